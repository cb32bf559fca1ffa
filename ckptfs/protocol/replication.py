"""The background replicator of a two-tier store (docs/tiers.md): copies each checkpoint that
committed on the local tier to the remote tier, oldest first, with retries.

Design decision: **a replica is a copy, and a copy is a save.**  Each step is replicated by
the one copier of ``ckptfs cp`` (`ckptfs.protocol.copy.StepCopier`; `copy_step` is its world
of one): an `Attempt` opened at the remote, every byte hashed while it is written there and
compared with the local manifest, the marker created last and exclusively.  There is no second
copy implementation: what ``ckptfs cp`` guarantees, a replica has (a remote marker never
vouches for bytes that did not verify; an interrupted copy leaves an uncommitted attempt that
garbage collection removes; an incremental checkpoint references the bytes the remote's latest
checkpoint already holds, so only new bytes travel).  The copier's group is the world size: a
world of one for a single-process store, every rank of a dedicated gloo group
(`replication_group`) for a sharded two-tier store whose ranks each hold their own files on
their own node's disk (docs/tiers.md "Sharded").  The two things a replicator adds are carried
by the copier's ``progress`` hook, called after every slice it copies: the byte count (lag,
``copied_bytes``) and the bandwidth bound (the hook sleeps).  Each copy runs with
``check_stored``: before the remote marker, every file written is compared with the checksum
the remote store itself keeps (where it keeps one, docs/remote-verify.md); a difference is a
storage error, so nothing commits and the step is retried.

One worker thread, one step at a time, **oldest first**: the remote tier then always holds a
prefix of the local history, a step is replicated only after every older one (so the lag is a
contiguous range, which is what local retention needs to reason about), and an incremental
checkpoint finds its predecessor already at the remote.

Failures: a storage error (an outage, a refused request after the storage's own retries) is
retried with capped exponential backoff, forever by default (``max_attempts=None``): an outage
never fails a save, it only grows the queue, and each failure is logged with the lag.  What no
retry can fix fails the step (``failed``, with the error) and the worker goes on with the next:
the local copy is corrupt (the copy refuses it), the remote holds the step committed with
other content, or the remote refuses or lacks the credentials (`StorageAccessError`).  A step
deleted locally before it was replicated (only if the store allows it) is dropped, logged
(the copier's `StepGone`).  A sharded store's copier whose collective broke (a rank died or
hung past `REPLICATE_TIMEOUT`) stops the worker (`ReplicationStopped`, status ``dead``): the
next open of the store queues what is missing again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Literal

from ckptfs.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ReplicationError,
    StorageAccessError,
    StorageError,
)
from ckptfs.protocol.copy import ReplicationStopped, StepCopier, StepGone
from ckptfs.protocol.group import RankGroup, WorldOfOne, gloo_group
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")

State = Literal["local", "replicating", "replicated", "failed"]

#: How long a rank's replication thread waits in a collective for its peers (one step's upload
#: on the slowest rank included) before it gives up: the replication stops in this process.
REPLICATE_TIMEOUT = timedelta(minutes=30)

__all__ = ["REPLICATE_TIMEOUT", "ReplicationStatus", "ReplicationStopped", "Replicator",
           "StepGone", "StepReplication", "replication_group"]


def replication_group(timeout: timedelta = REPLICATE_TIMEOUT) -> RankGroup:
    """The dedicated gloo group of a sharded store's replication threads, as the copier's
    `RankGroup` (every rank calls it, on its main thread, when the store is opened)."""
    return RankGroup(gloo_group(timeout, what="creating the sharded replication's gloo group"))


@dataclasses.dataclass
class StepReplication:
    """Where one locally committed step stands.

    ``state``: ``local`` (queued), ``replicating`` (being copied, or waiting to retry after
    ``error``), ``replicated`` (committed at the remote), ``failed`` (given up: ``error``).
    ``bytes``: its logical size; ``copied_bytes``: bytes read from the local tier and written
    to the remote so far (for an incremental checkpoint, only what the remote did not hold).
    ``server_verified`` / ``server_unverified``: of the files the copy wrote, those whose
    checksum as the remote store keeps it matched before the commit, and those the remote
    keeps no comparable checksum for (docs/remote-verify.md).

    The replicator keeps one per step and updates it; ``replication()`` hands out copies."""

    step: int
    state: State
    bytes: int
    copied_bytes: int = 0
    attempts: int = 0
    error: str | None = None
    server_verified: int = 0
    server_unverified: int = 0


@dataclasses.dataclass(frozen=True)
class ReplicationStatus:
    """A snapshot of the replication of a two-tier store (``store.replication()``)."""

    remote: str
    steps: dict[int, StepReplication]
    #: Steps committed locally and not (yet) at the remote: queued, in flight or failed.
    lag_steps: int
    #: Their logical bytes (an upper bound of what remains to upload for incremental ones).
    lag_bytes: int
    #: The last storage error while retrying (an outage), cleared by the next success.
    outage: str | None
    #: Set when the replicator thread died (e.g. the process is being torn down).
    dead: str | None = None

    def state(self, step: int) -> State:
        return self.steps[step].state

    @property
    def failed(self) -> list[StepReplication]:
        return [s for s in self.steps.values() if s.state == "failed"]

    def __str__(self) -> str:
        """A small table: one row per step (state, bytes copied of its size, attempts,
        error), then the lag and the outage."""
        head = (f"replication to {self.remote}: "
                + (f"{self.lag_steps} step(s) behind ({self.lag_bytes} B)" if self.lag_steps
                   else "up to date")
                + (f"; outage: {self.outage}" if self.outage else "")
                + (f"; STOPPED: {self.dead}" if self.dead else ""))
        rows = [f"{'step':>12}  {'state':<11}  {'copied / bytes':>23}  {'attempts':>8}  error"]
        for step in sorted(self.steps):
            r = self.steps[step]
            error = "" if r.error is None else (r.error if len(r.error) <= 100
                                                else r.error[:97] + "...")
            rows.append(f"{step:>12}  {r.state:<11}  {r.copied_bytes:>11} / {r.bytes:<9}  "
                        f"{r.attempts:>8}  {error}".rstrip())
        return "\n".join([head, *rows])

    def __repr__(self) -> str:
        return (f"ReplicationStatus(remote={self.remote!r}, steps={len(self.steps)}, "
                f"lag_steps={self.lag_steps}, lag_bytes={self.lag_bytes}, "
                f"outage={self.outage!r}, dead={self.dead!r})")


class _Meter:
    """copy's ``progress`` hook: counts bytes and, with a rate, sleeps to keep under it; and
    waits while the job is saving locally (`Replicator.foreground`)."""

    def __init__(self, record: StepReplication, lock: threading.Condition,
                 bytes_per_s: float | None, yield_to: Callable[[], None]) -> None:
        self.record = record
        self.lock = lock
        self.yield_to = yield_to
        self.rate = bytes_per_s
        self.start = time.monotonic()
        self.total = 0
        self._mine = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._mine:
            self.total += n
            due = self.start + self.total / self.rate if self.rate else 0.0
        with self.lock:
            self.record.copied_bytes += n
            self.yield_to()  # under the same lock: one acquisition per slice
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class Replicator:
    """Copies queued steps from ``local`` to ``remote`` on one daemon thread (module
    docstring)."""

    def __init__(self, local: Storage, remote: Storage, *, durable: bool = True,
                 threads: int = 2, bytes_per_s: float | None = None,
                 retry_base_s: float = 1.0, retry_max_s: float = 60.0,
                 max_attempts: int | None = None, copier: StepCopier | None = None,
                 deadline_s: float | None = None) -> None:
        """``copier``: how each step is copied (every rank of a sharded store calls the same
        one, on its dedicated group); default: the world of one, ``local`` to ``remote``.
        ``deadline_s``: each step's copy commits or fails with `SaveDeadlineError` within
        this many seconds (a failure like any other: retried after the backoff)."""
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        self.local = local
        self.remote = remote
        self.durable = durable
        self.threads = threads
        self.bytes_per_s = bytes_per_s
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self.max_attempts = max_attempts
        self.copier = copier if copier is not None else StepCopier(
            local, remote, WorldOfOne(), durable=durable, threads=threads, check_stored=True,
            deadline_s=deadline_s)
        self._cond = threading.Condition()
        self._records: dict[int, StepReplication] = {}
        self._outage: str | None = None
        self._dead: str | None = None
        self._closed = False
        self._foreground = 0  # local saves in progress: copying waits (foreground())
        self._thread: threading.Thread | None = None

    # -- the caller's side -----------------------------------------------------------------------

    def enqueue(self, step: int, nbytes: int) -> None:
        with self._cond:
            rec = self._records.get(step)
            if rec is not None and rec.state in ("local", "replicating"):
                return
            self._records[step] = StepReplication(step, "local", nbytes)
            pending = self._pending()
            if self._outage is not None:
                log.warning("remote tier %s unavailable (%s): %d checkpoints (%d B) wait to be "
                            "replicated", self.remote.url, self._outage, len(pending),
                            sum(r.bytes for r in pending))
            self._cond.notify_all()
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"ckptfs-replicate {self.remote.url}")
                self._thread.start()

    def mark_replicated(self, step: int, nbytes: int) -> None:
        """A step found committed at the remote when the store was opened."""
        with self._cond:
            self._records[step] = StepReplication(step, "replicated", nbytes)

    def forget(self, step: int) -> None:
        """The step was deleted locally (retention): no longer tracked."""
        with self._cond:
            self._records.pop(step, None)

    def unreplicated(self) -> set[int]:
        with self._cond:
            return {s for s, r in self._records.items() if r.state != "replicated"}

    def status(self) -> ReplicationStatus:
        with self._cond:
            # Copies: the worker goes on updating its own records.
            steps = {s: dataclasses.replace(r) for s, r in sorted(self._records.items())}
            lag = [r for r in steps.values() if r.state != "replicated"]
            return ReplicationStatus(self.remote.url, steps, len(lag),
                                     sum(r.bytes for r in lag), self._outage, self._dead)

    def wait(self, timeout: float | None = None) -> ReplicationStatus:
        """Until every queued step is replicated or failed; raises `ReplicationError`
        if one failed or the thread died, `TimeoutError` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending() and self._dead is None and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    status = self._status_locked()
                    raise TimeoutError(
                        f"replication to {self.remote.url} not done after {timeout} s: "
                        f"{status.lag_steps} checkpoints ({status.lag_bytes} B) behind"
                        + (f"; last error: {self._outage}" if self._outage else ""))
                self._cond.wait(left)
        status = self.status()
        if status.lag_steps and self._closed and status.dead is None and not status.failed:
            raise ReplicationError(f"the store is closed: {status.lag_steps} checkpoints not "
                                   f"replicated to {self.remote.url}; open it again to resume")
        if status.dead is not None:
            raise ReplicationError(f"the replicator to {self.remote.url} died ({status.dead}): "
                                   f"{status.lag_steps} checkpoints not replicated; open the "
                                   "store again to resume")
        if status.failed:
            raise ReplicationError(
                f"replication to {self.remote.url} failed for "
                + "; ".join(f"step {s.step}: {s.error}" for s in status.failed))
        return status

    def close(self) -> None:
        """Stop after the current copy attempt (what is left stays queued for the next open)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """While the job saves locally, copying pauses (after the slice in flight): the save
        then has the disk and the cores to itself, so a tiered save blocks about as long as a
        local-only one even while an earlier step replicates (docs/tiers.md; measured by
        ``ckptfs bench tiers``).  Replication resumes when the save returns."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def hold(self) -> None:
        """`foreground` in two halves (an async save holds until its write is done)."""
        with self._cond:
            self._foreground += 1

    def release(self) -> None:
        with self._cond:
            self._foreground -= 1
            self._cond.notify_all()

    def _yield_to_saves(self) -> None:
        """Wait while the job saves; the caller holds ``_cond``."""
        while self._foreground > 0 and not self._closed:
            self._cond.wait()

    # -- the worker ------------------------------------------------------------------------------

    def _pending(self) -> list[StepReplication]:
        return [r for r in self._records.values() if r.state in ("local", "replicating")]

    def _status_locked(self) -> ReplicationStatus:
        lag = [r for r in self._records.values() if r.state != "replicated"]
        return ReplicationStatus(self.remote.url, {}, len(lag), sum(r.bytes for r in lag),
                                 self._outage, self._dead)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    # A new copy does not start while the job saves (foreground()).
                    while not self._closed and (not self._pending() or self._foreground > 0):
                        self._cond.wait()
                    if self._closed:
                        return
                    rec = min(self._pending(), key=lambda r: r.step)  # oldest first
                    rec.state = "replicating"
                self._replicate(rec)
        except BaseException as exc:  # a bug, or (in tests) a simulated kill: tell every waiter
            log.error("the replicator to %s stopped: %s: %s; what is not replicated is queued "
                      "again when the store is opened again", self.remote.url,
                      type(exc).__name__, exc)
            with self._cond:
                self._dead = f"{type(exc).__name__}: {exc}"
                self._cond.notify_all()

    def _replicate(self, rec: StepReplication) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                rec.attempts += 1
                rec.copied_bytes = 0
            meter = _Meter(rec, self._cond, self.bytes_per_s, self._yield_to_saves)
            try:
                result = self.copier(rec.step, meter)
            except ReplicationStopped:
                raise  # the worker stops (dead): every waiter is told
            except StepGone as exc:
                self._drop(rec, exc)
                return
            except Exception as exc:
                retry = isinstance(exc, (StorageError, OSError)) and not isinstance(
                    exc, (CheckpointExistsError, CheckpointNotFoundError,
                          CorruptCheckpointError, StorageAccessError))  # credentials: fail
                if not retry or (self.max_attempts is not None
                                 and rec.attempts >= self.max_attempts):
                    self._fail(rec, exc)
                    return
                if not self._backoff(rec, exc):
                    return
                continue
            with self._cond:
                rec.state, rec.error, self._outage = "replicated", None, None
                rec.server_verified = result.server_verified
                rec.server_unverified = result.server_unverified
                self._cond.notify_all()
            log.info("replicated step %d to %s (%s, %d B copied in %.1f s, attempt %d)",
                     rec.step, self.remote.url, result.status, meter.total,
                     time.monotonic() - meter.start, rec.attempts)
            return

    def _drop(self, rec: StepReplication, exc: Exception) -> None:
        log.warning("step %d was deleted from the local tier %s before it reached %s (%s); "
                    "it will not be replicated", rec.step, self.local.url, self.remote.url, exc)
        with self._cond:
            self._records.pop(rec.step, None)
            self._cond.notify_all()

    def _fail(self, rec: StepReplication, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"
        log.error("replication of step %d to %s failed after %d attempt(s), not retried: %s",
                  rec.step, self.remote.url, rec.attempts, error)
        with self._cond:
            rec.state, rec.error = "failed", error
            self._cond.notify_all()

    def _backoff(self, rec: StepReplication, exc: Exception) -> bool:
        """Wait before the next attempt; ``False`` if the replicator was closed meanwhile."""
        delay = min(self.retry_max_s, self.retry_base_s * 2 ** (rec.attempts - 1))
        error = f"{type(exc).__name__}: {exc}"
        with self._cond:
            rec.error = self._outage = error
            lag = [r for r in self._records.values() if r.state != "replicated"]
            log.warning("replicating step %d to %s failed (attempt %d: %s); retrying in %.1f s; "
                        "%d checkpoints (%d B) not replicated yet", rec.step, self.remote.url,
                        rec.attempts, error, delay, len(lag), sum(r.bytes for r in lag))
            self._cond.notify_all()
            deadline = time.monotonic() + delay
            while not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(left)
            return False
