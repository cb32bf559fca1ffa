"""The commit protocol: how a save becomes a committed checkpoint.

Design decision: **the commit is the exclusive creation of one small marker, on every backend.**
Rename is not atomic on object stores (it is copy + delete), so it cannot be the commit there;
making the marker the commit everywhere keeps one protocol and one proof.

A save of step N:

1. validates and plans the whole state and the metadata, and checks every size and depth limit
   a reader enforces (:mod:`ckptfs.format.limits`) on the manifest and marker it will write, so
   a value the format cannot hold, or a checkpoint a reader would refuse, fails here before any
   byte is written; and fails fast if step N is already committed;
2. picks a fresh *attempt* name (UTC time + 64 random bits), so its files can never mix with a
   crashed earlier attempt or a concurrent writer of the same step (a zombie job and its
   replacement);
3. writes the data files into the attempt directory, hashing every byte from memory as it is
   written (files in parallel), then ``MANIFEST.json`` listing every file's size and digest.  On
   local disk the attempt is written under a hidden ``.tmp-`` name, every file fsynced, then
   renamed into place and the step directory fsynced, so no partial attempt is ever visible;
4. creates ``step-N/COMPLETE`` *exclusively* (``link`` on local disk, ``If-None-Match: *`` on
   S3, ``ifGenerationMatch=0`` on GCS, ``If-None-Match`` on Azure) in one request.  The marker
   records the attempt and the manifest's digest, so it can only vouch for that manifest.

Exactly one writer's marker creation succeeds; the others get :class:`CheckpointExistsError` and
their attempt directory is removed.  A crash before step 4 leaves an uncommitted attempt that
readers skip and garbage collection removes.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, cast

from ckptfs.errors import CheckpointExistsError
from ckptfs.format.hashing import (
    DEFAULT_ALGORITHM,
    HASH_INLINE_BYTES,
    BackgroundHasher,
    digest_bytes,
    format_digest,
    new_hasher,
)
from ckptfs.format.layout import (
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    StepPaths,
    check_step,
    new_attempt_name,
)
from ckptfs.format.limits import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES
from ckptfs.format.manifest import (
    MARKER_DIGEST_ALGORITHM,
    FileEntry,
    Manifest,
    Marker,
    check_document_size,
    check_metadata,
)
from ckptfs.format.serialize import DEFAULT_SHARD_BYTES, PlannedFile, plan_state
from ckptfs.protocol.resolve import CheckpointInfo, read_marker, storage_url
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")


def default_threads() -> int:
    return max(2, min(8, (os.cpu_count() or 2)))


#: How far (in bytes) the writer may run ahead of the hasher.  Chunks are views of the tensors'
#: own memory, so a lead costs no copies; the bound only matters for tensors that had to be
#: copied (GPU, non-contiguous), which stay alive until hashed.
MAX_HASH_LEAD = 256 * 1024 * 1024

#: The most bytes a save's parallel streaming writes may hold in buffers at once (object
#: stores: each open stream holds ``storage.stream_buffer_bytes``, its part buffers).  A save
#: opens at most ``WRITE_BUFFER_BUDGET // stream_buffer_bytes`` files at a time (at least one),
#: so its extra memory stays under the 64 MiB + 5% bound however many threads it has.
WRITE_BUFFER_BUDGET = 64 * 1024 * 1024


def write_streams(storage: Storage, nthreads: int, nfiles: int,
                  budget: int = WRITE_BUFFER_BUDGET) -> int:
    """How many files a save writes at once: the threads asked for, no more than the files, and
    no more than the storage's streams that fit in ``budget`` bytes of part buffers."""
    per_stream = int(getattr(storage, "stream_buffer_bytes", 0) or 0)
    n = max(1, min(nthreads, nfiles))
    if per_stream > 0:
        n = min(n, max(1, budget // per_stream))
    return n


def _write_planned(storage: Storage, path: str, pf: PlannedFile, algorithm: str,
                   durable: bool) -> FileEntry:
    """Write one planned file and hash every byte from memory as it is written.

    Writing and hashing overlap: this thread writes, fsyncs (durable) and closes (the last
    part upload and its completion on object stores) while a helper thread hashes the same
    chunks, so the hash hides behind the write, the upload or the fsync wait instead of adding
    to it.  Nothing written is ever read back."""
    hasher = new_hasher(algorithm)
    written = 0
    with BackgroundHasher(hasher, max_lead=MAX_HASH_LEAD,
                          background=pf.size > HASH_INLINE_BYTES) as bg, \
            storage.open_write(path) as f:
        for chunk in pf.chunks():
            bg.feed(chunk)
            f.write(chunk)
            written += len(chunk)
        if durable and storage.capabilities.fsync:
            f.fsync()  # type: ignore[attr-defined]
    if written != pf.size:  # pragma: no cover - a planning bug, never user input
        raise AssertionError(f"{path}: planned {pf.size} bytes, wrote {written}")
    return FileEntry(pf.path, written, format_digest(algorithm, hasher.hexdigest()))


def _write_file(storage: Storage, path: str, pf: PlannedFile, algorithm: str,
                durable: bool) -> FileEntry:
    """:func:`_write_planned`, repeated from the first byte when the storage offers bounded
    retries (:class:`~ckptfs.storage.retry.RetryingStorage`) and the failure is transient.  A
    planned file regenerates its chunks from memory, so a failed stream is replayed without
    having kept a copy of it."""
    retry = getattr(storage, "retry_call", None)
    if retry is None:
        return _write_planned(storage, path, pf, algorithm, durable)
    return cast(FileEntry, retry("write", path,
                                 lambda: _write_planned(storage, path, pf, algorithm, durable)))


def save_checkpoint(
    storage: Storage,
    step: int,
    state: Mapping[str, Any],
    *,
    algorithm: str = DEFAULT_ALGORITHM,
    durable: bool = True,
    threads: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> CheckpointInfo:
    check_step(step)
    new_hasher(algorithm)  # unknown/missing algorithm: fail before writing
    plan = plan_state(state, shard_bytes=shard_bytes)
    meta = dict(metadata or {})
    manifest_meta = {"tensor_count": plan.tensor_count, **meta}
    check_metadata(manifest_meta)
    attempt = new_attempt_name()
    writer = {"host": socket.gethostname(), "pid": os.getpid()}
    _check_documents(step, attempt, plan.files, algorithm, manifest_meta, writer)

    caps = storage.capabilities
    paths = StepPaths(step)
    if storage.exists(paths.marker):
        raise CheckpointExistsError(
            f"step {step} is already committed at {storage_url(storage, paths.dir)}; a committed "
            "checkpoint is never overwritten: save under a new step, or delete it first "
            f"('store.delete({step})')")

    final_dir = paths.attempt_dir(attempt)
    write_dir = paths.tmp_attempt_dir(attempt) if caps.atomic_rename else final_dir
    sync = durable and caps.fsync

    try:
        storage.makedirs(write_dir)
        if sync:
            storage.sync_dir("")  # the run root may have just gained checkpoints/
            storage.sync_dir(CHECKPOINTS_DIR)
            storage.sync_dir(paths.dir)
        nthreads = write_streams(storage, threads or default_threads(), len(plan.files))
        if nthreads > 1:
            with ThreadPoolExecutor(nthreads, thread_name_prefix="ckptfs-save") as pool:
                futures = [pool.submit(_write_file, storage, f"{write_dir}/{pf.path}", pf,
                                       algorithm, sync) for pf in plan.files]
                entries = [fut.result() for fut in futures]
        else:
            entries = [_write_file(storage, f"{write_dir}/{pf.path}", pf, algorithm, sync)
                       for pf in plan.files]

        created = _now()
        manifest = Manifest(step, attempt, tuple(entries), created, algorithm, manifest_meta)
        mbytes = manifest.to_bytes()
        check_document_size(mbytes, MAX_MANIFEST_BYTES, "MANIFEST.json")  # predicted above
        storage.write_bytes(f"{write_dir}/{MANIFEST_NAME}", mbytes)
        if sync:
            storage.sync_dir(write_dir)
        if caps.atomic_rename:
            storage.rename_dir(write_dir, final_dir)
            if sync:
                storage.sync_dir(paths.dir)

        marker = Marker(step, attempt, digest_bytes(MARKER_DIGEST_ALGORITHM, mbytes),
                        len(mbytes), created, writer)
    except BaseException:
        _discard_attempt(storage, write_dir, final_dir)
        raise
    try:
        storage.create_exclusive(paths.marker, marker.to_bytes())
    except BaseException as exc:
        # The outcome of the commit request itself can be ambiguous (a retried PUT whose first
        # try succeeded answers 412; a timeout may hide a success): the marker decides.
        owner = _marker_attempt(storage, step)
        if owner == attempt:
            log.info("commit of step %d reported %r but the marker is ours", step, exc)
        elif isinstance(exc, CheckpointExistsError):
            _discard_attempt(storage, final_dir)
            raise CheckpointExistsError(
                f"step {step} at {storage_url(storage, paths.dir)} was committed by another "
                f"writer while this one was saving; this attempt ({attempt}) was discarded. If "
                "two jobs write the same run, stop the stale one") from exc
        else:
            # Unknown outcome: keep the attempt (a marker may still name it); GC collects it.
            raise
    log.info("committed step %d at %s (%d files, %d bytes)", step, storage.url, len(entries),
             manifest.total_bytes)
    return CheckpointInfo(step, attempt, storage_url(storage, final_dir), manifest, marker)


def _marker_attempt(storage: Storage, step: int) -> str | None:
    try:
        marker = read_marker(storage, step)
    except Exception:
        return None
    return marker.attempt if marker is not None else None


def _check_metadata(meta: Mapping[str, Any]) -> None:
    """Kept for callers that validate before saving (async saves): :func:`check_metadata`."""
    check_metadata(meta)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _check_documents(step: int, attempt: str, files: list[PlannedFile], algorithm: str,
                     meta: dict[str, Any], writer: dict[str, Any]) -> None:
    """Build the manifest and marker this save will write, with placeholder digests of the
    right length (every file's size is already known from the plan), and refuse the save now,
    before any write, if a reader would refuse either of them for its size."""
    digest = digest_bytes(algorithm, b"")
    entries = tuple(FileEntry(pf.path, pf.size, digest) for pf in files)
    created = _now()
    mbytes = Manifest(step, attempt, entries, created, algorithm, meta).to_bytes()
    check_document_size(mbytes, MAX_MANIFEST_BYTES, "MANIFEST.json")
    marker = Marker(step, attempt, digest_bytes(MARKER_DIGEST_ALGORITHM, b""), len(mbytes),
                    created, writer)
    check_document_size(marker.to_bytes(), MAX_MARKER_BYTES, "the commit marker COMPLETE")


def _discard_attempt(storage: Storage, *dirs: str) -> None:
    """Best effort: a failed save removes what it wrote (GC catches what a crash leaves)."""
    for d in dict.fromkeys(dirs):
        try:
            storage.delete_tree(d)
        except Exception:  # pragma: no cover - best effort, garbage collection retries
            log.warning("could not remove failed attempt %s", storage_url(storage, d),
                        exc_info=True)
