"""``dcp.msgpack`` (format v2, docs/protocol.md §8.4): DCP's global ``Metadata`` without pickle,
decoded strictly, and the checks that bind it to the manifest and to the rank files'
safetensors headers.  Pure: no I/O.

What a decoded document guarantees (checked here, once, for load, verify and copy alike; the
by-hand checker of protocol.md §7 checks the same):

* every key of §8.4 is present, no map names a key twice, ``format_version`` is 2 (a newer one
  is `FormatVersionError`);
* every tensor's chunks lie inside it and **cover it exactly once**: no gap, no overlap, and a
  tensor with elements has chunks (`check_cover`);
* every stored item (``storage_data``) is a chunk of a tensor (its byte length that chunk's
  elements times the element size) or a value, named once; every chunk and every value has
  exactly one stored item;
* ``planner_data`` names exactly the stored names, each the ``"."``-join of its key path, and
  ``tree`` (when present) is well formed and its leaves are exactly the stored names.

`check_locations` binds the items to the manifest (each item one chunk of a rank file, a
rank file's chunks its header and then its items) and `check_rank_header` binds a rank
file's safetensors header to them (the same names, dtypes, shapes and offsets): the header and
``dcp.msgpack`` must agree, and a reader uses ``dcp.msgpack``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ckptfs.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError
from ckptfs.format.entries import ReferencedFile
from ckptfs.format.incremental import references_of
from ckptfs.format.layout import check_relpath
from ckptfs.format.limits import MAX_DEPTH, MAX_HEADER_BYTES
from ckptfs.format.manifest import Manifest, unique_pairs
from ckptfs.format.serialize import dtype_code, supported_dtypes
from ckptfs.format.sharded import (
    METADATA_NAME,
    METADATA_SCHEMA,
    SHARDED_FORMAT_VERSION,
    ChunkedFileEntry,
    check_version,
    element_size,
    item_name,
    tensor_code,
    unpack_document,
)
from ckptfs.format.sharded_tree import check_skeleton

if TYPE_CHECKING:  # importing torch.distributed.checkpoint costs ~1 s: only when used
    from torch.distributed.checkpoint.metadata import Metadata

#: ``dtype`` names of ``dcp.msgpack`` (the torch attribute name) -> the safetensors dtype code
#: the rank files' headers and the value documents use (§8.4, exactly this table).
DTYPE_NAMES: dict[str, str] = {str(d).removeprefix("torch."): dtype_code(d)
                               for d in supported_dtypes()}
#: Keys every ``dcp.msgpack`` and every tensor entry of it must have.
METADATA_KEYS = frozenset({"schema", "format_version", "version", "state_dict_metadata",
                           "planner_data", "storage_data", "storage_meta", "tree", "extra"})
TENSOR_KEYS = frozenset({"kind", "dtype", "size", "requires_grad", "memory_format",
                         "pin_memory", "chunks"})

_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format,
                   "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


@dataclass(frozen=True)
class ItemLocation:
    """Where one stored DCP item lives: ``length`` bytes at ``offset`` of ``path`` (a manifest
    path).  The item's bytes are exactly one chunk of that file."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class StoredItem:
    """One stored item, as ``dcp.msgpack`` describes it: a tensor chunk (``offsets`` in the
    tensor) or a value document (``offsets`` None, code ``U8``, shape ``(length,)``)."""

    fqn: str
    offsets: tuple[int, ...] | None
    path: str
    offset: int
    length: int
    code: str
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        """Its entry name in the rank file's safetensors header."""
        return item_name(self.fqn, self.offsets)


@dataclass
class DcpDocument:
    """The content of ``dcp.msgpack``: DCP's Metadata, plus (for ``store.save``) the tree of
    the user's state, so a full load rebuilds it exactly (int keys, tuples); ``items``: every
    stored item (decoded documents only)."""

    metadata: Metadata
    tree: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    items: list[StoredItem] = field(default_factory=list)


def encode_metadata(doc: DcpDocument) -> bytes:
    """Encode DCP's Metadata without pickle.  Raises `UnsupportedValueError` for
    planner data or storage data that is not plain (a custom planner's objects)."""
    import msgpack
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
    """Decode ``dcp.msgpack`` into DCP's Metadata with every check of the module docstring.
    Typed errors only: `FormatVersionError`, `UnsafeCheckpointError` (msgpack
    extension types, a path leaving the checkpoint), else `CorruptCheckpointError`;
    each names ``where``."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    raw = unpack_document(data, where)
    if not isinstance(raw, dict) or raw.get("schema") != METADATA_SCHEMA:
        raise CorruptCheckpointError(f"{where}: not a ckptfs DCP metadata document")
    check_version(raw.get("format_version"), where, "metadata")

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: malformed DCP metadata ({what})")

    missing = sorted(METADATA_KEYS - set(raw))
    if missing:
        raise bad(f"lacks {missing}")
    entries = raw["state_dict_metadata"]
    if not isinstance(entries, dict):
        raise bad("state_dict_metadata is not a map")
    sdm: dict[str, Any] = {}
    chunk_items: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]] = {}
    values: set[str] = set()
    for fqn, e in entries.items():
        if not isinstance(fqn, str) or not isinstance(e, dict):
            raise bad(f"entry {fqn!r:.80}")
        if e.get("kind") == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            values.add(fqn)
            continue
        if e.get("kind") != "tensor" or not set(e) >= TENSOR_KEYS:
            raise bad(f"entry {fqn!r:.80}: kind {e.get('kind')!r:.20}, or a tensor key missing")
        code = DTYPE_NAMES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if code is None:
            raise bad(f"tensor {fqn!r:.80}: dtype {e['dtype']!r:.40} is not a dtype name of §8.4")
        flags = (e["requires_grad"], e["pin_memory"])
        if not all(isinstance(f, bool) for f in flags) or \
                not isinstance(e["memory_format"], str) or \
                e["memory_format"] not in _MEMORY_FORMATS:
            raise bad(f"tensor {fqn!r:.80}: requires_grad, pin_memory or memory_format")
        size = _ints(e["size"], f"tensor {fqn!r:.80}: size", bad)
        raw_chunks = e["chunks"]
        if not isinstance(raw_chunks, list):
            raise bad(f"tensor {fqn!r:.80}: chunks")
        chunks = []
        for c in raw_chunks:
            if not isinstance(c, list) or len(c) != 2:
                raise bad(f"tensor {fqn!r:.80}: a chunk is not [offsets, sizes]")
            off = _ints(c[0], f"tensor {fqn!r:.80}: chunk offsets", bad)
            sizes = _ints(c[1], f"tensor {fqn!r:.80}: chunk sizes", bad)
            if (fqn, tuple(off)) in chunk_items:
                raise bad(f"tensor {fqn!r:.80}: two chunks at offsets {off}")
            chunk_items[(fqn, tuple(off))] = (code, tuple(sizes))
            chunks.append((off, sizes))
        check_cover(fqn, size, chunks, where)
        dtype = getattr(torch, e["dtype"])
        props = TensorProperties(dtype=dtype, requires_grad=e["requires_grad"],
                                 memory_format=_MEMORY_FORMATS[e["memory_format"]],
                                 pin_memory=e["pin_memory"])
        sdm[fqn] = TensorStorageMetadata(
            props, torch.Size(size),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    storage: dict[Any, ItemLocation] = {}
    items: list[StoredItem] = []
    raw_storage = raw["storage_data"]
    if not isinstance(raw_storage, list):
        raise bad("storage_data is not an array")
    for entry in raw_storage:
        if not isinstance(entry, list) or len(entry) != 5:
            raise bad(f"storage_data entry {entry!r:.80}")
        fqn, offsets, path, off, length = entry
        if not isinstance(fqn, str) or not _is_int(off) or not _is_int(length) or off < 0 \
                or length < 0:
            raise bad(f"storage_data entry {entry!r:.80}")
        try:
            path = check_relpath(path)
        except UnsafeCheckpointError as exc:  # '..', '/x', ...: name this document
            raise UnsafeCheckpointError(f"{where}: item {fqn!r:.80}: {exc}") from None
        key = None if offsets is None else tuple(_ints(offsets, "storage_data offsets", bad))
        index = MetadataIndex(fqn, None if key is None else list(key))
        if index in storage:
            raise bad(f"item {fqn!r:.80} at offsets {offsets!r:.40} is stored twice")
        if key is None:
            if fqn not in values:
                raise bad(f"stored value {fqn!r:.80} is not a value of state_dict_metadata")
            items.append(StoredItem(fqn, None, path, off, length, "U8", (length,)))
        else:
            found = chunk_items.get((fqn, key))
            if found is None:
                raise bad(f"stored item {fqn!r:.80} at offsets {list(key)} is not a chunk of "
                          "a tensor of state_dict_metadata")
            code, shape = found
            n = 1
            for d in shape:
                n *= d
            if length != n * element_size(code):
                raise bad(f"stored chunk {fqn!r:.80} at offsets {list(key)} is {length} B; "
                          f"{list(shape)} {code} is {n * element_size(code)} B")
            items.append(StoredItem(fqn, key, path, off, length, code, shape))
        storage[index] = ItemLocation(path, off, length)
    if len(items) != len(chunk_items) + len(values):
        stored = {(i.fqn, i.offsets) for i in items}
        lost = next(k for k in [*chunk_items, *((v, None) for v in values)] if k not in stored)
        raise bad(f"{lost[0]!r:.80}{'' if lost[1] is None else f' at offsets {list(lost[1])}'} "
                  "has no stored item")
    planner = raw["planner_data"]
    if planner is not None:
        if not isinstance(planner, dict) or set(planner) != set(sdm):
            raise bad("planner_data does not name exactly the stored names")
        for fqn, path_ in planner.items():
            if not isinstance(path_, list) or not path_ or not all(
                    isinstance(p, str) or _is_int(p) for p in path_) or \
                    ".".join(map(str, path_)) != fqn:
                raise bad(f"planner_data of {fqn!r:.80} is not a key path joining to it")
        planner = {k: tuple(v) for k, v in planner.items()}
    sm = None
    raw_meta = raw["storage_meta"]
    if raw_meta is not None:
        if not isinstance(raw_meta, dict) or not all(
                isinstance(raw_meta.get(k), (str, type(None))) for k in
                ("checkpoint_id", "save_id")) or not isinstance(raw_meta.get("modules", []),
                                                                 list) or \
                not all(isinstance(m, str) for m in raw_meta.get("modules", [])):
            raise bad("storage_meta")
        sm = StorageMeta(checkpoint_id=raw_meta.get("checkpoint_id"),
                         save_id=raw_meta.get("save_id"),
                         modules=[str(m) for m in raw_meta.get("modules", [])])
    version, extra = raw["version"], raw["extra"]
    if version is not None and not isinstance(version, str):
        raise bad("version")
    if not isinstance(extra, dict):
        raise bad("extra")
    tree = raw["tree"]
    if tree is not None:
        check_skeleton(tree, set(sdm), where=where)
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                  storage_meta=sm, version=version)
    return DcpDocument(md, tree, extra, items)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(v: Any, what: str, bad: Any) -> list[int]:
    if not isinstance(v, list) or len(v) > MAX_DEPTH or not all(_is_int(i) and i >= 0
                                                                 for i in v):
        raise bad(f"{what}: not a list of non-negative ints")
    return list(v)


def check_cover(fqn: str, size: list[int], chunks: list[tuple[list[int], list[int]]],
                where: str) -> None:
    """Raise `CorruptCheckpointError` unless ``chunks`` (offsets, sizes) lie inside a
    tensor of ``size`` and cover each of its elements exactly once.  Checked as: every chunk
    inside, the chunks' element counts summing to the tensor's, and no two chunks with
    elements intersecting (a sweep along the dimension with the most distinct offsets)."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: the chunks of tensor {fqn!r:.80} {what}")

    total = 1
    for d in size:
        total *= d
    covered = 0
    boxes: list[tuple[list[int], list[int]]] = []
    for off, sizes in chunks:
        if len(off) != len(size) or len(sizes) != len(size):
            raise bad(f"have {len(off)}/{len(sizes)} dimensions, the tensor {len(size)}")
        if any(o + s > full for o, s, full in zip(off, sizes, size, strict=True)):
            raise bad(f"include one outside it (offsets {off}, sizes {sizes}, tensor {size})")
        n = 1
        for s in sizes:
            n *= s
        if n:
            boxes.append((off, sizes))
        covered += n
    pair = _intersecting(boxes)
    if pair is not None:
        raise bad(f"overlap (offsets {pair[0][0]} and {pair[1][0]})")
    if covered != total:
        raise bad(f"cover {covered} of its {total} elements: a gap" if chunks else
                  f"are missing: none stored for its {total} elements")


def _intersecting(boxes: list[tuple[list[int], list[int]]]
                  ) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]] | None:
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    if ndim == 0:
        return boxes[0], boxes[1]  # two 0-d chunks, each holding the one element
    d = max(range(ndim), key=lambda k: len({b[0][k] for b in boxes}))
    active: list[tuple[list[int], list[int]]] = []
    for b in sorted(boxes, key=lambda b: b[0][d]):
        active = [a for a in active if a[0][d] + a[1][d] > b[0][d]]
        for a in active:
            if all(a[0][k] < b[0][k] + b[1][k] and b[0][k] < a[0][k] + a[1][k]
                   for k in range(ndim)):
                return a, b
        active.append(b)
    return None


def check_locations(doc: DcpDocument, manifest: Manifest, *, where: str) -> None:
    """Every stored item is exactly one chunk of a rank file of ``manifest`` (or of a reference,
    format v4), after that file's header chunk; each rank file's (and reference's) chunks are
    its header and then one per item stored in it."""
    files = {e.path: e for e in manifest.files if isinstance(e, ChunkedFileEntry)}
    files.update({r.path: manifest.chunked(r.path) for r in references_of(manifest)})
    per_file: dict[str, int] = {}
    for item in doc.items:
        e = files.get(item.path)
        if e is None or item.path == METADATA_NAME or not e.chunks or \
                item.offset < e.chunks[0].length or \
                e.chunk_at(item.offset, item.length) is None:
            raise CorruptCheckpointError(
                f"{where}: item {item.fqn!r:.80} is stored at {item.path}@{item.offset}+"
                f"{item.length}, which is not a chunk of a rank file in the manifest")
        per_file[item.path] = per_file.get(item.path, 0) + 1
    for path, e in files.items():
        if path != METADATA_NAME and len(e.chunks) != 1 + per_file.get(path, 0):
            raise CorruptCheckpointError(
                f"{where}: {path} has {len(e.chunks)} chunks for {per_file.get(path, 0)} "
                "stored items (its chunks must be its header and then one per item)")


def items_by_file(doc: DcpDocument) -> dict[str, list[StoredItem]]:
    out: dict[str, list[StoredItem]] = {}
    for item in doc.items:
        out.setdefault(item.path, []).append(item)
    return out


def check_rank_header(head: bytes | bytearray | memoryview, entry: ChunkedFileEntry,
                      items: list[StoredItem], *, where: str) -> None:
    """``head`` (the header chunk of the rank file ``entry``, digest already checked) is a
    safetensors header (§2.4 bounds, no key named twice) whose ``__metadata__`` names the
    file's rank and whose entries are exactly ``items``: the same names, dtypes, shapes and
    offsets as ``dcp.msgpack``.  For a reference (format v4, a `ReferencedFile`: a
    rank file of another attempt), each of ``items`` must be the header's entry of its name
    (same dtype, shape and offsets); the file holds others this checkpoint does not read.
    `CorruptCheckpointError` naming the file otherwise."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: safetensors header {what}")

    header = _parse_header(head, bad)
    meta = header.pop("__metadata__", None)
    if isinstance(entry, ReferencedFile):
        # A rank file of another attempt (format v4): it holds more items than this checkpoint
        # reads there; each item dcp.msgpack places in it must be the header's entry of that
        # name, with the same dtype, shape and offsets.
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise bad(f"__metadata__ {meta!r:.80} is not a map of strings")
        _check_entries(header, {i.name: i for i in items}, len(head), bad)
        return
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()) or \
            meta.get("rank") != str(entry.rank):
        raise bad(f"__metadata__ {meta!r:.80} does not name rank {entry.rank}")
    want = {i.name: i for i in items}
    if set(header) != set(want):
        extra = sorted(set(header) - set(want))[:3]
        lost = sorted(set(want) - set(header))[:3]
        raise bad(f"and dcp.msgpack list different items (only in the header: {extra}; only "
                  f"in dcp.msgpack: {lost})")
    _check_entries(header, want, len(head), bad)


def _parse_header(head: bytes | bytearray | memoryview, bad: Any) -> dict[str, Any]:
    head = bytes(head)
    if len(head) < 8:
        raise bad("shorter than 8 bytes")
    (hlen,) = struct.unpack("<Q", head[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen != len(head):
        raise bad(f"length {hlen} does not fill the header chunk ({len(head)} B)")
    try:
        header = json.loads(head[8:].decode("utf-8"), object_pairs_hook=unique_pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("is not an object")
    return header


def _check_entries(header: dict[str, Any], want: dict[str, StoredItem], head_len: int,
                   bad: Any) -> None:
    """Each item of ``want`` is the header's entry of its name: same dtype, shape, offsets."""
    for name, i in want.items():
        if name not in header:
            raise bad(f"has no entry {name!r:.80}, which dcp.msgpack places in this file")
        e = header[name]
        begin = i.offset - head_len
        try:
            dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        except (KeyError, TypeError):
            raise bad(f"entry {name!r:.80} is malformed") from None
        if dtype != i.code or shape != list(i.shape):
            raise bad(f"says {name!r:.80} is {dtype!r:.20} {shape!r:.80}, dcp.msgpack says "
                      f"{i.code} {list(i.shape)}: the two must agree")
        if offsets != [begin, begin + i.length]:
            raise bad(f"places {name!r:.80} at {offsets!r:.60}, dcp.msgpack at "
                      f"{[begin, begin + i.length]}")
