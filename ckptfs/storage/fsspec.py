"""The one adapter from ckptfs's :class:`~ckptfs.storage.base.Storage` to fsspec.

It does three things fsspec does not: it maps every storage-library exception to a typed ckptfs
error naming the URL; it bypasses listing caches on every listing (a commit by another process
must be visible at once); and it implements the create-only write and the local-disk durability
steps (fsync, ``link``-based exclusive create, rename) that the commit protocol relies on, as the
backend's :class:`~ckptfs.storage.base.Capabilities` say.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, BinaryIO, cast

import fsspec
import fsspec.core
from fsspec.registry import known_implementations

from ..errors import (
    BackendUnavailableError,
    CheckpointExistsError,
    CkptfsError,
    StorageAccessError,
    StorageError,
    StorageNotFoundError,
)
from .backends import BackendSpec, spec_for
from .base import Capabilities, Entry

log = logging.getLogger("ckptfs.storage")

_MEMORY_LOCK = threading.Lock()


def _is_precondition_failure(exc: BaseException) -> bool:
    """A create-only write refused because the object exists, whatever class the library used:
    s3fs raises FileExistsError only when the 412 names ``If-None-Match``, else OSError(EINVAL)
    (ministack); gcsfs and adlfs have their own.  The exception chain is searched for an HTTP
    412 status or a precondition error code."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, FileExistsError):
            return True
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            meta = response.get("ResponseMetadata", {})
            code = response.get("Error", {}).get("Code", "")
            if meta.get("HTTPStatusCode") == 412 or code in _PRECONDITION_CODES:
                return True
        status = getattr(cur, "status_code", None) or getattr(cur, "code", None)
        if status == 412 or getattr(cur, "error_code", None) in _PRECONDITION_CODES:
            return True
        text = str(cur)
        if any(m in text for m in _PRECONDITION_TEXT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


_PRECONDITION_CODES = {"PreconditionFailed", "ConditionNotMet", "BlobAlreadyExists",
                       "conditionNotMet"}
_PRECONDITION_TEXT = ("PreconditionFailed", "Precondition Failed", "ConditionNotMet",
                      "pre-conditions you specified did not hold", "BlobAlreadyExists")


class FsspecStorage:
    """A :class:`~ckptfs.storage.base.Storage` over any fsspec filesystem, rooted at ``url``."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.url = url.rstrip("/")
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        self.spec: BackendSpec = spec_for(protocol)
        options = {**self.spec.default_options, **storage_options}
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            known = known_implementations.get(protocol, {})
            hint = known.get("err") or f"install the fsspec implementation of {protocol!r}"
            raise BackendUnavailableError(f"cannot open {url}: {hint}") from exc
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
            raise StorageError(f"cannot open {url}: {type(exc).__name__}: {exc}") from exc
        self.fs = fs
        self.spec = spec_for(fs.protocol)
        self.capabilities: Capabilities = self.spec.capabilities
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self._local = self.capabilities.protocol == "file"

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
        except FileNotFoundError as exc:
            raise StorageNotFoundError(f"{op} {where}: not found") from exc
        except FileExistsError as exc:
            raise CheckpointExistsError(f"{op} {where}: already exists") from exc
        except PermissionError as exc:
            raise StorageAccessError(
                f"{op} {where}: access denied ({exc}); check the credentials and permissions "
                "passed as storage options"
            ) from exc
        except Exception as exc:
            raise StorageError(f"{op} {where} failed: {type(exc).__name__}: {exc}") from exc

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        with self._errors("read", path):
            return cast(bytes, self.fs.cat_file(self.full(path)))

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with self._errors("read", path):
            if self.spec.shared_read_handles:
                f = io.BytesIO(self.fs.cat_file(self.full(path)))
            else:
                f = self.fs.open(self.full(path), "rb", **self.spec.read_options)
        try:
            yield _Translating(f, self, path)
        finally:
            with self._errors("close", path):
                f.close()

    def exists(self, path: str) -> bool:
        with self._errors("stat", path):
            self._invalidate(path)
            return bool(self.fs.exists(self.full(path)))

    def _invalidate(self, path: str) -> None:
        try:
            self.fs.invalidate_cache(self.full(path))
        except Exception:  # pragma: no cover - a cache miss is harmless
            pass

    def list_dir(self, path: str) -> list[Entry]:
        with self._errors("list", path):
            self._invalidate(path)
            try:
                raw = self.fs.ls(self.full(path), detail=True, refresh=True)
            except FileNotFoundError:
                return []
            except TypeError:  # implementations without refresh=
                raw = self.fs.ls(self.full(path), detail=True)
        out = []
        me = self.full(path).rstrip("/")
        for info in raw:
            name = str(info["name"]).rstrip("/")
            if name == me or (self.capabilities.protocol == "memory" and "/" + name == me):
                continue
            out.append(Entry(self.rel(name), int(info.get("size") or 0),
                             info.get("type") == "directory"))
        return out

    def list_tree(self, path: str) -> list[Entry]:
        with self._errors("list", path):
            self._invalidate(path)
            try:
                raw = self.fs.find(self.full(path), detail=True, withdirs=False)
            except FileNotFoundError:
                return []
        return [Entry(self.rel(str(name)), int(info.get("size") or 0), False)
                for name, info in raw.items() if info.get("type") != "directory"]

    # -- writes --------------------------------------------------------------------------------

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        full = self.full(path)
        with self._errors("write", path):
            if self.capabilities.real_directories:
                self.fs.makedirs(self.fs._parent(full), exist_ok=True)
            f = self.fs.open(full, "wb")
        try:
            yield _Translating(f, self, path)
        except BaseException:
            _discard(f)
            if self.spec.partial_visible:
                with suppress(Exception):
                    self.fs.rm_file(full)
            raise
        with self._errors("write", path):
            f.close()

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
                    if _is_precondition_failure(exc):
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
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, full)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                raise FileExistsError(errno.EEXIST, "exists", full) from None
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            # A filesystem without hard links: fall back to O_EXCL (can leave a partial marker
            # on a crash mid-write; the reader then reports it as corrupt, never as committed).
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        self.sync_dir(os.path.dirname(path))

    def delete(self, path: str) -> None:
        with self._errors("delete", path):
            try:
                self.fs.rm_file(self.full(path))
            except FileNotFoundError:
                pass

    def delete_tree(self, path: str) -> None:
        with self._errors("delete", path):
            try:
                self.fs.rm(self.full(path), recursive=True)
            except FileNotFoundError:
                pass
            self._invalidate(path)

    def makedirs(self, path: str) -> None:
        if not self.capabilities.real_directories:
            return
        with self._errors("mkdir", path):
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
            fd = os.open(self.full(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def is_symlink(self, path: str) -> bool:
        """Only meaningful on local disk (a checkpoint may not contain symlinks)."""
        return self._local and os.path.islink(self.full(path))

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r}, {self.capabilities.protocol})"


BACKENDS_HINT = ("file", "memory", "s3", "gs", "az")


def _discard(f: Any) -> None:
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
        try:
            inner.close()
        except Exception:  # pragma: no cover
            pass


class _Translating:
    """A file wrapper whose ``read``/``readinto``/``write`` raise ckptfs errors, plus ``fsync``."""

    def __init__(self, f: Any, storage: FsspecStorage, path: str) -> None:
        self._f = f
        self._storage = storage
        self._path = path

    def write(self, data: Any) -> int:
        with self._storage._errors("write", self._path):
            return cast(int, self._f.write(data))

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
