"""`CkptfsStorage`, torch_checkpointing's ``Storage`` over a ckptfs storage adapter, and its
`CkptfsStorageConfig` (the design: the package's docstring)."""

from __future__ import annotations

import errno
import io
import json
import os
import posixpath
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfs.errors import CheckpointExistsError, CorruptCheckpointError
from ckptfs.format.hashing import DEFAULT_ALGORITHM, new_hasher
from ckptfs.storage.base import Entry
from ckptfs.storage.base import Storage as CkptfsAdapter
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.storage.retry import RetryingStorage
from ckptfs.torch_checkpointing.records import (
    DEFAULT_BLOCK_SIZE,
    HIDDEN_PREFIX,
    KEEP_NAME,
    MARKER_PREFIX,
    SUM_PREFIX,
    BlockHasher,
    CommitRecord,
    FileSum,
    base_name,
    join_key,
    marker_key,
    parent_key,
    parse_sum,
    sum_key,
)
from ckptfs.torch_checkpointing.streams import HashingWriter, VerifiedReader

try:
    from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ckptfs.torch_checkpointing needs the torch-checkpointing package (which needs "
        'torch>=2.11): pip install "ckptfs[torch-checkpointing]"') from exc

#: Threads reading sidecars at a commit.
COMMIT_THREADS = 16


COMMIT_THREADS = 16


@dataclass
class CkptfsStorageConfig(StorageConfig):
    """What a torch_checkpointing ``CheckpointManager.Config(storage_config=...)`` (and
    torchtitan's ``TorchCheckpointingManager(storage_config=...)``) takes; picklable, so the
    async saver's subprocess builds its own storage from it.

    ``url``: the root (any fsspec URL ckptfs supports: a path, ``file://``, ``memory://``,
    ``s3://``, ``gs://``, ``az://``); ``storage_options`` go to the fsspec implementation
    (``endpoint_url``, ``key``, ``secret``, ``token``, ``connection_string``, ...);
    ``mount``: a local prefix absolute paths are taken relative to (None: absolute paths are
    refused); ``retries``: retries of transient storage failures (0: none)."""

    url: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict)
    mount: str | None = None
    algorithm: str = DEFAULT_ALGORITHM
    block_size: int = DEFAULT_BLOCK_SIZE
    retries: int = 3

    def create_storage(self) -> CkptfsStorage:
        if not self.url:
            raise ValueError("CkptfsStorageConfig needs url= (the root of the checkpoints, "
                             "e.g. 's3://bucket/run' or '/data/run')")
        adapter: CkptfsAdapter = FsspecStorage(self.url, **self.storage_options)
        if self.retries > 0:
            adapter = RetryingStorage(adapter, attempts=self.retries + 1)
        return CkptfsStorage(adapter, mount=self.mount, algorithm=self.algorithm,
                             block_size=self.block_size)



def _occupied(src: str, dst: str, code: int, why: str) -> FileExistsError:
    return CheckpointExistsError(
        code, f"refusing to rename {src} onto {dst}: {why}; a rename commits onto unoccupied "
        "space and never merges or overwrites (delete the destination first if it is meant "
        "to be replaced)")


@dataclass(frozen=True)
class Where:
    """What a path is (`CkptfsStorage._walk`)."""

    record: CommitRecord | None = None  # the committed directory it is in (or is)
    rel: str = ""                       # the path relative to that directory
    owner: str | None = None            # it is in (or is) the files of this committed directory
    owner_files: str | None = None      # ... which are in this directory
    entry: Entry | None = None          # otherwise: its physical entry, None if absent
    parent_dir: bool = False            # otherwise: its parent exists as a directory
    depth: int = 0                      # otherwise: how many leading levels exist as directories


class CkptfsStorage(Storage):
    """torch_checkpointing's ``Storage`` over a ckptfs storage adapter (see the package
    docstring for the design).  Build it with `CkptfsStorageConfig`."""

    def __init__(self, adapter: CkptfsAdapter, *, mount: str | None = None,
                 algorithm: str = DEFAULT_ALGORITHM,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        new_hasher(algorithm)  # an unknown or uninstalled algorithm fails here, not mid-save
        self.adapter = adapter
        self.mount = os.path.normpath(mount) if mount else None
        self.algorithm = algorithm
        self.block_size = block_size
        self._records: dict[str, CommitRecord] = {}  # marker key -> record (immutable)
        self._lock = threading.Lock()

    # -- paths ---------------------------------------------------------------------------------

    def key(self, path: Path | str) -> str:
        """The name under the root URL that ``path`` stands for."""
        raw = os.fspath(path)
        if os.path.isabs(raw):
            norm = os.path.normpath(raw)
            if self.mount is None or not (norm == self.mount
                                          or norm.startswith(self.mount.rstrip("/") + "/")):
                where = f"under mount={self.mount!r}" if self.mount else "(no mount= given)"
                raise ValueError(
                    f"{raw} is an absolute path not {where}: paths for {self.adapter.url} are "
                    "relative to it, or absolute under CkptfsStorageConfig(mount=...), the "
                    "local prefix that stands for the URL")
            raw = os.path.relpath(norm, self.mount)
        rel = posixpath.normpath(raw.replace(os.sep, "/"))
        if rel in (".", ""):
            return ""
        if rel == ".." or rel.startswith("../"):
            raise ValueError(f"{raw} leads outside the storage root {self.adapter.url}")
        return rel.lstrip("/")

    def remap_path(self, path: Path) -> str:
        k = self.key(path)
        return f"{self.adapter.url}/{k}" if k else self.adapter.url

    # -- markers -------------------------------------------------------------------------------

    def _record(self, logical: str) -> CommitRecord | None:
        """The commit of ``logical`` as a directory, or None."""
        if not logical:
            return None
        mk = marker_key(logical)
        with self._lock:
            rec = self._records.get(mk)
        if rec is not None:
            return rec
        try:
            data = self.adapter.read_bytes(mk)
        except FileNotFoundError:
            return None
        rec = CommitRecord.parse(data, mk)
        with self._lock:
            self._records[mk] = rec
        return rec

    def _walk(self, key: str) -> Where:
        """What ``key`` is: inside (or) a committed directory, inside (or) the hidden files of
        one, or a plain physical path (its entry, None if absent).  One listing per level of
        the path (markers already read come from the cache)."""
        parts = key.split("/") if key else []
        with self._lock:
            for i in range(len(parts), 0, -1):
                cached = self._records.get(marker_key("/".join(parts[:i])))
                if cached is not None:
                    return Where(record=cached, rel="/".join(parts[i:]))
        entry: Entry | None = Entry("", 0, True)
        parent_dir = True
        for i, name in enumerate(parts, 1):
            prefix = "/".join(parts[:i])
            parent = parent_key(prefix)
            entries = self.adapter.list_dir(parent)
            by_name = {e.basename: e for e in entries}
            if MARKER_PREFIX + name in by_name:
                rec = self._record(prefix)
                if rec is not None:
                    return Where(record=rec, rel="/".join(parts[i:]))
            for target, source in self._sources_in(entries, parent).items():
                if source == name:
                    return Where(owner=join_key(parent, target), owner_files=prefix)
            parent_dir = entry is not None and entry.is_dir
            entry = by_name.get(name)
            if entry is None or name.startswith(HIDDEN_PREFIX):
                return Where(parent_dir=parent_dir and i == len(parts), depth=i - 1)
            if not entry.is_dir and i < len(parts):
                return Where(depth=i - 1)
        return Where(entry=entry, parent_dir=parent_dir, depth=len(parts))

    def _locate(self, key: str) -> tuple[CommitRecord, str] | None:
        """The committed directory ``key`` is in (or is), with ``key`` relative to it."""
        w = self._walk(key)
        return (w.record, w.rel) if w.record is not None else None

    def _sources_in(self, entries: Iterable[Entry], parent: str) -> dict[str, str]:
        """Committed name -> source name, of the markers among ``entries`` (a listing of
        ``parent``)."""
        out = {}
        for e in entries:
            if not e.is_dir and e.basename.startswith(MARKER_PREFIX):
                rec = self._record(join_key(parent, e.basename[len(MARKER_PREFIX):]))
                if rec is not None:
                    out[base_name(rec.target)] = base_name(rec.source)
        return out

    def _refuse_hidden(self, key: str) -> None:
        if any(p.startswith(HIDDEN_PREFIX) for p in key.split("/")):
            raise ValueError(f"{key}: names starting with {HIDDEN_PREFIX!r} are reserved for "
                             "ckptfs's commit records; choose another name")

    def _refuse_committed(self, key: str, what: str) -> Where:
        """``key``'s `Where`, unless it is inside a committed directory or its files (the
        files of a committed directory stay where they were written, as fixed as the
        committed directory: a second save of a committed step lands there)."""
        w = self._walk(key)
        if w.record is not None:
            raise OSError(errno.EROFS, f"cannot {what} {key}: it is inside the committed "
                          f"checkpoint directory {w.record.target}, whose files are fixed by "
                          "its commit; write to a new directory, or rmdir it first")
        if w.owner is not None:
            raise OSError(errno.EROFS, f"cannot {what} {key}: {w.owner_files} holds the files "
                          f"of the committed checkpoint directory {w.owner}, fixed by its "
                          f"commit; use another name, or rmdir {w.owner} first")
        return w

    # -- writes --------------------------------------------------------------------------------

    def _check_parent(self, key: str) -> None:
        self._refuse_hidden(key)
        w = self._refuse_committed(key, "write")
        if w.entry is not None and w.entry.is_dir:
            raise IsADirectoryError(errno.EISDIR, f"{self.adapter.url}/{key} is a directory")
        if not w.parent_dir:
            raise RuntimeError(f"Parent directory does not exist, create it!: "
                               f"{self.adapter.url}/{parent_key(key)}")

    def stream_write(self, path: Path) -> io.IOBase:
        k = self.key(path)
        self._check_parent(k)
        return HashingWriter(self.adapter, k, self.algorithm, self.block_size)

    def write(self, path: Path, data: Any) -> None:
        with self.stream_write(path) as f:
            f.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        k = self.key(path)
        self._refuse_hidden(k)
        if self._record(k) is not None:
            if not recursive:
                raise FileExistsError(errno.EEXIST, f"{self.remap_path(path)} exists")
            return
        w = self._refuse_committed(k, "create a directory at")
        if w.entry is not None and not w.entry.is_dir:
            raise FileExistsError(errno.EEXIST, f"{self.remap_path(path)} is a file")
        if w.entry is not None:
            if not recursive:
                raise FileExistsError(errno.EEXIST, f"{self.remap_path(path)} exists")
            return
        if not recursive and not w.parent_dir:
            raise FileNotFoundError(errno.ENOENT, f"no parent directory for "
                                    f"{self.remap_path(path)} (use recursive=True)")
        if self.adapter.capabilities.real_directories:
            self.adapter.makedirs(k)
        else:
            parts = k.split("/")
            for i in range(w.depth + 1, len(parts) + 1):  # each new level, so each is listed
                self.adapter.write_bytes(join_key("/".join(parts[:i]), KEEP_NAME), b"")

    def delete(self, path: Path) -> None:
        k = self.key(path)
        self._refuse_hidden(k)
        e = self._refuse_committed(k, "delete").entry
        if e is None or e.is_dir:
            raise FileNotFoundError(errno.ENOENT, f"no file {self.remap_path(path)}")
        self.adapter.delete(k)
        self.adapter.delete(sum_key(k))

    def rmdir(self, path: Path) -> None:
        k = self.key(path)
        self._refuse_hidden(k)
        rec = self._record(k)
        if rec is not None:
            # The marker first: the directory is gone at once, then its files.
            self.adapter.delete(marker_key(k))
            with self._lock:
                self._records.pop(marker_key(k), None)
            parent = parent_key(k)
            others = self._sources_in(self.adapter.list_dir(parent), parent)
            if base_name(rec.source) not in others.values():
                self.adapter.delete_tree(rec.source)
            self.adapter.delete_tree(k)
            return
        e = self._refuse_committed(k, "remove").entry
        if e is None or not e.is_dir:
            raise FileNotFoundError(errno.ENOENT, f"no directory {self.remap_path(path)}")
        with self._lock:
            prefix = k + "/"
            for mk in [m for m in self._records if m.startswith(prefix)]:
                del self._records[mk]
        self.adapter.delete_tree(k)

    # -- rename (the commit) -------------------------------------------------------------------

    def rename(self, src_path: Path, dst_path: Path, is_directory: bool = False,
               background_cleanup: bool = False) -> None:
        del is_directory, background_cleanup  # the kind is read from storage; nothing to clean
        src, dst = self.key(src_path), self.key(dst_path)
        self._refuse_hidden(src)
        self._refuse_hidden(dst)
        if not src or not dst:
            raise OSError(errno.EINVAL, f"cannot rename the storage root {self.adapter.url}")
        src_rec = self._record(src)
        src_kind: str | None = "dir"
        if src_rec is None:
            e = self._refuse_committed(src, "move").entry
            src_kind = None if e is None else "dir" if e.is_dir else "file"
        if src_kind is None:
            raise FileNotFoundError(errno.ENOENT, f"no file or directory "
                                    f"{self.remap_path(src_path)} to rename")
        if self._record(dst) is not None:
            raise _occupied(src, dst, errno.ENOTEMPTY, "it is a committed directory")
        d = self._refuse_committed(dst, "rename onto").entry
        dst_kind = None if d is None else "dir" if d.is_dir else "file"
        if src_kind == "file":
            if dst_kind == "dir":
                raise _occupied(src, dst, errno.EISDIR, "it is a directory")
            self._move_file(src, dst)
            return
        if dst_kind == "file":
            raise _occupied(src, dst, errno.ENOTDIR, "it is a file")
        if dst_kind == "dir" and self.ls(dst_path):
            raise _occupied(src, dst, errno.ENOTEMPTY, "it is a directory with files in it")
        if parent_key(src) != parent_key(dst):
            raise OSError(errno.EXDEV, f"cannot rename directory {src} to {dst}: a committed "
                          "directory must stay in the parent of the directory it was written "
                          "in (its commit marker lives there)")
        if dst == src or dst.startswith(src + "/"):
            raise OSError(errno.EINVAL, f"cannot rename {src} into itself ({dst})")
        if src_rec is not None:
            rec = CommitRecord(dst, src_rec.source, src_rec.block_size, src_rec.files,
                               src_rec.dirs)
            self._create_marker(src, dst, rec)
            self.adapter.delete(marker_key(src))
            with self._lock:
                self._records.pop(marker_key(src), None)
            return
        self._create_marker(src, dst, self._manifest(src, dst))

    def _create_marker(self, src: str, dst: str, rec: CommitRecord) -> None:
        try:
            self.adapter.create_exclusive(marker_key(dst), rec.to_bytes())
        except FileExistsError as exc:
            raise _occupied(src, dst, errno.EEXIST, "another writer committed it first") from exc
        with self._lock:
            self._records[marker_key(dst)] = rec

    def _manifest(self, src: str, dst: str) -> CommitRecord:
        """One listing of ``src``: its files with their sidecars' sums (a file without one, or
        whose size differs, hashed here)."""
        entries = self.adapter.list_tree(src)
        prefix = src + "/"
        data: dict[str, int] = {}
        sums: set[str] = set()
        dirs: set[str] = set()
        for e in entries:
            rel = e.name[len(prefix):] if e.name.startswith(prefix) else e.name
            base = base_name(rel)
            if base.startswith(MARKER_PREFIX):
                raise OSError(errno.EINVAL, f"cannot commit {src} as {dst}: it holds a "
                              f"committed directory ({rel}); commit directories one level deep")
            if base == KEEP_NAME:
                if parent_key(rel):
                    dirs.add(parent_key(rel))
            elif base.startswith(SUM_PREFIX):
                sums.add(join_key(parent_key(rel), base[len(SUM_PREFIX):]))
            elif not base.startswith(HIDDEN_PREFIX):
                data[rel] = e.size
        for rel in data:
            parts = rel.split("/")[:-1]
            dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))

        def one(rel: str) -> tuple[str, FileSum]:
            if rel in sums:
                try:
                    raw = self.adapter.read_bytes(sum_key(join_key(src, rel)))
                    doc = json.loads(raw)
                    s = parse_sum(doc)
                    if doc.get("block_size") == self.block_size and s.size == data[rel]:
                        return rel, s
                except (FileNotFoundError, ValueError, KeyError, TypeError):
                    pass
            return rel, self._hash_file(join_key(src, rel))

        with ThreadPoolExecutor(min(COMMIT_THREADS, max(1, len(data)))) as pool:
            files = dict(pool.map(one, sorted(data)))
        return CommitRecord(dst, src, self.block_size, files, frozenset(dirs))

    def _hash_file(self, key: str) -> FileSum:
        h = BlockHasher(self.algorithm, self.block_size)
        with self.adapter.open_read(key) as f:
            while chunk := f.read(self.block_size):
                h.update(memoryview(chunk))
        return h.result()

    def _move_file(self, src: str, dst: str) -> None:
        self._check_parent(dst)
        with self._reader(src, src) as r, HashingWriter(self.adapter, dst, self.algorithm,
                                                          self.block_size) as w:
            while chunk := r.read(self.block_size):
                w.write(chunk)
        self.adapter.delete(src)
        self.adapter.delete(sum_key(src))

    # -- reads ---------------------------------------------------------------------------------

    def _reader(self, key: str, name: str) -> VerifiedReader:
        w = self._walk(key)
        if w.record is not None:
            s = w.record.files.get(w.rel)
            if s is None:
                raise FileNotFoundError(errno.ENOENT, f"no file {name} in the committed "
                                        f"directory {w.record.target}")
            return VerifiedReader(self.adapter, join_key(w.record.source, w.rel), name, s.size, s,
                                  w.record.block_size)
        e = w.entry
        if e is None or e.is_dir:
            raise FileNotFoundError(errno.ENOENT, f"no file {name}")
        expected, block_size = None, self.block_size
        try:
            doc = json.loads(self.adapter.read_bytes(sum_key(key)))
            expected, block_size = parse_sum(doc), int(doc["block_size"])
        except FileNotFoundError:
            pass  # written by something else, or its writer died before closing it
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{name}: unreadable checksum record ({exc}); "
                                         "delete the file and write it again", path=name) from exc
        if expected is not None and expected.size != e.size:
            raise CorruptCheckpointError(
                f"{name}: {e.size} bytes where {expected.size} were written: the file changed "
                "after it was written; restore it or write it again", path=name)
        return VerifiedReader(self.adapter, key, name, e.size, expected, block_size)

    def _forget(self, key: str) -> bool:
        """Drop the cached markers of ``key``'s levels; whether there were any."""
        parts = key.split("/") if key else []
        with self._lock:
            gone = [self._records.pop(marker_key("/".join(parts[:i])), None)
                    for i in range(1, len(parts) + 1)]
        return any(r is not None for r in gone)

    def _read_all(self, key: str, name: str) -> bytes:
        """The whole file, checked.  A marker read earlier may be stale (another process
        deleted the directory and committed it again): on a failure, once more from storage."""
        try:
            with self._reader(key, name) as reader:
                return reader.readall()
        except (CorruptCheckpointError, FileNotFoundError):
            if not self._forget(key):
                raise
        with self._reader(key, name) as reader:
            return reader.readall()

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        """A seekable stream (``pre_read_full_file``, the default: the whole file, read and
        checked at once); every block is checked before any of its bytes is returned."""
        k = self.key(path)
        if read_args is None or read_args.pre_read_full_file:
            return io.BytesIO(self._read_all(k, self.remap_path(path)))  # type: ignore[return-value]
        return self._reader(k, self.remap_path(path))

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        return self._read_all(self.key(path), self.remap_path(path))

    # -- names ---------------------------------------------------------------------------------

    def ls(self, path: Path) -> list[str]:
        k = self.key(path)
        w = self._walk(k)
        if w.record is not None:
            if w.rel and w.rel not in w.record.dirs:
                raise NotADirectoryError(errno.ENOTDIR, f"{self.remap_path(path)}")
            return w.record.child_names(w.rel)
        if w.entry is None or not w.entry.is_dir:
            raise FileNotFoundError(errno.ENOENT, f"no directory {self.remap_path(path)}")
        entries = self.adapter.list_dir(k)
        committed = self._sources_in(entries, k)
        hidden = set(committed.values())
        names = {e.basename for e in entries
                 if not e.basename.startswith(HIDDEN_PREFIX) and e.basename not in hidden}
        return sorted(names | set(committed))

    def exists(self, path: Path) -> bool:
        w = self._walk(self.key(path))
        if w.record is not None:
            return not w.rel or w.rel in w.record.files or w.rel in w.record.dirs
        return w.entry is not None

    def isdir(self, path: Path) -> bool:
        w = self._walk(self.key(path))
        if w.record is not None:
            return not w.rel or w.rel in w.record.dirs
        return w.entry is not None and w.entry.is_dir

    def getsize(self, path: Path) -> int:
        w = self._walk(self.key(path))
        if w.record is not None:
            s = w.record.files.get(w.rel)
            if s is not None:
                return s.size
        elif w.entry is not None and not w.entry.is_dir:
            return w.entry.size
        raise FileNotFoundError(errno.ENOENT, f"no file {self.remap_path(path)}")

    def committed(self, path: Path) -> CommitRecord | None:
        """The commit record of the directory ``path``, or None if it is not a committed one."""
        return self._record(self.key(path))

    @property
    def mmap_fill_chunk_bytes(self) -> int | None:
        # Whole blocks per ranged read, so that no block is fetched (and checked) twice.
        return self.block_size * 8
