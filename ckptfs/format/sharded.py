"""Format v2, the sharded layout: names, chunk digests, the v2 manifest, and the pickle-free
encodings of DCP's global metadata and of non-tensor values.  Pure: no I/O, no collectives.

A sharded checkpoint is written by several ranks into one attempt::

    step-000000001000/
      COMPLETE                            the v1 marker, unchanged: binds MANIFEST.json by sha256
      a-20261130T012500Z-3f9c2a1b.../
        MANIFEST.json                     format_version 2, layout "sharded": every file with
                                          its size, its chunk list and a digest of that list
        dcp.msgpack                       DCP's global Metadata (tensors, chunks, where each
                                          stored item lives), msgpack: never pickle
        rank-00000/data-0.safetensors     rank 0's write items: header chunk, then one chunk
        rank-00001/data-0.safetensors     per item (a tensor shard, or an encoded value)

Every file is tiled by *chunks* (offset, length, digest): the safetensors header is one chunk,
each write item's bytes another.  Each byte is hashed once, into its chunk's digest; the file's
digest is the digest of its chunk list (:func:`chunk_list_digest`), so no second pass over the
bytes is needed, and a ranged reader checks exactly the chunks it reads.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from ckptfs.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format.hashing import digest_bytes, parse_digest
from ckptfs.format.layout import check_relpath, is_attempt_name
from ckptfs.format.limits import MAX_DEPTH, MAX_FILE_SIZE, MAX_FILES
from ckptfs.format.manifest import MANIFEST_SCHEMA, FileEntry, Manifest
from ckptfs.format.serialize import (
    CODE_DTYPES,
    Flattener,
    build_tree,
    dtype_code,
    tensor_memoryview,
)

if TYPE_CHECKING:  # importing torch.distributed.checkpoint costs ~1 s: only when used
    from torch.distributed.checkpoint.metadata import Metadata

SHARDED_FORMAT_VERSION = 2
SHARDED_LAYOUT = "sharded"
METADATA_NAME = "dcp.msgpack"
METADATA_SCHEMA = "ckptfs.dcp"
VALUE_SCHEMA = "ckptfs.value"


def rank_file_name(rank: int, index: int = 0) -> str:
    """``rank-00003/data-0.safetensors``: the data file ``index`` of ``rank``."""
    return f"rank-{rank:05d}/data-{index}.safetensors"


# ----------------------------------------------------------------------------------------------
# Chunks and their digests


@dataclass(frozen=True)
class Chunk:
    """``length`` bytes at ``offset`` of a file, whose digest (hex, the file's algorithm) is
    ``digest``."""

    offset: int
    length: int
    digest: str


def chunk_list_text(chunks: Iterable[Chunk]) -> bytes:
    """The canonical text a chunked file's digest is taken over: one ``"<offset> <length>
    <hex>\\n"`` line per chunk, in file order (docs/protocol.md, format v2)."""
    return "".join(f"{c.offset} {c.length} {c.digest}\n" for c in chunks).encode("ascii")


def chunk_list_digest(algorithm: str, chunks: Iterable[Chunk]) -> str:
    """``"<algorithm>:<hex>"`` of :func:`chunk_list_text`: the file digest of format v2."""
    return digest_bytes(algorithm, chunk_list_text(chunks))


@dataclass(frozen=True)
class ChunkedFileEntry(FileEntry):
    """A v2 manifest entry: ``digest`` is the digest of the chunk list, which tiles the file."""

    chunks: tuple[Chunk, ...] = ()
    rank: int | None = None

    def chunk_at(self, offset: int, length: int) -> Chunk | None:
        """The chunk that starts at ``offset`` and is ``length`` long, or ``None``."""
        lo, hi = 0, len(self.chunks)
        while lo < hi:  # chunks are sorted by offset (checked on decode)
            mid = (lo + hi) // 2
            if self.chunks[mid].offset < offset:
                lo = mid + 1
            else:
                hi = mid
        while lo < len(self.chunks) and self.chunks[lo].offset == offset:
            c = self.chunks[lo]  # several only where zero-length chunks share the offset
            if c.length == length:
                return c
            lo += 1
        return None


def make_entry(path: str, size: int, algorithm: str, chunks: list[Chunk],
               rank: int | None) -> ChunkedFileEntry:
    """The manifest entry of a chunked file, after checking that ``chunks`` tile it."""
    check_tiling(chunks, size, where=path)
    return ChunkedFileEntry(path, size, chunk_list_digest(algorithm, chunks), tuple(chunks), rank)


def check_tiling(chunks: list[Chunk] | tuple[Chunk, ...], size: int, *, where: str) -> None:
    pos = 0
    for c in chunks:
        if c.offset != pos or c.length < 0:
            raise CorruptCheckpointError(
                f"{where}: chunks do not tile the file (chunk at {c.offset}, expected {pos})")
        pos += c.length
    if pos != size:
        raise CorruptCheckpointError(f"{where}: chunks cover {pos} B of a {size} B file")


# ----------------------------------------------------------------------------------------------
# The v2 manifest


@dataclass(frozen=True)
class ShardedManifest(Manifest):
    """The manifest of a sharded checkpoint (format v2)."""

    world_size: int = 0
    format_version: int = SHARDED_FORMAT_VERSION

    def chunked(self, path: str) -> ChunkedFileEntry:
        entry = self.file(path)
        if not isinstance(entry, ChunkedFileEntry):  # pragma: no cover - decode guarantees
            raise KeyError(path)
        return entry

    def to_bytes(self) -> bytes:
        files = []
        for e in self.files:
            if not isinstance(e, ChunkedFileEntry):
                raise TypeError(f"{e.path}: a v2 manifest lists chunked files only")
            files.append({"path": e.path, "size": e.size, "digest": e.digest,
                          "algorithm": e.algorithm, "rank": e.rank,
                          "chunks": [[c.offset, c.length, c.digest] for c in e.chunks]})
        doc = {
            "schema": MANIFEST_SCHEMA, "format_version": SHARDED_FORMAT_VERSION,
            "layout": SHARDED_LAYOUT, "step": self.step, "attempt": self.attempt,
            "created": self.created, "hash_algorithm": self.hash_algorithm,
            "world_size": self.world_size, "files": files, "metadata": self.metadata,
        }
        return (json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
                + "\n").encode()

    @classmethod
    def from_doc(cls, doc: dict[str, Any], *, where: str) -> ShardedManifest:
        try:
            if doc.get("layout") != SHARDED_LAYOUT:
                raise TypeError("layout")
            step, attempt, raw_files = doc["step"], doc["attempt"], doc["files"]
            world = doc.get("world_size", 0)
            if not _is_int(step) or step < 0 or not _is_int(world) or world < 0:
                raise TypeError("step/world_size")
            if not isinstance(attempt, str) or not is_attempt_name(attempt):
                raise TypeError("attempt")
            if not isinstance(raw_files, list) or len(raw_files) > MAX_FILES:
                raise TypeError("files")
            files: list[FileEntry] = []
            seen: set[str] = set()
            for raw in raw_files:
                files.append(_decode_entry(raw, seen, where))
            metadata, created = doc.get("metadata", {}), doc.get("created", "")
            algo = doc.get("hash_algorithm", "")
            if not isinstance(metadata, dict) or not isinstance(created, str) or not isinstance(
                    algo, str):
                raise TypeError("metadata/created/hash_algorithm")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"{where}: malformed v2 manifest ({type(exc).__name__}: {exc})") from None
        return cls(step, attempt, tuple(files), created, algo, metadata, world_size=world)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _decode_entry(raw: Any, seen: set[str], where: str) -> ChunkedFileEntry:
    path = check_relpath(raw["path"])
    size = raw["size"]
    if not _is_int(size) or not 0 <= size <= MAX_FILE_SIZE:
        raise UnsafeCheckpointError(f"{where}: file {path!r} has bad size {size!r}")
    if path in seen:
        raise UnsafeCheckpointError(f"{where}: file {path!r} listed twice")
    seen.add(path)
    algo, _ = parse_digest(raw["digest"])
    if raw.get("algorithm", algo) != algo:
        raise TypeError("algorithm")
    rank = raw.get("rank")
    if rank is not None and (not _is_int(rank) or rank < 0):
        raise TypeError("rank")
    raw_chunks = raw["chunks"]
    if not isinstance(raw_chunks, list):
        raise TypeError("chunks")
    chunks = []
    for rc in raw_chunks:
        if (not isinstance(rc, list) or len(rc) != 3 or not _is_int(rc[0])
                or not _is_int(rc[1])):
            raise TypeError("chunk")
        parse_digest(f"{algo}:{rc[2]}")
        chunks.append(Chunk(rc[0], rc[1], rc[2]))
    check_tiling(chunks, size, where=f"{where}: {path}")
    entry = ChunkedFileEntry(path, size, raw["digest"], tuple(chunks), rank)
    if chunk_list_digest(algo, chunks) != entry.digest:
        raise CorruptCheckpointError(
            f"{where}: file {path!r}: its digest does not match its chunk list")
    return entry


# ----------------------------------------------------------------------------------------------
# A rank's data file: a safetensors file whose header is known before any data is resolved


@dataclass(frozen=True)
class PlannedItem:
    """One entry of a rank's data file."""

    name: str        # safetensors entry name: "<fqn>@<offsets>" or "<fqn>@bytes"
    dtype: str       # safetensors dtype code
    shape: tuple[int, ...]
    nbytes: int


def item_name(fqn: str, offsets: Iterable[int] | None) -> str:
    """Entry name of a write item: unique per (fqn, offsets) because the suffix after the last
    ``@`` never contains ``@``."""
    if offsets is None:
        return f"{fqn}@bytes"
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def plan_header(items: list[PlannedItem], rank: int) -> tuple[bytes, list[int]]:
    """The file's first chunk (8-byte length + JSON header padded to 8 bytes) and each item's
    offset in the file, in the order given."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": "ckptfs",
                                               "rank": str(rank)}}
    pos = 0
    for it in items:
        header[it.name] = {"dtype": it.dtype, "shape": list(it.shape),
                           "data_offsets": [pos, pos + it.nbytes]}
        pos += it.nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    prefix = struct.pack("<Q", len(hbytes)) + hbytes
    offsets = []
    pos = len(prefix)
    for it in items:
        offsets.append(pos)
        pos += it.nbytes
    return prefix, offsets


def element_size(code: str) -> int:
    return torch.empty((), dtype=CODE_DTYPES[code]).element_size()


def tensor_code(dtype: torch.dtype, where: str) -> str:
    """The safetensors code of ``dtype``, or :class:`UnsupportedValueError` naming ``where``."""
    try:
        return dtype_code(dtype)
    except KeyError:
        raise UnsupportedValueError(
            f"tensor {where!r} has dtype {dtype}, which safetensors cannot store") from None


# ----------------------------------------------------------------------------------------------
# Non-tensor values (DCP BYTE_IO items): ckptfs's tagged msgpack, never torch.save/pickle


def encode_value(value: Any, *, key: str) -> bytes:
    """Encode one non-tensor value of the state (an int, a list of param names, a tuple of
    betas...) with the v1 tagged tree; tensors inside it are stored inline.  Raises
    :class:`UnsupportedValueError` naming ``key`` for what the format cannot hold."""
    flat = Flattener()
    tree = flat.encode(value, (key,))
    tensors = []
    for t in flat.tensors:
        code = dtype_code(t.dtype)
        ct = t.detach().to("cpu").contiguous()
        tensors.append([code, list(ct.shape), bytes(tensor_memoryview(ct))])
    doc = {"schema": VALUE_SCHEMA, "format_version": SHARDED_FORMAT_VERSION, "tree": tree,
           "tensors": tensors}
    return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]


def decode_value(data: bytes | bytearray | memoryview, *, where: str) -> Any:
    """Decode :func:`encode_value` bytes; typed errors only, nothing is ever unpickled."""
    try:
        doc = _unpack(data, where)
    except CorruptCheckpointError:
        doc = None
    if not isinstance(doc, dict) or doc.get("schema") != VALUE_SCHEMA:
        raise CorruptCheckpointError(
            f"{where}: not a ckptfs value (written with torch.save/pickle by a planner that is "
            "not ckptfs's? ckptfs never unpickles)")
    raw = doc.get("tensors")
    if not isinstance(raw, list):
        raise CorruptCheckpointError(f"{where}: malformed value")
    tensors = []
    for r in raw:
        if (not isinstance(r, list) or len(r) != 3 or r[0] not in CODE_DTYPES
                or not isinstance(r[1], list) or not all(_is_int(d) and d >= 0 for d in r[1])
                or not isinstance(r[2], bytes)):
            raise CorruptCheckpointError(f"{where}: malformed tensor in value")
        dtype = CODE_DTYPES[r[0]]
        n = 1
        for d in r[1]:
            n *= d
        if n * element_size(r[0]) != len(r[2]):
            raise CorruptCheckpointError(f"{where}: tensor in value has the wrong byte length")
        t = torch.frombuffer(bytearray(r[2]), dtype=dtype) if r[2] else torch.empty(0, dtype=dtype)
        tensors.append(t.reshape(r[1]))
    return build_tree(doc.get("tree"), tensors, where=where)


def _unpack(data: bytes | bytearray | memoryview, where: str) -> Any:
    def no_ext(code: int, payload: bytes) -> Any:
        raise UnsafeCheckpointError(f"{where}: msgpack extension type {code} is not allowed")

    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=False, ext_hook=no_ext,
                               use_list=True)
    except UnsafeCheckpointError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            RecursionError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{where}: not valid msgpack ({type(exc).__name__}: {str(exc)[:120]})") from None


# ----------------------------------------------------------------------------------------------
# DCP's global Metadata, as msgpack (stock DCP pickles it)


@dataclass(frozen=True)
class ItemLocation:
    """Where one stored DCP item lives: ``length`` bytes at ``offset`` of ``path`` (a manifest
    path).  The item's bytes are exactly one chunk of that file."""

    path: str
    offset: int
    length: int


_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format,
                   "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


@dataclass
class DcpDocument:
    """The content of ``dcp.msgpack``: DCP's Metadata, plus (for ``store.save``) the tree of
    the user's state, so a full load rebuilds it exactly (int keys, tuples)."""

    metadata: Metadata
    tree: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def encode_metadata(doc: DcpDocument) -> bytes:
    """Encode DCP's Metadata without pickle.  Raises :class:`UnsupportedValueError` for
    planner data or storage data that is not plain (a custom planner's objects)."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    md = doc.metadata
    entries: dict[str, Any] = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, BytesStorageMetadata):
            entries[fqn] = {"kind": "bytes"}
            continue
        if not isinstance(sm, TensorStorageMetadata):
            raise UnsupportedValueError(f"{fqn!r}: unknown DCP storage metadata {type(sm)}")
        p = sm.properties
        if p.layout != torch.strided:
            raise UnsupportedValueError(f"tensor {fqn!r} has layout {p.layout}; convert it "
                                        "with .to_dense()")
        tensor_code(p.dtype, fqn)
        fmt = next((k for k, v in _MEMORY_FORMATS.items() if v == p.memory_format),
                   "contiguous_format")
        entries[fqn] = {"kind": "tensor", "dtype": str(p.dtype).removeprefix("torch."),
                        "size": list(sm.size), "requires_grad": bool(p.requires_grad),
                        "memory_format": fmt, "pin_memory": bool(p.pin_memory),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in sm.chunks]}
    planner: Any = None
    if md.planner_data is not None:
        if not isinstance(md.planner_data, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (tuple, list))
                and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v)
                for k, v in md.planner_data.items()):
            raise UnsupportedValueError(
                "the planner's planner_data is not a flatten mapping (fqn -> path of str/int); "
                "ckptfs stores metadata without pickle: use ckptfs.dcp.SavePlanner")
        planner = {k: list(v) for k, v in md.planner_data.items()}
    storage = []
    for index, loc in (md.storage_data or {}).items():
        if not isinstance(index, MetadataIndex) or not isinstance(loc, ItemLocation):
            raise UnsupportedValueError("storage_data must map MetadataIndex to ItemLocation")
        storage.append([index.fqn, None if index.offset is None else list(index.offset),
                        loc.path, loc.offset, loc.length])
    sm_doc = None
    if md.storage_meta is not None:
        s = md.storage_meta
        sm_doc = {"checkpoint_id": None if s.checkpoint_id is None else str(s.checkpoint_id),
                  "save_id": s.save_id, "modules": [str(m) for m in s.modules]}
    out = {"schema": METADATA_SCHEMA, "format_version": SHARDED_FORMAT_VERSION,
           "version": md.version, "state_dict_metadata": entries, "planner_data": planner,
           "storage_data": storage, "storage_meta": sm_doc, "tree": doc.tree,
           "extra": doc.extra}
    try:
        return msgpack.packb(out, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as exc:
        raise UnsupportedValueError(f"DCP metadata cannot be encoded as msgpack: {exc}") from exc


def decode_metadata(data: bytes | bytearray | memoryview, *, where: str) -> DcpDocument:
    """Decode ``dcp.msgpack`` into DCP's Metadata; strict, typed errors only."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    raw = _unpack(data, where)
    if not isinstance(raw, dict) or raw.get("schema") != METADATA_SCHEMA:
        raise CorruptCheckpointError(f"{where}: not a ckptfs DCP metadata document")
    if raw.get("format_version") != SHARDED_FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: metadata format {raw.get('format_version')!r}; this ckptfs reads "
            f"{SHARDED_FORMAT_VERSION}: upgrade ckptfs")
    try:
        sdm: dict[str, Any] = {}
        for fqn, e in raw["state_dict_metadata"].items():
            if not isinstance(fqn, str) or not isinstance(e, dict):
                raise TypeError("entry")
            if e["kind"] == "bytes":
                sdm[fqn] = BytesStorageMetadata()
                continue
            if e["kind"] != "tensor":
                raise TypeError("kind")
            dtype = getattr(torch, str(e["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise TypeError("dtype")
            tensor_code(dtype, fqn)
            props = TensorProperties(dtype=dtype, requires_grad=bool(e["requires_grad"]),
                                     memory_format=_MEMORY_FORMATS[e["memory_format"]],
                                     pin_memory=bool(e["pin_memory"]))
            chunks = [ChunkStorageMetadata(torch.Size(_ints(o)), torch.Size(_ints(s)))
                      for o, s in e["chunks"]]
            sdm[fqn] = TensorStorageMetadata(props, torch.Size(_ints(e["size"])), chunks)
        planner = raw.get("planner_data")
        if planner is not None:
            if not isinstance(planner, dict):
                raise TypeError("planner_data")
            planner = {k: tuple(_path(v)) for k, v in planner.items()}
        storage: dict[Any, ItemLocation] = {}
        for fqn, offset, path, off, length in raw["storage_data"]:
            if not isinstance(fqn, str) or not _is_int(off) or not _is_int(length):
                raise TypeError("storage_data")
            if off < 0 or length < 0:
                raise TypeError("storage_data range")
            index = MetadataIndex(fqn, None if offset is None else _ints(offset))
            storage[index] = ItemLocation(check_relpath(path), off, length)
        sm = None
        if raw.get("storage_meta") is not None:
            s = raw["storage_meta"]
            sm = StorageMeta(checkpoint_id=s.get("checkpoint_id"), save_id=s.get("save_id"),
                             modules=[str(m) for m in s.get("modules", [])])
        version = raw.get("version")
        if version is not None and not isinstance(version, str):
            raise TypeError("version")
        extra = raw.get("extra") or {}
        if not isinstance(extra, dict):
            raise TypeError("extra")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{where}: malformed DCP metadata ({type(exc).__name__}: {exc})") from None
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                  storage_meta=sm, version=version)
    return DcpDocument(md, raw.get("tree"), extra)


def _ints(v: Any) -> list[int]:
    if not isinstance(v, list) or len(v) > MAX_DEPTH or not all(_is_int(i) and i >= 0
                                                                 for i in v):
        raise TypeError("expected a list of non-negative ints")
    return list(v)


def _path(v: Any) -> list[str | int]:
    if not isinstance(v, list) or not all(isinstance(p, str) or _is_int(p) for p in v):
        raise TypeError("planner path")
    return list(v)
