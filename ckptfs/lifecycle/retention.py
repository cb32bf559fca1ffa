"""Which committed checkpoints to keep, the running-best tracker, and pruning.

Retention is a pure decision (`plan_retention`) over the committed steps, executed by
`prune`.  The rules, all of which *keep* (a step is deleted only if no rule keeps it):

- the newest committed checkpoint, always (the one a crash-resume needs);
- ``keep_last`` N: the N newest committed steps (``None``: keep all);
- ``keep_every`` K: every step divisible by K (milestones);
- the running-best pool (`BestTracker`);
- protected steps (e.g. the checkpoint the run resumed from).

Pruning runs only after a new checkpoint has committed (the manager calls it after ``save``
returns), deletes oldest first, and goes through `CheckpointStore.delete`, which removes
the marker first: a prune killed half-way leaves a step that reads as *incomplete*, never one
that reads as committed with files missing.

The running-best tracker (from the robotics code base) keeps a pool of at most K steps, each a
strict improvement over every earlier value of the metric (``None`` and NaN never improve), most
recent last.  When the pool overflows, its oldest entry leaves the pool; that checkpoint is then
deleted by the next prune only if no other rule keeps it (a best that is also a milestone
stays).  The tracker is persisted in the store as an atomically written record
(`ckptfs.lifecycle.records`: exclusive creation of the next generation, on every backend).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ckptfs.errors import (
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    StorageNotFoundError,
    UnsupportedValueError,
)
from ckptfs.format.layout import MAX_STEP
from ckptfs.lifecycle.records import CorruptRecordError, RecordLog
from ckptfs.protocol.resolve import committed_steps
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
    """What `prune` did.  ``refused`` says why nothing was deleted when the newest
    committed checkpoint fails its quick verify (the older ones are then its only fallbacks);
    ``already_gone`` lists steps another process deleted first (not a failure)."""

    plan: RetentionPlan
    deleted: list[int]
    dry_run: bool
    errors: dict[int, str] = field(default_factory=dict)
    refused: str | None = None
    already_gone: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {**self.plan.as_dict(), "deleted": self.deleted, "dry_run": self.dry_run,
                "errors": {str(k): v for k, v in self.errors.items()},
                "refused": self.refused, "already_gone": self.already_gone}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> PruneReport:
        """The report `as_dict` wrote (sent to the other ranks of a distributed job)."""
        plan = RetentionPlan({int(k): list(v) for k, v in doc["keep"].items()},
                             [int(s) for s in doc["delete"]])
        return cls(plan, [int(s) for s in doc["deleted"]], bool(doc["dry_run"]),
                   {int(k): str(v) for k, v in doc["errors"].items()}, doc["refused"],
                   [int(s) for s in doc["already_gone"]])


def newest_problem(store: CheckpointStore, step: int) -> str | None:
    """Why the newest committed checkpoint ``step`` cannot serve as the one to resume from
    (quick verify: marker, manifest, names and sizes from one listing), or ``None``."""
    try:
        store.verify(step, quick=True)
    except CheckpointNotFoundError:
        raise
    except CorruptCheckpointError as exc:
        return str(exc)
    return None


def prune(store: CheckpointStore, policy: RetentionPolicy, *, best: Iterable[int] = (),
          protected: Iterable[int] = (), dry_run: bool = False,
          hold: Callable[[], Iterable[int]] | None = None) -> PruneReport:
    """Delete the committed checkpoints no rule keeps, oldest first, marker first.

    The newest committed step is re-read from storage here, so a checkpoint committed by this
    or another writer just before is never a candidate.  Before deleting anything the newest
    committed checkpoint gets a quick verify (marker, manifest, names and sizes): if it fails,
    nothing is deleted and ``refused`` says why, because the older checkpoints are then the only
    ones a resume can fall back to (``dry_run`` checks too).  A checkpoint that another process
    deleted first (two prunes at once) is listed in ``already_gone``, not as an error.

    ``hold``: steps to keep as well, asked right after each listing (the remote tier's prune
    keeps every step the local tier holds: read after the remote was listed, a step the local
    tier still holds then is never a candidate).  The store's `CheckpointStore.holds` (a
    two-tier store: its local steps not replicated yet) are kept too."""
    best, protected = list(best), [*protected, *store.holds]
    for _ in range(5):
        steps = committed_steps(store.storage)  # the tier it deletes from (two tiers: local)
        held = [*protected, *(hold() if hold is not None else ())]
        plan = plan_retention(steps, policy, best=best, protected=held)
        report = PruneReport(plan, [], dry_run)
        if not plan.delete:
            return report
        newest = max(plan.keep)
        try:
            problem = newest_problem(store, newest)
        except CheckpointNotFoundError:
            continue  # deleted meanwhile (by hand, or replaced): plan again on a fresh listing
        break
    else:
        report.refused = ("the committed checkpoints changed under the prune 5 times in a row "
                          "(another process is deleting them); nothing deleted, run it again")
        log.warning("prune at %s: %s", store.url, report.refused)
        return report
    if problem is not None:
        report.refused = (
            f"the newest committed checkpoint, step {newest}, fails a quick verify ({problem}); "
            f"the older checkpoints are the fallbacks a resume needs, so none was deleted. "
            f"Inspect it with 'ckptfs verify {store.url} --step {newest}', delete it if it is "
            "damaged, then prune again")
        log.warning("prune at %s: %s", store.url, report.refused)
        return report
    if dry_run:
        return report
    for step in plan.delete:
        try:
            store.delete(step)
        except (StorageNotFoundError, CheckpointNotFoundError) as exc:
            _gone_or_failed(store, step, report, exc)
            continue
        except Exception as exc:  # keep pruning the others; the report says what failed
            log.warning("prune: could not delete step %d at %s: %s", step, store.url, exc)
            report.errors[step] = f"{type(exc).__name__}: {exc}"
            continue
        log.info("prune: deleted step %d at %s", step, store.url)
        report.deleted.append(step)
    return report


def _gone_or_failed(store: CheckpointStore, step: int, report: PruneReport,
                    exc: Exception) -> None:
    """A delete that found something missing: success if the step is no longer committed
    (another prune removed it first), else a failure for the report."""
    try:
        still = step in committed_steps(store.storage)
    except Exception:  # cannot tell: report the original failure
        still = True
    if not still:
        log.info("prune: step %d at %s was already deleted by another process", step,
                 store.url)
        report.already_gone.append(step)
        return
    log.warning("prune: could not delete step %d at %s: %s", step, store.url, exc)
    report.errors[step] = f"{type(exc).__name__}: {exc}"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_value(value: object, *, key: str = "metric") -> float | None:
    """The float value of a metric, ``None`` for ``None``.

    Accepts any real scalar: ``int``, ``float``, a one-element tensor or NumPy array/scalar of
    an integer or floating dtype, and anything else real with ``__float__`` (``Decimal``,
    ``Fraction``).  Booleans (a comparison result, not a measurement), complex numbers, strings,
    multi-element tensors or arrays and ints too large for a float raise
    `UnsupportedValueError`.  NaN and infinities are returned as such: the caller
    decides (the best tracker never lets them in)."""
    what = f"metric {key!r}"
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UnsupportedValueError(
                f"{what} is a tensor of shape {tuple(value.shape)}; give one number (e.g. "
                "loss.mean() or loss.item())")
        if value.dtype == torch.bool or value.is_complex():
            raise UnsupportedValueError(f"{what} is a {value.dtype} tensor; give a real number")
        value = value.detach().cpu().item()
    else:
        kind = getattr(getattr(value, "dtype", None), "kind", None)  # NumPy scalar or array
        if isinstance(kind, str):
            size = getattr(value, "size", 1)
            if size != 1:
                raise UnsupportedValueError(f"{what} is an array of {size} values; give one "
                                            "number")
            if kind not in "iuf":
                raise UnsupportedValueError(f"{what} has dtype {value.dtype} (kind {kind!r}); "  # type: ignore[attr-defined]
                                            "give a real number")
            value = value.item()  # type: ignore[attr-defined]
    if isinstance(value, bool):
        raise UnsupportedValueError(f"{what} is a bool ({value}); give a number")
    if isinstance(value, (str, bytes, bytearray)) or (
            isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real)):
        raise UnsupportedValueError(f"{what} is {type(value).__name__} {value!r:.80}; give a "
                                    "real number")
    if not isinstance(value, numbers.Real) and not hasattr(type(value), "__float__"):
        raise UnsupportedValueError(f"{what} is a {type(value).__name__}; give a real number")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError, ArithmeticError) as exc:
        raise UnsupportedValueError(f"{what} ({type(value).__name__}) does not convert to a "
                                    f"float: {exc}") from None


def _as_bool(value: object) -> bool | None:
    """``value`` as a bool if it is one (Python, or a one-element NumPy/torch bool)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        return bool(value.item()) if value.numel() == 1 and value.dtype == torch.bool else None
    dtype = getattr(value, "dtype", None)
    if getattr(dtype, "kind", None) == "b" and getattr(value, "size", 0) == 1:
        return bool(value.item())  # type: ignore[attr-defined]
    return None


def record_metrics(metrics: Mapping[str, Any] | None, tracked: str | None = None
                    ) -> dict[str, Any]:
    """The metrics as recorded in the manifest: real scalars (tensors, NumPy scalars included)
    as floats, NaN/inf as ``None``; booleans, ``None`` and strings as they are.  Anything else
    (a multi-element tensor, a complex number, a list) raises
    `UnsupportedValueError`, as does a ``tracked`` (best) metric that is not a
    real scalar or ``None``: checked before anything is written."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UnsupportedValueError(f"metrics must be a mapping of name -> number, got "
                                    f"{type(metrics).__name__}")
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        key = str(k)
        if k != tracked:
            flag = _as_bool(v)
            if v is None or isinstance(v, str) or flag is not None:
                out[key] = v if flag is None else flag
                continue
        value = metric_value(v, key=key)
        if value is not None and not math.isfinite(value):
            log.warning("metric %r is %s (not finite, e.g. a diverged loss): recorded as null; "
                        "it never enters the best pool", key, value)
            value = None
        out[key] = value
    return out


class BestTracker:
    """The running-best pool of one metric, persisted in the store.

    ``high_water`` is the best value seen; ``pool`` the steps of the last ``keep`` strict
    improvements, most recent last (so also best last)."""

    def __init__(self, config: Best) -> None:
        self.config = config
        self.high_water: float | None = None
        self.pool: list[dict[str, Any]] = []
        self.last_step: int | None = None

    def value_of(self, metrics: Mapping[str, Any] | None) -> float | None:
        """The tracked metric of ``metrics`` as a float, or ``None`` (absent).  Raises
        `UnsupportedValueError` if it is not a real scalar (see
        `metric_value`): the manager calls this before committing a save."""
        if metrics is None:
            return None
        return metric_value(metrics.get(self.config.metric), key=self.config.metric)

    def improves(self, value: object) -> bool:
        """True if ``value`` strictly improves on the high-water mark.  ``None``, NaN,
        infinities and anything that is not a real scalar never improve."""
        try:
            v = metric_value(value, key=self.config.metric)
        except UnsupportedValueError:
            return False
        if v is None or not math.isfinite(v):
            return False
        if self.high_water is None:
            return True
        return v < self.high_water if self.config.mode == "min" else v > self.high_water

    def observe(self, step: int, metrics: Mapping[str, Any] | None) -> tuple[bool, list[int]]:
        """Record ``step``'s metrics.  Returns (improved, steps evicted from the pool).

        Never raises: a value that is not a real scalar, or is NaN or infinite (a diverged
        loss), is logged and does not enter the pool, so it can neither become a best nor make
        the persisted record unwritable."""
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        try:
            value = self.value_of(metrics if isinstance(metrics, Mapping) else None)
        except UnsupportedValueError as exc:
            log.warning("best: step %d: %s; not considered for the best pool", step, exc)
            return False, []
        if value is not None and not math.isfinite(value):
            log.warning("best: step %d: metric %r is %s (not finite, e.g. a diverged loss); "
                        "it never enters the best pool", step, self.config.metric, value)
            return False, []
        if value is None or not self.improves(value):
            return False, []
        self.high_water = value
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
        the pool; a different metric name starts over.  A record of the wrong shape raises
        `CorruptRecordError` (see `check_best_doc`)."""
        doc = check_best_doc(doc, where)
        if doc.get("metric") != self.config.metric:
            log.warning("%s: best record tracks %r, this run tracks %r: starting a new pool",
                        where, doc.get("metric"), self.config.metric)
            return
        pool = [dict(e) for e in doc.get("pool") or []]
        if existing is not None:
            have = set(existing)
            dropped = [e["step"] for e in pool if e["step"] not in have]
            if dropped:
                log.warning("%s: best pool entries for steps %s have no committed checkpoint "
                            "any more; dropped", where, dropped)
            pool = [e for e in pool if e["step"] in have]
        self.pool = pool[-self.config.keep:] if len(pool) > self.config.keep else pool
        hw = doc.get("high_water")
        self.high_water = float(hw) if hw is not None else None
        last = doc.get("last_step")
        self.last_step = int(last) if last is not None else None
        if doc.get("mode") != self.config.mode:
            log.warning("%s: metric %r was tracked with mode %r, now %r: the high-water mark "
                        "(%s) is discarded; the pool %s is kept", where, self.config.metric,
                        doc.get("mode"), self.config.mode, self.high_water, self.steps)
            self.high_water = None


def _step_ok(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEP


def _finite(value: object) -> bool:
    return _is_number(value) and math.isfinite(float(value))  # type: ignore[arg-type]


def check_best_doc(doc: object, where: str = "") -> dict[str, Any]:
    """Validate a persisted best record; returns it as a dict.  Anything of the wrong shape (a
    pool that is not a list of ``{"step": int, "value": finite number}``, a non-finite or
    non-numeric high-water mark, an unknown mode, a newer version) raises
    `CorruptRecordError` naming ``where``: retention must not
    guess which checkpoints a damaged record protects."""
    def bad(why: str) -> CorruptRecordError:
        return CorruptRecordError(
            f"{where or 'best record'}: {why}; ckptfs did not write this (tampering or a bug). "
            "Delete this generation file to fall back to the previous one, or the directory "
            "lifecycle/best/ to start a new pool", path=where or None)

    if not isinstance(doc, Mapping):
        raise bad(f"is a {type(doc).__name__}, not a JSON object")
    version = doc.get("version", 1)
    if not _step_ok(version) or version < 1:
        raise bad(f"version {version!r:.40} is not a positive int")
    if version > 1:
        raise bad(f"version {version} was written by a newer ckptfs (this one reads 1)")
    if not isinstance(doc.get("metric"), str):
        raise bad("'metric' is not a string")
    if doc.get("mode") not in ("min", "max"):
        raise bad(f"'mode' is {doc.get('mode')!r:.40}, not 'min' or 'max'")
    hw = doc.get("high_water")
    if hw is not None and not _finite(hw):
        raise bad(f"'high_water' is {hw!r:.40}, not a finite number or null")
    last = doc.get("last_step")
    if last is not None and not _step_ok(last):
        raise bad(f"'last_step' is {last!r:.40}, not a step")
    pool = doc.get("pool")
    if pool is None:
        pool = []
    if not isinstance(pool, list):
        raise bad(f"'pool' is a {type(pool).__name__}, not a list")
    for e in pool:
        if not (isinstance(e, Mapping) and _step_ok(e.get("step")) and _finite(e.get("value"))):
            raise bad(f"pool entry {e!r:.80} is not {{'step': step, 'value': finite number}}")
    return dict(doc)


def read_best(store: CheckpointStore) -> dict[str, Any] | None:
    """The persisted best record of a store (``None`` if the run never tracked one), validated
    by `check_best_doc`."""
    rec = RecordLog(store.storage, BEST_RECORD).read()
    if rec is None:
        return None
    return check_best_doc(rec.doc, f"{store.url}/{rec.path}")


def best_steps_of(doc: Mapping[str, Any] | None, where: str = "") -> list[int]:
    """The steps of a best record's pool; a malformed record raises
    `CorruptRecordError`."""
    if doc is None:
        return []
    return [int(e["step"]) for e in check_best_doc(doc, where).get("pool") or []]


class BestPool:
    """A run's running-best pool as the manager keeps it: the `BestTracker` (None
    without ``best=``), persisted in the store's ``best`` record and replayed from the
    committed manifests' metrics for steps the record has not seen (a crash between a commit
    and the record's update, or a lost record).  ``steps``: the committed steps to replay
    (default ``store.steps()``; a two-tier store's manager passes both tiers' steps, so a
    record lost with the local disk is rebuilt from the remote tier's checkpoints)."""

    def __init__(self, store: CheckpointStore, config: Best | None,
                 steps: Callable[[], list[int]] | None = None) -> None:
        self.store = store
        self._steps = steps or store.steps
        self.tracker = BestTracker(config) if config is not None else None
        self.record = RecordLog(store.storage, BEST_RECORD)
        self.generation: int | None = None
        self.loaded = False

    def ensure_loaded(self) -> None:
        """Read the record and replay what it missed, once (again after `reload`)."""
        if self.loaded or self.tracker is None:
            self.loaded = True
            return
        rec = self.record.read()
        steps = self._steps()
        if rec is not None:
            self.generation = rec.generation
            # a malformed record raises (typed) and stays unloaded: never overwritten by a
            # fresh pool that would let retention delete what it protected
            self.tracker.load_doc(rec.doc, existing=steps,
                                  where=f"{self.store.url}/{rec.path}")
        self.loaded = True
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
                            "considered for the best pool", s, self.store.url, exc)
                continue
            improved, _ = self.tracker.observe(s, metrics if isinstance(metrics, dict) else {})
            changed = changed or improved
        if changed or (rec is not None and rec.doc != self.tracker.to_doc()):
            try:
                self.persist()
            except CkptfsError as exc:  # the in-memory pool is right; the next update retries
                log.warning("best: could not update the best record at %s (%s); it is "
                            "rewritten at the next improvement, and replayed on resume",
                            self.store.url, exc)

    def reload(self) -> None:
        self.loaded = False
        self.ensure_loaded()

    def persist(self) -> None:
        """Write the tracker's pool as the record's next generation."""
        if self.tracker is None:
            return
        doc = self.tracker.to_doc()
        self.record.update(lambda _cur: doc)
        rec = self.record.read()
        self.generation = rec.generation if rec else None

    def best(self) -> dict[str, Any] | None:
        """The best checkpoint so far: ``{"step", "value"}``, or None."""
        self.ensure_loaded()
        return self.tracker.best if self.tracker is not None else None

    def steps(self) -> list[int]:
        """The pool; without ``best=``, the pool a previous configuration of the run persisted
        (so dropping ``best=`` never silently deletes those checkpoints)."""
        self.ensure_loaded()
        if self.tracker is not None:
            return self.tracker.steps
        rec = self.record.read()
        if rec is None:
            return []
        return best_steps_of(rec.doc, f"{self.store.url}/{rec.path}")
