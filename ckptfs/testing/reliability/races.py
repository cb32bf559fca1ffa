"""Race sweeps: a zombie job and its replacement saving the same step, unsynchronised writers
racing on one step, a reader during saves, and ``prune`` during a save; made deterministic
with gates that pause one writer before a chosen storage call."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ckptfs.errors import CheckpointExistsError, CheckpointNotFoundError
from ckptfs.format.layout import StepPaths
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal
from ckptfs.testing.faults import FaultyStorage
from ckptfs.testing.reliability.common import (
    Sweep,
    check_store,
    prune_and_gc_api,
    raw_storage,
    scenario_guard,
    state_for,
    states_equal,
    store_on,
)
from ckptfs.testing.reliability.paths import V1, WritePath


class _Gate:
    """Pause one writer before a given call until an event is set (deterministic races)."""

    def __init__(self, ops: tuple[str, ...], step: int, suffix: str = "") -> None:
        self.ops = ops
        self.suffix = suffix
        self.step_dir = StepPaths(step).dir
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, op: str, path: str) -> None:
        if op in self.ops and path.startswith(self.step_dir) and path.endswith(self.suffix):
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
        gate = _Gate(("create_exclusive",), step)
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
        with scenario_guard(sweep, scenario):
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
    with scenario_guard(sweep, scenario):
        assert_state_equal(reader.load(13), zombie_state(13))
    return sweep


def sweep_free_race(backend: Backend, *, trials: int = 3, writers: int = 2,
                    paths: Sequence[WritePath] = (V1,)) -> Sweep:
    """Unsynchronised writers (separate clients) racing on one step: one winner per trial.
    Writer ``i`` writes through ``paths[i % len(paths)]`` (`.paths`: a save, an async
    save, a copy and a sharded save racing each other), each its own state."""
    sweep = Sweep(backend.name, "race-free" if tuple(paths) == (V1,) else
                  "race-free (" + ", ".join(p.name for p in paths) + ")")
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
            paths[i % len(paths)].save(stores[i], step, state_for(step + 1000 * i))  # noqa: B023

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
            sweep.bad(scenario, f"a loser got {[type(r).__name__ for r in others]}: "
                                f"{others!r}")
        if exclusive and len(winners) != 1:
            sweep.bad(scenario, f"{len(winners)} writers committed")
        committed.add(step)
        states = {step: state_for(step + 1000 * winners[0])} if len(winners) == 1 else None
        reader = check_store(sweep, scenario, backend, committed, step, states=states)
        with scenario_guard(sweep, scenario):
            loaded = reader.load(step)
            marker_attempt = reader.info(step).attempt
            matches = [i for i in range(writers)
                       if states_equal(loaded, state_for(step + 1000 * i))]
            if len(matches) != 1:
                sweep.bad(scenario, f"the committed checkpoint ({marker_attempt}) is not exactly "
                          "one writer's state")
    return sweep


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
            if not states_equal(loaded, state_for(info.step)):
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
    mods = prune_and_gc_api()
    assert mods is not None
    retention, gc = mods
    base = store_on(raw_storage(backend))
    for s in (1, 2, 3):
        base.save(s, state_for(s))
    # before the marker; before the manifest (a whole document, or streamed where the
    # commit fsyncs it in its one step: local disk)
    for where, ops, suffix in (("create_exclusive", ("create_exclusive",), ""),
                               ("the manifest's write", ("write_bytes", "open_write"),
                                "/MANIFEST.json")):
        scenario = f"prune + gc while the save of the next step waits before {where}"
        sweep.tried += 1
        resumed = max(base.steps())
        step = resumed + 1
        gate = _Gate(ops, step, suffix)
        writer = store_on(FaultyStorage(raw_storage(backend), hook=gate))
        t, errors = _run(lambda: writer.save(step, state_for(step)))  # noqa: B023
        gate.reached.wait(120)
        with scenario_guard(sweep, scenario):
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
