"""The ranks' local save plans as columns, and the global plan the coordinator makes of them.

Design decision: **the coordinator of a collective save plans in columns, never with one
object per write item.**  At 4,096 ranks a one-layer slice of a 70B model is 200,000 write
items; building DCP's ``WriteItem`` objects for them, deduplicating and checking them one by one
and deriving the metadata from them cost the coordinator 3-4 s before any rank wrote a byte
(docs/benchmarks.md).  Here a rank's local plan is two parts:

* its **skeleton** (`Skeleton`): per write item its name, kind, tensor properties, global size,
  index hint and how its index offset is given.  It is the same on every rank of an SPMD job
  (every rank holds a shard of every parameter), so the coordinator decodes it once per
  distinct document (`ckptfs.protocol.plan_docs`), not once per rank;
* its **numbers**: per tensor item the chunk's offsets and sizes (and an index offset of its
  own where it is not the chunk's), int64 in one array.

`global_plan` stacks the numbers of the ranks sharing a skeleton into one matrix and makes the
global plan with tensor operations over each item's column of ranks: DCP's deduplication
(every value and, for format v5, every small replicated tensor from the lowest rank holding it;
each other replicated tensor written by the holder `split_writers` picks, or split along its
rows between several when it alone is larger than a rank's share), the index hints,
DCP's check that each tensor's chunks tile it once (`tiling_errors`' verdict; a cut along one
dimension is checked by sorting one column), and each rank's part.  What is O(items) by nature
is made only on demand: DCP's ``Metadata`` and save plans (`GlobalPlan.metadata`,
`GlobalPlan.save_plans`: format v2's ``dcp.msgpack`` lists every chunk) and, for format v5, the
tensor spec's layouts (`GlobalPlan.spec_layouts`: O(tensors) for the grids sharding makes).

The result is exactly what DCP's ``dedup_save_plans`` then ``create_default_global_save_plan``
make of the same plans for the same writers, in the same order (tests/protocol/
test_plan_tiling.py); `ckptfs.protocol.sharded_plan.SavePlanner.create_global_plan` (DCP's own
hook, under a plain ``dcp.save``) runs through it too, over tables made of DCP's plans.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import itertools
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ckptfs.format.tiling import summary, tiling_errors
from ckptfs.protocol.balance import split_writers
from ckptfs.protocol.group import decode_bytes, encode_bytes

__all__ = ["KEY_CHUNK", "KEY_NONE", "SMALL_REPLICATED_BYTES", "GlobalPlan", "LocalTable",
           "PlanMappings", "Row", "Skeleton", "decode_numbers", "decode_planner_data",
           "decode_skeleton", "encode_numbers", "encode_planner_data", "global_plan",
           "layout_of"]

#: A row's index offset is its chunk's offsets (every item DCP's planner makes of a tensor).
KEY_CHUNK = -2
#: A row's index offset is None (a value).
KEY_NONE = -1
#: A replicated tensor at most this large is stored by the lowest rank holding it, with
#: ``gather_small`` (format v5); larger ones are spread over the ranks by `split_writers`.
SMALL_REPLICATED_BYTES = 1 << 20


@dataclass(frozen=True)
class Row:
    """One write item of a skeleton: ``props`` indexes `Skeleton.properties` (-1 for a value),
    ``size`` is the tensor's (``()`` for a value), ``nbytes`` a value's declared size (None:
    none declared), ``key`` how the index offset is given (`KEY_CHUNK`, `KEY_NONE`, or k >= 0:
    k numbers of its own), ``dims`` the chunk's dimensions (0 for a value) and ``start`` where
    the item's numbers begin in a rank's array: the index offset's k numbers, then the chunk's
    offsets, then its sizes."""

    fqn: str
    kind: WriteItemType
    props: int
    size: tuple[int, ...]
    hint: int | None
    nbytes: int | None
    key: int
    dims: int
    start: int

    @property
    def width(self) -> int:
        return max(self.key, 0) + 2 * self.dims


@dataclass(frozen=True)
class Skeleton:
    """What a local plan's items are but for their chunks (module docstring).  ``blob`` is its
    document (`ckptfs.protocol.plan_docs`): two skeletons with one blob are one."""

    properties: tuple[TensorProperties, ...]
    rows: tuple[Row, ...]
    width: int
    blob: str


class PlanMappings(dict):  # type: ignore[type-arg]
    """DCP's flattening map of one rank's save plan, carrying that rank's state skeleton
    (``tree``) to the coordinator, which merges the maps as DCP's ``ChainMap`` does."""

    tree: Any = None


@dataclass(eq=False)
class LocalTable:
    """One rank's local save plan in columns: its skeleton, its numbers (int64, the
    skeleton's ``width``), the step it saves, DCP's ``usable`` and its planner data (the
    flattening map, with the rank's state skeleton ``tree``); ``texts``, the documents of the
    numbers and the planner data, and ``layout``, the digest of what the plan is made of (the
    skeleton's, the planner data's and the numbers' documents: `layout_of`).  ``items``: the
    plan's own write items where the table was made of a plan (`of_plan`)."""

    skeleton: Skeleton
    numbers: torch.Tensor
    step: Any
    usable: bool
    planner_data: Any
    texts: tuple[str, str | None]
    layout: str
    items: list[WriteItem] | None = None

    @classmethod
    def of_plan(cls, plan: SavePlan) -> LocalTable:
        """The table of ``plan`` (a rank's local save plan)."""
        props: list[TensorProperties] = []
        seen: dict[Any, int] = {}
        rows: list[Row] = []
        numbers: list[int] = []
        for item in plan.items:
            idx, td = item.index, item.tensor_data
            if td is None:
                key = KEY_NONE if idx.offset is None else len(idx.offset)
                if idx.offset is not None:
                    numbers += idx.offset
                nbytes = None if item.bytes_io_data is None else int(item.bytes_io_data.nbytes)
                rows.append(Row(idx.fqn, item.type, -1, (), idx.index, nbytes, key, 0,
                                len(numbers) - max(key, 0)))
                continue
            c, p = td.chunk, td.properties
            if len(c.offsets) != len(c.sizes):
                raise ValueError(f"write item {idx.fqn!r:.80}: a chunk of {len(c.offsets)} "
                                 f"offsets and {len(c.sizes)} sizes")
            pkey = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
            k = seen.get(pkey)
            if k is None:
                k = seen[pkey] = len(props)
                props.append(p)
            start = len(numbers)
            if idx.offset is None:
                key = KEY_NONE
            elif tuple(idx.offset) == tuple(c.offsets):
                key = KEY_CHUNK
            else:
                key = len(idx.offset)
                numbers += idx.offset
            numbers += c.offsets
            numbers += c.sizes
            rows.append(Row(idx.fqn, item.type, k, tuple(int(s) for s in td.size), idx.index,
                            None, key, len(c.offsets), start))
        blob = _encode_skeleton(props, rows)
        skeleton = Skeleton(tuple(props), tuple(rows), len(numbers), blob)
        nums = torch.tensor(numbers, dtype=torch.int64)
        numbers_text, planner_text = encode_numbers(nums), encode_planner_data(plan.planner_data)
        return cls(skeleton, nums, plan.storage_data, bool(plan.usable), plan.planner_data,
                   (numbers_text, planner_text), layout_of(blob, numbers_text, planner_text),
                   list(plan.items))

    def write_items(self) -> list[WriteItem]:
        """DCP's write items of this table (the plan's own where it was made of one)."""
        if self.items is None:
            self.items = _materialize(self.skeleton, self.numbers.tolist())
        return self.items


def _materialize(sk: Skeleton, nums: list[int]) -> list[WriteItem]:
    out: list[WriteItem] = []
    for row in sk.rows:
        s = row.start
        k = max(row.key, 0)
        own = torch.Size(nums[s:s + k]) if row.key >= 0 else None
        if row.props < 0:
            out.append(WriteItem(index=MetadataIndex(row.fqn, own, row.hint), type=row.kind,
                                 bytes_io_data=None if row.nbytes is None
                                 else BytesIOWriteData(nbytes=row.nbytes)))
            continue
        d = row.dims
        offsets = torch.Size(nums[s + k:s + k + d])
        sizes = torch.Size(nums[s + k + d:s + k + 2 * d])
        at = offsets if row.key == KEY_CHUNK else own
        out.append(WriteItem(index=MetadataIndex(row.fqn, at, row.hint), type=row.kind,
                             tensor_data=TensorWriteData(
                                 chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                 properties=sk.properties[row.props],
                                 size=torch.Size(row.size))))
    return out


@dataclass
class _Tensor:
    """The kept chunks of one tensor, in plan order: offsets and sizes (m x d), ranks (m)."""

    props: TensorProperties
    size: tuple[int, ...]
    offsets: torch.Tensor
    sizes: torch.Tensor
    ranks: torch.Tensor


@dataclass(eq=False)
class GlobalPlan:
    """The global plan of a collective save (`global_plan`): per skeleton group (ranks
    sharing a skeleton) which rank writes which of its items (``kept``) with which index hint
    (``hints``, -1 for none); per name, the kept chunks (``tensors``) or the rank storing the
    value (``values``), in the metadata's order (``order``).  Immutable once made: the
    coordinator keeps it for the next save of the same layout."""

    world: int
    groups: list[tuple[Skeleton, list[int]]]
    kept: list[torch.Tensor]
    hints: list[torch.Tensor]
    order: list[str]
    tensors: dict[str, _Tensor]
    values: dict[str, int]
    planner_data: dict[str, Any] | None
    tables: list[LocalTable]
    #: The items written in part (a replicated tensor split between its holders):
    #: (group, row in the group, position) -> (first row of the piece, its rows).
    pieces: dict[tuple[int, int, int], tuple[int, int]] = dataclasses.field(
        default_factory=dict)
    #: What is made on demand, once: DCP's state_dict_metadata, the spec's layouts.
    memo: dict[str, Any] = dataclasses.field(default_factory=dict)

    def _where(self) -> list[tuple[int, int]]:
        where = self.memo.get("where")
        if where is None:
            where = [(-1, -1)] * self.world
            for g, (_, ranks) in enumerate(self.groups):
                for i, r in enumerate(ranks):
                    where[r] = (g, i)
            self.memo["where"] = where
        return where

    def part(self, rank: int) -> tuple[list[int], list[int | None],
                                       list[tuple[int, int] | None]]:
        """Rank ``rank``'s part: the positions in its local plan of the items it writes, their
        index hints, and for an item it writes in part the piece (its first row within the
        item's chunk, its rows; None: the whole item)."""
        g, i = self._where()[rank]
        pos: list[int] = torch.nonzero(self.kept[g][i]).flatten().tolist()
        hints = self.hints[g][i][pos].tolist()
        pieces: list[tuple[int, int] | None] = [self.pieces.get((g, i, p)) for p in pos]
        return pos, [None if h < 0 else h for h in hints], pieces

    def items_per_rank(self) -> list[int]:
        """How many items each rank writes."""
        out = [0] * self.world
        for g, (_, ranks) in enumerate(self.groups):
            for r, n in zip(ranks, self.kept[g].sum(dim=1).tolist(), strict=True):
                out[r] = n
        return out

    def state_dict_metadata(self) -> dict[str, Any]:
        """DCP's ``state_dict_metadata``: per name its chunks (plan order) or a value."""
        sdm = self.memo.get("sdm")
        if sdm is None:
            sdm = {}
            for fqn in self.order:
                t = self.tensors.get(fqn)
                if t is None:
                    sdm[fqn] = BytesStorageMetadata()
                    continue
                offs, sizes = t.offsets.tolist(), t.sizes.tolist()
                sdm[fqn] = TensorStorageMetadata(
                    properties=t.props, size=torch.Size(t.size),
                    chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                            for o, s in zip(offs, sizes, strict=True)])
            self.memo["sdm"] = sdm
        return sdm

    @property
    def metadata_version(self) -> str | None:
        """The ``version`` of DCP's ``Metadata`` this plan makes."""
        return Metadata({}).version

    def metadata(self) -> Metadata:
        """A new DCP ``Metadata`` of this plan (a writer sets its storage data)."""
        md = Metadata(dict(self.state_dict_metadata()))
        if self.planner_data is not None:
            md = dataclasses.replace(md, planner_data=self.planner_data)
        return md

    def save_plans(self, tables: Sequence[LocalTable] | None = None) -> list[SavePlan]:
        """DCP's global save plans: each rank's kept items, index hints set.  ``tables``: the
        ranks' tables of this save (a plan kept for their layout was made of an earlier
        save's; their items are equal, their steps may not be)."""
        out: list[SavePlan] = []
        for rank, table in enumerate(self.tables if tables is None else tables):
            items = table.write_items()
            pos, hints, pieces = self.part(rank)
            kept = [_hinted(items[p] if piece is None else piece_of(items[p], *piece), h)
                    for p, h, piece in zip(pos, hints, pieces, strict=True)]
            out.append(SavePlan(kept, storage_data=table.step, planner_data=table.planner_data,
                                usable=table.usable))
        return out


#: DCP's ``WriteItem`` and ``MetadataIndex`` hold their fields in their instance dicts
#: (torch 2.13): a hinted copy is made with them set as such, about 4 times faster than two
#: ``dataclasses.replace`` (which validate every field through ``__init__``).
_PLAIN = tuple(f.name for f in dataclasses.fields(WriteItem)) == (
    "index", "type", "bytes_io_data", "tensor_data") and \
    tuple(f.name for f in dataclasses.fields(MetadataIndex)) == ("fqn", "offset", "index") \
    and "__slots__" not in vars(WriteItem) and "__slots__" not in vars(MetadataIndex)


def piece_of(item: WriteItem, start: int, rows: int) -> WriteItem:
    """The write item of rows ``start`` .. ``start + rows`` of ``item``'s chunk (a replicated
    tensor split between its holders, `split_writers`): a shard, its index offset the
    piece's."""
    td = item.tensor_data
    if td is None or not td.chunk.sizes or not 0 <= start < start + rows <= td.chunk.sizes[0]:
        raise ValueError(f"write item {item.index.fqn!r:.80}: no rows {start}+{rows} to write")
    offsets = torch.Size([td.chunk.offsets[0] + start, *td.chunk.offsets[1:]])
    sizes = torch.Size([rows, *td.chunk.sizes[1:]])
    chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
    return dataclasses.replace(item, index=dataclasses.replace(item.index, offset=offsets),
                               type=WriteItemType.SHARD,
                               tensor_data=dataclasses.replace(td, chunk=chunk))


def _hinted(item: WriteItem, hint: int | None) -> WriteItem:
    if item.index.index == hint:
        return item
    if not _PLAIN:  # pragma: no cover - another torch's dataclasses
        return dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint))
    index = object.__new__(MetadataIndex)
    index.__dict__.update(item.index.__dict__, index=hint)
    copy = object.__new__(WriteItem)
    copy.__dict__.update(item.__dict__, index=index)
    return copy


# ----------------------------------------------------------------------------------------------
# The skeleton's document and the numbers' bytes

_KINDS = {WriteItemType.TENSOR: "tensor", WriteItemType.SHARD: "shard",
          WriteItemType.BYTE_IO: "bytes"}
_KIND_OF = {v: k for k, v in _KINDS.items()}
_TORCH_NAME = re.compile(r"torch\.[A-Za-z0-9_]{1,64}")
#: At most this many dimensions per chunk and numbers per index offset (torch's own bound).
_MAX_DIMS = 64


def _torch_attr(name: Any, kind: type, what: str) -> Any:
    if not isinstance(name, str) or not _TORCH_NAME.fullmatch(name):
        raise ValueError(f"{what}: {name!r:.80} is not a torch name")
    value = getattr(torch, name[len("torch."):], None)
    if not isinstance(value, kind):
        raise ValueError(f"{what}: {name!r:.80} is not a {kind.__name__}")
    return value


def _properties_doc(p: TensorProperties) -> list[Any]:
    # str(): "torch.float32", "torch.strided", "torch.contiguous_format"
    return [str(p.dtype), str(p.layout), bool(p.requires_grad), str(p.memory_format),
            bool(p.pin_memory)]


def _properties_of(raw: Any) -> TensorProperties:
    if not isinstance(raw, list) or len(raw) != 5:
        raise ValueError(f"tensor properties: 5 fields wanted, got {raw!r:.80}")
    dtype = _torch_attr(raw[0], torch.dtype, "dtype")
    layout = _torch_attr(raw[1], torch.layout, "layout")
    memory_format = _torch_attr(raw[3], torch.memory_format, "memory format")
    if type(raw[2]) is not bool or type(raw[4]) is not bool:
        raise ValueError("tensor properties: requires_grad and pin_memory are bools")
    return TensorProperties(dtype=dtype, layout=layout, requires_grad=raw[2],
                            memory_format=memory_format, pin_memory=raw[4])


def _encode_skeleton(props: list[TensorProperties], rows: list[Row]) -> str:
    doc = [[_properties_doc(p) for p in props],
           [[r.fqn, _KINDS[r.kind], r.props, list(r.size), r.hint, r.nbytes, r.key, r.dims]
            for r in rows]]
    return encode_bytes(msgpack.packb(doc, use_bin_type=True))


def _pair(text: Any, what: str, shape: str) -> list[Any]:
    """A plan document's part: base64 text of a msgpack pair whose first is a list, else
    ``ValueError`` naming ``what`` and its ``shape``."""
    if not isinstance(text, str):
        raise ValueError(f"a local save plan's {what}: {shape} as text wanted")
    try:
        doc = msgpack.unpackb(decode_bytes(text), raw=False, use_list=True,
                              strict_map_key=True)
    except Exception as exc:  # not base64, not msgpack
        raise ValueError(f"a local save plan's {what}: {exc}") from exc
    if not (isinstance(doc, list) and len(doc) == 2 and isinstance(doc[0], list)):
        raise ValueError(f"a local save plan's {what}: {shape} wanted")
    return doc


def _is_int(v: Any) -> bool:
    return type(v) is int


def decode_skeleton(blob: Any) -> Skeleton:
    """The skeleton a rank sent (`LocalTable.of_plan`'s ``blob``), every field checked:
    ``ValueError`` naming what is wrong."""
    doc = _pair(blob, "skeleton", "[properties, items]")
    if not isinstance(doc[1], list):
        raise ValueError("a local save plan's skeleton: [properties, items] wanted")
    props = tuple(_properties_of(p) for p in doc[0])
    rows: list[Row] = []
    start = 0
    for raw in doc[1]:
        if not (isinstance(raw, list) and len(raw) == 8 and isinstance(raw[0], str)):
            raise ValueError(f"a write item: {raw!r:.80}")
        fqn, kind_name, k, size, hint, nbytes, key, dims = raw
        kind = _KIND_OF.get(kind_name) if isinstance(kind_name, str) else None
        if kind is None:
            raise ValueError(f"write item {fqn!r:.80}: kind {kind_name!r:.20}")
        if hint is not None and not (_is_int(hint) and hint >= 0):
            raise ValueError(f"write item {fqn!r:.80}: index hint {hint!r:.20}")
        if not (_is_int(key) and KEY_CHUNK <= key <= _MAX_DIMS) or \
                not (_is_int(dims) and 0 <= dims <= _MAX_DIMS):
            raise ValueError(f"write item {fqn!r:.80}: offsets {key!r:.20}/{dims!r:.20}")
        if not (isinstance(size, list) and len(size) <= _MAX_DIMS
                and all(_is_int(x) and x >= 0 for x in size)):
            raise ValueError(f"write item {fqn!r:.80}: size {size!r:.80}")
        if kind == WriteItemType.BYTE_IO:
            if k != -1 or size or dims or key == KEY_CHUNK or \
                    not (nbytes is None or (_is_int(nbytes) and nbytes >= 0)):
                raise ValueError(f"write item {fqn!r:.80}: a value with a tensor's fields")
        elif not (_is_int(k) and 0 <= k < len(props)) or nbytes is not None:
            raise ValueError(f"write item {fqn!r:.80}: properties {k!r:.20}")
        row = Row(fqn, kind, k, tuple(size), hint, nbytes, key, dims, start)
        start += row.width
        rows.append(row)
    return Skeleton(props, tuple(rows), start, blob)


def encode_planner_data(pd: Any) -> str | None:
    """A plan's planner data (ckptfs's planner: the flattening map, with the rank's state
    skeleton) as text: msgpack, base64.  None: none."""
    if pd is None:
        return None
    if not isinstance(pd, dict):
        raise TypeError(f"planner data of type {type(pd).__name__}: ckptfs's planner sends a "
                        "dict")
    tree = getattr(pd, "tree", None)
    blob = msgpack.packb([[[fqn, list(path)] for fqn, path in pd.items()], tree],
                         use_bin_type=True)
    return encode_bytes(blob)


def decode_planner_data(text: Any) -> PlanMappings:
    """`encode_planner_data`'s map, every entry checked: ``ValueError`` naming what is
    wrong."""
    raw = _pair(text, "planner data", "[mappings, tree]")
    mappings = PlanMappings()
    for pair in raw[0]:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], list)
                and all(type(k) in (str, int) for k in pair[1])):
            raise ValueError(f"a flattening map entry: {pair!r:.80}")
        mappings[pair[0]] = tuple(pair[1])
    mappings.tree = raw[1]
    return mappings


def _digest(text: str | None) -> str:
    return "-" if text is None else hashlib.sha256(text.encode()).hexdigest()


def layout_of(skeleton: str, numbers: str, planner: str | None,
              digests: dict[str | None, str] | None = None) -> str:
    """The digest of what a local plan is made of: its skeleton's, numbers' and planner
    data's documents (a changed shape, dtype or placement changes the skeleton or the
    numbers; a value added, removed or moved the skeleton and the flattening map; the values
    themselves do not take part).  Equal digests on every rank: the same global plan.  The
    rank computes it of what it sends, the coordinator of what it received (so a plan whose
    digest is not its content's is refused, never planned as another).  ``digests``: the
    digests of the skeleton and planner documents already made (every rank sends the same)."""
    digests = {} if digests is None else digests
    parts = []
    for text in (skeleton, planner):
        d = digests.get(text)
        if d is None:
            d = digests[text] = _digest(text)
        parts.append(d)
    return hashlib.sha256(f"{parts[0]}:{parts[1]}:{numbers}".encode()).hexdigest()


def encode_numbers(numbers: torch.Tensor) -> str:
    """A table's numbers as text: int64, little-endian, base64."""
    data = array.array("q", numbers.tolist())
    if sys.byteorder != "little":  # pragma: no cover - a big-endian machine
        data.byteswap()
    return encode_bytes(data.tobytes())


def decode_numbers(text: Any, width: int) -> torch.Tensor:
    """`encode_numbers`' numbers, exactly ``width`` of them, else ``ValueError``."""
    if not isinstance(text, str):
        raise ValueError("a local save plan's numbers: a string wanted")
    try:
        raw = decode_bytes(text)
    except Exception as exc:
        raise ValueError(f"a local save plan's numbers: {exc}") from exc
    if len(raw) != 8 * width:
        raise ValueError(f"a local save plan's numbers: {len(raw)} B, its skeleton wants "
                         f"{8 * width} B")
    if not width:
        return torch.zeros(0, dtype=torch.int64)
    data = array.array("q")
    data.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover - a big-endian machine
        data.byteswap()
    return torch.frombuffer(data, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# The global plan


def global_plan(tables: Sequence[LocalTable], *, gather_small: bool = False,
                merge_mappings: bool = True) -> GlobalPlan:
    """The global plan of every rank's local plan (``tables``, in rank order): module
    docstring.  ``gather_small``: every replicated whole tensor of at most
    `SMALL_REPLICATED_BYTES` is stored by the lowest rank holding it (format v5).  Raises
    ``ValueError`` ("Failed to validate global plan: ...", DCP's words) if a tensor's kept
    chunks do not tile it once, ``AssertionError`` for two items of one value or whole tensor
    (DCP's own invariants).

    Every rank's every item is one *entry*; the entries of all ranks and names are columns of
    one set of tensors (so the number of tensor operations does not grow with the ranks or
    the names), sorted in plan order (rank, then position: DCP's order of the metadata's
    chunks).  A Python loop runs only over the keys several ranks hold and, at the end, over
    the names (one slice each)."""
    world = len(tables)
    by_blob: dict[str, int] = {}
    groups: list[tuple[Skeleton, list[int]]] = []
    for r, t in enumerate(tables):
        g = by_blob.get(t.skeleton.blob)
        if g is None:
            g = by_blob[t.skeleton.blob] = len(groups)
            groups.append((t.skeleton, []))
        groups[g][1].append(r)
    e = _entries(tables, groups)
    n = len(e.rank)
    alive = torch.ones(n, dtype=torch.bool)
    # The keys several ranks hold (a value or tensor replicated): their writers.
    shared = _shared_keys(e, alive)
    if gather_small and shared and bool(e.small.any()):
        changed = False
        for _, idx, _firsts in shared:
            small = idx[e.small[idx]]
            if len(small):
                drop = idx[e.rank[idx] != e.rank[small[0]]]
                if len(drop):
                    alive[drop] = False
                    changed = True
        if changed:
            shared = _shared_keys(e, alive)
    tensor_live = alive & (e.nbytes >= 0)
    fixed = torch.zeros(world, dtype=torch.int64).index_add_(0, e.rank[tensor_live],
                                                              e.nbytes[tensor_live])
    # (plan order of its second holder, key's entries, the first entry of each holder)
    shared.sort(key=lambda s: int(e.order[s[2][1]]))
    tensors = [(idx, firsts) for _, idx, firsts in shared if int(e.nbytes[firsts[-1]]) >= 0]
    items = []
    for _, firsts in tensors:
        holders = e.rank[firsts]
        size = int(e.nbytes[firsts[-1]])
        fixed[holders] -= size
        last = int(firsts[-1])
        rows = int(e.sizes[last, 0]) if int(e.dims[last]) > 0 else 1
        items.append((size, holders.tolist(), rows))
    piece_start = torch.zeros(n, dtype=torch.int64)
    piece_rows = torch.full((n,), -1, dtype=torch.int64)
    for (idx, firsts), split in zip(tensors, split_writers(items, world, fixed=fixed.tolist()),
                                    strict=True):
        alive[idx] = False
        if len(split) == 1:  # written whole: by the writer (its every item of the key)
            alive[idx[e.rank[idx] == split[0][0]]] = True
        else:  # in pieces: each writer's first item of the key writes its rows
            keep = firsts[torch.isin(e.rank[firsts], torch.tensor([w for w, _, _ in split]))]
            alive[keep] = True
            by_rank = {int(e.rank[j]): int(j) for j in keep}
            for writer, start, rows in split:
                piece_start[by_rank[writer]], piece_rows[by_rank[writer]] = start, rows
    for _, idx, firsts in shared:
        if int(e.nbytes[firsts[-1]]) < 0:  # a value: the lowest rank holding it
            alive[idx] = False
            alive[idx[e.rank[idx] == e.rank[firsts[0]]]] = True
    return _finish_plan(e, alive, piece_start, piece_rows, tables, groups, world,
                        merge_mappings)


@dataclass
class _AllEntries:
    """Every entry (one rank's one item) as columns, in plan order: its rank, position, group,
    row in the group, column (group and position), name id, kind, properties' itemsize and
    whether a small whole tensor, dimensions, chunk offsets and sizes (padded), bytes (-1 for
    a value) and key id (equal ids: equal name and index offset)."""

    rank: torch.Tensor
    pos: torch.Tensor
    group: torch.Tensor
    row_in_group: torch.Tensor
    order: torch.Tensor
    fqn: torch.Tensor
    kind: torch.Tensor
    small: torch.Tensor
    dims: torch.Tensor
    offsets: torch.Tensor
    sizes: torch.Tensor
    nbytes: torch.Tensor
    key: torch.Tensor
    hint: torch.Tensor
    names: list[str]
    rows: list[Row]          # per column
    column: torch.Tensor     # per entry: its column
    props: list[TensorProperties | None]  # per column


_KIND_CODE = {WriteItemType.TENSOR: 0, WriteItemType.SHARD: 1, WriteItemType.BYTE_IO: 2}


def _entries(tables: Sequence[LocalTable], groups: list[tuple[Skeleton, list[int]]]
             ) -> _AllEntries:
    names: dict[str, int] = {}
    rows: list[Row] = []
    props: list[TensorProperties | None] = []
    width = max((len(sk.rows) for sk, _ in groups), default=0) + 1
    kdim = max((max(r.dims, max(r.key, 0)) for sk, _ in groups for r in sk.rows), default=0)
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "rank", "pos", "group", "row", "column", "key", "offsets", "sizes")}
    for g, (sk, ranks) in enumerate(groups):
        n, m = len(ranks), len(sk.rows)
        if not m:
            continue
        base = len(rows)
        rows += sk.rows
        props += [sk.properties[r.props] if r.props >= 0 else None for r in sk.rows]
        for r in sk.rows:
            names.setdefault(r.fqn, len(names))
        nums = torch.stack([tables[r].numbers for r in ranks]) if sk.width else \
            torch.zeros((n, 0), dtype=torch.int64)
        # Two extra columns to gather from: -1 (padding of offsets and keys), 1 (of sizes).
        ext = torch.cat([nums, torch.full((n, 1), -1, dtype=torch.int64),
                         torch.ones((n, 1), dtype=torch.int64)], dim=1)
        pad, one = sk.width, sk.width + 1
        key_at, off_at, size_at = [], [], []
        for r in sk.rows:
            k = -1 if r.key == KEY_NONE else r.dims if r.key == KEY_CHUNK else r.key
            key_at.append([r.start + j if j < k else pad for j in range(kdim)])
            lo = r.start + max(r.key, 0)
            off_at.append([lo + j if j < r.dims else pad for j in range(kdim)])
            size_at.append([lo + r.dims + j if j < r.dims else one for j in range(kdim)])
        flat = n * m
        for part, where in (("key", key_at), ("offsets", off_at), ("sizes", size_at)):
            cols[part].append(ext[:, torch.tensor(where, dtype=torch.int64).reshape(m, kdim)]
                              .reshape(flat, kdim))
        rt = torch.tensor(ranks, dtype=torch.int64)
        cols["rank"].append(rt.repeat_interleave(m))
        cols["pos"].append(torch.arange(m).repeat(n))
        cols["group"].append(torch.full((flat,), g, dtype=torch.int64))
        cols["row"].append(torch.arange(n).repeat_interleave(m))
        cols["column"].append(torch.arange(base, base + m).repeat(n))
    if not rows:
        empty = torch.zeros(0, dtype=torch.int64)
        pair = torch.zeros((0, kdim), dtype=torch.int64)
        return _AllEntries(empty, empty, empty, empty, empty, empty, empty,
                           torch.zeros(0, dtype=torch.bool), empty, pair, pair, empty, empty,
                           empty, [], [], empty, [])
    cat = {k: torch.cat(v) for k, v in cols.items()}
    column = cat["column"]
    order = cat["rank"] * width + cat["pos"]
    perm = torch.argsort(order, stable=True)
    column = column[perm]
    per_col = {
        "fqn": [names[r.fqn] for r in rows],
        "kind": [_KIND_CODE[r.kind] for r in rows],
        "kclass": [-1 if r.key == KEY_NONE else r.dims if r.key == KEY_CHUNK else r.key
                   for r in rows],
        "dims": [r.dims for r in rows],
        "itemsize": [p.dtype.itemsize if p is not None else -1 for p in props],
        "small": [r.kind == WriteItemType.TENSOR and p is not None and
                  math.prod(r.size) * p.dtype.itemsize <= SMALL_REPLICATED_BYTES
                  for r, p in zip(rows, props, strict=True)],
        "hint": [-1 if r.hint is None or r.props >= 0 else r.hint for r in rows],
    }
    at = {k: torch.tensor(v)[column] for k, v in per_col.items()}
    offsets, sizes, key = cat["offsets"][perm], cat["sizes"][perm], cat["key"][perm]
    itemsize = at["itemsize"]
    nbytes = torch.where(itemsize >= 0, torch.prod(sizes, dim=1) * itemsize,
                         torch.full_like(itemsize, -1))
    ids, _ = _row_ids(torch.cat([at["fqn"][:, None], at["kclass"][:, None], key], dim=1))
    return _AllEntries(cat["rank"][perm], cat["pos"][perm], cat["group"][perm],
                       cat["row"][perm], order[perm], at["fqn"], at["kind"], at["small"],
                       at["dims"], offsets, sizes, nbytes, ids, at["hint"], list(names),
                       rows, column, props)


def _shared_keys(e: _AllEntries, alive: torch.Tensor
                 ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """The keys more than one rank holds among the entries still ``alive``: (key, its
    entries, the first entry of each of its ranks), in plan order within each."""
    idx = torch.nonzero(alive).flatten()
    idx = idx[torch.argsort(e.key[idx], stable=True)]  # by key, plan order within
    if len(idx) < 2:
        return []
    keys, ranks = e.key[idx], e.rank[idx]
    new_key = torch.ones(len(idx), dtype=torch.bool)
    new_key[1:] = keys[1:] != keys[:-1]
    new_rank = new_key.clone()
    new_rank[1:] |= ranks[1:] != ranks[:-1]
    segment = torch.cumsum(new_key.long(), 0) - 1
    distinct = torch.zeros(int(segment[-1]) + 1, dtype=torch.int64).index_add_(
        0, segment, new_rank.long())
    many = torch.nonzero(distinct > 1).flatten()
    if len(many) == 0:
        return []
    starts = torch.nonzero(new_key).flatten()
    ends = torch.cat([starts[1:], torch.tensor([len(idx)])])
    return [(int(keys[s]), idx[s:t], idx[s:t][new_rank[s:t]])
            for s, t in zip(starts[many].tolist(), ends[many].tolist(), strict=True)]


def _finish_plan(e: _AllEntries, alive: torch.Tensor, piece_start: torch.Tensor,
                 piece_rows: torch.Tensor, tables: Sequence[LocalTable],
                 groups: list[tuple[Skeleton, list[int]]], world: int,
                 merge_mappings: bool) -> GlobalPlan:
    """What is kept per rank, the hints, per name its chunks or value, DCP's checks."""
    kept = [torch.zeros((len(ranks), len(sk.rows)), dtype=torch.bool) for sk, ranks in groups]
    hints = [torch.full((len(ranks), len(sk.rows)), -1, dtype=torch.int64)
             for sk, ranks in groups]
    live = torch.nonzero(alive).flatten()  # plan order
    live = live[torch.argsort(e.fqn[live], stable=True)]  # by name, plan order within
    fqn = e.fqn[live]
    first = torch.ones(len(live), dtype=torch.bool)
    first[1:] = fqn[1:] != fqn[:-1]
    starts = torch.nonzero(first).flatten()
    seg = torch.cumsum(first.long(), 0) - 1
    within = torch.arange(len(live)) - starts[seg] if len(live) else seg
    is_value = e.kind[live] == _KIND_CODE[WriteItemType.BYTE_IO]
    pieces_at = piece_rows[live] >= 0
    # DCP's invariants: after a name's first item only shards (a piece is one) follow it.
    bad = ~first & (e.kind[live] != _KIND_CODE[WriteItemType.SHARD]) & ~pieces_at
    if bool(bad.any()):
        name = e.names[int(fqn[torch.nonzero(bad).flatten()[0]])]
        raise AssertionError(f"{name!r}: two write items of one value or whole tensor")
    bad = ~first & is_value[starts[seg]] if len(live) else bad
    if bool(bad.any()):
        name = e.names[int(fqn[torch.nonzero(bad).flatten()[0]])]
        raise AssertionError(f"{name!r}: a value and a tensor of one name")
    bad = e.dims[live] != e.dims[live[starts]][seg] if len(live) else bad
    if bool(bad.any()):
        name = e.names[int(fqn[torch.nonzero(bad).flatten()[0]])]
        raise AssertionError(f"{name!r}: chunks of different dimensions")
    # Kept items and hints, per group (a value keeps its own hint).
    hint = torch.where(is_value, e.hint[live], within)
    for g in range(len(groups)):
        mine = e.group[live] == g
        kept[g][e.row_in_group[live[mine]], e.pos[live[mine]]] = True
        hints[g][e.row_in_group[live[mine]], e.pos[live[mine]]] = hint[mine]
    offsets, sizes = e.offsets[live], e.sizes[live]
    if bool(pieces_at.any()):  # the rows each writer of a split item writes
        offsets[pieces_at, 0] += piece_start[live][pieces_at]
        sizes[pieces_at, 0] = piece_rows[live][pieces_at]
    pieces: dict[tuple[int, int, int], tuple[int, int]] = {}
    for j in torch.nonzero(pieces_at).flatten().tolist():
        at = int(live[j])
        pieces[(int(e.group[at]), int(e.row_in_group[at]), int(e.pos[at]))] = (
            int(piece_start[at]), int(piece_rows[at]))
    # Per name: a slice of the kept entries; the metadata's order is their first items'.
    bounds = [*starts.tolist(), len(live)]
    order_of = e.order[live[starts]].tolist()
    ranks = e.rank[live]
    out_tensors: dict[str, _Tensor] = {}
    values: dict[str, int] = {}
    errors: dict[str, list[str]] = {}
    firsts: list[tuple[int, str]] = []
    for k, (s, t) in enumerate(itertools.pairwise(bounds)):
        j = int(live[s])
        name = e.names[int(fqn[s])]
        firsts.append((order_of[k], name))
        row, props = e.rows[int(e.column[j])], e.props[int(e.column[j])]
        if props is None:
            values[name] = int(ranks[s])
            continue
        d = row.dims
        t_off, t_size = offsets[s:t, :d], sizes[s:t, :d]
        out_tensors[name] = _Tensor(props, row.size, t_off, t_size, ranks[s:t])
        if row.size:
            found = _tiling(name, row.size, t_off, t_size, check_volume=world > 1)
            if found:
                errors[name] = found
    firsts.sort()
    if errors:  # in the metadata's order, as DCP's check reports them
        raise ValueError("Failed to validate global plan: " + summary(
            [msg for _, name in firsts for msg in errors.get(name, ())]))
    merged: dict[str, Any] | None = None
    if merge_mappings:
        merged = {}
        last: Any = None
        for tb in reversed(tables):  # ChainMap's order: the last map's keys first
            pd = tb.planner_data
            if isinstance(pd, dict) and not (last is not None and (pd is last or pd == last)):
                merged.update(pd)  # (a map equal to the one before changes nothing)
                last = pd
    return GlobalPlan(world, groups, kept, hints, [f for _, f in firsts], out_tensors, values,
                      merged, list(tables), pieces)


def _row_ids(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An id per row of ``rows`` (n x k), equal for equal rows, and how many distinct rows:
    one stable sort per column (``torch.unique(dim=0)`` is many times slower)."""
    order = torch.arange(len(rows))
    for j in range(rows.shape[1] - 1, -1, -1):
        order = order[torch.argsort(rows[order, j], stable=True)]
    ordered = rows[order]
    new = torch.ones(len(rows), dtype=torch.bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(dim=1)
    ids = torch.cumsum(new.long(), 0) - 1
    inverse = torch.empty(len(rows), dtype=torch.int64)
    inverse[order] = ids
    return inverse, int(ids[-1]) + 1


#: A tensor of at most this many chunks is checked by `tiling_errors` itself; more, by one sort
#: of tensor columns first (`_tiles_by_one_cut`).
_FEW_CHUNKS = 64


def _tiling(fqn: str, size: tuple[int, ...], offsets: torch.Tensor, sizes: torch.Tensor, *,
            check_volume: bool) -> list[str]:
    """`tiling_errors`' findings on the chunks (m x d), without building them where they are
    many and a cut of the tensor along one dimension that tiles it (checked here by one
    sort)."""
    if len(offsets) > _FEW_CHUNKS and _tiles_by_one_cut(size, offsets, sizes):
        return []
    chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
              for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)]
    return tiling_errors(fqn, size, chunks, check_volume=check_volume)


def _tiles_by_one_cut(size: tuple[int, ...], offsets: torch.Tensor, sizes: torch.Tensor
                      ) -> bool:
    """`ckptfs.format.tiling`'s cut along one dimension, in columns: every chunk's other
    extents the tensor's own, the non-empty ones meeting end to start from 0 to the end, each
    empty one on a boundary of theirs."""
    ndim = len(size)
    if len(offsets) == 0 or ndim == 0 or min(size) <= 0 or offsets.shape[1] != ndim:
        return False
    full = torch.tensor(size, dtype=torch.int64)
    differ = torch.nonzero(sizes[0] != full).flatten()
    d = int(differ[0]) if len(differ) else 0
    others = [e for e in range(ndim) if e != d]
    if others and not (bool((sizes[:, others] == full[others]).all())
                       and bool((offsets[:, others] == 0).all())):
        return False
    length, start = sizes[:, d], offsets[:, d]
    if bool((length < 0).any()):
        return False
    nonempty = length > 0
    starts, lengths = start[nonempty], length[nonempty]
    order = torch.argsort(starts)
    starts, lengths = starts[order], lengths[order]
    ends = starts + lengths
    if len(starts) == 0 or int(starts[0]) != 0 or int(ends[-1]) != size[d] or \
            not bool((starts[1:] == ends[:-1]).all()):
        return False
    empty = start[~nonempty]
    if len(empty) == 0:
        return True
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), ends])
    return bool(torch.isin(empty, bounds).all())
