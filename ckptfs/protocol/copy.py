"""Copying a committed checkpoint into another run root (``ckptfs cp``, the replicator of a
two-tier store, and the per-rank replica of a sharded one), under the commit protocol.

Design decision: **a copy is a new save of the same bytes, not a file transfer.**  It opens an
`Attempt` at the destination (a fresh attempt name, never the source's: an interrupted
earlier copy, or a concurrent one, can then never share a path with this one), streams every
file from the source through it (hashed while written, as every save is), and refuses a file
whose size or digest differs from the source's manifest before anything is committed.  Before
anything is written at the destination, the source is checked as a load checks it
(`check_checkpoint`: the listing, every document decoded, every tensor file's header), so
copying a source that a reader refuses fails with the error the load raises and commits
nothing.  Then it commits the source manifest with only ``attempt`` changed (files, digests,
metadata, ``created`` are the source's), so a copy is either committed whole or absent, and
every reader limit is checked by the same commit as any save.  A destination step that is
already committed is left alone: the copy succeeds only if it holds the same content (same
files with the same digests, same metadata), else `CheckpointExistsError`.

**One copier over the world size** (`StepCopier`, over a `Group`): ``copy_step`` is the world
of one (``ckptfs cp``, the replicator of a single-process store); a sharded two-tier store's
replicator is every rank of a dedicated gloo group, each holding its own rank files on its own
node's disk (docs/tiers.md "Sharded").  One step, on every rank::

    coordinator   reads the source's marker and manifest; the destination holds the step?
                  (the same content: "identical"; other content: CheckpointExistsError);
                  the source checked as a load checks it (where the coordinator holds every
                  file; else its documents, and each rank lists its own files); references
                  remapped to the destination's own bytes (format v3: `_plan_referencing`; v4:
                  `references_at`), each chunk reused there read and checked first; opens the
                  destination attempt (Attempt.open) and checks the manifest it will commit
    broadcast     the plan: the source checkpoint and the attempt name (or the outcome); for
                  a format v5 source whose files lie on the ranks' nodes, first "expand":
                  every rank gathers every rank's index (`expand_over`), the coordinator plans
                  over that view, and the plan is broadcast then
    every rank    copies the files it holds (a world of one: all of them; a rank of a sharded
                  store: its own rank files, the coordinator also dcp.msgpack and anything
                  rank-less) with `copy_file` (hashed while written, compared with the source
                  manifest), then compares what the destination store keeps of each
                  (``check_stored``: `check_stored_checksums`)
    all_gather    each rank's report (its files' store checksums) or error
    coordinator   every rank succeeded: one listing of the attempt, Attempt.commit (the fence
                  of the destination steps it references and the lease, `fence_protectors`;
                  every reference resolves there; marker last); a lost marker race settled by
                  `settle_lost_race` (the winner holds the same content: "identical"); else
                  the attempt is discarded
    broadcast     the outcome: every rank returns the same result or raises the same error
                  class (so every rank's replicator retries, fails or moves on alike)

A referenced destination step deleted before the marker, or a copy that outlived its lease
while a collector removed what it references, is copied again once on every rank
(`write_again_if_gone`), referencing nothing it does not have to.  A source step not (or no
longer) committed is `StepGone` on every rank (a replicator drops it); a collective that fails
(a rank died or hung past the group's timeout) is `ReplicationStopped` on the survivors.

An incremental checkpoint (format v3, docs/protocol.md §9) references files of other attempts
of its run, which the destination does not have.  Its copy is a v3 checkpoint that holds every
byte it uses itself, or references only the destination's own committed checkpoint:

* a tensor file the state document names (one of the source's own files, or a reference's
  ``path``) whose tensors the destination's latest committed v3 checkpoint already holds, all of
  them in one file, under the same names and the same digests (same algorithm, length, dtype
  and shape), becomes a reference to that file at the destination (decided by digest, as an
  incremental save decides; that checkpoint is the copy's *protector*, fenced before the marker
  exactly as a save's: `ckptfs.protocol.incremental.index_of`, ``Attempt.commit(protectors=)``);
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
behind the fence of those steps.  Where the destination holds no committed copy of that step
and the coordinator holds every source file, the referenced files are copied from the source
into a *retired* attempt of that step there (`Attempt.retire`: files and manifest, no marker,
as a prune leaves one), which the references name; a failed copy removes it.  Whatever the
writer, the commit refuses a reference that does not resolve at the destination, before the
marker (`Attempt.commit`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from ckptfs.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    ReplicationError,
    StorageError,
)
from ckptfs.format.content import same_content as same_content  # shared: cp, tiers, walk
from ckptfs.format.hashing import ALGORITHMS
from ckptfs.format.incremental import (
    DEFAULT_LEASE_S,
    Reference,
    references_of,
)
from ckptfs.format.layout import StepPaths
from ckptfs.format.manifest import FileEntry, Manifest
from ckptfs.format.serialize import HeaderEntry
from ckptfs.format.sharded import Chunk, ChunkedFileEntry, make_entry
from ckptfs.format.versions import REFERENCES, features, has_rank_metadata, is_sharded
from ckptfs.protocol.chunks import StoredChunks, check_digest, check_streamed, chunk_pieces
from ckptfs.protocol.commit import (
    Attempt,
    Lease,
    ProtectorGoneError,
    placeholder_digest,
    settle_lost_race,
    write_again_if_gone,
)
from ckptfs.protocol.copy_io import (
    COPY_CHUNK,
    COPY_HASH_LEAD,
    Progress,
    check_copied,
    check_listed,
    check_stored_checksums,
    committed_at,
    copy_file,
    discard_unreferenced,
    reference_protectors,
    references_at,
    source_chunks,
)
from ckptfs.protocol.formats import check_checkpoint
from ckptfs.protocol.group import Group, Outcomes, WorldOfOne, carried, describe
from ckptfs.protocol.incremental import (
    ReuseIndex,
    ReuseMemory,
    Stored,
    index_of,
    stored_chunk_intact,
)
from ckptfs.protocol.listing import check_listing
from ckptfs.protocol.reader import CheckedSingleProcess, local_header, reference_chunks
from ckptfs.protocol.resolve import (
    CheckpointInfo,
    read_committed,
    read_marker,
    resolve_latest,
    storage_url,
)
from ckptfs.storage.base import Storage
from ckptfs.storage.deadline import Deadline, bounded, check_deadline

log = logging.getLogger("ckptfs")


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


class StepGone(CheckpointNotFoundError):
    """The step is not (or no longer) committed at the source: never committed, or deleted
    before or during the copy.  Nothing was committed at the destination; a replicator drops
    the step instead of failing it."""


class ReplicationStopped(ReplicationError):
    """A copier cannot go on in this process (its collective broke: a rank died or timed
    out): the replicator's worker stops, its status says ``dead``, and the next open of the
    store resumes."""


def copy_step(src: Storage, dst: Storage, step: int, *, durable: bool = True, threads: int = 4,
              progress: Progress | None = None, check_stored: bool = False,
              deadline_s: float | None = None) -> CopyResult:
    """Copy the committed ``step`` of ``src`` to ``dst`` (see the module docstring): the world
    of one of `StepCopier`.  The copy's manifest records the destination store's own
    checksums of the files it wrote, computed while writing (docs/remote-verify.md).
    ``check_stored``: before the marker, compare them with what the destination store keeps
    (one metadata request per file; where it offers `ServerChecksums`): a difference is a
    `StorageError` and nothing is committed.  ``deadline_s``: the copy commits or raises
    `SaveDeadlineError` within this many seconds (docs/reliability.md "Bounded saves")."""
    return StepCopier(src, dst, WorldOfOne(), durable=durable, threads=threads,
                      check_stored=check_stored, deadline_s=deadline_s)(step, progress)


# -- the copier ----------------------------------------------------------------------------------


def own_files(manifest: Manifest, rank: int, coordinator: bool) -> list[FileEntry]:
    """The files of a sharded ``manifest`` that ``rank`` wrote (its rank files; the
    coordinator also ``dcp.msgpack`` and anything else rank-less): what it holds on its own
    node."""
    def owner(e: FileEntry) -> int | None:
        return e.rank if isinstance(e, ChunkedFileEntry) else None

    return [e for e in manifest.files
            if owner(e) == rank or (owner(e) is None and coordinator)]


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


def rebuild_error(doc: Mapping[str, Any]) -> Exception:
    """The error a rank reported (`describe`), as the same class here, so every rank decides
    alike (retry or fail, as for a copy in one process); a class that cannot be rebuilt
    becomes `ReplicationError` (not retried): `group.carried` with that default."""
    err = carried(doc, ReplicationError)
    if isinstance(err, Exception):
        return err
    return ReplicationError(f"{doc.get('name')}: {doc.get('message')}")


@dataclasses.dataclass
class _ReferencingPlan:
    """What the coordinator decided for a format v3 step: the source's own files copied, the
    references materialized, and the references to the destination's own bytes."""

    copies: list[ChunkedFileEntry]
    mats: list[_Materialized]
    refs: list[Reference]


@dataclasses.dataclass
class _Plan:
    """The coordinator's plan of one step (it alone holds it; the other ranks get `doc`)."""

    source: CheckpointInfo
    att: Attempt
    #: The manifest to commit (attempt: ``att``'s; references: the destination's).
    manifest: Manifest
    writer: dict[str, Any]
    retired: list[Attempt] = dataclasses.field(default_factory=list)
    protectors: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    lease: Lease | None = None
    v3: _ReferencingPlan | None = None

    def doc(self) -> dict[str, Any]:
        return {"status": "copy", "source": self.source.to_doc(), "attempt": self.att.name}


@dataclasses.dataclass
class _Part:
    """What one rank copied of a step: its report to the coordinator (`doc`), and, on the
    coordinator, the entries it wrote (format v3: they make the manifest)."""

    sums: dict[str, tuple[tuple[str, str], ...]] = dataclasses.field(default_factory=dict)
    verified: tuple[int, int] = (0, 0)
    entries: list[FileEntry] = dataclasses.field(default_factory=list)

    def doc(self) -> dict[str, Any]:
        return {"sums": {p: [list(c) for c in cs] for p, cs in self.sums.items()},
                "verified": list(self.verified)}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> _Part:
        sums = {str(p): tuple((str(a), str(v)) for a, v in cs)
                for p, cs in doc["sums"].items()}
        ok, unvouched = doc["verified"]
        return cls(sums, (int(ok), int(unvouched)))


class StepCopier:
    """Copies one committed step of ``src`` into ``dst`` on every rank of ``group`` (module
    docstring): call it with the step (and a ``progress`` hook, called with each slice's byte
    count) on every rank, in the same order.  ``copy_step`` is its world of one; the replicator
    of a sharded two-tier store calls it on its dedicated gloo group
    (`ckptfs.protocol.replication.replication_group`)."""

    def __init__(self, src: Storage, dst: Storage, group: Group | None = None, *,
                 durable: bool = True, threads: int = 4, check_stored: bool = True,
                 lease_s: float = DEFAULT_LEASE_S, deadline_s: float | None = None) -> None:
        self.src = src
        self.dst = dst
        #: Each step's copy commits or raises `SaveDeadlineError` within this many seconds
        #: of its first request (its source reads included; None: unbounded).
        self.deadline_s = check_deadline(deadline_s)
        self.group = group if group is not None else WorldOfOne()
        self.durable = durable
        self.threads = threads
        self.check_stored = check_stored
        self.lease_s = lease_s
        #: This process's global rank (the rank its sharded saves' files are named by).
        self.rank = self.group.ranks[self.group.rank]
        self.coordinator = self.group.coordinator
        self._plan: _Plan | None = None

    # -- collectives (any failure: the group is unusable, copying stops here) ----------------

    def _bcast(self, doc: Any) -> Any:
        try:
            return self.group.broadcast(doc)
        except TypeError:
            raise  # a payload that is not JSON: a ckptfs bug, raised on the sender
        except Exception as exc:
            raise self._stopped(exc) from exc

    def _outcomes(self, fn: Callable[[], Any]) -> Outcomes[Any]:
        """Every rank's outcome of ``fn`` (`Group.outcomes`, results shared); a collective
        that breaks stops the copy (`_stopped`)."""
        try:
            return self.group.outcomes(fn, share=True)
        except TypeError:
            raise
        except Exception as exc:
            raise self._stopped(exc) from exc

    def _stopped(self, exc: BaseException) -> ReplicationStopped:
        self._abandon()
        return ReplicationStopped(
            f"the copy's collective to {self.dst.url} failed on rank {self.rank} "
            f"({type(exc).__name__}: {exc}): a rank died or hung past the timeout; nothing "
            "more is copied by this process (open the store again to resume)")

    def broadcast_scan(self, scan: Any) -> Any:
        """The coordinator's open-time scan (JSON: lists, or the refusal's message), to every
        rank (on the calling thread)."""
        return self._bcast(scan)

    # -- one step --------------------------------------------------------------------------------

    def __call__(self, step: int, progress: Progress | None = None) -> CopyResult:
        """Copy ``step``; every rank returns the same result or raises the same error class.
        A destination step it references deleted meanwhile (or its lease run out): copied
        once more, referencing nothing it does not have to (`write_again_if_gone`).  With a
        ``deadline_s``, the step's requests (both storages) are bounded by one `Deadline`."""
        if self.deadline_s is None:
            return self._copy_step(step, progress)
        src, dst = self.src, self.dst
        deadline = Deadline(self.deadline_s, what=f"copy of step {step} to {dst.url}",
                            rank=self.rank if self.group.world_size > 1 else None)
        self.src, self.dst = bounded(src, deadline), bounded(dst, deadline)
        try:
            return self._copy_step(step, progress)
        finally:
            self.src, self.dst = src, dst

    def _copy_step(self, step: int, progress: Progress | None) -> CopyResult:
        return write_again_if_gone(f"{self.dst.url}: copy of step {step}",
                                   lambda reuse: self._copy(step, progress, reuse),
                                   lambda: None)

    def _copy(self, step: int, progress: Progress | None, reuse: bool) -> CopyResult:
        mine: BaseException | None = None  # this rank's own error, raised as it is
        try:
            sent = None
            if self.coordinator:
                try:
                    sent = self._plan_step(step, reuse)
                except Exception as exc:
                    mine, sent = exc, self._failure(step, exc)
            plan = self._bcast(sent)
            view: CheckpointInfo | None = None
            if plan["status"] == "expand":  # format v5 over the nodes: every rank's index
                view, mine, sent = self._expand(step, reuse, plan)
                plan = self._bcast(sent)
            if plan["status"] != "copy":
                return self._outcome(plan, mine)
            part: _Part | None = None

            def copy_part() -> dict[str, Any]:
                nonlocal part
                source = self._plan.source if self._plan is not None \
                    else view if view is not None else CheckpointInfo.from_doc(plan["source"])
                part = self._copy_files(source, str(plan["attempt"]), progress)
                return part.doc()

            got = self._outcomes(copy_part)
            if got.own is not None:
                mine = got.own
                log.error("rank %d: copying its files of step %d to %s failed: %s: %s",
                          self.rank, step, self.dst.url, type(mine).__name__, mine)
            outcome = None
            if self.coordinator:
                assert self._plan is not None and got.values is not None
                try:
                    outcome = self._finish(self._plan, part, got.failures, got.values)
                except Exception as exc:
                    mine, outcome = exc, self._failure(step, exc)
            return self._outcome(self._bcast(outcome), mine)
        except BaseException:
            self._abandon()
            raise

    def _outcome(self, doc: Mapping[str, Any], mine: BaseException | None) -> CopyResult:
        """The broadcast outcome: the result, or the error (this rank's own where it raised
        the one reported, else the same class rebuilt)."""
        self._plan = None
        if doc["status"] == "done":
            return CopyResult(**doc["result"])
        if doc.get("origin") == self.group.rank and mine is not None:
            raise mine
        raise rebuild_error(doc["error"]) from mine

    def _failure(self, step: int, exc: BaseException, origin: int | None = None
                 ) -> dict[str, Any]:
        """The coordinator's outcome for a copy that failed with ``exc`` (raised by rank
        ``origin``, default this one): the source step gone meanwhile is `StepGone`."""
        self._abandon()
        if not isinstance(exc, StepGone) and self._source_gone(step):
            gone = StepGone(f"step {step} is not committed at {self.src.url} (never, or "
                            f"deleted before or during the copy); nothing was committed at "
                            f"{self.dst.url}: {type(exc).__name__}: {exc}")
            return {"status": "error", "error": describe(gone), "origin": None}
        return {"status": "error", "error": describe(exc),
                "origin": self.group.rank if origin is None else origin}

    def _source_gone(self, step: int) -> bool:
        try:
            return read_marker(self.src, step) is None
        except Exception:
            return False

    def _abandon(self) -> None:
        """Discard the coordinator's open attempt (and the retired ones it wrote), if any."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        plan.att.abandon()
        discard_unreferenced(self.dst, plan.source.step, plan.retired)

    def holds_all(self, manifest: Manifest) -> bool:
        """Whether the coordinator holds every file of ``manifest`` (a world of one, or a
        checkpoint one process saved); else each rank holds its own (`own_files`)."""
        return self.group.world_size == 1 or not is_sharded(manifest)

    def held(self, manifest: Manifest) -> list[FileEntry]:
        """The files of ``manifest`` this rank holds, and copies."""
        if self.holds_all(manifest):
            return list(manifest.files) if self.coordinator else []
        return own_files(manifest, self.rank, self.coordinator)

    def _plan_step(self, step: int, reuse: bool, info: CheckpointInfo | None = None
                   ) -> dict[str, Any]:
        """The coordinator's part before any file is copied (module docstring), of the
        committed ``step`` (or of ``info``, its view with every rank's files); the step
        committed at the destination meanwhile (``Attempt.open`` refused) is settled as a lost
        marker race."""
        if info is None:
            info = read_committed(self.src, step)
        try:
            return self._plan_copy(info, reuse)
        except CheckpointExistsError as exc:
            self._abandon()
            return self._settle(info, exc)

    def _expand(self, step: int, reuse: bool, plan: Mapping[str, Any]
                ) -> tuple[CheckpointInfo | None, BaseException | None, Any]:
        """Every rank, for a format v5 source whose files are on the ranks' nodes: the view
        with every rank's files (`expand_over`: this node's attempt settled first, so its index
        is at the committed path), then the coordinator's plan over it (what it broadcasts);
        an error is the coordinator's outcome, the same on every rank."""
        from ckptfs.protocol.rank_metadata import expand_over  # imports DCP: v5 only

        source = CheckpointInfo.from_doc(plan["source"])
        view: CheckpointInfo | None = None
        mine: BaseException | None = None
        sent: Any = None
        try:
            settle_node_attempt(self.src, step, source.attempt, durable=self.durable)
        except Exception as exc:  # the expansion names the index it cannot read
            log.warning("rank %d: could not settle its files of step %d at %s: %s", self.rank,
                        step, self.src.url, exc)
        try:
            view = expand_over(self.src, source, self.group, self.rank)
        except Exception as exc:
            mine = exc
            if self.coordinator:
                sent = self._failure(step, exc)
            return None, mine, sent
        if self.coordinator:
            try:
                sent = self._plan_step(step, reuse, view)
            except Exception as exc:
                mine, sent = exc, self._failure(step, exc)
        return view, mine, sent

    def _settle(self, source: CheckpointInfo, exc: CheckpointExistsError) -> dict[str, Any]:
        """A writer committed the step at the destination first: "identical" if it holds
        the same content (`settle_lost_race`), else ``exc`` is raised again."""
        winner = settle_lost_race(self.dst, source.step, source.manifest)
        if winner is None:
            raise exc
        return {"status": "done", "result": CopyResult(
            source.step, "identical", winner.attempt, len(source.manifest.files),
            source.bytes).as_dict()}

    def _plan_copy(self, info: CheckpointInfo, reuse: bool) -> dict[str, Any]:
        step, manifest = info.step, info.manifest
        existing = committed_at(self.dst, step)
        if existing is not None:
            if same_content(existing.manifest, manifest):
                return {"status": "done", "result": CopyResult(
                    step, "identical", existing.attempt, len(manifest.files),
                    info.bytes).as_dict()}
            raise CheckpointExistsError(
                f"step {step} is already committed at {storage_url(self.dst, existing.paths.dir)}"
                f" with different content than {info.url}; a committed checkpoint is never "
                "overwritten: delete it first ('ckptfs prune' or store.delete("
                f"{step})) or copy to another run root")
        # What a load of the source refuses, the copy refuses, before anything is written at
        # the destination (the same typed error): the listing (links, missing, resized files:
        # nothing is read for a size the storage does not hold), every document decoded, every
        # tensor file's header checked; the tensor bytes are checked against their digests as
        # they are copied.  Files on other nodes are listed there, by their ranks.
        if has_rank_metadata(manifest):
            # Format v5: the files to copy are every rank file and index document the table
            # names (read and checked through it: `expand`), besides the manifest's own; on
            # the nodes of a sharded replica, expanded by every rank together first
            # (`expand_over`, in `_copy`), here already.
            from ckptfs.protocol.rank_metadata import expand, is_expanded  # DCP: v5 only

            if not self.holds_all(manifest) and not is_expanded(info):
                return {"status": "expand", "source": info.to_doc()}
            info = expand(self.src, info)
            manifest = info.manifest
        if self.holds_all(manifest):
            checked = check_checkpoint(self.src, info)
        else:
            from ckptfs.protocol.sharded_read import read_document  # a sharded store: DCP

            checked = read_document(self.src, info)
        writer = {"world_size": self.group.world_size} if self.group.world_size > 1 else {}
        if REFERENCES in features(manifest) and not is_sharded(manifest):
            self._plan = _plan_referencing(self.src, self.dst, info, checked, reuse=reuse,
                                  durable=self.durable, lease_s=self.lease_s, writer=writer)
        else:
            # A sharded checkpoint's references (format v4) name the destination's own copies.
            there, retired = references_at(
                self.dst, manifest, src=self.src if self.holds_all(manifest) else None,
                durable=self.durable)
            try:
                att = Attempt.open(self.dst, step, algorithm=manifest.hash_algorithm,
                                   durable=self.durable)
            except BaseException:
                discard_unreferenced(self.dst, step, retired)
                raise
            protectors = reference_protectors(there, retired)
            self._plan = _Plan(info, att, dataclasses.replace(there, attempt=att.name), writer,
                               retired, protectors,
                               Lease(self.lease_s, "copy") if protectors else None)
        self._plan.att.check(self._plan.manifest, **writer)
        return self._plan.doc()

    def _copy_files(self, source: CheckpointInfo, attempt: str, progress: Progress | None
                    ) -> _Part:
        """This rank's files of the step, from the source into the destination attempt; each
        object's checksum as the destination keeps it compared with the one computed while
        sending (``check_stored``)."""
        plan = self._plan
        v3 = plan.v3 if plan is not None else None
        mine = [e for e in self.held(source.manifest)
                if v3 is None or e in v3.copies]
        if not mine and (v3 is None or not v3.mats):
            return _Part()
        if not self.holds_all(source.manifest):  # this node's own files: listed here
            settle_node_attempt(self.src, source.step, source.attempt, durable=self.durable)
            check_listing(self.src, source, files=mine)  # links, missing, resized: refused
        att = plan.att if plan is not None else Attempt.join(
            self.dst, source.step, attempt, algorithm=source.manifest.hash_algorithm,
            durable=self.durable)
        entries = sorted(mine, key=lambda e: -e.size)
        if not any(isinstance(e, ChunkedFileEntry) for e in entries):
            written = att.write_files(
                [(e.path, e.size, source_chunks(self.src, source.path, source.step, e,
                                                 progress)) for e in entries],
                threads=self.threads, hash_lead=COPY_HASH_LEAD)
            for entry, w in zip(entries, written, strict=True):
                check_copied(self.src, self.dst, source.path, source.step, entry, w.digest, [])
        else:
            written = [copy_file(self.src, source.path, att, e, progress=progress)
                       for e in entries]
        out = [dataclasses.replace(e, store_checksums=w.store_checksums)
               for e, w in zip(entries, written, strict=True)]
        if v3 is not None:
            for m in v3.mats:
                w = att.write_file(m.ref.path, m.size,
                                   _materialized_chunks(self.src, source, m, progress),
                                   pieces=m.pieces, hash_lead=COPY_HASH_LEAD)
                _check_materialized(self.src, self.dst, source, m, list(w.pieces),
                                    att.algorithm)
                written.append(w)
                out.append(w.chunked_entry(att.algorithm, m.pieces))
        verified = check_stored_checksums(self.dst, att, written) if self.check_stored \
            else (0, 0)
        return _Part({w.path: w.store_checksums for w in written}, verified, out)

    def _finish(self, plan: _Plan, part: _Part | None, failed: dict[int, dict[str, Any]],
                reports: list[Any]) -> dict[str, Any]:
        """The coordinator commits the attempt if every rank copied its files (``failed``:
        the ranks that could not, their errors; ``reports``: every rank's `_Part` document);
        the manifest records the destination store's checksums the ranks computed while
        sending."""
        source, step = plan.source, plan.source.step
        if failed:
            self._abandon()
            permanent = [r for r, e in failed.items()
                         if not isinstance(rebuild_error(e), StorageError)]
            origin = (permanent or sorted(failed))[0]
            if self.group.world_size == 1:
                return self._failure(step, rebuild_error(failed[origin]), origin)
            err = rebuild_error({**failed[origin], "message": (
                f"no commit of step {step} at {self.dst.url}: rank(s) {sorted(failed)} could "
                "not copy their files: " + "; ".join(
                    f"rank {r}: {e.get('name')}: {e.get('message')}"
                    for r, e in sorted(failed.items())))})
            return self._failure(step, err, -1)
        parts = [_Part.from_doc(d) for d in reports]
        verified = (sum(p.verified[0] for p in parts), sum(p.verified[1] for p in parts))
        if plan.v3 is not None:
            assert part is not None
            manifest = dataclasses.replace(plan.manifest, files=tuple(part.entries))
        else:
            sums = {p: c for u in parts for p, c in u.sums.items()}
            manifest = dataclasses.replace(plan.manifest, files=tuple(
                dataclasses.replace(e, store_checksums=sums.get(e.path, ()))
                for e in plan.manifest.files))
        att = plan.att
        try:
            check_listed(self.dst, att, manifest.files)
            out = att.commit(manifest, protectors=plan.protectors, lease=plan.lease,
                             copied_from=source.url, **plan.writer)
        except CheckpointExistsError as exc:
            self._abandon()
            return self._settle(source, exc)
        except CorruptCheckpointError as exc:
            if att.committed is not None:  # uncommitted after its lease: copy again
                self._abandon()
                raise ProtectorGoneError(str(exc)) from exc
            raise
        self._plan = None
        if plan.v3 is not None:
            log.info("copied step %d from %s to %s (%d files materialized, %d referenced "
                     "there)", step, self.src.url, self.dst.url, len(plan.v3.mats),
                     len(plan.v3.refs))
        else:
            log.info("copied step %d from %s to %s (%d rank(s) copied their files)", step,
                     self.src.url, self.dst.url, self.group.world_size)
        return {"status": "done", "result": CopyResult(
            step, "copied", out.attempt, len(manifest.files), source.bytes,
            *verified).as_dict()}


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
    """The new header, then each tensor's bytes read from the referenced file by the chunk
    reader (ranged reads of at most `COPY_CHUNK`, each a buffer of its own); its error says
    that nothing was committed."""
    source = StoredChunks.of_reference(info, m.ref)

    def chunks() -> Iterator[memoryview]:
        yield memoryview(m.prefix)
        for _, c in m.tensors:
            try:
                for piece in chunk_pieces(src, source, c, bound=COPY_CHUNK):
                    yield piece
                    if progress is not None:
                        progress(len(piece))
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(f"{exc}; nothing was committed", step=exc.step,
                                             path=exc.path) from None

    return chunks


def _check_materialized(src: Storage, dst: Storage, info: CheckpointInfo, m: _Materialized,
                        pieces: list[str], algorithm: str) -> None:
    """Every tensor written from a referenced file hashes to the digest the source's manifest
    binds for its chunk: the digest taken while it was written when the destination's
    algorithm is the reference's, else its chunk read again and checked by the chunk reader
    (reads of at most `COPY_CHUNK`)."""
    source = StoredChunks.of_reference(info, m.ref)
    for i, (name, c) in enumerate(m.tensors):
        try:
            if m.ref.algorithm == algorithm:
                check_digest(src, source, c, pieces[1 + i])
            else:
                check_streamed(src, source, c, bound=COPY_CHUNK)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{exc} (tensor {name!r}): the source is corrupt; nothing was committed at "
                f"{dst.url}", step=exc.step, path=exc.path) from None


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



def _plan_referencing(src: Storage, dst: Storage, info: CheckpointInfo, checked: Any, *,
                      reuse: bool, durable: bool, lease_s: float, writer: dict[str, Any]
                      ) -> _Plan:
    """The coordinator's plan of a format v3 step: each own file and reference of the source
    referenced at the destination (its latest committed checkpoint holds the bytes, read and
    checked there: `_reusable`), copied, or materialized (module docstring); the destination
    attempt opened."""
    manifest = info.manifest
    step, algo = info.step, manifest.hash_algorithm
    used: dict[str, set[str]] = {}
    for slot in cast(CheckedSingleProcess, checked).slots:
        used.setdefault(slot.file, set()).add(slot.name)
    index = _destination_index(dst, algo) if reuse else None
    held = _held(index) if index is not None else {}
    memory = ReuseMemory()  # what this copy read and checked at the destination
    v3 = _ReferencingPlan([], [], [])
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
            v3.refs.append(ref)
        else:
            v3.copies.append(entry)
    for sref in references_of(manifest):
        located = reference_chunks(src, info, sref, used.get(sref.path, set()))
        ref = _reusable(dst, sref.path, located, algo, held, memory) if held else None
        if ref is not None:
            v3.refs.append(ref)
        else:
            v3.mats.append(_materialized(sref, located))
    protectors = [index.protector] if v3.refs and index is not None else []
    att = Attempt.open(dst, step, algorithm=algo, durable=durable)
    hexd = placeholder_digest(algo).split(":", 1)[1]
    planned = dataclasses.replace(
        manifest, attempt=att.name, references=tuple(v3.refs),
        files=(*v3.copies, *(make_entry(m.ref.path, m.size, algo,
                                        _tiles(m.pieces, [hexd] * len(m.pieces)), None)
                             for m in v3.mats)))
    return _Plan(info, att, planned, writer, [], protectors,
                 Lease(lease_s, "copy") if protectors else None, v3)


def _tiles(lengths: list[int], digests: list[str]) -> list[Chunk]:
    out, pos = [], 0
    for length, hexd in zip(lengths, digests, strict=True):
        out.append(Chunk(pos, length, hexd))
        pos += length
    return out
