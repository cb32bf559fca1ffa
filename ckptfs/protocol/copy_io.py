"""Copying a step's files, and its references, into a destination attempt: the file-level work
of ``ckptfs.protocol.copy`` (`StepCopier`: ``ckptfs cp``, replication, the tiers).

Each file is read from the source in slices of `COPY_CHUNK` (each checked against the source
manifest's chunk digests as it streams: `source_chunks`), written into the destination attempt
while hashed (`copy_file`, its hasher at most `COPY_HASH_LEAD` behind), and checked again once
written (`check_copied`, `check_stored_checksums`).  A format v3 step's references are settled
at the destination (`references_at`): to the destination's own committed copy of the referenced
step when it has one, else to a retired copy written beside it; `reference_protectors` names
what must stay committed until the marker.  `committed_at` answers what a copy asks of the
destination before and after writing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

import torch

from ckptfs.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ReplicationError,
    StorageError,
)
from ckptfs.format.content import same_content as same_content  # shared: cp, tiers, walk
from ckptfs.format.hashing import format_digest
from ckptfs.format.incremental import (
    Reference,
    has_references,
    references_of,
)
from ckptfs.format.manifest import FileEntry, Manifest
from ckptfs.format.serialize import tensor_memoryview
from ckptfs.format.sharded import ChunkedFileEntry
from ckptfs.protocol.commit import (
    Attempt,
    WrittenFile,
)
from ckptfs.protocol.incremental import (
    ReuseMemory,
    Stored,
    stored_chunk_intact,
)
from ckptfs.protocol.references import attempt_sharing
from ckptfs.protocol.remote_verify import compare_stored
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
#: How far a copy's writer may run ahead of its hasher (``Attempt.write_file``'s
#: ``hash_lead``).  Each slice a copy reads is a buffer of its own, alive until hashed, so this
#: bounds a copy's memory: at most this plus one slice per file in flight (plus the
#: destination's write buffer).  Four slices keep the hash and the write overlapped.
COPY_HASH_LEAD = 4 * COPY_CHUNK
Progress = Callable[[int], None]

__all__ = [
    "COPY_CHUNK",
    "COPY_HASH_LEAD",
    "Progress",
    "check_copied",
    "check_listed",
    "check_stored_checksums",
    "committed_at",
    "committed_reference",
    "copy_file",
    "discard_unreferenced",
    "reference_protectors",
    "references_at",
    "retired_copy",
    "source_chunks",
    "source_entry",
]


def check_listed(dst: Storage, att: Attempt, files: Iterable[FileEntry]) -> None:
    """One listing of the attempt at ``dst`` before its marker: every file of ``files`` is
    there with its size, and not a link; else `CorruptCheckpointError` (nothing is
    committed)."""
    prefix = att.write_dir + "/"
    found = {e.name[len(prefix):]: e.size for e in dst.list_tree(att.write_dir)
             if e.name.startswith(prefix) and not e.is_link}
    for entry in files:
        if found.get(entry.path) != entry.size:
            raise CorruptCheckpointError(
                f"{storage_url(dst, prefix + entry.path)}: {entry.size} B were copied there, "
                f"the destination lists {found.get(entry.path, 'no file')}; nothing was "
                "committed", step=att.step, path=prefix + entry.path)


M = TypeVar("M", bound=Manifest)


def references_at(dst: Storage, manifest: M, *, src: Storage | None = None,
                  durable: bool = True) -> tuple[M, list[Attempt]]:
    """``manifest`` for its copy at ``dst`` (``ckptfs cp``, a replica, each rank's part of a
    sharded replica): a reference of a sharded checkpoint (format v4) names the attempt of the
    step it takes bytes from; at ``dst`` that step's copy has another attempt name, and must
    hold the same file with the same size and the referenced chunks, and each of those chunks
    must hold its digest's bytes there: read and checked once, as an incremental save checks
    what it reuses (`stored_chunk_intact`), so rot at the destination is never referenced
    (`CorruptCheckpointError` naming the damaged file, nothing written).

    Where ``dst`` holds no committed copy of that step and ``src`` is given (the source run
    root), the referenced files are copied from ``src`` (every chunk checked against the
    source attempt's manifest) into a fresh *retired* attempt of that step at ``dst``
    (`Attempt.retire`: its files and manifest, no marker, as a prune leaves one), which the
    references then name; those attempts are returned, for the caller to discard if its own
    commit fails.  Without ``src`` (a sharded replica: the files lie on several nodes), such a
    step cannot be copied by reference: `ReplicationError`.  A manifest without references
    is returned as it is."""
    if not has_references(manifest) or not manifest.references:
        return manifest, []
    memory = ReuseMemory()
    refs: list[Reference] = []
    retired: dict[str, tuple[Attempt, Manifest]] = {}  # source attempt dir -> its copy
    try:
        for ref in manifest.references:
            there_attempt = committed_reference(dst, manifest.step, ref, memory,
                                                 none_ok=src is not None)
            if there_attempt is None:
                assert src is not None
                if ref.attempt_dir not in retired:
                    retired[ref.attempt_dir] = retired_copy(src, dst, manifest.step,
                                                             ref, durable)
                there_attempt = retired[ref.attempt_dir][0].name
            refs.append(dataclasses.replace(ref, attempt=there_attempt))
        for adir, (att, m) in retired.items():
            needed = sorted({r.source for r in manifest.references if r.attempt_dir == adir})
            for path in needed:
                ref = next(r for r in manifest.references
                           if r.attempt_dir == adir and r.source == path)
                assert src is not None
                copy_file(src, adir, att, source_entry(src, m, ref))
            att.retire(dataclasses.replace(m, attempt=att.name), needed)
    except BaseException:
        for att, _ in retired.values():
            att.discard()
        raise
    return (dataclasses.replace(manifest, references=tuple(refs)),
            [att for att, _ in retired.values()])


def source_entry(src: Storage, m: Manifest, ref: Reference) -> ChunkedFileEntry:
    """The entry of the source attempt's manifest ``m`` for the file ``ref`` takes bytes
    from, which must hold the referenced chunks."""
    entry = {e.path: e for e in m.files}.get(ref.source)
    if (not isinstance(entry, ChunkedFileEntry) or entry.size != ref.size
            or not set(ref.chunks) <= set(entry.chunks)):
        raise CorruptCheckpointError(
            f"{storage_url(src, ref.location)}: referenced as {ref.path}, but its attempt's "
            "manifest does not list it with that size and those chunks; nothing was committed",
            step=ref.step, path=ref.location)
    return entry


def retired_copy(src: Storage, dst: Storage, step: int, ref: Reference, durable: bool
                  ) -> tuple[Attempt, Manifest]:
    """A fresh attempt of ``ref.step`` at ``dst`` for the referenced files of the source
    attempt ``ref`` names, and that attempt's manifest (read at ``src``: it must be one
    whose files may be referenced)."""
    sharing = attempt_sharing(src, ref.attempt_dir)
    if not sharing.shares or sharing.manifest is None:
        raise CorruptCheckpointError(
            f"{storage_url(src, ref.location)}: step {step} references it, in an attempt "
            f"whose files may not be referenced ({sharing.why}); nothing was committed",
            step=step, path=ref.location)
    m = sharing.manifest
    log.info("%s: step %d references step %d, which is not committed there: its referenced "
             "files are copied into a retired attempt of step %d", dst.url, step, ref.step,
             ref.step)
    return Attempt.open(dst, ref.step, algorithm=m.hash_algorithm, durable=durable), m


def committed_reference(dst: Storage, step: int, ref: Reference, memory: ReuseMemory, *,
                         none_ok: bool) -> str | None:
    """The attempt of ``dst``'s committed copy of ``ref.step`` that holds ``ref``'s file
    and chunks, each chunk read and checked there; ``None`` when ``dst`` has no committed
    copy of that step and ``none_ok``."""
    there = committed_at(dst, ref.step)
    if there is None and none_ok:
        return None
    entry = None if there is None else {e.path: e for e in there.manifest.files}.get(
        ref.source)
    if (there is None or not isinstance(entry, ChunkedFileEntry) or entry.size != ref.size
            or not set(ref.chunks) <= set(entry.chunks)):
        raise ReplicationError(
            f"step {step} references bytes of step {ref.step} ({ref.source}), "
            f"which {dst.url} does not hold as committed (not copied there yet, pruned "
            "there, or other content): it cannot be copied by reference; copy step "
            f"{ref.step} there first (ckptfs cp --all copies every step, oldest first)")
    for chunk in ref.chunks:
        st = Stored(ref.step, there.attempt, ref.source, ref.size, ref.algorithm,
                    ref.chunks[0], chunk, f"{ref.path}@{chunk.offset}", "", ())
        if not stored_chunk_intact(dst, st, memory):
            raise CorruptCheckpointError(
                f"{storage_url(dst, st.path)}: bytes {chunk.offset}.."
                f"{chunk.offset + chunk.length}, which step {step} references "
                f"there, are missing or differ from their digest: the destination's copy "
                f"of step {ref.step} is damaged; nothing was committed (run 'ckptfs "
                f"verify' there, delete the damaged step and copy it again)",
                step=ref.step, path=st.path)
    return there.attempt


def discard_unreferenced(dst: Storage, step: int, retired: list[Attempt]) -> None:
    """After a failed copy of ``step``: remove the retired attempts it wrote, unless a marker
    of ``step`` may still name its attempt (an unknown outcome: then they are kept, and gc
    frees them once nothing references them)."""
    if not retired:
        return
    try:
        marker = read_marker(dst, step)
    except Exception:
        return
    if marker is None:
        for r in retired:
            r.discard()



def reference_protectors(manifest: Manifest, retired: Iterable[Attempt] = ()
                           ) -> list[tuple[int, str]]:
    """The destination steps a copy's references name (`references_at`), ``(step,
    attempt)``: the commit fences them before the marker (`fence_protectors`); the
    ``retired`` attempts the copy wrote itself have no marker to check."""
    own = {a.name for a in retired}
    return sorted({(r.step, r.attempt) for r in references_of(manifest) if r.attempt not in own})


def check_stored_checksums(dst: Storage, att: Attempt, written: list[WrittenFile]
                           ) -> tuple[int, int]:
    """Before the marker (of a copy, a replica, or each rank's part of a sharded replica):
    each written object's checksum as ``dst`` keeps it equals the one
    computed from the bytes sent (`compare_stored`).
    Returns (matched, not available); a mismatch raises `StorageError` (the store holds
    other bytes than were sent: nothing is committed, a replicator retries)."""
    results = [compare_stored(dst, att.file_path(w.path), w.path, w.store_checksums)[0]
               for w in written]
    bad = [r for r in results if r.status == "mismatch"]
    if bad:
        raise StorageError(
            f"{dst.url}: step {att.step}: the store holds other bytes than were written ("
            + "; ".join(f"{r.path}: {r.detail}" for r in bad) + "); nothing was committed")
    matched = sum(1 for r in results if r.status == "match")
    return matched, len(results) - matched


def copy_file(src: Storage, source_dir: str, att: Attempt, entry: FileEntry, *,
              progress: Progress | None = None) -> WrittenFile:
    """Copy one file of a committed checkpoint (``entry``, under ``source_dir`` of ``src``,
    the attempt's directory from the run root) into ``att``: streamed, hashed while written
    (per chunk for a chunked entry), and `CorruptCheckpointError` (before anything is
    committed) unless its size and digests are the manifest's.  The one per-file copy of
    `StepCopier`, on every rank."""
    pieces = [c.length for c in entry.chunks] if isinstance(entry, ChunkedFileEntry) else None
    w = att.write_file(entry.path, entry.size,
                       source_chunks(src, source_dir, att.step, entry, progress), pieces=pieces,
                       hash_lead=COPY_HASH_LEAD)
    check_copied(src, att.storage, source_dir, att.step, entry, w.digest, list(w.pieces))
    return w


def source_chunks(src: Storage, source_dir: str, step: int, entry: FileEntry,
                   progress: Progress | None) -> Callable[[], Iterator[memoryview]]:
    """The bytes of ``entry`` read from the source, in slices of at most `COPY_CHUNK`; a
    file that turns out shorter or longer than declared raises while it is written (the partial
    upload is aborted).

    Each slice is a buffer of its own (uninitialized, not zero-filled): the writer hands a
    slice to its background hasher and goes on while it is hashed, so a slice must not change
    after it was yielded.  (A reused buffer was refilled by the next read before the hasher had
    read it whenever the destination took the bytes faster than the hash, e.g. ``memory://``:
    a healthy source then failed as "digest differs", and replication gave the step up.)
    Memory: the hasher's bounded lead (`COPY_HASH_LEAD`) per file in flight."""
    source = f"{source_dir}/{entry.path}"

    def chunks() -> Iterator[memoryview]:
        size = 0
        slice_bytes = min(COPY_CHUNK, max(entry.size, 1))
        try:
            with src.open_read(source) as raw:
                reader = cast(Any, raw)
                while size < entry.size:
                    view = tensor_memoryview(torch.empty(slice_bytes, dtype=torch.uint8))
                    n = reader.readinto(view[:min(slice_bytes, entry.size - size)])
                    if not n:
                        break
                    size += n
                    yield view[:n]
                    if progress is not None:
                        progress(n)
                extra = reader.read(1) if size == entry.size else b""
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{storage_url(src, source)}: listed in the manifest "
                                         "but missing", step=step, path=source) from None
        if size != entry.size or extra:
            raise CorruptCheckpointError(
                f"{storage_url(src, source)}: size differs from the manifest (declared "
                f"{entry.size} B, read {'more' if extra else size}); nothing was committed",
                step=step, path=source)

    return chunks


def check_copied(src: Storage, dst: Storage, source_dir: str, step: int, entry: FileEntry,
                  digest: str, pieces: list[str]) -> None:
    """The bytes the destination got hash to what the source's manifest declares."""
    if isinstance(entry, ChunkedFileEntry):
        ok = pieces == [c.digest for c in entry.chunks]
        got = "chunk digests differ"
    else:
        got = format_digest(entry.algorithm, digest)
        ok = got == entry.digest
    if not ok:
        source = f"{source_dir}/{entry.path}"
        raise CorruptCheckpointError(
            f"{storage_url(src, source)}: content digest differs from the manifest (expected "
            f"{entry.digest}, got {got}): the source is corrupt; nothing was committed at "
            f"{dst.url}", step=step, path=source)


def committed_at(storage: Storage, step: int, *, quiet: bool = False) -> CheckpointInfo | None:
    """The committed checkpoint of ``step`` at ``storage``, or ``None`` when there is none (or
    it was deleted meanwhile).  ``quiet``: ``None`` on any other error too.  What a copy, a
    replica and a sharded replica ask of the destination before and after writing."""
    name = find_step_dir(storage, step)
    if name is None:
        return None
    try:
        if read_marker(storage, step, name) is None:
            return None
        return read_committed(storage, step, name)
    except CheckpointNotFoundError:
        return None
    except Exception:
        if quiet:
            return None
        raise
