"""The reliability sweeps behind tests/test_crash_points.py, test_power_cut.py, test_concurrency.py,
test_corruption.py, test_hostile.py and test_transient.py, and the command that publishes their
figures in docs/reliability.md::

    python -m ckptfs.testing.reliability                # all backends, writes the JSON + table
    python -m ckptfs.testing.reliability --backends local memory

Each sweep returns a :class:`Sweep`: how many scenarios it tried, and every *violation* of an
invariant of docs/protocol.md it saw, as a sentence naming the scenario.  The tests assert that
the list is empty; the command counts.  Sweeps never stop at the first violation, so one run
reports all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from ..layout import StepPaths
from ..resolve import read_committed
from ..storage.base import Storage
from ..store import CheckpointStore
from .backend import Backend, unique_name
from .conformance import assert_state_equal
from .faults import FaultyStorage, SimulatedCrash

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
def _scenario(sweep: Sweep, scenario: str) -> Iterator[None]:
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
                recheck: set[int] | None = None) -> CheckpointStore:
    """A fresh reader (new client) sees exactly the expected latest, it verifies fully and loads
    bit-exactly, and every retained committed checkpoint is still listed as committed and
    verifies (quick; full with ``full_all``; only the steps in ``recheck`` when given, the
    others having been verified after they were written and untouched since)."""
    reader = backend.open()
    with _scenario(sweep, scenario):
        latest = reader.latest()
        got = None if latest is None else latest.step
        if got != expect_latest:
            sweep.bad(scenario, f"latest() is {got}, expected {expect_latest}")
        if latest is not None:
            reader.verify(latest.step)
            expected = (states or {}).get(latest.step)
            assert_state_equal(reader.load(latest.step),
                               state_for(latest.step) if expected is None else expected)
        steps = set(reader.steps())
        lost = committed - steps
        if lost:
            sweep.bad(scenario, f"committed checkpoints lost: {sorted(lost)}")
        for s in sorted(committed & steps):
            if recheck is None or s in recheck or full_all:
                reader.verify(s, quick=not full_all)
    return reader


# -- crash points of save ------------------------------------------------------------------------


def count_calls(backend: Backend, action: Callable[[CheckpointStore], object]) -> FaultyStorage:
    fs = FaultyStorage(raw_storage(backend))
    action(store_on(fs))
    return fs


def sweep_save_crashes(backend: Backend, *, tear: bool | None = None,
                       threads: int = 1) -> Sweep:
    """Crash a save at every mutating storage call (before it takes effect), once after the
    last call (the commit took effect, the writer never heard), and, where partial files exist
    (local disk, memory://), tear every data write; after each, check with a fresh reader and
    save again (same step, next step).  With ``threads`` > 1 the data files are written in
    parallel: the k-th call is then whichever thread gets there, and the other threads find the
    writer dead at their next call."""
    sweep = Sweep(backend.name, "save-crash")
    counter = count_calls(backend, lambda st: st.save(0, state_for(0)))
    ops = [c for c in counter.calls if c.index]
    n = len(ops)
    marker_k = next(c.index for c in ops if c.op == "create_exclusive")
    sweep.count("calls_per_save", n)
    committed = {0}
    if tear is None:
        tear = backend.protocol in ("file", "memory")
    inner = raw_storage(backend)
    plan: list[tuple[str, int]] = [("crash", k) for k in range(1, n + 1)] + [("crash-after", n)]
    if tear:
        plan += [("tear", c.index) for c in ops if c.op in ("write", "commit", "write_bytes")]
    step = 1
    for kind, k in plan:
        scenario = (f"{kind} at call {k}/{n} ({ops[k - 1].op} {ops[k - 1].path.split('/')[-1]})"
                    if threads == 1 else f"{kind} at call {k}/{n} ({threads} threads)")
        sweep.tried += 1
        sweep.count(kind)
        fs = FaultyStorage(inner, crash_at=k if kind != "tear" else None,
                           crash_after=kind == "crash-after",
                           tear_at=k if kind == "tear" else None)
        try:
            store_on(fs, threads).save(step, state_for(step))
            sweep.bad(scenario, "the save did not crash")
        except SimulatedCrash:
            pass
        except BaseException as exc:
            sweep.bad(scenario, f"the save raised {type(exc).__name__}: {exc} instead of dying")
        if fs.count != k and not (kind == "tear" and threads > 1):
            # (a torn write dies after persisting its prefix: other threads may have gone on)
            sweep.bad(scenario, f"crashed at call {fs.count}, not {k} (call order changed)")
        took_effect = k > marker_k or (kind == "crash-after" and k == marker_k)
        if took_effect:
            committed.add(step)
        again = check_store(sweep, scenario, backend, committed, max(committed),
                            recheck={step - 1, step})
        with _scenario(sweep, scenario + ", then saving again"):
            try:
                again.save(step, state_for(step))
                if took_effect:
                    sweep.bad(scenario, "re-saving the committed step was not refused")
            except CheckpointExistsError:
                if not took_effect:
                    sweep.bad(scenario, "re-saving an uncommitted step was refused")
            committed.add(step)
            again.save(step + 1, state_for(step + 1))
            committed.add(step + 1)
        step += 2
    check_store(sweep, "end of sweep", backend, committed, max(committed), full_all=True)
    return sweep


# -- crash points of delete, prune and gc --------------------------------------------------------


def sweep_delete_crashes(backend: Backend) -> Sweep:
    """Crash ``CheckpointStore.delete`` at every call: the step is either still committed and
    verifies fully, or reads as not committed; nothing else changes; deleting again works."""
    sweep = Sweep(backend.name, "delete-crash")
    base = store_on(raw_storage(backend))
    for s in (0, 1):
        base.save(s, state_for(s))
    committed = {0, 1}
    counter = count_calls(backend, lambda st: st.delete(1))
    committed.discard(1)
    n = counter.count
    sweep.count("calls_per_delete", n)
    victim = 2
    inner = raw_storage(backend)
    for kind, k in [("crash", k) for k in range(1, n + 1)] + [("crash-after", n)]:
        scenario = f"{kind} at call {k}/{n} of delete"
        sweep.tried += 1
        base.save(victim, state_for(victim))
        fs = FaultyStorage(inner, crash_at=k, crash_after=kind == "crash-after")
        try:
            store_on(fs).delete(victim)
            sweep.bad(scenario, "delete did not crash")
        except SimulatedCrash:
            pass
        except BaseException as exc:
            sweep.bad(scenario, f"delete raised {type(exc).__name__}: {exc}")
        still = victim in store_on(inner).steps()
        reader = check_store(sweep, scenario, backend, committed | ({victim} if still else set()),
                             victim if still else max(committed), full_all=still)
        with _scenario(sweep, scenario):
            if still:
                sweep.count("still_committed")  # its full verification ran in check_store
            else:
                try:
                    read_committed(reader.storage, victim)
                    sweep.bad(scenario, "step reads as committed but is not listed")
                except CheckpointNotFoundError:
                    pass
        with _scenario(sweep, scenario + ", then deleting again"):
            reader.delete(victim)
            if victim in reader.steps() or backend.raw_files(StepPaths(victim).dir):
                sweep.bad(scenario, "the second delete left files behind")
        victim += 1
    return sweep


# -- power cuts (local disk) ---------------------------------------------------------------------


def sweep_power_cuts(backend: Backend) -> Sweep:
    """On local disk: a first save completes, then a second is cut by a power failure after each
    of its mutating calls (0..n, n = completed), with unsynced file data lost (emptied or
    halved) and unsynced directory entries rolled back.  A save that returned must survive."""
    sweep = Sweep(backend.name, "power-cut")
    if backend.protocol != "file":
        raise ValueError("the power-cut model needs local disk")
    probe = backend.sibling()
    fs0 = FaultyStorage(raw_storage(probe), power_model=True)
    store_on(fs0).save(1, state_for(1))
    first = fs0.count
    store_on(fs0).save(2, state_for(2))
    ops = [c for c in fs0.calls if c.index > first]
    n = len(ops)
    marker_k = next(i for i, c in enumerate(ops, 1) if c.op == "create_exclusive")
    sweep.count("calls_per_save", n)
    for k in range(0, n + 1):
        lost: Literal["empty", "half"]
        for lost in ("empty", "half"):
            where = "before the save" if k == 0 else f"after call {k}/{n} ({ops[k - 1].op})"
            scenario = f"power cut {where}, unsynced data {lost}"
            sweep.tried += 1
            b = backend.sibling()
            fs = FaultyStorage(raw_storage(b), power_model=True)
            store_on(fs).save(1, state_for(1))
            fs.crash_at = fs.count + k + 1
            try:
                store_on(fs).save(2, state_for(2))
                if k < n:
                    sweep.bad(scenario, "the save did not stop")
            except SimulatedCrash:
                pass
            lost_counts = fs.power_cut(lost_data=lost)
            sweep.count("files_lost", lost_counts["lost_files"])
            sweep.count("entries_rolled_back", lost_counts["rolled_back_entries"])
            committed = {1, 2} if k >= marker_k else {1}
            check_store(sweep, scenario, b, committed, max(committed), full_all=True)
            with _scenario(sweep, scenario + ", then saving again"):
                again = b.open()
                if 2 not in committed:
                    again.save(2, state_for(2))
                again.save(3, state_for(3))
                again.verify(3)
    return sweep


def sweep_power_cut_delete(backend: Backend) -> Sweep:
    """On local disk: ``delete`` of the newest step cut by a power failure after each of its
    calls: the step is either still committed and verifies, or reads as not committed; the
    older checkpoint is intact."""
    sweep = Sweep(backend.name, "power-cut")
    probe = backend.sibling()
    fs0 = FaultyStorage(raw_storage(probe), power_model=True)
    for s in (1, 2):
        store_on(fs0).save(s, state_for(s))
    first = fs0.count
    store_on(fs0).delete(2)
    n = fs0.count - first
    sweep.count("calls_per_delete", n)
    for k in range(0, n + 1):
        scenario = f"power cut after call {k}/{n} of delete"
        sweep.tried += 1
        b = backend.sibling()
        fs = FaultyStorage(raw_storage(b), power_model=True)
        for s in (1, 2):
            store_on(fs).save(s, state_for(s))
        fs.crash_at = fs.count + k + 1
        with contextlib.suppress(SimulatedCrash):
            store_on(fs).delete(2)
        fs.power_cut()
        still = 2 in store_on(raw_storage(b)).steps()
        sweep.count("still_committed" if still else "deleted")
        check_store(sweep, scenario, b, {1, 2} if still else {1}, 2 if still else 1,
                    full_all=True)
    return sweep


def _prune_and_gc() -> tuple[Any, Any] | None:
    try:
        from .. import gc, retention
    except ImportError:  # pragma: no cover - both ship with ckptfs now
        return None
    return retention, gc


def sweep_prune_crashes(backend: Backend) -> Sweep:
    """Crash ``prune`` (keep the last 2 of 5) at every call: the kept checkpoints stay committed
    and verify, each pruned one is either still fully committed or reads as not committed, and a
    clean prune afterwards finishes the job."""
    sweep = Sweep(backend.name, "prune-crash")
    mods = _prune_and_gc()
    assert mods is not None
    retention, _ = mods
    policy = retention.RetentionPolicy(keep_last=2)
    base = store_on(raw_storage(backend))
    inner = raw_storage(backend)
    next_step = 0

    def fill() -> None:
        nonlocal next_step
        while len(base.steps()) < 5:
            base.save(next_step, state_for(next_step))
            next_step += 1

    fill()
    counter = FaultyStorage(raw_storage(backend))
    retention.prune(store_on(counter), policy)
    n = counter.count
    sweep.count("calls_per_prune", n)
    for kind, k in [("crash", k) for k in range(1, n + 1)] + [("crash-after", n)]:
        scenario = f"{kind} at call {k}/{n} of prune"
        sweep.tried += 1
        fill()
        before = base.steps()
        keep = set(before[-2:])
        fs = FaultyStorage(inner, crash_at=k, crash_after=kind == "crash-after")
        try:
            retention.prune(store_on(fs), policy)
            sweep.bad(scenario, "prune did not crash")
        except SimulatedCrash:
            pass
        except BaseException as exc:
            sweep.bad(scenario, f"prune raised {type(exc).__name__}: {exc}")
        remaining = set(store_on(inner).steps())
        # full verification of every step that still reads as committed: none is half-deleted
        reader = check_store(sweep, scenario, backend, keep | remaining, max(before),
                             full_all=True)
        with _scenario(sweep, scenario + ", then pruning again"):
            retention.prune(reader, policy)
            if set(reader.steps()) != keep:
                sweep.bad(scenario, f"a clean prune left {reader.steps()}, expected {keep}")
    return sweep


def sweep_gc_crashes(backend: Backend) -> Sweep:
    """Crash garbage collection at every call, with crashed attempts of two steps around three
    committed checkpoints: no committed checkpoint is touched, and a clean collection afterwards
    removes the rest."""
    sweep = Sweep(backend.name, "gc-crash")
    mods = _prune_and_gc()
    assert mods is not None
    _, gc = mods
    from datetime import datetime, timedelta, timezone

    later = datetime.now(timezone.utc) + timedelta(days=1)
    inner = raw_storage(backend)
    base = store_on(raw_storage(backend))
    next_step = 0

    def make_garbage() -> None:
        nonlocal next_step
        for _ in range(2):
            base.save(next_step, state_for(next_step))
            crashing = FaultyStorage(inner)
            crashing.crash_at = 4
            with contextlib.suppress(SimulatedCrash):
                store_on(crashing).save(next_step + 1, state_for(next_step + 1))
            next_step += 2

    def collect(storage: Storage) -> Any:
        return gc.collect(storage, older_than=timedelta(0), now=later, multipart=False)

    make_garbage()
    counter = FaultyStorage(raw_storage(backend))
    report = collect(counter)
    n = counter.count
    sweep.count("calls_per_gc", n)
    sweep.count("garbage_items_first_run", len(report.items))
    for kind, k in [("crash", k) for k in range(1, n + 1)] + [("crash-after", n)]:
        scenario = f"{kind} at call {k}/{n} of gc"
        sweep.tried += 1
        make_garbage()
        committed = set(base.steps())
        fs = FaultyStorage(inner, crash_at=k, crash_after=kind == "crash-after")
        try:
            collect(fs)
            if fs.count >= k:
                sweep.bad(scenario, "gc did not crash")
        except SimulatedCrash:
            pass
        except BaseException as exc:
            sweep.bad(scenario, f"gc raised {type(exc).__name__}: {exc}")
        reader = check_store(sweep, scenario, backend, committed, max(committed),
                             full_all=True)
        with _scenario(sweep, scenario + ", then collecting again"):
            collect(reader.storage)
            again = collect(reader.storage)
            left = [i.path for i in again.items if i.kind != "empty-step"]
            if left:
                sweep.bad(scenario, f"garbage left after two clean runs: {left}")
            check_store(sweep, scenario + " after gc", backend, committed, max(committed))
    return sweep


# -- races -----------------------------------------------------------------------------------


class _Gate:
    """Pause one writer before a given call until an event is set (deterministic races)."""

    def __init__(self, op: str, step: int) -> None:
        self.op = op
        self.step_dir = StepPaths(step).dir
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, op: str, path: str) -> None:
        if op == self.op and path.startswith(self.step_dir):
            self.reached.set()
            if not self.release.wait(120):
                raise TimeoutError("gate never released")


def _run(target: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, errors


def sweep_zombie(backend: Backend) -> Sweep:
    """A zombie job (the old one, still running) and its replacement, saving the same step in
    both orders of commit, and neighbouring steps interleaved call by call."""
    sweep = Sweep(backend.name, "race-zombie")
    exclusive = backend.open(retries=0).capabilities.exclusive_across_processes or (
        backend.protocol == "memory")
    new = store_on(raw_storage(backend))
    new.save(10, state_for(10))  # the checkpoint both resumed from
    committed = {10}

    def zombie_state(step: int) -> dict[str, Any]:
        return state_for(step + 1000)  # distinguishable content

    for first in ("new", "zombie"):
        step = 11 if first == "new" else 12
        scenario = f"same step {step}, {first} writer commits first"
        sweep.tried += 1
        gate = _Gate("create_exclusive", step)
        late_is_zombie = first == "new"
        late = store_on(FaultyStorage(raw_storage(backend), hook=gate))
        late_state = zombie_state(step) if late_is_zombie else state_for(step)
        early_state = state_for(step) if late_is_zombie else zombie_state(step)
        t, errors = _run(lambda: late.save(step, late_state))  # noqa: B023
        if not gate.reached.wait(120):
            sweep.bad(scenario, "the late writer never reached its commit")
        try:
            store_on(raw_storage(backend)).save(step, early_state)
        except Exception as exc:
            sweep.bad(scenario, f"the first committer failed: {exc!r}")
        gate.release.set()
        t.join(120)
        if not exclusive:
            sweep.count("not_exclusive")
        elif len(errors) != 1 or not isinstance(errors[0], CheckpointExistsError):
            sweep.bad(scenario, f"the late writer got {errors!r}, expected CheckpointExistsError")
        committed.add(step)
        reader = check_store(sweep, scenario, backend, committed, max(committed),
                             states={step: early_state})
        with _scenario(sweep, scenario):
            attempts = {k.split("/")[2] for k in backend.raw_files(StepPaths(step).dir)
                        if k.count("/") >= 3}
            if len(attempts) != 1:
                sweep.bad(scenario, f"the loser's attempt was not removed: {sorted(attempts)}")

    # neighbouring steps, strictly alternating calls (a turnstile in the hooks)
    scenario = "neighbouring steps 13 (zombie) and 14 (new), calls alternating"
    sweep.tried += 1
    cond = threading.Condition()
    turn = ["zombie"]
    done = {"zombie": False, "new": False}

    def turnstile(me: str, other: str) -> Callable[[str, str], None]:
        def hook(op: str, path: str) -> None:
            with cond:
                cond.wait_for(lambda: turn[0] == me or done[other], timeout=30)
                turn[0] = other
                cond.notify_all()
        return hook

    def run_writer(me: str, other: str, step: int, state: dict[str, Any]) -> None:
        try:
            store_on(FaultyStorage(raw_storage(backend), hook=turnstile(me, other))).save(
                step, state)
        finally:
            with cond:
                done[me] = True
                cond.notify_all()

    tz, ez = _run(lambda: run_writer("zombie", "new", 13, zombie_state(13)))
    tn, en = _run(lambda: run_writer("new", "zombie", 14, state_for(14)))
    tz.join(120)
    tn.join(120)
    if ez or en:
        sweep.bad(scenario, f"a writer failed: {ez + en!r}")
    committed |= {13, 14}
    reader = check_store(sweep, scenario, backend, committed, 14, full_all=True)
    with _scenario(sweep, scenario):
        assert_state_equal(reader.load(13), zombie_state(13))
    return sweep


def sweep_free_race(backend: Backend, *, trials: int = 3, writers: int = 2) -> Sweep:
    """Unsynchronised writers (separate clients) racing on one step: one winner per trial."""
    sweep = Sweep(backend.name, "race-free")
    exclusive = backend.open(retries=0).capabilities.exclusive_across_processes or (
        backend.protocol == "memory")
    committed: set[int] = set()
    for trial in range(trials):
        step = 100 + trial
        scenario = f"{writers} writers on step {step}"
        sweep.tried += 1
        stores = [store_on(raw_storage(backend)) for _ in range(writers)]
        barrier = threading.Barrier(writers)
        results: list[BaseException | None] = [None] * writers

        def go(i: int, step: int = step, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            stores[i].save(step, state_for(step + 1000 * i))  # noqa: B023

        threads = []
        for i in range(writers):
            t, errs = _run(lambda i=i: go(i))  # type: ignore[misc]
            threads.append((t, errs))
        for i, (t, errs) in enumerate(threads):
            t.join(120)
            results[i] = errs[0] if errs else None
        winners = [i for i, r in enumerate(results) if r is None]
        others = [r for r in results if r is not None]
        if any(not isinstance(r, CheckpointExistsError) for r in others):
            sweep.bad(scenario, f"a loser got {others!r}")
        if exclusive and len(winners) != 1:
            sweep.bad(scenario, f"{len(winners)} writers committed")
        committed.add(step)
        states = {step: state_for(step + 1000 * winners[0])} if len(winners) == 1 else None
        reader = check_store(sweep, scenario, backend, committed, step, states=states)
        with _scenario(sweep, scenario):
            loaded = reader.load(step)
            marker_attempt = reader.info(step).attempt
            matches = [i for i in range(writers)
                       if _state_equal(loaded, state_for(step + 1000 * i))]
            if len(matches) != 1:
                sweep.bad(scenario, f"the committed checkpoint ({marker_attempt}) is not exactly "
                          "one writer's state")
    return sweep


def _state_equal(a: Any, b: Any) -> bool:
    try:
        assert_state_equal(a, b)
    except AssertionError:
        return False
    return True


def sweep_reader_during_saves(backend: Backend, *, saves: int = 5) -> Sweep:
    """A reader calling latest() and load() in a loop while a writer saves: every load is the
    complete, exact state of the step it resolved; never an error."""
    sweep = Sweep(backend.name, "race-reader")
    writer = store_on(raw_storage(backend))
    reader = backend.open()
    writer.save(0, state_for(0))
    stop = threading.Event()
    seen: list[int] = []
    progress = threading.Semaphore(0)

    def read_loop() -> None:
        while not stop.is_set():
            info = reader.latest()
            if info is None:
                sweep.bad("reader", "latest() is None after a commit")
                continue
            try:
                loaded = reader.load(info.step)
            except CheckpointNotFoundError:
                sweep.count("deleted_while_loading")  # a prune won the race: not corruption
                continue
            finally:
                progress.release()
            if not _state_equal(loaded, state_for(info.step)):
                sweep.bad("reader", f"load({info.step}) returned a different state")
            seen.append(info.step)

    t, errors = _run(read_loop)
    try:
        for s in range(1, saves + 1):
            progress.acquire(timeout=30)  # let the reader overlap every save
            writer.save(s, state_for(s))
            # old ones get deleted while the reader runs: marker first, so never half-read
            if s >= 3:
                writer.delete(s - 3)
        progress.acquire(timeout=30)
    finally:
        stop.set()
        t.join(120)
    for exc in errors:
        sweep.bad("reader", f"raised {type(exc).__name__}: {exc}")
    sweep.tried = len(seen)
    sweep.count("distinct_steps_seen", len(set(seen)))
    return sweep


def sweep_prune_during_save(backend: Backend) -> Sweep:
    """Prune (keep the last 1) and a deletion of an old step while a save is paused just before
    its commit: the checkpoint resumed from and the one being written both survive."""
    sweep = Sweep(backend.name, "race-prune")
    mods = _prune_and_gc()
    assert mods is not None
    retention, gc = mods
    base = store_on(raw_storage(backend))
    for s in (1, 2, 3):
        base.save(s, state_for(s))
    for where in ("create_exclusive", "write_bytes"):
        scenario = f"prune + gc while the save of the next step waits before {where}"
        sweep.tried += 1
        resumed = max(base.steps())
        step = resumed + 1
        gate = _Gate(where, step)
        writer = store_on(FaultyStorage(raw_storage(backend), hook=gate))
        t, errors = _run(lambda: writer.save(step, state_for(step)))  # noqa: B023
        gate.reached.wait(120)
        with _scenario(sweep, scenario):
            retention.prune(store_on(raw_storage(backend)), retention.RetentionPolicy(keep_last=1))
            gc.collect(raw_storage(backend))  # default grace: a running writer is young
            if resumed not in base.steps():
                sweep.bad(scenario, f"the checkpoint resumed from ({resumed}) was pruned")
        gate.release.set()
        t.join(120)
        if errors:
            sweep.bad(scenario, f"the save failed: {errors!r}")
        check_store(sweep, scenario, backend, {resumed, step}, step, full_all=True)
    return sweep


def all_race_sweeps(make: Callable[[], Backend]) -> list[Sweep]:
    return [sweep_zombie(make()), sweep_free_race(make()), sweep_reader_during_saves(make()),
            sweep_prune_during_save(make())]


# -- transient faults ----------------------------------------------------------------------------


def sweep_transient(backend: Backend, *, trials: int = 8, p: float = 0.15,
                    attempts: int = 4) -> Sweep:
    """Saves with ``p`` of all storage calls failing transiently (half of the failures of
    mutating calls after the call took effect), through the retry layer: each save either
    commits a checkpoint that verifies, or fails with a typed error and leaves no marker (or,
    when the commit itself took effect but its answer was lost, a marker whose checkpoint
    verifies).  Retries are bounded: never more than ``attempts`` tries of one call."""
    from ..storage.retry import RetryingStorage

    sweep = Sweep(backend.name, "transient")
    inner = raw_storage(backend)
    clean = FaultyStorage(inner)
    store_on(clean).save(0, state_for(0))
    calls_per_save = clean.count + clean.stats.reads
    committed = {0}
    for trial in range(trials):
        step = trial + 1
        scenario = f"save of step {step} with p={p} (seed {trial})"
        sweep.tried += 1
        faulty = FaultyStorage(inner, transient_p=p, seed=trial)
        retrying = RetryingStorage(faulty, attempts=attempts, base_delay=0.001, max_delay=0.004,
                                   seed=trial)
        error: BaseException | None = None
        try:
            store_on(retrying).save(step, state_for(step))
        except CheckpointExistsError as exc:
            error = exc
            sweep.bad(scenario, f"refused as existing: {exc}")
        except Exception as exc:
            error = exc
        injected = faulty.stats.transient_before + faulty.stats.transient_after
        sweep.count("faults_injected", injected)
        sweep.count("retries", retrying.retries)
        total_calls = faulty.count + faulty.stats.reads
        if total_calls > attempts * 3 * calls_per_save:
            sweep.bad(scenario, f"{total_calls} storage calls for a save of {calls_per_save}: "
                      "retries are not bounded")
        marker = store_on(inner).storage.exists(StepPaths(step).marker)
        if error is None:
            sweep.count("committed")
            committed.add(step)
        elif not isinstance(error, CkptfsError):
            sweep.bad(scenario, f"untyped error {type(error).__name__}: {error}")
        elif marker:
            sweep.count("ambiguous_commit")  # the commit took effect, its answer was lost
            committed.add(step)
        else:
            sweep.count("failed_cleanly")
            if str(backend.url) not in str(error):
                sweep.bad(scenario, f"the error does not name the store: {error}")
        check_store(sweep, scenario, backend, committed, max(committed))
    return sweep


# -- corruption matrix ---------------------------------------------------------------------------


def _flip(data: bytes, pos: int, bit: int = 0) -> bytes:
    b = bytearray(data)
    b[pos] ^= 1 << bit
    return bytes(b)


def corruption_matrix(backend: Backend, *, marker_byte_sweep: bool | None = None) -> Sweep:
    """Every file of a committed checkpoint (state.msgpack, each safetensors file, MANIFEST.json,
    COMPLETE) flipped, truncated, extended, deleted, swapped with another checkpoint's; a stray
    file added; the manifest replaced by another checkpoint's; the marker edited field by field.
    Full verify and ``load(verify=True)`` must detect every one, naming the file; quick verify
    every size or inventory change.  With ``marker_byte_sweep`` every byte of the marker is also
    flipped: each flip must be detected or provably harmless (the marker still parses and binds
    the same step, attempt and manifest digest)."""
    sweep = Sweep(backend.name, "corruption")
    if marker_byte_sweep is None:
        marker_byte_sweep = backend.protocol in ("file", "memory")
    store = store_on(raw_storage(backend))
    store.save(1, state_for(1))
    store.save(2, state_for(2))
    t_step, o_step = 2, 1  # damage the newest, so "latest" meets the damage
    info1, info2 = store.info(t_step), store.info(o_step)
    pristine = {rel: backend.raw_read(rel) for rel in backend.raw_files(StepPaths(t_step).dir)}
    marker_rel = StepPaths(t_step).marker
    manifest_rel = f"{info1.path}/MANIFEST.json"
    other_manifest = backend.raw_read(f"{info2.path}/MANIFEST.json")
    other_marker = backend.raw_read(StepPaths(o_step).marker)

    def restore(rels: list[str]) -> None:
        for rel in rels:
            if rel in pristine:
                backend.raw_write(rel, pristine[rel])
            elif backend.raw_exists(rel):
                backend.raw_delete(rel)

    def marker_doc(**change: Any) -> bytes:
        doc = json.loads(pristine[marker_rel])
        doc.update(change)
        return (json.dumps(doc, sort_keys=True) + "\n").encode()

    cases: list[tuple[str, str, Callable[[], None], bool]] = []  # name, file, mutate, sized

    def add(name: str, rel: str, mutate: Callable[[], None], sized: bool) -> None:
        cases.append((name, rel, mutate, sized))

    def put(rel: str, data: bytes) -> Callable[[], None]:
        return lambda: backend.raw_write(rel, data)

    def remove(rel: str) -> Callable[[], None]:
        return lambda: backend.raw_delete(rel)

    files = [f"{info1.path}/{e.path}" for e in info1.manifest.files] + [manifest_rel]
    for rel in files:
        data = pristine[rel]
        base = rel.rsplit("/", 1)[-1]
        for pos_name, pos in (("first", 0), ("middle", len(data) // 2), ("last", len(data) - 1)):
            add(f"flip {pos_name} byte of {base}", rel, put(rel, _flip(data, pos)), False)
        add(f"truncate {base} by 1 byte", rel, put(rel, data[:-1]), True)
        add(f"truncate {base} to half", rel, put(rel, data[:len(data) // 2]), True)
        add(f"extend {base} by 1 byte", rel, put(rel, data + b"\0"), True)
        add(f"delete {base}", rel, remove(rel), True)
        other = backend.raw_read(f"{info2.path}/{base}")
        add(f"replace {base} with step {o_step}'s", rel, put(rel, other), len(other) != len(data))
    add("stray file in the attempt", f"{info1.path}/stray.bin",
        lambda: backend.raw_write(f"{info1.path}/stray.bin", b"junk"), True)
    add("stray safetensors in the attempt", f"{info1.path}/tensors-99999.safetensors",
        lambda: backend.raw_write(f"{info1.path}/tensors-99999.safetensors",
                                  pristine[f"{info1.path}/tensors-00000.safetensors"]), True)
    add("manifest replaced by another checkpoint's", manifest_rel,
        lambda: backend.raw_write(manifest_rel, other_manifest), False)
    def swap_pair() -> None:
        backend.raw_write(manifest_rel, other_manifest)
        backend.raw_write(marker_rel, other_marker)

    add("marker and manifest replaced by another checkpoint's", marker_rel, swap_pair, False)
    other_digest = json.loads(other_marker)["manifest_digest"]
    edits = {"manifest_digest": other_digest, "attempt": info2.attempt, "step": o_step,
             "manifest_size": json.loads(pristine[marker_rel])["manifest_size"] + 1,
             "format_version": 99, "schema": "other"}
    for key, value in edits.items():
        add(f"marker {key} edited", marker_rel, put(marker_rel, marker_doc(**{key: value})),
            False)
    mdata = pristine[marker_rel]
    add("marker truncated", marker_rel,
        lambda: backend.raw_write(marker_rel, mdata[:len(mdata) // 2]), False)
    add("marker extended", marker_rel, lambda: backend.raw_write(marker_rel, mdata + b"x"), False)
    add("marker emptied", marker_rel, lambda: backend.raw_write(marker_rel, b""), False)

    quick_tried = quick_detected = load_detected = 0
    reader = backend.open()
    for name, rel, mutate, sized in cases:
        sweep.tried += 1
        base = rel.rsplit("/", 1)[-1]
        mutate()
        stray = "stray" in name
        # full verify
        try:
            reader.verify(t_step)
            sweep.bad(name, "full verify passed")
        except CkptfsError as exc:
            if base not in str(exc):
                sweep.bad(name, f"full verify does not name {base}: {exc}")
            else:
                sweep.count("detected")
        # load
        try:
            loaded = reader.load(t_step, verify=True)
            if stray and _state_equal(loaded, state_for(t_step)):
                sweep.count("load_unaffected_by_stray")  # the files it reads are intact
            else:
                sweep.bad(name, "load(verify=True) returned")
        except CkptfsError as exc:
            if base not in str(exc):
                sweep.bad(name, f"load does not name {base}: {exc}")
            else:
                load_detected += 1
        # no silent rollback: the newest is damaged, so loading "the latest" must raise, never
        # return the older checkpoint (a stray file changes nothing load reads)
        try:
            latest = reader.load()
            if not (stray and _state_equal(latest, state_for(t_step))):
                sweep.bad(name, "load() of the latest returned instead of raising")
        except CorruptCheckpointError:
            sweep.count("latest_raised")
        except CkptfsError as exc:
            sweep.bad(name, f"load() of the latest raised {type(exc).__name__}: {exc}")
        if sized:
            quick_tried += 1
            try:
                reader.verify(t_step, quick=True)
                sweep.bad(name, "quick verify missed a size/inventory change")
            except CkptfsError:
                quick_detected += 1
        restore([rel, manifest_rel] if rel == marker_rel else [rel])
    sweep.count("load_detected", load_detected)
    sweep.count("quick_tried", quick_tried)
    sweep.count("quick_detected", quick_detected)

    if marker_byte_sweep:
        reader = store_on(raw_storage(backend))
        for pos in range(len(mdata)):
            sweep.count("marker_flips")
            backend.raw_write(marker_rel, _flip(mdata, pos, bit=pos % 7))
            try:
                got = read_committed(reader.storage, t_step)
                if (got.attempt, got.marker.manifest_digest) != (info1.attempt,
                                                                 info1.marker.manifest_digest):
                    sweep.bad(f"marker byte {pos} flipped", "accepted with different binding")
                sweep.count("marker_flips_harmless")
            except CkptfsError:
                sweep.count("marker_flips_detected")
        restore([marker_rel])
    reader = backend.open()
    with _scenario(sweep, "after the matrix"):
        reader.verify(1)
        reader.verify(2)
    return sweep


# -- hostile checkpoints -------------------------------------------------------------------------

#: A hostile checkpoint may make the reader use at most this much Python memory.
HOSTILE_MEMORY_LIMIT = 64 * 1024 * 1024


class _Planter:
    """Writes hostile checkpoints through the backdoor, each with a *valid* marker: the marker
    binds whatever manifest bytes the attacker chose, as an attacker can always arrange."""

    def __init__(self, backend: Backend) -> None:
        from ..hashing import digest_bytes
        from ..manifest import Marker

        self.backend = backend
        self._digest = digest_bytes
        self._marker = Marker
        donor = store_on(raw_storage(backend))
        info = donor.save(0, state_for(0))
        self.files = {e.path: backend.raw_read(f"{info.path}/{e.path}")
                      for e in info.manifest.files}
        self.step = 1000

    def entries(self, files: dict[str, bytes]) -> list[dict[str, Any]]:
        return [{"path": p, "size": len(d), "digest": self._digest("sha256", d),
                 "algorithm": "sha256"} for p, d in files.items()]

    def plant(self, *, files: dict[str, bytes] | None = None,
              entries: list[dict[str, Any]] | None = None, manifest: bytes | None = None,
              doc_edit: Callable[[dict[str, Any]], None] | None = None,
              marker_edit: Callable[[dict[str, Any]], None] | None = None) -> int:
        from ..layout import new_attempt_name

        self.step += 1
        step = self.step
        files = dict(self.files if files is None else files)
        attempt = new_attempt_name()
        adir = StepPaths(step).attempt_dir(attempt)
        for rel, data in files.items():
            self.backend.raw_write(f"{adir}/{rel}", data)
        doc: dict[str, Any] = {
            "schema": "ckptfs.manifest", "format_version": 1, "step": step, "attempt": attempt,
            "created": "2026-01-01T00:00:00+00:00", "hash_algorithm": "sha256",
            "files": self.entries(files) if entries is None else entries, "metadata": {}}
        if doc_edit is not None:
            doc_edit(doc)
        mbytes = manifest if manifest is not None else json.dumps(doc).encode()
        self.backend.raw_write(f"{adir}/MANIFEST.json", mbytes)
        marker = json.loads(self._marker(step, attempt, self._digest("sha256", mbytes),
                                         max(1, len(mbytes)), "2026-01-01T00:00:00+00:00",
                                         {}).to_bytes())
        if marker_edit is not None:
            marker_edit(marker)
        self.backend.raw_write(StepPaths(step).marker, json.dumps(marker).encode())
        return step


def _packb(obj: Any) -> bytes:
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def _state_doc(tree: Any, tensors: list[Any] | None = None) -> bytes:
    return _packb({"schema": "ckptfs.state", "format_version": 1, "tree": tree,
                   "tensors": tensors or []})


def _nested_msgpack(depth: int) -> bytes:
    # ["l", ["l", [...]]] built as bytes, so building it needs no recursion
    inner = _packb(None)
    for _ in range(depth):
        inner = b"\x92" + _packb("l") + b"\x91" + inner
    head = _packb({"schema": "ckptfs.state", "format_version": 1, "tensors": []})
    # replace the 3-entry map header with a 4-entry one and append the "tree" key
    return bytes([head[0] + 1]) + head[1:] + _packb("tree") + inner


class _Evil:
    """Unpickling this creates the sentinel file: proof that something executed."""

    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.sentinel, "w"))


def hostile_cases(pl: _Planter, sentinel: str, *, local: bool
                  ) -> list[tuple[str, Callable[[], int], str]]:
    """(name, plant -> step, expected) for every hostile input; ``expected`` is what load must
    raise: "unsafe" (:class:`UnsafeCheckpointError`), "typed" (any CkptfsError), or "" (may
    load, harmlessly)."""
    import io
    import pickle
    import struct

    f = pl.files
    state, shard = f["state.msgpack"], f["tensors-00000.safetensors"]
    cases: list[tuple[str, Callable[[], int], str]] = []

    def add(name: str, fn: Callable[[], int], expected: str = "typed") -> None:
        cases.append((name, fn, expected))

    def with_path(path: str) -> Callable[[], int]:
        def build() -> int:
            entries = pl.entries(f)
            entries.append({"path": path, "size": 4, "digest": pl._digest("sha256", b"evil"),
                            "algorithm": "sha256"})
            return pl.plant(entries=entries)
        return build

    for path in ["/etc/passwd", "../../secret.bin", "a/../../../secret.bin", "..", ".",
                 "..\\..\\secret.bin", "tensors\\x.safetensors", "state.msgpack\x00.txt",
                 "s3://other-bucket/key", "file:///etc/passwd", "gs://b/k", "C:/Windows/x",
                 "MANIFEST.json", "COMPLETE", ".hidden", "", "a//b", "x" * 600, "./x",
                 "tens\u00f6rs", "a/./b", "~/x", "%2e%2e/secret"]:
        add(f"manifest path {path[:40]!r}", with_path(path), "unsafe")

    def entry_edit(**change: Any) -> Callable[[], int]:
        def build() -> int:
            entries = pl.entries(f)
            for e in entries:
                if e["path"] == change.get("target", "tensors-00000.safetensors"):
                    e.update({k: v for k, v in change.items() if k != "target"})
            return pl.plant(entries=entries)
        return build

    for size in [1 << 50, (1 << 50) + 1, 1 << 40, 1 << 33, -1, True, 1.5, "12", None]:
        add(f"declared size {size!r} of a tensor file", entry_edit(size=size))
    add("declared size 1 PiB of state.msgpack", entry_edit(target="state.msgpack", size=1 << 50))
    add("declared size 16 GiB of state.msgpack",
        entry_edit(target="state.msgpack", size=1 << 34))
    add("digest with an unknown algorithm", entry_edit(digest="md5:00", algorithm="md5"))
    add("digest not hex", entry_edit(digest="sha256:zz"))
    add("duplicate file entries", lambda: pl.plant(entries=pl.entries(f) + pl.entries(f)))
    add("files is not a list", lambda: pl.plant(doc_edit=lambda d: d.update(files={"a": 1})))
    add("format version from the future",
        lambda: pl.plant(doc_edit=lambda d: d.update(format_version=99)))
    add("manifest is not JSON", lambda: pl.plant(manifest=b"\x80\x04\x95pickle"))
    add("manifest with NaN", lambda: pl.plant(manifest=b'{"schema": NaN}'))
    add("manifest JSON nested 100000 deep",
        lambda: pl.plant(manifest=b'{"schema":' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
    add("manifest step differs from its directory",
        lambda: pl.plant(doc_edit=lambda d: d.update(step=1)))
    add("marker names an attempt with '..'",
        lambda: pl.plant(marker_edit=lambda m: m.update(attempt="../../x")))
    add("marker names another step", lambda: pl.plant(marker_edit=lambda m: m.update(step=1)))
    add("marker declares a 1 TiB manifest",
        lambda: pl.plant(marker_edit=lambda m: m.update(manifest_size=1 << 40)))

    def with_files(**repl: bytes) -> Callable[[], int]:
        def build() -> int:
            files = dict(f)
            files.update({k.replace("__", "."): v for k, v in repl.items()})
            return pl.plant(files=files)
        return build

    hlen_huge = struct.pack("<Q", 1 << 60) + b"{}" + b" " * 6
    add("safetensors header length 2^60", with_files(**{"tensors-00000__safetensors": hlen_huge}))
    add("safetensors header length beyond the file",
        with_files(**{"tensors-00000__safetensors": struct.pack("<Q", 1000) + b"{}"}))
    add("safetensors header of 150 MB declared",
        with_files(**{"tensors-00000__safetensors": struct.pack("<Q", 150 << 20) + b"{}"}))

    def st_header(header: dict[str, Any], data: bytes = b"") -> bytes:
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        return struct.pack("<Q", len(h)) + h + data

    def shard_with(header: dict[str, Any], data: bytes = b"") -> Callable[[], int]:
        return with_files(**{"tensors-00000__safetensors": st_header(header, data)})

    add("safetensors offsets beyond the data",
        shard_with({"model.w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 1 << 40]}},
                   b"\0" * 64))
    add("safetensors shape product overflows",
        shard_with({"model.w": {"dtype": "F32", "shape": [1 << 62, 1 << 62],
                                "data_offsets": [0, 64]}}, b"\0" * 64))
    add("safetensors dtype 'PICKLE'",
        shard_with({"model.w": {"dtype": "PICKLE", "shape": [16], "data_offsets": [0, 64]}},
                   b"\0" * 64))
    add("safetensors negative dimension",
        shard_with({"model.w": {"dtype": "F32", "shape": [-4, -4], "data_offsets": [0, 64]}},
                   b"\0" * 64))
    add("safetensors overlapping tensors",
        shard_with({"a": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
                    "b": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}},
                   b"\0" * 64))
    add("safetensors header nested 100000 deep",
        with_files(**{"tensors-00000__safetensors": (
            lambda h: struct.pack("<Q", len(h)) + h)(b"[" * 100_000 + b"]" * 100_000)}))

    evil = pickle.dumps(_Evil(sentinel))
    add("state.msgpack is a pickle", with_files(state__msgpack=evil))
    buf = io.BytesIO()
    import torch as _torch

    _torch.save({"x": _Evil(sentinel)}, buf)
    add("tensor file is a torch.save zip (pickle inside)",
        with_files(**{"tensors-00000__safetensors": buf.getvalue()}))
    add("a pickle listed in the manifest but referenced by nothing",
        with_files(**{"data__pkl": evil}), "")
    add("state.msgpack nested 100000 deep", with_files(state__msgpack=_nested_msgpack(100_000)))
    add("state tree nested 300 deep (valid msgpack, beyond the tree limit)",
        with_files(state__msgpack=_nested_msgpack(300)))
    add("msgpack array header claiming 2^32-1 items",
        with_files(state__msgpack=b"\xdd\xff\xff\xff\xff" + b"\xc0" * 8))
    add("msgpack str header claiming 4 GiB",
        with_files(state__msgpack=b"\xdb\xff\xff\xff\xff" + b"a" * 8))
    add("msgpack map with 2^32-1 entries declared",
        with_files(state__msgpack=b"\xdf\xff\xff\xff\xff"))
    add("msgpack ext type in the document",
        with_files(state__msgpack=_state_doc(None)[:-1] + b"\xd4\x05\x00"), "unsafe")
    # ext -1 (timestamp) is decoded by msgpack itself into an inert Timestamp, never through
    # the ext hook: the document/tree checks reject it (CorruptCheckpointError)
    add("msgpack timestamp ext (-1) as the tensor list",
        with_files(state__msgpack=_state_doc(None)[:-1] + b"\xd6\xff\x00\x00\x00\x00"))
    add("msgpack timestamp ext (-1) in the tree",
        with_files(state__msgpack=_state_doc(["d", [["t", None]]])
                   .replace(b"\xc0", b"\xd6\xff\x00\x00\x00\x00")))
    add("msgpack trailing garbage", with_files(state__msgpack=state + b"\x00"))
    add("tensor slot naming '../secret.safetensors'",
        with_files(state__msgpack=_state_doc(["T", 0], [["../secret.safetensors", "w", "F32",
                                                         [4]]])), "unsafe")
    add("tensor slot naming an absolute path",
        with_files(state__msgpack=_state_doc(["T", 0], [["/etc/passwd", "w", "F32", [4]]])),
        "unsafe")
    add("tensor reference out of range",
        with_files(state__msgpack=_state_doc(["T", 99])))
    add("dtype tag naming a torch function",
        with_files(state__msgpack=_state_doc(["d", [["x", ["dt", "load"]]]])))
    add("dtype tag naming a dunder",
        with_files(state__msgpack=_state_doc(["dt", "__class__"])))
    add("big int of a million digits",
        with_files(state__msgpack=_state_doc(["i", "9" * 1_000_000])))
    add("unknown tag", with_files(state__msgpack=_state_doc(["pickle", "cos\nsystem"])))
    add("unhashable dict key",
        with_files(state__msgpack=_state_doc(["d", [[["l", []], None]]])))
    add("state root is a list", with_files(state__msgpack=_state_doc(["l", []])))
    add("state document of another schema",
        with_files(state__msgpack=_packb({"schema": "evil", "format_version": 1})))
    _ = shard
    if local:
        add("state.msgpack is a symlink to a file outside the root", lambda: _symlinked(
            pl, "state.msgpack", sentinel + ".secret"), "unsafe")
        add("attempt directory is a symlink", lambda: _symlinked(pl, None, None), "unsafe")
    return cases


def _symlinked(pl: _Planter, rel: str | None, target: str | None) -> int:
    """Plant a valid checkpoint, then replace a file (or the attempt directory) by a symlink."""
    import shutil as _shutil

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
        _shutil.move(adir, real)
        os.symlink(real, adir)
    return step


def _recorder(paths: list[str]) -> Callable[[str, str], None]:
    return lambda op, path: paths.append(path)


def hostile_sweep(backend: Backend) -> Sweep:
    """Every hostile input: a typed error (CkptfsError) from latest/load/verify, no storage
    access outside the checkpoint, nothing written, nothing executed, bounded memory."""
    import tempfile
    import tracemalloc

    sweep = Sweep(backend.name, "hostile")
    local = backend.protocol == "file"
    pl = _Planter(backend)
    inner = raw_storage(backend)
    with tempfile.TemporaryDirectory() as tmp:
        sentinel = os.path.join(tmp, "EXECUTED")
        for name, build, expected in hostile_cases(pl, sentinel, local=local):
            sweep.tried += 1
            try:
                step = build()
            except Exception as exc:  # pragma: no cover - a harness bug, reported
                sweep.bad(name, f"could not plant: {exc!r}")
                continue
            paths: list[str] = []
            audited = FaultyStorage(inner, hook=_recorder(paths))
            reader = CheckpointStore(audited, threads=1)
            before = backend.raw_files()
            outside_before = set(os.listdir(tmp))
            ops: list[tuple[str, Callable[[], object]]] = [
                ("latest", reader.latest), ("load", lambda: reader.load(step)),  # noqa: B023
                ("load unverified", lambda: reader.load(step, verify=False)),  # noqa: B023
                ("verify", lambda: reader.verify(step)),  # noqa: B023
                ("verify quick", lambda: reader.verify(step, quick=True))]  # noqa: B023
            accepted = []
            tracemalloc.start()
            try:
                for op_name, op in ops:
                    try:
                        op()
                        if op_name.startswith("load"):
                            # verify may pass: a consistent manifest vouches for the bytes;
                            # refusing hostile content is the loader's job
                            accepted.append(op_name)
                    except CkptfsError as exc:
                        sweep.count(type(exc).__name__)
                        if (expected == "unsafe" and op_name.startswith("load")
                                and not isinstance(exc, UnsafeCheckpointError)):
                            sweep.bad(name, f"{op_name} raised {type(exc).__name__}, not "
                                      f"UnsafeCheckpointError: {str(exc)[:200]}")
                    except BaseException as exc:
                        sweep.bad(name, f"{op_name} raised untyped {type(exc).__name__}: "
                                  f"{str(exc)[:200]}")
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            if expected and accepted:
                sweep.bad(name, f"accepted by {accepted}")
            if peak > HOSTILE_MEMORY_LIMIT:
                sweep.bad(name, f"peak Python memory {peak >> 20} MiB")
            sweep.counters["peak_bytes_max"] = max(sweep.counters.get("peak_bytes_max", 0), peak)
            for p in paths:
                parts = p.split("/")
                if (parts[0] != "checkpoints" or ".." in parts
                        or any(c in p for c in ("\\", "\x00", ":"))):
                    sweep.bad(name, f"storage accessed outside the checkpoints: {p!r}")
            if backend.raw_files() != before:
                sweep.bad(name, "reading wrote to storage")
            if os.path.exists(sentinel):
                sweep.bad(name, "code was executed (the pickle's sentinel exists)")
                os.unlink(sentinel)
            if set(os.listdir(tmp)) - outside_before:
                sweep.bad(name, "a file appeared outside the root")
            # the hostile step must not stop the next save (it is the newest)
            backend.raw_delete(StepPaths(step).dir)
    return sweep


# -- figures -------------------------------------------------------------------------------------

SERVER_OF = {"s3": "moto", "ministack": "ministack", "gcs": "gcs", "azure": "azurite"}
NAME_OF = {"local": "local", "memory": "memory", "s3": "s3-moto", "ministack": "s3-ministack",
           "gcs": "gcs-fake", "azure": "azure-azurite"}


@contextlib.contextmanager
def backends(names: list[str], tmp: str) -> Iterator[dict[str, Callable[[], Backend]]]:
    """Factories of fresh backends by short name, starting the servers needed."""
    from . import servers

    with contextlib.ExitStack() as stack:
        out: dict[str, Callable[[], Backend]] = {}
        for name in names:
            if name == "local":
                out[name] = lambda: Backend("local", f"file://{tmp}/{unique_name()}")
            elif name == "memory":
                out[name] = lambda: Backend("memory", f"memory://{unique_name()}")
            else:
                info = stack.enter_context(servers.SERVERS[SERVER_OF[name]]())

                def make(info: Any = info, name: str = name) -> Backend:
                    return Backend(NAME_OF[name], info.url(unique_name()),
                                   dict(info.storage_options), env=dict(info.env))

                out[name] = make
        yield out


def sweeps_for(name: str, make: Callable[[], Backend]) -> list[Sweep]:
    """Every sweep of one backend, as the figures command runs them (the tests run the same
    functions, some with fewer trials)."""
    out = [sweep_save_crashes(make()), sweep_delete_crashes(make()),
           sweep_prune_crashes(make()), sweep_gc_crashes(make())]
    if name in ("local", "memory"):
        out.append(sweep_save_crashes(make(), threads=4))
    if name == "local":
        out += [sweep_power_cuts(make()), sweep_power_cut_delete(make())]
    out += [sweep_zombie(make()), sweep_free_race(make(), trials=5, writers=3),
            sweep_reader_during_saves(make()), sweep_prune_during_save(make()),
            corruption_matrix(make()), sweep_transient(make(), trials=25, p=0.1),
            sweep_transient(make(), trials=25, p=0.2), hostile_sweep(make())]
    return out


def run_all(names: list[str], tmp: str) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {}
    with backends(names, tmp) as factories:
        for name, make in factories.items():
            t0 = time.monotonic()
            sweeps = sweeps_for(name, make)
            results[name] = [s.as_dict() for s in sweeps]
            print(f"{name}: {sum(s.tried for s in sweeps)} scenarios, "
                  f"{sum(len(s.violations) for s in sweeps)} violations, "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
            for s in sweeps:
                for v in s.violations:
                    print("  VIOLATION", v, file=sys.stderr)
    return {"generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "results": results}


COLUMNS = [
    ("save-crash", "save crash points"),
    ("delete-crash", "delete crash points"),
    ("prune-crash", "prune crash points"),
    ("gc-crash", "gc crash points"),
    ("power-cut", "power cuts"),
    ("race", "race trials"),
    ("corruption", "corruptions detected / tried"),
    ("transient", "saves under transient faults (committed)"),
    ("hostile", "hostile inputs"),
]


def _merge(sweeps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by: dict[str, dict[str, Any]] = {}
    for s in sweeps:
        key = "race" if s["name"].startswith("race") else s["name"]
        cur = by.setdefault(key, {"tried": 0, "violations": [], "counters": {}})
        cur["tried"] += s["tried"]
        cur["violations"] = cur["violations"] + s["violations"]
        for k, v in s["counters"].items():
            if k.endswith("_max") or k.startswith("calls_per"):
                cur["counters"][k] = max(cur["counters"].get(k, 0), v)
            else:
                cur["counters"][k] = cur["counters"].get(k, 0) + v
    return by


def table(doc: dict[str, Any]) -> str:
    lines = ["| backend | " + " | ".join(c[1] for c in COLUMNS) + " | violations |",
             "|---|" + "---:|" * (len(COLUMNS) + 1)]
    for name, sweeps in doc["results"].items():
        by = _merge(sweeps)
        cells = []
        for key, _ in COLUMNS:
            s = by.get(key)
            if s is None:
                cells.append("n/a")
            elif key == "corruption":
                cells.append(f"{s['counters'].get('detected', 0)} / {s['tried']}")
            elif key == "transient":
                cells.append(f"{s['tried']} ({s['counters'].get('committed', 0)})")
            else:
                cells.append(str(s["tried"]))
        viol = sum(len(s["violations"]) for s in sweeps)
        lines.append(f"| {NAME_OF.get(name, name)} | " + " | ".join(cells) + f" | {viol} |")
    return "\n".join(lines)


def details(doc: dict[str, Any]) -> str:
    """One line per backend with the counters behind the table."""
    lines = []
    for name, sweeps in doc["results"].items():
        by = _merge(sweeps)

        def c(key: str, counter: str, by: dict[str, dict[str, Any]] = by) -> int:
            return int(by.get(key, {}).get("counters", {}).get(counter, 0))

        parts = [f"{c('save-crash', 'calls_per_save')} mutating calls per save",
                 f"{c('save-crash', 'tear')} torn writes",
                 f"quick verify {c('corruption', 'quick_detected')} / "
                 f"{c('corruption', 'quick_tried')} size or inventory changes",
                 f"load detected {c('corruption', 'load_detected')} (+"
                 f"{c('corruption', 'load_unaffected_by_stray')} stray files that do not "
                 "change what it loads)",
                 f"load() of the damaged latest raised {c('corruption', 'latest_raised')} times"]
        if c("corruption", "marker_flips"):
            parts.append(f"marker byte flips {c('corruption', 'marker_flips')}: "
                         f"{c('corruption', 'marker_flips_detected')} detected, "
                         f"{c('corruption', 'marker_flips_harmless')} provably harmless")
        if "power-cut" in by:
            parts.append(f"power cuts rolled back {c('power-cut', 'entries_rolled_back')} "
                         "directory entries")
        parts.append(f"transient faults injected {c('transient', 'faults_injected')}, retries "
                     f"{c('transient', 'retries')}")
        parts.append(f"hostile-input peak memory "
                     f"{c('hostile', 'peak_bytes_max') / 2**20:.1f} MiB")
        lines.append(f"- {NAME_OF.get(name, name)}: " + "; ".join(parts) + ".")
    return "\n".join(lines)


BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"


def update_doc(doc_path: str, doc: dict[str, Any]) -> None:
    text = f"{BEGIN}\n{END}\n"
    if os.path.exists(doc_path):
        with open(doc_path) as f:
            text = f.read()
    block = (f"{BEGIN}\nLast run: {doc['generated']} (`python -m ckptfs.testing.reliability`).\n\n"
             f"{table(doc)}\n\n{details(doc)}\n{END}")
    text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text,
                  flags=re.DOTALL)
    with open(doc_path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m ckptfs.testing.reliability",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=list(NAME_OF),
                        choices=list(NAME_OF))
    parser.add_argument("--json", default="docs/reliability.json")
    parser.add_argument("--doc", default="docs/reliability.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        doc = run_all(args.backends, tmp)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    update_doc(args.doc, doc)
    print(table(doc))
    violations = sum(len(s["violations"]) for v in doc["results"].values() for s in v)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
