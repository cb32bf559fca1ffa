"""Transient-fault sweep: saves through the retry layer while a fraction of all storage calls
fail transiently (some after taking effect)."""

from __future__ import annotations

from ckptfs.errors import CheckpointExistsError, CkptfsError
from ckptfs.format.layout import StepPaths
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage
from ckptfs.testing.reliability.common import Sweep, check_store, raw_storage, state_for, store_on


def sweep_transient(backend: Backend, *, trials: int = 8, p: float = 0.15,
                    attempts: int = 4) -> Sweep:
    """Saves with ``p`` of all storage calls failing transiently (half of the failures of
    mutating calls after the call took effect), through the retry layer: each save either
    commits a checkpoint that verifies, or fails with a typed error and leaves no marker (or,
    when the commit itself took effect but its answer was lost, a marker whose checkpoint
    verifies).  Retries are bounded: never more than ``attempts`` tries of one call."""
    from ckptfs.storage.retry import RetryingStorage

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
