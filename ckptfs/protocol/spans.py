"""Reading one large file of a local-disk checkpoint with several threads at once.

Design decision: **a large file is read in spans, several at once, and hashed in order as
they arrive.**  A single-process checkpoint keeps a state's tensors in a few files split by
top-level key (the model, the optimizer: `ckptfs.format.serialize.relayout`), so their sizes
differ (a 64 MiB transformer state: 22 and 44 MB).  Read one per thread, a load lasts as long
as its largest file.  What a read into new tensors costs is the copy from the page cache and
the first touch of every page of the tensors, work two cores do in half the time (measured
here: 42 MiB read into one tensor in 19 ms by one thread, 11 ms by two).  So the tensor data
of a file larger than two spans is cut into spans of `SPAN_BYTES` (`cut`) and read at their
offsets (``os.preadv`` straight into the tensors' memory) by a small pool kept for the
process, ``window`` spans of the file in flight at a time, in file order.  The reading thread
hands each span to the file's hasher as soon as it and every span before it are read (the
file's digest is over its bytes in order): the hash trails the reads by about one span instead
of starting after the last one.

Only local disk (`ckptfs.storage.base.LocalFiles`: what ``mmap=True`` maps) is read so:
positional reads of the file itself, opened with ``O_NOFOLLOW`` (a file replaced by a link
after the listing is refused, as the mapping refuses it).  Other storages read each file in
one stream.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from concurrent.futures import Future

from ckptfs.errors import CorruptCheckpointError, StorageError
from ckptfs.protocol.chunks import open_no_follow, pread_views
from ckptfs.storage.syncs import KeptPool

__all__ = ["SPAN_BYTES", "SpanReads", "cut", "windows_of"]

#: The bytes of one span (a pool thread's unit of work).
SPAN_BYTES = 4 * 1024 * 1024
#: The pool's threads (spans of the files a load reads at once).
WORKERS = 8

_POOL = KeptPool(WORKERS, "ckptfs-span")


def processors() -> int:
    """The processors this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # pragma: no cover - not Linux


def windows_of(sizes: Sequence[int], threads: int) -> list[int]:
    """Spans in flight at once for each file of a load reading files of ``sizes`` on
    ``threads`` threads (1: the file is read in one stream).  The load's bytes are shared
    over the threads that can run at once (``threads``, at most the processors this process
    may use): a file larger than one share is read by as many spans at once as it has shares,
    so the largest file no longer sets the load's length.  Files of equal size on as many
    threads are each read in one stream (splitting them adds threads, not speed: measured
    here, two 512 MiB files in 0.46-0.49 s in one stream each, 0.50-0.54 s with two spans
    each at once)."""
    ways = max(1, min(threads, processors()))
    total = sum(sizes)
    if ways == 1 or total <= 0 or not hasattr(os, "preadv"):  # no positional reads: streams
        return [1] * len(sizes)
    return [max(1, min(ways, -(-size * ways // total))) for size in sizes]


def cut(views: Sequence[memoryview], start: int, span: int
        ) -> list[tuple[int, list[memoryview]]]:
    """``views`` (consecutive in the file from offset ``start``) cut into spans of ``span``
    bytes (the last one the rest; a view is cut where a span ends): each span's file offset
    and views."""
    out: list[tuple[int, list[memoryview]]] = [(start, [])]
    room = span
    offset = start
    for view in views:
        at = 0
        while at < len(view):
            if room == 0:
                out.append((offset, []))
                room = span
            piece = view[at:at + room]
            out[-1][1].append(piece)
            at += len(piece)
            offset += len(piece)
            room -= len(piece)
    return out


class SpanReads:
    """The spans of one local file (`cut`), read by the pool, ``window`` at a time in file
    order: `wait` ``(k)`` is whether span ``k`` was read full (and hands the next one to the
    pool); `extra_byte` whether the file holds a byte past its size.  Use as a context manager
    (it opens the file, ``O_NOFOLLOW``): leaving it cancels the spans not started and waits
    for those being read (their memory is the caller's), then closes the file."""

    def __init__(self, local: str, spans: list[tuple[int, list[memoryview]]], window: int, *,
                 where: str, step: int, path: str) -> None:
        self.local, self.spans, self.window, self.where = local, spans, max(1, window), where
        self.step, self.path = step, path
        self.fd: int | None = None
        self.futures: list[Future[int]] = []

    def __enter__(self) -> SpanReads:
        where, step, path = self.where, self.step, self.path
        self.fd = open_no_follow(self.local, where, step=step, path=path,
                                 missing=lambda: CorruptCheckpointError(
                                     f"{where}: listed in the manifest but missing",
                                     step=step, path=path))
        for _ in range(min(self.window, len(self.spans))):
            self._submit()
        return self

    def _submit(self) -> None:
        assert self.fd is not None
        offset, views = self.spans[len(self.futures)]
        self.futures.append(_POOL.get().submit(pread_views, self.fd, views, offset))

    def wait(self, k: int) -> bool:
        """Whether span ``k`` was read full; a read error as `StorageError`."""
        try:
            n = self.futures[k].result()
        except OSError as exc:
            raise StorageError(f"{self.where}: read failed: {exc}") from exc
        if len(self.futures) < len(self.spans):
            self._submit()
        return n == sum(len(v) for v in self.spans[k][1])

    def extra_byte(self, size: int) -> bool:
        """Whether the file holds more than ``size`` bytes."""
        assert self.fd is not None
        try:
            return bool(os.pread(self.fd, 1, size))
        except OSError as exc:
            raise StorageError(f"{self.where}: read failed: {exc}") from exc

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        for fut in self.futures:  # the spans write into the caller's memory: never leave early
            if not fut.cancel():
                with contextlib.suppress(BaseException):  # reported by wait(), or the
                    fut.result()                          # caller failed first
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
