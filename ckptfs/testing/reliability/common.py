"""What every reliability sweep shares: the `Sweep` record, the deterministic state
saved at each step, fresh storage clients without the retry layer, and `check_store`, the
check run after every scenario (a fresh reader sees exactly the expected latest, which loads
bit-exactly, and no committed checkpoint is lost)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ckptfs.protocol.resolve import read_committed
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.base import Storage
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal

#: Small shards, so a tiny state still makes several files (more crash points per save).
SWEEP_SHARD_BYTES = 64


@dataclass
class Sweep:
    """Scenarios tried and invariant violations seen by one sweep on one backend."""

    backend: str
    name: str
    tried: int = 0
    violations: list[str] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    #: Per scenario, what each operation did (the error class, or "ok"): how the sweeps compare
    #: one input's outcome across paths (the same typed error through every path).
    outcomes: dict[str, dict[str, str]] = field(default_factory=dict)

    def bad(self, scenario: str, what: str) -> None:
        self.violations.append(f"[{self.backend} {self.name}] {scenario}: {what}")

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_for(step: int) -> dict[str, Any]:
    """The state saved at ``step`` in every sweep: deterministic (any load can be compared bit
    for bit), small, and with ``SWEEP_SHARD_BYTES`` spread over several tensor files."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)},
            "optimizer": {"step": torch.tensor(float(step)),
                          "exp_avg": torch.randn(4, 4, generator=g)},
            "trainer": {"step": step, "lr": 0.1, "tag": f"s{step}", "tuple": (1, 2.5, None)}}


def raw_storage(backend: Backend) -> Storage:
    """A fresh storage client on the backend, without the retry layer (faults are exact)."""
    return backend.open(retries=0).storage


def store_on(storage: Storage, threads: int = 1) -> CheckpointStore:
    """Single-threaded by default, so the order of storage calls (the crash points) is
    deterministic."""
    return CheckpointStore(storage, threads=threads, shard_bytes=SWEEP_SHARD_BYTES)


@contextlib.contextmanager
def scenario_guard(sweep: Sweep, scenario: str) -> Iterator[None]:
    """Run one check; an unexpected exception is a violation, not a crash of the sweep."""
    try:
        yield
    except AssertionError as exc:
        sweep.bad(scenario, f"assertion failed: {exc}")
    except Exception as exc:
        sweep.bad(scenario, f"unexpected {type(exc).__name__}: {exc}")


def check_store(sweep: Sweep, scenario: str, backend: Backend, committed: set[int],
                expect_latest: int | None, *, full_all: bool = False,
                states: dict[int, Any] | None = None,
                recheck: set[int] | None = None,
                state: Callable[[int], Any] | None = None) -> CheckpointStore:
    """A fresh reader (new client) sees exactly the expected latest, it verifies fully and loads
    bit-exactly, and every retained committed checkpoint is still listed as committed and
    verifies (quick; full with ``full_all``; only the steps in ``recheck`` when given, the
    others having been verified after they were written and untouched since).  ``state``: the
    state saved at a step (default `state_for`)."""
    reader = backend.open()
    with scenario_guard(sweep, scenario):
        latest = reader.latest()
        got = None if latest is None else latest.step
        if got != expect_latest:
            sweep.bad(scenario, f"latest() is {got}, expected {expect_latest}")
        if latest is not None:
            reader.verify(latest.step)
            expected = (states or {}).get(latest.step)
            assert_state_equal(reader.load(latest.step),
                               (state or state_for)(latest.step) if expected is None
                               else expected)
        steps = set(reader.steps())
        lost = committed - steps
        if lost:
            sweep.bad(scenario, f"committed checkpoints lost: {sorted(lost)}")
        for s in sorted(committed & steps):
            if recheck is None or s in recheck or full_all:
                reader.verify(s, quick=not full_all)
    return reader


def died(exc: BaseException) -> bool:
    """Whether ``exc`` is a simulated crash, or carries one: DCP catches every exception of a
    rank's step (``BaseException`` included) and reports it in a ``CheckpointException``, which
    the sharded save raises as `ShardedSaveError`.  A killed process
    raises nothing; in the sweeps the crashed writer's storage refuses every later call, so
    whatever the wrapper does afterwards cannot reach storage."""
    from ckptfs.testing.faults import SimulatedCrash

    todo: list[Any] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if isinstance(e, tuple) and e:
            e = e[0]
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        if isinstance(e, SimulatedCrash):
            return True
        seen.add(id(e))
        failures = getattr(e, "failures", None)
        todo += [e.__cause__, e.__context__,
                 *(failures.values() if isinstance(failures, dict) else ())]
    return False


def prune_and_gc_api() -> tuple[Any, Any] | None:
    try:
        from ckptfs.lifecycle import gc, retention
    except ImportError:  # pragma: no cover - both ship with ckptfs now
        return None
    return retention, gc


def states_equal(a: Any, b: Any) -> bool:
    try:
        assert_state_equal(a, b)
    except AssertionError:
        return False
    return True


class Evil:
    """Unpickling this creates the sentinel file: proof that something executed."""

    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.sentinel, "w"))


def plant_symlinked(pl: Any, rel: str | None, target: str | None) -> int:
    """Plant a valid checkpoint with ``pl`` (a hostile-input planter of either format), then replace
    its file ``rel`` (or, with ``rel`` None, the attempt directory) by a symbolic link."""
    step = pl.plant()
    b = pl.backend
    info = read_committed(raw_storage(b), step)
    root = b.raw_root
    adir = os.path.join(root, *info.path.split("/"))
    if rel is not None and target is not None:
        with open(target, "wb") as fh:
            fh.write(pl.files[rel])  # same bytes, so only the link check can refuse it
        os.unlink(os.path.join(adir, rel))
        os.symlink(target, os.path.join(adir, rel))
    else:
        real = adir + "-real"
        shutil.move(adir, real)
        os.symlink(real, adir)
    return int(step)
