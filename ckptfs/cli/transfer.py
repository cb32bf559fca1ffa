"""Copying a committed checkpoint to another store (``ckptfs cp``), under the commit protocol.

Design decision: **a copy is a new save of the same bytes, not a file transfer.**  It takes a
fresh attempt name at the destination (never the source's: an interrupted earlier copy, or a
concurrent one, can then never share a path with this one), streams every file from the source
while hashing it, and refuses a file whose size or digest differs from the source's manifest
before anything is committed.  Then it writes the source manifest with only ``attempt``
changed (files, digests, metadata, ``created`` are the source's) and creates the marker
*last*, exclusively, exactly as :mod:`ckptfs.protocol.commit` does, so a copy is either
committed whole or absent.  A destination step that is already committed is left alone: the
copy succeeds only if it holds the same content (same files with the same digests, same
metadata), else :class:`~ckptfs.errors.CheckpointExistsError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from ckptfs.errors import CheckpointExistsError, CorruptCheckpointError, UnsafeCheckpointError
from ckptfs.format.hashing import Hasher, format_digest, new_hasher
from ckptfs.format.layout import CHECKPOINTS_DIR, MANIFEST_NAME, StepPaths, new_attempt_name
from ckptfs.format.manifest import MARKER_DIGEST_ALGORITHM, FileEntry, Manifest, Marker
from ckptfs.format.sharded import ChunkedFileEntry, chunk_list_digest
from ckptfs.protocol.resolve import (
    CheckpointInfo,
    find_step_dir,
    read_committed,
    read_marker,
    storage_url,
)
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")

COPY_CHUNK = 8 * 1024 * 1024
Progress = Callable[[int], None]


@dataclasses.dataclass
class CopyResult:
    step: int
    status: str  # "copied" or "identical" (already committed there with the same content)
    attempt: str
    files: int
    bytes: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def same_content(a: Manifest, b: Manifest) -> bool:
    """Same step, files (paths, sizes, digests, chunks) and metadata: the same checkpoint,
    whatever attempt name or time either copy has."""
    def files(m: Manifest) -> list[tuple[Any, ...]]:
        return sorted((e.path, e.size, e.digest, getattr(e, "chunks", ())) for e in m.files)

    return (a.step == b.step and a.format_version == b.format_version
            and files(a) == files(b) and a.metadata == b.metadata)


def copy_step(src: Storage, dst: Storage, step: int, *, durable: bool = True, threads: int = 4,
              progress: Progress | None = None) -> CopyResult:
    """Copy the committed ``step`` of ``src`` to ``dst`` (see the module docstring)."""
    info = read_committed(src, step)
    mbytes = src.read_bytes(info.paths.manifest(info.attempt))
    info.marker.check_manifest(mbytes, where=storage_url(src, info.paths.manifest(info.attempt)))
    manifest = info.manifest

    existing = _committed_at(dst, step)
    if existing is not None:
        if same_content(existing.manifest, manifest):
            return CopyResult(step, "identical", existing.attempt, len(manifest.files),
                              manifest.total_bytes)
        raise CheckpointExistsError(
            f"step {step} is already committed at {storage_url(dst, existing.paths.dir)} with "
            f"different content than {info.url}; a committed checkpoint is never overwritten: "
            f"delete it first ('ckptfs prune' or store.delete({step})) or copy to another run "
            "root")

    _check_source_listing(src, info)
    attempt = new_attempt_name()
    paths = StepPaths(step)
    final_dir = paths.attempt_dir(attempt)
    caps = dst.capabilities
    write_dir = paths.tmp_attempt_dir(attempt) if caps.atomic_rename else final_dir
    sync = durable and caps.fsync
    new_manifest = dataclasses.replace(manifest, attempt=attempt)
    new_mbytes = new_manifest.to_bytes()
    try:
        dst.makedirs(write_dir)
        if sync:
            dst.sync_dir("")
            dst.sync_dir(CHECKPOINTS_DIR)
            dst.sync_dir(paths.dir)

        def one(entry: FileEntry) -> None:
            _copy_file_retrying(src, dst, info, entry, f"{write_dir}/{entry.path}", sync,
                                progress)

        entries = sorted(manifest.files, key=lambda e: -e.size)
        if threads > 1 and len(entries) > 1:
            with ThreadPoolExecutor(min(threads, len(entries)),
                                    thread_name_prefix="ckptfs-cp") as pool:
                for fut in [pool.submit(one, e) for e in entries]:
                    fut.result()
        else:
            for e in entries:
                one(e)
        dst.write_bytes(f"{write_dir}/{MANIFEST_NAME}", new_mbytes)
        if sync:
            dst.sync_dir(write_dir)
        if caps.atomic_rename:
            dst.rename_dir(write_dir, final_dir)
            if sync:
                dst.sync_dir(paths.dir)
    except BaseException:
        _discard(dst, write_dir, final_dir)
        raise
    marker = Marker(step, attempt, format_digest(
        MARKER_DIGEST_ALGORITHM, hashlib.sha256(new_mbytes).hexdigest()), len(new_mbytes),
        info.marker.created, {"host": socket.gethostname(), "pid": os.getpid(),
                              "copied_from": info.url}, info.marker.format_version)
    try:
        dst.create_exclusive(paths.marker, marker.to_bytes())
    except BaseException:
        winner = _committed_at(dst, step, quiet=True)
        if winner is not None and winner.attempt == attempt:
            pass  # a retried request whose first try succeeded
        elif winner is not None and same_content(winner.manifest, manifest):
            _discard(dst, final_dir)  # an identical copy committed first
            return CopyResult(step, "identical", winner.attempt, len(manifest.files),
                              manifest.total_bytes)
        elif winner is not None:
            _discard(dst, final_dir)
            raise CheckpointExistsError(
                f"step {step} at {storage_url(dst, paths.dir)} was committed by another writer "
                "while this copy was running; the copy was discarded") from None
        else:
            raise  # unknown outcome: keep the attempt (a marker may still name it); GC collects
    log.info("copied step %d from %s to %s", step, src.url, dst.url)
    return CopyResult(step, "copied", attempt, len(manifest.files), manifest.total_bytes)


def _committed_at(storage: Storage, step: int, *, quiet: bool = False) -> CheckpointInfo | None:
    name = find_step_dir(storage, step)
    if name is None:
        return None
    try:
        if read_marker(storage, step, name) is None:
            return None
        return read_committed(storage, step, name)
    except Exception:
        if quiet:
            return None
        raise


def _check_source_listing(src: Storage, info: CheckpointInfo) -> None:
    """Like a load: every listed file present with its declared size (so nothing is read for a
    size the storage does not hold), and no symbolic link anywhere (local disk)."""
    prefix = info.path + "/"
    is_link = getattr(src, "is_symlink", None)
    dirs = [info.paths.dir, info.path] if is_link is not None else []
    listing = [e for e in src.list_tree(info.path) if e.name.startswith(prefix)]
    links = [d for d in dirs if is_link is not None and is_link(d)]
    links += [e.name for e in listing if e.is_link]
    if links:
        raise UnsafeCheckpointError(
            f"{storage_url(src, links[0])} is a symbolic link; a checkpoint may not contain "
            "links. Refusing to copy it", step=info.step, path=links[0])
    found = {e.name[len(prefix):]: e.size for e in listing}
    for entry in info.manifest.files:
        if found.get(entry.path) != entry.size:
            raise CorruptCheckpointError(
                f"{storage_url(src, prefix + entry.path)}: "
                + ("listed in the manifest but missing" if entry.path not in found else
                   f"size differs from the manifest (declared {entry.size} B, found "
                   f"{found[entry.path]} B)"), step=info.step, path=prefix + entry.path)


def _copy_file_retrying(src: Storage, dst: Storage, info: CheckpointInfo, entry: FileEntry,
                        target: str, sync: bool, progress: Progress | None) -> None:
    def run() -> None:
        _copy_file(src, dst, info, entry, target, sync, progress)

    retry = getattr(dst, "retry_call", None)
    if retry is None:
        run()
    else:
        retry("write", target, run)


class _Verifier:
    """Hashes a file as it streams past: the whole file (format v1) or each chunk (v2)."""

    def __init__(self, entry: FileEntry) -> None:
        self.entry = entry
        self.chunks = entry.chunks if isinstance(entry, ChunkedFileEntry) else None
        self.index = 0
        self.left = self.chunks[0].length if self.chunks else 0
        self.hexes: list[str] = []
        self.hasher: Hasher = new_hasher(entry.algorithm)

    def update(self, data: memoryview) -> None:
        if self.chunks is None:
            self.hasher.update(data)
            return
        while len(data):
            while self.left == 0 and self.index < len(self.chunks):
                self._close_chunk()
            if self.index >= len(self.chunks):
                return  # more bytes than the chunks cover: the size check reports it
            n = min(self.left, len(data))
            self.hasher.update(data[:n])
            data, self.left = data[n:], self.left - n

    def _close_chunk(self) -> None:
        assert self.chunks is not None
        self.hexes.append(self.hasher.hexdigest())
        self.hasher = new_hasher(self.entry.algorithm)
        self.index += 1
        if self.index < len(self.chunks):
            self.left = self.chunks[self.index].length

    def digest(self) -> str:
        if self.chunks is None:
            return format_digest(self.entry.algorithm, self.hasher.hexdigest())
        while self.index < len(self.chunks):
            self._close_chunk()
        if self.hexes != [c.digest for c in self.chunks]:
            return "chunk digests differ"
        return chunk_list_digest(self.entry.algorithm, self.chunks)


def _copy_file(src: Storage, dst: Storage, info: CheckpointInfo, entry: FileEntry, target: str,
               sync: bool, progress: Progress | None) -> None:
    source = f"{info.path}/{entry.path}"
    verifier = _Verifier(entry)
    size = 0
    buf = bytearray(min(COPY_CHUNK, max(entry.size, 1)))
    view = memoryview(buf)
    try:
        with src.open_read(source) as raw, dst.open_write(target) as out:
            reader = cast(Any, raw)
            while True:
                n = reader.readinto(view)
                if not n:
                    break
                size += n
                if size > entry.size:
                    break
                verifier.update(view[:n])
                out.write(view[:n])
                if progress is not None:
                    progress(n)
            problem = _mismatch(entry, size, verifier)
            if problem:  # raised inside the block: the partial upload is aborted
                raise CorruptCheckpointError(
                    f"{storage_url(src, source)}: {problem}; nothing was committed at "
                    f"{dst.url}", step=info.step, path=source)
            if sync:
                out.fsync()  # type: ignore[attr-defined]
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage_url(src, source)}: listed in the manifest but "
                                     "missing", step=info.step, path=source) from None


def _mismatch(entry: FileEntry, size: int, verifier: _Verifier) -> str | None:
    if size != entry.size:
        return (f"size differs from the manifest (declared {entry.size} B, read "
                f"{'more' if size > entry.size else size})")
    actual = verifier.digest()
    if actual != entry.digest:
        return (f"content digest differs from the manifest (expected {entry.digest}, got "
                f"{actual}): the source is corrupt")
    return None


def _discard(storage: Storage, *dirs: str) -> None:
    for d in dict.fromkeys(dirs):
        try:
            storage.delete_tree(d)
        except Exception:  # pragma: no cover - best effort; garbage collection retries
            log.warning("could not remove %s", storage_url(storage, d), exc_info=True)
