"""Conformance of the training-run lifecycle (`CheckpointManager`) on a backend.

Like `ckptfs.testing.conformance`, a backend's test module provides a ``backend`` fixture
and subclasses `ManagerConformance`; the same resume, retention, best-tracking and
garbage-collection behaviour is then checked on that storage.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from datetime import datetime, timedelta, timezone
from typing import Any, BinaryIO

import pytest
import torch

from ckptfs.cli.demo import ToyTask, train
from ckptfs.errors import CheckpointNotFoundError
from ckptfs.format.layout import StepPaths, new_attempt_name
from ckptfs.lifecycle.gc import collect
from ckptfs.lifecycle.manager import CheckpointManager
from ckptfs.lifecycle.retention import Best
from ckptfs.lifecycle.rng import seed_all
from ckptfs.storage.base import Entry, Storage, StorageWrapper
from ckptfs.testing.backend import Backend


class InjectedCrash(RuntimeError):
    """The process "dies" at a storage call.  Not a StorageError, so no retry layer repeats
    the call: the operation stops there, as it would if the process were killed."""


class CrashingStorage(StorageWrapper):
    """Wraps a storage; raises `InjectedCrash` on the first call of ``method`` (a
    member of `Storage`) whose path contains ``match``: an
    injected crash at one storage call, for crash tests.  Every other call, and every call
    after the crash, goes to ``inner`` unchanged (an explicit
    `StorageWrapper`: the optional capabilities of ``inner`` are
    kept)."""

    METHODS = ("read_bytes", "open_read", "open_write", "write_bytes", "create_exclusive",
               "list_dir", "list_tree", "exists", "delete", "delete_tree", "makedirs",
               "rename_dir", "sync_dir")

    def __init__(self, inner: Storage, method: str, match: str = "") -> None:
        if method not in self.METHODS:
            raise ValueError(f"CrashingStorage crashes one of {self.METHODS}, not {method!r}")
        super().__init__(inner)
        self.method, self.match = method, match
        self.crashed = False

    def _at(self, name: str, path: str) -> None:
        if name == self.method and self.match in path and not self.crashed:
            self.crashed = True
            raise InjectedCrash(f"injected crash at {name}({path!r})")

    def read_bytes(self, path: str) -> bytes:
        self._at("read_bytes", path)
        return super().read_bytes(path)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        self._at("open_read", path)
        return super().open_read(path)

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        self._at("open_write", path)
        return super().open_write(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self._at("write_bytes", path)
        super().write_bytes(path, data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._at("create_exclusive", path)
        super().create_exclusive(path, data)

    def list_dir(self, path: str) -> list[Entry]:
        self._at("list_dir", path)
        return super().list_dir(path)

    def list_tree(self, path: str) -> list[Entry]:
        self._at("list_tree", path)
        return super().list_tree(path)

    def exists(self, path: str) -> bool:
        self._at("exists", path)
        return super().exists(path)

    def delete(self, path: str) -> None:
        self._at("delete", path)
        super().delete(path)

    def delete_tree(self, path: str) -> None:
        self._at("delete_tree", path)
        super().delete_tree(path)

    def makedirs(self, path: str) -> None:
        self._at("makedirs", path)
        super().makedirs(path)

    def rename_dir(self, src: str, dst: str) -> None:
        self._at("rename_dir", src)
        super().rename_dir(src, dst)

    def sync_dir(self, path: str) -> None:
        self._at("sync_dir", path)
        super().sync_dir(path)


def run_reference(total: int) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    task = ToyTask()
    losses = train(task, None, 0, total, 10**9)
    return losses, task.params()


def resume_and_finish(backend: Backend, total: int, save_every: int
                      ) -> tuple[int, dict[int, float], dict[str, torch.Tensor]]:
    """A fresh process's view: new objects, scrambled RNG, restore, train to the end."""
    seed_all(987654)
    random.random()
    task = ToyTask(seed=4242)  # different init: everything must come from the checkpoint
    mgr = CheckpointManager(backend.open(), save_every=save_every, run_seed=7)
    start = mgr.restore_latest(model=task.model, optimizer=task.opt, scheduler=task.sched,
                               stateful={"sampler": task.sampler})
    losses = train(task, mgr, start, total, save_every)
    return start, losses, task.params()


class ManagerConformance:
    """Resume, retention, best and GC through the manager on one backend."""

    TOTAL = 36
    EVERY = 10

    def test_resume_is_bit_identical(self, backend: Backend) -> None:
        ref_losses, ref_params = run_reference(self.TOTAL)
        task = ToyTask()
        mgr = CheckpointManager(backend.open(), save_every=self.EVERY, run_seed=7)
        assert mgr.restore_latest(model=task.model, optimizer=task.opt) == 0
        # "killed" after step 24: the last save is step 20
        first = train(task, mgr, 0, 25, self.EVERY, final_save=False)
        assert backend.open().steps() == [10, 20]
        start, resumed, params = resume_and_finish(backend, self.TOTAL, self.EVERY)
        assert start == 21
        assert all(first[s] == ref_losses[s] for s in first)
        assert [resumed[s].hex() for s in range(21, self.TOTAL)] == \
            [ref_losses[s].hex() for s in range(21, self.TOTAL)]
        for k, v in ref_params.items():
            assert torch.equal(params[k], v), k

    def test_crash_in_save_then_resume(self, backend: Backend) -> None:
        ref_losses, ref_params = run_reference(self.TOTAL)
        store = backend.open()
        store.storage = CrashingStorage(store.storage, "create_exclusive",
                                        "step-000000000020/COMPLETE")
        task = ToyTask()
        mgr = CheckpointManager(store, save_every=self.EVERY, run_seed=7)
        with pytest.raises(InjectedCrash, match="injected crash"):
            train(task, mgr, 0, self.TOTAL, self.EVERY)
        fresh = backend.open()
        assert fresh.steps() == [10] and 20 in fresh.all_steps()
        info = fresh.latest()
        assert info is not None and info.step == 10
        start, resumed, params = resume_and_finish(backend, self.TOTAL, self.EVERY)
        assert start == 11
        assert all(resumed[s] == ref_losses[s] for s in range(11, self.TOTAL))
        assert all(torch.equal(params[k], v) for k, v in ref_params.items())
        report = collect(backend.open().storage, older_than=timedelta(0))
        assert [i.kind for i in report.items if i.removed] == ["attempt"]
        assert backend.open().steps() == [10, 20, 30, 35]

    def test_retention_after_commit(self, backend: Backend) -> None:
        mgr = CheckpointManager(backend.open(), keep_last=2, keep_every=30)
        state = {"w": torch.zeros(3)}
        for step in range(10, 80, 10):
            result = mgr.save(step, stateful={"s": _Plain(state)})
            assert result.info is not None and result.info.step == step
        assert backend.open().steps() == [30, 60, 70]
        for step in (10, 20, 40, 50):
            assert not backend.raw_exists(StepPaths(step).marker)

    def test_best_pool_and_self_heal(self, backend: Backend) -> None:
        mgr = CheckpointManager(backend.open(), keep_last=1,
                                best=Best("eval/loss", "min", keep=2))
        values = {10: 5.0, 20: 4.0, 30: 4.5, 40: float("nan"), 50: 3.0, 60: None, 70: 3.5}
        for step, v in values.items():
            mgr.save(step, metrics={"eval/loss": v})
        assert mgr.best_steps() == [20, 50]
        assert backend.open().steps() == [20, 50, 70]
        other = CheckpointManager(backend.open(), best=Best("eval/loss", "min", keep=2))
        assert other.best() == {"step": 50, "value": 3.0}
        backend.open().delete(50)
        healed = CheckpointManager(backend.open(), best=Best("eval/loss", "min", keep=2))
        assert healed.best_steps() == [20]

    def test_gc_grace_period(self, backend: Backend) -> None:
        store = backend.open()
        store.save(1, {"x": torch.ones(4)})
        old = new_attempt_name(datetime.now(timezone.utc) - timedelta(hours=3))
        young = new_attempt_name()
        for attempt in (old, young):
            backend.raw_write(f"{StepPaths(2).attempt_dir(attempt)}/state.msgpack", b"x" * 100)
        report = collect(store.storage, older_than=timedelta(hours=1))
        removed = [i.path for i in report.items if i.removed]
        assert removed == [StepPaths(2).attempt_dir(old)]
        assert report.bytes_freed == 100
        assert backend.raw_exists(StepPaths(2).attempt_dir(young) + "/state.msgpack")
        assert store.steps() == [1]
        with pytest.raises(CheckpointNotFoundError):
            store.info(2)


class _Plain:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state
