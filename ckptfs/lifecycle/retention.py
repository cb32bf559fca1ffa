"""Which committed checkpoints to keep, the running-best tracker, and pruning.

Retention is a pure decision (:func:`plan_retention`) over the committed steps, executed by
:func:`prune`.  The rules, all of which *keep* (a step is deleted only if no rule keeps it):

- the newest committed checkpoint, always (the one a crash-resume needs);
- ``keep_last`` N: the N newest committed steps (``None``: keep all);
- ``keep_every`` K: every step divisible by K (milestones);
- the running-best pool (:class:`BestTracker`);
- protected steps (e.g. the checkpoint the run resumed from).

Pruning runs only after a new checkpoint has committed (the manager calls it after ``save``
returns), deletes oldest first, and goes through :meth:`CheckpointStore.delete`, which removes
the marker first: a prune killed half-way leaves a step that reads as *incomplete*, never one
that reads as committed with files missing.

The running-best tracker (from the robotics code base) keeps a pool of at most K steps, each a
strict improvement over every earlier value of the metric (``None`` and NaN never improve), most
recent last.  When the pool overflows, its oldest entry leaves the pool; that checkpoint is then
deleted by the next prune only if no other rule keeps it (a best that is also a milestone
stays).  The tracker is persisted in the store as an atomically written record
(:mod:`ckptfs.lifecycle.records`: exclusive creation of the next generation, on every backend).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptfs.lifecycle.records import RecordLog
from ckptfs.protocol.store import CheckpointStore

log = logging.getLogger("ckptfs")

Mode = Literal["min", "max"]
BEST_RECORD = "best"


@dataclass(frozen=True)
class Best:
    """Keep the ``keep`` most recent strict improvements of ``metric`` (``mode`` min or max)."""

    metric: str
    mode: Mode = "min"
    keep: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"Best.mode must be 'min' or 'max', got {self.mode!r}")
        if self.keep < 1:
            raise ValueError(f"Best.keep must be >= 1, got {self.keep}")


@dataclass(frozen=True)
class RetentionPolicy:
    """``keep_last`` None keeps every checkpoint (no pruning by age)."""

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the newest is always kept), got "
                             f"{self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"keep_every must be >= 1, got {self.keep_every}")


@dataclass
class RetentionPlan:
    """Every committed step with the reasons it is kept; ``delete`` holds the rest, oldest
    first."""

    keep: dict[int, list[str]]
    delete: list[int]

    def as_dict(self) -> dict[str, Any]:
        return {"keep": {str(k): v for k, v in sorted(self.keep.items())},
                "delete": list(self.delete)}


def plan_retention(steps: Iterable[int], policy: RetentionPolicy, *,
                   best: Iterable[int] = (), protected: Iterable[int] = ()) -> RetentionPlan:
    """Decide what to keep.  Pure: no storage access."""
    ordered = sorted(set(steps))
    keep: dict[int, list[str]] = {}

    def add(step: int, why: str) -> None:
        keep.setdefault(step, []).append(why)

    if ordered:
        add(ordered[-1], "newest")
    if policy.keep_last is None:
        for s in ordered:
            add(s, "keep-all")
    else:
        for s in ordered[-policy.keep_last:]:
            add(s, f"last-{policy.keep_last}")
    if policy.keep_every:
        for s in ordered:
            if s % policy.keep_every == 0:
                add(s, f"every-{policy.keep_every}")
    present = set(ordered)
    for s in best:
        if s in present:
            add(s, "best")
    for s in protected:
        if s in present:
            add(s, "protected")
    for why in keep.values():
        if "keep-all" in why and len(why) > 1:
            why.remove("keep-all")
    return RetentionPlan(keep, [s for s in ordered if s not in keep])


@dataclass
class PruneReport:
    plan: RetentionPlan
    deleted: list[int]
    dry_run: bool
    errors: dict[int, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {**self.plan.as_dict(), "deleted": self.deleted, "dry_run": self.dry_run,
                "errors": {str(k): v for k, v in self.errors.items()}}


def prune(store: CheckpointStore, policy: RetentionPolicy, *, best: Iterable[int] = (),
          protected: Iterable[int] = (), dry_run: bool = False) -> PruneReport:
    """Delete the committed checkpoints no rule keeps, oldest first, marker first.

    The newest committed step is re-read from storage here, so a checkpoint committed by this
    or another writer just before is never a candidate."""
    plan = plan_retention(store.steps(), policy, best=best, protected=protected)
    report = PruneReport(plan, [], dry_run)
    if dry_run:
        return report
    for step in plan.delete:
        try:
            store.delete(step)
        except Exception as exc:  # keep pruning the others; the report says what failed
            log.warning("prune: could not delete step %d at %s: %s", step, store.url, exc)
            report.errors[step] = f"{type(exc).__name__}: {exc}"
            continue
        log.info("prune: deleted step %d at %s", step, store.url)
        report.deleted.append(step)
    return report


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class BestTracker:
    """The running-best pool of one metric, persisted in the store.

    ``high_water`` is the best value seen; ``pool`` the steps of the last ``keep`` strict
    improvements, most recent last (so also best last)."""

    def __init__(self, config: Best) -> None:
        self.config = config
        self.high_water: float | None = None
        self.pool: list[dict[str, Any]] = []
        self.last_step: int | None = None

    def improves(self, value: object) -> bool:
        if not _is_number(value) or math.isnan(float(value)):  # type: ignore[arg-type]
            return False
        v = float(value)  # type: ignore[arg-type]
        if self.high_water is None:
            return True
        return v < self.high_water if self.config.mode == "min" else v > self.high_water

    def observe(self, step: int, metrics: Mapping[str, Any] | None) -> tuple[bool, list[int]]:
        """Record ``step``'s metrics.  Returns (improved, steps evicted from the pool)."""
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        value = (metrics or {}).get(self.config.metric)
        if not self.improves(value):
            return False, []
        self.high_water = float(value)  # type: ignore[arg-type]
        self.pool = [e for e in self.pool if e["step"] != step]
        self.pool.append({"step": step, "value": self.high_water})
        evicted = []
        while len(self.pool) > self.config.keep:
            evicted.append(int(self.pool.pop(0)["step"]))
        return True, evicted

    @property
    def steps(self) -> list[int]:
        return [int(e["step"]) for e in self.pool]

    @property
    def best(self) -> dict[str, Any] | None:
        return dict(self.pool[-1]) if self.pool else None

    def to_doc(self) -> dict[str, Any]:
        return {"schema": "ckptfs.best", "version": 1, "metric": self.config.metric,
                "mode": self.config.mode, "keep": self.config.keep,
                "high_water": self.high_water, "pool": [dict(e) for e in self.pool],
                "last_step": self.last_step}

    def load_doc(self, doc: Mapping[str, Any], *, existing: Iterable[int] | None = None,
                 where: str = "") -> None:
        """Adopt a persisted record.  Entries whose checkpoint no longer exists are dropped
        (self-heal); a flipped ``mode`` discards the high-water mark with a warning but keeps
        the pool; a different metric name starts over."""
        if doc.get("metric") != self.config.metric:
            log.warning("%s: best record tracks %r, this run tracks %r: starting a new pool",
                        where, doc.get("metric"), self.config.metric)
            return
        pool = [dict(e) for e in doc.get("pool") or []
                if isinstance(e, dict) and isinstance(e.get("step"), int)]
        if existing is not None:
            have = set(existing)
            dropped = [e["step"] for e in pool if e["step"] not in have]
            if dropped:
                log.warning("%s: best pool entries for steps %s have no committed checkpoint "
                            "any more; dropped", where, dropped)
            pool = [e for e in pool if e["step"] in have]
        self.pool = pool[-self.config.keep:] if len(pool) > self.config.keep else pool
        hw = doc.get("high_water")
        self.high_water = (float(hw) if isinstance(hw, (int, float)) and not isinstance(hw, bool)
                           else None)
        last = doc.get("last_step")
        self.last_step = int(last) if isinstance(last, int) else None
        if doc.get("mode") != self.config.mode:
            log.warning("%s: metric %r was tracked with mode %r, now %r: the high-water mark "
                        "(%s) is discarded; the pool %s is kept", where, self.config.metric,
                        doc.get("mode"), self.config.mode, self.high_water, self.steps)
            self.high_water = None


def read_best(store: CheckpointStore) -> dict[str, Any] | None:
    """The persisted best record of a store (``None`` if the run never tracked one)."""
    rec = RecordLog(store.storage, BEST_RECORD).read()
    return rec.doc if rec is not None else None


def best_steps_of(doc: Mapping[str, Any] | None) -> list[int]:
    if not doc:
        return []
    return [int(e["step"]) for e in doc.get("pool") or []
            if isinstance(e, dict) and isinstance(e.get("step"), int)]
