"""Power-cut sweeps (local disk only): a save or a delete cut after each of its calls, with
unsynced file data lost and unsynced directory entries rolled back
(`power_cut`)."""

from __future__ import annotations

import contextlib
from typing import Literal

from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage, SimulatedCrash
from ckptfs.testing.reliability.common import (
    Sweep,
    check_store,
    died,
    raw_storage,
    scenario_guard,
    state_for,
    store_on,
)
from ckptfs.testing.reliability.paths import V1, WritePath


def sweep_power_cuts(backend: Backend, *, path: WritePath = V1) -> Sweep:
    """On local disk: a first save completes, then a second is cut by a power failure after each
    of its mutating calls (0..n, n = completed), with unsynced file data lost (emptied or
    halved) and unsynced directory entries rolled back.  A save that returned must survive.
    ``path``: how the second save writes (`.paths`: ``save_async``, ``ckptfs cp``...)."""
    backend = path.at(backend)
    sweep = Sweep(backend.name, "power-cut" if path is V1 else f"power-cut ({path.name})")
    if backend.protocol != "file":
        raise ValueError("the power-cut model needs local disk")
    probe = backend.sibling()
    fs0 = FaultyStorage(raw_storage(probe), power_model=True)
    store_on(fs0).save(1, state_for(1))
    first = fs0.count
    path.save(store_on(fs0), 2, state_for(2))
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
                path.save(store_on(fs), 2, state_for(2))
                if k < n:
                    sweep.bad(scenario, "the save did not stop")
            except BaseException as exc:
                if not died(exc):
                    raise
            lost_counts = fs.power_cut(lost_data=lost)
            sweep.count("files_lost", lost_counts["lost_files"])
            sweep.count("entries_rolled_back", lost_counts["rolled_back_entries"])
            committed = {1, 2} if k >= marker_k else {1}
            check_store(sweep, scenario, b, committed, max(committed), full_all=True)
            with scenario_guard(sweep, scenario + ", then saving again"):
                again = b.open()
                if 2 not in committed:
                    path.save(again, 2, state_for(2))
                path.save(again, 3, state_for(3))
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
