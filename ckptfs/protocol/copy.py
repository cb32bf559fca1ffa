"""Copying a committed checkpoint to another store (``ckptfs cp``), under the commit protocol.

Design decision: **a copy is a new save of the same bytes, not a file transfer.**  It opens an
`Attempt` at the destination (a fresh attempt name, never the
source's: an interrupted earlier copy, or a concurrent one, can then never share a path with
this one), streams every file from the source through it (hashed while written, as every save
is), and refuses a file whose size or digest differs from the source's manifest before anything
is committed.  Before anything is written at the destination, the source is checked as a load
checks it (`check_checkpoint`: the listing, every document
decoded, every tensor file's header), so copying a source that a reader refuses fails with the
error the load raises and commits nothing.  Then it commits the source manifest with only
``attempt`` changed (files, digests, metadata, ``created`` are the source's), so a copy is
either committed whole or absent, and every reader limit is checked by the same commit as any
save.  A destination step that is already committed is left alone: the copy succeeds only if it
holds the same content (same files with the same digests, same metadata), else
`CheckpointExistsError`.

An incremental checkpoint (format v3, docs/protocol.md §9) references files of other attempts
of its run, which the destination does not have.  Its copy is a v3 checkpoint that holds every
byte it uses itself, or references only the destination's own committed checkpoint:

* a tensor file the state document names (one of the source's own files, or a reference's
  ``path``) whose tensors the destination's latest committed v3 checkpoint already holds, all of
  them in one file, under the same names and the same digests (same algorithm, length, dtype
  and shape), becomes a reference to that file at the destination (decided by digest, as an
  incremental save decides; that checkpoint is the copy's *protector*, fenced before the marker
  exactly as a save's: `ckptfs.protocol.incremental.index_of`, ``Attempt.commit(fence=)``);
* else a source's own file is copied byte for byte, and a reference is *materialized*: a file
  of the destination attempt named by the reference's ``path``, holding exactly the tensors the
  state reads there (a new safetensors header over them, then their bytes, each tensor one
  chunk), every tensor's bytes read from the referenced file and checked against the digest the
  source's manifest binds while they are written.

The state document is copied unchanged: its slots name files by ``path`` and tensors by name,
and both are kept.  A source byte that differs from its digest (own file or referenced chunk)
fails the copy with `CorruptCheckpointError` before anything commits.  A destination chunk is
referenced only after it was read and checked there (`stored_chunk_intact`, as an incremental
save checks what it reuses): a rotted one is written again instead.

A sharded incremental checkpoint (format v4) is copied file for file, and each reference is
remapped to the destination's own committed copy of the step it names (`references_at`: the
same file, size and chunks, each chunk read and checked there: rot there refuses the copy),
behind the fence of its protectors (`references_fence`).  Where the destination holds no
committed copy of that step, the referenced files are copied from the source into a *retired*
attempt of that step there (`Attempt.retire`: files and manifest, no marker, as a prune leaves
one), which the references name; a failed copy removes it.  ``ckptfs cp``, the
replicator and the per-rank sharded replica all go through these two functions.  Whatever the
writer, the commit refuses a reference that does not resolve at the destination, before the
marker (`Attempt.commit`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

import torch

from ckptfs.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    ReplicationError,
    StorageError,
)
from ckptfs.format.content import same_content as same_content  # shared: cp, tiers, walk
from ckptfs.format.hashing import ALGORITHMS, format_digest, new_hasher
from ckptfs.format.incremental import (
    DEFAULT_LEASE_S,
    Reference,
    has_references,
)
from ckptfs.format.manifest import FileEntry, Manifest
from ckptfs.format.serialize import HeaderEntry, tensor_memoryview
from ckptfs.format.sharded import Chunk, ChunkedFileEntry, make_entry
from ckptfs.format.versions import REFERENCES, SHARDED, features
from ckptfs.protocol.commit import Attempt, WrittenFile, placeholder_digest
from ckptfs.protocol.formats import check_checkpoint
from ckptfs.protocol.incremental import (
    ProtectorGoneError,
    ReuseIndex,
    ReuseMemory,
    Stored,
    index_of,
    recheck_after_lease,
    stored_chunk_intact,
)
from ckptfs.protocol.reader import CheckedV1, local_header, reference_chunks
from ckptfs.protocol.references import attempt_sharing
from ckptfs.protocol.remote_verify import compare_stored
from ckptfs.protocol.resolve import (
    CheckpointInfo,
    find_step_dir,
    read_committed,
    read_marker,
    resolve_latest,
    storage_url,
)
from ckptfs.storage.base import Storage, read_range

log = logging.getLogger("ckptfs")

COPY_CHUNK = 8 * 1024 * 1024
#: How far a copy's writer may run ahead of its hasher (``Attempt.write_file``'s
#: ``hash_lead``).  Each slice a copy reads is a buffer of its own, alive until hashed, so this
#: bounds a copy's memory: at most this plus one slice per file in flight (plus the
#: destination's write buffer).  Four slices keep the hash and the write overlapped.
COPY_HASH_LEAD = 4 * COPY_CHUNK
Progress = Callable[[int], None]


@dataclasses.dataclass
class CopyResult:
    step: int
    status: str  # "copied" or "identical" (already committed there with the same content)
    attempt: str
    files: int
    bytes: int
    #: ``check_stored``: files whose checksum, as the destination store keeps it, was compared
    #: before the commit and matched, and files the store has no comparable checksum for.
    server_verified: int = 0
    server_unverified: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def copy_step(src: Storage, dst: Storage, step: int, *, durable: bool = True, threads: int = 4,
              progress: Progress | None = None, check_stored: bool = False) -> CopyResult:
    """Copy the committed ``step`` of ``src`` to ``dst`` (see the module docstring).  The copy's
    manifest records the destination store's own checksums of the files it wrote, computed
    while writing (docs/remote-verify.md).  ``check_stored``: before the marker, compare them
    with what the destination store keeps (one metadata request per file; where it offers
    `ServerChecksums`): a difference is a
    `StorageError` and nothing is committed."""
    info = read_committed(src, step)
    manifest = info.manifest

    existing = committed_at(dst, step)
    if existing is not None:
        if same_content(existing.manifest, manifest):
            return CopyResult(step, "identical", existing.attempt, len(manifest.files),
                              info.bytes)
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
    checked = check_checkpoint(src, info)
    feats = features(manifest)
    if REFERENCES in feats and SHARDED not in feats:
        return _copy_v3(src, dst, info, manifest, checked,
                        durable=durable, progress=progress, check_stored=check_stored)
    # A sharded checkpoint's references (format v4) name the destination's own copies.
    there, retired = references_at(dst, manifest, src=src, durable=durable)
    try:
        with Attempt.open(dst, step, algorithm=manifest.hash_algorithm,
                          durable=durable) as att:
            copied = dataclasses.replace(there, attempt=att.name)
            att.check(copied)
            entries = sorted(manifest.files, key=lambda e: -e.size)
            if not any(isinstance(e, ChunkedFileEntry) for e in entries):
                files = [(e.path, e.size, _source_chunks(src, info.path, info.step, e, progress))
                         for e in entries]
                written = att.write_files(files, threads=threads, hash_lead=COPY_HASH_LEAD)
                for entry, w in zip(entries, written, strict=True):
                    _check_copied(src, dst, info.path, info.step, entry, w.digest, [])
            else:
                written = [copy_file(src, info.path, att, entry, progress=progress)
                           for entry in entries]
            sums = {w.path: w.store_checksums for w in written}
            copied = dataclasses.replace(copied, files=tuple(
                dataclasses.replace(e, store_checksums=sums[e.path]) for e in manifest.files))
            verified = check_stored_checksums(dst, att, written) if check_stored else (0, 0)
            out = att.commit(copied, fence=references_fence(dst, copied, retired),
                             copied_from=info.url)
    except BaseException as exc:
        _discard_unreferenced(dst, step, retired)
        if not isinstance(exc, CheckpointExistsError):
            raise
        winner = committed_at(dst, step, quiet=True)
        if winner is not None and same_content(winner.manifest, manifest):
            return CopyResult(step, "identical", winner.attempt, len(manifest.files),
                              manifest.total_bytes)
        raise
    log.info("copied step %d from %s to %s", step, src.url, dst.url)
    return CopyResult(step, "copied", out.attempt, len(manifest.files), manifest.total_bytes,
                      *verified)


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
            there_attempt = _committed_reference(dst, manifest.step, ref, memory,
                                                 none_ok=src is not None)
            if there_attempt is None:
                assert src is not None
                if ref.attempt_dir not in retired:
                    retired[ref.attempt_dir] = _retired_copy(src, dst, manifest.step,
                                                             ref, durable)
                there_attempt = retired[ref.attempt_dir][0].name
            refs.append(dataclasses.replace(ref, attempt=there_attempt))
        for adir, (att, m) in retired.items():
            needed = sorted({r.source for r in manifest.references if r.attempt_dir == adir})
            for path in needed:
                ref = next(r for r in manifest.references
                           if r.attempt_dir == adir and r.source == path)
                assert src is not None
                copy_file(src, adir, att, _source_entry(src, m, ref))
            att.retire(dataclasses.replace(m, attempt=att.name), needed)
    except BaseException:
        for att, _ in retired.values():
            att.discard()
        raise
    return (dataclasses.replace(manifest, references=tuple(refs)),
            [att for att, _ in retired.values()])


def _source_entry(src: Storage, m: Manifest, ref: Reference) -> ChunkedFileEntry:
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


def _retired_copy(src: Storage, dst: Storage, step: int, ref: Reference, durable: bool
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


def _committed_reference(dst: Storage, step: int, ref: Reference, memory: ReuseMemory, *,
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


def _discard_unreferenced(dst: Storage, step: int, retired: list[Attempt]) -> None:
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


def references_fence(dst: Storage, manifest: Manifest, retired: Iterable[Attempt] = ()
                     ) -> Callable[[], None] | None:
    """The fence of a copy whose references name ``dst``'s committed steps
    (`references_at`): before the marker, each referenced step is still committed there
    with the same attempt, else `CorruptCheckpointError` (nothing committed); the
    ``retired`` attempts the copy wrote itself have no marker to check.  ``None`` without
    such references."""
    own = {a.name for a in retired}
    protectors = sorted({(r.step, r.attempt) for r in
                         (manifest.references if has_references(manifest) else ())
                         if r.attempt not in own})
    if not protectors:
        return None

    def fence() -> None:
        for pstep, pattempt in protectors:
            marker = read_marker(dst, pstep)
            if marker is None or marker.attempt != pattempt:
                raise CorruptCheckpointError(
                    f"step {pstep} at {dst.url}, whose bytes step {manifest.step} references "
                    "there, was deleted meanwhile; nothing was committed", step=manifest.step)
    return fence


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
    `copy_step` and of the per-rank upload of a sharded replica
    (`ckptfs.protocol.replication_sharded`)."""
    pieces = [c.length for c in entry.chunks] if isinstance(entry, ChunkedFileEntry) else None
    w = att.write_file(entry.path, entry.size,
                       _source_chunks(src, source_dir, att.step, entry, progress), pieces=pieces,
                       hash_lead=COPY_HASH_LEAD)
    _check_copied(src, att.storage, source_dir, att.step, entry, w.digest, list(w.pieces))
    return w


def _source_chunks(src: Storage, source_dir: str, step: int, entry: FileEntry,
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


def _check_copied(src: Storage, dst: Storage, source_dir: str, step: int, entry: FileEntry,
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


# -- format v3 -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Materialized:
    """A reference of the source written as a file of the destination attempt: a new
    safetensors header over the tensors the state reads there, then their bytes."""

    ref: Reference
    prefix: bytes
    tensors: tuple[tuple[str, Chunk], ...]  # the source chunk of each tensor, in file order

    @property
    def pieces(self) -> list[int]:
        return [len(self.prefix), *(c.length for _, c in self.tensors)]

    @property
    def size(self) -> int:
        return sum(self.pieces)


def _materialized(ref: Reference, located: dict[str, tuple[HeaderEntry, Chunk]]
                  ) -> _Materialized:
    order = sorted(located.items(), key=lambda kv: (kv[1][1].offset, kv[0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": "ckptfs"}}
    pos = 0
    for name, (e, c) in order:
        header[name] = {"dtype": e.dtype, "shape": list(e.shape),
                        "data_offsets": [pos, pos + c.length]}
        pos += c.length
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    return _Materialized(ref, struct.pack("<Q", len(hbytes)) + hbytes,
                         tuple((n, c) for n, (_, c) in order))


def _materialized_chunks(src: Storage, info: CheckpointInfo, m: _Materialized,
                         progress: Progress | None) -> Callable[[], Iterator[memoryview]]:
    """The new header, then each tensor's bytes read from the referenced file (ranged reads of
    at most `COPY_CHUNK`)."""
    loc = m.ref.location

    def chunks() -> Iterator[memoryview]:
        yield memoryview(m.prefix)
        for _, c in m.tensors:
            end = c.offset + c.length
            for off in range(c.offset, end, COPY_CHUNK):
                n = min(COPY_CHUNK, end - off)
                try:
                    data = read_range(src, loc, off, n)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"{storage_url(src, loc)}: referenced by step {info.step} as "
                        f"{m.ref.path} but missing; nothing was committed",
                        step=info.step, path=loc) from None
                if len(data) != n:
                    raise CorruptCheckpointError(
                        f"{storage_url(src, loc)}: shorter than step {info.step} references; "
                        "nothing was committed", step=info.step, path=loc)
                yield memoryview(data)
                if progress is not None:
                    progress(n)

    return chunks


def _check_materialized(src: Storage, dst: Storage, info: CheckpointInfo, m: _Materialized,
                        pieces: list[str], algorithm: str) -> None:
    """Every tensor written from a referenced file hashed, while written, to the digest the
    source's manifest binds for its chunk."""
    if m.ref.algorithm == algorithm:
        got = pieces[1:]
    else:  # the reference's own algorithm: read the chunks again (never written so)
        got = [_digest_range(src, m.ref, c) for _, c in m.tensors]
    for (name, c), actual in zip(m.tensors, got, strict=True):
        if actual != c.digest:
            raise CorruptCheckpointError(
                f"{storage_url(src, m.ref.location)}: bytes {c.offset}..{c.offset + c.length} "
                f"(tensor {name!r}), referenced by step {info.step} as {m.ref.path}, differ "
                f"from their digest in its manifest (expected {c.digest}, got {actual}): the "
                f"source is corrupt; nothing was committed at {dst.url}",
                step=info.step, path=m.ref.location)


def _digest_range(src: Storage, ref: Reference, c: Chunk) -> str:
    h = new_hasher(ref.algorithm)
    end = c.offset + c.length
    for off in range(c.offset, end, COPY_CHUNK):
        h.update(read_range(src, ref.location, off, min(COPY_CHUNK, end - off)))
    return h.hexdigest()


def _destination_index(dst: Storage, algorithm: str) -> ReuseIndex | None:
    """The reuse index of the destination's latest committed checkpoint (format v3 only, a
    cryptographic algorithm only), or ``None``."""
    if not ALGORITHMS[algorithm].cryptographic:
        return None
    try:
        latest = resolve_latest(dst)
        return None if latest is None else index_of(dst, latest)
    except CkptfsError as exc:
        log.warning("%s: the copy references nothing there: its latest checkpoint cannot be "
                    "indexed (%s)", dst.url, exc)
        return None


def _held(index: ReuseIndex) -> dict[tuple[int, str, str], dict[str, Stored]]:
    """The indexed tensors by the file that holds them, by their name in that file."""
    out: dict[tuple[int, str, str], dict[str, Stored]] = {}
    for st in (*index.by_key.values(), *index.by_name.values()):
        out.setdefault(st.location, {})[st.name] = st
    return out


def _reusable(dst: Storage, path: str, wanted: dict[str, tuple[HeaderEntry, Chunk]],
              algorithm: str, held: dict[tuple[int, str, str], dict[str, Stored]],
              memory: ReuseMemory) -> Reference | None:
    """A reference (named ``path``) to one destination file that holds every ``wanted`` tensor
    under the same name with the same digest, length, dtype and shape, each of those chunks
    (and the file's header chunk) read and checked at ``dst`` once, as an incremental save
    checks what it reuses (`stored_chunk_intact`): a rotted chunk is never referenced, the
    bytes are written again instead.  Else ``None``."""
    if not wanted:
        return None
    for tensors in held.values():
        got = []
        for name, (e, c) in wanted.items():
            st = tensors.get(name)
            if st is None or st.key != (algorithm, c.digest, c.length, e.dtype, e.shape):
                break
            got.append(st)
        else:
            first = got[0]
            if not all(stored_chunk_intact(dst, st, memory) for st in
                       (dataclasses.replace(first, chunk=first.header), *got)):
                continue
            chunks = {(st.chunk.offset, st.chunk.length): st.chunk for st in got}
            chunks.pop((first.header.offset, first.header.length), None)
            return Reference(path, first.step, first.attempt, first.source, first.size,
                             first.algorithm, (first.header, *(chunks[k] for k in sorted(chunks))))
    return None


def _copy_v3(src: Storage, dst: Storage, info: CheckpointInfo, manifest: Manifest,
             checked: Any, *, durable: bool, progress: Progress | None,
             reuse: bool = True, lease_s: float = DEFAULT_LEASE_S,
             check_stored: bool = False) -> CopyResult:
    """Copy a v3 checkpoint so that it holds every byte it uses, or references the
    destination's latest committed checkpoint (module docstring)."""
    step, algo = info.step, manifest.hash_algorithm
    used: dict[str, set[str]] = {}
    for slot in cast(CheckedV1, checked).slots:
        used.setdefault(slot.file, set()).add(slot.name)
    index = _destination_index(dst, algo) if reuse else None
    held = _held(index) if index is not None else {}
    memory = ReuseMemory()  # what this copy read and checked at the destination
    dst_refs: list[Reference] = []
    copies: list[ChunkedFileEntry] = []
    mats: list[_Materialized] = []
    for entry in manifest.files:
        assert isinstance(entry, ChunkedFileEntry)
        ref = None
        if held and entry.path in used:
            start, entries = local_header(src, info, entry)
            wanted = {}
            for name in used[entry.path]:
                e = entries[name]
                chunk = entry.chunk_at(start + e.begin, e.end - e.begin)
                if chunk is not None:
                    wanted[name] = (e, chunk)
            if len(wanted) == len(used[entry.path]):
                ref = _reusable(dst, entry.path, wanted, algo, held, memory)
        if ref is not None:
            dst_refs.append(ref)
        else:
            copies.append(entry)
    for sref in manifest.references:
        located = reference_chunks(src, info, sref, used.get(sref.path, set()))
        ref = _reusable(dst, sref.path, located, algo, held, memory) if held else None
        if ref is not None:
            dst_refs.append(ref)
        else:
            mats.append(_materialized(sref, located))

    def build(name: str, entries: list[ChunkedFileEntry]) -> Manifest:
        return Manifest(step, name, tuple(entries), manifest.created, algo,
                        dict(manifest.metadata), manifest.features, references=tuple(dst_refs))

    def fence_for(opened: float) -> Callable[[], None] | None:
        if not dst_refs or index is None:
            return None
        pstep, pattempt = index.protector

        def fence() -> None:
            if time.monotonic() - opened > lease_s:
                raise ProtectorGoneError(f"the copy ran longer than its {lease_s:.0f} s lease")
            marker = read_marker(dst, pstep)
            if marker is None or marker.attempt != pattempt:
                raise ProtectorGoneError(f"step {pstep} at {dst.url}, whose stored bytes this "
                                         "copy references, was deleted meanwhile")
        return fence

    hexd = placeholder_digest(algo).split(":", 1)[1]
    try:
        with Attempt.open(dst, step, algorithm=algo, durable=durable) as att:
            opened = time.monotonic()
            att.check(build(att.name, [*copies, *(
                make_entry(m.ref.path, m.size, algo, _tiles(m.pieces, [hexd] * len(m.pieces)),
                           None) for m in mats)]))
            written: list[ChunkedFileEntry] = []
            files: list[WrittenFile] = []
            for entry in sorted(copies, key=lambda e: -e.size):
                w = copy_file(src, info.path, att, entry, progress=progress)
                written.append(dataclasses.replace(entry, store_checksums=w.store_checksums))
                files.append(w)
            for m in mats:
                w = att.write_file(m.ref.path, m.size, _materialized_chunks(src, info, m, progress),
                                   pieces=m.pieces, hash_lead=COPY_HASH_LEAD)
                _check_materialized(src, dst, info, m, list(w.pieces), algo)
                written.append(w.chunked_entry(algo, m.pieces))
                files.append(w)
            verified = check_stored_checksums(dst, att, files) if check_stored else (0, 0)
            out = att.commit(build(att.name, written), fence=fence_for(opened),
                             copied_from=info.url)
            if dst_refs and time.monotonic() - opened > lease_s:
                try:
                    recheck_after_lease(dst, out)  # uncommits if referenced bytes are gone
                except CorruptCheckpointError as exc:
                    raise ProtectorGoneError(str(exc)) from None
    except ProtectorGoneError as exc:
        log.warning("%s: step %d: %s; copying every byte instead", dst.url, step, exc)
        return _copy_v3(src, dst, info, manifest, checked, durable=durable, progress=progress,
                        reuse=False, lease_s=lease_s, check_stored=check_stored)
    except CheckpointExistsError:
        winner = committed_at(dst, step, quiet=True)
        if winner is not None and same_content(winner.manifest, manifest):
            return CopyResult(step, "identical", winner.attempt, len(manifest.files),
                              manifest.logical_bytes)
        raise
    log.info("copied step %d from %s to %s (%d files materialized, %d referenced there)",
             step, src.url, dst.url, len(mats), len(dst_refs))
    return CopyResult(step, "copied", out.attempt, len(written), manifest.logical_bytes,
                      *verified)


def _tiles(lengths: list[int], digests: list[str]) -> list[Chunk]:
    out, pos = [], 0
    for length, hexd in zip(lengths, digests, strict=True):
        out.append(Chunk(pos, length, hexd))
        pos += length
    return out


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
