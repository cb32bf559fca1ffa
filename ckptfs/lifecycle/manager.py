"""The training-run lifecycle over the core store: save, resume, retention, best, GC.

`CheckpointManager` is what a training loop talks to::

    mgr = ckptfs.CheckpointManager("s3://bucket/runs/exp1", save_every=1000,
                                   keep_last=3, keep_every=10_000,
                                   best=ckptfs.Best(metric="eval/loss", mode="min", keep=2))
    start = mgr.restore_latest(model=model, optimizer=opt, scheduler=sched, expect=provenance)
    for step in range(start, total):
        ...
        if mgr.should_save(step):
            mgr.save(step, model=model, optimizer=opt, scheduler=sched,
                     metrics={"eval/loss": loss})

It adds no commit protocol of its own: every checkpoint is one
`CheckpointStore.save` (or ``save_async``; marker created
last, exclusively), and everything the manager does after that (side-output records, the best
record, pruning) happens only once the checkpoint has committed, so a crash at any point leaves
the committed history intact and the next `restore_latest` heals what was left half-done.
Resuming uses the store's one walk (`CheckpointStore.walk
<ckptfs.CheckpointStore.walk>`, `ckptfs.protocol.resolve.walk_tiers`: the newest
committed checkpoint, rolled back over a corrupt one only if allowed; on a two-tier store the
newest in either tier, the local copy first: docs/tiers.md).  On a two-tier store the manager's
retention prunes the local tier, and ``remote_retention`` the remote tier, in the background.

One body for every mode.  ``save`` and ``restore_latest`` are written once, as the collective
algorithm, over a coordinator (`ckptfs.lifecycle.coordinator`, whose docstring gives the
call sequences): `Solo` in one process (the identity: no
collectives), `ProcessGroup` when torch.distributed runs
several ranks (every rank calls them; each saves and loads its own shards and RNG state, a
failure on one rank raises on every rank, the bookkeeping runs once, on rank 0, and every rank
returns the same ``SaveResult``).  What a checkpoint holds: `ckptfs.lifecycle.schema`;
the model and optimizer across DCP's boundary: `ckptfs.lifecycle.distributed`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch

from ckptfs.errors import (
    CheckpointNotFoundError,
    ShardedLoadError,
    ShardedSaveError,
    StorageError,
)
from ckptfs.format.layout import check_step
from ckptfs.lifecycle import distributed, rng, schema
from ckptfs.lifecycle import provenance as prov
from ckptfs.lifecycle.artifacts import RunArtifacts, SideOutputs, SideOutputStatus
from ckptfs.lifecycle.coordinator import Coordinator, ProcessGroup, Solo, check_ranks
from ckptfs.lifecycle.gc import DEFAULT_GRACE, GcReport, collect
from ckptfs.lifecycle.retention import (
    Best,
    BestPool,
    PruneReport,
    RetentionPolicy,
    prune,
    record_metrics,
)
from ckptfs.lifecycle.rng import decode_rng, encode_rng
from ckptfs.lifecycle.schema import TrainerState
from ckptfs.protocol.async_save import SaveFuture
from ckptfs.protocol.load_options import MapLocation, tensor_map
from ckptfs.protocol.resolve import CheckpointInfo, committed_steps
from ckptfs.protocol.store import CheckpointStore
from ckptfs.protocol.store import open as open_store
from ckptfs.protocol.tiers import TieredStore

log = logging.getLogger("ckptfs")

__all__ = ["CheckpointManager", "SaveResult", "TrainerState", "decode_rng", "encode_rng"]

class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


RngGather = Callable[[dict[str, Any]], Mapping[int, Mapping[str, Any]]]


@dataclass
class SaveResult:
    """What `CheckpointManager.save` did.  ``info`` is None on a non-writer rank of a
    job without torch.distributed (it writes nothing).

    ``errors`` lists bookkeeping that failed *after* the checkpoint committed (the side-output
    record, the best record, the prune): the save itself succeeded, and each of them is redone
    by a later save or resume (they are also logged as warnings)."""

    info: CheckpointInfo | None
    best_improved: bool = False
    evicted_from_best: list[int] = field(default_factory=list)
    prune: PruneReport | None = None
    errors: list[str] = field(default_factory=list)
    #: ``async_save=True``: the pending save; ``info`` stays None here, and the SaveResult of
    #: its bookkeeping comes from `CheckpointManager.wait` (docs/async.md).
    future: SaveFuture | None = None

    def to_doc(self) -> dict[str, Any]:
        """The bookkeeping outcome as JSON (the writer rank sends it to the others)."""
        return {"best_improved": self.best_improved, "evicted": list(self.evicted_from_best),
                "errors": list(self.errors),
                "prune": self.prune.as_dict() if self.prune is not None else None}

    @classmethod
    def from_doc(cls, info: CheckpointInfo | None, doc: Mapping[str, Any]) -> SaveResult:
        prune_doc = doc.get("prune")
        return cls(info, best_improved=bool(doc["best_improved"]),
                   evicted_from_best=[int(s) for s in doc["evicted"]],
                   prune=None if prune_doc is None else PruneReport.from_dict(prune_doc),
                   errors=[str(e) for e in doc["errors"]])


@dataclass
class _Pending:
    """An async save whose bookkeeping runs once it committed (at the next save, restore or
    `CheckpointManager.wait`), on the caller's thread, with the coordinator it was
    saved under."""

    coord: Coordinator
    step: int
    future: SaveFuture
    side: dict[str, dict[str, Any]]
    metrics: dict[str, Any]
    what: str


@dataclass
class _Loaded:
    """A checkpoint a restore loaded on this rank, not yet applied to any object."""

    info: CheckpointInfo
    state: dict[Any, Any]


def _default_rank() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


class CheckpointManager:
    """Checkpoints of one training run, with resume, retention, best tracking and GC.

    ``keep_last`` None keeps every checkpoint.  ``rank``/``world_size`` default to
    torch.distributed's when it is initialized, else 0/1.  ``run_seed`` derives the RNG seeds
    of ranks that have no saved state (a larger world size on resume).  ``async_save``:
    `save` returns once the state is snapshotted (``store.save_async``, collective under
    a process group); the bookkeeping of a save runs after its commit (docs/async.md).
    ``staging_bytes``: with ``async_save``, the host-memory budget of each save's snapshot
    (``store.save_async(staging_bytes=)``: a larger state streams through it; docs/async.md
    section 5).

    On a two-tier store (`ckptfs.tiered`), ``keep_last``/``keep_every`` are the local
    tier's retention (a local checkpoint not yet replicated is kept whatever they say) and
    ``remote_retention`` the remote tier's, applied in the background after each save
    (`prune_remote`; docs/tiers.md).  The best pool and the protected steps are kept in
    both tiers."""

    def __init__(self, url: str | CheckpointStore, *, save_every: int | None = None,
                 keep_last: int | None = None, keep_every: int | None = None,
                 best: Best | None = None, protect: Iterable[int] = (),
                 rank: int | None = None, world_size: int | None = None,
                 writer_rank: int = 0, run_seed: int = 0,
                 per_rank_batch_size: int | None = None,
                 provenance: prov.Provenance | None = None,
                 rng_gather: RngGather | None = None, async_save: bool = False,
                 staging_bytes: int | None = None,
                 remote_retention: RetentionPolicy | None = None,
                 **storage_options: Any) -> None:
        self.store = url if isinstance(url, CheckpointStore) else open_store(url,
                                                                             **storage_options)
        if remote_retention is not None and not isinstance(self.store, TieredStore):
            raise ValueError(f"remote_retention applies to a two-tier store (ckptfs.tiered); "
                             f"{self.store.url} has one tier: use keep_last/keep_every")
        if remote_retention is not None and not isinstance(remote_retention, RetentionPolicy):
            raise TypeError("remote_retention must be a ckptfs.RetentionPolicy, got "
                            f"{type(remote_retention).__name__}")
        #: The remote tier's retention (two-tier stores), applied by `prune_remote`.
        self.remote_policy = remote_retention
        self._remote_pruner = _Background(self._prune_remote_now, "ckptfs-remote-prune")
        if save_every is not None and save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        self.save_every = save_every
        self.policy = RetentionPolicy(keep_last, keep_every)
        self.best_config = best
        self._best = BestPool(self.store, best, steps=self._run_steps)
        self.tracker = self._best.tracker
        self.protected: set[int] = {check_step(s) for s in protect}
        d_rank, d_world = _default_rank()
        self.rank = d_rank if rank is None else rank
        self.world_size = d_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        self.writer_rank = writer_rank
        self.run_seed = int(run_seed)
        self.per_rank_batch_size = per_rank_batch_size
        self.provenance = provenance
        self._rng_gather = rng_gather
        self.trainer = TrainerState()
        self.resumed_from: int | None = None
        self._pending_changes: list[dict[str, Any]] = []
        self._last_saved: int | None = None
        self.artifacts = RunArtifacts(self.store)
        self.side_outputs = SideOutputs(self.store)
        self.last_rng_outcome: rng.RestoreOutcome | None = None
        self.async_save = bool(async_save)
        if staging_bytes is not None and not self.async_save:
            raise ValueError("staging_bytes is the budget of an asynchronous save's snapshot: "
                             "pass async_save=True with it")
        self.staging_bytes = staging_bytes
        self._pending: list[_Pending] = []
        self._warned_metrics = False

    def wait(self) -> list[SaveResult]:
        """``async_save``: wait for the pending save, then run its bookkeeping (side outputs,
        best record, prune); returns those SaveResults.  Raises a failed save's error.  Under
        a process group, call it on every rank (it agrees on the outcome)."""
        done: list[SaveResult] = []
        while self._pending:
            pending = self._pending.pop(0)
            info = pending.coord.agree(pending.future.result, pending.what, ShardedSaveError)
            done.append(self._after_commit(pending.coord, pending.step, info, pending.side,
                                           pending.metrics, pending.what))
        self.store.wait()
        return done

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def is_writer(self) -> bool:
        return self.rank == self.writer_rank

    def _coordinator(self, model: torch.nn.Module | None) -> Coordinator:
        if distributed.active(model):
            return ProcessGroup()
        return Solo(self.rank, self.world_size)

    # -- saving --------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """True every ``save_every`` steps (never step 0, never a step already saved)."""
        return (self.save_every is not None and step > 0 and step % self.save_every == 0
                and step != self._last_saved)

    def save(self, step: int, *, model: torch.nn.Module | None = None,
             optimizer: Stateful | None = None, scheduler: Stateful | None = None,
             stateful: Mapping[str, Stateful] | None = None,
             metrics: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
             epoch: int | None = None,
             rng_states: Mapping[int, Mapping[str, Any]] | None = None) -> SaveResult:
        """Save and commit the checkpoint of ``step``, then update the best record and prune.

        Call it on every rank: collective under a process group (docs/lifecycle.md §11), else
        the RNG states are gathered (``rng_gather``) and only the writer rank writes.
        ``rng_states`` overrides the gather (rank -> `ckptfs.lifecycle.rng.capture`
        output).  Pruning and the best record happen only after the commit succeeded.

        Metrics are checked before anything is written: each must be a real scalar (a Python
        number, a one-element tensor, a NumPy scalar), a bool, a string or None, and the tracked
        ``best`` metric a real scalar or None, else `UnsupportedValueError`.  A
        NaN or infinite metric is recorded as ``null`` and never enters the best pool (logged).
        Under a process group the ranks' metrics are merged: a metric given on one rank only is
        recorded, one given on several ranks must have the same value on each (else
        ``ValueError`` on every rank, before anything is written).
        Once the checkpoint has committed, ``save`` returns normally: bookkeeping that fails
        after the commit is logged and listed in ``SaveResult.errors``, and never skips the
        rest (the best record, then the prune)."""
        check_step(step)
        self.wait()  # async_save: the previous save's bookkeeping comes first
        coord = self._coordinator(model)
        what = f"CheckpointManager.save of step {step} at {self.url}"
        writes = coord.collective or self.is_writer
        built: list[tuple[dict[str, Any], dict[str, dict[str, Any]]]] = []

        def prepare() -> dict[str, Any]:
            """Every rank: check, capture, build; the metrics and RNG ranks go to all."""
            check_ranks(coord, rank=self.rank, world_size=self.world_size,
                        writer_rank=self.writer_rank)
            if coord.collective and optimizer is not None and model is None:
                raise ValueError("a distributed save of an optimizer needs model= too (DCP "
                                 "names the optimizer's state by parameter name)")
            schema.check_stateful_names(stateful or {})
            tracked = self.best_config.metric if self.best_config is not None else None
            recorded = record_metrics(metrics, tracked)
            states = dict(rng_states) if rng_states is not None else rng.states_for_save(
                collective=coord.collective, rank=self.rank, world_size=self.world_size,
                gather=self._rng_gather)
            if writes:
                built.append(self._build(coord, step, states, model=model, optimizer=optimizer,
                                         scheduler=scheduler, stateful=stateful, extra=extra,
                                         epoch=epoch))
            return {"metrics": recorded, "rng_ranks": sorted(int(r) for r in states)}

        per_rank = coord.agree_gather(prepare, what, ShardedSaveError)
        merged = schema.merge_rank_metrics([(r, d["metrics"]) for r, d in per_rank])
        if not writes:
            self._last_saved = step
            if metrics and not self._warned_metrics:
                self._warned_metrics = True
                log.warning("rank %d is not the writer rank (%d) and torch.distributed is not "
                            "initialized: its metrics are not recorded, only the writer rank's "
                            "save writes; pass metrics on rank %d", self.rank,
                            self.writer_rank, self.writer_rank)
            return SaveResult(None)
        [(state, side)] = built
        record = self._current_provenance().to_record()
        record["changes"] = list(self._pending_changes)
        metadata = schema.checkpoint_metadata(
            trainer=self.trainer, metrics=merged, world_size=self.world_size,
            rng_ranks=[r for _, d in per_rank for r in d["rng_ranks"]],
            resumed_from=self.resumed_from, protected=self.protected, provenance=record,
            side_outputs=side)
        if self.async_save:  # the bookkeeping runs after the commit (wait / next save)
            future = self.store.save_async(step, state, metadata=metadata,
                                           staging_bytes=self.staging_bytes)
            self._last_saved = step
            self._pending.append(_Pending(coord, step, future, side, merged, what))
            return SaveResult(None, future=future)
        info = self.store.save(step, state, metadata=metadata)  # collective under a group
        return self._after_commit(coord, step, info, side, merged, what)

    def _build(self, coord: Coordinator, step: int, states: Mapping[int, Mapping[str, Any]],
               *, model: torch.nn.Module | None, optimizer: Stateful | None,
               scheduler: Stateful | None, stateful: Mapping[str, Stateful] | None,
               extra: Mapping[str, Any] | None, epoch: int | None
               ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """(the state tree, the side outputs it commits) on a rank that writes."""
        state: dict[str, Any] = {}
        if coord.collective:
            state.update(distributed.state_dicts(model, optimizer))
        else:
            for name, obj in (("model", model), ("optimizer", optimizer)):
                if obj is not None:
                    state[name] = obj.state_dict()
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        for name, obj in (stateful or {}).items():
            state[name] = obj.state_dict()
        self.trainer.step = step
        if epoch is not None:
            self.trainer.epoch = int(epoch)
        if extra:
            self.trainer.extra.update(extra)
        state["trainer"] = self.trainer.to_state()
        state["rng"] = rng.pack_ranks(states, self.world_size)  # rank-keyed when collective
        state["manager"] = schema.manager_entry(
            run_seed=self.run_seed, world_size=self.world_size, resumed_from=self.resumed_from,
            dcp_entries=list(state) if coord.collective else None)
        side: dict[str, dict[str, Any]] = {}
        if self.is_writer:
            side = self.side_outputs.take_pending()
            if self.tracker is not None:
                self._ensure_best_loaded()  # before the commit: the replay must not see it
        return state, side

    def _after_commit(self, coord: Coordinator, step: int, info: CheckpointInfo,
                      side: dict[str, dict[str, Any]], metrics: dict[str, Any],
                      what: str) -> SaveResult:
        """The bookkeeping of a committed save, on the writer; every rank returns its
        outcome."""
        result = coord.on_writer(
            lambda: self._committed(step, info, side, metrics),
            f"{what} (committed; bookkeeping)", ShardedSaveError,
            encode=SaveResult.to_doc, decode=lambda doc: SaveResult.from_doc(info, doc))
        if coord.collective and result.prune is not None and result.prune.deleted:
            self._prune_nodes(result.prune.deleted)
        self._last_saved = step
        self._pending_changes = []
        return result

    def _committed(self, step: int, info: CheckpointInfo, side: dict[str, dict[str, Any]],
                   metrics: Mapping[str, Any] | None) -> SaveResult:
        # Committed.  Everything below is bookkeeping that a resume can redo: none of it may
        # raise (the caller would think the save failed) or skip what follows it.
        self._last_saved = step
        self._pending_changes = []
        result = SaveResult(info)
        try:
            self.side_outputs.committed(step, side)
        except Exception as exc:
            self._bookkeeping_failed(result, step, "side-output record", exc)
        if self.tracker is not None:
            improved, evicted = self.tracker.observe(step, metrics)  # never raises
            result.best_improved, result.evicted_from_best = improved, evicted
            if improved:
                try:
                    self._persist_best()
                except Exception as exc:
                    self._bookkeeping_failed(result, step, "best record", exc)
        if self.policy.keep_last is not None:
            try:
                result.prune = self._prune(False)
            except Exception as exc:
                self._bookkeeping_failed(result, step, "prune", exc)
            else:
                if result.prune.refused:
                    result.errors.append(f"prune refused: {result.prune.refused}")
        if self._prunes_remote():
            try:
                self._request_remote_prune()
            except Exception as exc:
                self._bookkeeping_failed(result, step, "remote prune", exc)
        return result

    def _bookkeeping_failed(self, result: SaveResult, step: int, what: str,
                            exc: Exception) -> None:
        msg = f"{what}: {type(exc).__name__}: {exc}"
        log.warning("checkpoint step %d at %s committed, but the %s failed (%s: %s); it is "
                    "redone by the next save or resume", step, self.url, what,
                    type(exc).__name__, exc)
        result.errors.append(msg)

    def _current_provenance(self, p: prov.Provenance | None = None) -> prov.Provenance:
        p = p or self.provenance or prov.Provenance()
        return prov.Provenance(p.config, dict(p.fingerprints),
                               {"world_size": self.world_size, **dict(p.execution)})


    # -- best ----------------------------------------------------------------------------------

    def _ensure_best_loaded(self) -> None:
        self._best.ensure_loaded()

    def _persist_best(self) -> None:
        self._best.persist()

    def best(self) -> dict[str, Any] | None:
        """The best checkpoint so far: ``{"step", "value"}``, or None."""
        return self._best.best()

    def best_steps(self) -> list[int]:
        """The running-best pool; without ``best=``, the pool a previous configuration of the
        run persisted (so dropping ``best=`` never silently deletes those checkpoints)."""
        return self._best.steps()

    # -- retention and GC ------------------------------------------------------------------------

    def prune(self, *, dry_run: bool = False) -> PruneReport:
        """Apply the retention policy now (``save`` does after every commit).  On a sharded
        two-tier store (node-local tiers) call it on every rank: the writer prunes, then every
        rank removes its node's files of the steps it deleted."""
        coord = self._coordinator(None)
        if not (coord.collective and self.store.node_local):
            return self._prune(dry_run)
        report = coord.on_writer(lambda: self._prune(dry_run), f"prune at {self.url}",
                                 ShardedSaveError, encode=PruneReport.as_dict,
                                 decode=PruneReport.from_dict)
        if not dry_run:
            self._prune_nodes(report.deleted)
        return report

    def _prune_nodes(self, deleted: list[int]) -> None:
        """Every rank of a collective manager, after the writer's prune deleted ``deleted``:
        on a store whose storage is each node's own (``store.node_local``: a sharded two-tier
        store's local tiers) the other nodes remove their files of those steps."""
        if self.store.node_local and not self.is_writer:
            from ckptfs.protocol.node_copy import remove_node_files  # imports DCP
            remove_node_files(self.store.storage, deleted)

    def _prune(self, dry_run: bool) -> PruneReport:
        """The prune itself, on the writer (`prune`; a save's bookkeeping)."""
        if not dry_run:
            self.side_outputs.reconcile()
        protected = set(self.protected)
        if self.resumed_from is not None:
            protected.add(self.resumed_from)
        return prune(self.store, self.policy, best=self.best_steps(), protected=protected,
                     dry_run=dry_run)

    def _run_steps(self) -> list[int]:
        """The run's committed steps in every tier the store reads (one store: its own; a
        two-tier store: either tier), for the best pool's replay after a lost record."""
        out: set[int] = set()
        for _, storage in self.store.read_tiers():
            try:
                out.update(committed_steps(storage))
            except StorageError as exc:
                if storage is self.store.storage:
                    raise
                log.warning("best: %s cannot be listed (%s); its checkpoints are left out of "
                            "the best pool's replay", storage.url, exc)
        return sorted(out)

    def _prunes_remote(self) -> bool:
        return self.remote_policy is not None and self.remote_policy.keep_last is not None

    def _remote_keep(self) -> dict[str, list[int]]:
        """What the remote tier keeps besides its policy: the best pool and the protected
        steps; and every step the local tier holds (a remote copy pruned while the local one
        stays would be replicated again by the next open), read by the prune right after it
        lists the remote (``hold``)."""
        protected = set(self.protected)
        if self.resumed_from is not None:
            protected.add(self.resumed_from)
        return {"best": self.best_steps(), "protected": sorted(protected)}

    def prune_remote(self, *, dry_run: bool = False) -> PruneReport:
        """Apply ``remote_retention`` to the remote tier of a two-tier store now (``save``
        requests it in the background after every commit: `wait_remote_prune`).

        The remote tier keeps what the policy keeps, its newest committed step (always), the
        best pool, the protected steps (and the one the run resumed from) and every step the
        local tier still holds; deletes go through the remote store's reference-aware
        ``delete`` (marker first).  Nothing is deleted if the remote's newest checkpoint fails
        a quick verify (``refused``)."""
        if self.remote_policy is None or not isinstance(self.store, TieredStore):
            raise ValueError(f"{self!r} has no remote_retention (a two-tier store's remote "
                             "tier policy)")
        self._remote_pruner.wait()
        return self._prune_remote_with(dry_run=dry_run, **self._remote_keep())

    def _prune_remote_with(self, *, best: list[int], protected: list[int],
                           dry_run: bool = False) -> PruneReport:
        if self.remote_policy is None or not isinstance(self.store, TieredStore):
            raise ValueError("no remote tier to prune")  # pragma: no cover - checked before
        report = prune(self.store.remote, self.remote_policy, best=best, protected=protected,
                       dry_run=dry_run, hold=self.store.local.steps)
        if report.deleted:
            log.info("remote retention at %s: deleted steps %s", self.store.remote.url,
                     report.deleted)
        return report

    def _prune_remote_now(self) -> PruneReport:
        """The background prune: what to keep is read when it runs, not when a save asked for
        it (a snapshot taken then could miss a step the local tier still holds by the time the
        remote has more: a run delayed past two saves deleted it remotely)."""
        keep = self._remote_keep()
        return self._prune_remote_with(best=keep["best"], protected=keep["protected"])

    def _request_remote_prune(self) -> None:
        assert isinstance(self.store, TieredStore)
        outage = self.store.replication().outage
        if outage is not None:
            log.info("remote retention at %s waits for the remote tier (%s)",
                     self.store.remote.url, outage)
            return
        self._remote_pruner.request()

    def wait_remote_prune(self, timeout: float | None = None) -> PruneReport | None:
        """Wait for the remote prune running in the background, if any; return the report of
        the last one (None if none ran).  Raises its error, if it failed; ``TimeoutError``
        after ``timeout`` seconds."""
        if not self._remote_pruner.wait(timeout):
            raise TimeoutError(f"the remote prune at {self.url} is still running after "
                               f"{timeout} s")
        return self._remote_pruner.result()

    def gc(self, *, older_than: timedelta = DEFAULT_GRACE, dry_run: bool = False) -> GcReport:
        """Remove uncommitted attempts, temporary files and orphaned uploads older than
        ``older_than`` (see `ckptfs.lifecycle.gc`)."""
        return collect(self.store.storage, older_than=older_than, dry_run=dry_run)

    # -- resuming ------------------------------------------------------------------------------

    def restore_latest(self, *, model: torch.nn.Module | None = None,
                       optimizer: Stateful | None = None, scheduler: Stateful | None = None,
                       stateful: Mapping[str, Stateful] | None = None,
                       expect: prov.Provenance | None = None,
                       mode: prov.ProvenanceMode = "exact", strict_rng: bool = False,
                       map_location: MapLocation = "cpu", allow_rollback: bool = False,
                       discard_uncommitted: bool = True) -> int:
        """Restore the newest committed checkpoint into the given objects; returns the step to
        continue from (saved step + 1), or 0 when the run has no checkpoint yet.

        A newest checkpoint that fails its check (marker, manifest, or the content hashes
        verified while loading) raises `CorruptCheckpointError`; with
        ``allow_rollback`` the next older committed checkpoint is tried instead (logged), as
        `CheckpointStore.load` does (the same walk).
        Nothing is restored into the objects before a checkpoint has loaded and verified.  If
        every committed checkpoint is corrupt, `CheckpointNotFoundError` lists
        them (never a silent start from step 0).

        ``model``, ``optimizer``, ``scheduler``: restored with their ``load_state_dict``
        from the checkpoint's ``model``, ``optimizer`` and ``scheduler`` entries (a distributed
        optimizer restore needs ``model`` too); ``stateful``: more objects by name
        (``{"sampler": s}``), each from the entry its name was saved under.
        ``expect``: the `Provenance` this run expects; ``mode="exact"`` refuses any recorded
        difference with `ProvenanceMismatchError`, ``"execution_change"`` accepts changes in
        ``execution.*`` keys (docs/lifecycle.md, provenance).
        ``strict_rng``: a rank whose saved RNG state is missing raises `RngStateError`
        instead of being reseeded (docs/lifecycle.md, RNG state).
        ``map_location``: every form ``torch.load`` accepts, applied to every loaded tensor;
        under a process group the model and optimizer load into today's placement instead.
        ``allow_rollback``: skip a corrupt newest checkpoint for the next older one (above).
        ``discard_uncommitted``: delete side outputs written by a run that stopped before its
        checkpoint (``False`` keeps them; docs/lifecycle.md, side outputs).
        Under a process group every rank calls it (docs/lifecycle.md §11); a one-process
        checkpoint restores into a sharded model too (each rank loads it whole)."""
        self.wait()  # a pending async save of this store commits first
        return self._restore(None, model=model, optimizer=optimizer, scheduler=scheduler,
                             stateful=stateful, expect=expect, mode=mode, strict_rng=strict_rng,
                             map_location=map_location, allow_rollback=allow_rollback,
                             discard_uncommitted=discard_uncommitted)

    def restore(self, step: int, *, model: torch.nn.Module | None = None,
                optimizer: Stateful | None = None, scheduler: Stateful | None = None,
                stateful: Mapping[str, Stateful] | None = None,
                expect: prov.Provenance | None = None, mode: prov.ProvenanceMode = "exact",
                strict_rng: bool = False, map_location: MapLocation = "cpu",
                discard_uncommitted: bool = True) -> int:
        """Restore checkpoint ``step``; see `restore_latest`."""
        self.wait()
        return self._restore(step, model=model, optimizer=optimizer, scheduler=scheduler,
                             stateful=stateful, expect=expect, mode=mode, strict_rng=strict_rng,
                             map_location=map_location, allow_rollback=False,
                             discard_uncommitted=discard_uncommitted)

    def _restore(self, step: int | None, *, model: torch.nn.Module | None,
                 optimizer: Stateful | None, scheduler: Stateful | None,
                 stateful: Mapping[str, Stateful] | None, expect: prov.Provenance | None,
                 mode: prov.ProvenanceMode, strict_rng: bool, map_location: MapLocation,
                 allow_rollback: bool, discard_uncommitted: bool) -> int:
        """The one restore body (call sequence: `ckptfs.lifecycle.coordinator`)."""
        coord = self._coordinator(model)
        what = f"CheckpointManager restore at {self.url}"
        names = ["scheduler"] * (scheduler is not None) + list(stateful or {})

        def check() -> None:
            tensor_map(map_location)  # LoadOptionError before any I/O
            if step is not None:
                check_step(step)
            check_ranks(coord, rank=self.rank, world_size=self.world_size,
                        writer_rank=self.writer_rank)
            if coord.collective and optimizer is not None and model is None:
                raise ValueError("a distributed restore of an optimizer needs model= too (DCP "
                                 "names the optimizer's state by parameter name)")

        coord.agree(check, what, ShardedLoadError)
        # A collective restore walks the tiers every rank reads whole (a sharded two-tier
        # store: its remote tier, once what the local tiers hold has been replicated); the
        # model and optimizer still load through the store, each node's own files first.
        collective = coord.collective
        skipped: list[str] = []

        def walk(run: Callable[[CheckpointInfo], _Loaded]
                 ) -> tuple[CheckpointInfo, _Loaded] | None:
            """The writer: which checkpoint, by the store's one walk (or the step asked)."""
            if step is not None:
                return self.store.use_step(step, run, collective=collective)
            found = self.store.walk(run, allow_rollback=allow_rollback, skipped=skipped,
                                    collective=collective)
            if found is None and skipped:
                raise CheckpointNotFoundError(
                    f"no loadable committed checkpoint at {self.url}: every one is corrupt "
                    f"({'; '.join(skipped)}); not starting over from step 0 silently")
            return found

        def use(info: CheckpointInfo) -> _Loaded:
            return self._load_candidate(coord, info, expect=expect, mode=mode,
                                        map_location=map_location, model=model,
                                        optimizer=optimizer, names=names, what=what)

        chosen = coord.walk(self.store.read_tiers(collective=collective), walk, use, what,
                            ShardedLoadError)
        loaded = None if chosen is None else chosen[1]
        if loaded is None:
            if expect is not None:
                self.provenance = expect
            coord.agree(lambda: self._after_resume(discard_uncommitted), what, ShardedLoadError)
            log.info("no committed checkpoint at %s: starting from step 0", self.url)
            return 0
        return coord.agree(
            lambda: self._apply_restore(coord, loaded, model=model, optimizer=optimizer,
                                        scheduler=scheduler, stateful=stateful,
                                        strict_rng=strict_rng,
                                        discard_uncommitted=discard_uncommitted),
            f"{what}, step {loaded.info.step}", ShardedLoadError)

    def _load_candidate(self, coord: Coordinator, info: CheckpointInfo, *,
                        expect: prov.Provenance | None,
                        mode: prov.ProvenanceMode, map_location: MapLocation,
                        model: torch.nn.Module | None, optimizer: Stateful | None,
                        names: list[str], what: str) -> _Loaded:
        """Every rank, for one candidate: the provenance check (on the writer), the small
        entries, then the model and optimizer (collective); touches no training object (so the
        walk can try the next one)."""
        step = info.step
        what = f"{what}, step {step}"
        if expect is not None:
            changes = coord.on_writer(
                lambda: self._check_provenance(info, expect, mode), what,
                ShardedLoadError)
            self._pending_changes = list(changes or [])
            self.provenance = expect
            for ch in self._pending_changes:
                log.warning("resuming step %d with a declared execution change: %s %r -> %r",
                            step, ch["key"], ch["from"], ch["to"])

        def entries() -> tuple[CheckpointInfo, dict[Any, Any], dict[str, Any] | None]:
            """(info, small entries, fresh model/optimizer state dicts for the collective
            load, or None: none wanted, a v1 checkpoint, or not saved: named at apply)."""
            found = info  # this rank's tier's copy (`over_group`)
            into = None
            if coord.collective and distributed.is_sharded(found):
                state = distributed.load_entries(self.store, found, coord.rank, names,
                                                 map_location)
                saved = schema.saved_entries(state)
                if wanted and (saved is None or all(n in saved for n in wanted)):
                    into = distributed.fresh(distributed.state_dicts(model, optimizer))
            else:  # one process, or a one-process (v1) checkpoint: loaded whole
                state = self.store.load_info(found, map_location=map_location)
            schema.check_manager_entries(state, found.url, step)
            if state.get("rng") is not None:
                rng.check_entry(state["rng"])  # RngStateError before any object is touched
            return found, state, into

        wanted = [n for n, o in (("model", model), ("optimizer", optimizer)) if o is not None]
        found, state, into = coord.agree(entries, what, ShardedLoadError)
        if into is not None:  # collective; verified: every byte checked before it returns
            coord.agree(lambda: self.store.load(step, into=into), what, ShardedLoadError)
            state = {**state, **into}
        return _Loaded(found, state)

    def _check_provenance(self, info: CheckpointInfo, expect: prov.Provenance,
                          mode: prov.ProvenanceMode) -> list[dict[str, Any]]:
        """On the writer only (a refusal writes one diagnostic file, not one per rank)."""
        recorded = info.metadata.get("provenance")
        return prov.check(self.store.storage, self._current_provenance(expect),
                          recorded if isinstance(recorded, dict) else None, step=info.step,
                          mode=mode)

    def _apply_restore(self, coord: Coordinator, loaded: _Loaded, *,
                       model: torch.nn.Module | None, optimizer: Stateful | None,
                       scheduler: Stateful | None, stateful: Mapping[str, Stateful] | None,
                       strict_rng: bool, discard_uncommitted: bool) -> int:
        step, state = loaded.info.step, loaded.state
        missing = [n for n, o in (("model", model), ("optimizer", optimizer),
                                  ("scheduler", scheduler)) if o is not None and n not in state]
        missing += [n for n in (stateful or {}) if n not in state]
        if missing:
            held = schema.saved_entries(state) or [k for k in state if isinstance(k, str)]
            raise CheckpointNotFoundError(
                f"checkpoint step {step} at {self.url} has no state for {missing}; it holds "
                f"{sorted(held)}")
        distributed.load_into_objects(state, model, optimizer, collective=coord.collective)
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        for name, obj in (stateful or {}).items():
            obj.load_state_dict(state[name])
        self.trainer.load_state(state.get("trainer") or {})
        mstate = state.get("manager") or {}
        if "run_seed" in mstate and int(mstate["run_seed"]) != self.run_seed:
            log.info("using the checkpoint's run seed %s (the manager was given %s)",
                     mstate["run_seed"], self.run_seed)
            self.run_seed = int(mstate["run_seed"])
        self.resumed_from = step
        self._last_saved = step
        self.last_rng_outcome = rng.restore_for_rank(
            state.get("rng"), rank=self.rank, world_size=self.world_size,
            run_seed=self.run_seed, per_rank_batch_size=self.per_rank_batch_size,
            strict=strict_rng)
        self._after_resume(discard_uncommitted)
        log.info("resumed from step %d at %s (rng: %s)", step, self.url,
                 self.last_rng_outcome.action)
        return step + 1

    def _after_resume(self, discard_uncommitted: bool) -> None:
        if not self.is_writer:
            return
        self._best.reload()
        self.side_outputs.reconcile()
        if discard_uncommitted:
            gone = self.side_outputs.discard_uncommitted()
            if gone:
                log.warning("discarded %d side output(s) no committed checkpoint lists "
                            "(written by a run that stopped before its checkpoint): %s",
                            len(gone), ", ".join(gone[:10]))

    # -- side outputs --------------------------------------------------------------------------

    def write_side_output(self, step: int, name: str, data: bytes) -> str:
        """Write a side output of ``step`` (eval results, logs); it is committed by the next
        checkpoint this manager saves, and discarded on resume if that never happens."""
        return self.side_outputs.write(step, name, data)

    def side_output_status(self) -> SideOutputStatus:
        return self.side_outputs.status()

    def __repr__(self) -> str:
        remote = "" if self.remote_policy is None else \
            f", remote_retention={self.remote_policy}"
        return (f"CheckpointManager({self.url!r}, rank={self.rank}/{self.world_size}, "
                f"keep_last={self.policy.keep_last}, keep_every={self.policy.keep_every}, "
                f"best={self.best_config}{remote})")


class _Background:
    """Runs ``fn`` on a thread of its own, one run at a time: requests while it runs make one
    more run after it (the remote prune: slow deletes on an object store never block the
    training loop)."""

    def __init__(self, fn: Callable[[], PruneReport], name: str) -> None:
        self._fn = fn
        self._name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending = False
        self._last: PruneReport | None = None
        self._error: Exception | None = None

    def request(self) -> None:
        with self._lock:
            self._pending = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                pending, self._pending = self._pending, False
                if not pending:
                    self._thread = None
                    return
            try:
                self._last, self._error = self._fn(), None
            except Exception as exc:  # logged; the next save requests it again
                log.warning("%s failed (%s: %s); retried after the next save", self._name,
                            type(exc).__name__, exc)
                self._error = exc

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return True
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False

    def result(self) -> PruneReport | None:
        if self._error is not None:
            raise self._error
        return self._last

