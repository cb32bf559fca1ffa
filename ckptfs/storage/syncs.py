"""Concurrent fsyncs for local disk: the one step in which a commit makes its small files and
its directory entries durable (`ckptfs.storage.base.BatchedSync`).

One fsync waits for the filesystem's journal to commit; several issued at once are committed
together, so the step costs about one commit instead of one per path (measured on this
machine's ext4: 3 small files and 4 directories in 0.72-0.78 ms at once, 1.17-1.26 ms one
after the other).  ``os.fsync`` releases the GIL; the threads are a small pool kept for the
process and made again in a forked child (a pool's threads do not survive ``fork``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["KeptPool", "fsync_path", "sync_all"]

#: The pool's threads: fsyncs in flight at once (a commit has a handful of paths).
WORKERS = 8

class KeptPool:
    """A thread pool kept for the process (made on first use) and made again in a forked
    child, whose copy of the parent's pool has no threads: `get`."""

    def __init__(self, workers: int, prefix: str) -> None:
        self.workers, self.prefix = workers, prefix
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.prefix)
            return self._pool


_POOL = KeptPool(WORKERS, "ckptfs-fsync")


def fsync_path(full: str, directory: bool) -> None:
    """fsync one file's data or one directory's entries (``full``: an OS path)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(full, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_all(files: Sequence[str], dirs: Sequence[str]) -> list[tuple[str, BaseException]]:
    """fsync every one of ``files`` (data) and ``dirs`` (entries), OS paths, at once; returns
    once all are done, with each one's failure (path, error), in the order given."""
    paths = [(p, False) for p in files] + [(d, True) for d in dirs]
    if len(paths) == 1:
        try:
            fsync_path(*paths[0])
        except Exception as exc:
            return [(paths[0][0], exc)]
        return []
    futures: list[tuple[str, Future[None]]] = [
        (p, _POOL.get().submit(fsync_path, p, d)) for p, d in paths]
    failed: list[tuple[str, BaseException]] = []
    for p, fut in futures:
        error = fut.exception()
        if error is not None:
            failed.append((p, error))
    return failed
