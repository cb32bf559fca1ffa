"""The one adapter from ckptfs's `Storage` to fsspec.

It does three things fsspec does not: it maps every storage-library exception to a typed ckptfs
error naming the URL; it bypasses listing caches on every listing (a commit by another process
must be visible at once); and it implements the create-only write and the local-disk durability
steps (fsync, ``link``-based exclusive create, rename) that the commit protocol relies on, as the
backend's `Capabilities` say.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import errno
import io
import logging
import os
import socket
import stat
import threading
import time
import urllib.parse
import urllib.request
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from typing import Any, BinaryIO, TypeVar, cast

import fsspec
import fsspec.core
from fsspec.registry import known_implementations

from ckptfs.errors import (
    BackendUnavailableError,
    CheckpointExistsError,
    CkptfsError,
    StorageAccessError,
    StorageError,
    StorageNotFoundError,
)
from ckptfs.storage.backends import (
    EXTRAS,
    BackendSpec,
    check_url,
    endpoint_of,
    merge_options,
    spec_for,
)
from ckptfs.storage.base import (
    BatchedSync,
    Capabilities,
    CapabilityUnavailableError,
    EmptyDirRemoval,
    Entry,
    LocalFiles,
    ModifiedTimes,
    MultipartUploads,
    PendingUpload,
    RangedRead,
    ServerChecksums,
    StoredChecksum,
)
from ckptfs.storage.classify import classify as classify
from ckptfs.storage.classify import describe_cause as describe_cause
from ckptfs.storage.classify import error_chain as error_chain
from ckptfs.storage.classify import is_precondition_failure as is_precondition_failure
from ckptfs.storage.classify import permanent_advice
from ckptfs.storage.classify import status_code as status_code
from ckptfs.storage.local_files import link_or_create, open_regular, read_at
from ckptfs.storage.syncs import sync_all

log = logging.getLogger("ckptfs.storage")

_MEMORY_LOCK = threading.Lock()
#: How many times a memory:// listing or stat is tried when the dict changed under it.
_MEMORY_SETTLE_TRIES = 8
T = TypeVar("T")


#: Seconds the open-time probe waits for a refused or unroutable endpoint; one that accepts
#: connections gets ``SLOW_PROBE_FACTOR`` times more.
DEFAULT_PROBE_TIMEOUT = 10.0
SLOW_PROBE_FACTOR = 5
#: Seconds the probe waits for the endpoint's host name to resolve before it gives up on that
#: check (and goes on to the request, which the libraries bound by ``probe_timeout``): a name
#: that cannot be resolved fails at once, with the resolver's cause, instead of after the
#: libraries' retries (75 s for gcsfs with no network).
RESOLVE_TIMEOUT = 5.0


class FsspecStorage:
    """A `Storage` over any fsspec filesystem, rooted at ``url``."""

    def __init__(self, url: str, *, probe: bool = True,
                 probe_timeout: float = DEFAULT_PROBE_TIMEOUT,
                 full_object_checksums: bool = True, **storage_options: Any) -> None:
        """Open ``url`` with ``storage_options`` passed to the fsspec implementation (merged over
        the backend's defaults, see `ckptfs.storage.backends`).

        ``full_object_checksums`` (S3 only): multi-part uploads ask the store to keep a
        full-object CRC32 (`S3FullObjectCrc32`), so that ``verify(remote=True)`` can
        compare them; ``False`` for an S3-compatible server that refuses those requests.

        On object stores the bucket/container is checked at once (one request, at most
        ``probe_timeout`` seconds), so a missing bucket, refused credentials or a dead endpoint
        raise here, naming the URL and the cause, before anything is written.  ``probe=False``
        skips it (one request fewer per open)."""
        check_url(url)
        self.url = url.rstrip("/")
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        self.spec: BackendSpec = spec_for(protocol)
        options = merge_options(self.spec.default_options, storage_options)
        if probe and self.spec.probe_on_open:  # before the library looks for credentials
            _check_resolves(url, endpoint_of(protocol, options), min(probe_timeout,
                                                                     RESOLVE_TIMEOUT))
        try:
            fs, root = _make_fs(url, protocol, options)
        except ImportError as exc:
            raise BackendUnavailableError(
                f"cannot open {url}: {missing_package_hint(protocol, self.spec, exc)}") from exc
        except ValueError as exc:
            if "Protocol not known" in str(exc) or "not known" in str(exc):
                raise BackendUnavailableError(
                    f"cannot open {url}: unknown protocol {protocol!r}; known protocols include "
                    f"{', '.join(sorted(BACKENDS_HINT))}"
                ) from exc
            raise StorageError(f"cannot open {url}: {exc}") from exc
        except TypeError as exc:
            raise StorageError(f"cannot open {url}: bad storage option ({exc})") from exc
        except CkptfsError:
            raise
        except Exception as exc:
            raise classify(exc)(f"cannot open {url}: {describe_cause(exc)}") from exc
        self.fs = fs
        self.spec = spec_for(fs.protocol)
        self.capabilities: Capabilities = dataclasses.replace(
            self.spec.capabilities, caveat=self.spec.caveat,
            stream_buffer_bytes=0 if self.spec.capabilities.protocol == "file"
            else self.spec.stream_buffer_bytes)
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self._local = self.capabilities.protocol == "file"
        self._full_object_checksums = full_object_checksums
        #: The optional capabilities this backend has (`offers`), decided once, as data:
        #: from the backend's spec, and for multi-part uploads from what the filesystem object
        #: can do (s3fs), never from the URL.
        self._offered: frozenset[type] = frozenset(
            cap for cap, has in ((RangedRead, True),
                                 (LocalFiles, self._local),
                                 (EmptyDirRemoval, self.capabilities.real_directories),
                                 (ModifiedTimes, bool(self.spec.mtime_keys)),
                                 (MultipartUploads, has_multipart_api(fs)),
                                 (ServerChecksums, self._checksum_api() is not None),
                                 (BatchedSync, self.capabilities.fsync))
            if has)
        if probe and self.spec.probe_on_open:
            self.probe(probe_timeout)

    # -- reachability --------------------------------------------------------------------------

    @property
    def bucket(self) -> str:
        return self.root.strip("/").split("/", 1)[0]

    def probe(self, timeout: float = DEFAULT_PROBE_TIMEOUT) -> None:
        """Check that the bucket/container exists and the credentials are accepted, in one
        request bounded by ``timeout`` seconds (the libraries' own retries on a refused
        connection take 60-90 s for gcsfs and adlfs).  Where the credentials may not read the
        bucket itself but may list the run root (a prefix-scoped policy), listing the root is
        enough."""
        bucket = self.bucket
        started = time.monotonic()
        try:
            self._bounded(timeout, "info", bucket)
            return
        except TimeoutError:
            waited = time.monotonic() - started
            raise StorageError(
                f"cannot open {self.url}: no answer in {waited:.0f} s"
                f"{_reachability(self.fs)}; check the endpoint (endpoint_url / connection "
                "string) and the network, or pass a larger probe_timeout"
            ) from None
        except Exception as exc:
            first: BaseException = exc
        cls = classify(first)
        if cls is StorageAccessError:
            try:
                self._bounded(timeout, "ls", self.root)
                return
            except FileNotFoundError:
                return
            except Exception:
                pass
            raise StorageAccessError(
                f"cannot open {self.url}: access denied ({describe_cause(first)}); check the "
                "credentials and permissions passed as storage options"
            ) from first
        if cls is StorageNotFoundError:
            raise StorageNotFoundError(
                f"cannot open {self.url}: bucket/container {bucket!r} does not exist "
                f"({describe_cause(first)}); create it, or fix the URL"
            ) from first
        raise StorageError(f"cannot open {self.url}: {describe_cause(first)}") from first

    def _bounded(self, timeout: float, name: str, *args: Any) -> Any:
        """``fs.<name>(*args)``, abandoned (and its coroutine cancelled) after ``timeout``."""
        fs = self.fs
        coro_fn = getattr(fs, f"_{name}", None)
        loop = getattr(fs, "loop", None) if getattr(fs, "async_impl", False) else None
        if coro_fn is None or loop is None:
            return getattr(fs, name)(*args)
        fut = asyncio.run_coroutine_threadsafe(coro_fn(*args), loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            # A server that accepts connections is slow (a loaded machine, a cold start), not
            # dead: give it more time.  Only a refused or unroutable endpoint fails at once.
            if _connectable(fs) is not False:
                with suppress(TimeoutError):
                    return fut.result(timeout * SLOW_PROBE_FACTOR)
            fut.cancel()
            raise

    # -- paths ---------------------------------------------------------------------------------

    def full(self, path: str) -> str:
        if not path:
            return self.root
        return f"{self.root}/{path}" if self.root not in ("", "/") else f"{self.root}{path}"

    def rel(self, full: str) -> str:
        full = full.rstrip("/")
        root = self.root.rstrip("/")
        if self.capabilities.protocol == "memory" and not full.startswith("/"):
            full = "/" + full
        if full == root:
            return ""
        if root and full.startswith(root + "/"):
            return full[len(root) + 1:]
        if not root:
            return full.lstrip("/")
        return full

    def describe(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url

    @contextmanager
    def _errors(self, op: str, path: str) -> Iterator[None]:
        where = self.describe(path)
        try:
            yield
        except CkptfsError:
            raise
        except FileExistsError as exc:
            raise CheckpointExistsError(f"{op} {where}: already exists") from exc
        except Exception as exc:
            cls = classify(exc)
            cause = describe_cause(exc)
            if cls is StorageNotFoundError:
                raise StorageNotFoundError(f"{op} {where}: not found ({cause})") from exc
            if cls is StorageAccessError:
                raise StorageAccessError(
                    f"{op} {where}: access denied ({cause}); check the credentials and "
                    "permissions passed as storage options"
                ) from exc
            advice = permanent_advice(exc)
            if advice is not None:  # not retried (ckptfs.storage.classify)
                raise cls(f"{op} {where} failed: {cause}; {advice}") from exc
            raise cls(f"{op} {where} failed: {cause}") from exc

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        with self._errors("read", path):
            if self._local:  # never waits on a FIFO (`ckptfs.storage.local_files`)
                with os.fdopen(self._open_local(path), "rb") as f:
                    return f.read()
            return cast(bytes, self.fs.cat_file(self.full(path), **self.spec.cat_options))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """One ranged read (an HTTP range GET on object stores)."""
        if length <= 0:
            return b""
        with self._errors("read", path):
            if self._local:
                fd = self._open_local(path)
                try:
                    return read_at(fd, start, length)
                finally:
                    os.close(fd)
            return cast(bytes, self.fs.cat_file(self.full(path), start=start, end=start + length))

    def _open_local(self, path: str) -> int:
        return open_regular(self.full(path), self.describe(path), path)

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with self._errors("read", path):
            if self._local:
                f: Any = os.fdopen(self._open_local(path), "rb")
            elif self.spec.shared_read_handles:
                f = io.BytesIO(self.fs.cat_file(self.full(path)))
            else:
                f = self.fs.open(self.full(path), "rb", **self.spec.read_options)
        try:
            yield cast(BinaryIO, _Translating(f, self, path))
        finally:
            with self._errors("close", path):
                f.close()

    def _settled(self, fn: Callable[[], T]) -> T:
        """``fn()``, repeated if fsspec's in-memory filesystem tripped over another thread's
        change to its dict: ``KeyError`` (its ``ls``/``info`` look a key up again after a
        snapshot, so a file deleted in between, a losing writer discarding its attempt, fails
        the listing instead of leaving it out) or ``RuntimeError`` "dictionary changed size
        during iteration" (its ``ls`` iterates the shared dict itself while a writer adds or
        removes a file).  Other backends: once."""
        if self.capabilities.protocol != "memory":
            return fn()
        for _ in range(_MEMORY_SETTLE_TRIES - 1):
            try:
                return fn()
            except KeyError:
                continue
            except RuntimeError as exc:
                if "changed size during iteration" not in str(exc):
                    raise
                continue
        return fn()

    def exists(self, path: str) -> bool:
        with self._errors("stat", path):
            self._invalidate(path)
            return bool(self._settled(lambda: self.fs.exists(self.full(path))))

    def _invalidate(self, path: str) -> None:
        with suppress(Exception):  # a cache miss is harmless
            self.fs.invalidate_cache(self.full(path))

    def list_dir(self, path: str) -> list[Entry]:
        with self._errors("list", path):
            self._invalidate(path)
            try:
                raw = self._settled(lambda: self.fs.ls(self.full(path), detail=True,
                                                       refresh=True))
            except FileNotFoundError:
                return []
            except TypeError:  # implementations without refresh=
                raw = self._settled(lambda: self.fs.ls(self.full(path), detail=True))
        out = []
        me = self.full(path).rstrip("/")
        for info in raw:
            name = str(info["name"]).rstrip("/")
            if name == me or (self.capabilities.protocol == "memory" and "/" + name == me):
                continue
            link = bool(info.get("islink"))  # local disk: listed, never followed
            is_dir = info.get("type") == "directory" or (link and self._local
                                                         and os.path.isdir(name))
            out.append(Entry(self.rel(name), int(info.get("size") or 0), is_dir, link))
        return out

    def list_tree(self, path: str) -> list[Entry]:
        if self._local:
            with self._errors("list", path):
                return self._list_tree_local(path)
        with self._errors("list", path):
            self._invalidate(path)
            try:
                raw = self._settled(lambda: self.fs.find(self.full(path), detail=True,
                                                         withdirs=False))
            except FileNotFoundError:
                return []
        return [Entry(self.rel(str(name)), int(info.get("size") or 0), False)
                for name, info in raw.items() if info.get("type") != "directory"]

    def _list_tree_local(self, path: str) -> list[Entry]:
        """Local ``list_tree`` that never hides an error: fsspec's walk skips a directory it
        cannot read, which made an unreadable attempt read as "files missing" (corruption)
        instead of a permission error.  Symbolic links are listed (``is_link``), never
        followed.  A subdirectory deleted during the walk is skipped (a concurrent delete)."""
        top = self.full(path)

        def onerror(exc: OSError) -> None:
            if isinstance(exc, FileNotFoundError) and exc.filename != top:
                return
            raise exc

        out: list[Entry] = []
        try:
            for dirpath, dirnames, filenames in os.walk(top, onerror=onerror):
                for name in [*filenames, *dirnames]:
                    full = os.path.join(dirpath, name)
                    try:
                        st = os.lstat(full)
                    except FileNotFoundError:
                        continue
                    link = stat.S_ISLNK(st.st_mode)
                    if link or not stat.S_ISDIR(st.st_mode):
                        out.append(Entry(self.rel(full), st.st_size, False, link))
        except FileNotFoundError as exc:
            if exc.filename == top:
                return []
            raise
        return out

    # -- writes --------------------------------------------------------------------------------

    def _makedirs_local(self, full: str, *, sync_all: bool = False) -> None:
        """``os.makedirs`` that makes the entries of the directories it creates durable (their
        parents fsynced, top-down) for the run root and the directories above it, a brand-new
        run root, which the commit protocol's own ``sync_dir`` calls (all inside the root)
        cannot reach; ``sync_all``: for every directory it creates."""
        missing: list[str] = []
        d = os.path.abspath(full)
        while not os.path.lexists(d):
            missing.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        if not missing and os.path.isdir(d):
            return  # the common case (every file of an attempt): one stat, no mkdir
        for tries_left in (2, 1, 0):
            try:
                os.makedirs(full, exist_ok=True)
                break
            except FileNotFoundError:  # a parent was removed meanwhile (an empty step
                if not tries_left:     # directory, by a failed writer's discard or gc)
                    raise
        root = os.path.abspath(self.full(""))
        for created in reversed(missing):
            if sync_all or created == root or root.startswith(created.rstrip(os.sep) + os.sep):
                _fsync_dir(os.path.dirname(created))

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        full = self.full(path)
        with self._errors("write", path):
            if self._local:
                self._makedirs_local(os.path.dirname(full))
            elif self.capabilities.real_directories:
                self.fs.makedirs(self.fs._parent(full), exist_ok=True)
            # Object stores: one part per ``spec.write_block_size`` written instead of the
            # library's default block (s3fs: 50 MiB), and writes split at part boundaries (see
            # _Translating), so a stream holds at most ``stream_buffer_bytes``.  Local and
            # memory files have no block.
            block = self.spec.write_block_size
            f = (self.fs.open(full, "wb", block_size=block) if block and not self._local
                 else self.fs.open(full, "wb"))
            if (self._full_object_checksums and self._checksum_api() == "s3"
                    and callable(getattr(f, "_call_s3", None))):
                f._call_s3 = S3FullObjectCrc32(f._call_s3)
        try:
            yield cast(BinaryIO, _Translating(f, self, path, None if self._local else block))
            with self._errors("write", path):
                f.close()
        except BaseException:
            # An exception in the block, or a failed close (e.g. CompleteMultipartUpload
            # refused): abort the multipart upload / resumable session, commit nothing.
            discard_write(f)
            if self.spec.partial_visible:
                with suppress(Exception):
                    self.fs.rm_file(full)
            raise

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)
            if self.capabilities.fsync:
                f.fsync()  # type: ignore[attr-defined]

    def create_exclusive(self, path: str, data: bytes) -> None:
        if not data:
            raise ValueError("ckptfs never creates empty objects exclusively (s3fs turns them "
                             "into unconditional writes)")
        how = self.capabilities.exclusive_create
        with self._errors("create", path):
            if how == "os_excl":
                self._create_local(path, data)
            elif how == "server_precondition":
                try:
                    self.fs.pipe_file(self.full(path), data, mode="create")
                except Exception as exc:
                    if is_precondition_failure(exc):
                        raise CheckpointExistsError(
                            f"create {self.describe(path)}: already exists (another writer "
                            "created it first)"
                        ) from exc
                    raise
            elif how == "process_lock":
                with _MEMORY_LOCK:
                    if self.fs.exists(self.full(path)):
                        raise FileExistsError(path)
                    self.fs.pipe_file(self.full(path), data)
            else:
                self._invalidate(path)
                if self.fs.exists(self.full(path)):
                    raise FileExistsError(path)
                self.fs.pipe_file(self.full(path), data)

    def _create_local(self, path: str, data: bytes) -> None:
        """Exclusive create with full content: write + fsync a private temporary file, then
        ``link`` it to the final name (atomic, fails with EEXIST), so a crash can never leave
        an empty or partial file under the final name (``O_EXCL`` + write could)."""
        full = self.full(path)
        parent = os.path.dirname(full)
        self._makedirs_local(parent, sync_all=True)
        tmp = os.path.join(parent, f".tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:  # the temporary file is removed however this ends (a full disk: every try)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            link_or_create(tmp, full, data)
        finally:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
        self.sync_dir(os.path.dirname(path))

    def delete(self, path: str) -> None:
        with self._errors("delete", path), suppress(FileNotFoundError):
            self.fs.rm_file(self.full(path))

    def delete_tree(self, path: str) -> None:
        def rm() -> None:
            with suppress(FileNotFoundError):  # repeated: what is gone already is not found
                self.fs.rm(self.full(path), recursive=True)

        with self._errors("delete", path):
            self._settled(rm)
            self._invalidate(path)

    def makedirs(self, path: str) -> None:
        if not self.capabilities.real_directories:
            return
        with self._errors("mkdir", path):
            if self._local:
                self._makedirs_local(self.full(path))
            else:
                self.fs.makedirs(self.full(path), exist_ok=True)

    def rename_dir(self, src: str, dst: str) -> None:
        if not self.capabilities.atomic_rename:
            raise StorageError(f"{self.url}: rename is not atomic on this backend")
        with self._errors("rename", src):
            d = self.full(dst)
            if os.path.lexists(d):
                raise FileExistsError(errno.EEXIST, "exists", d)
            os.rename(self.full(src), d)

    def sync_dir(self, path: str) -> None:
        if not self.capabilities.fsync:
            return
        with self._errors("fsync", path):
            _fsync_dir(self.full(path))

    def sync_paths(self, files: Sequence[str], dirs: Sequence[str]) -> None:
        """Every path's fsync at once (`ckptfs.storage.syncs`); the first failure raised as
        the typed error of that path's fsync, once all are done."""
        if not self.capabilities.fsync:
            return
        failed = sync_all([self.full(p) for p in files], [self.full(d) for d in dirs])
        if failed:
            full, exc = failed[0]
            with self._errors("fsync", self.rel(full)):
                raise exc

    # -- optional capabilities (ckptfs.storage.base) ------------------------------------------

    def offers(self, capability: type) -> bool:
        """Which optional capabilities this backend really has (decided when opened, as data):
        ranged reads everywhere, local files on local disk, empty-directory removal where
        directories are real, modification times where the backend's ``info`` carries one,
        multi-part uploads where the filesystem can list and abort them (s3fs)."""
        return capability in self._offered

    def _require(self, capability: type) -> None:
        if capability not in self._offered:
            raise CapabilityUnavailableError(
                f"{self.url} ({self.capabilities.protocol}) does not offer "
                f"{capability.__name__}")

    def local_path(self, path: str) -> str:
        """The OS path of ``path`` (local disk only: `LocalFiles`)."""
        self._require(LocalFiles)
        return self.full(path)

    def modified(self, path: str) -> datetime | None:
        """The modification time ``info`` reports (`ModifiedTimes`;
        the backend's ``mtime_keys``), ``None`` if absent or not given for this object."""
        self._require(ModifiedTimes)
        with self._errors("stat", path):
            try:
                info = self._settled(lambda: self.fs.info(self.full(path)))
            except FileNotFoundError:
                return None
        for key in self.spec.mtime_keys:
            when = _as_time(info.get(key))
            if when is not None:
                return when
        return None

    def remove_empty_dir(self, path: str) -> bool:
        """``rmdir``: never removes anything a writer created in the directory meanwhile
        (`EmptyDirRemoval`, real directories only)."""
        self._require(EmptyDirRemoval)
        with self._errors("rmdir", path):
            try:
                self.fs.rmdir(self.full(path))
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    return False
                raise
        return True

    def _bucket_key(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.full(path))
        return str(bucket), str(key).rstrip("/")

    def list_uploads(self, path: str) -> list[PendingUpload]:
        """The unfinished multi-part uploads under ``path``
        (`MultipartUploads`), with the bytes of the parts uploaded
        so far (``ListParts``; 0 where that fails)."""
        self._require(MultipartUploads)
        bucket, prefix = self._bucket_key(path)
        with self._errors("list uploads", path):
            raw = self.fs.list_multipart_uploads(bucket)
        out = []
        for up in raw:
            key = str(up.get("Key", ""))
            if prefix and not (key == prefix or key.startswith(prefix + "/")):
                continue
            initiated = up.get("Initiated")
            out.append(PendingUpload(
                self.rel(f"{bucket}/{key}"), str(up["UploadId"]),
                _as_time(initiated),
                self._upload_size(bucket, key, str(up["UploadId"]))))
        return out

    def _upload_size(self, bucket: str, key: str, upload_id: str) -> int:
        try:
            parts = self.fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=upload_id)
            return sum(int(p.get("Size", 0)) for p in parts.get("Parts", []))
        except Exception:
            log.debug("list_parts failed for %s/%s", bucket, key, exc_info=True)
            return 0

    def abort_upload(self, upload: PendingUpload) -> bool:
        """Abort one unfinished upload; ``False`` if it was gone already (``NoSuchUpload``:
        aborted by another process, or completed)."""
        self._require(MultipartUploads)
        bucket, key = self._bucket_key(upload.path)
        with self._errors("abort upload", upload.path):
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key,
                                UploadId=upload.upload_id)
            except Exception as exc:
                if _no_such_upload(exc):
                    return False
                raise
        return True

    def _checksum_api(self) -> str | None:
        """How this store's whole-object checksums are read: ``"s3"`` (HeadObject through
        botocore, which s3fs's ``info`` does not surface), ``"info"`` (the library's ``info``
        carries them: gcsfs's ``crc32c``), or ``None`` (none known: local, memory, Azure)."""
        if not self.spec.server_checksums:
            return None
        if has_multipart_api(self.fs):
            return "s3"
        return "info"

    def checksum_algorithms(self) -> tuple[str, ...]:
        """The store checksums to compute while writing
        (`ServerChecksums`)."""
        self._require(ServerChecksums)
        return tuple(self.spec.server_checksums)

    def server_checksum(self, path: str) -> StoredChecksum | None:
        """The store's whole-object checksum of ``path`` from one metadata request (S3:
        ``HeadObject`` with ``ChecksumMode=ENABLED``; GCS: the object's metadata), ``None``
        where it keeps none for this object: an S3 multi-part object with a composite
        (checksum-of-parts) checksum or none at all."""
        self._require(ServerChecksums)
        with self._errors("stat", path):
            if self._checksum_api() == "s3":
                bucket, key = self._bucket_key(path)
                head = self.fs.call_s3("head_object", Bucket=bucket, Key=key,
                                       ChecksumMode="ENABLED")
                return s3_full_object_checksum(head)
            info = self.fs.info(self.full(path))
        value = info.get("crc32c")
        return StoredChecksum("crc32c", b64_to_hex(value)) if isinstance(value, str) else None

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r}, {self.capabilities.protocol})"


#: S3's checksum response fields, by store-checksum name, in order of preference.
S3_CHECKSUM_FIELDS = (("crc64nvme", "ChecksumCRC64NVME"), ("crc32c", "ChecksumCRC32C"),
                      ("crc32", "ChecksumCRC32"))


def s3_full_object_checksum(head: dict[str, Any]) -> StoredChecksum | None:
    """The full-object checksum of a ``HeadObject``/``GetObjectAttributes`` answer, ``None`` if
    it has none or only a composite one (``ChecksumType: COMPOSITE``, or a value ending in
    ``-<parts>``: a checksum of the parts' checksums, which no single pass over the bytes
    reproduces)."""
    if head.get("ChecksumType") == "COMPOSITE":
        return None
    for name, key in S3_CHECKSUM_FIELDS:
        value = head.get(key)
        if isinstance(value, str) and "-" not in value:
            return StoredChecksum(name, b64_to_hex(value))
    return None


class S3FullObjectCrc32:
    """The request method of one s3fs file being written, made to give a multi-part upload a
    full-object CRC32 that S3 checks and keeps (``ChecksumType: FULL_OBJECT``): s3fs creates
    the upload and completes it naming no checksum, and then S3 keeps none for the object.

    CreateMultipartUpload asks for ``ChecksumAlgorithm=CRC32, ChecksumType=FULL_OBJECT``; each
    UploadPart sends its part's CRC32 (which botocore would otherwise compute itself); and
    CompleteMultipartUpload lists each part's CRC32 and the whole object's, which S3 checks
    against what it received.  s3fs uploads the parts of one file in order, one at a time, so
    the whole object's CRC is a running CRC over the parts (an out-of-order part is refused
    here rather than completed with a wrong value).  A single-request upload (below the part
    size) needs none of this: botocore sends a CRC32 of every PutObject body, which S3 keeps
    as the object's full-object checksum.  See docs/remote-verify.md."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call
        self._crc = 0
        self._parts: dict[int, str] = {}

    def __call__(self, method: str, *kwargs_list: Any, **kwargs: Any) -> Any:
        if method == "create_multipart_upload":
            kwargs.update(ChecksumAlgorithm="CRC32", ChecksumType="FULL_OBJECT")
        elif method == "upload_part":
            body = kwargs["Body"]
            if kwargs["PartNumber"] != len(self._parts) + 1:
                raise StorageError(f"part {kwargs['PartNumber']} of {kwargs.get('Key')} "
                                   f"uploaded after {len(self._parts)} parts: out of order")
            part = zlib.crc32(body)
            self._crc = zlib.crc32(body, self._crc)
            self._parts[kwargs["PartNumber"]] = kwargs["ChecksumCRC32"] = _crc_b64(part)
        elif method == "complete_multipart_upload":
            parts = kwargs["MultipartUpload"]["Parts"]
            kwargs["MultipartUpload"] = {**kwargs["MultipartUpload"], "Parts": [
                {**p, "ChecksumCRC32": self._parts[p["PartNumber"]]} for p in parts]}
            kwargs.update(ChecksumCRC32=_crc_b64(self._crc), ChecksumType="FULL_OBJECT")
        return self._call(method, *kwargs_list, **kwargs)


def _crc_b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def b64_to_hex(value: str) -> str:
    """A checksum as the stores send it (base64 of the big-endian bytes) as lowercase hex."""
    return base64.b64decode(value).hex()


BACKENDS_HINT = ("file", "memory", "s3", "gs", "az")


def _fsync_dir(full: str) -> None:
    fd = os.open(full, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def has_multipart_api(fs: Any) -> bool:
    """The filesystem can list and abort multi-part uploads (s3fs): a check of what the object
    offers, never of the URL (an S3-compatible endpoint under another protocol name counts)."""
    return all(callable(getattr(fs, name, None))
               for name in ("list_multipart_uploads", "call_s3", "split_path"))


def _as_time(value: object) -> datetime | None:
    """A modification time as ``info`` reports it (POSIX seconds, a datetime, ISO 8601 text),
    timezone-aware; ``None`` for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(float(value), timezone.utc)
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return None


def _no_such_upload(exc: BaseException) -> bool:
    """``NoSuchUpload`` (or the library's translation of it to ``FileNotFoundError``) anywhere
    in the exception's chain: the upload was aborted or completed meanwhile."""
    for e in error_chain(exc):
        _, code = status_code(e)
        if code == "NoSuchUpload" or "NoSuchUpload" in str(e) or isinstance(e, FileNotFoundError):
            return True
    return False


def _make_fs(url: str, protocol: str, options: dict[str, Any]) -> tuple[Any, str]:
    """The fsspec filesystem and root path for ``url``.

    gcsfs trap: ``import gcsfs`` picks its ``GCSFileSystem`` class from the environment variable
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` (default on in gcsfs 2026.x), and the experimental class
    makes a gRPC bucket-type call that an emulator or custom endpoint cannot answer, retried for
    40-100 s on *every* open.  When an endpoint is given (``endpoint_url=`` or
    ``STORAGE_EMULATOR_HOST``), ckptfs instantiates the plain ``gcsfs.core.GCSFileSystem``
    directly, whatever the variable says or when gcsfs was imported.  Against Google's own
    endpoint gcsfs keeps its choice."""
    if protocol in ("gs", "gcs") and (options.get("endpoint_url")
                                      or os.environ.get("STORAGE_EMULATOR_HOST")):
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem(**options), str(GCSFileSystem._strip_protocol(url))
    fs, root = fsspec.core.url_to_fs(url, **options)
    return fs, str(root)


def _endpoint(fs: Any) -> str | None:
    for attr in ("endpoint_url", "_endpoint", "account_url", "_location"):
        value = getattr(fs, attr, None)
        if isinstance(value, str) and value.startswith(("http://", "https://")):
            return value
    client_kwargs = getattr(fs, "client_kwargs", None)
    if isinstance(client_kwargs, dict) and isinstance(client_kwargs.get("endpoint_url"), str):
        return str(client_kwargs["endpoint_url"])
    url = getattr(getattr(fs, "service_client", None), "url", None)
    return url if isinstance(url, str) else None


def missing_package_hint(protocol: str, spec: BackendSpec, exc: ImportError) -> str:
    """What to install for ``protocol`` when importing its implementation failed: the extra
    of ckptfs that installs it (``pip install "ckptfs[s3]"``) where there is one."""
    package = spec.package or getattr(exc, "name", None)
    extra = EXTRAS.get(package or "")
    if extra is not None:
        return (f"the {protocol}:// protocol needs the {package} package, which is not "
                f'installed: pip install "ckptfs[{extra}]"')
    known = known_implementations.get(protocol, {})
    return str(known.get("err") or f"install the fsspec implementation of {protocol!r}")


def _check_resolves(url: str, endpoint: str | None, timeout: float) -> None:
    """Raise `StorageError` naming the host when the host of ``endpoint`` cannot be resolved.
    Silent when it resolves, when the resolver gives no answer within ``timeout`` (the probe's
    request is then bounded by its own timeout), when the endpoint is unknown, or when a proxy
    from the environment serves it (the proxy resolves it, not this machine)."""
    host = urllib.parse.urlsplit(endpoint).hostname if endpoint else None
    if not host:
        return
    proxies = urllib.request.getproxies_environment()
    if proxies and not urllib.request.proxy_bypass(host):
        return
    outcome: list[OSError | None] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=resolve, name="ckptfs-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    exc = outcome[0] if outcome else None
    if isinstance(exc, socket.gaierror):
        raise StorageError(
            f"cannot open {url}: the endpoint's host {host!r} ({endpoint}) cannot be resolved "
            f"({exc.strerror or exc}); check the host name in the endpoint (endpoint_url / "
            "connection string), the DNS and the network") from exc


def _host_port(fs: Any) -> tuple[str, str, int] | None:
    endpoint = _endpoint(fs)
    if not endpoint:
        return None
    parsed = urllib.parse.urlsplit(endpoint)
    if not parsed.hostname:
        return None
    return endpoint, parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)


def _connectable(fs: Any) -> bool | None:
    """Whether a TCP connection to the filesystem's endpoint succeeds (None: endpoint unknown,
    e.g. the provider's default)."""
    where = _host_port(fs)
    if where is None:
        return None
    try:
        with socket.create_connection(where[1:], timeout=3.0):
            return True
    except OSError:
        return False


def _reachability(fs: Any) -> str:
    """After a timeout: name the endpoint and say whether a TCP connection to it is refused, so
    the message gives the cause the library's retries hid."""
    where = _host_port(fs)
    if where is None:
        return ""
    endpoint, host, port = where
    try:
        with socket.create_connection((host, port), timeout=3.0):
            return f" from {endpoint} (it accepts connections but did not answer)"
    except OSError as exc:
        return f" from {endpoint} (cannot connect: {exc.strerror or exc})"


def discard_write(f: Any) -> None:
    """Abandon a partially written file: abort the multipart upload / resumable session where
    the library supports it, and never commit it."""
    try:
        f.discard()
    except Exception:  # pragma: no cover - best effort
        log.debug("discard failed", exc_info=True)
    try:
        if hasattr(f, "buffer"):
            f.buffer = None
        f.closed = True
    except Exception:  # pragma: no cover
        pass
    inner = getattr(f, "f", None)  # LocalFileOpener: close the OS file, leave the partial file
    if inner is not None:
        with suppress(Exception):
            inner.close()


class _Translating:
    """A file wrapper whose ``read``/``readinto``/``write`` raise ckptfs errors, plus ``fsync``."""

    def __init__(self, f: Any, storage: FsspecStorage, path: str,
                 block: int | None = None) -> None:
        self._f = f
        self._storage = storage
        self._path = path
        #: Part size of a buffered streaming write: each write is split (as zero-copy views) at
        #: part boundaries, so the library's buffer fills to exactly one part and is sent whole.
        #: Unsplit, a 16 MiB write into a nearly full buffer grows it to two parts, and the
        #: leftover is copied into a new buffer after each upload (~2x the memory per stream).
        self._block = block
        self._pos = 0

    def write(self, data: Any) -> int:
        with self._storage._errors("write", self._path):
            if not self._block:
                return cast(int, self._f.write(data))
            mv = memoryview(data)
            if mv.ndim != 1 or mv.itemsize != 1:
                mv = mv.cast("B")
            total = len(mv)
            while mv:
                room = self._block - self._pos % self._block
                part = mv[:room]
                self._f.write(part)
                self._pos += len(part)
                mv = mv[room:]
            return total

    def read(self, n: int = -1) -> bytes:
        with self._storage._errors("read", self._path):
            return cast(bytes, self._f.read(n))

    def readinto(self, buf: Any) -> int:
        with self._storage._errors("read", self._path):
            got = self._f.readinto(buf)
            return int(got or 0)

    def fsync(self) -> None:
        with self._storage._errors("fsync", self._path):
            self._f.flush()
            inner = getattr(self._f, "f", self._f)
            os.fsync(inner.fileno())
