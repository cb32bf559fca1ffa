"""Asynchronous saves: the training loop blocks only while its state is prepared and copied.

Design decision: **stage, then the same save on the store's thread** (as DCP's ``async_save``
stages and submits the very ``save``).  ``save_async`` prepares the very save ``store.save``
writes (`ckptfs.protocol.prepare.prepare`: the layout decided, the state planned, everything
that save refuses before writing raised by ``save_async`` itself), copies what that save still
reads of the state (``Prepared.reads``; one snapshot for every layout:
`ckptfs.protocol.snapshot`), and runs that prepared save over the copies (``Prepared.over``)
on one background thread per store.  One commit protocol and one proof: a background failure
leaves no marker, exactly as a failed synchronous save does.  What only the async save adds:
a collective save's collectives run on the store's own gloo group (`AsyncSaver.
collective_group`).  A two-tier store's tiers settle the future it returns
(`ckptfs.protocol.tiers.TwoTiers.future`).

::

    caller thread                             "ckptfs-async-save" thread (one per store)
    -------------                             -------------------------------------------
    raise uncollected failures
    prepare(store, step, state): the save
      store.save writes (key-path errors
      raised now; a collective save's on
      every rank, from its future)
    back-pressure: wait while max_in_flight
      saves are pending (logged, counted)
    snapshot of prepared.reads (CUDA:      ----->   prepared.over(snapshot): the same save
      pinned, non-blocking, one                     over the copies; buffers back to the
      synchronize per device)                       pool
    return SaveFuture                               future resolved (or failed: kept for the
                                                    next save / save_async / wait to raise)

A store's saves run one after the other on its thread, so a collective save's collectives (on
the store's own gloo group, never the training loop's nor the synchronous saves') never
interleave with the next one's.  The staging pool keeps one buffer per tensor of the last
snapshot(s), so a run that saves the same shapes allocates nothing after its first save.  Extra
memory is one copy of the state's tensors per save in flight (``max_in_flight``, default 1),
held until `close`; with a staging budget (``staging_bytes``) at most that many bytes, a larger
single-process state (format v1, or v3: only what it writes) streamed through them
(`ckptfs.protocol.staging.Stream`: the call
returns once its last part is copied, the earlier parts written).

At interpreter exit (before ``concurrent.futures`` stops accepting work, so the commit can still
use its writer threads) pending saves are completed and a failure nobody collected is logged as
an error: never silent.  A killed process leaves an attempt without a marker, which readers skip
and garbage collection removes.  A process forked while saves are in flight (a data-loader
worker, say) starts with none: in the child, the parent's pending futures fail with
`AsyncSaveError` (the parent completes them) and the store works as new.  See docs/async.md.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (imported before our exit hook is registered)
import contextlib
import functools
import logging
import os
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfs.errors import AsyncSaveError, CheckpointExistsError, ShardedSaveError
from ckptfs.format.layout import check_step
from ckptfs.protocol.prepare import Prepared, prepare
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.protocol.snapshot import take
from ckptfs.protocol.staging import StagingPool, Stream, check_budget

if TYPE_CHECKING:
    from ckptfs.protocol.store import CheckpointStore

log = logging.getLogger("ckptfs")


@dataclass
class AsyncStats:
    """Counters of one store's asynchronous saves (``store.async_stats``)."""

    submitted: int = 0
    committed: int = 0
    failed: int = 0
    #: save_async calls that had to wait for an earlier save (back-pressure), and how long.
    waits: int = 0
    wait_seconds: float = 0.0
    last_wait_seconds: float = 0.0
    #: Time the caller was blocked by the snapshot itself (planning + copies), last and total.
    last_snapshot_seconds: float = 0.0
    snapshot_seconds: float = 0.0
    #: Saves with a staging budget (``staging_bytes``) streamed through it, and saves over
    #: it that could not stream (written from the caller's objects, the call blocking until
    #: they were done): docs/async.md section 5.
    streamed: int = 0
    unstaged: int = 0
    pool: StagingPool = field(default_factory=StagingPool, repr=False)

    @property
    def staging_bytes(self) -> int:
        """Bytes the staging pool holds now (in use by pending saves, and idle)."""
        return self.pool.nbytes

    @property
    def staging_allocations(self) -> int:
        """Staging buffers allocated so far (constant once a run saves the same shapes)."""
        return self.pool.allocations

    @property
    def staging_reuses(self) -> int:
        return self.pool.reuses

    @property
    def staging_peak_bytes(self) -> int:
        """The most bytes the staging pool held at once (buffers and slab)."""
        return self.pool.peak_bytes

    @property
    def staging_peak_live_bytes(self) -> int:
        """The most bytes staged and not yet written at once, within a staging budget."""
        return self.pool.peak_live_bytes


def _clear_frames(exc: BaseException) -> None:
    """Clear the finished frames of ``exc``, its causes and DCP's per-rank failures."""
    todo: list[Any] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if isinstance(e, tuple) and e:
            e = e[0]
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__, *getattr(e, "_failures", {}).values()]


def _add_note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)``; on Python 3.10 the same ``__notes__`` list, set by hand."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(text)
        return
    notes = getattr(exc, "__notes__", None) or []  # pragma: no cover - Python 3.10
    exc.__notes__ = [*notes, text]  # type: ignore[attr-defined]  # pragma: no cover


# -- futures ---------------------------------------------------------------------------------------


class SaveFuture(Future[CheckpointInfo]):
    """The future of one async save: ``result()`` is the committed
    `CheckpointInfo` or raises what went wrong.  A failure read through
    ``result()`` or ``exception()`` counts as collected: the store's next call does not raise
    it again."""

    def __init__(self, step: int, url: str) -> None:
        super().__init__()
        self.step = step
        self.url = url
        self.collected = False

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        try:
            return super().result(timeout)
        except BaseException:
            if self.done():
                self.collected = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = super().exception(timeout)
        if exc is not None:
            self.collected = True
        return exc

    def failure(self) -> BaseException | None:
        """The exception of a done save, without counting it as collected."""
        return super().exception(0) if self.done() else None

    def fail_in_forked_child(self, parent: int) -> None:
        """In a process forked while this save was pending: the save runs in the parent only,
        so here it fails with `AsyncSaveError` (counted as collected).  The threads
        that could hold this future's lock at the fork do not exist here: it gets a new one.
        Its done callbacks are the parent's (they run there when the save ends), not run here:
        this runs inside ``os.fork()``, and the save did not fail."""
        self._condition = threading.Condition()
        self._waiters = []
        self._done_callbacks: list[Callable[[Future[Any]], object]] = []  # Future's own
        self.collected = True
        self.set_exception(AsyncSaveError(
            f"the async save of step {self.step} at {self.url} was in flight when this process "
            f"was forked from process {parent}; it is written and committed by that process "
            "only, and this one cannot wait for it (look for the step with store.steps() "
            "later)"))

    def __repr__(self) -> str:
        return (f"<SaveFuture step {self.step} at {self.url}: "
                f"{'done' if self.done() else 'pending'}>")


# -- the per-store saver -------------------------------------------------------------------------

_worker = threading.local()


class AsyncSaver:
    """The async-save machinery of one store: its thread, its futures (back-pressure,
    uncollected failures, the exit hook), its staging pool and its own gloo group.  Holds no
    reference to the store (it lives in a weak mapping keyed by the store), only what the
    background saves need."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pool = StagingPool()
        self.stats = AsyncStats(pool=self.pool)
        self._submit_lock = threading.Lock()  # one save_async at a time per store
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[SaveFuture] = []  # submitted, not yet known done and collected
        self._warned_wait = False
        self._warned_unstaged = False
        #: The store's own gloo group of async saves, with the default group it was made in.
        self._group: tuple[Any, Any] | None = None

    # -- submitting ----------------------------------------------------------------------------

    def submit(self, store: CheckpointStore, step: int, state: Mapping[str, Any], *,
               metadata: Mapping[str, Any] | None, max_in_flight: int,
               staging_bytes: int | None = None) -> SaveFuture:
        """``store.save_async``: the save ``store.save`` would write, prepared
        (`ckptfs.protocol.prepare.prepare`, its collectives on `collective_group`), the
        snapshot of what it reads (`ckptfs.protocol.snapshot.take`), then that save over the
        snapshot on the store's thread (`_Job`).  With a staging budget (``staging_bytes``)
        smaller than what the save reads, a save of format v1, v2 or v3 is streamed through
        it (`_stream`); a sharded incremental (v4) or per-rank metadata (v5) save is written
        from the caller's objects, and this call returns once it is done (`_unstaged`):
        docs/async.md section 5."""
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        check_budget(staging_bytes)
        self._check_not_worker("save_async")
        with self._submit_lock:
            self.raise_uncollected()
            t0 = time.perf_counter()
            check_step(step)
            self.check_step_free(step)
            prepared = prepare(store, step, state, metadata=metadata,
                               background=self.collective_group, staging_bytes=staging_bytes)
            planned = time.perf_counter() - t0
            self.wait_for_slot(step, max_in_flight)
            self.raise_uncollected()  # a save that failed while we waited
            t1 = time.perf_counter()
            fut = SaveFuture(step, store.url)
            if prepared.streamed is not None:
                assert staging_bytes is not None
                self._stream(fut, prepared, staging_bytes)
            else:
                snap = take(self.pool, prepared.reads, staging_bytes)
                self.pool.trim(slab=staging_bytes is None)
                if snap is None:
                    self._unstaged(fut, prepared, staging_bytes)
                else:
                    try:
                        job = _Job(self, fut, prepared.over(snap.value, snap.hint),
                                   functools.partial(snap.give_back, self.pool))
                    except BaseException:
                        snap.give_back(self.pool)
                        raise
                    del prepared, snap  # the caller's objects: not read again
                    self._enqueue(job, fut)
            self.record_blocked(planned + time.perf_counter() - t1)
            return fut

    def _enqueue(self, job: _Job, fut: SaveFuture) -> None:
        try:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(
                        1, thread_name_prefix="ckptfs-async-save")
                self._executor.submit(job.run)
                self._futures.append(fut)
                self.stats.submitted += 1
        except BaseException:
            job.release()
            raise
        _register_exit_hook()

    def _stream(self, fut: SaveFuture, prepared: Prepared, budget: int) -> None:
        """A save larger than its staging budget: its job is queued first,
        then this thread copies its files into the pool's slab one after the other while the
        job writes them (`ckptfs.protocol.staging.Stream`), and returns once every byte is
        staged (the earlier files written).  If the save fails meanwhile, staging stops and
        the future carries the failure; if a copy fails here, the save fails too, and this
        raises the copy's error once the save has stopped (its future counted collected)."""
        assert prepared.streamed is not None
        stream = Stream(self.pool, prepared.reads, prepared.streamed, budget)
        try:
            job = _Job(self, fut, prepared.over(stream.views, None, stream.gate), stream.close)
        except BaseException:
            stream.close()
            raise
        del prepared
        self._enqueue(job, fut)
        self.stats.streamed += 1
        try:
            stream.run()
        except BaseException:
            wait_futures([fut])
            fut.collected = True
            raise

    def _unstaged(self, fut: SaveFuture, prepared: Prepared, budget: int | None) -> None:
        """A save over its staging budget that cannot be streamed (a sharded incremental or a
        per-rank metadata save, a rank holding a tensor larger than the budget): nothing is
        staged; the save runs over the caller's own objects on the store's thread, and this
        call waits until it is done (committed or failed)."""
        level = logging.INFO if self._warned_unstaged else logging.WARNING
        self._warned_unstaged = True
        log.log(level, "save_async(step %d) at %s: what it must copy exceeds staging_bytes=%s "
                "and this collective save (sharded incremental, per-rank metadata, or a "
                "tensor larger than the budget on this rank) cannot stream through it "
                "(docs/async.md section 5): it is written from the caller's tensors, and "
                "save_async returns once it is done", fut.step, self.url, budget)
        job = _Job(self, fut, prepared.over(prepared.reads, None), lambda: None)
        del prepared
        self._enqueue(job, fut)
        self.stats.unstaged += 1
        wait_futures([fut])

    def collective_group(self, live: Any, what: str) -> Any:
        """This store's own gloo group for async saves, created once per default group
        (collectively: every rank creates its stores' groups in the same order), so that a
        background save's collectives never share a group with the training loop's or a
        synchronous save's.  Its creation is bounded by the collective timeout; a rank that
        never joins it fails it on the others with `ShardedSaveError` naming that rank
        (``live``: the save's `Liveness`).  None in a process without a process group (a
        store of ``layout="ranks"``: the world of one)."""
        import torch.distributed as dist

        from ckptfs.protocol.collective import is_distributed
        from ckptfs.protocol.group import gloo_group
        from ckptfs.protocol.sharded import COLLECTIVE_TIMEOUT

        if not is_distributed():
            return None
        world = dist.group.WORLD  # by identity, never id(): a new world may reuse an old id
        if self._group is None or self._group[0] is not world:
            group = gloo_group(COLLECTIVE_TIMEOUT, what=f"{what}: creating the store's gloo "
                               "group for async saves", default=ShardedSaveError, live=live)
            self._group = (world, group)
        return self._group[1]

    @property
    def group(self) -> Any:
        """The store's own gloo group of async saves (None before its first sharded one)."""
        return None if self._group is None else self._group[1]

    def check_step_free(self, step: int) -> None:
        """Refuse a step that already has a save of this store in flight."""
        if any(f.step == step and not f.done() for f in self._live()):
            raise CheckpointExistsError(
                f"step {step} at {self.url} already has an async save in flight; a step is "
                "saved once: wait for it (store.wait()) or save under a new step")

    def record_blocked(self, seconds: float) -> None:
        """The caller was blocked ``seconds`` by a snapshot (planning and copies)."""
        self.stats.last_snapshot_seconds = seconds
        self.stats.snapshot_seconds += seconds

    def _live(self) -> list[SaveFuture]:
        with self._lock:
            return list(self._futures)

    def wait_for_slot(self, step: int, max_in_flight: int) -> None:
        """Back-pressure: wait while ``max_in_flight`` saves are pending (counted, logged)."""
        running = [f for f in self._live() if not f.done()]
        if len(running) < max_in_flight:
            return
        t0 = time.perf_counter()
        while len(running) >= max_in_flight:
            wait_futures(running, return_when=FIRST_COMPLETED)
            running = [f for f in running if not f.done()]
        waited = time.perf_counter() - t0
        self.stats.waits += 1
        self.stats.wait_seconds += waited
        self.stats.last_wait_seconds = waited
        level = logging.INFO if self._warned_wait else logging.WARNING
        self._warned_wait = True
        log.log(level, "save_async(step %d) at %s waited %.3f s for an earlier async save to "
                "finish (back-pressure, max_in_flight=%d; %d wait(s), %.3f s in total so far): "
                "checkpoints are requested faster than they are written", step, self.url,
                waited, max_in_flight, self.stats.waits, self.stats.wait_seconds)

    # -- the background side -------------------------------------------------------------------

    @contextlib.contextmanager
    def background_thread(self) -> Iterator[None]:
        """Marks the current thread as running this saver's background save: ``save_async``,
        ``wait`` and ``close`` of the store called from it (a done callback) raise
        `AsyncSaveError` instead of waiting for themselves."""
        _worker.saver = self
        try:
            yield
        finally:
            _worker.saver = None

    def settle(self, fut: SaveFuture, exc: BaseException | None,
               info: CheckpointInfo | None) -> None:
        """Count, log and resolve a finished background save (on the thread that ran it)."""
        if exc is not None:
            _clear_frames(exc)  # frames hold views of the staging buffers
            _add_note(exc, f"ckptfs: raised by the background save of step {fut.step} at "
                      f"{fut.url} (save_async); that save did not commit")
            log.warning("async save of step %d at %s failed: %s: %s", fut.step, fut.url,
                        type(exc).__name__, exc)
        with self._lock:
            if exc is None:
                self.stats.committed += 1
            else:
                self.stats.failed += 1
        if exc is None:
            fut.set_result(info)  # type: ignore[arg-type]
        else:
            fut.set_exception(exc)

    # -- flushing and errors -------------------------------------------------------------------

    def raise_uncollected(self) -> None:
        """Raise the oldest background failure nobody collected (it then counts as
        collected) and forget the futures that are done and settled.  Every failure is
        raised, one per call, oldest first, each as its own exception object (so ``except``
        clauses written for ``save`` keep working): with two uncollected failures, this call
        raises the first, with a note naming the second, and the next ``save``,
        ``save_async``, ``wait`` or ``close`` raises the second.  (A failure read through its
        future's ``result()`` or ``exception()`` counts as collected: not raised here.)"""
        with self._lock:
            failed = [f for f in self._futures
                      if f.done() and not f.collected and f.failure() is not None]
            later = failed[1:]
            self._futures = [f for f in self._futures if not f.done() or f in later]
        if not failed:
            return
        first = failed[0]
        first.collected = True
        exc = first.failure()
        assert exc is not None
        if later:
            steps = ", ".join(str(f.step) for f in later)
            _add_note(exc, f"ckptfs: {len(later)} more background save(s) at {self.url} "
                      f"failed uncollected (step {steps}); the next save, save_async, wait or "
                      "close raises the next one (each future holds its own exception)")
        raise exc

    def wait(self, what: str = "wait") -> None:
        """Wait for every pending save, then raise the failures nobody collected (``what``:
        the store method that waits, for the error raised on the background thread)."""
        self._check_not_worker(what)
        pending = [f for f in self._live() if not f.done()]
        if pending:
            wait_futures(pending)
        self.raise_uncollected()

    def close(self) -> None:
        """Flush (raising uncollected failures), then stop the thread and free the pool.
        From the background thread itself (a done callback) it raises
        `AsyncSaveError` before touching anything."""
        self._check_not_worker("close")
        try:
            self.wait()
        finally:
            with self._lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
            self.pool.trim(slab=True)

    def _check_not_worker(self, what: str) -> None:
        if getattr(_worker, "saver", None) is self:
            raise AsyncSaveError(
                f"{what}() on {self.url} was called from the store's background save thread "
                "(a future's done callback?): it would wait for itself. Call it from the "
                "training thread")

    def exit_flush(self) -> None:
        """Interpreter exit: complete what is pending, and report what failed uncollected."""
        pending = [f for f in self._live() if not f.done()]
        if pending:
            log.warning("interpreter exit: waiting for %d pending async save(s) of %s (step "
                        "%s) to commit; a process killed now leaves them uncommitted (no "
                        "marker: readers skip them)", len(pending), self.url,
                        ", ".join(str(f.step) for f in pending))
            wait_futures(pending)
        for f in self._live():
            if not f.done():  # pragma: no cover - waited above
                continue
            exc = f.failure() if not f.collected else None
            if exc is not None:
                f.collected = True
                log.error("async save of step %d at %s failed and nobody collected the error: "
                          "%s: %s. It did not commit: readers skip it", f.step, self.url,
                          type(exc).__name__, exc)
            elif f in pending:
                log.warning("async save of step %d at %s committed at interpreter exit",
                            f.step, self.url)
        with self._lock:
            self._futures = []

    def after_fork_in_child(self, parent: int) -> None:
        """In a forked child: no thread of the parent exists here.  Fresh locks, no executor,
        an empty pool; the parent's pending saves fail here (`SaveFuture.
        fail_in_forked_child`) and every future of the parent is forgotten, so the child's
        ``save``, ``wait``, ``close`` and exit never wait for them nor raise their errors."""
        self._submit_lock = threading.Lock()
        self._lock = threading.Lock()
        self._executor = None  # its thread is the parent's: work queued here would never run
        self._group = None  # its peers are the parent's
        self.pool = self.stats.pool = StagingPool()
        futures, self._futures = self._futures, []
        for f in futures:
            if not f.done():
                f.fail_in_forked_child(parent)


class _Job:
    """One background save: the store's synchronous save over a snapshot (``save``), then its
    staging buffers back to the pool (``release``) and its future settled."""

    def __init__(self, saver: AsyncSaver, fut: SaveFuture, save: Callable[[], CheckpointInfo],
                 release: Callable[[], None]) -> None:
        self.saver = saver
        self.fut = fut
        self.save: Callable[[], CheckpointInfo] | None = save
        self.give_back: Callable[[], None] | None = release

    def run(self) -> None:
        fut = self.fut
        saver = self.saver
        if not fut.set_running_or_notify_cancel():  # pragma: no cover - never cancelled
            self.release()
            return
        with saver.background_thread():
            try:
                assert self.save is not None
                info = self.save()
            except BaseException as exc:
                self.release()
                saver.settle(fut, exc, None)
            else:
                self.release()
                saver.settle(fut, None, info)
            finally:
                # The exception's traceback keeps this frame (and so this job) alive: drop the
                # job's references, so a failed future does not keep the saver's thread alive.
                self.__dict__.clear()

    def release(self) -> None:
        """Drop the save and give its staging back to the pool (once)."""
        self.save = None
        give_back, self.give_back = self.give_back, None
        if give_back is not None:
            give_back()


# -- one saver per store, the exit hook, fork ----------------------------------------------------

_SAVERS: weakref.WeakKeyDictionary[CheckpointStore, AsyncSaver] = weakref.WeakKeyDictionary()
#: Every saver still alive, also one whose store was dropped while a save was pending (its jobs
#: keep it alive): the exit hook flushes these.
_ALL_SAVERS: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()
_SAVERS_LOCK = threading.Lock()
_hook_registered = False


def saver_for(store: CheckpointStore) -> AsyncSaver:
    with _SAVERS_LOCK:
        saver = _SAVERS.get(store)
        if saver is None:
            saver = _SAVERS[store] = AsyncSaver(store.url)
            _ALL_SAVERS.add(saver)
        return saver


def existing_saver(store: CheckpointStore) -> AsyncSaver | None:
    with _SAVERS_LOCK:
        return _SAVERS.get(store)


def stats_of(store: CheckpointStore) -> AsyncStats:
    return saver_for(store).stats


def before_sync_save(store: CheckpointStore) -> None:
    """A synchronous save first waits for the store's async saves (so steps commit in the
    order they were asked for) and raises the failures nobody collected."""
    saver = existing_saver(store)
    if saver is not None:
        saver.wait("save")


def wait(store: CheckpointStore) -> None:
    saver = existing_saver(store)
    if saver is not None:
        saver.wait()


def close(store: CheckpointStore) -> None:
    saver = existing_saver(store)
    if saver is not None:
        saver.close()


def exit_context(store: CheckpointStore, failing: bool) -> None:
    """``with store:`` leaves: flush and close.  When the block is already raising, a flush
    failure is logged, not raised over the block's own exception."""
    if not failing:
        close(store)
        return
    try:
        close(store)
    except BaseException as exc:
        log.error("while leaving 'with %r' on an exception, a pending async save failed too: "
                  "%s: %s", store, type(exc).__name__, exc)


def _at_exit() -> None:
    with _SAVERS_LOCK:
        savers = list(_ALL_SAVERS)
    for s in savers:
        try:
            s.exit_flush()
        except BaseException:  # pragma: no cover - never let one store stop the others
            log.exception("ckptfs: flushing async saves of %s at exit failed", s.url)


def _register_exit_hook() -> None:
    """Run `_at_exit` before ``concurrent.futures`` shuts its executors down (after which
    the commit could not start its writer threads): ``threading._register_atexit`` hooks run in
    reverse order of registration, and ``concurrent.futures.thread`` registered its own when it
    was imported, before this module.  ``atexit`` is the fallback."""
    global _hook_registered
    with _SAVERS_LOCK:
        if _hook_registered:
            return
        _hook_registered = True
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_at_exit)
            return
        except RuntimeError:  # pragma: no cover - the interpreter is already shutting down
            pass
    atexit.register(_at_exit)  # pragma: no cover - CPython >= 3.9 has _register_atexit


def _after_fork_in_child() -> None:
    """``os.fork()`` copies this module's state but only the forking thread: reset every
    saver (see `AsyncSaver.after_fork_in_child`) and the registry's lock, which a thread
    of the parent may have held.  The exit hook stays registered (it then has nothing to do
    for the parent's saves)."""
    global _SAVERS_LOCK
    _SAVERS_LOCK = threading.Lock()
    _worker.saver = None
    parent = os.getppid()
    for saver in list(_ALL_SAVERS):
        saver.after_fork_in_child(parent)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
