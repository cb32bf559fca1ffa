"""The training-run lifecycle over the core store: save, resume, retention, best, GC.

:class:`CheckpointManager` is what a training loop talks to::

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
:meth:`CheckpointStore.save <ckptfs.CheckpointStore.save>` (marker created last, exclusively),
and everything the manager does after that (side-output records, the best record, pruning)
happens only once the checkpoint has committed, so a crash at any point leaves the committed
history intact and the next :meth:`restore_latest` heals what was left half-done.

A checkpoint's state tree::

    {"model": ..., "optimizer": ..., "scheduler": ..., "<stateful name>": ...,
     "trainer": {"step", "attempted_updates", "successful_updates", "epoch", "extra": {...}},
     "rng": {"world_size": W, "ranks": {rank: rng state}},      (ckptfs.lifecycle.rng; no pickle)
     "manager": {"version": 1, "run_seed", "world_size", "resumed_from"}}

and its manifest metadata (readable without loading the state, used by the CLI and by resume):
``trainer`` counters, finite ``metrics``, ``provenance`` (with accepted ``changes``),
``side_outputs`` and ``lifecycle`` (``resumed_from``, protected by retention).

Distributed runs (:mod:`ckptfs.lifecycle.distributed`): every rank calls :meth:`save` and
:meth:`restore_latest`; each saves and loads its own shards (DCP state dicts) and RNG state in
one collective checkpoint, a failure on one rank raises on every rank, and the bookkeeping runs
once, on the writer rank (0 by default), with the same ``SaveResult`` returned everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch

from ckptfs.errors import (
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    FormatVersionError,
)
from ckptfs.format.layout import check_step
from ckptfs.lifecycle import distributed, rng
from ckptfs.lifecycle import provenance as prov
from ckptfs.lifecycle.artifacts import RunArtifacts, SideOutputs, SideOutputStatus
from ckptfs.lifecycle.gc import DEFAULT_GRACE, GcReport, collect
from ckptfs.lifecycle.records import RecordLog
from ckptfs.lifecycle.retention import (
    BEST_RECORD,
    Best,
    BestTracker,
    PruneReport,
    RetentionPolicy,
    best_steps_of,
    prune,
    record_metrics,
)
from ckptfs.lifecycle.rng import decode_rng, dist_gather, encode_rng
from ckptfs.protocol.async_save import DeferredCommits
from ckptfs.protocol.load_options import MapLocation
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.protocol.store import CheckpointStore
from ckptfs.protocol.store import open as open_store

log = logging.getLogger("ckptfs")

__all__ = ["CheckpointManager", "SaveResult", "TrainerState", "decode_rng", "encode_rng"]

MANAGER_STATE_VERSION = 1


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


RngGather = Callable[[dict[str, Any]], Mapping[int, Mapping[str, Any]]]


@dataclass
class TrainerState:
    """Progress counters saved with every checkpoint.  ``attempted_updates`` counts optimizer
    updates tried, ``successful_updates`` those applied (they differ when updates are skipped,
    e.g. on inf/NaN gradients or a rejected RL batch)."""

    step: int = 0
    attempted_updates: int = 0
    successful_updates: int = 0
    epoch: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def record_update(self, applied: bool = True) -> None:
        self.attempted_updates += 1
        if applied:
            self.successful_updates += 1

    def to_state(self) -> dict[str, Any]:
        return {"step": self.step, "attempted_updates": self.attempted_updates,
                "successful_updates": self.successful_updates, "epoch": self.epoch,
                "extra": dict(self.extra)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.step = int(state.get("step", 0))
        self.attempted_updates = int(state.get("attempted_updates", 0))
        self.successful_updates = int(state.get("successful_updates", 0))
        self.epoch = int(state.get("epoch", 0))
        self.extra = dict(state.get("extra") or {})


@dataclass
class SaveResult:
    """What :meth:`CheckpointManager.save` did.  ``info`` is None on non-writer ranks.

    ``errors`` lists bookkeeping that failed *after* the checkpoint committed (the side-output
    record, the best record, the prune): the save itself succeeded, and each of them is redone
    by a later save or resume (they are also logged as warnings)."""

    info: CheckpointInfo | None
    best_improved: bool = False
    evicted_from_best: list[int] = field(default_factory=list)
    prune: PruneReport | None = None
    errors: list[str] = field(default_factory=list)
    #: ``async_save=True``: the pending save; ``info`` stays None here, and the SaveResult of
    #: its bookkeeping comes from :meth:`CheckpointManager.wait` (docs/async.md).
    future: Future[CheckpointInfo] | None = None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_manager_entries(state: Mapping[Any, Any], where: str, step: int) -> None:
    """The ``trainer`` and ``manager`` entries of a loaded state have the shape the manager
    writes, else :class:`~ckptfs.CorruptCheckpointError` (never a raw ``TypeError`` from
    restoring them)."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {why}; this checkpoint was not written by "
                                      "CheckpointManager, or was edited", step=step)

    trainer = state.get("trainer")
    if trainer is not None:
        if not isinstance(trainer, Mapping):
            raise bad(f"'trainer' is a {type(trainer).__name__}, not a map")
        for key in ("step", "attempted_updates", "successful_updates", "epoch"):
            if key in trainer and not _is_int(trainer[key]):
                raise bad(f"trainer {key!r} is {trainer[key]!r:.40}, not an int")
        if trainer.get("extra") is not None and not isinstance(trainer["extra"], Mapping):
            raise bad("trainer 'extra' is not a map")
    manager = state.get("manager")
    if manager is not None:
        if not isinstance(manager, Mapping):
            raise bad(f"'manager' is a {type(manager).__name__}, not a map")
        if "run_seed" in manager and not _is_int(manager["run_seed"]):
            raise bad(f"manager 'run_seed' is {manager['run_seed']!r:.40}, not an int")


def _default_rank() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


class CheckpointManager:
    """Checkpoints of one training run, with resume, retention, best tracking and GC.

    ``keep_last`` None keeps every checkpoint.  ``rank``/``world_size`` default to
    torch.distributed's when it is initialized, else 0/1.  ``run_seed`` derives the RNG seeds
    of ranks that have no saved state (a larger world size on resume)."""

    def __init__(self, url: str | CheckpointStore, *, save_every: int | None = None,
                 keep_last: int | None = None, keep_every: int | None = None,
                 best: Best | None = None, protect: Iterable[int] = (),
                 rank: int | None = None, world_size: int | None = None,
                 writer_rank: int = 0, run_seed: int = 0,
                 per_rank_batch_size: int | None = None,
                 provenance: prov.Provenance | None = None,
                 rng_gather: RngGather | None = None, async_save: bool = False,
                 **storage_options: Any) -> None:
        self.store = url if isinstance(url, CheckpointStore) else open_store(url,
                                                                             **storage_options)
        if save_every is not None and save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        self.save_every = save_every
        self.policy = RetentionPolicy(keep_last, keep_every)
        self.best_config = best
        self.tracker = BestTracker(best) if best is not None else None
        self._best_record = RecordLog(self.store.storage, BEST_RECORD)
        self._best_generation: int | None = None
        self._best_loaded = False
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
        # async_save (docs/async.md): save() returns after the snapshot; the bookkeeping of a
        # save runs on this thread once it committed (next save, restore_latest or wait()).
        self._deferred: DeferredCommits[SaveResult] | None = (
            DeferredCommits(self.store) if async_save else None)

    def wait(self) -> list[SaveResult]:
        """``async_save``: wait for the pending save, then run its bookkeeping (side outputs,
        best record, prune); returns those SaveResults.  Raises a failed save's error."""
        done = self._deferred.finish() if self._deferred is not None else []
        self.store.wait()
        return done

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def is_writer(self) -> bool:
        return self.rank == self.writer_rank

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

        Call it on every rank: collective when distributed (docs/lifecycle.md §11), else the
        RNG states are gathered and only the writer rank writes.
        ``rng_states`` overrides the gather (rank -> :func:`ckptfs.lifecycle.rng.capture` output).
        Pruning and the best record happen only after the commit succeeded.

        Metrics are checked before anything is written: each must be a real scalar (a Python
        number, a one-element tensor, a NumPy scalar), a bool, a string or None, and the tracked
        ``best`` metric a real scalar or None, else :class:`~ckptfs.UnsupportedValueError`.  A
        NaN or infinite metric is recorded as ``null`` and never enters the best pool (logged).
        Once the checkpoint has committed, ``save`` returns normally: bookkeeping that fails
        after the commit is logged and listed in ``SaveResult.errors``, and never skips the
        rest (the best record, then the prune)."""
        check_step(step)
        self.wait()  # async_save: the previous save's bookkeeping comes first
        if distributed.active(model):
            return distributed.save(self, step, model=model, optimizer=optimizer,
                                    scheduler=scheduler, stateful=stateful, metrics=metrics,
                                    extra=extra, epoch=epoch, rng_states=rng_states)
        states = dict(rng_states) if rng_states is not None else self._gather_rng()
        if not self.is_writer:
            self._last_saved = step
            return SaveResult(None)
        tracked = self.best_config.metric if self.best_config is not None else None
        recorded_metrics = record_metrics(metrics, tracked)
        self.trainer.step = step
        if epoch is not None:
            self.trainer.epoch = int(epoch)
        if extra:
            self.trainer.extra.update(extra)
        state: dict[str, Any] = {}
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
            if obj is not None:
                state[name] = obj.state_dict()
        for name, obj in (stateful or {}).items():
            if name in ("model", "optimizer", "scheduler", "trainer", "rng", "manager"):
                raise ValueError(f"stateful name {name!r} is reserved by the manager")
            state[name] = obj.state_dict()
        state["trainer"] = self.trainer.to_state()
        state["rng"] = rng.pack_ranks(states, self.world_size)
        state["manager"] = {"version": MANAGER_STATE_VERSION, "run_seed": self.run_seed,
                            "world_size": self.world_size, "resumed_from": self.resumed_from}
        side = self.side_outputs.take_pending()
        metadata: dict[str, Any] = {
            "trainer": {k: v for k, v in self.trainer.to_state().items() if k != "extra"},
            "metrics": recorded_metrics,
            "world_size": self.world_size,
            "rng_ranks": sorted(int(r) for r in states),
            "lifecycle": {"resumed_from": self.resumed_from,
                          "protected": sorted(self.protected)},
        }
        record = self._current_provenance().to_record()
        record["changes"] = list(self._pending_changes)
        metadata["provenance"] = record
        if side:
            metadata["side_outputs"] = side
        if self.tracker is not None:
            self._ensure_best_loaded()  # before the commit: the replay must not see this step
        if self._deferred is not None:  # async_save: _committed runs once it has committed
            self._last_saved = step
            return SaveResult(None, future=self._deferred.submit(
                step, state, metadata,
                lambda info: self._committed(step, info, side, recorded_metrics)))
        return self._committed(step, self.store.save(step, state, metadata=metadata), side,
                               metrics)

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
                result.prune = self.prune()
            except Exception as exc:
                self._bookkeeping_failed(result, step, "prune", exc)
            else:
                if result.prune.refused:
                    result.errors.append(f"prune refused: {result.prune.refused}")
        return result

    def _bookkeeping_failed(self, result: SaveResult, step: int, what: str,
                            exc: Exception) -> None:
        msg = f"{what}: {type(exc).__name__}: {exc}"
        log.warning("checkpoint step %d at %s committed, but the %s failed (%s: %s); it is "
                    "redone by the next save or resume", step, self.url, what,
                    type(exc).__name__, exc)
        result.errors.append(msg)

    def _gather_rng(self) -> dict[int, dict[str, Any]]:
        mine = rng.capture()
        if self._rng_gather is not None:
            return {int(r): dict(s) for r, s in self._rng_gather(mine).items()}
        dist = torch.distributed
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            return dist_gather(mine, self.world_size)
        if self.world_size > 1:
            log.warning("world size %d but torch.distributed is not initialized and no "
                        "rng_gather was given: only rank %d's RNG state is saved",
                        self.world_size, self.rank)
        return {self.rank: mine}

    def _current_provenance(self, p: prov.Provenance | None = None) -> prov.Provenance:
        p = p or self.provenance or prov.Provenance()
        return prov.Provenance(p.config, dict(p.fingerprints),
                               {"world_size": self.world_size, **dict(p.execution)})

    # -- best ----------------------------------------------------------------------------------

    def _ensure_best_loaded(self) -> None:
        if self._best_loaded or self.tracker is None:
            self._best_loaded = True
            return
        rec = self._best_record.read()
        steps = self.store.steps()
        if rec is not None:
            self._best_generation = rec.generation
            # a malformed record raises (typed) and stays unloaded: never overwritten by a
            # fresh pool that would let retention delete what it protected
            self.tracker.load_doc(rec.doc, existing=steps, where=f"{self.url}/{rec.path}")
        self._best_loaded = True
        # Replay committed checkpoints the record has not seen (a crash between a commit and
        # the record's update, or a record that was lost): their metrics are in the metadata.
        seen = self.tracker.last_step
        changed = False
        for s in steps:
            if seen is not None and s <= seen:
                continue
            try:
                metrics = self.store.info(s).metadata.get("metrics")
            except CheckpointNotFoundError:
                continue
            except CorruptCheckpointError as exc:  # its metrics are unknown: not a best
                log.warning("best: cannot read the metrics of step %d at %s (%s); it is not "
                            "considered for the best pool", s, self.url, exc)
                continue
            improved, _ = self.tracker.observe(s, metrics if isinstance(metrics, dict) else {})
            changed = changed or improved
        if changed or (rec is not None and rec.doc != self.tracker.to_doc()):
            try:
                self._persist_best()
            except CkptfsError as exc:  # the in-memory pool is right; the next update retries
                log.warning("best: could not update the best record at %s (%s); it is "
                            "rewritten at the next improvement, and replayed on resume",
                            self.url, exc)

    def _persist_best(self) -> None:
        assert self.tracker is not None
        doc = self.tracker.to_doc()
        self._best_record.update(lambda _cur: doc)
        rec = self._best_record.read()
        self._best_generation = rec.generation if rec else None

    def best(self) -> dict[str, Any] | None:
        """The best checkpoint so far: ``{"step", "value"}``, or None."""
        self._ensure_best_loaded()
        return self.tracker.best if self.tracker is not None else None

    def best_steps(self) -> list[int]:
        """The running-best pool; without ``best=``, the pool a previous configuration of the
        run persisted (so dropping ``best=`` never silently deletes those checkpoints)."""
        self._ensure_best_loaded()
        if self.tracker is not None:
            return self.tracker.steps
        rec = self._best_record.read()
        if rec is None:
            return []
        return best_steps_of(rec.doc, f"{self.url}/{rec.path}")

    # -- retention and GC ------------------------------------------------------------------------

    def prune(self, *, dry_run: bool = False) -> PruneReport:
        """Apply the retention policy now (``save`` does after every commit)."""
        if not dry_run:
            self.side_outputs.reconcile()
        protected = set(self.protected)
        if self.resumed_from is not None:
            protected.add(self.resumed_from)
        return prune(self.store, self.policy, best=self.best_steps(), protected=protected,
                     dry_run=dry_run)

    def gc(self, *, older_than: timedelta = DEFAULT_GRACE, dry_run: bool = False) -> GcReport:
        """Remove uncommitted attempts, temporary files and orphaned uploads older than
        ``older_than`` (see :mod:`ckptfs.lifecycle.gc`)."""
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
        verified while loading) raises :class:`~ckptfs.CorruptCheckpointError`; with
        ``allow_rollback`` the next older committed checkpoint is tried instead (logged), as
        :meth:`CheckpointStore.load <ckptfs.CheckpointStore.load>` does.  Nothing is restored
        into the objects before a checkpoint has loaded and verified.  If every committed
        checkpoint is corrupt, :class:`~ckptfs.CheckpointNotFoundError` lists them (never a
        silent start from step 0)."""
        self.wait()  # a pending async save of this store commits first
        if distributed.active(model):
            return distributed.restore(self, None, **self._dist_args(locals()))
        info = self.store.latest(allow_rollback=allow_rollback)
        skipped: list[str] = []
        vanished = 0
        while info is not None:
            try:
                state = self._load_for_restore(info.step, expect, mode, map_location)
            except FormatVersionError:
                raise  # written by a newer ckptfs: never rolled back over
            except CorruptCheckpointError as exc:
                if not allow_rollback:
                    raise CorruptCheckpointError(
                        f"the newest committed checkpoint, step {info.step} at {self.url}, is "
                        f"corrupt: {exc}. Refusing to fall back silently: run 'ckptfs verify "
                        f"{self.url} --step {info.step}', delete it, or pass "
                        "allow_rollback=True", step=info.step, path=exc.path) from exc
                log.warning("allow_rollback: skipping corrupt checkpoint step %d at %s: %s",
                            info.step, self.url, exc)
                skipped.append(f"step {info.step}: {exc}")
                info = self._previous_committed(info.step, skipped)
                continue
            except CheckpointNotFoundError:
                # deleted while it was being read (a prune by another job): resolve again
                vanished += 1
                if vanished > 3 or info.step in self.store.steps():
                    raise
                info = self.store.latest(allow_rollback=allow_rollback)
                continue
            return self._apply_restore(info.step, state, model=model, optimizer=optimizer,
                                       scheduler=scheduler, stateful=stateful,
                                       strict_rng=strict_rng,
                                       discard_uncommitted=discard_uncommitted)
        if skipped:
            raise CheckpointNotFoundError(
                f"no loadable committed checkpoint at {self.url}: every one is corrupt "
                f"({'; '.join(skipped)}); not starting over from step 0 silently")
        if expect is not None:
            self.provenance = expect
        self._after_resume(discard_uncommitted)
        log.info("no committed checkpoint at %s: starting from step 0", self.url)
        return 0

    @staticmethod
    def _dist_args(args: dict[str, Any]) -> dict[str, Any]:
        return {k: args[k] for k in distributed.RESTORE_ARGS}

    def _previous_committed(self, step: int, skipped: list[str]) -> CheckpointInfo | None:
        """The newest committed checkpoint older than ``step`` whose marker and manifest
        check (the corrupt ones are logged and added to ``skipped``)."""
        for s in reversed(self.store.steps()):
            if s >= step:
                continue
            try:
                return self.store.info(s)
            except FormatVersionError:
                raise
            except CorruptCheckpointError as exc:
                log.warning("allow_rollback: skipping corrupt checkpoint step %d at %s: %s", s,
                            self.url, exc)
                skipped.append(f"step {s}: {exc}")
            except CheckpointNotFoundError:
                continue
        return None

    def restore(self, step: int, *, model: torch.nn.Module | None = None,
                optimizer: Stateful | None = None, scheduler: Stateful | None = None,
                stateful: Mapping[str, Stateful] | None = None,
                expect: prov.Provenance | None = None, mode: prov.ProvenanceMode = "exact",
                strict_rng: bool = False, map_location: MapLocation = "cpu",
                discard_uncommitted: bool = True) -> int:
        """Restore checkpoint ``step``; see :meth:`restore_latest`."""
        if distributed.active(model):
            return distributed.restore(self, step, **self._dist_args(
                {**locals(), "allow_rollback": False}))
        state = self._load_for_restore(step, expect, mode, map_location)
        return self._apply_restore(step, state, model=model, optimizer=optimizer,
                                   scheduler=scheduler, stateful=stateful,
                                   strict_rng=strict_rng, discard_uncommitted=discard_uncommitted)

    def _load_for_restore(self, step: int, expect: prov.Provenance | None,
                          mode: prov.ProvenanceMode, map_location: MapLocation
                          ) -> dict[Any, Any]:
        """Check provenance, load and verify ``step``, and check the manager's own entries;
        touches no training object (so a rollback can try the next one)."""
        info = self.store.info(step)
        if expect is not None:
            recorded = info.metadata.get("provenance")
            self._pending_changes = prov.check(
                self.store.storage, self._current_provenance(expect),
                recorded if isinstance(recorded, dict) else None, step=step, mode=mode)
            self.provenance = expect
            for ch in self._pending_changes:
                log.warning("resuming step %d with a declared execution change: %s %r -> %r",
                            step, ch["key"], ch["from"], ch["to"])
        state = self.store.load(step, map_location=map_location)
        _check_manager_entries(state, f"{info.url}/state.msgpack", step)
        if state.get("rng") is not None:
            rng.check_entry(state["rng"])  # RngStateError before any object is touched
        return state

    def _apply_restore(self, step: int, state: dict[Any, Any], *,
                       model: torch.nn.Module | None, optimizer: Stateful | None,
                       scheduler: Stateful | None, stateful: Mapping[str, Stateful] | None,
                       strict_rng: bool, discard_uncommitted: bool) -> int:
        missing = [n for n, o in (("model", model), ("optimizer", optimizer),
                                  ("scheduler", scheduler)) if o is not None and n not in state]
        missing += [n for n in (stateful or {}) if n not in state]
        if missing:
            raise CheckpointNotFoundError(
                f"checkpoint step {step} at {self.url} has no state for {missing}; it holds "
                f"{sorted(k for k in state if isinstance(k, str))}")
        distributed.load_into_objects(state, model, optimizer)  # DCP state dicts or plain
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
        self._best_loaded = False
        self._ensure_best_loaded()
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
        return (f"CheckpointManager({self.url!r}, rank={self.rank}/{self.world_size}, "
                f"keep_last={self.policy.keep_last}, keep_every={self.policy.keep_every}, "
                f"best={self.best_config})")
