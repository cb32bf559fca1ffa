"""Format v2, the sharded layout: names, chunk digests, the v2 manifest, the rank files'
safetensors headers (as planned by the writer) and the pickle-free encoding of non-tensor
values.  ``dcp.msgpack`` (DCP's global metadata) and the checks binding it to the manifest and
to the headers are `ckptfs.format.sharded_metadata`.  Pure: no I/O, no collectives.

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
digest is the digest of its chunk list (`chunk_list_digest`), so no second pass over the
bytes is needed, and a ranged reader checks exactly the chunks it reads.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ckptfs.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format.hashing import ALGORITHMS, digest_bytes, parse_digest
from ckptfs.format.layout import MAX_STEP, check_relpath, is_attempt_name
from ckptfs.format.limits import MAX_FILE_SIZE, MAX_FILES
from ckptfs.format.manifest import (
    FILE_KEYS,
    MANIFEST_KEYS,
    MANIFEST_SCHEMA,
    FileEntry,
    Manifest,
    decode_store_checksums,
    store_checksums_doc,
    unique_pairs,
)
from ckptfs.format.serialize import (
    CODE_DTYPES,
    Flattener,
    build_tree,
    cpu_contiguous,
    dtype_code,
    tensor_memoryview,
)

SHARDED_FORMAT_VERSION = 2
SHARDED_LAYOUT = "sharded"
METADATA_NAME = "dcp.msgpack"
METADATA_SCHEMA = "ckptfs.dcp"
VALUE_SCHEMA = "ckptfs.value"
#: Keys every v2 manifest and every v2 file entry must have (docs/protocol.md §8.2).
V2_MANIFEST_KEYS = MANIFEST_KEYS | {"layout", "world_size"}
V2_FILE_KEYS = FILE_KEYS | {"rank", "chunks"}
#: Keys every value document must have (§8.5).
VALUE_KEYS = frozenset({"schema", "format_version", "tree", "tensors"})

_RANK_FILE = re.compile(r"rank-([0-9]{5,})/data-([0-9]+)\.safetensors")


def rank_file_name(rank: int, index: int = 0) -> str:
    """``rank-00003/data-0.safetensors``: the data file ``index`` of ``rank``."""
    return f"rank-{rank:05d}/data-{index}.safetensors"


def rank_of_file(path: str) -> int | None:
    """The rank whose data file ``path`` is, if ``path`` is exactly the name
    `rank_file_name` gives it (canonical: 5 or more digits, no extra zeros), else
    ``None``."""
    m = _RANK_FILE.fullmatch(path)
    if m is None:
        return None
    rank, index = int(m.group(1)), int(m.group(2))
    return rank if rank_file_name(rank, index) == path else None


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
    """``"<algorithm>:<hex>"`` of `chunk_list_text`: the file digest of format v2."""
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
               rank: int | None, *, store_checksums: tuple[tuple[str, str], ...] = ()
               ) -> ChunkedFileEntry:
    """The manifest entry of a chunked file, after checking that ``chunks`` tile it;
    ``store_checksums``: what the writer computed of the store's own checksums
    (docs/remote-verify.md)."""
    check_tiling(chunks, size, where=path)
    return ChunkedFileEntry(path, size, chunk_list_digest(algorithm, chunks), tuple(chunks), rank,
                            store_checksums=store_checksums)


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

    def as_doc(self) -> dict[str, Any]:
        """The manifest's JSON document (§8.2; a subclass adds its own keys)."""
        files = []
        for e in self.files:
            if not isinstance(e, ChunkedFileEntry):
                raise TypeError(f"{e.path}: a v2 manifest lists chunked files only")
            files.append({"path": e.path, "size": e.size, "digest": e.digest,
                          "algorithm": e.algorithm, "rank": e.rank,
                          "chunks": [[c.offset, c.length, c.digest] for c in e.chunks],
                          **store_checksums_doc(e)})
        return {
            "schema": MANIFEST_SCHEMA, "format_version": self.format_version,
            "layout": SHARDED_LAYOUT, "step": self.step, "attempt": self.attempt,
            "created": self.created, "hash_algorithm": self.hash_algorithm,
            "world_size": self.world_size, "files": files, "metadata": self.metadata,
        }

    def to_bytes(self) -> bytes:
        return (json.dumps(self.as_doc(), sort_keys=True, separators=(",", ":"),
                           allow_nan=False) + "\n").encode()

    @classmethod
    def from_doc(cls, doc: dict[str, Any], *, where: str) -> ShardedManifest:
        """Decode a v2 manifest (already parsed by the bounded JSON reader, schema and version
        checked): every key of §8.2 required, the algorithm known and the same in every
        digest, each chunk list tiling its file and bound by the file's digest, exactly one
        ``dcp.msgpack``, and every other file the canonical ``rank-NNNNN/data-K.safetensors``
        of its ``rank`` (``0 <= rank < world_size``).  Typed errors only."""
        try:
            missing = sorted(V2_MANIFEST_KEYS - set(doc))
            if missing:
                raise KeyError(f"v2 manifest lacks {missing}")
            if doc["layout"] != SHARDED_LAYOUT:
                raise TypeError(f"layout {doc['layout']!r:.40} is not {SHARDED_LAYOUT!r}")
            step, attempt, world = doc["step"], doc["attempt"], doc["world_size"]
            if not _is_int(step) or not 0 <= step <= MAX_STEP:
                raise TypeError(f"step {step!r:.40} is not an int in [0, {MAX_STEP}]")
            if not isinstance(attempt, str) or not is_attempt_name(attempt):
                raise TypeError(f"attempt {attempt!r:.80} is not an attempt name")
            if not _is_int(world) or world < 1:
                raise TypeError(f"world_size {world!r:.40} is not a positive int")
            algo = doc["hash_algorithm"]
            if algo not in ALGORITHMS:
                raise TypeError(f"unknown hash_algorithm {algo!r:.40}")
            metadata, created = doc["metadata"], doc["created"]
            if not isinstance(metadata, dict) or not isinstance(created, str):
                raise TypeError("'metadata' is not an object or 'created' not a string")
            raw_files = doc["files"]
            if not isinstance(raw_files, list) or len(raw_files) > MAX_FILES:
                raise TypeError(f"'files' is not a list of at most {MAX_FILES} entries")
            files: list[FileEntry] = []
            seen: set[str] = set()
            for raw in raw_files:
                files.append(_decode_entry(raw, seen, world, where))
            if METADATA_NAME not in seen:
                raise KeyError(f"no {METADATA_NAME} among the files")
        except Exception as exc:
            raise manifest_error(exc, where, "v2") from None
        return cls(step, attempt, tuple(files), created, algo, metadata, world_size=world)


def manifest_error(exc: Exception, where: str, version: str) -> Exception:
    """What a manifest decoder (formats v2-v4) raises for ``exc``: a typed ckptfs error
    (path, size, digest) named after the manifest ``where``, a malformed field as
    `CorruptCheckpointError`; anything else unchanged."""
    if isinstance(exc, CorruptCheckpointError):
        return exc if str(exc).startswith(where) else type(exc)(f"{where}: {exc}")
    if isinstance(exc, (KeyError, TypeError, ValueError, AttributeError)):
        return CorruptCheckpointError(
            f"{where}: malformed {version} manifest ({type(exc).__name__}: {exc})")
    return exc


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _decode_entry(raw: Any, seen: set[str], world: int, where: str) -> ChunkedFileEntry:
    if not isinstance(raw, dict):
        raise TypeError("a 'files' entry is not an object")
    missing = sorted(V2_FILE_KEYS - set(raw))
    if missing:
        raise KeyError(f"file entry lacks {missing}")
    path = check_relpath(raw["path"])
    size = raw["size"]
    if not _is_int(size) or not 0 <= size <= MAX_FILE_SIZE:
        raise UnsafeCheckpointError(f"{where}: file {path!r} has bad size {size!r}")
    if path in seen:
        raise UnsafeCheckpointError(f"{where}: file {path!r} listed twice")
    seen.add(path)
    algo, _ = parse_digest(raw["digest"])
    if raw["algorithm"] != algo:
        raise TypeError(f"file {path!r}: 'algorithm' differs from its digest's")
    rank = raw["rank"]
    if path == METADATA_NAME:
        if rank is not None:
            raise TypeError(f"file {path!r}: rank {rank!r:.20} (must be null)")
    elif not _is_int(rank) or rank_of_file(path) != rank or not 0 <= rank < world:
        raise TypeError(f"file {path!r} (rank {rank!r:.20}) is neither {METADATA_NAME} nor "
                        f"the rank-NNNNN/data-K.safetensors file of its rank (0 <= rank < "
                        f"world_size {world})")
    chunks = decode_chunks(raw["chunks"], algo, path)
    return bound_entry(path, size, raw["digest"], algo, chunks, rank, where=where,
                       store_checksums=decode_store_checksums(raw, path))


def decode_chunks(raw: Any, algo: str, path: str) -> list[Chunk]:
    """A manifest's chunk list, ``[[offset, length, hex], ...]`` (formats v2, v3, v4): each an
    array of two ints and a hex digest of ``algo`` (``TypeError``/``ValueError`` otherwise,
    which the manifest decoders turn into `CorruptCheckpointError`)."""
    if not isinstance(raw, list):
        raise TypeError(f"file {path!r}: 'chunks' is not a list")
    chunks = []
    for rc in raw:
        if (not isinstance(rc, list) or len(rc) != 3 or not _is_int(rc[0])
                or not _is_int(rc[1]) or not isinstance(rc[2], str)):
            raise TypeError(f"file {path!r}: a chunk is not [offset, length, hex]")
        parse_digest(f"{algo}:{rc[2]}")
        chunks.append(Chunk(rc[0], rc[1], rc[2]))
    return chunks


def bound_entry(path: str, size: int, digest: str, algo: str, chunks: list[Chunk],
                rank: int | None, *, where: str,
                store_checksums: tuple[tuple[str, str], ...] = ()) -> ChunkedFileEntry:
    """The manifest entry of a chunked file, after checking that ``chunks`` tile it and that
    ``digest`` is the digest of their list (`CorruptCheckpointError` naming ``where``)."""
    check_tiling(chunks, size, where=f"{where}: {path}")
    entry = ChunkedFileEntry(path, size, digest, tuple(chunks), rank,
                             store_checksums=store_checksums)
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
    """The safetensors code of ``dtype``, or `UnsupportedValueError` naming ``where``."""
    try:
        return dtype_code(dtype)
    except KeyError:
        raise UnsupportedValueError(
            f"tensor {where!r} has dtype {dtype}, which safetensors cannot store") from None


# ----------------------------------------------------------------------------------------------
# Non-tensor values (DCP BYTE_IO items): ckptfs's tagged msgpack, never torch.save/pickle


def encode_value(value: Any, *, key: str, path: tuple[Any, ...] | None = None) -> bytes:
    """Encode one non-tensor value of the state (an int, a list of param names, a tuple of
    betas...) with the v1 tagged tree; tensors inside it are stored inline.  Raises
    `UnsupportedValueError` naming its key path (``path``, the value's keys in the
    state; else ``key``, its DCP name) for what the format cannot hold."""
    flat = Flattener()
    tree = flat.encode(value, path or (key,))
    tensors = []
    for t in flat.tensors:
        code = dtype_code(t.dtype)
        ct = cpu_contiguous(t)
        tensors.append([code, list(ct.shape), bytes(tensor_memoryview(ct))])
    doc = {"schema": VALUE_SCHEMA, "format_version": SHARDED_FORMAT_VERSION, "tree": tree,
           "tensors": tensors}
    return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]


def decode_value(data: bytes | bytearray | memoryview, *, where: str) -> Any:
    """Decode a value document (§8.5): typed errors only, nothing is ever unpickled.  Every key
    of §8.5 is required, no map names a key twice, ``format_version`` is 2 (a newer one raises
    `FormatVersionError`), every inline tensor's bytes fit its dtype and shape."""
    try:
        doc = unpack_document(data, where)
    except UnsafeCheckpointError:
        raise
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{where}: not a ckptfs value document ({str(exc).removeprefix(where + ': ')}); "
            "written with torch.save/pickle by a planner that is not ckptfs's? ckptfs never "
            "unpickles") from None
    if not isinstance(doc, dict) or doc.get("schema") != VALUE_SCHEMA:
        raise CorruptCheckpointError(
            f"{where}: not a ckptfs value (written with torch.save/pickle by a planner that is "
            "not ckptfs's? ckptfs never unpickles)")
    missing = sorted(VALUE_KEYS - set(doc))
    if missing:
        raise CorruptCheckpointError(f"{where}: value document lacks {missing}")
    check_version(doc["format_version"], where, "value document")
    raw = doc["tensors"]
    if not isinstance(raw, list):
        raise CorruptCheckpointError(f"{where}: 'tensors' of the value is not a list")
    tensors = []
    for r in raw:
        if (not isinstance(r, list) or len(r) != 3 or not isinstance(r[0], str)
                or r[0] not in CODE_DTYPES
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
    return build_tree(doc["tree"], tensors, where=where)


def check_version(version: Any, where: str, what: str) -> None:
    """``format_version`` of a v2 document: 2; a newer int raises `FormatVersionError`
    (upgrade ckptfs), anything else `CorruptCheckpointError`."""
    if _is_int(version) and version > SHARDED_FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: {what} written by format version {version}; this ckptfs reads "
            f"{SHARDED_FORMAT_VERSION}: upgrade ckptfs")
    if version != SHARDED_FORMAT_VERSION or not _is_int(version):
        raise CorruptCheckpointError(f"{where}: {what} has format_version {version!r:.40}, "
                                     f"expected {SHARDED_FORMAT_VERSION}")


def unpack_document(data: bytes | bytearray | memoryview, where: str) -> Any:
    """A msgpack document of format v2 (``dcp.msgpack``, a value document): str or bin map
    keys only, no map naming a key twice, no extension types (`UnsafeCheckpointError`);
    anything else malformed is `CorruptCheckpointError` naming ``where``."""

    def no_ext(code: int, payload: bytes) -> Any:
        raise UnsafeCheckpointError(f"{where}: msgpack extension type {code} is not allowed")

    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, ext_hook=no_ext,
                               use_list=True, object_pairs_hook=unique_pairs)
    except UnsafeCheckpointError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            RecursionError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{where}: not valid msgpack ({type(exc).__name__}: {str(exc)[:120]})") from None
