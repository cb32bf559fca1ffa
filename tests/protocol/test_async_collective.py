"""Asynchronous saves of sharded states (docs/async.md): ``store.save_async`` on every rank of
a 2-rank gloo job with an FSDP2/DTensor state: the snapshot, then the synchronous collective save
on the store's thread, on the store's own gloo group (one commit).

One job (spawning ranks costs seconds on 2 shared cores) checks: the values at call time are
what is committed (the DTensors, and NumPy arrays, a set, a Namespace with a tensor, a list, a
conjugate view, are mutated while the background write is held at a gate, and for a second
save before the store's thread has even planned it),
the training loop's collectives on the default group run while a save is in flight, both ranks
get the same CheckpointInfo, two saves in flight commit in order, and a storage failure on rank
1 is a typed error from ``result()`` on both ranks (and from the next ``wait`` when nobody
collected it), with no marker.

The tests after it run both layouts in this process (the collective one under a one-rank gloo
group): save_async writes the format store.save writes on an incremental store (v3, v4), and
two uncollected failures are both raised."""

from __future__ import annotations

import argparse
import contextlib
import copy
import threading
from collections.abc import Iterator
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_util import run_ranks
from test_sharded import FailingWrites, build_state, to_plain

import ckptfs
from ckptfs.errors import CkptfsError, ShardedSaveError, UnsupportedValueError
from ckptfs.format.incremental import references_of
from ckptfs.format.layout import StepPaths
from ckptfs.testing.conformance import assert_state_equal


class GatedWrites:
    """This rank's storage: data-file writes wait until ``gate`` is set (the background save
    has not written a byte of its shards before the test mutated them)."""

    def __init__(self, inner: Any, gate: threading.Event, reached: threading.Event) -> None:
        self._inner = inner
        self._gate = gate
        self._reached = reached

    def open_write(self, path: str) -> Any:
        if "/rank-" in path:
            self._reached.set()
            assert self._gate.wait(60), "gate never opened"
        return self._inner.open_write(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def mutate(value: Any) -> None:
    """Change every floating-point tensor and DTensor shard in place (the training loop)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        mutate(value._local_tensor)
    elif isinstance(value, torch.Tensor):
        with torch.no_grad():
            if value.dtype.is_floating_point or value.dtype == torch.int64:
                value.add_(100)
    elif isinstance(value, dict):
        for v in value.values():
            mutate(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            mutate(v)


def extra_values() -> dict[str, Any]:
    """Values beside the DTensors, identical on every rank: what the save plans (and so reads) on
    its own thread unless the snapshot copied them."""
    return {"np": np.arange(4, dtype=np.float32), "np_list": [np.ones(2)], "set": {1, 2},
            "ns": argparse.Namespace(w=torch.ones(2), tags=["a"]), "ints": [1, 2],
            "z": torch.complex(torch.ones(3), torch.arange(3.0)), "e1": torch.empty(0),
            "e2": torch.empty(0)}


def mutate_extra(extra: dict[str, Any]) -> None:
    extra["np"] += 100
    extra["np_list"][0][:] = 7
    extra["set"].add(3)
    extra["ns"].w.add_(5)
    extra["ns"].tags.append("b")
    extra["ints"].append(3)
    extra["z"].mul_(2)


def job_async_w2(rank: int, world: int, url: str, threshold: int | None) -> Any:
    import torch.distributed as dist

    import ckptfs.format.features as features
    from ckptfs.protocol import async_save, sharded

    if threshold is not None:  # the default store as a job of this many ranks or more
        features.PER_RANK_MIN_WORLD = threshold
    state, _ = build_state(world)
    extra = extra_values()
    extra["zc"] = extra["z"].conj()  # a conjugate view beside its base: two tensors
    state["extra"] = extra
    plain = copy.deepcopy(to_plain(state))  # the values at call time (full tensors, copies)
    out: dict[str, Any] = {"plain": plain if rank == 0 else None}
    gate, reached = threading.Event(), threading.Event()
    store = ckptfs.open(url)
    store.storage = GatedWrites(store.storage, gate, reached)  # type: ignore[assignment]
    fut = store.save_async(10, state, max_in_flight=2)
    assert reached.wait(60), "the background save never reached its writes"
    assert not fut.done()
    # Step 11 is snapshotted now, but planned (its values read) on the store's thread only once
    # step 10 has finished, after the changes below: what it stores must be the snapshot's.
    fut11 = store.save_async(11, state, max_in_flight=2)
    mutate(state)  # after save_async returned, before the background write
    mutate_extra(extra)
    total = torch.ones(1) * (rank + 1)
    dist.all_reduce(total)  # the training loop's own collective, while the save is in flight
    out["all_reduce"] = total.item()
    mutated = to_plain(state["dt"]["a"])  # collective: every rank
    out["mutated"] = mutated if rank == 0 else None
    gate.set()
    info = fut.result(timeout=60)
    out["info"] = (info.step, info.attempt, info.manifest.format_version,
                   info.manifest.world_size)
    out["info11"] = fut11.result(timeout=60).step
    saver = async_save.existing_saver(store)
    assert saver is not None
    group = saver.group
    out["own_group"] = (group is not None and group is not dist.group.WORLD
                        and all(group is not g for g in sharded._GROUP[1:]))
    # Two saves in flight (max_in_flight=2): they run one after the other on the group.
    f12 = store.save_async(12, state, max_in_flight=2)
    f13 = store.save_async(13, state, max_in_flight=2)
    out["in_order"] = [f.result(timeout=60).step for f in (f12, f13)]
    # A storage failure on rank 1: a typed error on both ranks, from result() ...
    bad = ckptfs.open(url)
    if rank == 1:
        bad.storage = FailingWrites(bad.storage)  # type: ignore[assignment]
    try:
        bad.save_async(14, state).result(timeout=60)
    except ShardedSaveError as exc:
        out["failure"] = (type(exc).__name__, str(exc), sorted(exc.failures))
    # ... and, when nobody collected it, from the store's next wait().
    bad.save_async(15, state)
    try:
        bad.wait()
    except ShardedSaveError as exc:
        out["uncollected"] = sorted(exc.failures)
    out["failed_count"] = bad.async_stats.failed
    # A value the format cannot hold on rank 0 only: save_async returns on both ranks (rank 1
    # must not be left waiting in the collective); result() raises it on both, naming rank 0.
    odd = dict(state, bad={"x": object()}) if rank == 0 else state
    try:
        store.save_async(16, odd).result(timeout=60)
    except UnsupportedValueError as exc:
        out["bad_value"] = str(exc)
    st = store.async_stats
    out["stats"] = (st.submitted, st.committed, st.failed)
    bad.close()
    store.close()
    return out


def check_extra(loaded: dict[str, Any]) -> None:
    """The values beside the DTensors, as they were at the call."""
    expected = extra_values()
    assert np.array_equal(loaded["np"], expected["np"]) and loaded["np"].dtype == np.float32
    assert type(loaded["np_list"][0]) is np.ndarray
    assert np.array_equal(loaded["np_list"][0], np.ones(2))
    assert loaded["set"] == {1, 2} and loaded["ints"] == [1, 2]
    assert type(loaded["ns"]) is argparse.Namespace and loaded["ns"].tags == ["a"]
    assert torch.equal(loaded["ns"].w, torch.ones(2))
    assert loaded["e1"].shape == loaded["e2"].shape == (0,)
    assert torch.equal(loaded["z"], expected["z"])
    assert torch.equal(loaded["zc"], expected["z"].conj().resolve_conj())


@pytest.mark.parametrize("threshold, version", [(None, 2), (2, 5)])
def test_sharded_save_async_two_ranks(tmp_path: Path, threshold: int | None,
                                      version: int) -> None:
    """The default store at 2 ranks (format v2) and as a job of 64 ranks or more takes it (the
    threshold lowered: format v5, per-rank metadata)."""
    url = str(tmp_path / "run")
    r0, r1 = run_ranks(job_async_w2, 2, url, threshold, timeout=180)
    expected = r0["plain"]
    expected_extra = expected.pop("extra")
    # Both ranks: the same committed checkpoint, of its format, written by 2 ranks.
    assert r0["info"] == r1["info"] and r0["info"][0] == 10
    assert r0["info"][2:] == (version, 2)
    assert r0["info11"] == r1["info11"] == 11
    assert r0["all_reduce"] == r1["all_reduce"] == 3.0
    assert r0["own_group"] and r1["own_group"]
    # The state was really changed before the write (and, for step 11, before it was planned),
    # yet both checkpoints hold the values at call time, bit-exact, in one process.
    assert not torch.equal(r0["mutated"], expected["dt"]["a"])
    store = ckptfs.open(url)
    for step in (11, 10):
        loaded = store.load(step)
        check_extra(loaded.pop("extra"))
        assert_state_equal(loaded, expected)
        assert store.verify(step).ok
    assert torch.equal(expected_extra["zc"], expected_extra["z"].conj())
    for r in (r0, r1):
        assert r["in_order"] == [12, 13]
        assert r["stats"] == (5, 4, 1)
        name, text, ranks = r["failure"]
        assert name == "ShardedSaveError" and ranks == [1] and "injected failure" in text
        assert r["uncollected"] == [1]
        assert r["failed_count"] == 2
        assert "rank(s) [0]" in r["bad_value"] and "object" in r["bad_value"]
    assert store.steps() == [10, 11, 12, 13]
    for step in (14, 15, 16):
        assert not (tmp_path / "run" / StepPaths(step).marker).exists()
    assert store.latest().step == 13  # type: ignore[union-attr]


# -- an incremental store: format v4, the reuse hint of the caller's tensors ---------------------


def test_async_sharded_incremental_hashes_only_unchanged_tensors(
        tmp_path: Path, monkeypatch: Any) -> None:
    """save_async of DTensors on an incremental store (a one-rank process group) writes format
    v4 as the synchronous sharded save does (before: v2), referencing the frozen base, and
    hashes exactly what the synchronous save hashes: a tensor the caller changed in place since
    the previous save (its autograd version moved) is not hashed as a candidate.  The writer
    sees staged copies, so the hint is the caller's tensor's, taken at the snapshot (before:
    every staged copy looked unchanged, and every tensor was hashed twice)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptfs.protocol import incremental
    from ckptfs.testing.reliability.paths import world_of_one

    hashed: list[int] = []
    real = incremental.tensor_digest

    def counting(t: torch.Tensor, algorithm: str) -> str:
        hashed.append(t.numel())
        return real(t, algorithm)

    monkeypatch.setattr(incremental, "tensor_digest", counting)  # the one reuse decision's
    counts: dict[str, list[list[int]]] = {}
    with world_of_one() as mesh:
        for how in ("sync", "async"):
            url = str(tmp_path / how)
            store = ckptfs.open(url, incremental=True)
            base = distribute_tensor(torch.randn(16, 4), mesh, [Shard(0)])
            head = distribute_tensor(torch.zeros(3, 5), mesh, [Shard(0)])
            infos = []
            counts[how] = []
            for step in (1, 2, 3):
                with torch.no_grad():
                    head.to_local().add_(1.0)  # the training loop: in place, version moves
                hashed.clear()
                state = {"base": base, "head": head}
                infos.append(store.save(step, state) if how == "sync"
                             else store.save_async(step, state).result(60))
                counts[how].append(list(hashed))
            store.close()
            assert [i.manifest.format_version for i in infos] == [4, 4, 4], how
            assert [len(getattr(i.manifest, "references", ())) for i in infos] == [0, 1, 1]
            got = ckptfs.open(url).load(3)
            assert torch.equal(got["base"], base.full_tensor())
            assert torch.equal(got["head"], torch.full((3, 5), 3.0))
    assert counts["async"] == counts["sync"] == [[], [64], [64]], counts  # the base only


# -- both layouts, in this process (a one-rank gloo group for the collective one) ----------------

LAYOUTS = ["one process", "collective"]


@contextlib.contextmanager
def layout_of(layout: str) -> Iterator[Any]:
    """The mesh of a collective layout (a one-rank gloo group, `world_of_one`), or None."""
    from ckptfs.testing.reliability.paths import world_of_one

    if layout == "one process":
        yield None
        return
    with world_of_one() as mesh:
        yield mesh


def in_layout(state: dict[str, Any], mesh: Any, memo: dict[int, Any]) -> dict[str, Any]:
    """``state`` as the layout saves it: its tensors DTensors on ``mesh`` when collective."""
    from ckptfs.testing.reliability.paths import as_dtensors

    return state if mesh is None else as_dtensors(state, mesh, memo)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_async_writes_what_save_writes_on_an_incremental_store(
        tmp_path: Path, layout: str) -> None:
    """One prepared save for both: on an incremental store, save_async writes the format
    store.save writes for the state's layout (v3 in one process, v4 collectively; before, a
    DTensor state got v2 from save_async), with the same references and bytes written."""
    got: dict[str, list[tuple[int, int, int]]] = {}
    with layout_of(layout) as mesh:
        memo: dict[int, Any] = {}
        frozen = torch.randn(16, 4)
        heads = [torch.full((3, 5), float(step)) for step in (1, 2)]  # alive: memo is by id
        for how in ("sync", "async"):
            root = str(tmp_path / how[0])  # dcp.msgpack holds the path: the same length
            store = ckptfs.open(root, incremental=True)
            got[how] = []
            for step, head in zip((1, 2), heads, strict=True):
                state = in_layout({"base": frozen, "head": head, "step": step}, mesh, memo)
                info = store.save(step, state) if how == "sync" else \
                    store.save_async(step, state).result(60)
                got[how].append((info.manifest.format_version,
                                 len(references_of(info.manifest)), info.bytes_written))
            store.close()
            assert torch.equal(ckptfs.open(root).load(2)["base"], frozen)
    version = 3 if layout == "one process" else 4
    assert [v for v, _, _ in got["sync"]] == [version, version]
    assert [r for _, r, _ in got["sync"]] == [0, 1]  # the second references the frozen base
    assert got["async"] == got["sync"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_uncollected_failures_are_both_raised(tmp_path: Path, layout: str) -> None:
    """Two background saves fail and nobody collects either, on both layouts: the store's next
    call raises the first (with a note naming the second), the call after it the second, each
    its own exception object; then the store saves again."""
    from test_async_save import FailingStorage, Gate

    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.testing.faults import FaultyStorage
    from ckptfs.testing.reliability.common import state_for

    with layout_of(layout) as mesh:
        gate = Gate()  # both submitted before either fails: the second call cannot raise it
        inner = ckptfs.open(str(tmp_path / "run")).storage
        store = CheckpointStore(FailingStorage(FaultyStorage(inner, hook=gate), fail=2))
        gate.close()
        f1 = store.save_async(1, in_layout(state_for(1), mesh, {}), max_in_flight=2)
        f2 = store.save_async(2, in_layout(state_for(2), mesh, {}), max_in_flight=2)
        gate.open()
        wait_futures([f1, f2], timeout=60)  # done, not collected
        assert f1.failure() is not None and f2.failure() is not None
        with pytest.raises(CkptfsError, match="injected") as e1:
            store.wait()
        assert e1.value is f1.failure()
        [also] = [n for n in getattr(e1.value, "__notes__", []) if "more background" in n]
        assert "step 2" in also
        with pytest.raises(CkptfsError, match="injected") as e2:
            store.wait()
        assert e2.value is f2.failure()
        store.wait()  # nothing left
        assert store.save_async(3, in_layout(state_for(3), mesh, {})).result(60).step == 3
        assert store.steps() == [3] and store.async_stats.failed == 2
        store.close()
