"""Crash points of a sharded save (format v2): a 2-rank save stopped before each of its storage
calls in turn, then checked with `check_store`, by
saving again, and by garbage collection.

Launching gloo ranks per crash point would cost seconds each on 2 cores, so the ranks are
simulated in one process, each running the rounds of ckptfs's own collective save
(`ckptfs.protocol.save_rounds.SaveRounds`, every message through its JSON), which call DCP's
planner and ckptfs's ``StorageWriter`` as ``dcp.save`` does (torch 2.13,
``state_dict_saver._save_state_dict``): every rank ``set_up_planner`` /
``set_up_storage_writer`` / ``create_local_plan`` / ``prepare_local_plan``; the coordinator
``create_global_plan`` (replicated items are deduplicated and spread over the ranks, so every
rank writes a file) and ``prepare_global_plan`` (the attempt is chosen once); every rank
``finish_plan`` and ``write_data``; the coordinator ``finish`` (metadata, manifest, marker).
A real multi-process save with a rank killed by SIGKILL is in
tests/reliability/test_sharded_crash.py.

Two families of crash points:

- **job**: every rank shares one `FaultyStorage`, numbered over
  the whole save; the k-th mutating call kills the whole job (a node or job failure), for every
  k, plus once after the last call (the marker was created, nobody heard);
- **rank 1**: only rank 1's storage crashes, at each of its own calls; rank 0 finishes writing
  its file and the coordinator never runs ``finish`` (in a real job the coordinator learns of
  the failure from the gather of the write results and every rank raises it).

After each: no marker for the step (unless the marker's creation took effect), the previous
latest is intact and loads bit-exactly, the same step saves again (with the garbage still
there), and a garbage collection then removes the crashed attempt and nothing committed.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from ckptfs.format.layout import StepPaths
from ckptfs.protocol.options import SaveOptions
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.protocol.save_rounds import RESEND, SaveRounds
from ckptfs.protocol.sharded import SavePlanner
from ckptfs.protocol.sharded_io import ShardedWriter
from ckptfs.storage.base import Storage
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage, SimulatedCrash
from ckptfs.testing.reliability.common import (
    Sweep,
    check_store,
    prune_and_gc_api,
    raw_storage,
    scenario_guard,
    state_for,
)

#: Simulated ranks of the sweep.
WORLD = 2


def simulated_save(storages: list[Storage], step: int, state: dict[str, Any]
                   ) -> CheckpointInfo | None:
    """A sharded save of ``state`` (the same replicated state on every rank) by
    ``len(storages)`` simulated ranks, rank ``r`` writing through ``storages[r]``, in DCP's
    call order.  Returns the committed info; ``None`` if a rank died (a
    `SimulatedCrash` on a rank other than 0: the survivors
    write, the coordinator never finishes); a crash of the coordinator's storage propagates."""
    from ckptfs.format.sharded_tree import dcp_view
    from ckptfs.protocol.group import decode, encode

    def sent(doc: Any) -> Any:  # what a rank receives: the document through its JSON
        return decode(encode(doc))

    def raised(r: SaveRounds) -> BaseException:
        assert r.own is not None
        return r.own

    rounds = []
    for rank, storage in enumerate(storages):
        view, skeleton = dcp_view(state)
        writer = ShardedWriter(storage, step, SaveOptions(threads=1), tree=skeleton)
        rounds.append(SaveRounds(view, writer, SavePlanner(), rank))
    docs = [sent(r.plan()) for r in rounds]
    for r, d in zip(rounds, docs, strict=True):
        if "error" in d:
            raise raised(r)
    parts = rounds[0].plan_globally(docs)
    if parts[0] == RESEND:  # as `drive_save`: a rank left its items out of a plan this
        # process's coordinator lacks (an earlier save in this process sent that layout)
        parts = rounds[0].plan_globally([sent(r.plan_in_full()) for r in rounds])
    if "failures" in parts[0]:
        raise raised(rounds[0])  # the coordinator's storage failed (or the job's)
    results = []
    dead: list[int] = []
    for r, part in zip(rounds, parts, strict=True):
        doc = sent(r.write(sent(part)))
        if "error" in doc:
            if not isinstance(r.own, SimulatedCrash) or r.rank == 0 or \
                    storages[r.rank] is storages[0]:
                raise raised(r)  # the coordinator (or the whole job) died
            dead.append(r.rank)
        results.append(doc)
    if dead:
        return None
    outcome = rounds[0].commit(results)
    if "failures" in outcome:
        raise raised(rounds[0])
    return rounds[0].result(sent(outcome))


def _leftovers(backend: Backend, step: int, keep: str | None) -> list[str]:
    """Files under the step's directory other than the marker and attempt ``keep``'s files."""
    paths = StepPaths(step)
    prefix = paths.dir.split("/", 1)[1] + "/"
    out = []
    for rel in backend.raw_files(paths.dir):
        name = rel.split(prefix, 1)[-1] if prefix in rel else rel
        if name == paths.marker.rsplit("/", 1)[-1]:
            continue
        if keep is not None and name.startswith(keep + "/"):
            continue
        out.append(name)
    return sorted(out)


def sweep_sharded_save_crashes(backend: Backend, *, world: int = WORLD) -> Sweep:
    """Crash a ``world``-rank sharded save at every mutating storage call of the job, once after
    its last call, and at every call of rank 1 alone; check the invariants after each (module
    docstring)."""
    sweep = Sweep(backend.name, "sharded-save-crash")
    mods = prune_and_gc_api()
    assert mods is not None
    _, gc = mods
    later = datetime.now(timezone.utc) + timedelta(days=1)
    inner = raw_storage(backend)

    counter = FaultyStorage(raw_storage(backend))
    info0 = simulated_save([counter] * world, 0, state_for(0))
    ops = [c for c in counter.calls if c.index]
    n = len(ops)
    marker_k = next(c.index for c in ops if c.op == "create_exclusive")
    sweep.count("calls_per_sharded_save", n)
    sweep.count("files_per_sharded_save", len(info0.manifest.files) if info0 else 0)
    rank1 = FaultyStorage(raw_storage(backend))
    simulated_save([raw_storage(backend), rank1], 1, state_for(1))
    n1 = rank1.count
    sweep.count("calls_of_rank1", n1)
    committed = {0, 1}

    plan: list[tuple[str, int]] = ([("job crash", k) for k in range(1, n + 1)]
                                   + [("job crash-after", n)]
                                   + [("rank 1 crash", k) for k in range(1, n1 + 1)])
    step = 2
    for kind, k in plan:
        where = ops[k - 1] if kind.startswith("job") else None
        scenario = (f"{kind} at call {k}/{n} ({where.op} {where.path.split('/')[-1]})"
                    if where is not None else f"{kind} at its call {k}/{n1}")
        sweep.tried += 1
        sweep.count(kind.replace(" ", "_"))
        fs = FaultyStorage(inner, crash_at=k, crash_after=kind == "job crash-after")
        storages: list[Storage] = ([fs] * world if kind.startswith("job")
                                   else [inner, fs] + [inner] * (world - 2))
        try:
            got = simulated_save(storages, step, state_for(step))
            if got is not None:
                sweep.bad(scenario, "the save did not crash")
        except SimulatedCrash:
            pass
        except BaseException as exc:
            sweep.bad(scenario, f"the save raised {type(exc).__name__}: {exc} instead of dying")
        if fs.count != k:
            sweep.bad(scenario, f"crashed at call {fs.count}, not {k} (call order changed)")
        took_effect = kind.startswith("job") and (
            k > marker_k or (kind == "job crash-after" and k == marker_k))
        if took_effect:
            committed.add(step)
        elif backend.raw_exists(StepPaths(step).marker):
            sweep.bad(scenario, "a marker exists for the crashed save")
        check_store(sweep, scenario, backend, committed, max(committed),
                    recheck={step - 2, step})
        with scenario_guard(sweep, scenario + ", then saving again and collecting"):
            again = None
            if not took_effect:
                again = simulated_save([inner] * world, step, state_for(step))
                if again is None:
                    sweep.bad(scenario, "saving the step again did not commit")
                committed.add(step)
            report = gc.collect(inner, older_than=timedelta(0), now=later, multipart=False)
            sweep.count("gc_items", sum(1 for i in report.items if i.removed))
            errors = [f"{i.path}: {i.error}" for i in report.items if i.error]
            if errors:
                sweep.bad(scenario, f"gc failed: {errors}")
            keep = backend.open().info(step).attempt
            left = _leftovers(backend, step, keep)
            if left:
                sweep.bad(scenario, f"gc left the crashed attempt's files: {left}")
            if again is not None and again.attempt != keep:
                sweep.bad(scenario, f"the marker names {keep}, the new save {again.attempt}")
            check_store(sweep, scenario + " after gc", backend, committed, max(committed),
                        recheck={step})
        step += 2
    check_store(sweep, "end of sweep", backend, committed, max(committed), full_all=True)
    return sweep
