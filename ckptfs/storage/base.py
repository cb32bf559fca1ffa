"""The storage interface ckptfs owns: the few operations the commit protocol needs.

Everything above this module speaks only `Storage`; everything below it (fsspec, s3fs,
gcsfs, adlfs, the OS) is hidden behind one adapter, `ckptfs.storage.fsspec.FsspecStorage`.
Paths are ``/``-separated and relative to the store's root.  Differences between backends are
data (`Capabilities`), read by the protocol, never guessed from a URL at call sites.

Note for implementers: ``create_exclusive`` is the commit.  It must either write all of ``data``
in one request that the server refuses if the object exists, or raise ``FileExistsError``;
where the backend cannot do that, set ``exclusive_create=False`` and the protocol reports the
weaker guarantee instead of pretending.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import BinaryIO, Literal, Protocol, TypeVar, cast, runtime_checkable

from ckptfs.errors import TierOverlapError

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
    #: Peak bytes one open streaming write holds in this process (object stores: the part
    #: buffers; 0 where a write goes straight to the OS or to a dict).  A save bounds the sum
    #: over its parallel streams (``ckptfs.protocol.commit.WRITE_BUFFER_BUDGET``).
    stream_buffer_bytes: int = 0
    #: The weaker guarantee, in words, where exclusive create is not enforced across processes
    #: (logged when a store is opened); empty otherwise.
    caveat: str = ""

    @property
    def exclusive_across_processes(self) -> bool:
        return self.exclusive_create in ("os_excl", "server_precondition")


@dataclass(frozen=True)
class Entry:
    """One listing entry; ``name`` is the path relative to the store root.

    Note for implementers: ``is_link`` is a safety check, not a detail.  Where the backend has
    symbolic links (local disk), ``list_dir`` and ``list_tree`` must report them (and never
    follow them): the reader refuses a checkpoint containing one, from the listing alone."""

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
    """A store rooted at one URL.  All methods raise `ckptfs.errors.StorageError` (or a
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
        ``FileExistsError`` (`ckptfs.errors.CheckpointExistsError` family)."""
        ...

    def list_dir(self, path: str) -> list[Entry]:
        """Direct children of ``path``, bypassing every listing cache.  [] if absent.
        Symbolic links are listed with ``is_link=True`` (a link to a directory included)."""
        ...

    def list_tree(self, path: str) -> list[Entry]:
        """Every file under ``path`` (recursive, files only), bypassing listing caches.
        Symbolic links (to files or directories) are listed with ``is_link=True``, never
        followed."""
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



# -- optional capabilities ---------------------------------------------------------------------
#
# Each is a small protocol the core asks for with `supports` (never a ``getattr`` probe),
# and each is delegated explicitly by `StorageWrapper`.  A storage that implements only
# `Storage` keeps every safety check; it just loses the optimisation or the extra.

T = TypeVar("T")


@runtime_checkable
class RangedRead(Protocol):
    """Read a byte range in one request (an HTTP ranged GET on object stores).  Used by sharded
    loads, which read only the chunks a rank needs; `read_range` falls back to a
    streaming read for a `Storage` without it."""

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``start`` (fewer only at the end of the object);
        ``FileNotFoundError`` if absent."""
        ...


@runtime_checkable
class LocalFiles(Protocol):
    """Objects are files on this machine's filesystem (``mmap=True`` loads map them)."""

    def local_path(self, path: str) -> str:
        """The OS path of ``path``."""
        ...


@runtime_checkable
class Retrying(Protocol):
    """Bounded retries of a whole operation that the caller can replay from its first byte (a
    streamed file regenerated from memory).  `retry_call` runs ``fn`` once without it."""

    def retry_call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        ...


@runtime_checkable
class ModifiedTimes(Protocol):
    """Modification times of objects (garbage collection ages temporary files by them)."""

    def modified(self, path: str) -> datetime | None:
        """When ``path`` was last written (timezone-aware), or ``None`` if unknown/absent."""
        ...


@runtime_checkable
class EmptyDirRemoval(Protocol):
    """Remove a directory only if it is empty (real directories: local disk)."""

    def remove_empty_dir(self, path: str) -> bool:
        """Remove ``path`` if empty.  True if removed, False if it is not empty (a writer put
        something in it); ``FileNotFoundError`` if it is gone already."""
        ...


@dataclass(frozen=True)
class PendingUpload:
    """An unfinished multi-part upload under the store root (S3)."""

    path: str          # relative to the store root
    upload_id: str
    initiated: datetime | None
    size: int          # bytes in the parts uploaded so far (0 if unknown)


@runtime_checkable
class MultipartUploads(Protocol):
    """List and abort unfinished multi-part uploads (S3): what a killed writer leaves behind
    that no listing of objects shows."""

    def list_uploads(self, path: str) -> list[PendingUpload]:
        """The unfinished uploads under ``path`` (relative to the root)."""
        ...

    def abort_upload(self, upload: PendingUpload) -> bool:
        """Abort ``upload``.  False if it was gone already (aborted or completed)."""
        ...


@dataclass(frozen=True)
class StoredChecksum:
    """A whole-object checksum the object store itself keeps for an object (S3's full-object
    ``ChecksumCRC32``/``CRC32C``/``CRC64NVME``, GCS's ``crc32c``), as the store reports it in
    a metadata request: ``algorithm`` one of `ckptfs.format.hashing.STORE_CHECKSUMS`,
    ``hexdigest`` lowercase big-endian hex."""

    algorithm: str
    hexdigest: str


@runtime_checkable
class ServerChecksums(Protocol):
    """The store keeps a checksum of each whole object and reports it from a metadata request
    (no data read), so a committed checkpoint can be checked against its manifest without
    downloading it (docs/remote-verify.md).  A writer computes `checksum_algorithms`
    while it writes and records them in the manifest; the verifier compares."""

    def checksum_algorithms(self) -> tuple[str, ...]:
        """The whole-object checksums this store keeps for objects written through this
        storage, as names of `ckptfs.format.hashing.STORE_CHECKSUMS` (the writer computes
        each while writing)."""
        ...

    def server_checksum(self, path: str) -> StoredChecksum | None:
        """The store's whole-object checksum of ``path`` from one metadata request, ``None``
        where the store keeps none for this object (e.g. a composite multipart checksum);
        ``FileNotFoundError`` if absent."""
        ...


@runtime_checkable
class BatchedSync(Protocol):
    """Make several written files and directories durable in one step: their fsyncs run at
    once (a journaling filesystem commits them together), instead of one after the other.
    A commit that owns its files leaves each small file's fsync to this one step before its
    marker (`ckptfs.protocol.commit.Attempt`); without it, each file is fsynced as it is
    written and each directory with ``sync_dir``."""

    def sync_paths(self, files: Sequence[str], dirs: Sequence[str]) -> None:
        """Make the data of each of ``files`` (written and closed) and the entries of each of
        ``dirs`` durable: when it returns, every one is; a failure of any is raised (the
        others still ran).  A no-op where ``not capabilities.fsync``."""
        ...


@runtime_checkable
class DeclaresCapabilities(Protocol):
    """A storage whose class has the members of several optional capabilities but offers only
    some of them on a given backend (the fsspec adapter: local files only on local disk,
    multi-part uploads only on S3), and every `StorageWrapper`.  `supports` asks
    it instead of looking at its members."""

    def offers(self, capability: type) -> bool:
        ...


#: Every optional capability, for wrappers and the conformance suite.
OPTIONAL_CAPABILITIES: tuple[type, ...] = (RangedRead, LocalFiles, Retrying, ModifiedTimes,
                                           EmptyDirRemoval, MultipartUploads, ServerChecksums,
                                           BatchedSync)


def supports(storage: Storage, capability: type) -> bool:
    """Whether ``storage`` offers the optional ``capability`` (one of
    `OPTIONAL_CAPABILITIES`).  A `StorageWrapper` declares every member, so for a
    wrapper this asks the wrapper what it really offers (usually: what its inner storage
    offers).  A storage that declares its capabilities (`DeclaresCapabilities`) is
    asked; any other is checked for the capability's members."""
    if not _has_members(storage, capability):
        return False
    if _has_members(storage, DeclaresCapabilities):
        return bool(cast(DeclaresCapabilities, storage).offers(capability))
    return True


def location(storage: Storage) -> str:
    """Where ``storage``'s run root is, spelled one way: the resolved OS path for local disk
    (``/a/../a``, ``file:///a/``, ``local:///a`` and a symbolic link to ``/a`` are all ``/a``),
    else ``protocol://path`` with the path of its URL without repeated or trailing slashes and
    the protocol its implementation's one name, ``capabilities.protocol``, not the alias the URL
    spells (``s3a://b/x`` is ``s3://b/x``; ``gcs`` is ``gs``; ``abfs``/``abfss`` are ``az``; a
    protocol the backend table does not know is named by the fsspec implementation registered
    for it: `ckptfs.storage.backends.spec_for` of the filesystem's own protocol names).  For
    telling whether two storages are the same place, or one lies inside the other
    (`overlaps`)."""
    if supports(storage, LocalFiles):
        return os.path.realpath(cast(LocalFiles, storage).local_path(""))
    protocol, sep, path = storage.url.partition("://")
    if not sep:
        path = protocol
    parts = [p for p in path.split("/") if p]
    return f"{storage.capabilities.protocol}://{'/'.join(parts)}"


def overlaps(a: Storage, b: Storage) -> bool:
    """Whether the run roots of ``a`` and ``b`` are the same place or one holds the other."""
    la, lb = location(a), location(b)
    return any(x == y or x.startswith(y.rstrip("/") + "/") for x, y in ((la, lb), (lb, la)))


def check_tier_roots(local: Storage, remote: Storage) -> None:
    """Refuse two tiers (a two-tier store's, ``ckptfs ls --remote``'s, ``ckptfs replicate``'s)
    that are the same run root, however spelled, or nested: `TierOverlapError`."""
    if overlaps(local, remote):
        raise TierOverlapError(
            f"the local tier {local.url} and the remote tier {remote.url} are the same run "
            f"root ({location(local)}), or one lies inside the other: a step would count as "
            "replicated to itself and retention would delete its only copy; give the remote "
            "tier a run root of its own")


@cache
def _members(protocol: type) -> tuple[str, ...]:
    """The methods a capability protocol declares (its public callables)."""
    return tuple(name for name, value in vars(protocol).items()
                 if not name.startswith("_") and callable(value))


def _has_members(storage: object, protocol: type) -> bool:
    """``isinstance(storage, protocol)`` for a runtime-checkable protocol of methods, without
    its cost (Python 3.11 recomputes the protocol's members on every check: ~20-60 us, paid per
    ranged read of a sharded load)."""
    return all(callable(getattr(storage, name, None)) for name in _members(protocol))


def read_range(storage: Storage, path: str, start: int, length: int) -> bytes:
    """``length`` bytes at ``start`` of ``path`` (fewer if the object is shorter)."""
    if supports(storage, RangedRead):
        return storage.read_range(path, start, length)  # type: ignore[attr-defined, no-any-return]
    with storage.open_read(path) as f:
        skip = start
        while skip > 0:
            got = f.read(min(skip, 1 << 24))
            if not got:
                return b""
            skip -= len(got)
        return f.read(length) if length else b""


def retry_call(storage: Storage, op: str, path: str, fn: Callable[[], T]) -> T:
    """``fn`` under ``storage``'s bounded retries where it offers them (`Retrying`),
    else once."""
    if supports(storage, Retrying):
        return storage.retry_call(op, path, fn)  # type: ignore[attr-defined, no-any-return]
    return fn()


class CapabilityUnavailableError(NotImplementedError):
    """An optional capability was used on a storage that does not offer it (a bug in the
    caller: ask `supports` first)."""


class StorageWrapper:
    """Base of every storage that wraps another (retries, a sub-root, fault injection).

    Every member of `Storage` and of each optional capability is delegated here
    *explicitly*, through two hooks a subclass may override: `inner_path` (the inner
    storage's path of one of ours) and `outer_entry` (the reverse, for listings).  There
    is no ``__getattr__`` forwarding: a member a wrapper forgets fails a test instead of
    silently dropping a check.  `offers` says which optional capabilities this wrapper
    really has: those of its inner storage, unless a subclass adds one (retries)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url: str = inner.url
        self.capabilities: Capabilities = inner.capabilities

    # -- the two hooks -------------------------------------------------------------------------

    def inner_path(self, path: str) -> str:
        return path

    def outer_entry(self, entry: Entry) -> Entry:
        return entry

    def outer_path(self, path: str) -> str:
        return self.outer_entry(Entry(path, 0, False)).name

    def offers(self, capability: type) -> bool:
        return supports(self.inner, capability)

    # -- Storage -------------------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        return self.inner.read_bytes(self.inner_path(path))

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self.inner.open_read(self.inner_path(path))

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self.inner.open_write(self.inner_path(path))

    def write_bytes(self, path: str, data: bytes) -> None:
        self.inner.write_bytes(self.inner_path(path), data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.inner.create_exclusive(self.inner_path(path), data)

    def list_dir(self, path: str) -> list[Entry]:
        return [self.outer_entry(e) for e in self.inner.list_dir(self.inner_path(path))]

    def list_tree(self, path: str) -> list[Entry]:
        return [self.outer_entry(e) for e in self.inner.list_tree(self.inner_path(path))]

    def exists(self, path: str) -> bool:
        return self.inner.exists(self.inner_path(path))

    def delete(self, path: str) -> None:
        self.inner.delete(self.inner_path(path))

    def delete_tree(self, path: str) -> None:
        self.inner.delete_tree(self.inner_path(path))

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(self.inner_path(path))

    def rename_dir(self, src: str, dst: str) -> None:
        self.inner.rename_dir(self.inner_path(src), self.inner_path(dst))

    def sync_dir(self, path: str) -> None:
        self.inner.sync_dir(self.inner_path(path))

    # -- optional capabilities (each raises CapabilityUnavailableError where not offered) ------

    def require(self, capability: type) -> None:
        """Raise `CapabilityUnavailableError` unless this wrapper offers ``capability``."""
        if not self.offers(capability):
            raise CapabilityUnavailableError(
                f"{self!r} does not offer {capability.__name__} (check supports() first)")

    def read_range(self, path: str, start: int, length: int) -> bytes:
        # Always available: the inner storage's ranged read, or its streaming fallback.
        return read_range(self.inner, self.inner_path(path), start, length)

    def local_path(self, path: str) -> str:
        self.require(LocalFiles)
        return self.inner.local_path(self.inner_path(path))  # type: ignore[attr-defined, no-any-return]

    def retry_call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        return retry_call(self.inner, op, self.inner_path(path), fn)

    def modified(self, path: str) -> datetime | None:
        self.require(ModifiedTimes)
        return self.inner.modified(self.inner_path(path))  # type: ignore[attr-defined, no-any-return]

    def remove_empty_dir(self, path: str) -> bool:
        self.require(EmptyDirRemoval)
        return self.inner.remove_empty_dir(self.inner_path(path))  # type: ignore[attr-defined, no-any-return]

    def list_uploads(self, path: str) -> list[PendingUpload]:
        self.require(MultipartUploads)
        ups = self.inner.list_uploads(self.inner_path(path))  # type: ignore[attr-defined]
        return [PendingUpload(self.outer_path(u.path), u.upload_id, u.initiated, u.size)
                for u in ups]

    def abort_upload(self, upload: PendingUpload) -> bool:
        self.require(MultipartUploads)
        inner = PendingUpload(self.inner_path(upload.path), upload.upload_id, upload.initiated,
                              upload.size)
        return self.inner.abort_upload(inner)  # type: ignore[attr-defined, no-any-return]

    def checksum_algorithms(self) -> tuple[str, ...]:
        self.require(ServerChecksums)
        return self.inner.checksum_algorithms()  # type: ignore[attr-defined, no-any-return]

    def server_checksum(self, path: str) -> StoredChecksum | None:
        self.require(ServerChecksums)
        return self.inner.server_checksum(self.inner_path(path))  # type: ignore[attr-defined, no-any-return]

    def sync_paths(self, files: Sequence[str], dirs: Sequence[str]) -> None:
        self.require(BatchedSync)
        self.inner.sync_paths([self.inner_path(p) for p in files],  # type: ignore[attr-defined]
                              [self.inner_path(d) for d in dirs])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
