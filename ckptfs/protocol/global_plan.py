"""The global plan of a collective save, made of every rank's table (`ckptfs.protocol.plan_table`).

`global_plan` stacks the numbers of the ranks sharing a skeleton into one matrix, every rank's
every item an *entry* (a row of one set of columns, in plan order), and makes the global plan
with tensor operations over all of them at once (about 45, whatever the ranks and names):
DCP's deduplication (every value and, for format v5, every small replicated tensor from the
lowest rank holding it; each other replicated tensor written by the holder `split_writers`
picks, or split along its rows between several where it does not fit under the mean), the
index hints, DCP's check that each tensor's chunks tile it once (`tiling_errors`' verdict; a
cut along one dimension of many chunks is checked by sorting one column first), and each
rank's part.  Python loops run over the keys several ranks hold and, once, over the names.
What is O(items) by nature is made only on demand: DCP's ``Metadata`` and save plans
(`GlobalPlan.metadata`, `GlobalPlan.save_plans`: format v2's ``dcp.msgpack`` lists every
chunk) and, for format v5, the tensor spec's layouts (`ckptfs.protocol.rank_metadata`'s
``PerRankSave.spec_part``, from the columns: O(tensors) for the grids sharding makes).

The result is exactly what DCP's ``dedup_save_plans`` then ``create_default_global_save_plan``
make of the same plans for the same writers, in the same order (tests/protocol/
test_plan_tiling.py); `ckptfs.protocol.sharded_plan.SavePlanner.create_global_plan` (DCP's own
hook, under a plain ``dcp.save``) runs through it too, over tables made of DCP's plans.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ckptfs.format.tiling import summary, tiling_errors
from ckptfs.protocol.balance import split_writers
from ckptfs.protocol.plan_table import (
    KEY_CHUNK,
    KEY_NONE,
    SMALL_REPLICATED_BYTES,
    LocalTable,
    Row,
    Skeleton,
)
from ckptfs.protocol.replicas import check_replicas, is_divergent

__all__ = ["GlobalPlan", "global_plan", "piece_of"]


@dataclass(frozen=True)
class _Holders:
    """Every entry of a key several ranks hold: its key's number (``seg``, into ``names``),
    its rank and its position in that rank's plan."""

    names: list[str]
    seg: torch.Tensor
    rank: torch.Tensor
    pos: torch.Tensor


def _holders_of(e: _AllEntries, shared: list[tuple[int, torch.Tensor, torch.Tensor]]
                ) -> _Holders | None:
    if not shared:
        return None
    idx = torch.cat([i for _, i, _ in shared])
    lengths = torch.tensor([len(i) for _, i, _ in shared], dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(len(shared)), lengths)
    firsts = torch.stack([i[0] for _, i, _ in shared])
    names = [e.names[f] for f in e.fqn[firsts].tolist()]
    return _Holders(names, seg, e.rank[idx], e.pos[idx])


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
    #: Who holds each key several ranks hold, to compare their copies at every save.
    holders: _Holders | None = None

    def check_replicas(self, tables: Sequence[LocalTable]) -> None:
        """Refuse (`ReplicaMismatchError`, naming the keys and ranks) a save whose ranks hold
        different copies of a key the checkpoint stores once: the digests ``tables`` carry
        (this save's: a plan kept for their layout was made of an earlier save's) of every
        key several ranks hold, compared in columns."""
        h = self.holders
        if h is None or all(t.replicas is None for t in tables):
            return
        lens = [len(t.skeleton.rows) for t in tables]
        flat = torch.cat([t.replicas if t.replicas is not None
                          else torch.zeros(n, dtype=torch.int64)
                          for t, n in zip(tables, lens, strict=True)])
        starts = torch.cumsum(torch.tensor([0, *lens[:-1]], dtype=torch.int64), 0)
        d = flat[starts[h.rank] + h.pos]
        nz = d != 0
        if not bool(nz.any()):
            return
        lim = torch.iinfo(torch.int64)
        n = len(h.names)
        lo = torch.full((n,), lim.max).scatter_reduce(0, h.seg[nz], d[nz], "amin")
        hi = torch.full((n,), lim.min).scatter_reduce(0, h.seg[nz], d[nz], "amax")
        bad = torch.nonzero((lo != hi) & (hi != lim.min)).flatten().tolist()
        if bad:
            found = []
            for k in bad:
                m = h.seg == k
                found.append((h.names[k], h.rank[m].tolist(), d[m].tolist()))
            check_replicas(found)

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



def global_plan(tables: Sequence[LocalTable], *, gather_small: bool = False,
                merge_mappings: bool = True, divergent: Sequence[str] = ()) -> GlobalPlan:
    """The global plan of every rank's local plan (``tables``, in rank order): module
    docstring.  ``gather_small``: every replicated whole tensor of at most
    `SMALL_REPLICATED_BYTES` is stored by the lowest rank holding it (format v5).  Raises
    ``ValueError`` ("Failed to validate global plan: ...", DCP's words) if a tensor's kept
    chunks do not tile it once, ``AssertionError`` for two items of one value or whole tensor
    (DCP's own invariants).

    Every rank's every item is one *entry*; the entries of all ranks and names are columns of
    one set of tensors (so the number of tensor operations does not grow with the ranks or
    the names), sorted in plan order (rank, then position: DCP's order of the metadata's
    chunks).  ``divergent``: key prefixes of tensors meant to differ between ranks, each
    written whole by its lowest holder (never in pieces from several).  A Python loop runs
    only over the keys several ranks hold and, at the end, over
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
    copies = _holders_of(e, shared)
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
        if divergent and is_divergent(e.names[int(e.fqn[idx[0]])], divergent):
            split = [(int(e.rank[firsts[0]]), 0, 0)]  # one copy, whole: the lowest holder's
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
    plan = _finish_plan(e, alive, piece_start, piece_rows, tables, groups, world,
                        merge_mappings)
    plan.holders = copies
    return plan


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
    fqn_of, col_of, rank_of = fqn.tolist(), e.column[live].tolist(), ranks.tolist()
    for k, (s, t) in enumerate(itertools.pairwise(bounds)):
        name = e.names[fqn_of[s]]
        firsts.append((order_of[k], name))
        row, props = e.rows[col_of[s]], e.props[col_of[s]]
        if props is None:
            values[name] = rank_of[s]
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
    chunks = [_Chunk(tuple(o), tuple(s))
              for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)]
    return tiling_errors(fqn, size, chunks, check_volume=check_volume)


class _Chunk(NamedTuple):
    """A chunk as `tiling_errors` reads it (``offsets``, ``sizes``), printed as DCP prints
    its ``ChunkStorageMetadata`` in the check's findings."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __repr__(self) -> str:
        return (f"ChunkStorageMetadata(offsets=torch.Size({list(self.offsets)}), "
                f"sizes=torch.Size({list(self.sizes)}))")


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
