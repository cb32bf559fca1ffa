"""Fault injection around any `Storage`: crashes, torn writes,
transient failures, and (on local disk) power cuts.

The wrapper sits between ckptfs and a real backend, so every protocol step runs against real
storage, and it numbers every *mutating* call: each ``write()`` of a streaming write, its
``fsync()`` and its commit (the close), ``write_bytes``, ``create_exclusive``, ``delete``,
``delete_tree``, ``makedirs``, ``rename_dir`` and ``sync_dir``.  A crash sweep first counts the
calls of a clean run, then crashes at each of them in turn.

A crash models a killed process, not an exception: `SimulatedCrash` derives from
``BaseException`` (``except Exception`` cleanup cannot swallow it) and, once raised, the wrapper
refuses every later call of that writer, reads included, so the ``except``/``finally`` cleanup
of ckptfs cannot reach storage either.  What a killed writer leaves behind is modelled per
backend: a partially streamed file stays visible on local disk and ``memory://`` (the bytes
written so far), while an object store shows nothing (an uncompleted upload is not an object).

Streaming writes are buffered by the wrapper and handed to the inner backend whole at the
commit (tests use small states): that makes every crash point deterministic and lets the
wrapper decide exactly which prefix a torn or killed write leaves.

The power-cut model (`PowerCutModel`, local disk only) follows POSIX durability at its
weakest: file data is durable only once the file was fsynced, a directory entry (create,
rename, delete) only once its parent directory was fsynced.  `FaultyStorage.power_cut`
rewrites the directory tree to what would be on disk after the machine lost power: unsynced
entries rolled back, unsynced file contents lost (empty files).  This is where a missing fsync
of a file or of a parent directory shows up.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, BinaryIO, Literal, cast

from ckptfs.errors import StorageError
from ckptfs.storage.base import (
    BatchedSync,
    EmptyDirRemoval,
    Entry,
    LocalFiles,
    ModifiedTimes,
    MultipartUploads,
    PendingUpload,
    Storage,
    StorageWrapper,
    supports,
)

MUTATING_OPS = ("write", "fsync", "commit", "write_bytes", "create_exclusive", "delete",
                "delete_tree", "makedirs", "rename_dir", "sync_dir", "remove_empty_dir",
                "abort_upload")
READ_OPS = ("read_bytes", "open_read", "open_write", "list_dir", "list_tree", "exists",
            "read_range", "modified", "list_uploads")


class SimulatedCrash(BaseException):
    """The writer died at this storage call.  Not an ``Exception``: cleanup code written as
    ``except Exception`` does not run, and the wrapper refuses every later call anyway."""


class TransientStorageError(StorageError):
    """An injected retryable failure (a dropped connection, a 503).  With ``after=True`` the
    call did reach storage and took effect before the error: the ambiguous outcome."""

    def __init__(self, message: str, *, after: bool = False) -> None:
        super().__init__(message)
        self.after = after


@dataclass(frozen=True)
class Call:
    """One recorded storage call: its 1-based number among mutating calls (0 for reads)."""

    index: int
    op: str
    path: str


Hook = Callable[[str, str], None]
Action = Literal["run", "tear", "fail_after", "crash_after", "outage_after"]


@dataclass
class FaultStats:
    mutating: int = 0
    reads: int = 0
    transient_before: int = 0
    transient_after: int = 0
    #: Calls refused by an outage (``outage_at``), reads included.
    outage_refused: int = 0
    calls: list[Call] = field(default_factory=list)


class FaultyStorage(StorageWrapper):
    """A `Storage` that injects faults into ``inner``.

    A `StorageWrapper`: it offers exactly the optional capabilities
    of ``inner``, and injects faults into those that are requests too (``read_range``,
    ``modified`` and ``list_uploads`` are reads; ``remove_empty_dir`` and ``abort_upload``
    mutate).  ``local_path`` and ``retry_call`` are delegated as they are (no request).

    ``crash_at=k``: the k-th mutating call crashes before it takes effect
    (``crash_after=True``: after it took effect, before the caller sees the answer).
    ``tear_at=k``: the k-th mutating call persists only ``tear_keep`` of its bytes, then crashes
    (``tear_then_crash=False``: then reports success, a storage that lies).
    ``transient_p``: every call fails with `TransientStorageError` with that probability
    (seeded by ``seed``); half of the failures of mutating calls happen after the call took effect.
    The ``write``/``fsync`` calls inside a streaming write are not requests of their own (the
    library buffers them), so they fail only with ``transient_stream_writes=True``.
    ``power_model``: record durability for `power_cut` (local disk only).
    ``outage_at=k``: an outage of the storage begins at the k-th mutating call: from it on,
    every call (reads included) fails with `TransientStorageError` before it reaches
    storage, until `end_outage` (or, with ``outage_calls``, after that many refused
    calls).  ``outage_after=True``: the k-th call takes effect first, then fails (the answer is
    lost: the ambiguous outcome), and the outage goes on from the next call.  Unlike a crash the
    writer is alive: it sees errors, retries, and goes on once the storage is back.
    `begin_outage` starts one at once (the storage is down from the start).
    ``hook(op, path)`` runs before every call (outside any lock): tests use it to interleave
    writers deterministically.
    """

    def __init__(self, inner: Storage, *, crash_at: int | None = None, crash_after: bool = False,
                 tear_at: int | None = None, tear_keep: float = 0.5,
                 tear_then_crash: bool = True, transient_p: float = 0.0,
                 transient_reads: bool = True, transient_stream_writes: bool = False,
                 seed: int = 0, power_model: bool = False,
                 outage_at: int | None = None, outage_after: bool = False,
                 outage_calls: int | None = None, hook: Hook | None = None) -> None:
        super().__init__(inner)
        self.crash_at = crash_at
        self.crash_after = crash_after
        self.tear_at = tear_at
        self.tear_keep = tear_keep
        self.tear_then_crash = tear_then_crash
        self.transient_p = transient_p
        self.transient_reads = transient_reads
        self.transient_stream_writes = transient_stream_writes
        self.hook = hook
        self.outage_at = outage_at
        self.outage_after = outage_after
        self.outage_calls = outage_calls
        #: Whether the outage is on now (from ``outage_at`` until `end_outage`).
        self.down = False
        self.stats = FaultStats()
        self.crashed = False
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        #: A killed writer leaves a partially streamed file visible (local disk, memory://);
        #: on object stores an uncompleted upload is no object.
        self.partial_visible = (inner.capabilities.real_directories
                                or inner.capabilities.protocol == "memory")
        self.power: PowerCutModel | None = None
        if power_model:
            self.power = PowerCutModel(local_root(inner))

    # -- bookkeeping ---------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """Mutating calls seen so far (including a crashed one)."""
        return self.stats.mutating

    @property
    def calls(self) -> list[Call]:
        return self.stats.calls

    def begin_outage(self) -> None:
        """The storage goes down now: every call fails until `end_outage`."""
        with self._lock:
            self.down = True

    def end_outage(self) -> None:
        """The storage is back: calls reach it again (no later outage begins)."""
        with self._lock:
            self.down = False
            self.outage_at = None

    def _refused(self) -> None:
        """Count a call the outage refused; with ``outage_calls``, the last one ends it."""
        self.stats.outage_refused += 1
        if self.outage_calls is not None and self.stats.outage_refused >= self.outage_calls:
            self.down = False
            self.outage_at = None

    def _refuse(self, op: str, path: str) -> TransientStorageError:
        self._refused()
        return TransientStorageError(f"{op} {self.url}/{path}: injected outage (connection "
                                     "refused)")

    def _die(self, op: str, path: str, index: int) -> SimulatedCrash:
        self.crashed = True
        return SimulatedCrash(f"simulated crash at mutating call {index} ({op} {path})")

    def _before(self, op: str, path: str, *, mutating: bool) -> Action:
        if self.hook is not None and not self.crashed:
            self.hook(op, path)
        with self._lock:
            if self.crashed:
                raise SimulatedCrash(f"{op} {path}: refused, this writer has crashed")
            if self.down:
                raise self._refuse(op, path)
            if not mutating:
                self.stats.reads += 1
                self.stats.calls.append(Call(0, op, path))
                if self.transient_reads and self._transient():
                    self.stats.transient_before += 1
                    raise TransientStorageError(f"{op} {self.url}/{path}: injected transient "
                                                "failure (connection reset)")
                return "run"
            self.stats.mutating += 1
            k = self.stats.mutating
            self.stats.calls.append(Call(k, op, path))
            if k == self.crash_at:
                if self.crash_after:
                    return "crash_after"
                raise self._die(op, path, k)
            if k == self.tear_at:
                return "tear"
            if k == self.outage_at:
                self.down = True
                if self.outage_after:
                    return "outage_after"
                self.stats.calls.pop()  # refused: it never reached storage
                self.stats.mutating -= 1
                raise self._refuse(op, path)
            if op in ("write", "fsync") and not self.transient_stream_writes:
                return "run"  # buffered inside one request: not a request of its own
            if self._transient():
                if self._rng.random() < 0.5:
                    return "fail_after"
                self.stats.transient_before += 1
                raise TransientStorageError(f"{op} {self.url}/{path}: injected transient failure "
                                            "(503 Slow Down)")
            return "run"

    def _transient(self) -> bool:
        return self.transient_p > 0 and self._rng.random() < self.transient_p

    def _after(self, action: Action, op: str, path: str) -> None:
        """Called once a mutating call took effect."""
        if action == "crash_after":
            raise self._die(op, path, self.stats.mutating)
        if action == "outage_after":
            with self._lock:
                self._refused()
            raise TransientStorageError(f"{op} {self.url}/{path}: injected outage after the "
                                        "request took effect (connection reset)", after=True)
        if action == "fail_after":
            with self._lock:
                self.stats.transient_after += 1
            raise TransientStorageError(f"{op} {self.url}/{path}: injected transient failure "
                                        "after the request took effect (timeout)", after=True)

    def _torn(self, data: bytes) -> bytes:
        return data[:int(len(data) * self.tear_keep)]

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        self._before("read_bytes", path, mutating=False)
        return self.inner.read_bytes(path)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        self._before("open_read", path, mutating=False)
        return self.inner.open_read(path)

    def list_dir(self, path: str) -> list[Entry]:
        self._before("list_dir", path, mutating=False)
        return self.inner.list_dir(path)

    def list_tree(self, path: str) -> list[Entry]:
        self._before("list_tree", path, mutating=False)
        return self.inner.list_tree(path)

    def exists(self, path: str) -> bool:
        self._before("exists", path, mutating=False)
        return self.inner.exists(path)

    # -- writes --------------------------------------------------------------------------------

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        self._before("open_write", path, mutating=False)
        writer = _BufferedWriter(self, path)
        try:
            yield cast(BinaryIO, writer)
        except SimulatedCrash:
            raise  # a dead process runs no cleanup: _BufferedWriter left what it had to
        except BaseException:
            raise  # the caller aborted the write: nothing was handed to the backend
        data = bytes(writer.buf)
        try:
            action = self._before("commit", path, mutating=True)
        except SimulatedCrash:
            self.leave_partial(path, data)  # killed before the close: the bytes so far stay
            raise
        if action == "tear":
            self._commit(path, self._torn(data), writer.synced)
            if self.tear_then_crash:
                raise self._die("commit", path, self.stats.mutating)
            return
        self._commit(path, data, writer.synced)
        self._after(action, "commit", path)

    def _commit(self, path: str, data: bytes, fsync: bool) -> None:
        with self.inner.open_write(path) as f:
            f.write(data)
            if fsync and self.capabilities.fsync:
                f.fsync()  # type: ignore[attr-defined]
        if self.power is not None:
            with self._lock:
                self.power.write_file(path, data, synced=fsync)

    def leave_partial(self, path: str, data: bytes) -> None:
        """What a killed streaming writer leaves: the bytes so far, where partial files are
        visible.  Executed by the wrapper (the storage's view), not by the dead writer."""
        if not self.partial_visible:
            return
        with self.inner.open_write(path) as f:
            f.write(data)
        if self.power is not None:
            with self._lock:
                self.power.write_file(path, data, synced=False)

    def write_bytes(self, path: str, data: bytes) -> None:
        action = self._before("write_bytes", path, mutating=True)
        if action == "tear":
            self.inner.write_bytes(path, self._torn(data))
            self._record_write(path, self._torn(data))
            if self.tear_then_crash:
                raise self._die("write_bytes", path, self.stats.mutating)
            return
        self.inner.write_bytes(path, data)
        self._record_write(path, data)
        self._after(action, "write_bytes", path)

    def _record_write(self, path: str, data: bytes) -> None:
        if self.power is not None:
            with self._lock:
                # FsspecStorage.write_bytes fsyncs the file where the backend can.
                self.power.write_file(path, data, synced=self.capabilities.fsync)

    def create_exclusive(self, path: str, data: bytes) -> None:
        action = self._before("create_exclusive", path, mutating=True)
        if action == "tear":
            self.inner.create_exclusive(path, self._torn(data) or data[:1])
            if self.tear_then_crash:
                raise self._die("create_exclusive", path, self.stats.mutating)
            return
        self.inner.create_exclusive(path, data)
        if self.power is not None:
            with self._lock:
                # The local adapter writes + fsyncs a temporary file, links it, fsyncs the
                # directory: the marker and its entry are durable when the call returns.
                self.power.create_durable(path, data)
        self._after(action, "create_exclusive", path)

    def _simple(self, op: str, path: str, fn: Callable[[], None],
                model: Callable[[PowerCutModel], None]) -> None:
        action = self._before(op, path, mutating=True)
        if action == "tear":
            raise self._die(op, path, self.stats.mutating)  # nothing to tear: a crash
        fn()
        if self.power is not None:
            with self._lock:
                model(self.power)
        self._after(action, op, path)

    def delete(self, path: str) -> None:
        self._simple("delete", path, lambda: self.inner.delete(path),
                     lambda m: m.unlink(path))

    def delete_tree(self, path: str) -> None:
        self._simple("delete_tree", path, lambda: self.inner.delete_tree(path),
                     lambda m: m.unlink(path))

    def makedirs(self, path: str) -> None:
        self._simple("makedirs", path, lambda: self.inner.makedirs(path),
                     lambda m: m.makedirs(path))

    def rename_dir(self, src: str, dst: str) -> None:
        self._simple("rename_dir", src, lambda: self.inner.rename_dir(src, dst),
                     lambda m: m.rename(src, dst))

    def sync_dir(self, path: str) -> None:
        self._simple("sync_dir", path, lambda: self.inner.sync_dir(path),
                     lambda m: m.sync_dir(path))

    def sync_paths(self, files: Sequence[str], dirs: Sequence[str]) -> None:
        """One call (one crash point): every path made durable at once, in the model too."""
        self.require(BatchedSync)
        files, dirs = list(files), list(dirs)

        def model(m: PowerCutModel) -> None:
            for f in files:
                m.sync_file(f)
            for d in dirs:
                m.sync_dir(d)

        self._simple("sync_paths", (files + dirs + [""])[0],
                     lambda: self.inner.sync_paths(files, dirs),  # type: ignore[attr-defined]
                     model)

    # -- optional capabilities (offered where ``inner`` offers them) ----------------------------

    def read_range(self, path: str, start: int, length: int) -> bytes:
        self._before("read_range", path, mutating=False)
        return super().read_range(path, start, length)

    def modified(self, path: str) -> datetime | None:
        self.require(ModifiedTimes)
        self._before("modified", path, mutating=False)
        return super().modified(path)

    def list_uploads(self, path: str) -> list[PendingUpload]:
        self.require(MultipartUploads)
        self._before("list_uploads", path, mutating=False)
        return super().list_uploads(path)

    def remove_empty_dir(self, path: str) -> bool:
        self.require(EmptyDirRemoval)
        removed = False
        remove = super().remove_empty_dir

        def run() -> None:
            nonlocal removed
            removed = remove(path)

        self._simple("remove_empty_dir", path, run, lambda m: m.unlink(path))
        return removed

    def abort_upload(self, upload: PendingUpload) -> bool:
        self.require(MultipartUploads)
        aborted = False
        abort = super().abort_upload

        def run() -> None:
            nonlocal aborted
            aborted = abort(upload)

        self._simple("abort_upload", upload.path, run, lambda m: None)
        return aborted

    # -- power cut -----------------------------------------------------------------------------

    def power_cut(self, *, lost_data: Literal["empty", "half"] = "empty") -> dict[str, int]:
        """The machine loses power now: this writer is dead, and the directory tree on disk is
        rewritten to its durable state.  Returns what was lost (counts) for the report."""
        if self.power is None:
            raise ValueError("power_cut needs FaultyStorage(..., power_model=True) on local disk")
        with self._lock:
            self.crashed = True
            return self.power.apply(lost_data)

    def __repr__(self) -> str:
        return f"FaultyStorage({self.inner!r}, crash_at={self.crash_at}, tear_at={self.tear_at})"


class _BufferedWriter:
    """The file object of `FaultyStorage.open_write`: every ``write`` and ``fsync`` is a
    numbered mutating call; the bytes go to the backend at the commit."""

    def __init__(self, storage: FaultyStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        self.buf = bytearray()
        self.synced = False

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        try:
            action = self._storage._before("write", self._path, mutating=True)
        except SimulatedCrash:
            self._storage.leave_partial(self._path, bytes(self.buf))
            raise
        if action == "tear":
            self.buf += self._storage._torn(chunk)
            if self._storage.tear_then_crash:
                self._storage.leave_partial(self._path, bytes(self.buf))
                raise self._storage._die("write", self._path, self._storage.count)
            return len(chunk)
        self.buf += chunk
        if action == "crash_after":
            self._storage.leave_partial(self._path, bytes(self.buf))
        self._storage._after(action, "write", self._path)
        return len(chunk)

    def fsync(self) -> None:
        try:
            action = self._storage._before("fsync", self._path, mutating=True)
        except SimulatedCrash:
            self._storage.leave_partial(self._path, bytes(self.buf))
            raise
        self.synced = True
        if action in ("crash_after", "tear"):
            self._storage.leave_partial(self._path, bytes(self.buf))
            raise self._storage._die("fsync", self._path, self._storage.count)
        self._storage._after(action, "fsync", self._path)


def local_root(storage: Storage) -> str:
    """The local directory a local-disk storage is rooted at
    (`LocalFiles`)."""
    if not supports(storage, LocalFiles):
        raise ValueError(f"the power-cut model needs a storage on local disk (LocalFiles), got "
                         f"{storage!r}")
    return cast(LocalFiles, storage).local_path("")


# -- the power-cut model ---------------------------------------------------------------------


class _File:
    __slots__ = ("data", "durable")

    def __init__(self, data: bytes, durable: bytes | None) -> None:
        self.data = data
        self.durable = durable


class _Dir:
    __slots__ = ("durable", "entries")

    def __init__(self) -> None:
        self.entries: dict[str, _File | _Dir] = {}
        self.durable: dict[str, _File | _Dir] = {}


class PowerCutModel:
    """A shadow of a local directory tree that knows what is durable.

    Nodes are objects (like inodes): a renamed directory keeps its identity and its entries; a
    file rewritten in place keeps its last fsynced contents as ``durable``.  Everything present
    when the model is created counts as durable."""

    def __init__(self, root: str) -> None:
        self.root_path = root
        self.root = self._snapshot(root)
        self.lost_files = 0
        self.rolled_back_entries = 0

    def _snapshot(self, path: str) -> _Dir:
        d = _Dir()
        if os.path.isdir(path):
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                if os.path.isdir(full) and not os.path.islink(full):
                    d.entries[name] = self._snapshot(full)
                elif os.path.isfile(full):
                    with open(full, "rb") as f:
                        data = f.read()
                    d.entries[name] = _File(data, data)
            d.durable = dict(d.entries)
        return d

    @staticmethod
    def _split(path: str) -> list[str]:
        return [p for p in path.split("/") if p]

    def _dir(self, parts: list[str], create: bool = False) -> _Dir:
        d = self.root
        for part in parts:
            node = d.entries.get(part)
            if not isinstance(node, _Dir):
                if not create:
                    raise FileNotFoundError("/".join(parts))
                node = _Dir()
                d.entries[part] = node
            d = node
        return d

    def makedirs(self, path: str) -> None:
        self._dir(self._split(path), create=True)

    def write_file(self, path: str, data: bytes, *, synced: bool) -> None:
        parts = self._split(path)
        parent = self._dir(parts[:-1], create=True)
        node = parent.entries.get(parts[-1])
        if isinstance(node, _File):
            node.data = data
            if synced:
                node.durable = data
        else:
            parent.entries[parts[-1]] = _File(data, data if synced else None)

    def create_durable(self, path: str, data: bytes) -> None:
        parts = self._split(path)
        parent = self._dir(parts[:-1], create=True)
        node = _File(data, data)
        parent.entries[parts[-1]] = node
        parent.durable[parts[-1]] = node

    def unlink(self, path: str) -> None:
        parts = self._split(path)
        if not parts:
            self.root.entries.clear()
            return
        try:
            parent = self._dir(parts[:-1])
        except FileNotFoundError:
            return
        parent.entries.pop(parts[-1], None)

    def rename(self, src: str, dst: str) -> None:
        s, d = self._split(src), self._split(dst)
        node = self._dir(s[:-1]).entries.pop(s[-1])
        self._dir(d[:-1], create=True).entries[d[-1]] = node

    def sync_dir(self, path: str) -> None:
        d = self._dir(self._split(path))
        d.durable = dict(d.entries)

    def sync_file(self, path: str) -> None:
        """The file's data is durable from now on (its entry only once its parent is
        synced)."""
        parts = self._split(path)
        node = self._dir(parts[:-1]).entries.get(parts[-1])
        if not isinstance(node, _File):
            raise FileNotFoundError(path)
        node.durable = node.data

    def durable_tree(self, lost_data: str = "empty") -> dict[str, bytes | None]:
        """Path -> contents (``None`` for a directory) of what survives a power cut."""
        out: dict[str, bytes | None] = {}
        self.lost_files = self.rolled_back_entries = 0

        def walk(d: _Dir, prefix: str) -> None:
            if d.entries.keys() != d.durable.keys() or any(
                    d.entries[k] is not d.durable[k] for k in d.entries):
                self.rolled_back_entries += len(set(d.entries.items()) ^ set(d.durable.items()))
            for name, node in d.durable.items():
                rel = f"{prefix}{name}"
                if isinstance(node, _Dir):
                    out[rel] = None
                    walk(node, rel + "/")
                else:
                    if node.durable is None or node.durable != node.data:
                        self.lost_files += 1
                    if node.durable is not None:
                        out[rel] = node.durable
                    else:
                        out[rel] = b"" if lost_data == "empty" else node.data[:len(node.data) // 2]

        walk(self.root, "")
        return out

    def apply(self, lost_data: str = "empty") -> dict[str, int]:
        tree = self.durable_tree(lost_data)
        root = self.root_path
        if os.path.isdir(root):
            for name in os.listdir(root):
                full = os.path.join(root, name)
                if os.path.isdir(full) and not os.path.islink(full):
                    shutil.rmtree(full)
                else:
                    os.unlink(full)
        os.makedirs(root, exist_ok=True)
        for rel, data in sorted(tree.items()):
            full = os.path.join(root, *rel.split("/"))
            if data is None:
                os.makedirs(full, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "wb") as f:
                    f.write(data)
        self.root = self._snapshot(root)
        return {"lost_files": self.lost_files, "rolled_back_entries": self.rolled_back_entries}
