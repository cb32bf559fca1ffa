"""Format v5, the ``rank-metadata`` feature (docs/protocol.md §9.7): the metadata of a sharded
checkpoint split so that each loading rank reads and decodes only what its load needs.  Pure:
the documents' encoders and strict, bounded decoders, the tensor layouts and their overlap
math, and the DCP ``Metadata`` a rank's load is planned over.  No I/O.

A v5 attempt holds, instead of v2's one ``dcp.msgpack`` and a manifest listing every chunk::

    MANIFEST.json                 format_version 5: the spec and the table blocks only, and
                                  ``rank_table`` (rows per block, rank files, their bytes)
    dcp-spec.msgpack              O(tensors): each tensor's dtype, size and layout (a grid of
                                  equal blocks with an owner progression, or explicit chunks),
                                  each value's rank, DCP's planner data, the state's tree
    rank-table/block-00000.bin    O(ranks), fixed width: per rank its file's size and digest
                                  (of its chunk list) and its index document's size and digest
    rank-00000/data-0.safetensors rank 0's items, exactly as in v2
    rank-00000/index.msgpack      rank 0's index: every item of its file (name, offsets,
                                  dtype, shape, place, chunk digest) and the header chunk

Binding: the marker binds the manifest; the manifest binds the spec and every table block by
digest; a block's row binds a rank's index document (size, digest) and its file (size, the
digest of its chunk list, which the index gives); each chunk's digest binds its bytes.  A
loading rank reads the manifest, the spec, the blocks holding the rows of the ranks whose
chunks overlap what it loads, and those ranks' index documents: nothing another rank needs.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from ckptfs.errors import CorruptCheckpointError, FormatVersionError, UnsupportedValueError
from ckptfs.format.entries import RANK_ROW_HEAD_BYTES, Chunk, chunk_list_digest, digest_width
from ckptfs.format.entries import rank_row_bytes as row_bytes
from ckptfs.format.features import PER_RANK as PER_RANK
from ckptfs.format.features import RANK_METADATA_FORMAT_VERSION
from ckptfs.format.hashing import ALGORITHMS
from ckptfs.format.layout import SPEC_NAME as SPEC_NAME
from ckptfs.format.layout import rank_file_name
from ckptfs.format.layout import rank_index_name as index_name
from ckptfs.format.layout import table_block_name as block_name
from ckptfs.format.limits import (
    MAX_DEPTH,
    MAX_FILE_SIZE,
    MAX_GRID_CELLS,
    MAX_RANK_INDEX_BYTES,
)
from ckptfs.format.serialize import CODE_DTYPES
from ckptfs.format.sharded import element_size, item_name, unpack_document
from ckptfs.format.sharded_metadata import (
    DTYPE_NAMES,
    DcpDocument,
    StoredItem,
)
from ckptfs.format.sharded_tree import check_skeleton
from ckptfs.format.tiling import summary, tiling_errors

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

SPEC_SCHEMA = "ckptfs.dcp-spec"
INDEX_SCHEMA = "ckptfs.rank-index"
#: Rows per table block a ckptfs writer uses (at most; the last block holds the rest).
DEFAULT_ROWS_PER_BLOCK = 128
SPEC_KEYS = frozenset({"schema", "format_version", "world_size", "version", "tensors", "values",
                       "planner_data", "storage_meta", "tree", "extra"})
SPEC_TENSOR_KEYS = frozenset({"dtype", "size", "requires_grad", "memory_format", "pin_memory",
                              "grid", "owners", "chunks", "empty"})
INDEX_KEYS = frozenset({"schema", "format_version", "rank", "file", "size", "algorithm",
                        "header", "items"})
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")
_ROW_HEAD = struct.Struct(">IBQQ")  # rank, flags, file size, index size
assert _ROW_HEAD.size == RANK_ROW_HEAD_BYTES


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


__all__ = ["SPEC_NAME", "block_name", "index_name", "row_bytes"]


def block_count(world: int, rows_per_block: int) -> int:
    return -(-world // rows_per_block)


def check_version(version: Any, where: str, what: str) -> None:
    """A v5 document's ``format_version``: 5; a newer int `FormatVersionError`."""
    if _is_int(version) and version > RANK_METADATA_FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: {what} written by format version {version}; this ckptfs reads "
            f"{RANK_METADATA_FORMAT_VERSION}: upgrade ckptfs")
    if not _is_int(version) or version != RANK_METADATA_FORMAT_VERSION:
        raise CorruptCheckpointError(f"{where}: {what} has format_version {version!r:.40}, "
                                     f"expected {RANK_METADATA_FORMAT_VERSION}")


def _ints(v: Any, what: str, where: str) -> list[int]:
    if not isinstance(v, list) or len(v) > MAX_DEPTH or not all(_is_int(i) and i >= 0
                                                                 for i in v):
        raise CorruptCheckpointError(f"{where}: {what} is not a list of non-negative ints")
    return list(v)


def _pack(doc: Any, what: str) -> bytes:
    try:
        return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as exc:
        raise UnsupportedValueError(f"{what} cannot be encoded as msgpack: {exc}") from exc


# ----------------------------------------------------------------------------------------------
# The table of rank files


@dataclass(frozen=True)
class RankRow:
    """One rank's row: ``has_file`` (a rank whose items other ranks stored writes nothing),
    its rank file's size and digest (``"algo:hex"`` of its chunk list), its index document's
    size and digest (``"algo:hex"`` of its bytes)."""

    rank: int
    has_file: bool
    file_size: int
    file_digest: str
    index_size: int
    index_digest: str

    @classmethod
    def empty(cls, rank: int, algorithm: str) -> RankRow:
        zero = f"{algorithm}:" + "00" * digest_width(algorithm)
        return cls(rank, False, 0, zero, 0, zero)


def encode_block(rows: list[RankRow], algorithm: str) -> bytes:
    """A table block: the rows, in rank order, each `row_bytes` wide."""
    out = bytearray()
    width = digest_width(algorithm)
    for r in rows:
        out += _ROW_HEAD.pack(r.rank, 1 if r.has_file else 0, r.file_size, r.index_size)
        for d in (r.file_digest, r.index_digest):
            algo, _, hexd = d.partition(":")
            raw = bytes.fromhex(hexd)
            if algo != algorithm or len(raw) != width:  # pragma: no cover - writer bug
                raise UnsupportedValueError(f"rank {r.rank}: digest {d!r:.80} is not {algorithm}")
            out += raw
    return bytes(out)


def decode_block(data: bytes | bytearray | memoryview, algorithm: str, first: int, count: int,
                 *, where: str) -> list[RankRow]:
    """The rows of ranks ``first .. first + count - 1`` from their block (its size and digest
    already checked against the manifest): each row's rank is its position; a row without a
    file has sizes 0 and zero digests; sizes within the format's bounds."""
    width = digest_width(algorithm)
    step = row_bytes(algorithm)
    if len(data) != count * step:
        raise CorruptCheckpointError(f"{where}: {len(data)} B, expected {count} rows of {step} B")
    out = []
    view = memoryview(bytes(data))
    for i in range(count):
        row = view[i * step:(i + 1) * step]
        rank, flags, fsize, isize = _ROW_HEAD.unpack(row[:_ROW_HEAD.size])
        fd = bytes(row[_ROW_HEAD.size:_ROW_HEAD.size + width]).hex()
        idg = bytes(row[_ROW_HEAD.size + width:]).hex()
        if rank != first + i or flags not in (0, 1):
            raise CorruptCheckpointError(
                f"{where}: row {i} names rank {rank} with flags {flags} (expected rank "
                f"{first + i}, flags 0 or 1)")
        if flags == 0 and (fsize or isize or fd.strip("0") or idg.strip("0")):
            raise CorruptCheckpointError(f"{where}: rank {rank} has no file but sizes or digests")
        if fsize > MAX_FILE_SIZE or isize > MAX_RANK_INDEX_BYTES:
            raise CorruptCheckpointError(
                f"{where}: rank {rank} declares a {fsize} B file or a {isize} B index (at most "
                f"{MAX_FILE_SIZE} and {MAX_RANK_INDEX_BYTES})")
        if flags == 1 and isize == 0:
            raise CorruptCheckpointError(f"{where}: rank {rank} has an empty index document")
        out.append(RankRow(rank, flags == 1, fsize, f"{algorithm}:{fd}", isize,
                           f"{algorithm}:{idg}"))
    return out


# ----------------------------------------------------------------------------------------------
# A rank's index document


@dataclass(frozen=True)
class IndexItem:
    """One item of a rank file: a tensor chunk (``offsets``) or a value (``None``)."""

    fqn: str
    offsets: tuple[int, ...] | None
    code: str
    shape: tuple[int, ...]
    offset: int
    length: int
    digest: str  # hex

    @property
    def name(self) -> str:
        return item_name(self.fqn, self.offsets)

    def stored(self, path: str) -> StoredItem:
        return StoredItem(self.fqn, self.offsets, path, self.offset, self.length, self.code,
                          self.shape)


@dataclass(frozen=True)
class RankIndex:
    """A rank's index document: its file's header chunk and items, in file order."""

    rank: int
    size: int
    algorithm: str
    header: Chunk
    items: tuple[IndexItem, ...]

    @property
    def file(self) -> str:
        return rank_file_name(self.rank)

    @property
    def chunks(self) -> list[Chunk]:
        """The rank file's chunk list (§8.1): its header, then one chunk per item."""
        return [self.header, *(Chunk(i.offset, i.length, i.digest) for i in self.items)]

    def find(self, fqn: str, offsets: tuple[int, ...] | None) -> IndexItem | None:
        by: dict[tuple[str, tuple[int, ...] | None], IndexItem] | None = \
            self.__dict__.get("_by")
        if by is None:
            by = {(i.fqn, i.offsets): i for i in self.items}
            object.__setattr__(self, "_by", by)
        return by.get((fqn, offsets))


def encode_index(index: RankIndex) -> bytes:
    doc = {"schema": INDEX_SCHEMA, "format_version": RANK_METADATA_FORMAT_VERSION,
           "rank": index.rank, "file": index.file, "size": index.size,
           "algorithm": index.algorithm,
           "header": [index.header.offset, index.header.length, index.header.digest],
           "items": [[i.fqn, None if i.offsets is None else list(i.offsets), i.code,
                      list(i.shape), i.offset, i.length, i.digest] for i in index.items]}
    return _pack(doc, f"the index of rank {index.rank}")


def _document(data: bytes | bytearray | memoryview, where: str, schema: str,
              keys: frozenset[str], what: str
              ) -> tuple[dict[str, Any], Callable[[str], CorruptCheckpointError]]:
    """A v5 document's map (msgpack, bounded by `unpack_document`) once its schema, format
    version and required keys hold, and the error maker of its other rules."""
    raw = unpack_document(data, where)

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: malformed {what} ({msg})")

    if not isinstance(raw, dict) or raw.get("schema") != schema:
        raise bad(f"not a ckptfs {what}")
    check_version(raw.get("format_version"), where, what)
    missing = sorted(keys - set(raw))
    if missing:
        raise bad(f"lacks {missing}")
    return raw, bad


def decode_index(data: bytes | bytearray | memoryview, row: RankRow, *, where: str
                 ) -> RankIndex:
    """Decode the index document of ``row``'s rank (its bytes already checked against the
    row's size and digest): every key required, ``rank`` and ``file`` the row's, the header
    chunk at 0, the items in file order tiling the file after it to ``size`` (the row's file
    size), each item's length its dtype and shape's, no (name, offsets) twice, and the chunk
    list's digest the row's file digest."""
    index = decode_own_index(data, row.rank, where=where, file_size=row.file_size,
                             algorithm=row.file_digest.split(":", 1)[0])
    if chunk_list_digest(index.algorithm, index.chunks) != row.file_digest:
        raise CorruptCheckpointError(
            f"{where}: the chunk list of {index.file} does not match the digest of its row")
    return index


def decode_own_index(data: bytes | bytearray | memoryview, rank: int, *, where: str,
                     file_size: int | None = None, algorithm: str | None = None) -> RankIndex:
    """Rank ``rank``'s index document by `decode_index`'s rules, without its row (what a
    rank's node can check of its own part: the table is on the coordinator's node), or with
    the row's ``file_size`` and ``algorithm``; its chunk list's digest is not checked
    here."""
    raw, bad = _document(data, where, INDEX_SCHEMA, INDEX_KEYS, "rank index")
    algo = raw["algorithm"]
    if raw["rank"] != rank or not _is_int(raw["rank"]):
        raise bad(f"names rank {raw['rank']!r:.20}, its row is rank {rank}: another "
                  "rank's index")
    size = raw["size"] if file_size is None else file_size
    if raw["file"] != rank_file_name(rank) or raw["size"] != size or not _is_int(size):
        raise bad(f"describes {raw['file']!r:.80} of {raw['size']!r:.20} B, the row "
                  f"{rank_file_name(rank)} of {size!r:.20} B")
    if algo not in ALGORITHMS or (algorithm is not None and algo != algorithm):
        raise bad(f"algorithm {algo!r:.40}")
    width = digest_width(algo) * 2

    def hexd(v: Any) -> str:
        if not isinstance(v, str) or len(v) != width or v.strip("0123456789abcdef"):
            raise bad(f"digest {v!r:.80}")
        return v

    h = raw["header"]
    if not isinstance(h, list) or len(h) != 3 or h[0] != 0 or not _is_int(h[1]) or h[1] < 8:
        raise bad("header chunk is not [0, length >= 8, hex]")
    header = Chunk(0, h[1], hexd(h[2]))
    items: list[IndexItem] = []
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    pos = header.length
    raw_items = raw["items"]
    if not isinstance(raw_items, list) or not raw_items:
        raise bad("items is not a non-empty array")
    for it in raw_items:
        if not isinstance(it, list) or len(it) != 7:
            raise bad(f"item {it!r:.80}")
        fqn, offsets, code, shape, off, length, dg = it
        if not isinstance(fqn, str) or not isinstance(code, str) or code not in CODE_DTYPES:
            raise bad(f"item {it!r:.80}")
        key = None if offsets is None else tuple(_ints(offsets, "item offsets", where))
        shp = tuple(_ints(shape, "item shape", where))
        if not _is_int(off) or not _is_int(length) or off != pos:
            raise bad(f"item {fqn!r:.80} at {off!r:.20} does not follow the previous one "
                      f"(at {pos})")
        n = math.prod(shp) * element_size(code)
        if (key is None and (code != "U8" or shp != (length,))) or n != length:
            raise bad(f"item {fqn!r:.80}: {length} B is not {code} {list(shp)}")
        if (fqn, key) in seen:
            raise bad(f"item {fqn!r:.80} at offsets {offsets!r:.40} twice")
        seen.add((fqn, key))
        items.append(IndexItem(fqn, key, code, shp, off, length, hexd(dg)))
        pos += length
    if pos != size:
        raise bad(f"its items end at {pos}, the file is {size} B")
    return RankIndex(rank, size, algo, header, tuple(items))


# ----------------------------------------------------------------------------------------------
# Tensor layouts and the spec


@dataclass(frozen=True)
class Cell:
    """One stored chunk of a tensor and the rank whose file holds it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the spec: its properties and layout.  ``grid`` (block sizes, one per
    dimension) with ``owners`` ``(base, stride)``: the chunks are the cells of equal blocks
    (the last of a dimension possibly smaller), the cell of row-major index ``i`` stored by
    rank ``base + i * stride``, and ``empty`` the chunks without elements stored besides
    (as DCP's planner keeps one where ranks past a tensor's end hold empty shards); otherwise
    ``chunks``, explicit (with any empty ones)."""

    dtype: str  # a dtype name of §8.4
    size: tuple[int, ...]
    requires_grad: bool
    memory_format: str
    pin_memory: bool
    grid: tuple[int, ...] | None = None
    owners: tuple[int, int] | None = None
    chunks: tuple[Cell, ...] | None = None
    empty: tuple[Cell, ...] = ()

    @property
    def code(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def counts(self) -> tuple[int, ...]:
        assert self.grid is not None
        return tuple(-(-s // b) for s, b in zip(self.size, self.grid, strict=True))

    def cells(self) -> Iterator[Cell]:
        """Every chunk, in row-major order (grid, then the empty ones) or as listed (chunks
        without elements included)."""
        if self.chunks is not None:
            yield from self.chunks
            return
        yield from self.overlapping(tuple(0 for _ in self.size), self.size)
        yield from self.empty

    def overlapping(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Iterator[Cell]:
        """The chunks that share an element with the box ``offsets``/``sizes`` (a box without
        elements, and a box of a 0-d tensor, overlaps what holds the tensor's elements)."""
        if self.chunks is not None:
            for c in self.chunks:
                if _intersects(c.offsets, c.sizes, offsets, sizes):
                    yield c
            return
        assert self.grid is not None and self.owners is not None
        counts = self.counts()
        ranges = []
        for d, (o, s, b, n) in enumerate(zip(offsets, sizes, self.grid, counts, strict=True)):
            if s <= 0 or o >= self.size[d]:
                return
            ranges.append(range(o // b, min(n, -(-(o + s) // b))))
        base, stride = self.owners
        for coords in _product(ranges):
            i = 0
            for k, n in zip(coords, counts, strict=True):
                i = i * n + k
            off = tuple(k * b for k, b in zip(coords, self.grid, strict=True))
            yield Cell(off, tuple(min(b, s - o) for o, b, s in
                                  zip(off, self.grid, self.size, strict=True)),
                       base + i * stride)


def _product(ranges: list[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (head, *rest)


def _intersects(ao: tuple[int, ...], asz: tuple[int, ...], bo: tuple[int, ...],
                bsz: tuple[int, ...]) -> bool:
    if not ao:
        return True
    return all(a < b + bs and b < a + as_ for a, as_, b, bs in zip(ao, asz, bo, bsz, strict=True))


def placement_errors(fqn: str, t: TensorSpec) -> list[str]:
    """What is wrong with the chunks ``t`` places on the ranks (its grid's cells and its
    ``empty`` ones, or its explicit chunks; each already inside the tensor, of its
    dimensions) as the tiling of the tensor a full read finds them in: two chunks at the same
    offsets (one name and offsets are one item: they would take each other's place), and
    `tiling_errors`' findings (DCP's rule: overlapping chunks, an empty one strictly inside
    another included, and volumes not summing to the tensor's).  In O(n log n) of the explicit
    or empty chunks: a grid's cells tile the tensor by construction, and an empty chunk
    overlaps a cell, or sits at its offsets, only if it does so with the cell holding its
    offsets (the one `TensorSpec.overlapping` finds for the one-element box there), so only
    those cells are checked with the empty chunks."""
    if t.chunks is not None:
        chunks, whole = list(t.chunks), True
    else:
        found: dict[tuple[int, ...], Cell] = {}
        for e in t.empty:
            found.update((c.offsets, c) for c in t.overlapping(e.offsets, (1,) * len(t.size)))
        chunks, whole = [*found.values(), *t.empty], False
    by_offsets: dict[tuple[int, ...], Cell] = {}
    errors: list[str] = []
    for c in chunks:
        other = by_offsets.setdefault(c.offsets, c)
        if other is not c:
            errors.append(f"key:{fqn} has two chunks at the same offsets: {other} {c}")
    if not t.size:  # a 0-d tensor: its one element in one chunk (a grid's one cell)
        if t.chunks is not None and len(chunks) != 1:
            errors.append(f"key:{fqn} invalid fill tensor-volume: 1 chunks: {len(chunks)}")
        return errors
    return errors + tiling_errors(fqn, t.size, chunks, check_volume=whole)


def layout_of(size: tuple[int, ...], cells: list[Cell]
              ) -> tuple[tuple[int, ...] | None, tuple[int, int] | None,
                         tuple[Cell, ...] | None, tuple[Cell, ...]]:
    """Writer side: the compact layout of a tensor stored as ``cells`` (its chunks and their
    ranks): a grid with an owner progression when the chunks with elements are exactly the
    cells of equal blocks and their ranks a progression in row-major order (the chunks without
    elements listed besides), else the explicit chunks."""
    explicit = (None, None, tuple(sorted(cells, key=lambda c: c.offsets)), ())
    if not cells or any(s == 0 for s in size):
        return explicit
    empty = tuple(sorted((c for c in cells if 0 in c.sizes), key=lambda c: c.offsets))
    cells = [c for c in cells if 0 not in c.sizes]
    if not cells:
        return explicit
    first = min(cells, key=lambda c: c.offsets)
    if any(first.offsets) or any(s == 0 for s in first.sizes):
        return explicit
    grid = first.sizes
    counts = tuple(-(-s // b) for s, b in zip(size, grid, strict=True))
    if len(cells) != math.prod(counts):
        return explicit
    by_index: dict[int, Cell] = {}
    for c in cells:
        coords = []
        for o, s, b, n, full in zip(c.offsets, c.sizes, grid, counts, size, strict=True):
            if o % b or s != min(b, full - o) or o // b >= n:
                return explicit
            coords.append(o // b)
        i = 0
        for k, n in zip(coords, counts, strict=True):
            i = i * n + k
        if i in by_index:
            return explicit
        by_index[i] = c
    ranks = [by_index[i].rank for i in range(len(cells))]
    stride = ranks[1] - ranks[0] if len(ranks) > 1 else 0
    if (stride <= 0 and len(ranks) > 1) or any(r != ranks[0] + i * stride
                                               for i, r in enumerate(ranks)):
        return explicit  # a grid's owners are distinct ranks (one rank's chunks are listed)
    return grid, (ranks[0], stride), None, empty


@dataclass
class Spec:
    """The decoded ``dcp-spec.msgpack``."""

    world_size: int
    tensors: dict[str, TensorSpec]
    values: dict[str, int]
    planner_data: dict[str, tuple[Any, ...]] | None
    storage_meta: dict[str, Any] | None
    version: str | None
    tree: Any
    extra: dict[str, Any]

    def owned(self) -> dict[int, int]:
        """Per rank, how many items the spec places in its file (a full read's check)."""
        out: dict[int, int] = {}
        for t in self.tensors.values():
            for c in t.cells():
                out[c.rank] = out.get(c.rank, 0) + 1
        for r in self.values.values():
            out[r] = out.get(r, 0) + 1
        return out


def encode_spec(spec: Spec) -> bytes:
    tensors = {}
    for fqn, t in spec.tensors.items():
        tensors[fqn] = {
            "dtype": t.dtype, "size": list(t.size), "requires_grad": t.requires_grad,
            "memory_format": t.memory_format, "pin_memory": t.pin_memory,
            "grid": None if t.grid is None else list(t.grid),
            "owners": None if t.owners is None else list(t.owners),
            "chunks": None if t.chunks is None else
            [[list(c.offsets), list(c.sizes), c.rank] for c in t.chunks],
            "empty": [[list(c.offsets), list(c.sizes), c.rank] for c in t.empty]}
    doc = {"schema": SPEC_SCHEMA, "format_version": RANK_METADATA_FORMAT_VERSION,
           "world_size": spec.world_size, "version": spec.version, "tensors": tensors,
           "values": dict(spec.values),
           "planner_data": None if spec.planner_data is None else
           {k: list(v) for k, v in spec.planner_data.items()},
           "storage_meta": spec.storage_meta, "tree": spec.tree, "extra": spec.extra}
    return _pack(doc, "the tensor spec")


def decode_spec(data: bytes | bytearray | memoryview, world: int, *, where: str) -> Spec:
    """Decode ``dcp-spec.msgpack`` (its size and digest checked against the manifest): every key
    required, ``world_size`` the manifest's; per tensor a dtype name of §8.4, its size, flags,
    and exactly one layout: a grid (one block size >= 1 per dimension, every dimension of the
    tensor >= 1, every owner ``base + i * stride`` a rank, distinct (stride >= 1) unless there
    is one cell; ``empty``: at most ``world_size`` chunks without elements, inside the tensor,
    each with a rank) or explicit chunks (each of the tensor's dimensions, with a rank;
    ``empty`` then ``[]``), the chunks either places on the ranks tiling the tensor exactly once
    (`placement_errors`: no two at the same offsets, none overlapping another, no gap); each
    value's rank; planner data naming exactly the stored names, and the tree. The chunks of all
    tensors together (grid cells counted, never enumerated) are at most `MAX_GRID_CELLS`: a
    small hostile document cannot make a load or verify build millions of objects before any
    other check."""
    raw, bad = _document(data, where, SPEC_SCHEMA, SPEC_KEYS, "tensor spec")
    if raw["world_size"] != world or not _is_int(raw["world_size"]):
        raise bad(f"world_size {raw['world_size']!r:.20} is not the manifest's {world}")

    def rank_ok(r: Any) -> bool:
        return _is_int(r) and 0 <= r < world

    raw_t, raw_v = raw["tensors"], raw["values"]
    if not isinstance(raw_t, dict) or not isinstance(raw_v, dict):
        raise bad("tensors or values is not a map")
    tensors: dict[str, TensorSpec] = {}
    placed = 0  # chunks placed by every tensor so far
    for fqn, e in raw_t.items():
        if not isinstance(fqn, str) or not isinstance(e, dict) or not set(e) >= SPEC_TENSOR_KEYS:
            raise bad(f"tensor {fqn!r:.80}: a key missing")
        if not isinstance(e["dtype"], str) or e["dtype"] not in DTYPE_NAMES:
            raise bad(f"tensor {fqn!r:.80}: dtype {e['dtype']!r:.40}")
        if not all(isinstance(e[k], bool) for k in ("requires_grad", "pin_memory")) or \
                e["memory_format"] not in _MEMORY_FORMATS:
            raise bad(f"tensor {fqn!r:.80}: requires_grad, pin_memory or memory_format")
        size = tuple(_ints(e["size"], f"tensor {fqn!r:.80}: size", where))
        grid = owners = chunks = None
        empty: tuple[Cell, ...] = ()
        if e["chunks"] is None:
            g = tuple(_ints(e["grid"], f"tensor {fqn!r:.80}: grid", where))
            ow = e["owners"]
            if len(g) != len(size) or not all(b >= 1 for b in g) or \
                    not all(s >= 1 for s in size):
                raise bad(f"tensor {fqn!r:.80}: grid {list(g)} for size {list(size)}")
            cells = math.prod(-(-s // b) for s, b in zip(size, g, strict=True))
            if cells > MAX_GRID_CELLS:
                raise bad(f"tensor {fqn!r:.80}: {cells} cells, more than {MAX_GRID_CELLS}")
            if not isinstance(ow, list) or len(ow) != 2 or not rank_ok(ow[0]) or \
                    not _is_int(ow[1]) or ow[1] < 0 or not rank_ok(ow[0] + (cells - 1) * ow[1]):
                raise bad(f"tensor {fqn!r:.80}: owners {ow!r:.40} are not ranks of the "
                          f"{world}-rank save")
            if ow[1] == 0 and cells > 1:  # the writer lists one rank's several chunks
                raise bad(f"tensor {fqn!r:.80}: a grid of {cells} cells all owned by rank "
                          f"{ow[0]} (a grid's owners are distinct ranks)")
            placed += cells
            grid, owners = g, (ow[0], ow[1])
            raw_e = e["empty"]
            if not isinstance(raw_e, list) or len(raw_e) > world:
                raise bad(f"tensor {fqn!r:.80}: empty {raw_e!r:.40}")
            em = []
            for c in raw_e:
                if not isinstance(c, list) or len(c) != 3 or not rank_ok(c[2]):
                    raise bad(f"tensor {fqn!r:.80}: empty chunk {c!r:.80}")
                off = tuple(_ints(c[0], "chunk offsets", where))
                sz = tuple(_ints(c[1], "chunk sizes", where))
                if len(off) != len(size) or len(sz) != len(size) or 0 not in sz or any(
                        o < 0 or n < 0 or o + n > full
                        for o, n, full in zip(off, sz, size, strict=True)):
                    raise bad(f"tensor {fqn!r:.80}: empty chunk {c!r:.80} is not an empty "
                              "box inside the tensor")
                em.append(Cell(off, sz, c[2]))
            if len({c.offsets for c in em}) != len(em):
                raise bad(f"tensor {fqn!r:.80}: two empty chunks at the same offsets")
            empty = tuple(em)
            placed += len(em)
        else:
            if e["grid"] is not None or e["owners"] is not None or \
                    not isinstance(e["chunks"], list) or e["empty"] != []:
                raise bad(f"tensor {fqn!r:.80}: both a grid and chunks, or neither")
            cl = []
            for c in e["chunks"]:
                if not isinstance(c, list) or len(c) != 3 or not rank_ok(c[2]):
                    raise bad(f"tensor {fqn!r:.80}: chunk {c!r:.80}")
                cl.append(Cell(tuple(_ints(c[0], "chunk offsets", where)),
                               tuple(_ints(c[1], "chunk sizes", where)), c[2]))
            if len({c.offsets for c in cl}) != len(cl):
                raise bad(f"tensor {fqn!r:.80}: two chunks at the same offsets")
            for c in cl:
                if len(c.offsets) != len(size) or len(c.sizes) != len(size):
                    raise bad(f"tensor {fqn!r:.80}: chunk at {list(c.offsets)} has "
                              f"{len(c.offsets)}/{len(c.sizes)} dimensions, the tensor "
                              f"{len(size)}")
            chunks = tuple(cl)
            placed += len(cl)
        if placed > MAX_GRID_CELLS:  # counted, never enumerated: bounded before allocation
            raise bad(f"the spec places more than {MAX_GRID_CELLS} chunks (at tensor "
                      f"{fqn!r:.80})")
        t = TensorSpec(e["dtype"], size, e["requires_grad"], e["memory_format"],
                       e["pin_memory"], grid, owners, chunks, empty)
        problems = placement_errors(fqn, t)
        if problems:
            raise bad(f"tensor {fqn!r:.80}: its chunks must tile it exactly once, without "
                      f"overlap, two at the same offsets or a gap: {summary(problems)}")
        tensors[fqn] = t
    values: dict[str, int] = {}
    for fqn, r in raw_v.items():
        if not isinstance(fqn, str) or fqn in tensors or not rank_ok(r):
            raise bad(f"value {fqn!r:.80}: rank {r!r:.20}")
        values[fqn] = r
    names = set(tensors) | set(values)
    planner = raw["planner_data"]
    if planner is not None:
        if not isinstance(planner, dict) or set(planner) != names:
            raise bad("planner_data does not name exactly the stored names")
        for fqn, path_ in planner.items():
            if not isinstance(path_, list) or not path_ or not all(
                    isinstance(p, str) or _is_int(p) for p in path_) or \
                    ".".join(map(str, path_)) != fqn:
                raise bad(f"planner_data of {fqn!r:.80} is not a key path joining to it")
        planner = {k: tuple(v) for k, v in planner.items()}
    sm = raw["storage_meta"]
    if sm is not None and (not isinstance(sm, dict) or not all(
            isinstance(sm.get(k), (str, type(None))) for k in ("checkpoint_id", "save_id"))
            or not isinstance(sm.get("modules", []), list)
            or not all(isinstance(m, str) for m in sm.get("modules", []))):
        raise bad("storage_meta")
    if raw["version"] is not None and not isinstance(raw["version"], str):
        raise bad("version")
    if not isinstance(raw["extra"], dict):
        raise bad("extra")
    if raw["tree"] is not None:
        check_skeleton(raw["tree"], names, where=where)
    return Spec(world, tensors, values, planner, sm, raw["version"], raw["tree"], raw["extra"])


# ----------------------------------------------------------------------------------------------
# What a rank's load needs, and DCP's Metadata over it

#: Per name, the regions wanted: boxes ``(offsets, sizes)`` of a tensor, ``None`` for all of
#: it (and for a value).  ``None`` as a whole: everything.
Regions = Mapping[str, list[tuple[tuple[int, ...], tuple[int, ...]]] | None]


def needed_cells(spec: Spec, regions: Regions | None) -> tuple[dict[str, list[Cell]],
                                                               dict[str, int]]:
    """The chunks (per tensor) and the values (name -> rank) a load of ``regions`` reads:
    every chunk sharing an element with a wanted box.  Names the checkpoint lacks are left
    out (DCP's planner names them)."""
    cells: dict[str, list[Cell]] = {}
    values: dict[str, int] = {}
    names: Iterable[str] = spec.tensors.keys() | spec.values.keys() if regions is None \
        else regions.keys()
    for fqn in names:
        if fqn in spec.values:
            values[fqn] = spec.values[fqn]
            continue
        t = spec.tensors.get(fqn)
        if t is None:
            continue
        boxes = None if regions is None else regions[fqn]
        if boxes is None:
            cells[fqn] = list(t.cells())
            continue
        found: dict[tuple[int, ...], Cell] = {}
        for off, sizes in boxes:
            if len(off) != len(t.size):  # another shape: DCP's planner refuses it
                found.update((c.offsets, c) for c in t.cells())
                continue
            found.update((c.offsets, c) for c in t.overlapping(tuple(off), tuple(sizes)))
        cells[fqn] = list(found.values())
    return cells, values


def build_document(spec: Spec, indexes: Mapping[int, RankIndex],
                   cells: Mapping[str, list[Cell]], values: Mapping[str, int], *,
                   where: str, full: bool = False) -> DcpDocument:
    """DCP's ``Metadata`` for a load of ``cells`` and ``values`` (`needed_cells`), from the
    index documents of the ranks holding them: each needed chunk must be its owner's item of
    that name and offsets, of the tensor's dtype and the chunk's sizes (else
    `CorruptCheckpointError`: the spec and the index disagree).  ``items``: every item of
    those ranks' files (a rank file's header is checked against all of them).  ``full``:
    every rank's index is given, and each must hold exactly what the spec places there."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    formats = {"contiguous_format": torch.contiguous_format,
               "channels_last": torch.channels_last, "preserve_format": torch.preserve_format}
    storage: dict[Any, Any] = {}
    from ckptfs.format.sharded_metadata import ItemLocation

    def locate(fqn: str, offsets: tuple[int, ...] | None, rank: int, code: str,
               shape: tuple[int, ...]) -> None:
        index = indexes.get(rank)
        item = None if index is None else index.find(fqn, offsets)
        if item is None or item.code != code or (offsets is not None and item.shape != shape):
            at = "" if offsets is None else f" at offsets {list(offsets)}"
            raise CorruptCheckpointError(
                f"{where}: the spec places {fqn!r:.80}{at} ({code} {list(shape)}) in the file "
                f"of rank {rank}, whose index does not hold it so")
        storage[MetadataIndex(fqn, None if offsets is None else list(offsets))] = \
            ItemLocation(rank_file_name(rank), item.offset, item.length)

    sdm: dict[str, Any] = {}
    for fqn, t in spec.tensors.items():
        mine = cells.get(fqn, [])
        for c in mine:
            locate(fqn, c.offsets, c.rank, t.code, c.sizes)
        props = TensorProperties(dtype=getattr(torch, t.dtype), requires_grad=t.requires_grad,
                                 memory_format=formats[t.memory_format],
                                 pin_memory=t.pin_memory)
        sdm[fqn] = TensorStorageMetadata(
            props, torch.Size(t.size),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in mine])
    for fqn in spec.values:
        sdm[fqn] = BytesStorageMetadata()
    for fqn, rank in values.items():
        locate(fqn, None, rank, "U8", ())
    if full:
        owned = spec.owned()
        for rank, index in indexes.items():
            if len(index.items) != owned.get(rank, 0):
                raise CorruptCheckpointError(
                    f"{where}: rank {rank}'s index holds {len(index.items)} items, the spec "
                    f"places {owned.get(rank, 0)} in its file")
        for rank in owned.keys() - indexes.keys():
            raise CorruptCheckpointError(
                f"{where}: the spec places items in the file of rank {rank}, which has none")
    sm = None
    if spec.storage_meta is not None:
        sm = StorageMeta(checkpoint_id=spec.storage_meta.get("checkpoint_id"),
                         save_id=spec.storage_meta.get("save_id"),
                         modules=list(spec.storage_meta.get("modules", [])))
    md: Metadata = Metadata(state_dict_metadata=sdm, planner_data=spec.planner_data,
                            storage_data=storage, storage_meta=sm, version=spec.version)
    items = [i.stored(idx.file) for idx in indexes.values() for i in idx.items]
    return DcpDocument(md, spec.tree, spec.extra, items)
