"""Crash-point sweeps: ``save``, ``delete``, ``prune`` and ``gc`` stopped (crashed, optionally
with a torn write) before each of their storage calls in turn, then checked with
`check_store` and by running the operation again."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ckptfs.errors import CheckpointExistsError, CheckpointNotFoundError
from ckptfs.format.incremental import references_of
from ckptfs.format.layout import StepPaths
from ckptfs.protocol.resolve import read_committed
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.base import Storage
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage, SimulatedCrash
from ckptfs.testing.reliability.common import (
    Sweep,
    check_store,
    died,
    prune_and_gc_api,
    raw_storage,
    scenario_guard,
    state_for,
    store_on,
)
from ckptfs.testing.reliability.paths import V1, WritePath
from ckptfs.testing.reliability.paths import V3 as V3_PATH


def count_calls(backend: Backend, action: Callable[[CheckpointStore], object]) -> FaultyStorage:
    fs = FaultyStorage(raw_storage(backend))
    action(store_on(fs))
    return fs


def sweep_save_crashes(backend: Backend, *, tear: bool | None = None, threads: int = 1,
                       path: WritePath = V1) -> Sweep:
    """Crash a save at every mutating storage call (before it takes effect), once after the
    last call (the commit took effect, the writer never heard), and, where partial files exist
    (local disk, memory://), tear every data write; after each, check with a fresh reader and
    save again (same step, next step).  With ``threads`` > 1 the data files are written in
    parallel: the k-th call is then whichever thread gets there, and the other threads find the
    writer dead at their next call.

    ``path``: how the save writes (`.paths`): ``store.save``, ``save_async`` (the crash
    hits the background thread), ``ckptfs cp`` (the crash hits the destination; the source is
    a scratch root), or any of them through a sub-storage; ``v3``: an incremental save whose
    model tensors are references to an earlier checkpoint's file (the sweep primes step 0, so
    every save it crashes has references; ``counters["with_references"]``: the committed
    checkpoints that have some).  A copy of a step already committed with the same content is
    not refused (``cp`` is idempotent): it must return that commit."""
    backend = path.at(backend)
    sweep = Sweep(backend.name, "save-crash" if path is V1 else f"save-crash ({path.name})")
    state = path.state
    if path.references:
        # the save examined references a committed checkpoint: step 0 primes the run, and the
        # calls are counted on a save with references (step 1 of a scratch run)
        path.save(store_on(raw_storage(backend)), 0, state(0))
        scratch = backend.sibling()
        path.save(store_on(raw_storage(scratch)), 0, state(0))
        counter = count_calls(scratch, lambda st: path.save(st, 1, state(1)))
        with contextlib.suppress(FileNotFoundError):
            raw_storage(scratch).delete_tree("")
    else:
        counter = count_calls(backend, lambda st: path.save(st, 0, state(0)))
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
            path.save(store_on(fs, threads), step, state(step))
            sweep.bad(scenario, "the save did not crash")
        except BaseException as exc:
            if not died(exc):
                sweep.bad(scenario, f"the save raised {type(exc).__name__}: {exc} instead of "
                          "dying")
        if fs.count != k and not (kind == "tear" and threads > 1):
            # (a torn write dies after persisting its prefix: other threads may have gone on)
            sweep.bad(scenario, f"crashed at call {fs.count}, not {k} (call order changed)")
        took_effect = k > marker_k or (kind == "crash-after" and k == marker_k)
        if took_effect:
            committed.add(step)
        again = check_store(sweep, scenario, backend, committed, max(committed),
                            recheck={step - 1, step}, state=state)
        with scenario_guard(sweep, scenario + ", then saving again"):
            try:
                before = again.info(step).attempt if took_effect else None
                got = path.save(again, step, state(step))
                if took_effect and not (path.copies and got.attempt == before):
                    sweep.bad(scenario, "re-saving the committed step was not refused")
            except CheckpointExistsError:
                if not took_effect:
                    sweep.bad(scenario, "re-saving an uncommitted step was refused")
            committed.add(step)
            path.save(again, step + 1, state(step + 1))
            committed.add(step + 1)
        step += 2
    reader = check_store(sweep, "end of sweep", backend, committed, max(committed),
                         full_all=True, state=state)
    if path.references:
        with scenario_guard(sweep, "end of sweep"):
            for s in sorted(committed):
                m = reader.info(s).manifest
                if references_of(m):
                    sweep.count("with_references")
    return sweep


def _writer(backend: Backend, path: WritePath) -> CheckpointStore:
    """The store a lifecycle sweep saves with: incremental for a path with references."""
    store = store_on(raw_storage(backend))
    if path.references:
        store = CheckpointStore(store.storage, threads=1, shard_bytes=store.shard_bytes,
                                incremental=True)
    return store


def sweep_delete_crashes(backend: Backend, *, path: WritePath = V1) -> Sweep:
    """Crash ``CheckpointStore.delete`` at every call: the step is either still committed and
    verifies fully, or reads as not committed; nothing else changes; deleting again works.

    ``path``: `V3`: incremental checkpoints, each referencing the frozen model
    an earlier one holds; the step deleted is the one the others reference (its bytes must
    survive every crash and the retry: every other checkpoint verifies fully afterwards)."""
    sweep = Sweep(backend.name, "delete-crash" if path is V1 else f"delete-crash ({path.name})")
    base = _writer(backend, path)
    state = path.state
    if path.references:
        return _sweep_shared_delete_crashes(sweep, backend, base, state)
    for s in (0, 1):
        base.save(s, state(s))
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
        base.save(victim, state(victim))
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
        with scenario_guard(sweep, scenario):
            if still:
                sweep.count("still_committed")  # its full verification ran in check_store
            else:
                try:
                    read_committed(reader.storage, victim)
                    sweep.bad(scenario, "step reads as committed but is not listed")
                except CheckpointNotFoundError:
                    pass
        with scenario_guard(sweep, scenario + ", then deleting again"):
            reader.delete(victim)
            if victim in reader.steps() or backend.raw_files(StepPaths(victim).dir):
                sweep.bad(scenario, "the second delete left files behind")
        victim += 1
    return sweep


def _sweep_shared_delete_crashes(sweep: Sweep, backend: Backend, base: CheckpointStore,
                                 state: Callable[[int], dict[str, Any]]) -> Sweep:
    """Each scenario: a fresh run (sibling root) whose step 0 holds the frozen model and whose
    steps 1 and 2 reference it; delete step 0 crashing at call k, then delete it again: steps
    1 and 2 verify fully and load what was saved at every point, and what step 0 leaves is
    exactly its referenced file and its manifest (retired)."""

    def fresh() -> tuple[Backend, CheckpointStore]:
        b = backend.sibling()
        st = _writer(b, V3_PATH)
        for s in (0, 1, 2):
            st.save(s, state(s))
        return b, st

    b0, _ = fresh()
    counter = count_calls(b0, lambda st: st.delete(0))
    n = counter.count
    sweep.count("calls_per_delete", n)
    for kind, k in [("crash", k) for k in range(1, n + 1)] + [("crash-after", n)]:
        scenario = f"{kind} at call {k}/{n} of delete (a referenced step)"
        sweep.tried += 1
        b, st = fresh()
        shared = st.info(1).manifest
        fs = FaultyStorage(raw_storage(b), crash_at=k, crash_after=kind == "crash-after")
        try:
            store_on(fs).delete(0)
            sweep.bad(scenario, "delete did not crash")
        except SimulatedCrash:
            pass
        except BaseException as exc:
            sweep.bad(scenario, f"delete raised {type(exc).__name__}: {exc}")
        still = 0 in store_on(raw_storage(b)).steps()
        reader = check_store(sweep, scenario, b, {1, 2} | ({0} if still else set()), 2,
                             full_all=True, state=state)
        with scenario_guard(sweep, scenario + ", then deleting again"):
            reader.delete(0)
            left = set(b.raw_files(StepPaths(0).dir))
            refs = {r.location for r in references_of(shared)}
            want = refs | {f"{r.rsplit('/', 1)[0]}/MANIFEST.json" for r in refs}
            if not refs:
                sweep.bad(scenario, "step 1 references nothing: the sweep proves nothing")
            if left != want:
                sweep.bad(scenario, f"the second delete left {sorted(left)}, expected only "
                                    f"the referenced files and the manifest {sorted(want)}")
            check_store(sweep, scenario + ", after the second delete", b, {1, 2}, 2,
                        full_all=True, state=state)
    return sweep


def sweep_prune_crashes(backend: Backend) -> Sweep:
    """Crash ``prune`` (keep the last 2 of 5) at every call: the kept checkpoints stay committed
    and verify, each pruned one is either still fully committed or reads as not committed, and a
    clean prune afterwards finishes the job."""
    sweep = Sweep(backend.name, "prune-crash")
    mods = prune_and_gc_api()
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
        with scenario_guard(sweep, scenario + ", then pruning again"):
            retention.prune(reader, policy)
            if set(reader.steps()) != keep:
                sweep.bad(scenario, f"a clean prune left {reader.steps()}, expected {keep}")
    return sweep


def sweep_shared_gc_crashes(backend: Backend) -> Sweep:
    """Incremental checkpoints (format v3): garbage collection crashed at every call, in a run
    where step 0 (the frozen model) is retired (deleted, its file referenced by steps 1-3) and
    crashed incremental saves left attempts: steps 1-3 verify fully after every crash, and two
    clean runs leave nothing but what they need (the retired attempt's referenced file and
    manifest)."""
    sweep = Sweep(backend.name, "gc-crash (v3)")
    mods = prune_and_gc_api()
    assert mods is not None
    _, gc = mods
    from datetime import datetime, timedelta, timezone

    later = datetime.now(timezone.utc) + timedelta(days=1)
    state = V3_PATH.state

    def fresh() -> Backend:
        b = backend.sibling()
        st = _writer(b, V3_PATH)
        for s in (0, 1, 2, 3):
            st.save(s, state(s))
        # a delete that crashed right after the marker: step 0 is retired with every file
        # (steps 1-3 reference its model file), for gc to free the rest
        st.storage.delete(StepPaths(0).marker)
        crashing = FaultyStorage(raw_storage(b))
        crashing.crash_at = 4
        with contextlib.suppress(SimulatedCrash):
            crashing_store = CheckpointStore(crashing, threads=1, incremental=True)
            crashing_store.save(4, state(4))
        return b

    def collect(storage: Storage) -> Any:
        return gc.collect(storage, older_than=timedelta(0), now=later, multipart=False)

    counter = FaultyStorage(raw_storage(fresh()))
    report = collect(counter)
    n = counter.count
    sweep.count("calls_per_gc", n)
    sweep.count("retired_first_run", len(report.retired))
    for kind, k in [("crash", k) for k in range(1, n + 1)] + [("crash-after", n)]:
        scenario = f"{kind} at call {k}/{n} of gc (v3, a retired step)"
        sweep.tried += 1
        b = fresh()
        fs = FaultyStorage(raw_storage(b), crash_at=k, crash_after=kind == "crash-after")
        try:
            collect(fs)
            if fs.count >= k:
                sweep.bad(scenario, "gc did not crash")
        except SimulatedCrash:
            pass
        except BaseException as exc:
            sweep.bad(scenario, f"gc raised {type(exc).__name__}: {exc}")
        reader = check_store(sweep, scenario, b, {1, 2, 3}, 3, full_all=True, state=state)
        with scenario_guard(sweep, scenario + ", then collecting again"):
            collect(reader.storage)
            again = collect(reader.storage)
            left = [i.path for i in again.items if i.kind != "empty-step"]
            if left:
                sweep.bad(scenario, f"garbage left after two clean runs: {left}")
            m = reader.info(3).manifest
            refs = {r.location for r in references_of(m)}
            kept = set(b.raw_files(StepPaths(0).dir))
            want = refs | {f"{r.rsplit('/', 1)[0]}/MANIFEST.json" for r in refs}
            if not refs or kept != want:
                sweep.bad(scenario, f"step 0 keeps {sorted(kept)}, expected {sorted(want)}")
            check_store(sweep, scenario + " after gc", b, {1, 2, 3}, 3, full_all=True,
                        state=state)
    return sweep


def sweep_gc_crashes(backend: Backend) -> Sweep:
    """Crash garbage collection at every call, with crashed attempts of two steps around three
    committed checkpoints: no committed checkpoint is touched, and a clean collection afterwards
    removes the rest."""
    sweep = Sweep(backend.name, "gc-crash")
    mods = prune_and_gc_api()
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
        with scenario_guard(sweep, scenario + ", then collecting again"):
            collect(reader.storage)
            again = collect(reader.storage)
            left = [i.path for i in again.items if i.kind != "empty-step"]
            if left:
                sweep.bad(scenario, f"garbage left after two clean runs: {left}")
            check_store(sweep, scenario + " after gc", backend, committed, max(committed))
    return sweep
