"""``save_async(..., staging_bytes=B)`` (docs/async.md section 5): a state larger than its staging
budget streams through it (a part copied, written, its buffer reused for the next part); the
staging code's own accounting (``StagingPool.live_bytes`` and the bytes it holds) never exceeds
the budget; the call returns once the last part is copied, and the checkpoint holds the values
at the call; a tensor larger than the budget is refused by name (an incremental store's:
test_async_budget_incremental.py; the collective saves: test_async_budget_ranks.py).  On
``memory://`` and local disk."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from ckptfs.errors import AsyncSaveError, StagingBudgetError, StorageError
from ckptfs.format.serialize import plan_state
from ckptfs.protocol import staging
from ckptfs.protocol.store import CheckpointStore
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal as _assert_equal
from ckptfs.testing.faults import FaultyStorage

KIB = 1024
BUDGET = 256 * KIB


def big_state(nbytes: int, seed: int = 0) -> dict[str, Any]:
    """About ``nbytes`` of tensors of every kind the staging copies (dtypes, views, tied,
    empty, NumPy data), in 16 KiB .. 32 KiB pieces, plus non-tensor values."""
    g = torch.Generator().manual_seed(seed)
    model: dict[str, Any] = {}
    i, total = 0, 0
    while total < nbytes:
        w = torch.randn(64, 96 + 16 * (i % 3), generator=g)  # 24-36 KiB
        model[f"layer{i}.weight"] = w
        total += w.numel() * 4
        i += 1
    base = torch.randn(40, 50, generator=g)
    model["tied"] = model["layer0.weight"]
    model["t_view"] = base.t()  # strided: copied with copy_
    model["bf16"] = torch.randn(3000, generator=g).to(torch.bfloat16)
    model["ids"] = torch.arange(5000, dtype=torch.int64)
    model["conj"] = torch.randn(100, dtype=torch.complex64, generator=g).conj()
    model["mask"] = torch.rand(777, generator=g) > 0.5
    model["empty"] = torch.empty(0, 3)
    return {"model": model, "np": [np.arange(1000, dtype=np.float32)],
            "trainer": {"step": seed, "lr": 0.1}}


def _torchify(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.resolve_conj().resolve_neg()
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v))
    if isinstance(v, dict):
        return {k: _torchify(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_torchify(x) for x in v]
    return v


def assert_state_equal(a: Any, b: Any) -> None:
    """Bit-exact (NumPy arrays compared as tensors; conjugate views by their values)."""
    _assert_equal(_torchify(a), _torchify(b))


def tensor_bytes(state: Any) -> int:
    return plan_state(state).tensor_bytes


def mutate_tensors(tensors: dict[str, Any]) -> None:
    """Every tensor of ``tensors`` changed in place (each kind as it can be)."""
    with torch.no_grad():
        for t in tensors.values():
            if t.dtype == torch.bool:
                t.logical_not_()
            elif t.is_conj():
                t.mul_(0)
            elif t.numel():
                t.add_(1)


def mutate(state: dict[str, Any]) -> None:
    mutate_tensors(state["model"])
    state["np"][0][:] = -1
    state["trainer"]["step"] = -1


def clone(state: Any) -> Any:
    return copy.deepcopy(state)


class Accounting:
    """Checks the pool's own accounting after every region taken: the bytes staged and not
    yet written, and the bytes the pool holds, never exceed ``budget``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
        self.budget = budget
        self.samples: list[tuple[int, int]] = []
        real = staging.StagingPool.occupy

        def occupy(pool: staging.StagingPool, offset: int, size: int, stop: Any) -> int | None:
            rid = real(pool, offset, size, stop)
            self.samples.append((pool.live_bytes, pool.nbytes))
            assert pool.live_bytes <= budget and pool.nbytes <= budget
            return rid

        monkeypatch.setattr(staging.StagingPool, "occupy", occupy)


def stream_and_mutate(store: CheckpointStore, state: dict[str, Any]) -> tuple[Any, Any]:
    """``save_async`` of ``state`` within `BUDGET`, the state mutated right after the call
    returned; the committed info and the store's stats, checked: streamed, within the budget."""
    fut = store.save_async(1, state, staging_bytes=BUDGET)
    mutate(state)  # right after the call returned
    info = fut.result(timeout=120)
    stats = store.async_stats
    assert stats.streamed == 1 and stats.unstaged == 0
    assert 0 < stats.staging_peak_live_bytes <= BUDGET
    assert stats.staging_peak_bytes <= BUDGET
    return info, stats


@pytest.mark.parametrize("where", ["memory", "local"])
def test_state_8x_the_budget_streams_and_loads_bit_exact(
        where: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    acct = Accounting(monkeypatch, BUDGET)
    store = backend.open()
    state = big_state(8 * BUDGET)
    assert tensor_bytes(state) >= 8 * BUDGET
    expected = clone(state)
    info, stats = stream_and_mutate(store, state)
    assert len(acct.samples) >= 16  # one region per tensor file: the slab reused many times
    assert max(s[0] for s in acct.samples) <= BUDGET
    assert stats.pool.live_bytes == 0  # all given back
    # files of at most half the budget, so one is copied while another is written
    assert len(info.manifest.files) >= 17
    out = store.load(1)
    assert_state_equal(out, expected)
    store.verify(1)
    # the next budgeted save reuses the same slab (no allocation)
    slab_allocs = stats.staging_allocations
    store.save_async(2, state, staging_bytes=BUDGET).result(timeout=120)
    assert stats.staging_allocations == slab_allocs
    assert_state_equal(store.load(2), state)
    store.close()
    assert stats.staging_bytes == 0


def test_within_budget_is_staged_whole_and_written_as_save(memory_backend: Backend) -> None:
    """A state that fits its budget: one copy in the slab, the call returns before the write,
    and the files are those store.save writes (the same layout)."""
    store = memory_backend.open()
    state = big_state(4 * BUDGET)
    fut = store.save_async(1, state, staging_bytes=16 * BUDGET)
    assert store.async_stats.streamed == 0
    info = fut.result(timeout=120)
    sync = store.save(2, state)
    assert [(f.path, f.size, f.digest) for f in info.manifest.files] == \
        [(f.path, f.size, f.digest) for f in sync.manifest.files]
    assert store.async_stats.staging_bytes <= 16 * BUDGET
    assert store.async_stats.staging_peak_bytes <= 16 * BUDGET


class SlowWrites:
    """A storage hook: each write of the background save (not the caller's thread) takes a
    while, and the paths opened for writing are recorded in order."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.opened: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, op: str, path: str) -> None:
        if op == "open_write" and path.endswith(".safetensors"):
            with self.lock:
                self.opened.append(path)
            time.sleep(self.delay)


@pytest.mark.parametrize("where", ["memory", "local"])
def test_the_call_returns_once_the_last_part_is_staged(
        where: str, request: pytest.FixtureRequest) -> None:
    """The documented point: save_async returns once every byte is staged, i.e. the files
    beyond the budget were written while it blocked, and the last window (within the budget)
    is written after it returned.  Mutating the state right then changes nothing stored."""
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    hook = SlowWrites(0.05)
    store = CheckpointStore(FaultyStorage(backend.open().storage, hook=hook), threads=2)
    state = big_state(8 * BUDGET, seed=2)
    expected = clone(state)
    fut = store.save_async(1, state, staging_bytes=BUDGET)
    opened_at_return = len(hook.opened)
    done_at_return = fut.done()
    mutate(state)
    info = fut.result(timeout=120)
    files = sum(1 for f in info.manifest.files if f.path.endswith(".safetensors"))
    # while blocked: every file but those of the last budget window (files of <= B/2 bytes,
    # at most 2 of them + the one being written by each of the 2 writer threads)
    assert opened_at_return >= files - 4
    assert not done_at_return  # the last window is written after the call returned
    assert_state_equal(store.load(1), expected)


def test_mutating_after_the_future_resolves_is_also_safe(memory_backend: Backend) -> None:
    store = memory_backend.open()
    state = big_state(8 * BUDGET, seed=4)
    expected = clone(state)
    fut = store.save_async(1, state, staging_bytes=BUDGET)
    fut.result(timeout=120)
    mutate(state)
    assert_state_equal(store.load(1), expected)


@pytest.mark.parametrize("where", ["memory", "local"])
def test_a_tensor_larger_than_the_budget_is_refused_by_name(
        where: str, request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    store = backend.open()
    state = big_state(4 * BUDGET)
    state["model"]["huge"] = torch.zeros(BUDGET // 4 + 1)  # 4 bytes over the budget
    with pytest.raises(StagingBudgetError, match=r"'model/huge' \(262148 bytes") as info:
        store.save_async(1, state, staging_bytes=BUDGET)
    err = info.value
    assert (err.key, err.nbytes, err.budget) == ("model/huge", BUDGET + 4, BUDGET)
    assert isinstance(err, AsyncSaveError) and isinstance(err, ValueError)
    assert str(BUDGET) in str(err)
    assert store.all_steps() == []
    assert store.async_stats.submitted == 0 and store.async_stats.staging_bytes == 0
    # a budget it fits in saves it
    store.save_async(1, state, staging_bytes=2 * BUDGET).result(timeout=120)
    assert_state_equal(store.load(1), state)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1"])
def test_invalid_budgets_are_refused(memory_backend: Backend, bad: Any) -> None:
    store = memory_backend.open()
    with pytest.raises(ValueError, match="staging_bytes"):
        store.save_async(1, {"x": torch.zeros(4)}, staging_bytes=bad)
    assert store.async_stats.submitted == 0


def test_a_background_failure_stops_the_stream(memory_backend: Backend) -> None:
    """A write fails in the middle of the stream: staging stops, save_async returns the
    future, which raises the storage error; no marker; the slab is all given back and the
    next save streams through it."""
    opened: list[str] = []

    def hook(op: str, path: str) -> None:
        if op == "open_write" and path.endswith(".safetensors"):
            opened.append(path)
            if path == opened[min(3, len(opened) - 1)] and len(opened) >= 4:  # every retry
                raise StorageError(f"injected failure writing {path}")

    store = CheckpointStore(FaultyStorage(memory_backend.open().storage, hook=hook))
    state = big_state(8 * BUDGET, seed=5)
    fut = store.save_async(1, state, staging_bytes=BUDGET)
    with pytest.raises(StorageError, match="injected"):
        fut.result(timeout=120)
    assert store.all_steps() == []
    assert store.async_stats.pool.live_bytes == 0
    store.save_async(2, state, staging_bytes=BUDGET).result(timeout=120)
    assert_state_equal(store.load(2), state)


def test_a_copy_failure_raises_from_the_call(memory_backend: Backend,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy fails on the caller's thread in the middle of the stream: the save stops (no
    marker), save_async raises the copy's error, and the future does not raise it again."""
    real = staging._copy_all
    calls = [0]

    def copy_all(pairs: Any) -> None:
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("injected copy failure")
        real(pairs)

    monkeypatch.setattr(staging, "_copy_all", copy_all)
    store = memory_backend.open()
    state = big_state(8 * BUDGET, seed=6)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        store.save_async(1, state, staging_bytes=BUDGET)
    store.wait()  # collected: not raised again
    assert store.all_steps() == []
    assert store.async_stats.pool.live_bytes == 0
    monkeypatch.setattr(staging, "_copy_all", real)
    store.save_async(1, state, staging_bytes=BUDGET).result(timeout=120)
    assert_state_equal(store.load(1), state)


def test_two_saves_in_flight_share_the_budget(memory_backend: Backend,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """max_in_flight=2: the second save's parts wait for the first's to be written; the
    store's staging stays within the one budget, and both commit in order."""
    Accounting(monkeypatch, BUDGET)
    store = memory_backend.open()
    a, b = big_state(4 * BUDGET, seed=7), big_state(3 * BUDGET, seed=8)
    ea, eb = clone(a), clone(b)
    fa = store.save_async(1, a, staging_bytes=BUDGET, max_in_flight=2)
    mutate(a)
    fb = store.save_async(2, b, staging_bytes=BUDGET, max_in_flight=2)
    mutate(b)
    assert fa.result(timeout=120).step == 1 and fb.result(timeout=120).step == 2
    assert_state_equal(store.load(1), ea)
    assert_state_equal(store.load(2), eb)
    assert store.async_stats.staging_peak_live_bytes <= BUDGET


def test_cuda_branch_streams_through_a_pinned_slab(monkeypatch: pytest.MonkeyPatch,
                                                   memory_backend: Backend) -> None:
    """The CUDA path's logic with CPU stand-ins (float32 tensors play the device's): the slab
    is allocated pinned, copies are non-blocking, and each file's copies are synchronized
    before the writer may read them (a synchronize after each file, before it is staged)."""
    events: list[tuple[Any, ...]] = []
    real_alloc, real_copy = staging._alloc, staging._copy_into
    monkeypatch.setattr(staging, "_needs_pinned", lambda t: t.dtype == torch.float32)

    def alloc(key: staging.PoolKey) -> torch.Tensor:
        events.append(("alloc", key[2]))
        return real_alloc((key[0], key[1], False))

    def copy_into(buf: torch.Tensor, t: torch.Tensor, non_blocking: bool) -> None:
        events.append(("copy", non_blocking))
        real_copy(buf, t, non_blocking)

    monkeypatch.setattr(staging, "_alloc", alloc)
    monkeypatch.setattr(staging, "_copy_into", copy_into)
    monkeypatch.setattr(staging, "_synchronize",
                        lambda devices: events.append(("sync", sorted(map(str, devices)))))
    store = memory_backend.open()
    g = torch.Generator().manual_seed(9)
    state = {f"w{i}": torch.randn(16 * KIB, generator=g) for i in range(16)}  # 1 MiB
    expected = clone(state)
    fut = store.save_async(1, state, staging_bytes=BUDGET)
    for t in state.values():
        t.add_(1)
    fut.result(timeout=120)
    assert [e for e in events if e[0] == "alloc"] == [("alloc", True)]  # one pinned slab
    copies = [e for e in events if e[0] == "copy"]
    assert copies == [("copy", True)] * 16
    syncs = [e for e in events if e[0] == "sync"]
    assert len(syncs) == 8 and syncs[0] == ("sync", ["cpu"])  # one per file of 2 tensors
    assert_state_equal(store.load(1), expected)
