"""The commit protocol: how a save becomes a committed checkpoint.  **The one place a commit
marker is created.**

Design decision: **the commit is the exclusive creation of one small marker, on every backend.**
Rename is not atomic on object stores (it is copy + delete), so it cannot be the commit there;
making the marker the commit everywhere keeps one protocol and one proof.

Every writer (the single-process save, the coordinator of a sharded save, ``ckptfs cp``, the
background thread of an async save) goes through one object, an `Attempt`::

    attempt = Attempt.open(storage, step, algorithm=..., durable=...)   # 1, 2
    entry = attempt.write_file("tensors-00000.safetensors", size, chunks) # 3 (any rank)
    info = attempt.commit(manifest)                                        # 4
    # on any failure before commit: attempt.discard()  (the context manager does it)

1. ``open`` fails fast if step N is already committed and picks a fresh *attempt* name (UTC
   time + 64 random bits), so its files can never mix with a crashed earlier attempt or a
   concurrent writer of the same step (a zombie job and its replacement).  On local disk the
   attempt is written under a hidden ``.tmp-`` name.  Other ranks of a sharded save get a
   handle on the same attempt with `Attempt.join` (no I/O).
2. Before anything is written, a writer that knows its files' sizes calls `Attempt.check`
   with a manifest of placeholder digests: every reader limit (manifest and marker size,
   documents a reader bounds: `ckptfs.format.versions`) is checked, so a checkpoint a
   reader would refuse fails here.
3. ``write_file`` streams a file into the attempt, hashing every byte from memory as it is
   written (on a helper thread), fsyncing it when durable (large files also along the way:
   `EarlyFlush`), repeated from its first byte under the storage's bounded retries
   (`Retrying`).  Nothing written is read back.
4. ``commit`` checks the final manifest again by the reader's own decoder's rules (so
   nothing is committed that a reader refuses, for every writer), writes ``MANIFEST.json``,
   renames the attempt into place (local disk), makes every directory entry leading to its
   files durable (fsyncs of each subdirectory holding files, whichever rank or copy wrote
   them, of the attempt's directory, the step's, ``checkpoints/`` and the run root), and creates
   ``step-N/COMPLETE`` *exclusively* in one request (``link`` on local disk, ``If-None-Match:
   *`` on S3, ``ifGenerationMatch=0`` on GCS, ``If-None-Match`` on Azure).  The marker records
   the attempt and the manifest's digest, so it can only vouch for that manifest.

The outcome of the marker request itself can be ambiguous; it is settled here, once: the
marker is re-read, and if it names this attempt the commit succeeded (a retried request whose
first try took effect); if another writer's marker is there, this attempt is discarded and
`CheckpointExistsError` raised; if the outcome is unknown, the attempt is kept (a marker
may still name it) and the error propagates.  A crash before step 4 leaves an uncommitted
attempt that readers skip and garbage collection removes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar, cast

from ckptfs.errors import CheckpointExistsError, CkptfsError, CorruptCheckpointError
from ckptfs.format.content import same_content
from ckptfs.format.hashing import (
    DEFAULT_ALGORITHM,
    HASH_INLINE_BYTES,
    BackgroundHasher,
    Hasher,
    MultiHasher,
    PieceHasher,
    digest_bytes,
    format_digest,
    new_hasher,
    new_store_hasher,
)
from ckptfs.format.incremental import Reference, references_of
from ckptfs.format.layout import (
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    StepPaths,
    check_step,
    new_attempt_name,
)
from ckptfs.format.limits import MAX_MARKER_BYTES
from ckptfs.format.manifest import (
    MARKER_DIGEST_ALGORITHM,
    FileEntry,
    Manifest,
    Marker,
    check_document_size,
    check_metadata,
)
from ckptfs.format.serialize import DEFAULT_SHARD_BYTES, StatePlan, plan_state
from ckptfs.format.sharded import Chunk, ChunkedFileEntry, make_entry
from ckptfs.format.versions import CHUNKED, REFERENCES, check_committable
from ckptfs.protocol.listing import dangling_references, list_attempt, problems
from ckptfs.protocol.options import SaveOptions
from ckptfs.protocol.resolve import (
    CheckpointInfo,
    find_step_dir,
    read_committed,
    read_marker,
    storage_url,
)
from ckptfs.storage.base import (
    BatchedSync,
    EmptyDirRemoval,
    ServerChecksums,
    Storage,
    retry_call,
    supports,
)

#: ``gate(i)``: a context manager around the write of file ``i`` (`Attempt.write_files`).
FileGate = Callable[[int], AbstractContextManager[None]]

log = logging.getLogger("ckptfs")

Chunks = Callable[[], Iterable[memoryview]]


#: How far (in bytes) a writer may run ahead of its hasher.  Chunks are views of the tensors'
#: own memory, so a lead costs no copies; the bound only matters for tensors that had to be
#: copied (GPU, non-contiguous), which stay alive until hashed.
MAX_HASH_LEAD = 256 * 1024 * 1024
#: Largest slice handed to one ``write`` call.
WRITE_SLICE = 16 * 1024 * 1024
#: A durable write is flushed to disk in the background each time this many more bytes were
#: written (see `EarlyFlush`).
FLUSH_STEP = 64 * 1024 * 1024

#: Files of a save that hold at most this many bytes in all are written one after the other
#: on the calling thread: a pool's threads cost more than they hide there (measured on this VM,
#: a durable save of a 64 KiB state: 2.8-3.3 ms with its files written in turn, 5.3-6.0 ms by
#: two threads, whose concurrent fsyncs also slowed the commit's own).
SERIAL_WRITE_BYTES = 4 * 1024 * 1024

#: A file of at most this many bytes that the committing writer writes itself is not fsynced
#: when written: its fsync joins the commit's one step with ``MANIFEST.json``'s and the
#: directories' (`ckptfs.storage.base.BatchedSync`, all at once), before the marker.  Larger
#: files are fsynced as they are written (their tail flush overlaps the other files' writes).
DEFERRED_SYNC_BYTES = 4 * 1024 * 1024

#: The most bytes a save's parallel streaming writes may hold in buffers at once (object
#: stores: each open stream holds ``capabilities.stream_buffer_bytes``, its part buffers).  A
#: save opens at most ``WRITE_BUFFER_BUDGET // stream_buffer_bytes`` files at a time (at least
#: one), so its extra memory stays under the 64 MiB + 5% bound however many threads it has.
WRITE_BUFFER_BUDGET = 64 * 1024 * 1024


def write_streams(storage: Storage, nthreads: int, nfiles: int,
                  budget: int = WRITE_BUFFER_BUDGET) -> int:
    """How many files a save writes at once: the threads asked for, no more than the files, and
    no more than the storage's streams that fit in ``budget`` bytes of part buffers."""
    per_stream = storage.capabilities.stream_buffer_bytes
    n = max(1, min(nthreads, nfiles))
    if per_stream > 0:
        n = min(n, max(1, budget // per_stream))
    return n


def writer_identity(**extra: Any) -> dict[str, Any]:
    """What a marker records of its writer: host, pid, and ``extra`` (world size, source)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), **extra}


def now_text() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class ProtectorGoneError(CkptfsError, RuntimeError):
    """The checkpoint an incremental save took references from was deleted (or the save ran
    past its lease) before the save could commit; the save is retried writing every byte."""


class Lease:
    """How long a writer that references stored bytes may take from its open to its marker
    (docs/protocol.md §9.4): started when made (the attempt's open), asked by the commit's
    fence before the marker and once the marker is ours."""

    def __init__(self, seconds: float, what: str = "save") -> None:
        self.seconds = seconds
        self.what = what
        self.opened = time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() - self.opened > self.seconds


T = TypeVar("T")


def write_again_if_gone(what: str, save: Callable[[bool], T],
                        forget: Callable[[], None]) -> T:
    """The "protector gone: write everything again" retry of every incremental writer:
    ``save(True)`` (reusing stored bytes); if its fence raised `ProtectorGoneError`, logged
    (``what``: where and which step), ``forget()`` the reuse memory, and ``save(False)`` once,
    referencing nothing."""
    try:
        return save(True)
    except ProtectorGoneError as exc:
        log.warning("%s: %s; writing every byte instead", what, exc)
        forget()
    return save(False)


def settle_lost_race(storage: Storage, step: int, manifest: Manifest
                     ) -> CheckpointInfo | None:
    """The "lost the marker race: the same content?" settlement of a writer whose commit
    raised `CheckpointExistsError` (a copy, a replica): the winner's committed checkpoint
    when it holds the same content as ``manifest`` (`same_content`: the step is there, as
    wanted), else ``None`` (the caller re-raises).  A winner that cannot be read counts as
    another content."""
    try:
        if find_step_dir(storage, step) is None or read_marker(storage, step) is None:
            return None
        winner = read_committed(storage, step)
    except Exception:
        return None
    return winner if same_content(winner.manifest, manifest) else None


@dataclass(frozen=True)
class WrittenFile:
    """A file written into an attempt: its manifest entry (whole-file digest, or ``""`` when
    written by pieces) and, when written by pieces, the hex digest of each piece in order."""

    path: str
    size: int
    digest: str
    pieces: tuple[str, ...] = ()
    #: ``(algorithm, hex)`` of the whole-object checksums the store keeps
    #: (`ServerChecksums`), computed in the same pass as the digest.
    store_checksums: tuple[tuple[str, str], ...] = ()

    def entry(self, algorithm: str) -> FileEntry:
        """Its format v1 entry (one whole-file digest), with the store checksums."""
        return FileEntry(self.path, self.size, format_digest(algorithm, self.digest),
                         store_checksums=self.store_checksums)

    def chunked_entry(self, algorithm: str, lengths: Sequence[int], rank: int | None = None
                      ) -> ChunkedFileEntry:
        """Its chunked (format v2-v4) entry, written by pieces of ``lengths`` (those given to
        `Attempt.write_file`), with the store checksums: every writer's entries carry
        them through here or `entry`."""
        out, pos = [], 0
        for length, hexd in zip(lengths, self.pieces, strict=True):
            out.append(Chunk(pos, length, hexd))
            pos += length
        return make_entry(self.path, self.size, algorithm, out, rank,
                          store_checksums=self.store_checksums)


class EarlyFlush:
    """While a durable file is streamed, a helper thread fsyncs what is written so far each
    time another `FLUSH_STEP` bytes were written, so the data goes to disk during the
    write instead of all at once in the final ``fsync`` (which still runs, last, and is what
    makes the file durable).  Bounding the dirty data also keeps the writes themselves fast:
    measured here, two processes each writing 512 MiB + fsync took 0.44 s instead of 0.65 s.

    Use as a context manager around the writes; `finish` before the final ``fsync``
    waits for a flush in flight and raises its error (the kernel reports a write-back error
    to one ``fsync`` only, so an early one's must not be lost).  Disabled (no thread) for
    small or non-durable files."""

    def __init__(self, f: Any, enabled: bool) -> None:
        self._f = f
        self._enabled = enabled
        self._pending = 0
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> EarlyFlush:
        if self._enabled:
            self._thread = threading.Thread(target=self._run, name="ckptfs-flush", daemon=True)
            self._thread.start()
        return self

    def wrote(self, n: int) -> None:
        if self._thread is None:
            return
        self._pending += n
        if self._pending >= FLUSH_STEP:
            self._pending = 0
            self._wake.set()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            try:
                self._f.fsync()
            except BaseException as exc:  # raised by the writer
                self._error = exc
                return

    def finish(self) -> None:
        """Stop the helper (after its flush in flight) and raise its error, if any."""
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            self._thread.join()
            self._thread = None


def _hex(algorithm: str, data: memoryview | bytes) -> str:
    return digest_bytes(algorithm, data).split(":", 1)[1]


class Attempt:
    """One attempt at committing one step: open, write files, commit; or discard.

    Use `open` (the writer that commits) or `join` (another rank writing into the
    same attempt).  As a context manager, leaving on an exception before `commit`
    discards what was written (best effort; garbage collection removes what a crash leaves)."""

    def __init__(self, storage: Storage, step: int, name: str, *, algorithm: str,
                 durable: bool) -> None:
        self.storage = storage
        self.step = check_step(step)
        self.name = name
        self.algorithm = algorithm
        self.durable = durable
        self.paths = StepPaths(self.step)
        caps = storage.capabilities
        self.final_dir = self.paths.attempt_dir(name)
        self.write_dir = self.paths.tmp_attempt_dir(name) if caps.atomic_rename \
            else self.final_dir
        self.sync = durable and caps.fsync
        self.committed: CheckpointInfo | None = None
        self._outcome_unknown = False
        #: This writer commits the attempt and the storage syncs in one step
        #: (`DEFERRED_SYNC_BYTES`): set by `open`, never for a joined attempt (its files are
        #: another process's, which commits).  Its small files written and not yet fsynced.
        self.batched = False
        self._unsynced: list[str] = []
        self._unsynced_lock = threading.Lock()
        #: The store's whole-object checksums, computed while writing each file (docs/
        #: remote-verify.md); none where the store keeps none.
        self.store_checksums: tuple[str, ...] = (
            storage.checksum_algorithms()  # type: ignore[attr-defined]
            if supports(storage, ServerChecksums) else ())

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, storage: Storage, step: int, *, algorithm: str = DEFAULT_ALGORITHM,
             durable: bool = True) -> Attempt:
        """Start a new attempt of ``step``: `CheckpointExistsError` if the step is
        already committed; else a fresh attempt name and its (hidden, on local disk)
        directory."""
        check_step(step)
        new_hasher(algorithm)  # unknown/missing algorithm: fail before writing
        att = cls(storage, step, new_attempt_name(), algorithm=algorithm, durable=durable)
        att.batched = att.sync and supports(storage, BatchedSync)
        att.refuse_if_committed()
        storage.makedirs(att.write_dir)  # its entries are made durable by commit()
        return att

    @classmethod
    def join(cls, storage: Storage, step: int, name: str, *,
             algorithm: str = DEFAULT_ALGORITHM, durable: bool = True) -> Attempt:
        """A handle on the attempt ``name`` another process opened (a rank of a sharded save
        writing its own files into the coordinator's attempt).  No I/O; it never commits."""
        new_hasher(algorithm)
        return cls(storage, step, name, algorithm=algorithm, durable=durable)

    def refuse_if_committed(self) -> None:
        if self.storage.exists(self.paths.marker):
            raise CheckpointExistsError(
                f"step {self.step} is already committed at "
                f"{storage_url(self.storage, self.paths.dir)}; a committed checkpoint is never "
                f"overwritten: save under a new step, or delete it first "
                f"('store.delete({self.step})')")

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abandon()

    def abandon(self) -> None:
        """A writer gives the attempt up: `discard` it, unless it committed or the outcome
        of its marker request is unknown (a marker may still name it; gc collects it)."""
        if self.committed is None and not self._outcome_unknown:
            self.discard()

    # -- checks before writing -----------------------------------------------------------------

    def check(self, manifest: Manifest, **writer: Any) -> None:
        """Refuse now, before any byte is written, a checkpoint a reader would refuse:
        ``manifest`` is the one this attempt will commit, with placeholder digests of the right
        length (`placeholder_digest`)."""
        if manifest.step != self.step or manifest.attempt != self.name:
            raise AssertionError("the manifest is not this attempt's")  # pragma: no cover
        check_manifest(manifest, writer_identity(**writer))

    # -- writing -------------------------------------------------------------------------------

    def file_path(self, relpath: str) -> str:
        return f"{self.write_dir}/{relpath}"

    def write_file(self, relpath: str, size: int, chunks: Chunks, *,
                   pieces: Sequence[int] | None = None,
                   hash_lead: int = MAX_HASH_LEAD) -> WrittenFile:
        """Stream ``chunks()`` (views of memory, regenerated from the start on a retry) into
        ``relpath`` of the attempt and return its size and digest.  ``pieces``: the file is
        consecutive pieces of these lengths, each with its own digest (format v2 chunks),
        whatever slices ``chunks()`` yields; else one digest of the whole file.  Writing and
        hashing overlap (a helper thread hashes while this one writes, fsyncs and closes), and
        the whole file is repeated from its first byte under the storage's bounded retries
        when a write fails transiently.  ``size``: the planned size (-1: unknown), checked.
        ``hash_lead``: how many bytes the writer may run ahead of the hasher; the chunks it
        holds meanwhile stay alive (a copy's slices are buffers of their own: a copy passes a
        small lead, a save's chunks are views of the tensors and cost nothing)."""
        path = self.file_path(relpath)
        defer = self.batched and 0 <= size <= DEFERRED_SYNC_BYTES
        written, digest, piece_digests, checksums = retry_call(
            self.storage, "write", path,
            lambda: self._write_once(path, size, chunks, pieces, hash_lead, defer))
        if size >= 0 and written != size:
            raise CorruptCheckpointError(
                f"{storage_url(self.storage, path)}: {written} bytes were streamed, {size} "
                "were planned or declared", step=self.step, path=path)
        if defer:
            with self._unsynced_lock:
                self._unsynced.append(relpath)
        return WrittenFile(relpath, written, digest, tuple(piece_digests), checksums)

    def _write_once(self, path: str, size: int, chunks: Chunks, pieces: Sequence[int] | None,
                    hash_lead: int, defer: bool = False
                    ) -> tuple[int, str, list[str], tuple[tuple[str, str], ...]]:
        hasher: Hasher | PieceHasher = new_hasher(self.algorithm) if pieces is None \
            else PieceHasher(self.algorithm, list(pieces))
        # The store's checksums ride on the digest's pass (one read of each slice of memory).
        extra = {name: new_store_hasher(name) for name in self.store_checksums}
        both = MultiHasher(hasher, *extra.values())
        written = 0
        with BackgroundHasher(both, max_lead=hash_lead,
                              background=size < 0 or size > HASH_INLINE_BYTES) as bg, \
                self.storage.open_write(path) as f, \
                EarlyFlush(f, self.sync and (size < 0 or size > FLUSH_STEP)) as flush:
            for chunk in chunks():
                bg.feed(chunk)
                for start in range(0, len(chunk), WRITE_SLICE):
                    piece = chunk[start:start + WRITE_SLICE]
                    f.write(piece)
                    flush.wrote(len(piece))
                written += len(chunk)
                del chunk
            if self.sync:
                flush.finish()
                if not defer:  # else in the commit's one step (`DEFERRED_SYNC_BYTES`)
                    f.fsync()  # type: ignore[attr-defined]
        checksums = tuple((name, h.hexdigest()) for name, h in extra.items())
        if isinstance(hasher, PieceHasher):
            return written, "", hasher.digests(), checksums
        return written, hasher.hexdigest(), [], checksums

    def write_files(self, files: Sequence[tuple[str, int, Chunks]], *, threads: int,
                    hash_lead: int = MAX_HASH_LEAD,
                    pieces: Sequence[Sequence[int] | None] | None = None,
                    gate: FileGate | None = None) -> list[WrittenFile]:
        """`write_file` of each ``(relpath, size, chunks)`` (whole-file digests, or by the
        file's ``pieces`` where given), several at once (bounded by ``threads`` and the
        storage's write-memory budget), started in order; in turn on this thread when they
        are small (`SERIAL_WRITE_BYTES` in all) and not gated.  ``gate(i)``: a context manager
        around the whole write of file ``i`` (its retries included): an async save streamed
        through a staging budget waits there until the file's bytes are staged, and reuses
        them once it is written (`ckptfs.protocol.staging.Stream`)."""
        split = list(pieces) if pieces is not None else [None] * len(files)

        def one(i: int, p: str, s: int, c: Chunks, k: Sequence[int] | None) -> WrittenFile:
            if gate is None:
                return self.write_file(p, s, c, pieces=k, hash_lead=hash_lead)
            with gate(i):
                return self.write_file(p, s, c, pieces=k, hash_lead=hash_lead)

        n = write_streams(self.storage, threads, len(files))
        small = gate is None and all(0 <= s <= SERIAL_WRITE_BYTES for _, s, _ in files) and \
            sum(s for _, s, _ in files) <= SERIAL_WRITE_BYTES
        if n <= 1 or small:
            return [one(i, p, s, c, k)
                    for i, ((p, s, c), k) in enumerate(zip(files, split, strict=True))]
        with ThreadPoolExecutor(n, thread_name_prefix="ckptfs-save") as pool:
            futures = [pool.submit(one, i, p, s, c, k)
                       for i, ((p, s, c), k) in enumerate(zip(files, split, strict=True))]
            return [fut.result() for fut in futures]

    def write_document(self, relpath: str, data: bytes) -> WrittenFile:
        """A small whole document (one request), hashed."""
        self.storage.write_bytes(self.file_path(relpath), data)
        return WrittenFile(relpath, len(data), _hex(self.algorithm, data),
                           store_checksums=store_checksums_of(self.store_checksums, data))

    def sync_file_dir(self, relpath: str) -> None:
        """Make the directory entry of ``relpath`` durable (a rank's own subdirectory)."""
        if self.sync:
            self.storage.sync_dir(self.file_path(relpath).rsplit("/", 1)[0])

    # -- committing ----------------------------------------------------------------------------

    def commit(self, manifest: Manifest, *, fence: Callable[[], None] | None = None,
               node_files: Iterable[str] | None = None,
               lease_expired: Callable[[], bool] | None = None,
               protectors: Iterable[tuple[int, str]] = (), lease: Lease | None = None,
               **writer: Any) -> CheckpointInfo:
        """Write ``manifest`` and create the marker exclusively: the checkpoint is committed
        when this returns.  ``writer``: extra facts the marker records (``world_size``,
        ``copied_from``).  ``fence``: called after the manifest is written (and durable) and
        before the marker is created; an error it raises discards the attempt (an incremental
        save checks there that what it references is still committed, docs/protocol.md §9.4).
        ``node_files``: the files on this node's storage, when each rank of a sharded save
        wrote to its own node's disk (docs/tiers.md): only their directories are made durable
        here, each rank did its own.  ``lease_expired``: the writer's lease (a save or copy
        that references stored bytes, docs/protocol.md §9.4), asked once the marker is ours:
        if it ran out, the marker stays only if every file of the checkpoint is still listed
        (`confirm_after_lease`).  ``protectors`` (``(step, attempt)`` of each committed
        checkpoint the manifest takes references from) and ``lease``: the fence of every
        incremental writer, run first (`fence_protectors`), and ``lease.expired`` as
        ``lease_expired``.  See the module docstring for the outcomes."""
        if manifest.step != self.step or manifest.attempt != self.name:
            raise AssertionError("the manifest is not this attempt's")  # pragma: no cover
        who = writer_identity(**writer)
        protected = sorted(set(protectors))
        if protected and lease is not None and lease_expired is None:
            lease_expired = lease.expired
        try:
            mbytes = check_manifest(manifest, who)
            self._place(mbytes, [f.path for f in manifest.files] if node_files is None
                        else node_files)
            if protected:
                fence_protectors(self.storage, protected, lease)
            if fence is not None:
                fence()
            if node_files is None:
                self.refuse_dangling(manifest)
            marker = Marker(self.step, self.name, digest_bytes(MARKER_DIGEST_ALGORITHM, mbytes),
                            len(mbytes), manifest.created, who)
        except BaseException:
            self.discard()
            raise
        try:
            self.storage.create_exclusive(self.paths.marker, marker.to_bytes())
        except BaseException as exc:
            owner = self._marker_attempt()
            if owner == self.name:
                log.info("commit of step %d reported %r but the marker is ours", self.step, exc)
            elif isinstance(exc, CheckpointExistsError):
                self.discard()
                raise CheckpointExistsError(
                    f"step {self.step} at {storage_url(self.storage, self.paths.dir)} was "
                    f"committed by another writer while this one was saving; this attempt "
                    f"({self.name}) was discarded. If two jobs write the same run, stop the "
                    "stale one") from exc
            else:
                # Unknown outcome: keep the attempt (a marker may still name it); GC collects it.
                self._outcome_unknown = True
                raise
        self.committed = CheckpointInfo(self.step, self.name,
                                        storage_url(self.storage, self.final_dir), manifest,
                                        marker)
        log.info("committed step %d at %s (%d files, %d bytes)", self.step, self.storage.url,
                 len(manifest.files), manifest.total_bytes)
        if lease_expired is not None and lease_expired():
            confirm_after_lease(self.storage, self.committed, node_files)
        return self.committed

    def _place(self, mbytes: bytes, relpaths: Iterable[str]) -> None:
        """``MANIFEST.json`` written, the attempt renamed into place (local disk), and every
        directory entry leading to its files ``relpaths`` (those on this node) durable, with
        the data of the files whose fsync was left to this step (`batched`: the manifest's
        too)."""
        manifest_path = f"{self.write_dir}/{MANIFEST_NAME}"
        if self.batched:  # its fsync in the one step below
            retry_call(self.storage, "write", manifest_path,
                       lambda: self._write_unsynced(manifest_path, mbytes))
        else:
            self.storage.write_bytes(manifest_path, mbytes)
        if self.write_dir != self.final_dir:
            self.storage.rename_dir(self.write_dir, self.final_dir)
        if self.sync:
            # Every entry leading to this attempt's files, durable before the marker: its
            # files in its directory, the directory (renamed) in the step's, the step's in
            # checkpoints/, checkpoints/ in the run root (it may have just been created).
            # Done here, once each, after the data.  A rank's ``rank-00003/`` first (deepest
            # first), whoever wrote its files.  Batched: all at once, with the data of this
            # writer's small files and of the manifest (a journaling filesystem commits them
            # together); else one after the other (the first fsync commits every entry made
            # so far and the others find nothing left).
            dirs = [f"{self.final_dir}/{sub}" for sub in subdirectories(relpaths)]
            dirs += [self.final_dir, self.paths.dir, CHECKPOINTS_DIR, ""]
            if self.batched:
                with self._unsynced_lock:
                    files = [f"{self.final_dir}/{p}" for p in (*self._unsynced, MANIFEST_NAME)]
                self.storage.sync_paths(files, dirs)  # type: ignore[attr-defined]
            else:
                for d in dirs:
                    self.storage.sync_dir(d)

    def _write_unsynced(self, path: str, data: bytes) -> None:
        """A whole small document, its fsync left to `_place`'s one step."""
        with self.storage.open_write(path) as f:
            f.write(data)

    def retire(self, manifest: Manifest, written: Iterable[str]) -> None:
        """Place ``manifest`` (a format with references) and the files ``written`` of this
        attempt as a *retired* attempt: durable, under its final name, with no marker, as a
        prune leaves an attempt whose files committed checkpoints reference
        (docs/protocol.md §9.5).  A copy of a format v4 step whose referenced step the
        destination does not hold writes the referenced files so (`ckptfs.protocol.copy`);
        the copy's own commit, which references them, follows.  On any failure the attempt
        is discarded."""
        if manifest.step != self.step or manifest.attempt != self.name:
            raise AssertionError("the manifest is not this attempt's")  # pragma: no cover
        try:
            mbytes = check_manifest(manifest, writer_identity())
            self._place(mbytes, written)
        except BaseException:
            self.discard()
            raise

    def refuse_dangling(self, manifest: Manifest) -> None:
        """Every reference of ``manifest`` (formats with the ``references`` feature) resolves
        here: its file listed in its attempt, of the declared size, no link, in an attempt
        whose files may be referenced (`dangling_references`: one listing per referenced
        attempt); else the typed error of the first finding, and nothing is committed.  Run by
        `commit` after the manifest is durable and the fence (whose own errors, e.g. a gone
        protector that makes a save write every byte again, come first), before the marker,
        for every writer (a copy whose references still named the source's attempts committed a
        checkpoint that never loads).  Not run for a node-local sharded save
        (``node_files``): the other nodes' files are not on this node's storage."""
        refs = references_of(manifest)
        if not refs:
            return
        found = dangling_references(self.storage, refs)
        if found:
            raise found[0].error_at(
                self.storage, self.step,
                suffix=f" (a reference of step {self.step}, attempt {self.name}: it does not "
                       f"resolve at {self.storage.url}); nothing was committed")

    def _marker_attempt(self) -> str | None:
        try:
            marker = read_marker(self.storage, self.step)
        except Exception:
            return None
        return marker.attempt if marker is not None else None

    def discard(self) -> None:
        """Best effort: remove what this attempt wrote (GC catches what a crash leaves), and
        the step directory when that leaves it empty (local disk: ``rmdir``, which never
        removes what another writer of the step put in it meanwhile)."""
        for d in dict.fromkeys((self.write_dir, self.final_dir)):
            try:
                self.storage.delete_tree(d)
            except Exception:  # pragma: no cover - best effort, garbage collection retries
                log.warning("could not remove failed attempt %s",
                            storage_url(self.storage, d), exc_info=True)
        if supports(self.storage, EmptyDirRemoval):
            try:
                cast(EmptyDirRemoval, self.storage).remove_empty_dir(self.paths.dir)
            except Exception:  # best effort: gc removes an empty step directory too
                log.debug("step directory %s left in place",
                          storage_url(self.storage, self.paths.dir), exc_info=True)

    def reread(self) -> CheckpointInfo:
        """The committed checkpoint as a reader sees it (after `commit`)."""
        return read_committed(self.storage, self.step)


def fence_protectors(storage: Storage, protectors: Iterable[tuple[int, str]],
                     lease: Lease | None) -> None:
    """The fence before the marker of a writer that references stored bytes (docs/protocol.md
    §9.4): within its ``lease``, and every checkpoint it took references from (its
    *protectors*, ``(step, attempt)``) still committed by the same attempt; else
    `ProtectorGoneError` (the writer writes every byte again: `write_again_if_gone`)."""
    what = "save" if lease is None else lease.what
    if lease is not None and lease.expired():
        raise ProtectorGoneError(f"the {what} ran longer than its {lease.seconds:.0f} s lease")
    for pstep, pattempt in protectors:
        marker = read_marker(storage, pstep)
        if marker is None or marker.attempt != pattempt:
            raise ProtectorGoneError(
                f"step {pstep}, whose stored bytes this {what} references, was deleted "
                "while it was being written")


def confirm_after_lease(storage: Storage, info: CheckpointInfo,
                        node_files: Iterable[str] | None = None) -> None:
    """The marker of ``info`` landed after its writer's lease ran out (docs/protocol.md §9.4):
    a collector may have judged the writer abandoned and removed its attempt's files or files
    it references.  Every file of the checkpoint is listed again, its own (only ``node_files``
    when each rank wrote to its own node's storage) and every referenced one: if one is
    missing, of another size or a link, the marker is deleted (the checkpoint is not
    committed) and `CorruptCheckpointError` raised; else the checkpoint is as safe as any
    committed one from now on (a collector that reads its marker leaves it alone)."""
    wanted = None if node_files is None else set(node_files)
    own = [e for e in info.manifest.files if wanted is None or e.path in wanted]
    found = [p for p in problems(info, list_attempt(storage, info), own) if p.kind != "stray"]
    found += dangling_references(storage, references_of(info.manifest))
    if not found:
        return
    storage.delete(info.paths.marker)
    log.warning("%s: step %d uncommitted: its marker landed after the writer's lease and %s",
                storage.url, info.step, found[0].text)
    raise CorruptCheckpointError(
        f"{storage_url(storage, info.path)}: the writer outlived its lease and files of the "
        f"checkpoint were removed meanwhile ({found[0].text}); it was uncommitted: write it "
        "again", step=info.step, path=found[0].path)


def store_checksums_of(algorithms: Iterable[str], data: bytes | memoryview
                       ) -> tuple[tuple[str, str], ...]:
    """``(algorithm, hex)`` of each store checksum of a small document held in memory."""
    out = []
    for name in algorithms:
        h = new_store_hasher(name)
        h.update(data)
        out.append((name, h.hexdigest()))
    return tuple(out)


def subdirectories(relpaths: Iterable[str]) -> list[str]:
    """The directories (relative, every ancestor) holding ``relpaths``, deepest first."""
    dirs: set[str] = set()
    for p in relpaths:
        parts = p.split("/")[:-1]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(dirs, key=lambda d: (-d.count("/"), d))


def placeholder_digest(algorithm: str) -> str:
    """A digest of the right length, for `Attempt.check` before the real one is known."""
    return digest_bytes(algorithm, b"")


def check_manifest(manifest: Manifest, writer: Mapping[str, Any]) -> bytes:
    """Encode ``manifest`` and refuse it, with `UnsupportedValueError`, if a
    reader would refuse it or the marker that commits it (every limit of
    `ckptfs.format.limits`, by the reader's own decoder's rules: `check_committable`).
    Returns its bytes."""
    mbytes = manifest.to_bytes()
    check_committable(manifest, mbytes, where=f"MANIFEST.json of step {manifest.step}")
    marker = Marker(manifest.step, manifest.attempt,
                    digest_bytes(MARKER_DIGEST_ALGORITHM, b""), len(mbytes), manifest.created,
                    dict(writer))
    check_document_size(marker.to_bytes(), MAX_MARKER_BYTES, "the commit marker COMPLETE")
    return mbytes


# -- the single-process save (format v1; v3 with references) -------------------------------------


def plan_single_process(state: Mapping[str, Any], *, metadata: Mapping[str, Any] | None,
            shard_bytes: int = DEFAULT_SHARD_BYTES) -> tuple[StatePlan, dict[str, Any]]:
    """Validate and plan a single-process save: the serializer's plan (every value the format
    cannot hold refused, naming its key path) and the manifest metadata."""
    plan = plan_state(state, shard_bytes=shard_bytes)
    meta = {"tensor_count": plan.tensor_count, **dict(metadata or {})}
    check_metadata(meta)
    return plan, meta


#: The layouts whose placeholder manifest `check_plan` accepted in this process (the last
#: `_PASSED_KEEP`): a run saves the same layout at every step, and the verdict depends on
#: nothing else (`_plan_key`).  The commit checks every manifest it commits all the same.
_PASSED: dict[Any, None] = {}
_PASSED_KEEP = 64
_PASSED_LOCK = threading.Lock()


def _plan_key(step: int, plan: StatePlan, meta: Mapping[str, Any], algorithm: str) -> Any:
    """Everything the verdict of `check_plan` depends on: the files (paths, sizes), the
    metadata, the algorithm, and the widths of what varies in length (the step number, the
    writer's pid); the attempt's name and time are of fixed length.  None: not keyable (the
    check runs)."""
    try:
        meta_text = json.dumps(meta, sort_keys=True)
    except (TypeError, ValueError):
        return None
    return (algorithm, len(str(step)), meta_text, socket.gethostname(),
            len(str(os.getpid())), tuple((pf.path, pf.size) for pf in plan.files))


def check_plan(step: int, plan: StatePlan, meta: Mapping[str, Any], algorithm: str) -> None:
    """`Attempt.check` of a planned v1 save, without opening an attempt (an async save
    checks on the caller's thread, before it returns); a layout this process checked
    already (`_PASSED`) is not checked again."""
    key = _plan_key(step, plan, meta, algorithm)
    with _PASSED_LOCK:
        if key is not None and key in _PASSED:
            return
    check_manifest(v1_manifest(step, new_attempt_name(), algorithm, meta, now_text(),
                               [(pf.path, pf.size, placeholder_digest(algorithm))
                                for pf in plan.files]), writer_identity())
    if key is not None:
        with _PASSED_LOCK:
            _PASSED[key] = None
            while len(_PASSED) > _PASSED_KEEP:
                del _PASSED[next(iter(_PASSED))]


def v1_manifest(step: int, attempt: str, algorithm: str, meta: Mapping[str, Any],
                created: str, files: list[tuple[str, int, str]]) -> Manifest:
    """The format v1 manifest of ``files`` (path, size, ``"algorithm:hex"`` digest)."""
    return Manifest(step, attempt, tuple(FileEntry(p, s, d) for p, s, d in files), created,
                    algorithm, dict(meta))


def single_manifest(feats: frozenset[str], step: int, attempt: str, algorithm: str,
                    meta: Mapping[str, Any], created: str, files: Sequence[FileEntry],
                    references: Sequence[Reference] = ()) -> Manifest:
    """The manifest of a single-process save with the features ``feats``: chunked files and
    references (format v3) or whole files (format v1)."""
    return Manifest(step, attempt, tuple(files), created, algorithm, dict(meta), feats,
                    references=tuple(references))


def save_plan(storage: Storage, step: int, plan: StatePlan, meta: Mapping[str, Any],
              opts: SaveOptions, *, feats: frozenset[str] = frozenset(),
              references: Sequence[Reference] = (), protectors: Sequence[tuple[int, str]] = (),
              gate: FileGate | None = None, checked: bool = False) -> CheckpointInfo:
    """Write and commit a planned single-process save (the world of one): open the attempt,
    check its manifest before any byte, write the plan's files (several at once; chunked, a
    digest per tensor, with the ``chunked`` feature), commit.  An incremental save (format v3,
    `ckptfs.protocol.incremental`) passes the features ``{chunked, references}``, the plan
    laid out over the tensors it did not reuse, its ``references`` and the checkpoints they
    come from (``protectors``); the commit fences them (`fence_protectors`) within the lease
    of ``opts``.
    ``gate``: around each file's write (`Attempt.write_files`; ``plan.files`` order).
    ``checked``: the caller ran `check_plan` on this plan (a format v1 save prepared by
    `ckptfs.protocol.prepare`), so the attempt's own check before writing is not repeated:
    the same manifest but for the attempt's name and time, both of fixed length."""
    chunked = CHUNKED in feats
    pieces: list[Sequence[int] | None] = [None] * len(plan.files)
    if chunked:
        by_path = {tf.path: tf.pieces for tf in plan.tensor_files}
        pieces = [by_path.get(pf.path, [pf.size]) for pf in plan.files]
    algorithm = opts.algorithm
    with Attempt.open(storage, step, algorithm=algorithm, durable=opts.durable) as att:
        lease = Lease(opts.lease_s) if REFERENCES in feats else None
        created = now_text()
        hexd = placeholder_digest(algorithm)
        if not (checked and not feats and not references):
            att.check(single_manifest(feats, step, att.name, algorithm, meta, created, [
                make_entry(pf.path, pf.size, algorithm, placeholder_chunks(k, algorithm), None)
                if k is not None else FileEntry(pf.path, pf.size, hexd)
                for pf, k in zip(plan.files, pieces, strict=True)], references))
        written = att.write_files([(pf.path, pf.size, pf.chunks) for pf in plan.files],
                                  threads=opts.workers,
                                  pieces=pieces if chunked else None, gate=gate)
        return att.commit(single_manifest(feats, step, att.name, algorithm, meta, created, [
            w.chunked_entry(algorithm, k) if k is not None else w.entry(algorithm)
            for w, k in zip(written, pieces, strict=True)], references),
            protectors=protectors if references else (), lease=lease)


def placeholder_chunks(pieces: Sequence[int], algorithm: str) -> list[Chunk]:
    """Chunks of ``pieces`` with placeholder digests (`Attempt.check` of a chunked file)."""
    hexd = placeholder_digest(algorithm).split(":", 1)[1]
    out, pos = [], 0
    for length in pieces:
        out.append(Chunk(pos, length, hexd))
        pos += length
    return out


def save_checkpoint(
    storage: Storage,
    step: int,
    state: Mapping[str, Any],
    opts: SaveOptions | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> CheckpointInfo:
    """Validate, plan, write and commit ``state`` as the format v1 checkpoint of ``step``
    with the options ``opts`` (default: `SaveOptions` ())."""
    check_step(step)
    opts = SaveOptions() if opts is None else opts
    plan, meta = plan_single_process(state, metadata=metadata, shard_bytes=shard_bytes)
    return save_plan(storage, step, plan, meta, opts)
