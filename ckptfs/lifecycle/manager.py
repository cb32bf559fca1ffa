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

Distributed runs: every rank calls :meth:`save` (the RNG states are gathered with a tensor
collective, no pickle) and only the writer rank (0 by default) writes; every rank calls
:meth:`restore_latest` and gets its own RNG state back.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch

from ckptfs.errors import CheckpointNotFoundError, CkptfsError
from ckptfs.format.layout import check_step
from ckptfs.lifecycle import provenance as prov
from ckptfs.lifecycle import rng
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
)
from ckptfs.protocol.reader import MapLocation
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.protocol.store import CheckpointStore
from ckptfs.protocol.store import open as open_store

log = logging.getLogger("ckptfs")

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
    """What :meth:`CheckpointManager.save` did.  ``info`` is None on non-writer ranks."""

    info: CheckpointInfo | None
    best_improved: bool = False
    evicted_from_best: list[int] = field(default_factory=list)
    prune: PruneReport | None = None


def _finite_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or v is None:
            out[str(k)] = v
        elif isinstance(v, (int, float)):
            out[str(k)] = float(v) if math.isfinite(float(v)) else None
        else:
            out[str(k)] = str(v)
    return out


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
                 rng_gather: RngGather | None = None,
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

        Call it on every rank (the RNG states are gathered); only the writer rank writes.
        ``rng_states`` overrides the gather (rank -> :func:`ckptfs.lifecycle.rng.capture` output).
        Pruning and the best record happen only after the commit succeeded."""
        check_step(step)
        states = dict(rng_states) if rng_states is not None else self._gather_rng()
        if not self.is_writer:
            self._last_saved = step
            return SaveResult(None)
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
            "metrics": _finite_metrics(metrics),
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
        info = self.store.save(step, state, metadata=metadata)
        # Committed.  Everything below is bookkeeping that a resume can redo.
        self._last_saved = step
        self._pending_changes = []
        self.side_outputs.committed(step, side)
        result = SaveResult(info)
        if self.tracker is not None:
            improved, evicted = self.tracker.observe(step, metrics)
            result.best_improved, result.evicted_from_best = improved, evicted
            if improved:
                self._persist_best()
        if self.policy.keep_last is not None:
            result.prune = self.prune()
        return result

    def _gather_rng(self) -> dict[int, dict[str, Any]]:
        mine = rng.capture()
        if self._rng_gather is not None:
            return {int(r): dict(s) for r, s in self._rng_gather(mine).items()}
        dist = torch.distributed
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            return _dist_gather(mine, self.world_size)
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
        self._best_loaded = True
        rec = self._best_record.read()
        steps = self.store.steps()
        if rec is not None:
            self._best_generation = rec.generation
            self.tracker.load_doc(rec.doc, existing=steps, where=self.url)
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
            improved, _ = self.tracker.observe(s, metrics if isinstance(metrics, dict) else {})
            changed = changed or improved
        if changed or (rec is not None and rec.doc != self.tracker.to_doc()):
            self._persist_best()

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
        return best_steps_of(rec.doc if rec is not None else None)

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
        continue from (saved step + 1), or 0 when the run has no checkpoint yet."""
        info = self.store.latest(allow_rollback=allow_rollback)
        if info is None:
            if expect is not None:
                self.provenance = expect
            self._after_resume(discard_uncommitted)
            log.info("no committed checkpoint at %s: starting from step 0", self.url)
            return 0
        return self.restore(info.step, model=model, optimizer=optimizer, scheduler=scheduler,
                            stateful=stateful, expect=expect, mode=mode, strict_rng=strict_rng,
                            map_location=map_location, discard_uncommitted=discard_uncommitted)

    def restore(self, step: int, *, model: torch.nn.Module | None = None,
                optimizer: Stateful | None = None, scheduler: Stateful | None = None,
                stateful: Mapping[str, Stateful] | None = None,
                expect: prov.Provenance | None = None, mode: prov.ProvenanceMode = "exact",
                strict_rng: bool = False, map_location: MapLocation = "cpu",
                discard_uncommitted: bool = True) -> int:
        """Restore checkpoint ``step``; see :meth:`restore_latest`."""
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
        missing = [n for n, o in (("model", model), ("optimizer", optimizer),
                                  ("scheduler", scheduler)) if o is not None and n not in state]
        missing += [n for n in (stateful or {}) if n not in state]
        if missing:
            raise CheckpointNotFoundError(
                f"checkpoint step {step} at {self.url} has no state for {missing}; it holds "
                f"{sorted(k for k in state if isinstance(k, str))}")
        if model is not None:
            model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
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


# -- torch.distributed gather of RNG states (tensor collectives: no pickle) ---------------------


def encode_rng(state: Mapping[str, Any]) -> bytes:
    """An RNG state as msgpack bytes (tensors as raw bytes), for a tensor collective."""
    import msgpack

    def enc(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {"__u8__": v.cpu().contiguous().numpy().tobytes()}
        if isinstance(v, dict):
            return {k: enc(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        return v

    return bytes(msgpack.packb(enc(dict(state)), use_bin_type=True))


def decode_rng(data: bytes) -> dict[str, Any]:
    import msgpack

    def dec(v: Any) -> Any:
        if isinstance(v, dict):
            if set(v) == {"__u8__"}:
                return torch.frombuffer(bytearray(v["__u8__"]), dtype=torch.uint8).clone()
            return {k: dec(x) for k, x in v.items()}
        if isinstance(v, list):
            return [dec(x) for x in v]
        return v

    out = dec(msgpack.unpackb(data, raw=False, strict_map_key=False))
    if not isinstance(out, dict):
        raise CkptfsError("gathered RNG state is not a mapping")
    return out


def _dist_gather(mine: dict[str, Any], world_size: int) -> dict[int, dict[str, Any]]:
    dist = torch.distributed
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    data = encode_rng(mine)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    longest = int(max(int(s.item()) for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.zeros_like(buf) for _ in range(world_size)]
    dist.all_gather(bufs, buf)
    return {r: decode_rng(bytes(b[:int(sizes[r].item())].cpu().numpy().tobytes()))
            for r, b in enumerate(bufs)}
