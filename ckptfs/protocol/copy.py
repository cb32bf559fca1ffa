"""Copying a committed checkpoint to another store (``ckptfs cp``), under the commit protocol.

Design decision: **a copy is a new save of the same bytes, not a file transfer.**  It opens an
:class:`~ckptfs.protocol.commit.Attempt` at the destination (a fresh attempt name, never the
source's: an interrupted earlier copy, or a concurrent one, can then never share a path with
this one), streams every file from the source through it (hashed while written, as every save
is), and refuses a file whose size or digest differs from the source's manifest before anything
is committed.  Before anything is written at the destination, the source is checked as a load
checks it (:func:`~ckptfs.protocol.formats.check_checkpoint`: the listing, every document
decoded, every tensor file's header), so copying a source that a reader refuses fails with the
error the load raises and commits nothing.  Then it commits the source manifest with only
``attempt`` changed (files, digests, metadata, ``created`` are the source's), so a copy is
either committed whole or absent, and every reader limit is checked by the same commit as any
save.  A destination step that is already committed is left alone: the copy succeeds only if it
holds the same content (same files with the same digests, same metadata), else
:class:`~ckptfs.errors.CheckpointExistsError`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

from ckptfs.errors import CheckpointExistsError, CorruptCheckpointError
from ckptfs.format.hashing import format_digest
from ckptfs.format.manifest import FileEntry, Manifest
from ckptfs.format.sharded import ChunkedFileEntry
from ckptfs.protocol.commit import Attempt
from ckptfs.protocol.formats import check_checkpoint
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
        return sorted((e.path, e.size, e.digest,
                       e.chunks if isinstance(e, ChunkedFileEntry) else ()) for e in m.files)

    return (a.step == b.step and a.format_version == b.format_version
            and files(a) == files(b) and a.metadata == b.metadata)


def copy_step(src: Storage, dst: Storage, step: int, *, durable: bool = True, threads: int = 4,
              progress: Progress | None = None) -> CopyResult:
    """Copy the committed ``step`` of ``src`` to ``dst`` (see the module docstring)."""
    info = read_committed(src, step)
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

    # What a load of the source refuses, the copy refuses, before anything is written at the
    # destination (the same typed error): the listing (links, missing, resized files: nothing
    # is read for a size the storage does not hold), every document decoded, every tensor
    # file's header checked; the tensor bytes are checked against their digests as they are
    # copied.
    check_checkpoint(src, info)
    try:
        with Attempt.open(dst, step, algorithm=manifest.hash_algorithm,
                          durable=durable) as att:
            copied = dataclasses.replace(manifest, attempt=att.name)
            att.check(copied)
            entries = sorted(manifest.files, key=lambda e: -e.size)
            files = [(e.path, e.size, _source_chunks(src, info, e, progress)) for e in entries]
            pieces = {e.path: [c.length for c in e.chunks] for e in entries
                      if isinstance(e, ChunkedFileEntry)}
            if not pieces:
                written = att.write_files(files, threads=threads)
            else:
                written = [att.write_file(p, s, c, pieces=pieces.get(p)) for p, s, c in files]
            for entry, w in zip(entries, written, strict=True):
                _check_copied(src, dst, info, entry, w.digest, list(w.pieces))
            out = att.commit(copied, copied_from=info.url)
    except CheckpointExistsError:
        winner = _committed_at(dst, step, quiet=True)
        if winner is not None and same_content(winner.manifest, manifest):
            return CopyResult(step, "identical", winner.attempt, len(manifest.files),
                              manifest.total_bytes)
        raise
    log.info("copied step %d from %s to %s", step, src.url, dst.url)
    return CopyResult(step, "copied", out.attempt, len(manifest.files), manifest.total_bytes)


def _source_chunks(src: Storage, info: CheckpointInfo, entry: FileEntry,
                   progress: Progress | None) -> Callable[[], Iterator[memoryview]]:
    """The bytes of ``entry`` read from the source, in slices of a reused buffer; a file that
    turns out shorter or longer than declared raises while it is written (the partial upload
    is aborted)."""
    source = f"{info.path}/{entry.path}"

    def chunks() -> Iterator[memoryview]:
        size = 0
        buf = bytearray(min(COPY_CHUNK, max(entry.size, 1)))
        view = memoryview(buf)
        try:
            with src.open_read(source) as raw:
                reader = cast(Any, raw)
                while size < entry.size:
                    n = reader.readinto(view[:min(len(view), entry.size - size)])
                    if not n:
                        break
                    size += n
                    yield view[:n]
                    if progress is not None:
                        progress(n)
                extra = reader.read(1) if size == entry.size else b""
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{storage_url(src, source)}: listed in the manifest "
                                         "but missing", step=info.step, path=source) from None
        if size != entry.size or extra:
            raise CorruptCheckpointError(
                f"{storage_url(src, source)}: size differs from the manifest (declared "
                f"{entry.size} B, read {'more' if extra else size}); nothing was committed",
                step=info.step, path=source)

    return chunks


def _check_copied(src: Storage, dst: Storage, info: CheckpointInfo, entry: FileEntry,
                  digest: str, pieces: list[str]) -> None:
    """The bytes the destination got hash to what the source's manifest declares."""
    if isinstance(entry, ChunkedFileEntry):
        ok = pieces == [c.digest for c in entry.chunks]
        got = "chunk digests differ"
    else:
        got = format_digest(entry.algorithm, digest)
        ok = got == entry.digest
    if not ok:
        source = f"{info.path}/{entry.path}"
        raise CorruptCheckpointError(
            f"{storage_url(src, source)}: content digest differs from the manifest (expected "
            f"{entry.digest}, got {got}): the source is corrupt; nothing was committed at "
            f"{dst.url}", step=info.step, path=source)


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
