"""Reading committed checkpoints: load with streaming verification, and verify.

Every byte is hashed as it is read, in the same pass that fills the buffer the tensors will view
(no second read); sizes come from the manifest, are bounded, and are checked before anything is
allocated; a mismatch raises :class:`CorruptCheckpointError` naming the file before any state is
returned.  Nothing is unpickled: the tree is msgpack, the tensors safetensors.
"""

from __future__ import annotations

import logging
import mmap as _mmap
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from ckptfs.errors import (
    CorruptCheckpointError,
    LoadOptionError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptfs.format.hashing import (
    HASH_INLINE_BYTES,
    BackgroundHasher,
    Hasher,
    format_digest,
    new_hasher,
    read_chunk_size,
)
from ckptfs.format.layout import MANIFEST_NAME, STATE_NAME
from ckptfs.format.limits import MAX_STATE_DOC_BYTES
from ckptfs.format.manifest import FileEntry
from ckptfs.format.serialize import (
    build_tree,
    decode_state_doc,
    dtype_code,
    tensor_memoryview,
    tensors_from_buffer,
)
from ckptfs.format.sharded import SHARDED_FORMAT_VERSION
from ckptfs.protocol.load_options import (
    KeyPath,
    MapLocation,
    map_tensors,
    parse_keys,
    prune_state,
    prune_tagged,
    selection,
    tensor_map,
    tensor_refs,
)
from ckptfs.protocol.resolve import CheckpointInfo, storage_url
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")

__all__ = ["MapLocation", "VerifyReport", "load_checkpoint", "read_file_verified",
           "verify_checkpoint"]
T = TypeVar("T")


@dataclass
class VerifyReport:
    step: int
    attempt: str
    url: str
    mode: str  # "full" or "quick"
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "attempt": self.attempt, "url": self.url, "mode": self.mode,
                "files": self.files, "bytes": self.bytes, "ok": self.ok,
                "problems": list(self.problems)}


def _links(storage: Storage, info: CheckpointInfo, *relpaths: str) -> list[str]:
    """Which of the step directory, the attempt directory and ``relpaths`` (relative to the
    attempt) are symbolic links, where the adapter can tell (local disk)."""
    is_link = getattr(storage, "is_symlink", None)
    if is_link is None:
        return []
    paths = [info.paths.dir, info.path, *(f"{info.path}/{r}" for r in relpaths)]
    return [p for p in paths if is_link(p)]


def _check_not_link(storage: Storage, info: CheckpointInfo, relpath: str) -> None:
    for p in _links(storage, info, relpath):
        raise UnsafeCheckpointError(
            f"{storage_url(storage, p)} is a symbolic link; a checkpoint may not contain "
            "links (they can point outside it). Refusing to read it", step=info.step, path=p)


class _NullHasher:
    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


_NULL_HASHER: Hasher = _NullHasher()


def read_file_verified(storage: Storage, info: CheckpointInfo, entry: FileEntry, *,
                       verify: bool = True) -> memoryview:
    """Read one manifest file into a buffer of exactly its declared size, hashing as it is read.

    The buffer is allocated uninitialized (``bytearray(n)`` would zero-fill it first: one more
    pass over the whole state, about 20% of a load) and is only returned once every byte of it
    has been read and checked.  The returned view keeps its memory alive.

    Raises :class:`CorruptCheckpointError` (naming the file) if the file is shorter or longer
    than declared or, with ``verify``, its digest differs."""
    _check_not_link(storage, info, entry.path)
    path = f"{info.path}/{entry.path}"
    where = storage_url(storage, path)
    view = tensor_memoryview(torch.empty(entry.size, dtype=torch.uint8))
    hasher = new_hasher(entry.algorithm) if verify else None
    pos = 0
    try:
        # The chunk just read is hashed on a helper thread while the next one is read.
        with BackgroundHasher(hasher or _NULL_HASHER, max_lead=max(entry.size, 1),
                              background=verify and entry.size > HASH_INLINE_BYTES) as bg, \
                storage.open_read(path) as raw:
            f = cast(Any, raw)  # BinaryIO stubs lack readinto
            step = read_chunk_size(entry.size)
            while pos < entry.size:
                n = f.readinto(view[pos:pos + step])
                if not n:
                    break
                if hasher is not None:
                    bg.feed(view[pos:pos + n])
                pos += n
            extra = f.read(1) if pos == entry.size else b""
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: listed in the manifest but missing",
                                     step=info.step, path=path) from None
    if pos != entry.size or extra:
        raise CorruptCheckpointError(
            f"{where}: size differs from the manifest (declared {entry.size} B, found "
            f"{'more' if extra else pos})", step=info.step, path=path)
    if hasher is not None:
        actual = format_digest(entry.algorithm, hasher.hexdigest())
        if actual != entry.digest:
            raise CorruptCheckpointError(
                f"{where}: content digest differs from the manifest (expected {entry.digest}, "
                f"got {actual}): the file was modified or corrupted after commit",
                step=info.step, path=path)
    return view


def _parallel(fn: Callable[[FileEntry], T], items: list[FileEntry], threads: int) -> list[T]:
    if threads <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="ckptfs-io") as pool:
        return list(pool.map(fn, items))


def _check_stored_sizes(storage: Storage, info: CheckpointInfo) -> None:
    """Compare every declared size with the stored object (one listing) before any buffer is
    allocated: a manifest that declares a 1 PiB file must fail as corrupt, not make the reader
    allocate (or try to allocate) what it declares.  A symbolic link anywhere in the attempt
    (local disk) is refused; files the manifest does not list are not read, and are logged
    (``verify`` reports them as stray)."""
    prefix = info.path + "/"
    listing = [e for e in storage.list_tree(info.path) if e.name.startswith(prefix)]
    for e in listing:
        if e.is_link:
            raise UnsafeCheckpointError(
                f"{storage_url(storage, e.name)} is a symbolic link; a checkpoint may not "
                "contain links (they can point outside it). Refusing to read it",
                step=info.step, path=e.name)
    found = {e.name[len(prefix):]: e.size for e in listing}
    strays = sorted(set(found) - {f.path for f in info.manifest.files} - {MANIFEST_NAME})
    if strays:
        log.warning("%s: files not in the manifest are ignored by load (run 'ckptfs verify' "
                    "to report them): %s", info.url, ", ".join(strays[:10]))
    for entry in info.manifest.files:
        size = found.get(entry.path)
        path = prefix + entry.path
        if size is None:
            raise CorruptCheckpointError(
                f"{storage_url(storage, path)}: listed in the manifest but missing",
                step=info.step, path=path)
        if size != entry.size:
            raise CorruptCheckpointError(
                f"{storage_url(storage, path)}: size differs from the manifest (declared "
                f"{entry.size} B, found {size} B)", step=info.step, path=path)


def map_file_verified(storage: Storage, info: CheckpointInfo, entry: FileEntry, *,
                      verify: bool = True) -> memoryview:
    """Memory-map one manifest file of a local-disk checkpoint (copy-on-write: writing to a
    tensor never changes the file) and, with ``verify``, hash every byte of the mapping and
    compare with the manifest before returning.  The mapping lives as long as a view of it."""
    _check_not_link(storage, info, entry.path)
    path = f"{info.path}/{entry.path}"
    where = storage_url(storage, path)
    local = cast(Any, storage).full(path)
    try:
        fd = os.open(local, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: listed in the manifest but missing",
                                     step=info.step, path=path) from None
    except OSError as exc:
        raise StorageError(f"{where}: cannot open for mapping: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size != entry.size:
            raise CorruptCheckpointError(
                f"{where}: size differs from the manifest (declared {entry.size} B, found "
                f"{size} B)", step=info.step, path=path)
        if size == 0:
            return memoryview(b"")
        try:
            mapping = _mmap.mmap(fd, size, access=_mmap.ACCESS_COPY)
        except OSError as exc:
            raise StorageError(f"{where}: cannot memory-map: {exc}") from exc
    finally:
        os.close(fd)
    view = memoryview(mapping)
    if verify:
        hasher = new_hasher(entry.algorithm)
        step = read_chunk_size(size)
        for pos in range(0, size, step):
            hasher.update(view[pos:pos + step])
        actual = format_digest(entry.algorithm, hasher.hexdigest())
        if actual != entry.digest:
            raise CorruptCheckpointError(
                f"{where}: content digest differs from the manifest (expected {entry.digest}, "
                f"got {actual}): the file was modified or corrupted after commit",
                step=info.step, path=path)
    return view


def _check_mmap_storage(storage: Storage, info: CheckpointInfo) -> None:
    if storage.capabilities.protocol != "file" or not callable(getattr(storage, "full", None)):
        raise LoadOptionError(
            f"{info.url}: mmap=True maps files of a local-disk checkpoint; this store is "
            f"{storage.capabilities.protocol}://. Load without mmap (or copy the checkpoint to "
            "local disk first: ckptfs cp)")
    if info.manifest.format_version == SHARDED_FORMAT_VERSION:
        raise LoadOptionError(
            f"{info.url}: mmap=True is supported for format v1 checkpoints; this one is "
            "sharded (format v2, docs/sharded.md): load it without mmap")


def load_checkpoint(storage: Storage, info: CheckpointInfo, *, verify: bool = True,
                    map_location: MapLocation = None, threads: int = 4,
                    keys: Iterable[str | KeyPath] | None = None,
                    mmap: bool = False) -> dict[Any, Any]:
    """Load a committed checkpoint (docs/loading.md).

    ``keys``: load only these key paths (format v1 reads and verifies only ``state.msgpack``
    and the tensor files holding the selected tensors; format v2 loads everything, then
    selects).  ``map_location``: as ``torch.load``.  ``mmap``: local disk, format v1: tensors
    view copy-on-write mappings of the files instead of buffers read into memory."""
    mapper = tensor_map(map_location)  # bad options fail before any I/O
    paths = parse_keys(keys)
    if mmap:
        _check_mmap_storage(storage, info)
    if info.manifest.format_version == SHARDED_FORMAT_VERSION:
        from ckptfs.protocol.sharded import load_full  # format v2: ranks' files, DCP metadata
        state = load_full(storage, info, verify=verify, threads=threads)
        if paths is not None:
            state = prune_state(state, selection(paths), info.url)
        return cast(dict[Any, Any], map_tensors(state, mapper)) if mapper else state
    manifest = info.manifest
    by_path = {e.path: e for e in manifest.files}
    state_entry = by_path.get(STATE_NAME)
    where = storage_url(storage, f"{info.path}/{STATE_NAME}")
    if state_entry is None:
        raise CorruptCheckpointError(f"{info.url}: manifest lists no {STATE_NAME}",
                                     step=info.step)
    if state_entry.size > MAX_STATE_DOC_BYTES:
        raise UnsafeCheckpointError(f"{where}: declared size {state_entry.size} exceeds "
                                    f"{MAX_STATE_DOC_BYTES} B", step=info.step)
    _check_stored_sizes(storage, info)
    doc = read_file_verified(storage, info, state_entry, verify=verify)
    tree, slots = decode_state_doc(bytes(doc), where=where)
    del doc

    if paths is None:
        wanted = list(range(len(slots)))
    else:
        tree = prune_tagged(tree, selection(paths),
                            lambda k: build_tree(k, [], where=where), info.url)
        wanted = sorted(i for i in tensor_refs(tree, set()) if 0 <= i < len(slots))
    needed = sorted({slots[i].file for i in wanted})
    missing = [n for n in needed if n not in by_path]
    if missing:
        raise CorruptCheckpointError(f"{info.url}: state references files not in the manifest: "
                                     f"{missing}", step=info.step)

    read = map_file_verified if mmap else read_file_verified

    def load_file(entry: FileEntry) -> dict[str, torch.Tensor]:
        buf = read(storage, info, entry, verify=verify)
        return tensors_from_buffer(buf, where=storage_url(storage, f"{info.path}/{entry.path}"))

    loaded = dict(zip(needed, _parallel(load_file, [by_path[n] for n in needed], threads),
                      strict=True))
    unselected = torch.empty(0)  # never reached: the pruned tree does not reference it
    tensors: list[torch.Tensor] = [unselected] * len(slots)
    for i in wanted:
        slot = slots[i]
        t = loaded[slot.file].get(slot.name)
        if t is None or tuple(t.shape) != slot.shape or dtype_code(t.dtype) != slot.dtype:
            raise CorruptCheckpointError(
                f"{info.url}/{slot.file}: tensor {slot.name!r} is missing or differs from the "
                "state document", step=info.step)
        tensors[i] = mapper(t) if mapper is not None else t
    state = build_tree(tree, tensors, where=where)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where}: the state root is not a dict", step=info.step)
    return state


def verify_checkpoint(storage: Storage, info: CheckpointInfo, *, quick: bool = False,
                      threads: int = 4) -> VerifyReport:
    """Check a committed checkpoint against its manifest.

    quick: names and sizes from one listing of the attempt directory (missing, extra, resized
    files).  full: also re-reads and re-hashes every file.  Problems are collected (all of them,
    naming each file) in the report; the caller decides whether to raise."""
    if info.manifest.format_version == SHARDED_FORMAT_VERSION:
        from ckptfs.protocol.sharded import verify_sharded  # chunk digests, not file digests
        return verify_sharded(storage, info, quick=quick, threads=threads)
    report = VerifyReport(info.step, info.attempt, info.url, "quick" if quick else "full")
    listing = {e.name: e for e in storage.list_tree(info.path)}
    prefix = info.path + "/"
    for p in _links(storage, info):
        report.problems.append(f"{storage_url(storage, p)}: symbolic link (refused)")
    for name, e in sorted(listing.items()):
        if e.is_link:
            report.problems.append(f"{name[len(prefix):]}: symbolic link (refused)")
    found = {name[len(prefix):]: e.size for name, e in listing.items()
             if name.startswith(prefix) and not e.is_link}
    found.pop(MANIFEST_NAME, None)
    for entry in info.manifest.files:
        size = found.pop(entry.path, None)
        if size is None:
            report.problems.append(f"{entry.path}: missing")
        elif size != entry.size:
            report.problems.append(f"{entry.path}: size {size} B, manifest says {entry.size} B")
    for stray in sorted(found):
        report.problems.append(f"{stray}: not in the manifest (stray file)")
    report.files = len(info.manifest.files)
    report.bytes = info.manifest.total_bytes
    if quick:
        return report

    def check(entry: FileEntry) -> str | None:
        try:
            read_file_verified(storage, info, entry, verify=True)
        except CorruptCheckpointError as exc:
            return f"{entry.path}: {exc}"
        return None

    already = {p.split(":", 1)[0] for p in report.problems}
    todo = [e for e in info.manifest.files if e.path not in already]
    for problem in _parallel(check, todo, threads):
        if problem:
            report.problems.append(problem)
    return report
