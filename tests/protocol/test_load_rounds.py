"""The collective load's rounds (`ckptfs.protocol.load_rounds`): ckptfs drives DCP's load
planner and its reader over its own group, as the save does.

* the grouped planner (`plan_group_reads`: ranks with the same needs planned as one group) makes
  exactly the plan of the per-rank one, on random needs;
* each rank's part (`parts_of`, `part_of`) holds exactly the transfers of the whole plan that it
  takes part in, in the same order on the sender and the receiver, and its chunks read alone;
* on real ranks (gloo, 2 replicas x 2 shards): a load(into=) runs no DCP collective and no
  pickle crosses (DCP's ``_load_state_dict`` and its ``_DistWrapper`` replaced by ones that
  fail), every rank gets the saved values, each byte read once per replica group, and a
  failure in the plan round (a target of another dtype on one rank) is the same typed error on
  every rank, its targets untouched;
* ``ckptfs bench scale``'s load round (`ckptfs.bench.scale_load`) at small W on each mesh: the
  coordinator's parts rebuild, rank by rank, the plan every rank made itself before.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks

import ckptfs
from ckptfs.protocol.balance import Key, ReadPlan, Transfer, plan_group_reads, plan_reads
from ckptfs.protocol.load_rounds import part_of, parts_of
from ckptfs.protocol.sharded_read import keys_doc

STEP = 4


def _random_needs(rng: random.Random, world: int) -> list[list[Key]]:
    files = {f"f{i}": [(0, 16)] + [(16 + 64 * j, 64) for j in range(rng.randint(1, 12))]
             for i in range(rng.randint(1, 5))}
    needs = []
    for _ in range(world):
        keys = set()
        for path, chunks in files.items():
            for off, length in chunks:
                if rng.random() < 0.4:
                    keys.add((path, off, length))
        needs.append(sorted(keys))
    # replicas: some ranks need exactly what another does
    for r in range(world):
        if rng.random() < 0.4:
            needs[r] = list(needs[rng.randrange(world)])
    return needs


def _groups(needs: list[list[Key]]) -> list[tuple[list[int], Any]]:
    by: dict[tuple[Key, ...], list[int]] = {}
    for r, keys in enumerate(needs):
        by.setdefault(tuple(keys), []).append(r)
    return [(members, keys_doc(list(keys))) for keys, members in by.items()]


def _grouped(needs: list[list[Key]]) -> ReadPlan | None:
    groups = [(members, [(p, o, n) for p, flat in d.items()
                         for o, n in zip(flat[::2], flat[1::2], strict=True)])
              for members, d in _groups(needs)]
    return plan_group_reads(groups, len(needs), max_piece=150, round_bytes=300)


@pytest.mark.parametrize("seed", range(40))
def test_grouped_plan_is_the_per_rank_plan(seed: int) -> None:
    rng = random.Random(seed)
    needs = _random_needs(rng, rng.randint(1, 9))
    assert _grouped(needs) == plan_reads(needs, max_piece=150, round_bytes=300)


def _share_of(transfers: list[Transfer], rank: int) -> list[Transfer]:
    """What rank ``rank`` does of one round of the whole plan, as its part says it: the chunks
    it reads (sent to every other needer), and those it receives (from their reader), in key
    order, the same on the sender and the receiver."""
    out = [t if t.reader == rank else Transfer(t.reader, t.key, (rank,))
           for t in transfers if t.reader == rank or rank in t.needers]
    return sorted(out, key=lambda t: t.key)


def _parts_match(parts: list[Any], whole: ReadPlan | None, needs: list[list[Key]]
                 ) -> list[ReadPlan | None]:
    """Each rank's part rebuilt (`part_of`): None where ``whole`` is, else its share of every
    round of ``whole``; the rebuilt plans, by rank."""
    world = len(needs)
    out = []
    for rank in range(world):
        mine = part_of(parts[rank]["part"], rank, world, needs[rank])
        if whole is None:
            assert mine is None
        else:
            assert mine is not None
            for got, full in zip(mine.rounds, whole.rounds, strict=True):
                assert got == _share_of(full, rank)
        out.append(mine)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_each_rank_part_is_its_share_of_the_whole_plan(seed: int) -> None:
    rng = random.Random(1000 + seed)
    world = rng.randint(2, 9)
    needs = _random_needs(rng, world)
    whole = plan_reads(needs, max_piece=150, round_bytes=300)
    parts = parts_of(whole, _groups(needs), world)
    for rank, mine in enumerate(_parts_match(parts, whole, needs)):
        if whole is None or mine is None:
            continue
        assert len(mine.rounds) == len(whole.rounds)  # every rank runs every exchange
        moved = {t.key for r in whole.rounds for t in r if rank in t.needers}
        assert mine.alone[rank] == [k for k in needs[rank] if k not in moved]
        assert all(not a for r, a in enumerate(mine.alone) if r != rank)


def test_ranks_needing_the_same_chunks_receive_one_document() -> None:
    keys = [("f", 0, 10), ("f", 10, 100), ("f", 110, 100)]
    needs = [keys, keys, keys, [("g", 0, 10)]]
    whole = plan_reads(needs, max_piece=1 << 20, round_bytes=1 << 20)
    parts = parts_of(whole, _groups(needs), 4)
    assert parts[0] is parts[1] is parts[2] and parts[3] is not parts[0]


# -- real ranks ----------------------------------------------------------------------------------


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(96, dtype=torch.int64)}


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def job_save(rank: int, world: int, url: str) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh()
    state: dict[str, Any] = {k: distribute_tensor(v, mesh, [Replicate(), Shard(0)])
                             for k, v in _full().items()}
    state["trainer"] = {"step": STEP}
    ckptfs.open(url).save(STEP, state)


def _no_dcp_collectives(monkeypatch: Any) -> None:
    import torch.distributed.checkpoint.state_dict_loader as loader
    import torch.distributed.checkpoint.utils as utils

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("DCP's load driver ran")

    monkeypatch.setattr(loader, "_load_state_dict", refuse)
    monkeypatch.setattr(utils._DistWrapper, "reduce_scatter", refuse)
    monkeypatch.setattr(utils._DistWrapper, "all_gather", refuse)


def job_load(rank: int, world: int, url: str, bad_dtype_rank: int) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mp = pytest.MonkeyPatch()
    _no_dcp_collectives(mp)
    try:
        mesh = _mesh()
        into: dict[str, Any] = {k: distribute_tensor(torch.zeros_like(v), mesh,
                                                     [Replicate(), Shard(0)])
                                for k, v in _full().items()}
        if rank == bad_dtype_rank:  # no collective: from_local, unchecked
            from torch.distributed.tensor import DTensor

            into["b"] = DTensor.from_local(torch.zeros(48, dtype=torch.float64), mesh,
                                           [Replicate(), Shard(0)], run_check=False)
        into["trainer"] = {"step": 0}
        store = ckptfs.open(url)
        from ckptfs.protocol.sharded import load_into
        from ckptfs.protocol.sharded_read import ShardedReader

        reader = ShardedReader(store.storage, STEP)
        try:
            load_into(store.storage, STEP, into, reader=reader)
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc),
                    "untouched": all(float(into[k].to_local().abs().sum()) == 0
                                     for k in ("w", "b"))}
        exact = all(torch.equal(into[k].full_tensor(), v) for k, v in _full().items())
        return {"exact": exact and into["trainer"] == {"step": STEP},
                "read": reader.bytes_read, "received": reader.bytes_received}
    finally:
        mp.undo()


def _data_bytes(url: str) -> int:
    info = ckptfs.open(url).info(STEP)
    return sum(e.size for e in info.manifest.files if "rank" in e.path
               and e.path.endswith(".safetensors"))


def test_load_into_runs_ckptfs_rounds_and_reads_each_byte_once(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    run_ranks(job_save, 4, url, timeout=240)
    out = run_ranks(job_load, 4, url, -1, timeout=240)
    assert all(o.get("exact") for o in out), out
    assert sum(o["received"] for o in out) > 0  # the replicas shared their chunks
    data = _data_bytes(url)
    assert sum(o["read"] for o in out) <= 1.05 * data + 4096 * 4


def test_a_plan_round_failure_is_one_typed_error_everywhere(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    run_ranks(job_save, 4, url, timeout=240)
    out = run_ranks(job_load, 4, url, 2, timeout=240)
    assert all("error" in o for o in out), out
    assert len({o["error"] for o in out}) == 1
    assert all("dtype" in o["message"] and "rank 2" in o["message"] for o in out), out
    assert all(o["untouched"] for o in out)


# -- the simulator ---------------------------------------------------------------------------


@pytest.mark.parametrize("mesh", ["fsdp", "hsdp", "tp"])
def test_scale_load_round_parts_rebuild_the_every_rank_plan(tmp_path: Path, mesh: str) -> None:
    from ckptfs.bench import scale, scale_load
    from ckptfs.protocol.load_rounds import LoadRounds
    from ckptfs.protocol.sharded_read import ShardedReader, sharded_manifest, shared_reads

    world = 16
    spec = scale.Spec(mesh=mesh, layers=1, hsdp_shard=4)
    plans = scale.local_plans(spec, world)
    root = str(tmp_path / "c")
    scale.simulate_ckptfs(spec, world, root, plans=plans)
    out = scale_load.load_round(root, scale.STEP, plans, dcp=True)
    assert out["ckptfs"]["round_s"] > 0 and out["before"]["plan_round_s"] > 0
    store = ckptfs.open(root)
    reader = ShardedReader(store.storage, scale.STEP)
    manifest = sharded_manifest(reader.resolve())
    needs, _ = scale_load.rank_needs(reader.load_document(), manifest, plans)
    whole = shared_reads([([r], keys_doc(k)) for r, k in enumerate(needs)], manifest,
                         list(range(world)))
    from ckptfs.protocol.load_rounds import encode_text

    docs = [{"plan": {"resolved": [reader.resolve().step, reader.resolve().attempt],
                      "needs": encode_text(keys_doc(k)), "share": True}} for k in needs]
    parts = LoadRounds({}, reader, None, 0, cooperative=True).plan_globally(  # type: ignore
        docs, list(range(world)))
    _parts_match(parts, whole, needs)
    if mesh == "hsdp":
        assert whole is not None  # the replicas share their shard's chunks


@pytest.mark.parametrize("seed", range(30))
def test_rounds_split_exactly_where_a_rank_would_pass_the_round_bytes(seed: int) -> None:
    """The rounds after the first (the headers) are the placed pieces cut greedily: a round
    ends just before the piece that would take some rank needing it past ``round_bytes``
    (read plus received), counted rank by rank here."""
    rng = random.Random(5000 + seed)
    needs = _random_needs(rng, rng.randint(2, 9))
    round_bytes = rng.choice([64, 150, 300, 1000])
    plan = plan_reads(needs, max_piece=150, round_bytes=round_bytes)
    if plan is None:
        return
    rest = plan.rounds[1:] if plan.rounds and all(t.key[1] == 0 for t in plan.rounds[0]) \
        else plan.rounds
    for i, transfers in enumerate(rest):
        traffic: dict[int, int] = {}
        pieces: list[list[Transfer]] = []
        for t in transfers:  # a piece: adjacent transfers of one reader and needer set
            if pieces and pieces[-1][-1].reader == t.reader and \
                    pieces[-1][-1].needers == t.needers and pieces[-1][-1].key[0] == t.key[0] \
                    and pieces[-1][-1].key[1] + pieces[-1][-1].key[2] == t.key[1]:
                pieces[-1].append(t)
            else:
                pieces.append([t])
        for piece in pieces:
            for r in piece[0].needers:
                traffic[r] = traffic.get(r, 0) + sum(t.key[2] for t in piece)
        over = [r for r, b in traffic.items() if b > round_bytes]
        assert not over or len(pieces) == 1 or all(
            sum(t.key[2] for p in pieces if r in p[0].needers for t in p)
            - sum(t.key[2] for t in pieces[-1]) <= round_bytes for r in over)
        if i + 1 < len(rest):  # the next round's first piece did not fit in this one
            nxt = rest[i + 1][0]
            size = sum(t.key[2] for t in rest[i + 1] if t.reader == nxt.reader
                       and t.needers == nxt.needers and t.key[0] == nxt.key[0])
            assert any(traffic.get(r, 0) + min(size, nxt.key[2]) > round_bytes
                       or traffic.get(r, 0) + size > round_bytes for r in nxt.needers)
