"""Replicating a sharded checkpoint whose ranks wrote to their own nodes' disks (docs/tiers.md
"Sharded").

Under torch.distributed, the local tier of a two-tier store is each node's own disk: the
coordinator's holds the step's marker, ``MANIFEST.json``, ``dcp.msgpack`` and its rank file;
every other node holds only its own rank file, in the same attempt directory.  So no single
process can copy the step: **each rank uploads its own files, and the coordinator commits the
remote copy once every rank has** (the same single exclusive commit as a sharded save).

Design decision: **a dedicated gloo process group, collectives from each rank's replication
thread** (the group's JSON messages, ``ckptfs.protocol.group``: plans, reports and errors are
documents, never pickles), rather than receipts written to storage.  Receipts would have to
live somewhere on the remote (new files in the step's layout: a protocol change, and listings
that see them as stray), and a rank waiting for receipts polls storage with its own timeout;
the group gives agreement, one timeout (``timeout``: a dead rank fails the collective on every
survivor instead of hanging it) and no new file.  It is created when the store is opened
(collectively, on the calling thread), used only by the replication threads, and every rank
processes the same steps in the same order: the coordinator's open-time scan is broadcast,
every rank enqueues each step its collective save returns, and each worker takes the oldest
pending step.

One step, on every rank (`ShardedCopier`)::

    coordinator   reads its local marker and manifest; the remote already holds the step?
                  (the same content: "identical"; other content: CheckpointExistsError);
                  dcp.msgpack decoded as a load would; a v4 reference remapped to the remote's
                  copy of the step it names (that copy must hold the same chunks, each read
                  and checked there: copy.references_at, as ckptfs cp does); opens the
                  remote attempt (Attempt.open) and checks the manifest it will commit
    broadcast     the plan: the local manifest and the remote attempt name (or the outcome)
    every rank    lists its own files on its own node (links, missing, resized: refused), then
                  streams each into the remote attempt (Attempt.join) with ckptfs cp's
                  per-file copy (copy.copy_file: hashed while written, compared with the
                  manifest), then lists them at the remote
    all_gather    each rank's success or error
    coordinator   every rank succeeded: one listing of the remote attempt, the fence (a
                  referenced remote step still committed), Attempt.commit (marker last);
                  else the attempt is discarded: no remote commit for the step
    broadcast     the outcome: every rank returns the same result or raises the same error
                  class, so every rank's replicator retries, fails or moves on alike

A rank that fails its upload (its node's file corrupt, the remote refusing it) means no remote
commit for that step, and the previous remote step stays the latest; a storage error is
retried (every rank again, after the same backoff), corruption fails the step.  A rank that
dies or hangs fails the collective on the survivors after ``timeout``: their replication stops
(`ReplicationStopped`, status ``dead``) and the next open
of the store queues what is missing again; an uncommitted remote attempt is collected by gc.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptfs.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ReplicationError,
    StorageError,
)
from ckptfs.format.layout import StepPaths
from ckptfs.format.manifest import Manifest, Marker
from ckptfs.format.sharded import ChunkedFileEntry
from ckptfs.format.versions import decode_manifest, is_sharded
from ckptfs.protocol.commit import Attempt
from ckptfs.protocol.copy import (
    CopyResult,
    Progress,
    check_stored_checksums,
    committed_at,
    copy_file,
    copy_step,
    references_at,
    references_fence,
    same_content,
)
from ckptfs.protocol.group import RankGroup, describe, gloo_group, rebuild
from ckptfs.protocol.listing import check_listing
from ckptfs.protocol.replication import ReplicationStopped, StepGone
from ckptfs.protocol.resolve import CheckpointInfo, read_committed, read_marker
from ckptfs.protocol.sharded_io import check_written
from ckptfs.protocol.sharded_read import read_document
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")

#: How long a rank's replication thread waits in a collective for its peers (one step's upload
#: on the slowest rank included) before it gives up: the replication stops in this process.
REPLICATE_TIMEOUT = timedelta(minutes=30)


def replication_group(timeout: timedelta = REPLICATE_TIMEOUT) -> Any:
    """The dedicated gloo group of a sharded store's replication threads (every rank calls it,
    on its main thread, when the store is opened)."""
    return gloo_group(timeout, what="creating the sharded replication's gloo group")


def settle_node_attempt(storage: Storage, step: int, attempt: str, *, durable: bool) -> None:
    """On a node whose rank wrote into the attempt under its hidden name (local disk writes an
    attempt under ``.tmp-``; the coordinator's commit renames only its own node's), give it its
    final name, so every node holds its files at the committed attempt's path.  Nothing to do
    on the coordinator's node, on shared storage, or where the attempt is final already."""
    if not storage.capabilities.atomic_rename:
        return
    paths = StepPaths(step)
    tmp, final = paths.tmp_attempt_dir(attempt), paths.attempt_dir(attempt)
    if storage.exists(tmp) and not storage.exists(final):
        storage.rename_dir(tmp, final)
        if durable and storage.capabilities.fsync:
            storage.sync_dir(paths.dir)


def own_files(manifest: Manifest, rank: int, coordinator: bool
              ) -> list[ChunkedFileEntry]:
    """The files of ``manifest`` that ``rank`` wrote (its rank files; the coordinator also
    ``dcp.msgpack``): what it holds on its own node."""
    return [e for e in manifest.files if isinstance(e, ChunkedFileEntry)
            and (e.rank == rank or (e.rank is None and coordinator))]


def info_doc(info: CheckpointInfo) -> dict[str, Any]:
    """A committed checkpoint as a message between ranks (`info_of` reads it): its manifest
    and marker as the bytes they are stored as."""
    return {"step": info.step, "attempt": info.attempt, "url": info.url,
            "dir_name": info.dir_name, "manifest": info.manifest.to_bytes().decode(),
            "marker": info.marker.to_bytes().decode()}


def info_of(doc: Mapping[str, Any]) -> CheckpointInfo:
    """The `CheckpointInfo` of `info_doc`, its manifest and marker read by the reader's own
    decoders."""
    return CheckpointInfo(
        int(doc["step"]), str(doc["attempt"]), str(doc["url"]),
        decode_manifest(str(doc["manifest"]).encode(), where=f"{doc['url']} (as sent)"),
        Marker.from_bytes(str(doc["marker"]).encode(), where=f"{doc['url']} (as sent)"),
        str(doc["dir_name"]))


@dataclasses.dataclass
class _Plan:
    status: str  # "copy" | "done" | "gone" | "error"
    source: CheckpointInfo | None = None
    manifest: Manifest | None = None  # the one the remote attempt will commit
    result: CopyResult | None = None
    error: dict[str, Any] | None = None  # `describe`

    def to_doc(self) -> dict[str, Any]:
        return {"status": self.status,
                "source": None if self.source is None else info_doc(self.source),
                "manifest": None if self.manifest is None else self.manifest.to_bytes().decode(),
                "result": None if self.result is None else self.result.as_dict(),
                "error": self.error}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> _Plan:
        manifest = None
        if doc["manifest"] is not None:
            manifest = decode_manifest(
                str(doc["manifest"]).encode(), where="the remote manifest (as sent)")
        return cls(str(doc["status"]),
                   None if doc["source"] is None else info_of(doc["source"]), manifest,
                   None if doc["result"] is None else CopyResult(**doc["result"]),
                   doc["error"])


@dataclasses.dataclass(frozen=True)
class _Upload:
    """One rank's report after uploading its files of a step."""

    error: dict[str, Any] | None = None  # `describe`
    #: path -> the remote store's checksums of the file, computed while sending it.
    sums: dict[str, tuple[tuple[str, str], ...]] = dataclasses.field(default_factory=dict)
    #: (objects whose stored checksum matched, objects the store cannot vouch for).
    verified: tuple[int, int] = (0, 0)

    def to_doc(self) -> dict[str, Any]:
        return {"error": self.error, "sums": {p: [list(c) for c in cs]
                                              for p, cs in self.sums.items()},
                "verified": list(self.verified)}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> _Upload:
        sums = {str(p): tuple((str(a), str(v)) for a, v in cs)
                for p, cs in doc["sums"].items()}
        ok, unvouched = doc["verified"]
        return cls(doc["error"], sums, (int(ok), int(unvouched)))


def rebuild_error(doc: Mapping[str, Any]) -> Exception:
    """The error a rank reported (`describe`), as the same class here, so every rank's
    replicator decides alike (retry or fail, as for a copy in one process); a class that
    cannot be rebuilt becomes `ReplicationError` (not retried)."""
    err = rebuild(doc)
    if isinstance(err, Exception):
        return err
    return ReplicationError(f"{doc.get('name')}: {doc.get('message')}")


class ShardedCopier:
    """The per-rank copier of a sharded two-tier store (module docstring); a
    `Copier` for the `Replicator`."""

    def __init__(self, local: Storage, remote: Storage, group: Any, *, durable: bool = True,
                 threads: int = 2) -> None:
        self.local = local
        self.remote = remote
        self.group = group
        self.durable = durable
        self.threads = threads
        self.rank = dist.get_rank()
        self.messages = RankGroup(group)
        self.coordinator = self.messages.coordinator
        self._att: Attempt | None = None

    # -- collectives (any failure: the group is unusable, replication stops here) ------------

    def _bcast(self, doc: Any) -> Any:
        try:
            return self.messages.broadcast(doc)
        except TypeError:
            raise  # a payload that is not JSON: a ckptfs bug, raised on the sender
        except Exception as exc:
            raise self._stopped(exc) from exc

    def _gather(self, doc: Any) -> list[Any]:
        try:
            return self.messages.all_gather(doc)
        except TypeError:
            raise
        except Exception as exc:
            raise self._stopped(exc) from exc

    def _stopped(self, exc: BaseException) -> ReplicationStopped:
        if self._att is not None:
            self._att.discard()
            self._att = None
        return ReplicationStopped(
            f"the replication collective to {self.remote.url} failed on rank {self.rank} "
            f"({type(exc).__name__}: {exc}): a rank died or hung past the timeout; nothing "
            "more is replicated by this process (open the store again to resume)")

    def broadcast_scan(self, scan: Any) -> Any:
        """The coordinator's open-time scan (JSON: lists, or the refusal's message), to every
        rank (on the calling thread)."""
        return self._bcast(scan)

    # -- one step --------------------------------------------------------------------------------

    def __call__(self, step: int, progress: Progress) -> CopyResult:
        own = self._plan(step) if self.coordinator else None
        sent = self._bcast(None if own is None else own.to_doc())
        plan = own if own is not None else _Plan.from_doc(sent)
        if plan.status == "gone":
            raise StepGone(f"step {step} is not committed on the coordinator's local tier")
        if plan.status == "error" and plan.error is not None:
            raise rebuild_error(plan.error)
        if plan.status == "done":
            assert plan.result is not None
            return plan.result
        mine: _Upload = _Upload()
        try:
            mine = self._upload(plan, progress)
        except Exception as exc:
            log.error("rank %d: uploading its files of step %d to %s failed: %s: %s",
                      self.rank, step, self.remote.url, type(exc).__name__, exc)
            mine = _Upload(error=describe(exc))
        reports = [_Upload.from_doc(d) for d in self._gather(mine.to_doc())]
        outcome = self._finish(plan, reports) if self.coordinator else None
        kind, payload = self._bcast(None if outcome is None else
                                    [outcome[0], outcome[1] if outcome[0] == "error"
                                     else outcome[1].as_dict()])
        if kind == "error":
            raise rebuild_error(payload)
        return CopyResult(**payload)

    def _plan(self, step: int) -> _Plan:
        """The coordinator's part before any upload (module docstring)."""
        try:
            try:
                info = read_committed(self.local, step)
            except CheckpointNotFoundError:
                if read_marker(self.local, step) is None:
                    return _Plan("gone")
                raise
            manifest = info.manifest
            if not is_sharded(manifest):  # saved by one process: cp's copy
                return _Plan("done", result=copy_step(self.local, self.remote, step,
                                                      durable=self.durable,
                                                      threads=self.threads))
            existing = committed_at(self.remote, step)
            if existing is not None:
                if same_content(existing.manifest, manifest):
                    return _Plan("done", result=CopyResult(
                        step, "identical", existing.attempt, len(manifest.files), info.bytes))
                raise CheckpointExistsError(
                    f"step {step} is already committed at {existing.url} with different "
                    f"content than {info.url}; a committed checkpoint is never overwritten")
            read_document(self.local, info)  # what a load refuses, the copy refuses
            remote_manifest, _ = references_at(self.remote, manifest)
            att = Attempt.open(self.remote, step, algorithm=manifest.hash_algorithm,
                               durable=self.durable)
            self._att = att
            remote_manifest = dataclasses.replace(remote_manifest, attempt=att.name)
            att.check(remote_manifest, world_size=manifest.world_size)
            return _Plan("copy", source=info, manifest=remote_manifest)
        except Exception as exc:
            if self._att is not None:
                self._att.discard()
                self._att = None
            return _Plan("error", error=describe(exc))

    def _upload(self, plan: _Plan, progress: Progress) -> _Upload:
        """This rank's files, from its own node to the remote attempt; each object's checksum
        as the remote keeps it compared with the one computed while sending
        (`check_stored_checksums`, as every replica)."""
        source, manifest = plan.source, plan.manifest
        assert source is not None and manifest is not None
        mine = own_files(source.manifest, self.rank, self.coordinator)
        if not mine:
            return _Upload()
        settle_node_attempt(self.local, source.step, source.attempt, durable=self.durable)
        check_listing(self.local, source, files=mine)  # links, missing, resized: refused
        att = Attempt.join(self.remote, source.step, manifest.attempt,
                           algorithm=manifest.hash_algorithm, durable=self.durable)
        written = []
        for entry in sorted(mine, key=lambda e: -e.size):
            written.append(copy_file(self.local, source.path, att, entry, progress=progress))
            att.sync_file_dir(entry.path)
        check_written(self.remote, att.write_dir, [(e.path, e.size, e.rank) for e in mine],
                      step=source.step, who=f"rank {self.rank} sees at the remote")
        verified = check_stored_checksums(self.remote, att, written)
        return _Upload(sums={w.path: w.store_checksums for w in written}, verified=verified)

    def _finish(self, plan: _Plan, reports: list[_Upload]) -> tuple[str, Any]:
        """The coordinator commits the remote attempt if every rank uploaded its files; the
        manifest records the remote store's checksums the ranks computed while uploading."""
        att, source, manifest = self._att, plan.source, plan.manifest
        self._att = None
        assert att is not None and source is not None and manifest is not None
        failed = {r: u.error for r, u in enumerate(reports) if u.error is not None}
        sums = {p: c for u in reports for p, c in u.sums.items()}
        manifest = dataclasses.replace(manifest, files=tuple(
            dataclasses.replace(e, store_checksums=sums.get(e.path, ()))
            for e in manifest.files))
        verified = (sum(u.verified[0] for u in reports), sum(u.verified[1] for u in reports))
        if failed:
            att.discard()
            permanent = [e for e in failed.values()
                         if not isinstance(rebuild_error(e), StorageError)]
            chosen = (permanent or list(failed.values()))[0]
            return "error", {**chosen, "message": (
                f"no remote commit of step {source.step}: rank(s) {sorted(failed)} could not "
                "upload their files: " + "; ".join(f"rank {r}: {e.get('name')}: "
                                                    f"{e.get('message')}"
                                                    for r, e in sorted(failed.items())))}
        try:
            with att:
                check_written(self.remote, att.write_dir,
                              [(e.path, e.size, e.rank) for e in manifest.files
                               if isinstance(e, ChunkedFileEntry)],
                              step=source.step, who="the coordinator sees at the remote")
                out = att.commit(manifest, fence=references_fence(self.remote, manifest),
                                 world_size=manifest.world_size, copied_from=source.url)
        except CheckpointExistsError as exc:
            winner = committed_at(self.remote, source.step)
            if winner is not None and same_content(winner.manifest, source.manifest):
                return "ok", CopyResult(source.step, "identical", winner.attempt,
                                        len(manifest.files), source.bytes)
            return "error", describe(exc)
        except Exception as exc:
            return "error", describe(exc)
        log.info("replicated sharded step %d to %s (%d ranks uploaded their files)",
                 source.step, self.remote.url, len(reports))
        return "ok", CopyResult(source.step, "copied", out.attempt, len(manifest.files),
                                source.bytes, *verified)

