"""Saves bounded in time: a `Storage` wrapper that waits for each request of one save no
longer than the save's deadline (docs/reliability.md, "Bounded saves").

A request that hangs (an object store that stops answering mid-upload, a stuck NFS mount)
cannot be interrupted from Python, so the caller must not be the thread that makes it.
`DeadlineStorage` runs every request of the save it serves (and each ``write``/``fsync``/
``close`` of a streamed file, each ``read`` of a copied one) on a helper thread and waits for
it until the save's `Deadline` runs out; then it raises `SaveDeadlineError` naming the rank,
the file or object and how long the request had made no progress.  The stalled helper is
abandoned (a daemon thread: it never holds the process up), and what it was writing is never
completed: the streamed file's context is left with the error, which discards it (fsspec:
``discard()``, the multipart upload aborted) on a helper too, without waiting for it once
the deadline has passed.

**The rule**: the deadline covers the whole save, from its first storage request to its
marker; it is not a "no progress for N seconds" rule.  A write that is slow but progressing
fails too when the save would end past the deadline: the deadline is what the user's training
loop (and every rank waiting in the save's collectives) can count on, and a trickling upload
that never stalls for N seconds would otherwise hold them without bound.  The error still
says how long the request it names had made no progress, so a stall and a slow link are told
apart.

Once the deadline has run out, no request is started any more (``SaveDeadlineError`` at
once), except the clean-up of the failed attempt (``delete``, ``delete_tree``,
``remove_empty_dir``, ``abort_upload``), which is started in the background and not waited
for (garbage collection removes what it leaves).  A retry layer inside (`RetryingStorage`)
is bounded with each request; its backoff between replays of a whole streamed file
(``retry_call``) is not, so a save can end at most one backoff (at most 5 s, usually under
1 s) past its deadline, and makes no request after it.

The wrapper costs one hand-over to a helper thread per request (tens of microseconds) and is
only used when a deadline is set (``save_deadline_s``); a store without one writes as before.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import datetime
from typing import Any, BinaryIO, TypeVar, cast

from ckptfs.errors import SaveDeadlineError
from ckptfs.storage.base import (
    BatchedSync,
    EmptyDirRemoval,
    Entry,
    ModifiedTimes,
    MultipartUploads,
    PendingUpload,
    ServerChecksums,
    Storage,
    StorageWrapper,
    StoredChecksum,
)

log = logging.getLogger("ckptfs.storage")
T = TypeVar("T")

__all__ = ["Deadline", "DeadlineStorage", "bounded"]

#: Idle helper threads kept for the next requests (more are started when all are busy).
IDLE_HELPERS = 32


class _Task:
    __slots__ = ("done", "error", "fn", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # handed to the waiting caller
            self.error = exc
        finally:
            self.fn = None  # type: ignore[assignment]  # free what it held
            self.done.set()

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Helpers:
    """Daemon threads that run requests; a stalled one is abandoned (it never returns to the
    idle list until its request returns), and a new one is started in its place."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[_Task | None]] = []
        self._lock = threading.Lock()

    def start(self, fn: Callable[[], Any]) -> _Task:
        task = _Task(fn)
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                             name="ckptfs-deadline").start()
        inbox.put(task)
        return task

    def _serve(self, inbox: queue.SimpleQueue[_Task | None]) -> None:
        while True:
            task = inbox.get()
            if task is None:
                return
            task.run()
            del task
            with self._lock:
                if len(self._idle) >= IDLE_HELPERS:
                    return
                self._idle.append(inbox)


_HELPERS = _Helpers()


class Deadline:
    """The deadline of one save: ``seconds`` from its first storage request (`start`).
    ``what`` names the save (``"save of step 3 at s3://b/run"``), ``rank`` the rank making it
    (None in a process alone).  Shared by every `DeadlineStorage` of the save (a copy's
    source and destination) and every thread writing for it."""

    def __init__(self, seconds: float, *, what: str = "save", rank: int | None = None) -> None:
        if not seconds > 0:
            raise ValueError(f"a save deadline must be a positive number of seconds, got "
                             f"{seconds!r}")
        self.seconds = float(seconds)
        self.what = what
        self.rank = rank
        self.started: float | None = None
        self._lock = threading.Lock()
        #: Requests in flight: id -> (what, where, since).
        self._inflight: dict[int, tuple[str, str, float]] = {}
        #: Bytes written (or read) so far, per file.
        self.moved: dict[str, int] = {}

    def start(self) -> None:
        if self.started is None:
            with self._lock:
                if self.started is None:
                    self.started = time.monotonic()

    def left(self) -> float:
        """Seconds left (the clock starts at the first call)."""
        self.start()
        return self.seconds - (time.monotonic() - cast(float, self.started))

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def begin(self, op: str, where: str) -> int:
        with self._lock:
            key = id(object()) ^ int(time.monotonic_ns())
            while key in self._inflight:
                key += 1
            self._inflight[key] = (op, where, time.monotonic())
            return key

    def end(self, key: int) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def add(self, where: str, n: int) -> None:
        with self._lock:
            self.moved[where] = self.moved.get(where, 0) + n

    def oldest(self) -> tuple[str, str, float] | None:
        with self._lock:
            return min(self._inflight.values(), key=lambda v: v[2], default=None)

    def error(self, op: str, where: str, since: float | None, *,
              marker: bool = False) -> SaveDeadlineError:
        """The error of a request (``op`` of ``where``, made since ``since``, or not made:
        None) that ran into the deadline: it names the request that stalled (this one, or
        the oldest still in flight when this one was never made)."""
        now = time.monotonic()
        stalled = None if since is None else now - since
        if since is None:
            culprit = self.oldest()
            if culprit is not None:
                op, where, began = culprit
                stalled = now - began
        who = f"rank {self.rank}: " if self.rank is not None else ""
        moved = self.moved.get(where)
        done = f" ({_size(moved)} of it written or read)" if moved else ""
        if stalled is None:
            how = f"the save's requests took {self.elapsed():.3g} s in all"
        else:
            how = f"the {op} of {where} made no progress for {stalled:.3g} s{done}"
        outcome = ("the marker request was sent and its outcome is unknown: the step may "
                   "still appear committed (check store.steps())" if marker else
                   "nothing was committed (no marker; the stalled upload was discarded, "
                   "never completed)")
        return SaveDeadlineError(
            f"{who}{self.what}: {how}, and the save's deadline of {self.seconds:g} s "
            f"(save_deadline_s) ran out after {self.elapsed():.3g} s: {outcome}. Check the "
            "storage service and the network; the next save starts afresh",
            rank=self.rank, path=where, stalled_s=stalled, deadline_s=self.seconds,
            outcome_unknown=marker)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} B"


class DeadlineStorage(StorageWrapper):
    """``inner`` with every request of one save bounded by ``deadline`` (module
    docstring).  Offers exactly what ``inner`` offers."""

    def __init__(self, inner: Storage, deadline: Deadline) -> None:
        super().__init__(inner)
        self.deadline = deadline

    def _where(self, path: str) -> str:
        return f"{self.url.rstrip('/')}/{path}" if path else self.url

    def _call(self, op: str, path: str, fn: Callable[[], T], *, marker: bool = False) -> T:
        d = self.deadline
        where = self._where(path)
        left = d.left()
        if left <= 0:
            raise d.error(op, where, None)
        key = d.begin(op, where)
        since = time.monotonic()
        task = _HELPERS.start(fn)
        if not task.done.wait(left):
            raise d.error(op, where, since, marker=marker)  # its request stays in flight
        d.end(key)
        return cast(T, task.result())

    def _cleanup(self, op: str, path: str, fn: Callable[[], T], default: T) -> T:
        """A clean-up request: bounded while time is left; once the deadline has run out,
        started in the background and not waited for (``default`` returned)."""
        left = self.deadline.left()
        task = _HELPERS.start(fn)
        if left > 0 and task.done.wait(left):
            return cast(T, task.result())
        log.info("%s: %s of %s left to finish in the background (the save's deadline ran "
                 "out)", self.deadline.what, op, self._where(path))
        return default

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        return self._call("read", path, lambda: self.inner.read_bytes(path))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        ranged = super().read_range
        return self._call("read", path, lambda: ranged(path, start, length))

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        stack = ExitStack()
        f = self._call("open", path, lambda: stack.enter_context(self.inner.open_read(path)))
        try:
            yield cast(BinaryIO, _Bounded(self, f, path))
        finally:
            self._cleanup("close", path, stack.close, None)

    def list_dir(self, path: str) -> list[Entry]:
        return self._call("list", path, lambda: self.inner.list_dir(path))

    def list_tree(self, path: str) -> list[Entry]:
        return self._call("list", path, lambda: self.inner.list_tree(path))

    def exists(self, path: str) -> bool:
        return self._call("stat", path, lambda: self.inner.exists(path))

    # -- writes --------------------------------------------------------------------------------

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        stack = ExitStack()
        f = self._call("open", path, lambda: stack.enter_context(self.inner.open_write(path)))
        try:
            yield cast(BinaryIO, _Bounded(self, f, path))
        except BaseException as exc:
            # Leave the inner context with the error: it discards the file (aborts the
            # multipart upload), never completes it; not waited for past the deadline.
            def discard(err: BaseException = exc) -> None:
                stack.__exit__(type(err), err, err.__traceback__)

            try:
                self._cleanup("discard", path, discard, None)
            except Exception as cleanup:  # the original error matters, not the clean-up's
                log.debug("discarding %s: %s", self._where(path), cleanup)
            raise
        self._call("close", path, stack.close)  # completes the upload: bounded

    def write_bytes(self, path: str, data: bytes) -> None:
        self._call("write", path, lambda: self.inner.write_bytes(path, data))
        self.deadline.add(self._where(path), len(data))

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._call("create", path, lambda: self.inner.create_exclusive(path, data),
                   marker=True)

    def delete(self, path: str) -> None:
        self._cleanup("delete", path, lambda: self.inner.delete(path), None)

    def delete_tree(self, path: str) -> None:
        self._cleanup("delete", path, lambda: self.inner.delete_tree(path), None)

    def makedirs(self, path: str) -> None:
        self._call("mkdir", path, lambda: self.inner.makedirs(path))

    def rename_dir(self, src: str, dst: str) -> None:
        self._call("rename", src, lambda: self.inner.rename_dir(src, dst))

    def sync_dir(self, path: str) -> None:
        self._call("fsync", path, lambda: self.inner.sync_dir(path))

    def sync_paths(self, files: Sequence[str], dirs: Sequence[str]) -> None:
        self.require(BatchedSync)
        sync = super().sync_paths
        self._call("fsync", (list(files) + list(dirs) + [""])[0], lambda: sync(files, dirs))

    # -- optional capabilities (offered where the inner storage offers them) -------------------

    def modified(self, path: str) -> datetime | None:
        self.require(ModifiedTimes)
        modified = super().modified
        return self._call("stat", path, lambda: modified(path))

    def remove_empty_dir(self, path: str) -> bool:
        self.require(EmptyDirRemoval)
        remove = super().remove_empty_dir
        return self._cleanup("rmdir", path, lambda: remove(path), False)

    def list_uploads(self, path: str) -> list[PendingUpload]:
        self.require(MultipartUploads)
        listing = super().list_uploads
        return self._call("list uploads", path, lambda: listing(path))

    def abort_upload(self, upload: PendingUpload) -> bool:
        self.require(MultipartUploads)
        abort = super().abort_upload
        return self._cleanup("abort upload", upload.path, lambda: abort(upload), False)

    def server_checksum(self, path: str) -> StoredChecksum | None:
        self.require(ServerChecksums)
        checksum = super().server_checksum
        return self._call("stat", path, lambda: checksum(path))


class _Bounded:
    """A streamed file of a `DeadlineStorage`: each ``write``, ``fsync``, ``flush``,
    ``read`` and ``readinto`` bounded by the save's deadline; the bytes moved counted."""

    def __init__(self, storage: DeadlineStorage, f: Any, path: str) -> None:
        self._s = storage
        self._f = f
        self._path = path
        self._where = storage._where(path)

    def write(self, data: Any) -> int:
        n = self._s._call("write", self._path, lambda: self._f.write(data))
        moved = memoryview(data).nbytes if n is None else int(n)
        self._s.deadline.add(self._where, moved)
        return moved

    def fsync(self) -> None:
        self._s._call("fsync", self._path, self._f.fsync)

    def flush(self) -> None:
        self._s._call("flush", self._path, self._f.flush)

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._s._call("read", self._path, lambda: self._f.read(n))
        self._s.deadline.add(self._where, len(data))
        return data

    def readinto(self, buf: Any) -> int:
        n: int = self._s._call("read", self._path, lambda: self._f.readinto(buf))
        self._s.deadline.add(self._where, n or 0)
        return n

    def readable(self) -> bool:
        return bool(self._f.readable())

    def writable(self) -> bool:
        return bool(self._f.writable())


def bounded(storage: Storage, deadline: Deadline | None) -> Storage:
    """``storage`` bounded by ``deadline`` (`DeadlineStorage`), or itself when there is
    none."""
    return storage if deadline is None else DeadlineStorage(storage, deadline)


def check_deadline(seconds: float | None) -> float | None:
    """A save deadline as given (None: none), or `ValueError`."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"save_deadline_s must be a positive number of seconds or None, got "
                         f"{seconds!r}")
    return float(seconds)
