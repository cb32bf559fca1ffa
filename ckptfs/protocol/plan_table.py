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
each other replicated tensor written by the holder `balance_writers` picks), the index hints,
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
from ckptfs.protocol.balance import balance_writers
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
#: ``gather_small`` (format v5); larger ones are spread over the ranks by `balance_writers`.
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

    def part(self, rank: int) -> tuple[list[int], list[int | None]]:
        """Rank ``rank``'s part: the positions in its local plan of the items it writes, and
        their index hints."""
        g, i = self._where()[rank]
        pos = torch.nonzero(self.kept[g][i]).flatten()
        hints = self.hints[g][i][pos].tolist()
        return pos.tolist(), [None if h < 0 else h for h in hints]

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
            pos, hints = self.part(rank)
            kept = [_hinted(items[p], h) for p, h in zip(pos, hints, strict=True)]
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


def _is_int(v: Any) -> bool:
    return type(v) is int


def decode_skeleton(blob: Any) -> Skeleton:
    """The skeleton a rank sent (`LocalTable.of_plan`'s ``blob``), every field checked:
    ``ValueError`` naming what is wrong."""
    if not isinstance(blob, str):
        raise ValueError("a local save plan's skeleton: a string wanted")
    try:
        doc = msgpack.unpackb(decode_bytes(blob), raw=False, use_list=True,
                              strict_map_key=True)
    except Exception as exc:  # not base64, not msgpack
        raise ValueError(f"a local save plan's skeleton: {exc}") from exc
    if not (isinstance(doc, list) and len(doc) == 2 and isinstance(doc[0], list)
            and isinstance(doc[1], list)):
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
    if not isinstance(text, str):
        raise ValueError("a local save plan's planner data: its mappings wanted")
    try:
        raw = msgpack.unpackb(decode_bytes(text), raw=False, use_list=True,
                              strict_map_key=True)
    except Exception as exc:  # not base64, not msgpack
        raise ValueError(f"a local save plan's planner data: {exc}") from exc
    if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], list)):
        raise ValueError("a local save plan's planner data: [mappings, tree] wanted")
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


@dataclass
class _Column:
    """One item position of one skeleton group: its row and its ranks' numbers."""

    group: int
    pos: int
    row: Row
    ranks: torch.Tensor      # (n,)
    numbers: torch.Tensor    # (n, width of the group)


def global_plan(tables: Sequence[LocalTable], *, gather_small: bool = False,
                merge_mappings: bool = True) -> GlobalPlan:
    """The global plan of every rank's local plan (``tables``, in rank order): module
    docstring.  ``gather_small``: every replicated whole tensor of at most
    `SMALL_REPLICATED_BYTES` is stored by the lowest rank holding it (format v5).  Raises
    ``ValueError`` ("Failed to validate global plan: ...", DCP's words) if a tensor's kept
    chunks do not tile it once, ``AssertionError`` for two items of one value or whole tensor
    (DCP's own invariants)."""
    world = len(tables)
    by_blob: dict[str, int] = {}
    groups: list[tuple[Skeleton, list[int]]] = []
    for r, t in enumerate(tables):
        g = by_blob.get(t.skeleton.blob)
        if g is None:
            g = by_blob[t.skeleton.blob] = len(groups)
            groups.append((t.skeleton, []))
        groups[g][1].append(r)
    width = max((len(sk.rows) for sk, _ in groups), default=0) + 1
    columns: dict[str, list[_Column]] = {}
    for g, (sk, ranks) in enumerate(groups):
        nums = torch.stack([tables[r].numbers for r in ranks]) if sk.width else \
            torch.zeros((len(ranks), 0), dtype=torch.int64)
        rt = torch.tensor(ranks, dtype=torch.int64)
        for p, row in enumerate(sk.rows):
            columns.setdefault(row.fqn, []).append(_Column(g, p, row, rt, nums))
    kept = [torch.ones((len(ranks), len(sk.rows)), dtype=torch.bool) for sk, ranks in groups]
    hints = [torch.tensor([[-1 if r.hint is None or r.props >= 0 else r.hint
                            for r in sk.rows]], dtype=torch.int64).expand(len(ranks), -1).clone()
             if sk.rows else torch.zeros((len(ranks), 0), dtype=torch.int64)
             for sk, ranks in groups]
    # Pass 1: every name's entries, their keys (name and index offset) and holders.
    entries = {fqn: _Entries(cols, width, groups) for fqn, cols in columns.items()}
    if gather_small:
        for e in entries.values():
            e.keep_lowest_of_small()
    # Pass 2: the replicated keys and their writers.
    fixed = torch.zeros(world, dtype=torch.int64)
    replicated: list[tuple[int, _Entries, int]] = []  # (order, entries, key)
    for e in entries.values():
        live = e.alive & (e.nbytes >= 0)
        fixed.index_add_(0, e.rank[live], e.nbytes[live])
        for k, at in e.replicated_keys():
            replicated.append((at, e, k))
    replicated.sort(key=lambda x: x[0])
    tensors = [(e, k) for _, e, k in replicated if e.key_size(k) >= 0]
    for e, k in tensors:
        holders = e.holders(k)
        fixed[holders] -= e.key_size(k)
    writers = balance_writers([(e.key_size(k), e.holders(k).tolist()) for e, k in tensors],
                              world, fixed=fixed.tolist())
    for (e, k), w in zip(tensors, writers, strict=True):
        e.write_by(k, w)
    for _, e, k in replicated:
        if e.key_size(k) < 0:  # a value: the lowest rank holding it
            e.write_by(k, int(e.holders(k)[0]))
    # Pass 3: what is kept, the hints, the metadata's tensors and values, the check.
    firsts: list[tuple[int, str]] = []
    out_tensors: dict[str, _Tensor] = {}
    values: dict[str, int] = {}
    errors: dict[str, list[str]] = {}
    for fqn, e in entries.items():
        keep = e.alive
        for c, col in enumerate(e.columns):
            sel = e.col == c
            kept[col.group][e.row_in_group[sel], col.pos] = keep[sel]
        idx = torch.nonzero(keep).flatten()  # plan order
        if len(idx) == 0:
            continue
        firsts.append((int(e.order[idx[0]]), fqn))
        cols = e.col[idx].tolist() if len(e.columns) > 1 else [0] * len(idx)
        first = e.columns[cols[0]].row
        if any(e.columns[c].row.kind != WriteItemType.SHARD for c in set(cols[1:])):
            raise AssertionError(f"{fqn!r}: two write items of one value or whole tensor")
        if first.props < 0:
            if len(idx) > 1:
                raise AssertionError(f"{fqn!r}: a value and a tensor of one name")
            values[fqn] = int(e.rank[idx[0]])
            continue
        props = groups[e.columns[cols[0]].group][0].properties[first.props]
        chunks = e.chunks(idx)
        if chunks is None:
            raise AssertionError(f"{fqn!r}: chunks of different dimensions")
        offsets, sizes = chunks
        hint_of = torch.arange(len(idx), dtype=torch.int64)
        for c, col in enumerate(e.columns):
            sel = e.col[idx] == c
            hints[col.group][e.row_in_group[idx[sel]], col.pos] = hint_of[sel]
        out_tensors[fqn] = _Tensor(props, first.size, offsets, sizes, e.rank[idx])
        if first.size:
            found = _tiling(fqn, first.size, offsets, sizes, check_volume=world > 1)
            if found:
                errors[fqn] = found
    firsts.sort()
    if errors:  # in the metadata's order, as DCP's check reports them
        raise ValueError("Failed to validate global plan: " + summary(
            [msg for _, fqn in firsts for msg in errors.get(fqn, ())]))
    merged: dict[str, Any] | None = None
    if merge_mappings:
        merged = {}
        last: Any = None
        for t in reversed(tables):  # ChainMap's order: the last map's keys first
            pd = t.planner_data
            if isinstance(pd, dict) and not (last is not None and (pd is last or pd == last)):
                merged.update(pd)  # (a map equal to the one before changes nothing)
                last = pd
    return GlobalPlan(world, groups, kept, hints, [f for _, f in firsts], out_tensors, values,
                      merged, list(tables))


class _Entries:
    """Every entry (a rank's item) of one name, in plan order (rank, then position): its
    rank, column, row in its group, key id (equal ids: equal index offsets), bytes (-1 for a
    value) and whether it is still kept; and the keys several ranks hold."""

    def __init__(self, columns: list[_Column], width: int,
                 groups: list[tuple[Skeleton, list[int]]]) -> None:
        self.columns = columns
        ranks, cols, order, rows_in, nbytes = [], [], [], [], []
        by_width: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for c, col in enumerate(columns):
            n, row, s = len(col.ranks), col.row, col.row.start
            ranks.append(col.ranks)
            cols.append(torch.full((n,), c, dtype=torch.int64))
            order.append(col.ranks * width + col.pos)
            rows_in.append(torch.arange(n, dtype=torch.int64))
            k = -1 if row.key == KEY_NONE else row.dims if row.key == KEY_CHUNK else row.key
            by_width.setdefault(k, []).append((c, col.numbers[:, s:s + max(k, 0)]))
            if row.props < 0:
                nbytes.append(torch.full((n,), -1, dtype=torch.int64))
            else:
                d, skip = row.dims, max(row.key, 0)
                itemsize = groups[col.group][0].properties[row.props].dtype.itemsize
                sz = col.numbers[:, s + skip + d:s + skip + 2 * d]
                nbytes.append(torch.prod(sz, dim=1) * itemsize)
        # Key ids: per width of the index offset (-1: None), one id per distinct offsets.
        keys: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * len(columns)
        base = 0
        for k, parts in by_width.items():
            stacked = torch.cat([p for _, p in parts])
            if k > 0 and len(stacked):
                inverse, count = _row_ids(stacked)
            else:  # None, or a 0-dim tensor's empty offsets: one key
                inverse, count = torch.zeros(len(stacked), dtype=torch.int64), 1
            at = 0
            for c, p in parts:
                keys[c] = inverse[at:at + len(p)] + base
                at += len(p)
            base += count
        order_t = torch.cat(order)
        perm = torch.argsort(order_t, stable=True)
        self.order = order_t[perm]
        self.rank = torch.cat(ranks)[perm]
        self.col = torch.cat(cols)[perm]
        self.row_in_group = torch.cat(rows_in)[perm]
        self.key = torch.cat(keys)[perm]
        self.nbytes = torch.cat(nbytes)[perm]
        self.alive = torch.ones(len(self.rank), dtype=torch.bool)
        self.small = [c.row.kind == WriteItemType.TENSOR and c.row.props >= 0 and
                      math.prod(c.row.size) * groups[c.group][0].properties[
                          c.row.props].dtype.itemsize <= SMALL_REPLICATED_BYTES
                      for c in columns]
        self._holders: dict[int, torch.Tensor] = {}
        self._sizes: dict[int, int] = {}
        self._segments: list[tuple[int, torch.Tensor]] = []
        self._recount()

    def _recount(self) -> None:
        """The keys more than one rank holds (among the entries still kept): each key with
        its entries that are the first of their rank (plan order)."""
        idx = torch.nonzero(self.alive).flatten()
        idx = idx[torch.argsort(self.key[idx], stable=True)]  # by key, plan order within
        self._segments = []
        if len(idx) < 2:
            return
        keys, ranks = self.key[idx], self.rank[idx]
        new_key = torch.ones(len(idx), dtype=torch.bool)
        new_key[1:] = keys[1:] != keys[:-1]
        new_rank = new_key.clone()
        new_rank[1:] |= ranks[1:] != ranks[:-1]
        segment = torch.cumsum(new_key.long(), 0) - 1
        distinct = torch.zeros(int(segment[-1]) + 1, dtype=torch.int64).index_add_(
            0, segment, new_rank.long())
        shared = torch.nonzero(distinct > 1).flatten()
        if len(shared) == 0:
            return
        starts = torch.nonzero(new_key).flatten()
        ends = torch.cat([starts[1:], torch.tensor([len(idx)])])
        for s, e in zip(starts[shared].tolist(), ends[shared].tolist(), strict=True):
            self._segments.append((int(keys[s]), idx[s:e][new_rank[s:e]]))

    def keep_lowest_of_small(self) -> None:
        """``small_tensors_from_lowest_rank``: a small replicated whole tensor's key stays in
        the plan of the lowest rank holding it (every item of that key there), no other."""
        if not any(self.small):
            return
        small = torch.tensor(self.small, dtype=torch.bool)[self.col]
        changed = False
        for key, _ in self._segments:
            sel = self.key == key
            mine = small & sel & self.alive
            if not bool(mine.any()):
                continue
            drop = sel & (self.rank != self.rank[mine][0])
            if bool((drop & self.alive).any()):
                self.alive &= ~drop
                changed = True
        if changed:
            self._recount()

    def replicated_keys(self) -> list[tuple[int, int]]:
        """(key, the plan order at which it got its second holder) of each key held by more
        than one rank; notes each one's holders and size (that of the last holder's first
        item, -1 for a value)."""
        out = []
        for key, firsts in self._segments:
            self._holders[key] = self.rank[firsts]
            self._sizes[key] = int(self.nbytes[firsts[-1]])
            out.append((key, int(self.order[firsts[1]])))
        return out

    def holders(self, key: int) -> torch.Tensor:
        return self._holders[key]

    def key_size(self, key: int) -> int:
        return self._sizes[key]

    def write_by(self, key: int, rank: int) -> None:
        self.alive &= ~((self.key == key) & (self.rank != rank))

    def chunks(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The offsets and sizes (m x d) of the entries ``idx`` (tensors of one dimension
        count, else None)."""
        cols = self.col[idx]
        present = sorted(set(cols.tolist())) if len(self.columns) > 1 else [0]
        dims = {self.columns[c].row.dims for c in present}
        if len(dims) != 1:
            return None
        d = dims.pop()
        if len(present) == 1:
            col = self.columns[present[0]]
            lo = col.row.start + max(col.row.key, 0)
            rows = self.row_in_group[idx]
            return col.numbers[rows, lo:lo + d], col.numbers[rows, lo + d:lo + 2 * d]
        offsets = torch.empty((len(idx), d), dtype=torch.int64)
        sizes = torch.empty((len(idx), d), dtype=torch.int64)
        for c in present:
            col = self.columns[c]
            sel = cols == c
            lo = col.row.start + max(col.row.key, 0)
            rows = self.row_in_group[idx[sel]]
            offsets[sel] = col.numbers[rows, lo:lo + d]
            sizes[sel] = col.numbers[rows, lo + d:lo + 2 * d]
        return offsets, sizes


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


def _tiling(fqn: str, size: tuple[int, ...], offsets: torch.Tensor, sizes: torch.Tensor, *,
            check_volume: bool) -> list[str]:
    """`tiling_errors`' findings on the chunks (m x d), without building them where they are
    a cut of the tensor along one dimension that tiles it (checked here by one sort)."""
    if _tiles_by_one_cut(size, offsets, sizes):
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
