"""Two tiers (docs/tiers.md): the replicator of a `
TieredStore` crashed or cut off at every mutating call it makes at the remote tier, a remote
outage during which training goes on, and the loss of the local disk.

The remote tier is the backend under test (local disk, ``memory://``, S3, GCS, Azure); the
local tier is a directory on local disk.  Faults are injected with
`FaultyStorage` at the remote (outermost, no retry layer below
it, so every fault reaches the replicator), and the local tier is watched by another wrapper
that records every mutating call made from a thread other than the caller's: the replicator
must never mutate the local tier (so there is no crash point of its own there to sweep: the
sweeps assert the count is 0).

`sweep_replication_crashes`: the replication of one step (a v1 checkpoint, or with
`V3` an incremental step whose predecessor is already at the remote: it writes
references) is counted, then, for each mutating call ``k`` of it:

* ``crash``: the replicator is killed at call ``k`` (`
  SimulatedCrash`, a ``BaseException`` that stops the worker as a kill would, the wrapper
  refusing every later call), and once after the last call took effect (``crash-after``); then
  a *restart*: a new `TieredStore` on the same tiers, ``wait_replicated()``;
* ``outage`` / ``outage-after``: the remote goes down at call ``k`` (before it takes effect, or
  after it did with its answer lost), every call failing, for at least two replication
  attempts; a save made meanwhile returns; then the remote returns and the same store catches
  up, oldest first.

After each, the same checks: right after the fault, the remote has the step committed exactly
when the marker call took effect, and a committed remote copy verifies fully and loads
bit-exactly (**a marker never precedes a byte that did not verify**); after the restart or the
recovery every step is ``replicated``, each remote copy verifies, loads bit-exactly and has the
local copy's content; garbage collection of the remote after its grace leaves **exactly** the
committed files (every leaked attempt collected, nothing committed touched); the local tier is
unchanged and got no mutating call from the replicator.

`sweep_replication_outage`: a remote down from the start while five checkpoints are saved
with ``keep_last=2`` retention (incremental): saves return, the lag grows and is logged,
retention holds every unreplicated step, catch-up is oldest first after the remote returns and
then retention prunes; and the disk-full policy (``delete_unreplicated=True``).

`sweep_local_loss`: the local directory removed, then the store opened again: resume from
the remote bit-exactly (an incremental chain whose remote copies reference remote attempts),
with unreplicated steps lost with the disk, and after a replicator killed before its marker.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

from ckptfs.errors import CkptfsError, ReplicationError, UnreplicatedCheckpointError
from ckptfs.format.incremental import references_of
from ckptfs.format.layout import StepPaths
from ckptfs.protocol.copy import same_content
from ckptfs.protocol.resolve import committed_steps, read_committed, read_marker
from ckptfs.protocol.store import CheckpointStore
from ckptfs.protocol.tiers import TieredStore
from ckptfs.storage.base import Storage
from ckptfs.testing.backend import Backend, unique_name
from ckptfs.testing.conformance import assert_state_equal
from ckptfs.testing.faults import MUTATING_OPS, FaultyStorage, SimulatedCrash
from ckptfs.testing.reliability.common import (
    SWEEP_SHARD_BYTES,
    Sweep,
    scenario_guard,
)
from ckptfs.testing.reliability.paths import V1, WritePath
from ckptfs.testing.reliability.paths import V3 as V3_PATH

#: Backoff of the sweeps' replicators (the defaults, 1 s doubling to 60 s, would make an outage
#: scenario wait for seconds).
FAST = {"retry_base_s": 0.01, "retry_max_s": 0.05}
#: How long a sweep waits for a replication (an emulator under load is slow, never this slow).
WAIT_S = 180.0
#: Failed attempts an outage lasts for before the remote returns.
OUTAGE_ATTEMPTS = 2


def client(backend: Backend) -> Storage:
    """A new storage client on ``backend`` without the retry layer (faults are exact) and
    without the open-time bucket probe (a request per client: the sweeps open many)."""
    return backend.open(retries=0, probe=False).storage


class LocalWatch:
    """The local tier's storage, watched: every mutating call made from a thread other than
    the one that created the watch (the caller's, which saves) is recorded; the replicator's
    worker and its copy threads must make none."""

    def __init__(self, backend: Backend) -> None:
        self.owner = threading.current_thread()
        self.foreign: list[str] = []
        self.storage = FaultyStorage(client(backend), hook=self._hook)

    def _hook(self, op: str, path: str) -> None:
        if op in MUTATING_OPS and threading.current_thread() is not self.owner:
            self.foreign.append(f"{op} {path} ({threading.current_thread().name})")


@contextlib.contextmanager
def _local_roots(local: Backend | None) -> Iterator[Callable[[], Backend]]:
    """Fresh local-tier roots: siblings of ``local``, or directories of a temporary one."""
    if local is not None:
        yield local.sibling
        return
    tmp = tempfile.mkdtemp(prefix="ckptfs-tiers-")
    try:
        yield lambda: Backend("local", f"file://{tmp}/{unique_name('local')}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _drop(*backends: Backend) -> None:
    """Remove a scenario's roots (memory:// would keep every one for the process's life)."""
    for b in backends:
        with contextlib.suppress(Exception):
            if b.protocol == "file":
                shutil.rmtree(b.raw_root, ignore_errors=True)
            else:
                client(b).delete_tree("")


def local_store(storage: Storage, path: WritePath) -> CheckpointStore:
    """The local tier's plain store: one thread (the save's calls in the caller's thread),
    small shards (several files per checkpoint), incremental for `V3`."""
    return CheckpointStore(storage, threads=1, shard_bytes=SWEEP_SHARD_BYTES,
                           incremental=path.references)


def open_tiers(local: Storage, remote: Storage, path: WritePath, *, threads: int = 1,
               **kw: Any) -> TieredStore:
    return TieredStore(local_store(local, path), CheckpointStore(remote),
                       replicate_threads=threads, **{**FAST, **kw})


def peak(sweep: Sweep, key: str, value: float) -> None:
    """Keep the largest ``value`` seen under ``key`` (a ``_max`` counter)."""
    sweep.counters[key] = max(sweep.counters.get(key, 0), int(value))


def wait_until(cond: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def later() -> datetime:
    """A clock past gc's default grace: every attempt the scenario left is old enough."""
    from ckptfs.lifecycle.gc import DEFAULT_GRACE

    return datetime.now(timezone.utc) + DEFAULT_GRACE + timedelta(minutes=5)


def committed_files(storage: Storage) -> set[str]:
    """What the committed checkpoints of a run root consist of: each marker, the committed
    attempt's manifest and every file it lists (a referenced file is another committed
    step's own file, listed there)."""
    out: set[str] = set()
    for step in committed_steps(storage):
        info = read_committed(storage, step)
        out.add(info.paths.marker)
        out.add(info.paths.manifest(info.attempt))
        out.update(info.paths.file(info.attempt, e.path) for e in info.manifest.files)
    return out


def check_remote_copy(sweep: Sweep, scenario: str, remote: Backend, local: Backend,
                      step: int, state: Callable[[int], Any]) -> None:
    """A committed remote copy: full verify, a bit-exact load, the local copy's content."""
    with scenario_guard(sweep, f"{scenario}: remote step {step}"):
        reader = CheckpointStore(client(remote))
        report = reader.verify(step)
        if not report.ok:
            sweep.bad(scenario, f"remote step {step} fails verification: {report}")
        assert_state_equal(reader.load(step), state(step))
        mine_store = local.open()
        mine = mine_store.info(step).manifest if step in mine_store.steps() else None
        if mine is not None and not same_content(reader.info(step).manifest, mine):
            sweep.bad(scenario, f"remote step {step} is committed with other content than the "
                      "local copy")


def check_references(sweep: Sweep, scenario: str, remote: Backend, step: int) -> int:
    """A remote incremental copy references only the remote's own committed attempts; returns
    how many references it has."""
    with scenario_guard(sweep, scenario):
        storage = client(remote)
        m = read_committed(storage, step).manifest
        refs = references_of(m)
        for r in refs:
            marker = read_marker(storage, r.step)
            if marker is None or marker.attempt != r.attempt:
                sweep.bad(scenario, f"remote step {step} references {r.location}, not a "
                          "committed attempt of the remote")
        return len(refs)
    return 0


def gc_exact(sweep: Sweep, scenario: str, remote: Backend, local: Backend,
             state: Callable[[int], Any]) -> None:
    """Garbage collection of the remote after its grace leaves exactly the committed files;
    every committed copy still verifies fully afterwards."""
    from ckptfs.lifecycle.gc import collect

    with scenario_guard(sweep, scenario + ", gc of the remote"):
        storage = client(remote)
        report = collect(storage, now=later())
        removed = [i for i in report.items if i.removed and i.kind != "empty-step"]
        failed = [f"{i.path}: {i.error}" for i in report.items if i.error]
        if failed:
            sweep.bad(scenario, f"gc failed to remove {failed}")
        sweep.count("leaked_attempts_collected", len(removed))
        want = committed_files(storage)
        have = set(remote.raw_files())
        if have != want:
            sweep.count("leaked_files_left", len(have - want))
            sweep.bad(scenario, f"after gc the remote holds {sorted(have - want)} beyond its "
                      f"committed files and lacks {sorted(want - have)}")
        reader = CheckpointStore(storage)
        for s in committed_steps(storage):  # (the exact set above: nothing was removed)
            reader.verify(s, quick=True)


def check_local(sweep: Sweep, scenario: str, local: Backend, steps: set[int],
                watches: list[LocalWatch]) -> None:
    """The local tier holds exactly ``steps`` (each verifies) and got no mutating call from a
    replicator."""
    with scenario_guard(sweep, scenario + ", local tier"):
        for w in watches:
            if w.foreign:
                sweep.count("local_mutations", len(w.foreign))
                sweep.bad(scenario, f"the replicator mutated the local tier: {w.foreign}")
        reader = local.open()
        got = set(reader.steps())
        if got != steps:
            sweep.bad(scenario, f"the local tier holds {sorted(got)}, expected {sorted(steps)}")
        for s in sorted(got):
            reader.verify(s, quick=True)


def _prime(local: Backend, remote: Backend, path: WritePath) -> set[int]:
    """With references: step 0 saved and replicated (the predecessor the swept step
    references).  Returns the steps both tiers hold."""
    if not path.references:
        return set()
    t = open_tiers(client(local), client(remote), path)
    try:
        t.save(0, path.state(0))
        t.wait_replicated(WAIT_S)
    finally:
        t.close()
    return {0}


def sweep_replication_crashes(backend: Backend, *, path: WritePath = V1, threads: int = 1,
                              local: Backend | None = None, outages: bool = True,
                              points: Callable[[int, int], list[int]] | None = None) -> Sweep:
    """The replication of one step to ``backend`` (the remote tier) crashed, and cut off by an
    outage (``outages``), at every mutating call (module docstring).  ``path``: `
    V1`, or `V3` (the swept step references its replicated predecessor).
    ``threads``: files the replicator copies at once (1: the calls come in a deterministic
    order; more: the k-th call is whichever thread gets there).  ``local``: where the local
    tiers go (default: a temporary directory).  ``points(n, marker_k)``: the calls to fault
    (default: every one, 1..n; a sample for a quick run)."""
    name = "replication-crash" if path is V1 else f"replication-crash ({path.name})"
    sweep = Sweep(backend.name, name + (f" ({threads} threads)" if threads > 1 else ""))
    state = path.state
    step = 1
    with _local_roots(local) as fresh_local:
        # count the remote's mutating calls of one replication, and check the local side
        b_local, b_remote = fresh_local(), backend.sibling()
        prior = _prime(b_local, b_remote, path)
        watch = LocalWatch(b_local)
        counter = FaultyStorage(client(b_remote))
        t = open_tiers(watch.storage, counter, path, threads=threads)
        try:
            t.save(step, state(step))
            t.wait_replicated(WAIT_S)
        finally:
            t.close()
        ops = [c for c in counter.calls if c.index]
        n = len(ops)
        marker_k = next(c.index for c in ops if c.op == "create_exclusive")
        sweep.count("calls_per_replication", n)
        sweep.count("local_calls_per_replication", len(watch.foreign))
        if watch.foreign:
            sweep.bad("counting run", f"the replicator mutated the local tier: {watch.foreign}")
        if path.references:
            sweep.count("references_per_copy", check_references(sweep, "counting run",
                                                                b_remote, step))
        _drop(b_local, b_remote)

        ks = list(range(1, n + 1)) if points is None else points(n, marker_k)
        plan: list[tuple[str, int]] = [("crash", k) for k in ks]
        plan.append(("crash-after", n))
        if outages:
            plan += [(kind, k) for kind in ("outage", "outage-after", "blip-after") for k in ks]
        for kind, k in plan:
            where = f"{ops[k - 1].op} {ops[k - 1].path.rsplit('/', 1)[-1]}" if threads == 1 \
                else f"{threads} threads"
            scenario = f"{kind} at call {k}/{n} ({where})"
            sweep.tried += 1
            sweep.count(kind.split("-")[0] + "_points")
            t0 = time.monotonic()
            b_local, b_remote = fresh_local(), backend.sibling()
            try:
                _replication_scenario(sweep, scenario, kind, k, marker_k, b_local, b_remote,
                                      path, threads, prior, step)
            finally:
                _drop(b_local, b_remote)
            peak(sweep, "scenario_ms_max", (time.monotonic() - t0) * 1000)
    return sweep


def _check_after_fault(sweep: Sweep, scenario: str, b_remote: Backend, b_local: Backend,
                       step: int, state: Callable[[int], Any], took_effect: bool,
                       where: str) -> None:
    with scenario_guard(sweep, scenario + ", after the fault"):
        marker = read_marker(client(b_remote), step)
        if (marker is not None) != took_effect:
            sweep.bad(scenario, f"remote marker {'present' if marker else 'absent'} after "
                      f"the fault at {where}")
        if marker is not None:
            sweep.count("committed_at_fault")
            check_remote_copy(sweep, scenario + " after the fault", b_remote, b_local, step,
                              state)


def _replication_scenario(sweep: Sweep, scenario: str, kind: str, k: int, marker_k: int,
                          b_local: Backend, b_remote: Backend, path: WritePath, threads: int,
                          prior: set[int], step: int) -> None:
    state = path.state
    with scenario_guard(sweep, scenario + ", set-up"):
        _prime(b_local, b_remote, path)
    crash = kind.startswith("crash")
    blip = kind.startswith("blip")
    after = kind.endswith("-after")
    if crash:
        fs = FaultyStorage(client(b_remote), crash_at=k, crash_after=after)
    else:
        fs = FaultyStorage(client(b_remote), outage_at=k, outage_after=after,
                           outage_calls=1 if blip else None)
    took_effect = k > marker_k or (after and k == marker_k)
    watches = [LocalWatch(b_local)]
    expected_local = prior | {step}
    t = open_tiers(watches[0].storage, fs, path, threads=threads)
    try:
        t.save(step, state(step))
        if crash:
            try:
                t.wait_replicated(WAIT_S)
                sweep.bad(scenario, "the replicator did not die")
            except ReplicationError as exc:
                if "died" not in str(exc):
                    sweep.bad(scenario, f"wait_replicated raised {exc}, not the death of the "
                              "replicator")
            if threads == 1 and fs.count != k:
                sweep.bad(scenario, f"crashed at call {fs.count}, not {k} (call order changed)")
        elif blip:
            with scenario_guard(sweep, scenario + ", after the lost answer"):
                status = t.wait_replicated(WAIT_S)
                if fs.stats.outage_refused != 1 or status.steps[step].attempts > 2:
                    sweep.bad(scenario, f"one lost answer: {fs.stats.outage_refused} refused, "
                              f"{status.steps[step]}")
                sweep.count("recovered")
        else:
            if not wait_until(lambda: fs.down
                              and t.replication().steps[step].attempts > OUTAGE_ATTEMPTS):
                sweep.bad(scenario, f"no {OUTAGE_ATTEMPTS + 1} attempts during the outage "
                          f"({t.replication()})")
            status = t.replication()
            if status.outage is None or status.state(step) != "replicating":
                sweep.bad(scenario, f"during the outage: {status}")
            # training goes on: a save while the remote is down returns, and queues
            t.save(step + 1, state(step + 1))
            expected_local.add(step + 1)
            if t.replication().lag_steps != 2 or not fs.down:
                sweep.bad(scenario, f"a save during the outage: {t.replication()}")
        if not blip:
            # right after the fault: committed at the remote exactly when the marker took
            # effect, and then complete (the marker never precedes a byte that did not verify)
            _check_after_fault(sweep, scenario, b_remote, b_local, step, state,
                               took_effect, f"call {k} (the marker is call {marker_k})")
        if not crash and not blip:
            fs.end_outage()
            with scenario_guard(sweep, scenario + ", after the outage"):
                status = t.wait_replicated(WAIT_S)
                order = [int(c.path.split("/")[1].split("-")[1]) for c in fs.calls
                         if c.op == "create_exclusive"]
                if order != sorted(order) or set(order) - {step, step + 1}:
                    sweep.bad(scenario, f"catch-up order {order}")
                sweep.count("recovered")
    finally:
        t.close()
    if crash:  # the restart: the same tiers opened again by a new process
        watches.append(LocalWatch(b_local))
        again = open_tiers(watches[-1].storage, client(b_remote), path, threads=threads)
        try:
            with scenario_guard(sweep, scenario + ", restart"):
                status = again.wait_replicated(WAIT_S)
                if status.state(step) != "replicated":
                    sweep.bad(scenario, f"after the restart: {status}")
                sweep.count("recovered")
        finally:
            again.close()
    with scenario_guard(sweep, scenario + ", end"):
        remote_steps = set(committed_steps(client(b_remote)))
        if remote_steps != expected_local:
            sweep.bad(scenario, f"the remote holds {sorted(remote_steps)}, expected "
                      f"{sorted(expected_local)}")
        for s in sorted(remote_steps):
            check_remote_copy(sweep, scenario, b_remote, b_local, s, state)
            if path.references and s > 0 and check_references(sweep, scenario, b_remote, s):
                sweep.count("with_references")
    gc_exact(sweep, scenario, b_remote, b_local, state)
    check_local(sweep, scenario, b_local, expected_local, watches)


# -- a remote outage while training goes on ----------------------------------------------------


class LogRecords(logging.Handler):
    """The ckptfs log records of a scenario (WARNING and above): attach it to the ``ckptfs``
    logger, read ``messages`` (also used by the sharded two-tier tests' ranks)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def saw(self, text: str) -> bool:
        return any(text in m for m in self.messages)


@contextlib.contextmanager
def _logged() -> Iterator[LogRecords]:
    logger = logging.getLogger("ckptfs")
    handler = LogRecords()
    level = logger.level
    if not logger.isEnabledFor(logging.WARNING):
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def sweep_replication_outage(backend: Backend, *, local: Backend | None = None,
                             saves: int = 5) -> Sweep:
    """A remote (``backend``) down from the start while ``saves`` checkpoints are saved with
    ``keep_last=2`` retention after each (module docstring); then the disk-full policy."""
    from ckptfs.lifecycle.retention import RetentionPolicy, prune

    sweep = Sweep(backend.name, "two-tier-outage")
    policy = RetentionPolicy(keep_last=2)
    path = V3_PATH
    state = path.state
    steps = list(range(1, saves + 1))
    with _local_roots(local) as fresh_local:
        # a local-only save of the same states: the blocking time to compare with
        base = fresh_local()
        plain = local_store(client(base), path)
        times = []
        for s in steps:
            t0 = time.monotonic()
            plain.save(s, state(s))
            times.append(time.monotonic() - t0)
        peak(sweep, "save_ms_local_only_max", max(times) * 1000)
        _drop(base)

        scenario = f"outage during {saves} saves, keep_last=2"
        sweep.tried += 1
        b_local, b_remote = fresh_local(), backend.sibling()
        fs = FaultyStorage(client(b_remote))
        fs.begin_outage()
        watch = LocalWatch(b_local)
        with _logged() as logs:
            t = open_tiers(watch.storage, fs, path)
            try:
                times = []
                for i, s in enumerate(steps, 1):
                    t0 = time.monotonic()
                    t.save(s, state(s))
                    times.append(time.monotonic() - t0)
                    if not fs.down:
                        sweep.bad(scenario, f"save {s}: the remote came back by itself")
                    prune(t, policy)
                    status = t.replication()
                    if status.lag_steps != i or t.local.steps() != steps[:i]:
                        sweep.bad(scenario, f"after save {s}: lag {status.lag_steps}, local "
                                  f"{t.local.steps()} (retention must hold each unreplicated step)")
                    if status.lag_bytes != sum(t.local.info(x).bytes for x in steps[:i]):
                        sweep.bad(scenario, f"after save {s}: lag bytes {status.lag_bytes}")
                    if i == 1 and not wait_until(lambda: t.replication().outage is not None):
                        sweep.bad(scenario, "the replicator never saw the outage")
                peak(sweep, "save_ms_during_outage_max", max(times) * 1000)
                sweep.count("remote_calls_refused", fs.stats.outage_refused)
                try:
                    t.delete(1)
                    sweep.bad(scenario, "deleting an unreplicated step was allowed")
                except UnreplicatedCheckpointError:
                    pass
                if not (logs.saw("not replicated yet") and logs.saw("wait to be replicated")):
                    sweep.bad(scenario, f"the lag was not logged: {logs.messages[-3:]}")
                sweep.count("lag_warnings", sum("replicat" in m for m in logs.messages))
                fs.end_outage()
                with scenario_guard(sweep, scenario + ", after the outage"):
                    status = t.wait_replicated(WAIT_S)
                    order = [int(c.path.split("/")[1].split("-")[1]) for c in fs.calls
                             if c.op == "create_exclusive"]
                    if order != steps:
                        sweep.bad(scenario, f"catch-up order {order}, expected {steps}")
                    first = status.steps[steps[0]].copied_bytes
                    if any(status.steps[s].copied_bytes >= first for s in steps[1:]):
                        sweep.bad(scenario, "an incremental step after the outage copied as "
                                  f"much as the first: {status}")
                    sweep.count("caught_up", len(order))
                    report = prune(t, policy)
                    if report.deleted != steps[:-2] or t.local.steps() != steps[-2:]:
                        sweep.bad(scenario, f"after recovery prune deleted {report.deleted}, "
                                  f"local {t.local.steps()}")
                    for s in steps[1:]:
                        if not check_references(sweep, scenario, b_remote, s):
                            sweep.bad(scenario, f"remote step {s} references nothing")
            finally:
                t.close()
        with scenario_guard(sweep, scenario + ", end"):
            if committed_steps(client(b_remote)) != steps:
                sweep.bad(scenario, f"remote {committed_steps(client(b_remote))}")
        gc_exact(sweep, scenario, b_remote, b_local, state)
        check_local(sweep, scenario, b_local, set(steps[-2:]), [watch])
        _drop(b_local, b_remote)

        scenario = f"outage during {saves} saves, keep_last=2, delete_unreplicated=True"
        sweep.tried += 1
        b_local, b_remote = fresh_local(), backend.sibling()
        fs = FaultyStorage(client(b_remote))
        fs.begin_outage()
        with _logged() as logs:
            t = open_tiers(client(b_local), fs, V1, delete_unreplicated=True)
            try:
                for s in steps:
                    t.save(s, V1.state(s))
                    prune(t, policy)
                if t.local.steps() != steps[-2:]:
                    sweep.bad(scenario, f"local {t.local.steps()}: the disk-full policy must prune")
                fs.end_outage()
                with scenario_guard(sweep, scenario + ", after the outage"):
                    t.wait_replicated(WAIT_S)
                    got = committed_steps(client(b_remote))
                    if got != steps[-2:]:
                        sweep.bad(scenario, f"remote {got}, expected {steps[-2:]}")
                if not logs.saw("deleted from the local tier"):
                    sweep.bad(scenario, "dropping an unreplicated step was not logged")
            finally:
                t.close()
        gc_exact(sweep, scenario, b_remote, b_local, V1.state)
        _drop(b_local, b_remote)
    return sweep


# -- the local disk lost -----------------------------------------------------------------------


def sweep_local_loss(backend: Backend, *, local: Backend | None = None) -> Sweep:
    """The local tier's directory removed (a replaced node), then the store opened again on
    the same remote (``backend``): three scenarios (module docstring)."""
    sweep = Sweep(backend.name, "two-tier-local-loss")
    with _local_roots(local) as fresh_local:
        _loss_chain(sweep, fresh_local(), backend.sibling())
        _loss_unreplicated(sweep, fresh_local(), backend.sibling())
        _loss_after_kill(sweep, fresh_local(), backend.sibling())
    return sweep


def _lose(local: Backend) -> None:
    shutil.rmtree(local.raw_root)


def _resume_check(sweep: Sweep, scenario: str, t: TieredStore, latest: int,
                  remote_steps: list[int], state: Callable[[int], Any]) -> None:
    """After the loss: nothing to replicate, the newest step comes from the remote and loads
    bit-exactly (every remote step does), and verifies."""
    with scenario_guard(sweep, scenario + ", resume"):
        if t.replication().lag_steps:
            sweep.bad(scenario, f"lag after the loss: {t.replication()}")
        info = t.latest()
        if info is None or info.step != latest or t.tier_of(info) != "remote":
            got = None if info is None else (info.step, t.tier_of(info))
            sweep.bad(scenario, f"latest() is {got}, expected step {latest} from the remote")
        assert_state_equal(t.load(), state(latest))
        for s in remote_steps:
            assert_state_equal(t.load(s), state(s))
        if not t.verify().ok:
            sweep.bad(scenario, "verify() of the resumed checkpoint fails")
        sweep.count("resumed")


def _loss_chain(sweep: Sweep, b_local: Backend, b_remote: Backend) -> None:
    scenario = "local disk lost after an incremental chain was replicated"
    sweep.tried += 1
    path = V3_PATH
    state = path.state
    try:
        t = open_tiers(client(b_local), client(b_remote), path)
        try:
            for s in (0, 1, 2, 3):
                t.save(s, state(s))
            t.wait_replicated(WAIT_S)
        finally:
            t.close()
        _lose(b_local)
        watch = LocalWatch(b_local)
        t = open_tiers(watch.storage, client(b_remote), path)
        try:
            _resume_check(sweep, scenario, t, 3, [0, 1, 2, 3], state)
            refs = sum(check_references(sweep, scenario, b_remote, s) for s in (1, 2, 3))
            if not refs:
                sweep.bad(scenario, "the remote chain has no references")
            sweep.count("remote_references", refs)
            with scenario_guard(sweep, scenario + ", saving again"):
                t.save(4, state(4))
                status = t.wait_replicated(WAIT_S)
                if t.tier_steps() != {"local": [4], "remote": [0, 1, 2, 3, 4]}:
                    sweep.bad(scenario, f"tiers {t.tier_steps()}")
                if not check_references(sweep, scenario, b_remote, 4):
                    sweep.bad(scenario, "the step saved after the loss was copied whole: "
                              f"{status.steps[4]}")
        finally:
            t.close()
        gc_exact(sweep, scenario, b_remote, b_local, state)
        check_local(sweep, scenario, b_local, {4}, [watch])
    finally:
        _drop(b_local, b_remote)


def _loss_unreplicated(sweep: Sweep, b_local: Backend, b_remote: Backend) -> None:
    scenario = "local disk lost during an outage (steps 2, 3 never reached the remote)"
    sweep.tried += 1
    state = V1.state
    try:
        fs = FaultyStorage(client(b_remote))
        t = open_tiers(client(b_local), fs, V1)
        try:
            t.save(1, state(1))
            t.wait_replicated(WAIT_S)
            fs.begin_outage()
            for s in (2, 3):
                t.save(s, state(s))
            wait_until(lambda: t.replication().steps[2].attempts > OUTAGE_ATTEMPTS)
        finally:
            t.close()
        _lose(b_local)
        fs.end_outage()
        t = open_tiers(client(b_local), client(b_remote), V1)
        try:
            _resume_check(sweep, scenario, t, 1, [1], state)
            with scenario_guard(sweep, scenario + ", saving again"):
                t.save(2, state(2))
                t.wait_replicated(WAIT_S)
                if t.tier_steps() != {"local": [2], "remote": [1, 2]}:
                    sweep.bad(scenario, f"tiers {t.tier_steps()}")
        finally:
            t.close()
        gc_exact(sweep, scenario, b_remote, b_local, state)
    finally:
        _drop(b_local, b_remote)


def _loss_after_kill(sweep: Sweep, b_local: Backend, b_remote: Backend) -> None:
    scenario = "replicator killed before its marker, then the local disk lost"
    sweep.tried += 1
    state = V1.state
    try:
        t = open_tiers(client(b_local), client(b_remote), V1)
        try:
            t.save(1, state(1))
            t.wait_replicated(WAIT_S)
        finally:
            t.close()
        fs = FaultyStorage(client(b_remote))

        def kill_at_marker(op: str, path: str) -> None:
            if op == "create_exclusive" and StepPaths(2).dir in path:
                fs.crash_at = fs.count + 1  # this call: killed before the marker

        fs.hook = kill_at_marker
        t = open_tiers(client(b_local), fs, V1)
        try:
            t.save(2, state(2))
            with contextlib.suppress(ReplicationError):
                t.wait_replicated(WAIT_S)
            if not fs.crashed:
                sweep.bad(scenario, "the replicator was not killed")
        except (SimulatedCrash, CkptfsError) as exc:
            sweep.bad(scenario, f"{type(exc).__name__}: {exc}")
        finally:
            t.close()
        _lose(b_local)
        t = open_tiers(client(b_local), client(b_remote), V1)
        try:
            _resume_check(sweep, scenario, t, 1, [1], state)
        finally:
            t.close()
        with scenario_guard(sweep, scenario):
            if StepPaths(2).dir not in {p.rsplit("/", 2)[0] for p in b_remote.raw_files()}:
                sweep.bad(scenario, "the killed replication left no attempt to collect")
        gc_exact(sweep, scenario, b_remote, b_local, state)
    finally:
        _drop(b_local, b_remote)


def replication_sweeps(name: str, make: Callable[[], Backend]) -> list[Sweep]:
    """Every two-tier sweep with the backend ``make`` builds as the remote tier (what the
    figures command runs: `sweeps_for`); each
    sweep's wall time is its ``sweep_ms`` counter."""
    runs: list[Callable[[], Sweep]] = [
        lambda: sweep_replication_crashes(make()),
        lambda: sweep_replication_crashes(make(), path=V3_PATH)]
    if name in ("local", "memory"):
        runs.append(lambda: sweep_replication_crashes(make(), threads=2, outages=False))
    runs += [lambda: sweep_replication_outage(make()), lambda: sweep_local_loss(make())]
    out = []
    for run in runs:
        t0 = time.monotonic()
        sweep = run()
        sweep.count("sweep_ms", int((time.monotonic() - t0) * 1000))
        out.append(sweep)
    return out
