"""A torch_checkpointing ``Storage`` over any URL ckptfs reaches, committed by a marker.

meta-pytorch's torch_checkpointing (the "DCPv2" torchtitan's ``TorchCheckpointingManager``
drives) writes every rank's files under ``tmp_<name>``, rank 0 adds ``metadata.pkl``, and the
save is committed by ``Storage.rename(tmp_<name>, <name>, is_directory=True)``.  Its only
backend is the local filesystem, it hashes nothing, and on an object store a directory rename
is a copy of every object followed by deletes: a job killed half way leaves ``<name>`` holding
some of the files (``metadata.pkl`` among them, possibly), which step discovery accepts.

`CkptfsStorage` keeps the files where they were written and makes the rename one request:

* **The commit is an exclusive marker.**  ``rename(<parent>/tmp_x, <parent>/x,
  is_directory=True)`` lists ``tmp_x`` once and creates ``<parent>/.ckptfs-commit.x`` with
  ckptfs's exclusive create (``O_EXCL``/``link`` on disk, ``If-None-Match: *`` on S3 and
  Azure, ``ifGenerationMatch=0`` on GCS, a lock in the process for ``memory://``).  The
  marker names the source directory and is the manifest of the committed directory: every
  file's size and content digests.  It is O(1) in the size of the checkpoint and atomic on
  every backend: before it exists, ``x`` does not; after, all of ``x`` does.  An occupied
  destination (a committed ``x``, a file, a directory with anything in it) raises
  ``FileExistsError`` and is never merged into, as the ``Storage.rename`` contract requires;
  two jobs committing the same name race on the marker and exactly one wins.
* **``x`` is a logical directory.**  Its listing, ``exists``, ``isdir``, ``getsize`` come from
  the marker (its manifest, immutable, cached once read); its files are read from the source
  directory.  ``ls(<parent>)`` shows ``x`` and hides ``tmp_x``; an uncommitted ``tmp_y`` (a
  job killed before its commit) stays visible under its own name, so torchtitan's retention
  deletes it, and a committed ``x`` is never half there.  Committed files are immutable:
  writing or deleting inside ``x`` raises; ``rmdir(x)`` deletes the marker first (``x`` is
  gone at once), then the source's files.
* **Content is hashed while written and verified when read.**  Each stream written through
  this storage records its size and the digests of its blocks (`DEFAULT_BLOCK_SIZE`, ckptfs's
  `DEFAULT_ALGORITHM`) in a small sidecar (``.ckptfs-sum.<file>``) when it closes, so rank
  N's files are hashed by rank N from bytes already in memory; the commit copies the sidecars
  into the marker (a file without one, or whose size changed, is hashed there).  Every read,
  whole or ranged (``seek`` + ``readinto``, as torch_checkpointing's resharder and parallel
  mmap fill do), fetches whole blocks and checks each against its digest before returning a
  byte: a flipped byte raises `ckptfs.errors.CorruptCheckpointError` naming the file.

Layout under the storage's root URL (``.ckptfs-*`` names are never listed)::

    outputs/checkpoint/
      .ckptfs-commit.step-10      # marker: {"source": "outputs/checkpoint/tmp_step-10", files}
      tmp_step-10/                # the files of step-10 (hidden: committed as step-10)
        metadata.pkl  model_0.pt  .ckptfs-sum.metadata.pkl  .ckptfs-sum.model_0.pt
      tmp_step-20/                # a save killed before its commit: visible, not a step
        model_0.pt  .ckptfs-sum.model_0.pt

Paths: torch_checkpointing passes ``pathlib.Path`` objects, which cannot hold a URL
(``Path("s3://b/x")`` is ``s3:/b/x``), so paths are names under the root URL: a relative path
is relative to the URL; an absolute path is accepted under ``mount`` (a local prefix that
stands for the URL, e.g. the directory a job would have used on disk) and refused otherwise.
``remap_path`` gives the URL a path stands for.

Costs and limits: each operation on a path that is not inside a committed directory already
seen lists each level of the path once (markers live in their parent's listing; a marker read
is cached, it never changes): on S3 (moto) one save of a tiny model by
``CheckpointManager`` with four files under ``outputs/checkpoint/tmp_step-N`` took about 28
listings, 5 to 7 small writes and 9 small reads besides the files; its commit is one of them.
A directory rename must stay in its parent directory (torch_checkpointing's always does) so
that the source is hidden by the same listing that shows the destination; a file rename copies
the file; deleting a directory that holds the source of a committed directory elsewhere is not
detected.  See docs/integrations.md for the wiring into torchtitan.
"""

from __future__ import annotations

import errno
import io
import json
import os
import posixpath
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from ckptfs.errors import CheckpointExistsError, CorruptCheckpointError
from ckptfs.format.hashing import DEFAULT_ALGORITHM, new_hasher
from ckptfs.storage.base import Entry, read_range
from ckptfs.storage.base import Storage as CkptfsAdapter
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.storage.retry import RetryingStorage

try:
    from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ckptfs.torch_checkpointing needs the torch-checkpointing package (which needs "
        'torch>=2.11): pip install "ckptfs[torch-checkpointing]"') from exc

__all__ = ["DEFAULT_BLOCK_SIZE", "CkptfsStorage", "CkptfsStorageConfig", "CommitRecord"]

#: Names this storage keeps beside the user's files; never listed, never writable by callers.
HIDDEN_PREFIX = ".ckptfs-"
MARKER_PREFIX = ".ckptfs-commit."
SUM_PREFIX = ".ckptfs-sum."
KEEP_NAME = ".ckptfs-dir"
MARKER_FORMAT = "ckptfs-torch-checkpointing-commit"
SUM_FORMAT = "ckptfs-torch-checkpointing-sum"
FORMAT_VERSION = 1
#: Digests are kept per block of this many bytes, so a ranged read checks only the blocks it
#: touches.
DEFAULT_BLOCK_SIZE = 8 * 1024 * 1024
#: Threads reading sidecars at a commit.
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


@dataclass(frozen=True)
class FileSum:
    """A file's size and the digests of its blocks (``"algorithm:hex"`` each)."""

    size: int
    blocks: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "blocks": list(self.blocks)}


@dataclass(frozen=True)
class CommitRecord:
    """A committed logical directory: the marker's content."""

    target: str              # the logical directory, relative to the root
    source: str              # where its files are
    block_size: int
    files: dict[str, FileSum]  # relative to the directory
    dirs: frozenset[str]       # every subdirectory (relative), "" excluded

    def to_bytes(self) -> bytes:
        doc = {"format": MARKER_FORMAT, "version": FORMAT_VERSION, "target": self.target,
               "source": self.source, "block_size": self.block_size,
               "files": {k: v.to_json() for k, v in sorted(self.files.items())},
               "dirs": sorted(self.dirs)}
        return json.dumps(doc, sort_keys=True).encode()

    @staticmethod
    def parse(data: bytes, where: str) -> CommitRecord:
        try:
            doc = json.loads(data)
            if doc.get("format") != MARKER_FORMAT or doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
            files = {str(k): _parse_sum(v) for k, v in doc["files"].items()}
            return CommitRecord(str(doc["target"]), str(doc["source"]), int(doc["block_size"]),
                                files, frozenset(str(d) for d in doc["dirs"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"{where}: unreadable commit marker ({exc}); the committed directory cannot "
                "be trusted: delete it (rmdir) and save again", path=where) from exc

    def child_names(self, rel: str) -> list[str]:
        prefix = rel + "/" if rel else ""
        names = {p[len(prefix):].split("/", 1)[0]
                 for p in (*self.files, *self.dirs) if p.startswith(prefix) and p != rel}
        return sorted(n for n in names if n)


def _parse_sum(v: Any) -> FileSum:
    return FileSum(int(v["size"]), tuple(str(b) for b in v["blocks"]))


def _parent(key: str) -> str:
    return key.rsplit("/", 1)[0] if "/" in key else ""


def _base(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _join(a: str, b: str) -> str:
    return f"{a}/{b}" if a and b else (a or b)


def _marker_key(key: str) -> str:
    return _join(_parent(key), MARKER_PREFIX + _base(key))


def _sum_key(key: str) -> str:
    return _join(_parent(key), SUM_PREFIX + _base(key))


def _occupied(src: str, dst: str, code: int, why: str) -> FileExistsError:
    return CheckpointExistsError(
        code, f"refusing to rename {src} onto {dst}: {why}; a rename commits onto unoccupied "
        "space and never merges or overwrites (delete the destination first if it is meant "
        "to be replaced)")


class BlockHasher:
    """Digests of consecutive ``block_size`` blocks of a stream of bytes."""

    def __init__(self, algorithm: str, block_size: int) -> None:
        self.algorithm, self.block_size = algorithm, block_size
        self.blocks: list[str] = []
        self.size = 0
        self._h = new_hasher(algorithm)
        self._fill = 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.block_size - self._fill)
            self._h.update(data[:take])
            self._fill += take
            self.size += take
            data = data[take:]
            if self._fill == self.block_size:
                self._finish_block()

    def _finish_block(self) -> None:
        self.blocks.append(f"{self.algorithm}:{self._h.hexdigest()}")
        self._h = new_hasher(self.algorithm)
        self._fill = 0

    def result(self) -> FileSum:
        if self._fill:
            self._finish_block()
        return FileSum(self.size, tuple(self.blocks))


def _view(data: Any) -> memoryview:
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1 or view.format != "B":
        view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    return view


class HashingWriter(io.RawIOBase):
    """A write stream that hashes what it passes on and, closed cleanly, records the file's
    sidecar.  Leaving its ``with`` block by an exception aborts the upload where the backend
    can and records nothing."""

    def __init__(self, owner: CkptfsStorage, key: str) -> None:
        super().__init__()
        self._owner, self._key = owner, key
        self._hasher = BlockHasher(owner.algorithm, owner.block_size)
        self._stack = ExitStack()
        self._file: BinaryIO = self._stack.enter_context(owner.adapter.open_write(key))
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._done:
            raise ValueError(f"write to closed stream {self._key}")
        view = _view(data)
        self._hasher.update(view)
        self._file.write(view)
        return len(view)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._stack.close()
            self._owner.adapter.write_bytes(_sum_key(self._key), _sum_bytes(self._hasher.result(),
                                                                            self._owner))
        super().close()

    def abort(self, exc: BaseException) -> None:
        if not self._done:
            self._done = True
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
        super().close()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self.abort(exc)
        else:
            self.close()


def _sum_bytes(s: FileSum, owner: CkptfsStorage) -> bytes:
    return json.dumps({"format": SUM_FORMAT, "version": FORMAT_VERSION,
                       "block_size": owner.block_size, **s.to_json()}).encode()


class VerifiedReader(io.RawIOBase):
    """A seekable reader of one file that fetches whole blocks and checks each against its
    digest before handing out any of its bytes (``expected`` None: unverified ranged reads)."""

    def __init__(self, adapter: CkptfsAdapter, key: str, name: str, size: int,
                 expected: FileSum | None, block_size: int) -> None:
        super().__init__()
        self._adapter, self._key, self._name = adapter, key, name
        self._size, self._expected, self._block_size = size, expected, block_size
        self._pos = 0
        self._block: tuple[int, bytes] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, f"negative seek position in {self._name}")
        self._pos = base + offset
        return self._pos

    def _get_block(self, index: int) -> bytes:
        if self._block is not None and self._block[0] == index:
            return self._block[1]
        start = index * self._block_size
        length = min(self._block_size, self._size - start)
        data = read_range(self._adapter, self._key, start, length)
        if len(data) != length:
            raise CorruptCheckpointError(
                f"{self._name}: {len(data)} bytes at offset {start} where {length} were "
                f"recorded (the file is {self._size} bytes): it was truncated or replaced "
                "after it was written; restore it or delete the checkpoint", path=self._name)
        if self._expected is not None:
            algorithm, _, digest = self._expected.blocks[index].partition(":")
            h = new_hasher(algorithm)
            h.update(data)
            if h.hexdigest() != digest:
                raise CorruptCheckpointError(
                    f"{self._name}: bytes {start}-{start + length - 1} do not match the digest "
                    "recorded when it was written (the file changed after it was written); "
                    "restore it or delete the checkpoint", path=self._name)
        self._block = (index, data)
        return data

    def readinto(self, buffer: Any) -> int:
        # The views are released even when a block is refused: the caller may close the
        # buffer (an mmap) while the exception propagates.
        with memoryview(buffer) as view, view.cast("B") as out:
            return self._readinto(out)

    def _readinto(self, out: memoryview) -> int:
        done = 0
        while done < len(out) and self._pos < self._size:
            index, offset = divmod(self._pos, self._block_size)
            block = self._get_block(index)
            n = min(len(out) - done, len(block) - offset)
            out[done:done + n] = block[offset:offset + n]
            done += n
            self._pos += n
        return done

    def readall(self) -> bytes:
        chunks = []
        while self._pos < self._size:
            index, offset = divmod(self._pos, self._block_size)
            block = self._get_block(index)
            chunks.append(block[offset:])
            self._pos += len(block) - offset
            self._block = None
        return b"".join(chunks)


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
    """torch_checkpointing's ``Storage`` over a ckptfs storage adapter (see the module
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
        mk = _marker_key(logical)
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
                cached = self._records.get(_marker_key("/".join(parts[:i])))
                if cached is not None:
                    return Where(record=cached, rel="/".join(parts[i:]))
        entry: Entry | None = Entry("", 0, True)
        parent_dir = True
        for i, name in enumerate(parts, 1):
            prefix = "/".join(parts[:i])
            parent = _parent(prefix)
            entries = self.adapter.list_dir(parent)
            by_name = {e.basename: e for e in entries}
            if MARKER_PREFIX + name in by_name:
                rec = self._record(prefix)
                if rec is not None:
                    return Where(record=rec, rel="/".join(parts[i:]))
            for target, source in self._sources_in(entries, parent).items():
                if source == name:
                    return Where(owner=_join(parent, target), owner_files=prefix)
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
                rec = self._record(_join(parent, e.basename[len(MARKER_PREFIX):]))
                if rec is not None:
                    out[_base(rec.target)] = _base(rec.source)
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
                               f"{self.adapter.url}/{_parent(key)}")

    def stream_write(self, path: Path) -> io.IOBase:
        k = self.key(path)
        self._check_parent(k)
        return HashingWriter(self, k)

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
                self.adapter.write_bytes(_join("/".join(parts[:i]), KEEP_NAME), b"")

    def delete(self, path: Path) -> None:
        k = self.key(path)
        self._refuse_hidden(k)
        e = self._refuse_committed(k, "delete").entry
        if e is None or e.is_dir:
            raise FileNotFoundError(errno.ENOENT, f"no file {self.remap_path(path)}")
        self.adapter.delete(k)
        self.adapter.delete(_sum_key(k))

    def rmdir(self, path: Path) -> None:
        k = self.key(path)
        self._refuse_hidden(k)
        rec = self._record(k)
        if rec is not None:
            # The marker first: the directory is gone at once, then its files.
            self.adapter.delete(_marker_key(k))
            with self._lock:
                self._records.pop(_marker_key(k), None)
            parent = _parent(k)
            others = self._sources_in(self.adapter.list_dir(parent), parent)
            if _base(rec.source) not in others.values():
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
        if _parent(src) != _parent(dst):
            raise OSError(errno.EXDEV, f"cannot rename directory {src} to {dst}: a committed "
                          "directory must stay in the parent of the directory it was written "
                          "in (its commit marker lives there)")
        if dst == src or dst.startswith(src + "/"):
            raise OSError(errno.EINVAL, f"cannot rename {src} into itself ({dst})")
        if src_rec is not None:
            rec = CommitRecord(dst, src_rec.source, src_rec.block_size, src_rec.files,
                               src_rec.dirs)
            self._create_marker(src, dst, rec)
            self.adapter.delete(_marker_key(src))
            with self._lock:
                self._records.pop(_marker_key(src), None)
            return
        self._create_marker(src, dst, self._manifest(src, dst))

    def _create_marker(self, src: str, dst: str, rec: CommitRecord) -> None:
        try:
            self.adapter.create_exclusive(_marker_key(dst), rec.to_bytes())
        except FileExistsError as exc:
            raise _occupied(src, dst, errno.EEXIST, "another writer committed it first") from exc
        with self._lock:
            self._records[_marker_key(dst)] = rec

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
            base = _base(rel)
            if base.startswith(MARKER_PREFIX):
                raise OSError(errno.EINVAL, f"cannot commit {src} as {dst}: it holds a "
                              f"committed directory ({rel}); commit directories one level deep")
            if base == KEEP_NAME:
                if _parent(rel):
                    dirs.add(_parent(rel))
            elif base.startswith(SUM_PREFIX):
                sums.add(_join(_parent(rel), base[len(SUM_PREFIX):]))
            elif not base.startswith(HIDDEN_PREFIX):
                data[rel] = e.size
        for rel in data:
            parts = rel.split("/")[:-1]
            dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))

        def one(rel: str) -> tuple[str, FileSum]:
            if rel in sums:
                try:
                    raw = self.adapter.read_bytes(_sum_key(_join(src, rel)))
                    doc = json.loads(raw)
                    s = _parse_sum(doc)
                    if doc.get("block_size") == self.block_size and s.size == data[rel]:
                        return rel, s
                except (FileNotFoundError, ValueError, KeyError, TypeError):
                    pass
            return rel, self._hash_file(_join(src, rel))

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
        with self._reader(src, src) as r, HashingWriter(self, dst) as w:
            while chunk := r.read(self.block_size):
                w.write(chunk)
        self.adapter.delete(src)
        self.adapter.delete(_sum_key(src))

    # -- reads ---------------------------------------------------------------------------------

    def _reader(self, key: str, name: str) -> VerifiedReader:
        w = self._walk(key)
        if w.record is not None:
            s = w.record.files.get(w.rel)
            if s is None:
                raise FileNotFoundError(errno.ENOENT, f"no file {name} in the committed "
                                        f"directory {w.record.target}")
            return VerifiedReader(self.adapter, _join(w.record.source, w.rel), name, s.size, s,
                                  w.record.block_size)
        e = w.entry
        if e is None or e.is_dir:
            raise FileNotFoundError(errno.ENOENT, f"no file {name}")
        expected, block_size = None, self.block_size
        try:
            doc = json.loads(self.adapter.read_bytes(_sum_key(key)))
            expected, block_size = _parse_sum(doc), int(doc["block_size"])
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
            gone = [self._records.pop(_marker_key("/".join(parts[:i])), None)
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
