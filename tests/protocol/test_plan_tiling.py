"""The sharded save's check of the global plan (`check_global_plan`): DCP's verdict on every
layout (chunks within the tensor, no two overlapping, their volumes summing to the tensor's),
without DCP's pairwise comparison."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import ChainMap
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import save_sharded
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

import ckptfs
from ckptfs.bench.scale import Spec, local_plans
from ckptfs.format.tiling import tiling_errors
from ckptfs.protocol import sharded_plan
from ckptfs.protocol.plan_table import LocalTable
from ckptfs.protocol.sharded_plan import (
    SavePlanner,
    check_global_plan,
    values_from_lowest_rank,
)

Box = tuple[list[int], list[int]]


def chunk(offsets: list[int], sizes: list[int]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def metadata(size: list[int], boxes: list[Box]) -> Metadata:
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                               [chunk(o, s) for o, s in boxes])
    return Metadata({"w": md})


def verdicts(size: list[int], boxes: list[Box], plans: int = 2) -> tuple[bool, bool]:
    """(ckptfs finds nothing wrong, DCP finds nothing wrong)."""
    md = metadata(size, boxes)
    global_plan = [SavePlan([]) for _ in range(plans)]
    ours = not tiling_errors("w", tuple(size), md.state_dict_metadata["w"].chunks,
                             check_volume=plans > 1)
    found = _validate_global_plan(global_plan, md)  # torch 2.9: a bool (valid); later: errors
    return ours, found if isinstance(found, bool) else not found


def grid(size: list[int], cuts: list[int]) -> list[Box]:
    """``size`` cut into ``cuts[d]`` near-equal pieces along each dimension."""
    boxes: list[Box] = [([], [])]
    for n, k in zip(size, cuts, strict=True):
        edges = [n * i // k for i in range(k + 1)]
        boxes = [([*o, a], [*s, b - a]) for o, s in boxes for a, b in itertools.pairwise(edges)]
    return boxes


def test_1d_fsdp_tiling_passes() -> None:
    boxes = grid([10], [4])
    assert verdicts([10], boxes) == (True, True)
    check_global_plan([SavePlan([]), SavePlan([])], metadata([10], boxes))


def test_2d_fsdp_by_tp_tiling_passes() -> None:
    boxes = grid([12, 30], [4, 3])
    assert verdicts([12, 30], boxes) == (True, True)
    check_global_plan([SavePlan([]), SavePlan([])], metadata([12, 30], boxes))


def test_uneven_shards_with_empty_ones_at_the_end_pass() -> None:
    boxes = [([0, 0], [2, 8]), ([2, 0], [2, 8]), ([4, 0], [1, 8]), ([5, 0], [0, 8]),
             ([5, 0], [0, 8])]
    assert verdicts([5, 8], boxes) == (True, True)


@pytest.mark.parametrize("name,boxes,finding", [
    ("overlap", [([0, 0], [3, 8]), ([2, 0], [2, 8])], "overlapping chunks"),
    ("gap", [([0, 0], [2, 8]), ([3, 0], [1, 8])], "invalid fill"),
    ("out of bounds", [([0, 0], [2, 8]), ([2, 0], [3, 8])], "out of bounds"),
    ("duplicate", [([0, 0], [2, 8]), ([2, 0], [2, 8]), ([2, 0], [2, 8])],
     "overlapping chunks"),
    ("overlap in a grid", [([0, 0], [2, 4]), ([0, 4], [2, 4]), ([2, 0], [2, 5]),
                           ([2, 4], [2, 4])], "overlapping chunks"),
])
def test_broken_tilings_raise(name: str, boxes: list[Box], finding: str) -> None:
    assert verdicts([4, 8], boxes) == (False, False), name
    with pytest.raises(ValueError, match=f"Failed to validate global plan: .*{finding}"):
        check_global_plan([SavePlan([]), SavePlan([])], metadata([4, 8], boxes))


@pytest.mark.parametrize("dim", [0, 1])
def test_cuts_along_one_dim_keep_dcps_verdict(dim: int) -> None:
    """The cut along one dimension (FSDP's, TP's), checked without the sweep when it tiles:
    empty chunks on a boundary pass, one strictly inside a chunk, a gap, an overlap, a chunk
    past the end or not spanning another dimension fail, as with DCP."""
    def cut(pieces: list[tuple[int, int]]) -> list[Box]:
        return [([o, 0][::1 if dim == 0 else -1], [n, 3][::1 if dim == 0 else -1])
                for o, n in pieces]
    size = [6, 3] if dim == 0 else [3, 6]
    layouts = {
        "tiles": ([(0, 2), (2, 2), (4, 2)], True),
        "uneven, empty at the end": ([(0, 3), (3, 3), (6, 0), (6, 0)], True),
        "empty on an inner boundary": ([(0, 3), (3, 0), (3, 3)], True),
        "empty strictly inside": ([(0, 3), (1, 0), (3, 3)], False),
        "gap": ([(0, 2), (3, 3)], False),
        "overlap": ([(0, 4), (3, 3)], False),
        "past the end": ([(0, 3), (3, 4)], False),
        "empty past the end": ([(0, 3), (3, 3), (7, 0)], False),
    }
    for name, (pieces, ok) in layouts.items():
        assert verdicts(size, cut(pieces)) == (ok, ok), name
    narrow = cut([(0, 3), (3, 3)])
    narrow[1][1][1 - dim] = 2  # not the whole other extent
    assert verdicts(size, narrow) == (False, False)


def test_one_plan_checks_no_volume() -> None:
    """DCP checks the volume only for more than one plan (a lone rank may save a part)."""
    assert verdicts([4], [([0], [2])], plans=1) == (True, True)
    assert verdicts([4], [([0], [2])], plans=2) == (False, False)


def random_boxes(rng: random.Random, size: list[int]) -> list[Box]:
    """A random tiling of ``size`` (guillotine cuts), then often broken: a chunk moved,
    grown, shrunk, dropped, duplicated, or an empty one added anywhere."""
    boxes: list[Box] = [([0] * len(size), list(size))]
    for _ in range(rng.randint(0, 6)):
        i = rng.randrange(len(boxes))
        o, s = boxes[i]
        d = rng.randrange(len(size))
        if s[d] < 2:
            continue
        cut = rng.randint(1, s[d] - 1)
        a = (list(o), [*s[:d], cut, *s[d + 1:]])
        b = ([*o[:d], o[d] + cut, *o[d + 1:]], [*s[:d], s[d] - cut, *s[d + 1:]])
        boxes[i:i + 1] = [a, b]
    for _ in range(rng.choice([0, 0, 1, 2])):
        kind = rng.choice(["move", "grow", "shrink", "drop", "dup", "empty"])
        i = rng.randrange(len(boxes))
        o, s = list(boxes[i][0]), list(boxes[i][1])
        d = rng.randrange(len(size))
        if kind == "move":
            o[d] += rng.choice([-1, 1])
        elif kind == "grow":
            s[d] += 1
        elif kind == "shrink":
            s[d] = max(0, s[d] - 1)
        elif kind == "drop" and len(boxes) > 1:
            del boxes[i]
            continue
        elif kind == "dup":
            boxes.append((o, s))
            continue
        elif kind == "empty":
            o = [rng.randint(0, n) for n in size]
            s = [rng.randint(0, 2) for _ in size]
            s[d] = 0
            boxes.append((o, s))
            continue
        boxes[i] = (o, s)
    rng.shuffle(boxes)
    return boxes


def test_same_verdict_as_dcp_on_random_layouts() -> None:
    rng = random.Random(1234)
    broken = 0
    for _ in range(3000):
        size = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        boxes = random_boxes(rng, size)
        ours, dcp = verdicts(size, boxes)
        assert ours == dcp, (size, boxes)
        broken += not dcp
    assert 300 < broken < 2700  # both kinds well represented


def item_rows(plans: list[SavePlan]) -> list[list[tuple[Any, ...]]]:
    """Per plan, its items with everything DCP compares and the index hint it does not."""
    return [[(i.index.fqn, i.index.offset, i.index.index, i.type, i.bytes_io_data,
              i.tensor_data) for i in p.items] for p in plans]


def written(plans: list[SavePlan]) -> dict[tuple[str, Any], int]:
    """Who writes each item (by ``MetadataIndex``: name and offset)."""
    return {(i.index.fqn, i.index.offset): r for r, p in enumerate(plans) for i in p.items}


def bytes_per_rank(plans: list[SavePlan]) -> list[int]:
    return [sum(math.prod(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize
                for i in p.items if i.tensor_data is not None) for p in plans]


@pytest.mark.parametrize("mesh", ["fsdp", "hsdp", "tp"])
def test_the_planner_makes_dcps_global_plan(mesh: str) -> None:
    """On the plans of a sharded state (the scale benchmark's, 16 ranks), ckptfs's planner
    writes every item DCP writes, each unreplicated one by its rank, each replicated one by
    the holder `balance_writers` picks; and for that choice its global plans (index hints
    included) and metadata (the flattening maps in their order too) are DCP's own
    construction (every value from its lowest rank: `values_from_lowest_rank`)."""
    plans = local_plans(Spec(mesh=mesh, layers=1, shrink=64), 16)
    ours = SavePlanner()
    ours.set_up_planner({}, None, True)
    theirs = DefaultSavePlanner()
    theirs.set_up_planner({}, None, True)
    gp_ours, md_ours = ours.create_global_plan(plans)
    lowest = values_from_lowest_rank(plans)
    gp_theirs, md_theirs = theirs.create_global_plan(lowest)
    ours_by, theirs_by = written(gp_ours), written(gp_theirs)
    assert ours_by.keys() == theirs_by.keys()
    holders: dict[tuple[str, Any], list[int]] = {}
    for r, p in enumerate(lowest):
        for i in p.items:
            holders.setdefault((i.index.fqn, i.index.offset), []).append(r)
    replicated = [k for k, h in holders.items() if len(h) > 1]
    assert all(ours_by[k] == h[0] for k, h in holders.items() if len(h) == 1)
    assert all(ours_by[k] in holders[k] for k in replicated)
    assert replicated  # the 0-dim `step` tensors, and on hsdp every shard
    # Given the writers, DCP's own construction of the plans and metadata.
    deduped = [dataclasses.replace(p, items=[i for i in p.items if ours_by[
        (i.index.fqn, i.index.offset)] == r]) for r, p in enumerate(lowest)]
    gp_dcp, md_dcp = create_default_global_save_plan(deduped)
    assert item_rows(gp_ours) == item_rows(gp_dcp)
    assert [p.planner_data for p in gp_ours] == [p.planner_data for p in gp_dcp]
    assert md_ours.state_dict_metadata == md_dcp.state_dict_metadata
    merged = dict(ChainMap(*[p.planner_data for p in gp_dcp]))
    assert list(md_ours.planner_data.items()) == list(merged.items())
    assert md_ours.planner_data == md_theirs.planner_data
    # The writers are balanced at least as well as DCP's.
    loads = bytes_per_rank(gp_ours)
    assert max(loads) <= max(bytes_per_rank(gp_theirs))


def test_replicated_shards_are_balanced_by_bytes() -> None:
    """HSDP, 4 replicas of 8 shards: every rank writes within 5% of the mean bytes (DCP's
    deduplication, in the order items come, leaves some ranks far above it)."""
    plans = local_plans(Spec(mesh="hsdp", layers=2, shrink=64, hsdp_shard=8), 32)
    planner = SavePlanner()
    planner.set_up_planner({}, None, True)
    loads = bytes_per_rank(planner.create_global_plan(plans)[0])
    mean = sum(loads) / len(loads)
    assert max(loads) / mean < 1.05, loads


def test_the_planner_refuses_overlapping_shards() -> None:
    plans = local_plans(Spec(mesh="fsdp", layers=1, shrink=64), 4)
    k, bad = next((k, it) for k, it in enumerate(plans[2].items) if it.tensor_data is not None
                  and it.tensor_data.chunk.offsets and it.tensor_data.chunk.offsets[0] > 0)
    c = bad.tensor_data.chunk
    moved = ChunkStorageMetadata(offsets=torch.Size([c.offsets[0] - 1, *c.offsets[1:]]),
                                 sizes=c.sizes)
    td = dataclasses.replace(bad.tensor_data, chunk=moved)
    items = list(plans[2].items)
    items[k] = dataclasses.replace(bad, tensor_data=td)
    plans[2] = dataclasses.replace(plans[2], items=items)
    planner = SavePlanner()
    planner.set_up_planner({}, None, True)
    with pytest.raises(ValueError, match=r"Failed to validate global plan: .*overlapping"):
        planner.create_global_plan(plans)


def test_a_save_of_the_same_layout_reuses_the_global_plan(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator plans once per layout (`layout_of` every rank's local plan): a
    second save with new values and the same shapes reuses the global plan; a changed shape,
    or a value added, plans again; every save commits a checkpoint that loads back equal."""
    built: list[int] = []
    from ckptfs.protocol import global_plan as planning

    real = planning.global_plan

    def counting(plans: list[SavePlan], **kw: Any) -> Any:
        built.append(len(plans))
        return real(plans, **kw)

    monkeypatch.setattr(planning, "global_plan", counting)
    monkeypatch.setattr(sharded_plan, "_PLAN_CACHE", sharded_plan._PlanCache())
    store = ckptfs.open(str(tmp_path))
    states = [
        {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3), "step": 1},
        {"w": torch.arange(6.0).reshape(2, 3) * 2, "b": torch.zeros(3), "step": 2},  # same
        {"w": torch.arange(8.0).reshape(2, 4), "b": torch.zeros(3), "step": 3},      # shape
        {"w": torch.arange(8.0).reshape(2, 4) + 1, "b": torch.ones(3), "step": 4},   # same
        {"w": torch.arange(8.0).reshape(2, 4), "b": torch.ones(3), "step": 5, "x": "a"},
    ]
    counts = []
    for step, state in enumerate(states, start=1):
        info = save_sharded(store.storage, step, state)
        counts.append(len(built))
        assert info.step == step
        back = store.load(step)
        assert set(back) == set(state)
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(back[k], v), (step, k)
            else:
                assert back[k] == v, (step, k)
    assert counts == [1, 1, 2, 2, 3]


def layout_digest(plan: SavePlan) -> str:
    return LocalTable.of_plan(plan).layout


def test_the_layout_digest_follows_shapes_and_placements_not_values() -> None:
    plans = local_plans(Spec(mesh="fsdp", layers=1, shrink=64), 4)
    again = local_plans(Spec(mesh="fsdp", layers=1, shrink=64), 4)
    other = local_plans(Spec(mesh="fsdp", layers=1, shrink=32), 4)
    ranks8 = local_plans(Spec(mesh="fsdp", layers=1, shrink=64), 8)
    digests = [layout_digest(p) for p in plans]
    assert digests == [layout_digest(p) for p in again]
    assert len(set(digests)) == 4  # each rank its own shards
    assert not set(digests) & {layout_digest(p) for p in other}
    assert not set(digests) & {layout_digest(p) for p in ranks8}


# ----------------------------------------------------------------------------------------------
# The planner in columns against DCP's own construction, on random plans


def _random_plans(rng: random.Random, worlds: tuple[int, int] = (1, 6),
                  dims: int = 7, grow: float = 0.05) -> list[SavePlan]:
    """Local plans of ``world`` ranks: tensors sharded along one dimension (uneven and empty
    shards included), on 1 or 2 replica groups; whole tensors on a random set of ranks;
    values on a random set; each rank's items in a random order; now and then a chunk grown
    (an overlap or a chunk past the end, which DCP's check refuses; only where one rank holds
    it: replicas of one item that differ are not a plan DCP's deduplication defines)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import (
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    world = rng.randint(*worlds)
    items: list[list[Any]] = [[] for _ in range(world)]
    dtypes = [torch.float32, torch.bfloat16, torch.int64]
    for t in range(rng.randint(1, 4)):
        shape = [rng.randint(1, dims) for _ in range(rng.randint(0, 3 if dims < 10 else 2))]
        props = TensorProperties(dtype=rng.choice(dtypes))
        fqn = f"t{t}"
        replicas = 2 if world % 2 == 0 and rng.random() < 0.3 else 1
        if shape and rng.random() < 0.6:  # sharded along d over each replica group
            d = rng.randrange(len(shape))
            group = world // replicas
            cuts = torch.arange(shape[d]).chunk(group)
            for r in range(world):
                k = r % group
                if k < len(cuts):
                    start, length = int(cuts[k][0]), len(cuts[k])
                else:  # past the end: an empty shard at the end
                    start, length = shape[d], 0
                off = [0] * len(shape)
                sz = list(shape)
                off[d], sz[d] = start, length
                if replicas == 1 and length and rng.random() < grow:
                    sz[d] += 1  # grown over the next one or the end: DCP refuses the plan
                c = ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz))
                items[r].append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=c, properties=props,
                                                size=torch.Size(shape))))
        else:  # a whole tensor on some ranks
            holders = rng.sample(range(world), rng.randint(1, world))
            zero = torch.Size([0] * len(shape))
            for r in holders:
                c = ChunkStorageMetadata(offsets=zero, sizes=torch.Size(shape))
                items[r].append(WriteItem(
                    index=MetadataIndex(fqn, zero), type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(chunk=c, properties=props,
                                                size=torch.Size(shape))))
    for v in range(rng.randint(0, 3)):
        for r in rng.sample(range(world), rng.randint(1, world)):
            items[r].append(WriteItem(index=MetadataIndex(f"v{v}"), type=WriteItemType.BYTE_IO))
    plans = []
    for r in range(world):
        rng.shuffle(items[r])
        plans.append(SavePlan(items[r], planner_data={
            i.index.fqn: (i.index.fqn,) for i in items[r]}))
    return plans


@pytest.mark.parametrize("worlds, dims, grow, cases, least", [
    ((1, 6), 7, 0.05, 400, (10, 200)),
    # more chunks per tensor than the planner checks by tiling_errors alone: its sort first
    # (at most 120 x 120 elements: no replicated tensor large enough to be split)
    ((65, 140), 120, 0.002, 80, (6, 30)),
])
def test_the_columns_plan_as_dcp_on_random_plans(worlds: tuple[int, int], dims: int,
                                                  grow: float, cases: int,
                                                  least: tuple[int, int]) -> None:
    """On random plans: ckptfs's planner in columns refuses exactly the plans DCP's own
    refuses (its check of the global plan), and otherwise writes every item DCP writes
    (each held by one rank by that rank, each value by its lowest holder, each replicated
    tensor by one of its holders), its plans and metadata being DCP's own construction for
    that choice of writers."""
    rng = random.Random(2026)
    refused = made = 0
    for case in range(cases):
        plans = _random_plans(rng, worlds, dims, grow)
        ours = SavePlanner()
        ours.set_up_planner({}, None, True)
        theirs = DefaultSavePlanner()
        theirs.set_up_planner({}, None, True)
        lowest = values_from_lowest_rank(plans)
        try:
            theirs.create_global_plan(lowest)
            dcp_ok = True
        except ValueError as exc:
            assert "Failed to validate global plan" in str(exc)
            dcp_ok = False
        try:
            gp_ours, md_ours = ours.create_global_plan(plans)
        except ValueError as exc:
            assert not dcp_ok, (case, exc)
            assert "Failed to validate global plan" in str(exc)
            refused += 1
            continue
        assert dcp_ok, case
        made += 1
        by = written(gp_ours)
        holders: dict[tuple[str, Any], list[int]] = {}
        for r, p in enumerate(lowest):
            for i in p.items:
                holders.setdefault((i.index.fqn, i.index.offset), []).append(r)
        assert by.keys() == holders.keys(), case
        assert all(by[k] in h for k, h in holders.items()), case
        deduped = [dataclasses.replace(p, items=[i for i in p.items if by[
            (i.index.fqn, i.index.offset)] == r]) for r, p in enumerate(lowest)]
        gp_dcp, md_dcp = create_default_global_save_plan(deduped)
        assert item_rows(gp_ours) == item_rows(gp_dcp), case
        assert list(md_ours.state_dict_metadata.items()) == \
            list(md_dcp.state_dict_metadata.items()), case
        merged = dict(ChainMap(*[p.planner_data for p in gp_dcp]))
        assert list(md_ours.planner_data.items()) == list(merged.items()), case
    assert refused >= least[0] and made >= least[1], (refused, made)


def test_the_spec_layouts_in_columns_are_layout_of() -> None:
    """`layout_of_columns` (a grid found with tensor operations) gives `layout_of`'s answer
    on grids of every shape, with owners in order, permuted, strided, with empty chunks, with
    chunks moved or missing."""
    from ckptfs.format.rank_metadata import Cell, layout_of
    from ckptfs.protocol.rank_metadata import layout_of_columns

    rng = random.Random(7)
    kinds: set[str] = set()
    for _ in range(600):
        size = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        grid = tuple(rng.randint(1, s) for s in size)
        counts = [-(-s // g) for s, g in zip(size, grid, strict=True)]
        cells = []
        base, stride = rng.randint(0, 3), rng.randint(0, 2)
        for i, coords in enumerate(itertools.product(*[range(c) for c in counts])):
            off = tuple(k * g for k, g in zip(coords, grid, strict=True))
            sz = tuple(min(g, s - o) for g, s, o in zip(grid, size, off, strict=True))
            cells.append(Cell(off, sz, base + i * stride))
        roll = rng.random()
        if roll < 0.15 and len(cells) > 1:
            rng.shuffle(cells)  # plan order need not be grid order
        elif roll < 0.3 and len(cells) > 1:
            a, b = rng.sample(range(len(cells)), 2)
            cells[a] = dataclasses.replace(cells[a], rank=cells[b].rank + 5)  # not in order
        elif roll < 0.4:
            cells.pop(rng.randrange(len(cells)))  # a gap
        elif roll < 0.5:
            c = cells[rng.randrange(len(cells))]
            cells.append(dataclasses.replace(c, rank=c.rank + 1))  # twice
        if rng.random() < 0.3:  # empty chunks past the end
            d = rng.randrange(len(size))
            for k in range(rng.randint(1, 3)):
                off = tuple(size[d] if e == d else 0 for e in range(len(size)))
                sz = tuple(0 if e == d else size[e] for e in range(len(size)))
                cells.append(Cell(off, sz, 10 + k))
        want = layout_of(size, cells)
        got = layout_of_columns(size, torch.tensor([c.offsets for c in cells]).reshape(
            len(cells), len(size)), torch.tensor([c.sizes for c in cells]).reshape(
            len(cells), len(size)), torch.tensor([c.rank for c in cells], dtype=torch.int64))
        assert got == want, (size, cells)
        kinds.add("grid" if want[0] is not None else "explicit")
    assert kinds == {"grid", "explicit"}
