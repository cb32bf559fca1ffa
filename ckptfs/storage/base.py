"""The storage interface ckptfs owns: the few operations the commit protocol needs.

Everything above this module speaks only :class:`Storage`; everything below it (fsspec, s3fs,
gcsfs, adlfs, the OS) is hidden behind one adapter, :class:`ckptfs.storage.fsspec.FsspecStorage`.
Paths are ``/``-separated and relative to the store's root.  Differences between backends are
data (:class:`Capabilities`), read by the protocol, never guessed from a URL at call sites.

Note for implementers: ``create_exclusive`` is the commit.  It must either write all of ``data``
in one request that the server refuses if the object exists, or raise ``FileExistsError``;
where the backend cannot do that, set ``exclusive_create=False`` and the protocol reports the
weaker guarantee instead of pretending.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO, Literal, Protocol, runtime_checkable

ExclusiveCreate = Literal["os_excl", "server_precondition", "process_lock", "none"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees, as data.  See docs/backends.md for the table."""

    protocol: str
    #: How ``create_exclusive`` is enforced: by the OS (``O_EXCL``), by the server (HTTP
    #: precondition ``If-None-Match: *`` / ``ifGenerationMatch=0``), by a lock inside this process
    #: only (``memory://``), or not at all.
    exclusive_create: ExclusiveCreate
    #: ``rename_dir`` is a single atomic metadata operation (local disk).  Object stores copy and
    #: delete, so the protocol never renames there.
    atomic_rename: bool
    #: Files and directory entries can be made durable with fsync.
    fsync: bool
    #: An empty object can be created exclusively without the library turning it into an
    #: unconditional write (s3fs does for zero bytes).  The protocol never writes empty markers
    #: anyway; this records the trap.
    empty_create_safe: bool
    #: Directories exist as such (local) rather than as key prefixes (object stores).
    real_directories: bool
    #: The backend is visible to other processes/hosts (False for ``memory://``).
    shared: bool
    #: The create-only precondition also holds for writes the library splits into several
    #: requests (S3 multipart, GCS resumable, Azure block lists), i.e. ``open(path, "xb")`` of a
    #: large file.  ckptfs does not need it (the marker is small and goes up in one request);
    #: recorded so the doctor and the docs can say so.
    exclusive_multipart: bool = False

    @property
    def exclusive_across_processes(self) -> bool:
        return self.exclusive_create in ("os_excl", "server_precondition")


@dataclass(frozen=True)
class Entry:
    """One listing entry; ``name`` is the path relative to the store root."""

    name: str
    size: int
    is_dir: bool
    #: A symbolic link (local disk; listed, never followed).  Always False on object stores.
    is_link: bool = False

    @property
    def basename(self) -> str:
        return self.name.rstrip("/").rsplit("/", 1)[-1]


@runtime_checkable
class Storage(Protocol):
    """A store rooted at one URL.  All methods raise :class:`ckptfs.errors.StorageError` (or a
    subclass, or ``FileNotFoundError``/``FileExistsError`` subclasses of it) for storage
    failures; never a storage library's own exception."""

    url: str
    capabilities: Capabilities

    def read_bytes(self, path: str) -> bytes:
        """Whole object; ``FileNotFoundError`` if absent."""
        ...

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        """A streaming reader supporting ``readinto``."""
        ...

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        """A streaming writer; the object appears (whole) when the context exits cleanly.  On an
        exception inside the block the partial upload is aborted where the backend allows.
        ``fsync()`` may be called on the returned object when ``capabilities.fsync``."""
        ...

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write (replacing) a whole small object."""
        ...

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create ``path`` with ``data`` in one request iff it does not exist; else raise
        ``FileExistsError`` (:class:`ckptfs.errors.CheckpointExistsError` family)."""
        ...

    def list_dir(self, path: str) -> list[Entry]:
        """Direct children of ``path``, bypassing every listing cache.  [] if absent."""
        ...

    def list_tree(self, path: str) -> list[Entry]:
        """Every file under ``path`` (recursive, files only), bypassing listing caches."""
        ...

    def exists(self, path: str) -> bool: ...

    def delete(self, path: str) -> None:
        """Delete one file; absent is not an error."""
        ...

    def delete_tree(self, path: str) -> None:
        """Delete everything under ``path``; absent is not an error."""
        ...

    def makedirs(self, path: str) -> None:
        """Create a directory (no-op on object stores)."""
        ...

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename a directory; only called when ``capabilities.atomic_rename``.  Must
        not replace an existing ``dst``."""
        ...

    def sync_dir(self, path: str) -> None:
        """Make directory entries under ``path`` durable (fsync the directory); no-op where
        ``not capabilities.fsync``."""
        ...


@runtime_checkable
class RangedRead(Protocol):
    """Optional: read a byte range in one request (an HTTP ranged GET on object stores).  Used
    by sharded loads, which read only the chunks a rank needs; :func:`read_range` falls back to
    a streaming read for a :class:`Storage` without it."""

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``start`` (fewer only at the end of the object);
        ``FileNotFoundError`` if absent."""
        ...


def read_range(storage: Storage, path: str, start: int, length: int) -> bytes:
    """``length`` bytes at ``start`` of ``path`` (fewer if the object is shorter)."""
    if isinstance(storage, RangedRead):
        return storage.read_range(path, start, length)
    with storage.open_read(path) as f:
        skip = start
        while skip > 0:
            got = f.read(min(skip, 1 << 24))
            if not got:
                return b""
            skip -= len(got)
        return f.read(length) if length else b""
