"""A collective ``save_async(..., staging_bytes=B)`` streams through its budget (docs/async.md
section 5, "Collective saves stream too"): each rank stages its tensors in groups of at most
``B/2`` bytes and writes one rank file per group inside that group's gate; the pool's own
accounting never exceeds ``B``; the call returns once the last group is staged and the
checkpoint holds the values at the call.  One rank in this process (``layout="ranks"``, the world
of one: memory:// and local disk) and two gloo ranks with DTensors and replicated tensors (the
replica digests taken before the call returns: a replicated tensor that differs between ranks
is still refused).  The saves that cannot stream (incremental, per-rank metadata, a rank
holding a tensor larger than the budget) are written from the caller's tensors."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks
from test_async_budget import (
    BUDGET,
    Accounting,
    SlowWrites,
    assert_state_equal,
    big_state,
    clone,
    mutate,
    stream_and_mutate,
)

import ckptfs
from ckptfs.errors import ReplicaMismatchError
from ckptfs.format.layout import rank_of_file
from ckptfs.format.versions import is_sharded
from ckptfs.protocol.store import CheckpointStore
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage

pytestmark = pytest.mark.sharded


def rank_files(info: Any) -> list[str]:
    return [f.path for f in info.manifest.files if rank_of_file(f.path) is not None]


@pytest.mark.parametrize("where", ["memory", "local"])
def test_ranks_layout_8x_the_budget_streams_and_loads_bit_exact(
        where: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    acct = Accounting(monkeypatch, BUDGET)
    store = ckptfs.open(backend.open().url, layout="ranks")
    state = big_state(8 * BUDGET)
    expected = clone(state)
    info, stats = stream_and_mutate(store, state)
    assert len(acct.samples) >= 16 and max(s[0] for s in acct.samples) <= BUDGET
    assert stats.pool.live_bytes == 0
    assert is_sharded(info.manifest)
    files = rank_files(info)
    assert len(files) >= 16 and all(rank_of_file(p) == 0 for p in files)
    assert "rank-00000/data-1.safetensors" in files
    assert_state_equal(store.load(1), expected)
    assert not store.verify(1).problems
    # the next streamed save reuses the slab
    allocs = stats.staging_allocations
    store.save_async(2, state, staging_bytes=BUDGET).result(timeout=120)
    assert stats.staging_allocations == allocs and stats.streamed == 2
    assert_state_equal(store.load(2), state)
    store.close()


def test_ranks_layout_returns_once_the_last_group_is_staged(memory_backend: Backend) -> None:
    """The groups beyond the last budget window are written while the call blocks; the last
    ones after it returned, and mutating the state then changes nothing stored."""
    hook = SlowWrites(0.05)
    store = CheckpointStore(FaultyStorage(memory_backend.open().storage, hook=hook),
                            layout="ranks")
    state = big_state(8 * BUDGET, seed=2)
    expected = clone(state)
    fut = store.save_async(1, state, staging_bytes=BUDGET)
    opened_at_return = len(hook.opened)
    done_at_return = fut.done()
    mutate(state)
    info = fut.result(timeout=120)
    assert opened_at_return >= len(rank_files(info)) - 3
    assert not done_at_return
    assert_state_equal(store.load(1), expected)


@pytest.mark.parametrize("opts", [{"incremental": True}, {"metadata_layout": "per-rank"}])
def test_collective_saves_that_cannot_stream_are_written_from_the_state(
        memory_backend: Backend, opts: dict[str, Any]) -> None:
    """Incremental (v4) and per-rank metadata (v5): nothing staged over the budget, the call
    returns once committed; within it, the snapshot."""
    store = ckptfs.open(memory_backend.open().url, layout="ranks", **opts)
    state = big_state(2 * BUDGET)
    expected = clone(state)
    fut = store.save_async(1, state, staging_bytes=BUDGET)
    assert fut.done() and fut.result().step == 1
    mutate(state)
    assert store.async_stats.unstaged == 1 and store.async_stats.streamed == 0
    assert store.async_stats.staging_peak_bytes == 0
    assert_state_equal(store.load(1), expected)
    state = big_state(2 * BUDGET, seed=1)
    expected = clone(state)
    fut = store.save_async(2, state, staging_bytes=8 * BUDGET)
    mutate(state)
    fut.result(timeout=120)
    assert store.async_stats.unstaged == 1
    assert 0 < store.async_stats.staging_peak_bytes <= 8 * BUDGET
    assert_state_equal(store.load(2), expected)


def test_a_rank_tensor_larger_than_the_budget_is_written_unstaged(
        memory_backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    """A collective save is not refused on one rank (the others would wait for it): that
    rank's part is written from the caller's tensors, logged with the key."""
    store = ckptfs.open(memory_backend.open().url, layout="ranks")
    state = big_state(2 * BUDGET)
    state["model"]["huge"] = torch.ones(2 * BUDGET // 4)
    expected = clone(state)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        fut = store.save_async(1, state, staging_bytes=BUDGET)
    assert fut.done()
    assert "'model.huge'" in caplog.text or "model/huge" in caplog.text
    assert store.async_stats.unstaged == 1 and store.async_stats.staging_peak_bytes == 0
    assert_state_equal(store.load(1), expected)


def test_a_failed_rank_file_write_stops_the_collective_stream(memory_backend: Backend) -> None:
    """A rank file's write fails in the middle of a streamed collective save (every retry):
    staging stops, the future raises the typed error naming the rank and the file, no marker,
    every slab region is given back, and the next streamed save commits."""
    from ckptfs.errors import ShardedSaveError, StorageError

    opened: list[str] = []
    fail = [True]

    def hook(op: str, path: str) -> None:
        if op == "open_write" and "/rank-00000/data-" in path:
            opened.append(path)
            if fail[0] and path.endswith("/data-3.safetensors"):
                raise StorageError(f"injected failure writing {path}")

    store = CheckpointStore(FaultyStorage(memory_backend.open().storage, hook=hook),
                            layout="ranks")
    state = big_state(8 * BUDGET, seed=5)
    fut = store.save_async(1, state, staging_bytes=BUDGET)
    with pytest.raises(ShardedSaveError, match=r"rank 0.*data-3\.safetensors.*injected"):
        fut.result(timeout=120)
    assert store.async_stats.streamed == 1
    assert store.all_steps() == []
    assert store.async_stats.pool.live_bytes == 0
    assert any(p.endswith("/data-2.safetensors") for p in opened)  # it had streamed on
    fail[0] = False
    store.save_async(2, state, staging_bytes=BUDGET).result(timeout=120)
    assert store.async_stats.streamed == 2 and store.all_steps() == [2]
    assert_state_equal(store.load(2), state)
    assert store.async_stats.pool.live_bytes == 0


# -- two gloo ranks -------------------------------------------------------------------------

def two_rank_state(rank: int, mesh: Any, diverge: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    model = {f"l{i}": distribute_tensor(torch.randn(64, 48, generator=g), mesh, [Shard(0)])
             for i in range(12)}
    # replicated plain tensors (every rank holds them): stored once, compared by digest
    model["bias"] = torch.arange(3000, dtype=torch.float32)
    model["table"] = torch.randn(96, 64, generator=g)
    if diverge and rank == 1:
        model["table"][5, 5] += 1
    return {"model": model, "trainer": {"step": 7, "name": "run"}}


def job_stream(rank: int, world: int, url: str, diverge: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    store = ckptfs.open(url)
    state = two_rank_state(rank, mesh, diverge)
    budget = 32 * 1024  # each rank holds 72 KiB of shards + 36 KiB replicated
    expected = {k: (v.full_tensor() if isinstance(v, DTensor) else v.clone())
                for k, v in state["model"].items()}
    fut = store.save_async(3, state, staging_bytes=budget)
    with torch.no_grad():
        for v in state["model"].values():
            (v._local_tensor if isinstance(v, DTensor) else v).add_(100)
    try:
        info = fut.result(timeout=120)
    except ReplicaMismatchError as exc:
        return {"refused": str(exc), "steps": store.steps()}
    stats = store.async_stats
    out = {"streamed": stats.streamed, "peak": stats.staging_peak_live_bytes,
           "pool_peak": stats.staging_peak_bytes,
           "files": sorted(f.path for f in info.manifest.files)}
    into = two_rank_state(rank, mesh, False)
    for v in into["model"].values():
        with torch.no_grad():
            (v._local_tensor if isinstance(v, DTensor) else v).zero_()
    store.load(3, into=into)
    out["equal"] = all(
        torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, expected[k])
        for k, v in into["model"].items())
    store.close()
    return out


@pytest.mark.timeout(300)
def test_two_ranks_stream_dtensors_and_replicas(tmp_path: Path) -> None:
    results = run_ranks(job_stream, 2, str(tmp_path / "run"), False, timeout=240)
    for r, out in enumerate(results):
        assert out["streamed"] == 1, out
        assert 0 < out["peak"] <= 32 * 1024 and out["pool_peak"] <= 32 * 1024
        assert out["equal"], f"rank {r} loaded other values"
    files = results[0]["files"]
    assert files == results[1]["files"]
    per_rank = {r: [p for p in files if rank_of_file(p) == r] for r in (0, 1)}
    assert len(per_rank[0]) >= 3 and len(per_rank[1]) >= 3, files  # several files per rank
    assert ckptfs.open(str(tmp_path / "run")).verify(3).problems == []


@pytest.mark.timeout(300)
def test_two_ranks_streamed_diverging_replica_is_refused(tmp_path: Path) -> None:
    """The replica digests of a streamed save come from the caller's tensors (taken before the
    call returned): a replicated tensor that differs between the ranks is refused on both,
    nothing committed."""
    results = run_ranks(job_stream, 2, str(tmp_path / "run"), True, timeout=240)
    for out in results:
        assert "'model.table'" in out["refused"] and out["steps"] == [], out
    assert copy.deepcopy(results[0]["refused"]) == results[1]["refused"]
