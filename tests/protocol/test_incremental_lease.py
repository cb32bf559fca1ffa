"""A marker after the lease proves the whole checkpoint is still there, or is not kept.

An incremental save (format v3, its async save, format v4) commits within its lease of opening
its attempt (docs/protocol.md §9.4); garbage collection's grace exceeds the lease, so a
collector never takes the files of a save that kept its lease.  A save that stalls between its
fence (which passed, within the lease) and its marker, past the lease and past gc's grace, may
find its own attempt collected meanwhile: its marker must not stay.  Each test stalls the save
right before its marker (a storage wrapper), moves the saver's clock past the lease and runs gc
with its default grace at a time past it: the save fails with a typed error and nothing is
committed; the run's latest is the previous step, which loads."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import torch

from ckptfs.errors import CkptfsError, CorruptCheckpointError
from ckptfs.format.incremental import references_of
from ckptfs.format.layout import StepPaths
from ckptfs.lifecycle.gc import collect
from ckptfs.protocol import commit
from ckptfs.protocol.incremental import ReuseMemory
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.base import Storage, StorageWrapper
from ckptfs.testing.backend import Backend

LEASE_S = 60.0


class _Clock:
    """``time`` for one module: ``monotonic`` returns ``now``, which a test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _StallBeforeMarker(StorageWrapper):
    """Runs ``stall`` once, right before the marker of ``step`` is created (the save's fence
    has passed): the saver stalls there."""

    def __init__(self, inner: Storage, step: int, stall: Callable[[], None]) -> None:
        super().__init__(inner)
        self.target, self.stall, self.done = StepPaths(step).marker, stall, False

    def create_exclusive(self, path: str, data: bytes) -> None:
        if path == self.target and not self.done:
            self.done = True
            self.stall()
        super().create_exclusive(path, data)


@pytest.fixture(params=["memory", "local"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def _state(step: int, frozen: torch.Tensor) -> dict[str, Any]:
    return {"model": {"frozen": frozen, "head": torch.full((8,), float(step))}, "step": step}


def _stall(backend: Backend, clock: _Clock, step: int) -> Callable[[], None]:
    """The stall: the saver's clock jumps two hours (past its lease), and a collector with the
    default grace (1 h, above the lease) runs at that time and takes the uncommitted attempt of
    ``step`` (older than its grace by then)."""
    def stall() -> None:
        clock.now += 7200
        collector = backend.open()
        report = collect(collector.storage, now=datetime.now(timezone.utc) + timedelta(hours=2))
        gone = [i.path for i in report.items if i.removed and StepPaths(step).dir in i.path]
        assert gone, f"the collector removed nothing of step {step}: {report.items}"
    return stall


def _assert_not_committed(backend: Backend, step: int, previous: int) -> None:
    reader = backend.open()
    assert not backend.raw_exists(StepPaths(step).marker), f"step {step} stayed committed"
    assert step not in reader.steps()
    latest = reader.latest()
    assert latest is not None and latest.step == previous
    reader.load(previous)
    assert reader.verify(previous).ok


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_v3_save_stalled_past_its_lease_while_gc_took_its_attempt_is_not_committed(
        backend: Backend, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(commit, "time", clock)
    frozen = torch.randn(64, 64)
    plain = backend.open()
    store = CheckpointStore(_StallBeforeMarker(plain.storage, 2, _stall(backend, clock, 2)),
                            incremental=True, lease_s=LEASE_S)
    first = store.save(1, _state(1, frozen))
    assert not references_of(first.manifest)
    with pytest.raises(CkptfsError) as ei:
        if how == "save":
            store.save(2, _state(2, frozen))
        else:
            store.save_async(2, _state(2, frozen)).result(60)
    store.close()
    assert isinstance(ei.value, CorruptCheckpointError), ei.value
    assert "outlived its lease" in str(ei.value) and ei.value.step == 2  # type: ignore
    _assert_not_committed(backend, 2, 1)


def test_v3_save_whose_marker_lands_after_the_lease_with_every_file_there_commits(
        backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same stall with no collector: every file, its own and the referenced ones, is
    listed again after the marker, and the checkpoint stays committed."""
    clock = _Clock()
    monkeypatch.setattr(commit, "time", clock)
    frozen = torch.randn(64, 64)

    def stall() -> None:
        clock.now += 7200

    store = CheckpointStore(_StallBeforeMarker(backend.open().storage, 2, stall),
                            incremental=True, lease_s=LEASE_S)
    store.save(1, _state(1, frozen))
    info = store.save(2, _state(2, frozen))
    assert references_of(info.manifest)
    got = backend.open().load(2)
    assert torch.equal(got["model"]["frozen"], frozen)


@pytest.mark.sharded
def test_v4_save_stalled_past_its_lease_while_gc_took_its_attempt_is_not_committed(
        backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    from dist_util import save_sharded

    clock = _Clock()
    monkeypatch.setattr(commit, "time", clock)
    frozen = torch.randn(64, 64)
    storage = _StallBeforeMarker(backend.open().storage, 2, _stall(backend, clock, 2))
    memory = ReuseMemory()
    save_sharded(storage, 1, _state(1, frozen), memory=memory, lease_s=LEASE_S)
    with pytest.raises(CkptfsError) as ei:
        save_sharded(storage, 2, _state(2, frozen), memory=memory, lease_s=LEASE_S)
    assert isinstance(ei.value, CorruptCheckpointError), ei.value
    assert "outlived its lease" in str(ei.value)
    _assert_not_committed(backend, 2, 1)
