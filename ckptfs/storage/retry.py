"""Bounded retries of idempotent storage calls, as a `Storage`
wrapper.

Object stores fail transiently (a reset connection, a 503 "slow down"); the storage libraries
retry some of that themselves, but not all, and a checkpoint save is many requests, so one
unlucky request should not lose a save.  Only calls that are safe to repeat are retried, a
bounded number of times, with capped exponential backoff and jitter:

* reads, listings, ``exists``, ``write_bytes`` (a whole-object replace), ``delete``,
  ``delete_tree``, ``makedirs``, ``sync_dir``: repeating them gives the same result;
* ``open_read``/``open_write``: only the opening is retried; bytes already streamed cannot be
  replayed without keeping a copy of them, so a failure mid-stream propagates;
* ``create_exclusive`` (the commit): a retry that is answered "already exists" may be seeing
  its own earlier try, which took effect although its answer was lost.  The object is read back:
  if it holds exactly our bytes (a marker names its writer's unique attempt), the create
  succeeded; otherwise another writer won and ``CheckpointExistsError`` propagates;
* ``rename_dir``: a retry that finds the source gone and the destination present is the
  earlier try having succeeded;
* the optional capabilities it can retry: ``read_range``, ``modified``, ``list_uploads`` and
  ``server_checksum`` (reads), ``remove_empty_dir`` (a retry answered "not found" is the
  earlier try having succeeded) and ``abort_upload`` (a retry answered "no such upload"
  reports it gone).
  ``local_path`` is not a request and is delegated as it is.

It is a `StorageWrapper`: every member is delegated explicitly, it
offers exactly the optional capabilities of the storage it wraps, and it adds
`Retrying` (`RetryingStorage.retry_call`) for the callers that
can replay a whole streamed write.

Errors that cannot get better by waiting (not found, access denied, exists, and the permanent
OS errors of `ckptfs.storage.classify.PERMANENT_ERRNOS`: a full disk, a read-only
filesystem, a regular file where a directory is expected...) are never retried.
When the attempts are used up, a `StorageError` says how many were made.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import datetime
from typing import BinaryIO, TypeVar

from ckptfs.errors import (
    CheckpointExistsError,
    StorageAccessError,
    StorageError,
    StorageNotFoundError,
)
from ckptfs.storage.base import (
    BatchedSync,
    EmptyDirRemoval,
    Entry,
    ModifiedTimes,
    MultipartUploads,
    PendingUpload,
    Retrying,
    ServerChecksums,
    Storage,
    StorageWrapper,
    StoredChecksum,
)
from ckptfs.storage.classify import permanent_errno

log = logging.getLogger("ckptfs.storage")
T = TypeVar("T")

DEFAULT_ATTEMPTS = 4
DEFAULT_BASE_DELAY = 0.2
DEFAULT_MAX_DELAY = 5.0


def is_retryable(exc: BaseException) -> bool:
    """A storage failure that may succeed if repeated: a `StorageError` that is not
    "not found", "access denied", "exists", nor caused by a permanent OS error."""
    return (isinstance(exc, StorageError)
            and not isinstance(exc, (StorageNotFoundError, StorageAccessError, FileExistsError))
            and permanent_errno(exc) is None)


class RetryingStorage(StorageWrapper):
    """Retries the idempotent calls of ``inner`` (see the module docstring)."""

    def __init__(self, inner: Storage, *, attempts: int = DEFAULT_ATTEMPTS,
                 base_delay: float = DEFAULT_BASE_DELAY, max_delay: float = DEFAULT_MAX_DELAY,
                 sleep: Callable[[float], None] = time.sleep, seed: int | None = None) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        super().__init__(inner)
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._sleep = sleep
        self._rng = random.Random(seed)
        #: Retries made so far (for tests and logs).
        self.retries = 0

    def offers(self, capability: type) -> bool:
        return capability is Retrying or super().offers(capability)

    def _delay(self, attempt: int) -> float:
        cap = min(self.max_delay, self.base_delay * 2.0 ** attempt)
        return float(cap * (0.5 + 0.5 * self._rng.random()))

    def _retry(self, op: str, path: str, fn: Callable[[], T]) -> T:
        for attempt in range(self.attempts):
            try:
                return fn()
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                if attempt + 1 >= self.attempts:
                    if self.attempts == 1:
                        raise
                    raise StorageError(
                        f"{op} {self.url}/{path} failed {self.attempts} times, giving up; last "
                        f"error: {exc}. Check the storage service and network, then retry"
                    ) from exc
                self.retries += 1
                delay = self._delay(attempt)
                log.info("%s %s/%s failed (%s); retry %d/%d in %.2fs", op, self.url, path, exc,
                         attempt + 1, self.attempts - 1, delay)
                self._sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def retry_call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` under this layer's bounded retries.  For a caller that can replay a whole
        operation (the commit protocol re-streams a file from memory)."""
        return self._retry(op, path, fn)

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        return self._retry("read", path, lambda: self.inner.read_bytes(path))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        ranged = super().read_range
        return self._retry("read", path, lambda: ranged(path, start, length))

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with ExitStack() as stack:
            yield self._retry("open", path,
                              lambda: stack.enter_context(self.inner.open_read(path)))

    def list_dir(self, path: str) -> list[Entry]:
        return self._retry("list", path, lambda: self.inner.list_dir(path))

    def list_tree(self, path: str) -> list[Entry]:
        return self._retry("list", path, lambda: self.inner.list_tree(path))

    def exists(self, path: str) -> bool:
        return self._retry("stat", path, lambda: self.inner.exists(path))

    # -- writes --------------------------------------------------------------------------------

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with ExitStack() as stack:
            yield self._retry("open", path,
                              lambda: stack.enter_context(self.inner.open_write(path)))

    def write_bytes(self, path: str, data: bytes) -> None:
        self._retry("write", path, lambda: self.inner.write_bytes(path, data))

    def create_exclusive(self, path: str, data: bytes) -> None:
        tries = 0

        def once() -> None:
            nonlocal tries
            tries += 1
            try:
                self.inner.create_exclusive(path, data)
            except CheckpointExistsError:
                if tries == 1 or not self._is_ours(path, data):
                    raise
                log.info("create %s/%s: a retry found the object, and it is ours (an earlier "
                         "try succeeded though its answer was lost)", self.url, path)

        self._retry("create", path, once)

    def _is_ours(self, path: str, data: bytes) -> bool:
        try:
            return self._retry("read", path, lambda: self.inner.read_bytes(path)) == data
        except StorageError:
            return False

    def delete(self, path: str) -> None:
        self._retry("delete", path, lambda: self.inner.delete(path))

    def delete_tree(self, path: str) -> None:
        self._retry("delete", path, lambda: self.inner.delete_tree(path))

    def makedirs(self, path: str) -> None:
        self._retry("mkdir", path, lambda: self.inner.makedirs(path))

    def rename_dir(self, src: str, dst: str) -> None:
        tries = 0

        def once() -> None:
            nonlocal tries
            tries += 1
            try:
                self.inner.rename_dir(src, dst)
            except (CheckpointExistsError, StorageNotFoundError):
                if tries == 1 or self.inner.exists(src) or not self.inner.exists(dst):
                    raise

        self._retry("rename", src, once)

    def sync_dir(self, path: str) -> None:
        self._retry("fsync", path, lambda: self.inner.sync_dir(path))

    def sync_paths(self, files: Sequence[str], dirs: Sequence[str]) -> None:
        self.require(BatchedSync)
        sync = super().sync_paths
        self._retry("fsync", (list(files) + list(dirs) + [""])[0], lambda: sync(files, dirs))

    # -- optional capabilities (offered where the inner storage offers them) -------------------

    def modified(self, path: str) -> datetime | None:
        self.require(ModifiedTimes)
        modified = super().modified
        return self._retry("stat", path, lambda: modified(path))

    def remove_empty_dir(self, path: str) -> bool:
        self.require(EmptyDirRemoval)
        remove = super().remove_empty_dir
        tries = 0

        def once() -> bool:
            nonlocal tries
            tries += 1
            try:
                return remove(path)
            except StorageNotFoundError:
                if tries == 1:
                    raise
                return True  # an earlier try removed it, though its answer was lost

        return self._retry("rmdir", path, once)

    def list_uploads(self, path: str) -> list[PendingUpload]:
        self.require(MultipartUploads)
        listing = super().list_uploads
        return self._retry("list uploads", path, lambda: listing(path))

    def abort_upload(self, upload: PendingUpload) -> bool:
        self.require(MultipartUploads)
        abort = super().abort_upload
        return self._retry("abort upload", upload.path, lambda: abort(upload))

    def server_checksum(self, path: str) -> StoredChecksum | None:
        self.require(ServerChecksums)
        stored = super().server_checksum
        return self._retry("stat", path, lambda: stored(path))

    def __repr__(self) -> str:
        return f"RetryingStorage({self.inner!r}, attempts={self.attempts})"
