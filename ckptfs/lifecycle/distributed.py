"""``CheckpointManager`` on every rank of a torch.distributed job (docs/lifecycle.md §11).

When torch.distributed is initialized with more than one rank (or the model holds DTensors),
:meth:`CheckpointManager.save` and :meth:`~CheckpointManager.restore_latest` are collective:

* the model and optimizer go through ``torch.distributed.checkpoint.state_dict``
  (``get_state_dict`` / ``set_state_dict``): every rank saves and loads only its own shards
  (never a gather to one rank), and a checkpoint written by W ranks restores into any W';
* each rank's RNG state is a rank-keyed value (``rng.ranks.<rank>``) of the same collective
  ``store.save``: written by that rank, read back by that rank only;
* the checks before the save (metrics, names, state dicts) are agreed: if one rank fails, every
  rank raises (:func:`Group.agree`), before anything is written; the save itself fails on every
  rank together (``store.save`` maps DCP's failures);
* the bookkeeping after the commit (side-output record, best record, prune) runs once, on the
  writer rank, and its outcome is broadcast: every rank returns the same ``SaveResult``.

The small collectives here send JSON through uint8 tensors on ckptfs's gloo group (no pickle).
``ckptfs.protocol.sharded`` (and so DCP, seconds to import) is imported only when needed.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from ckptfs.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    ProvenanceMismatchError,
    ShardedCheckpointError,
    ShardedLoadError,
    ShardedSaveError,
)
from ckptfs.format.layout import check_step
from ckptfs.lifecycle import provenance as prov
from ckptfs.lifecycle import rng
from ckptfs.lifecycle.retention import PruneReport, RetentionPlan, record_metrics
from ckptfs.protocol.load_options import select_and_map, tensor_map

if TYPE_CHECKING:
    from ckptfs.lifecycle.manager import CheckpointManager, SaveResult, Stateful

log = logging.getLogger("ckptfs")

T = TypeVar("T")

#: ``manager.state_dicts`` of a checkpoint whose model/optimizer entries are DCP state dicts
#: (``get_state_dict``: parameters by name, optimizer state keyed by parameter name).
DCP_STATE_DICTS = "dcp"

RESERVED = ("model", "optimizer", "scheduler", "trainer", "rng", "manager")

#: The keyword arguments of :func:`restore` (those of ``CheckpointManager.restore_latest``).
RESTORE_ARGS = ("model", "optimizer", "scheduler", "stateful", "expect", "mode", "strict_rng",
                "map_location", "allow_rollback", "discard_uncommitted")


def active(model: torch.nn.Module | None) -> bool:
    """Whether the manager runs collectively: torch.distributed is initialized and the world
    has more than one rank, or the model holds DTensors (FSDP2 on one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if dist.get_world_size() > 1:
        return True
    if model is None:
        return False
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Agreement: small pickle-free collectives, and one error class on every rank


def _describe(exc: BaseException) -> dict[str, Any]:
    doc: dict[str, Any] = {"module": type(exc).__module__, "name": type(exc).__qualname__,
                           "message": str(exc)}
    for attr in ("step", "path", "diagnostic"):
        value = getattr(exc, attr, None)
        if isinstance(value, (int, str)):
            doc[attr] = value
    if isinstance(exc, ProvenanceMismatchError):
        doc["differences"] = [[str(k), repr(a), repr(b)] for k, a, b in exc.differences]
    if isinstance(exc, ShardedCheckpointError):
        doc["failures"] = {str(r): str(v) for r, v in exc.failures.items()}
    return doc


def _rebuild(doc: Mapping[str, Any], message: str) -> BaseException | None:
    """An exception of the class ``doc`` names (ckptfs's or a builtin), or None."""
    module, name = str(doc.get("module")), str(doc.get("name"))
    if not (module == "builtins" or module == "ckptfs" or module.startswith("ckptfs.")):
        return None
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return None
    try:
        if issubclass(cls, ProvenanceMismatchError):
            return cls(message, differences=[tuple(d) for d in doc.get("differences", [])],
                       diagnostic=doc.get("diagnostic"))
        if issubclass(cls, CorruptCheckpointError):
            return cls(message, step=doc.get("step"), path=doc.get("path"))
        if issubclass(cls, ShardedCheckpointError):
            return cls(message, failures={int(r): v for r, v in
                                          (doc.get("failures") or {}).items()})
        return cls(message)
    except Exception:  # a class with other required arguments
        return None


class Group:
    """This job's ranks, on ckptfs's dedicated gloo group (``sharded.collective_group``)."""

    def __init__(self) -> None:
        from ckptfs.protocol import sharded  # lazily: DCP takes seconds to import
        self.group = sharded.collective_group(None)
        self.rank = int(dist.get_rank())
        self.world = int(dist.get_world_size())
        self.ranks = [int(r) for r in dist.get_process_group_ranks(self.group)]

    def _collective(self, fn: Callable[[], T], what: str,
                    default: type[ShardedCheckpointError]) -> T:
        try:
            return fn()
        except Exception as exc:  # a peer died or the group broke
            raise default(f"{what}: a checkpoint collective failed ({type(exc).__name__}: "
                          f"{exc}); a rank died, hung past the timeout, or the process group "
                          "broke", failures={}) from exc

    def gather(self, doc: Any, what: str, default: type[ShardedCheckpointError]) -> list[Any]:
        data = json.dumps(doc, default=str).encode()

        def run() -> list[Any]:
            size = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.zeros_like(size) for _ in self.ranks]
            dist.all_gather(sizes, size, group=self.group)
            buf = torch.zeros(max(1, max(int(s.item()) for s in sizes)), dtype=torch.uint8)
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            bufs = [torch.zeros_like(buf) for _ in self.ranks]
            dist.all_gather(bufs, buf, group=self.group)
            return [json.loads(bytes(b[:int(n.item())].numpy().tobytes()))
                    for b, n in zip(bufs, sizes, strict=True)]

        return self._collective(run, what, default)

    def broadcast(self, doc: Any, root: int, what: str,
                  default: type[ShardedCheckpointError]) -> Any:
        data = json.dumps(doc, default=str).encode() if self.rank == root else b""

        def run() -> Any:
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(size, src=root, group=self.group)
            buf = torch.zeros(max(1, int(size.item())), dtype=torch.uint8)
            if self.rank == root:
                buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            dist.broadcast(buf, src=root, group=self.group)
            return json.loads(bytes(buf[:int(size.item())].numpy().tobytes()))

        return self._collective(run, what, default)

    def agree(self, fn: Callable[[], T], what: str,
              default: type[ShardedCheckpointError]) -> T:
        """Run ``fn`` on every rank; if it raised on any rank, raise on every rank (the same
        error class everywhere: the failing ranks' class when they share one, else
        ``default`` with ``failures``)."""
        own: Exception | None = None
        out: Any = None
        try:
            out = fn()
        except Exception as exc:
            own = exc
        docs = self.gather(None if own is None else _describe(own), what, default)
        failures = {r: d for r, d in zip(self.ranks, docs, strict=True) if d is not None}
        if failures:
            self._raise(failures, own, what, default)
        return out  # type: ignore[no-any-return]

    def from_root(self, fn: Callable[[], Any], root: int, what: str,
                  default: type[ShardedCheckpointError]) -> Any:
        """Run ``fn`` on ``root`` only; every rank returns its (JSON) result or raises its
        error."""
        own: Exception | None = None
        doc: dict[str, Any] = {}
        if self.rank == root:
            try:
                doc = {"ok": fn()}
            except Exception as exc:
                own = exc
                doc = {"error": _describe(exc)}
        doc = self.broadcast(doc, root, what, default)
        if "error" in doc:
            self._raise({root: doc["error"]}, own, what, default)
        return doc.get("ok")

    def _raise(self, failures: dict[int, dict[str, Any]], own: Exception | None, what: str,
               default: type[ShardedCheckpointError]) -> None:
        classes = {(d.get("module"), d.get("name")) for d in failures.values()}
        if own is not None and len(classes) == 1 and len(failures) == len(self.ranks):
            raise own  # every rank failed the same way: its own error, unchanged
        parts = "; ".join(f"rank {r}: {d.get('name')}: {d.get('message')}"
                          for r, d in sorted(failures.items()))
        msg = f"{what} failed on rank(s) {sorted(failures)}: {parts}"
        if len(classes) == 1:
            err = _rebuild(failures[min(failures)], msg)
            if err is not None:
                raise err from own
        raise default(msg, failures={r: f"{d.get('name')}: {d.get('message')}"
                                     for r, d in failures.items()}) from own


# ----------------------------------------------------------------------------------------------
# Save


def _state_dicts(model: torch.nn.Module | None, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    if model is None:
        return {}
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def _result_doc(result: SaveResult) -> dict[str, Any]:
    return {"best_improved": result.best_improved, "evicted": list(result.evicted_from_best),
            "errors": list(result.errors),
            "prune": result.prune.as_dict() if result.prune is not None else None}


def _result_from(info: Any, doc: Mapping[str, Any]) -> SaveResult:
    from ckptfs.lifecycle.manager import SaveResult
    p = doc.get("prune")
    report = None
    if p is not None:
        plan = RetentionPlan({int(k): list(v) for k, v in p["keep"].items()}, list(p["delete"]))
        report = PruneReport(plan, list(p["deleted"]), bool(p["dry_run"]),
                             {int(k): v for k, v in p["errors"].items()}, p["refused"],
                             list(p["already_gone"]))
    return SaveResult(info, best_improved=bool(doc["best_improved"]),
                      evicted_from_best=list(doc["evicted"]), prune=report,
                      errors=list(doc["errors"]))


def save(mgr: CheckpointManager, step: int, *, model: torch.nn.Module | None,
         optimizer: Stateful | None, scheduler: Stateful | None,
         stateful: Mapping[str, Stateful] | None, metrics: Mapping[str, Any] | None,
         extra: Mapping[str, Any] | None, epoch: int | None,
         rng_states: Mapping[int, Mapping[str, Any]] | None) -> SaveResult:
    """The collective :meth:`CheckpointManager.save` (module docstring)."""
    g = Group()
    what = f"CheckpointManager.save of step {step} at {mgr.url}"

    def check() -> dict[str, Any]:
        check_step(step)
        if mgr._deferred is not None:
            raise ShardedSaveError(
                "async_save=True is not supported in a distributed job yet: use "
                "ckptfs.dcp.Writer with torch.distributed.checkpoint.async_save (docs/sharded.md)")
        if (mgr.rank, mgr.world_size) != (g.rank, g.world):
            raise ValueError(f"the manager was made for rank {mgr.rank} of {mgr.world_size}, "
                             f"but this process is rank {g.rank} of {g.world} in "
                             "torch.distributed: leave rank/world_size unset")
        if mgr.writer_rank != 0:
            raise ValueError(f"writer_rank={mgr.writer_rank}: in a distributed job rank 0 "
                             "commits and keeps the records; leave writer_rank at 0")
        if optimizer is not None and model is None:
            raise ValueError("a distributed save of an optimizer needs model= too (DCP names "
                             "the optimizer's state by parameter name)")
        for name in stateful or {}:
            if name in RESERVED:
                raise ValueError(f"stateful name {name!r} is reserved by the manager")
        tracked = mgr.best_config.metric if mgr.best_config is not None else None
        return record_metrics(metrics, tracked)

    recorded = g.agree(check, what, ShardedSaveError)  # before anything is built or written

    def build() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        from ckptfs.lifecycle.manager import MANAGER_STATE_VERSION
        state = _state_dicts(model, optimizer)
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        for name, obj in (stateful or {}).items():
            state[name] = obj.state_dict()
        mgr.trainer.step = step
        if epoch is not None:
            mgr.trainer.epoch = int(epoch)
        if extra:
            mgr.trainer.extra.update(extra)
        state["trainer"] = mgr.trainer.to_state()
        states = dict(rng_states) if rng_states is not None else {g.rank: rng.capture()}
        state["rng"] = rng.pack_ranks(states, g.world)  # rank-keyed: written by its rank
        state["manager"] = {"version": MANAGER_STATE_VERSION, "run_seed": mgr.run_seed,
                            "world_size": g.world, "resumed_from": mgr.resumed_from,
                            "state_dicts": DCP_STATE_DICTS,
                            "entries": [*sorted(k for k in state if k != "rng"), "rng"]}
        metadata: dict[str, Any] = {
            "trainer": {k: v for k, v in mgr.trainer.to_state().items() if k != "extra"},
            "metrics": recorded,
            "world_size": g.world,
            "rng_ranks": (sorted(int(r) for r in states) if rng_states is not None
                          else list(range(g.world))),
            "lifecycle": {"resumed_from": mgr.resumed_from, "protected": sorted(mgr.protected)},
        }
        record = mgr._current_provenance().to_record()
        record["changes"] = list(mgr._pending_changes)
        metadata["provenance"] = record
        side: dict[str, Any] = {}
        if mgr.is_writer:
            side = mgr.side_outputs.take_pending()
            if side:
                metadata["side_outputs"] = side
            if mgr.tracker is not None:
                mgr._ensure_best_loaded()  # before the commit: the replay must not see it
        return state, metadata, side

    state, metadata, side = g.agree(build, what, ShardedSaveError)
    info = mgr.store.save(step, state, metadata=metadata)  # collective: fails on every rank
    doc = g.from_root(lambda: _result_doc(mgr._committed(step, info, side, metrics)),
                      mgr.writer_rank, f"{what} (committed; bookkeeping)", ShardedSaveError)
    mgr._last_saved = step
    mgr._pending_changes = []
    return _result_from(info, doc)


# ----------------------------------------------------------------------------------------------
# Restore


def _fresh(value: Any) -> Any:
    """A copy of a state dict's structure with new, empty tensors of the same placement: the
    collective load fills these, and the model and optimizer are touched only once it has
    loaded and verified everything."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    return value


def load_into_objects(state: Mapping[Any, Any], model: torch.nn.Module | None,
                      optimizer: Any) -> None:
    """Put the ``model``/``optimizer`` entries of a loaded state into the objects: with
    ``set_state_dict`` when they are DCP state dicts (a distributed save), else with
    ``load_state_dict`` (a single-process save)."""
    manager = state.get("manager")
    is_dcp = isinstance(manager, Mapping) and manager.get("state_dicts") == DCP_STATE_DICTS
    if model is not None and is_dcp:
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_state_dict,
        )
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        else:
            set_model_state_dict(model, state["model"])
        return
    if model is not None:
        model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])


def _small_state(mgr: CheckpointManager, g: Group, step: int, names: list[str],
                 map_location: Any) -> tuple[dict[Any, Any], bool]:
    """(the state without the model and optimizer entries, whether it is a sharded one);
    this rank's RNG state only.  A single-process (v1) checkpoint is loaded whole."""
    from ckptfs.format.sharded import SHARDED_FORMAT_VERSION
    info = mgr.store.info(step)
    if info.manifest.format_version != SHARDED_FORMAT_VERSION:
        return mgr.store.load(step, map_location=map_location), False
    from ckptfs.protocol import sharded
    keys = {"trainer", "manager", "rng.world_size", f"rng.ranks.{g.rank}", *names}
    state = sharded.load_full(mgr.store.storage, info, keys=keys, threads=mgr.store.threads)
    state = select_and_map(state, info.url, None, tensor_map(map_location))
    where = f"{info.url}/dcp.msgpack"
    present = info.metadata.get("rng_ranks")
    entry = state.get("rng")
    if isinstance(entry, dict):
        if not (isinstance(present, list) and all(isinstance(r, int) for r in present)):
            raise CorruptCheckpointError(f"{where}: manifest metadata 'rng_ranks' is "
                                         f"{present!r:.60}, not a list of ranks", step=step)
        raw = entry.get("ranks")
        ranks: dict[Any, Any] = raw if isinstance(raw, dict) else {}
        # the other ranks' states are not read: only which ranks have one matters here
        entry["ranks"] = {**{r: None for r in present}, **ranks}
    return state, True


def _prepare(mgr: CheckpointManager, g: Group, step: int, *, model: Any, optimizer: Any,
             names: list[str], map_location: Any) -> tuple[dict[Any, Any], bool]:
    from ckptfs.lifecycle.manager import _check_manager_entries
    state, is_sharded = _small_state(mgr, g, step, names, map_location)
    _check_manager_entries(state, f"{mgr.url} step {step}", step)
    if state.get("rng") is not None:
        rng.check_entry(state["rng"])
    if is_sharded:
        manager = state.get("manager") if isinstance(state.get("manager"), dict) else {}
        entries = manager.get("entries") if isinstance(manager, dict) else None
        wanted = [n for n, o in (("model", model), ("optimizer", optimizer)) if o is not None]
        if isinstance(entries, list):
            missing = [n for n in wanted if n not in entries]
            if missing:
                raise CheckpointNotFoundError(
                    f"checkpoint step {step} at {mgr.url} has no state for {missing}; it holds "
                    f"{sorted(str(e) for e in entries)}")
    return state, is_sharded


def restore(mgr: CheckpointManager, step: int | None, *, model: torch.nn.Module | None,
            optimizer: Stateful | None, scheduler: Stateful | None,
            stateful: Mapping[str, Stateful] | None, expect: prov.Provenance | None,
            mode: prov.ProvenanceMode, strict_rng: bool, map_location: Any,
            allow_rollback: bool, discard_uncommitted: bool) -> int:
    """The collective :meth:`CheckpointManager.restore_latest` (``step`` None) and
    :meth:`~CheckpointManager.restore`: the writer rank resolves the step, every rank loads its
    own part, and a failure on any rank raises on every rank."""
    g = Group()
    root = mgr.writer_rank
    what = f"CheckpointManager restore at {mgr.url}"
    names = ([n for n, o in (("scheduler", scheduler),) if o is not None]
             + list(stateful or {}))

    def latest() -> int | None:
        if step is not None:
            return mgr.store.info(step).step
        info = mgr.store.latest(allow_rollback=allow_rollback)
        return None if info is None else info.step

    def previous(before: int) -> int | None:
        info = mgr._previous_committed(before, skipped)
        return None if info is None else info.step

    skipped: list[str] = []
    target: int | None = g.from_root(latest, root, what, ShardedLoadError)
    vanished = 0
    while target is not None:
        current = int(target)
        try:
            if expect is not None:
                changes = g.from_root(partial(_check_provenance, mgr, current, expect, mode),
                                      root, what, ShardedLoadError)
                mgr._pending_changes = list(changes or [])
                mgr.provenance = expect
                for ch in mgr._pending_changes:
                    log.warning("resuming step %d with a declared execution change: %s %r -> "
                                "%r", current, ch["key"], ch["from"], ch["to"])
            state, is_sharded = g.agree(
                partial(_prepare, mgr, g, current, model=model, optimizer=optimizer,
                        names=names, map_location=map_location),
                f"{what}, step {current}", ShardedLoadError)
            loaded: dict[str, Any] = {}
            if is_sharded and model is not None:
                loaded = _fresh(_state_dicts(model, optimizer))
                mgr.store.load(current, into=loaded)  # collective; verified before it returns
        except FormatVersionError:
            raise
        except CorruptCheckpointError as exc:
            if step is not None:
                raise
            if not allow_rollback:
                raise CorruptCheckpointError(
                    f"the newest committed checkpoint, step {current} at {mgr.url}, is corrupt: "
                    f"{exc}. Refusing to fall back silently: run 'ckptfs verify {mgr.url} "
                    f"--step {current}', delete it, or pass allow_rollback=True",
                    step=current, path=exc.path) from exc
            log.warning("allow_rollback: skipping corrupt checkpoint step %d at %s: %s",
                        current, mgr.url, exc)
            skipped.append(f"step {current}: {exc}")
            target = g.from_root(partial(previous, current), root, what, ShardedLoadError)
            continue
        except CheckpointNotFoundError:
            vanished += 1  # deleted while it was read (another job's prune): resolve again
            again = g.from_root(latest, root, what, ShardedLoadError)
            if step is not None or vanished > 3 or again == current:
                raise
            target = again
            continue

        full = {**state, **loaded}
        apply = partial(mgr._apply_restore, current, full, model=model, optimizer=optimizer,
                        scheduler=scheduler, stateful=stateful, strict_rng=strict_rng,
                        discard_uncommitted=discard_uncommitted)
        return int(g.agree(apply, f"{what}, step {current}", ShardedLoadError))
    if skipped:
        raise CheckpointNotFoundError(
            f"no loadable committed checkpoint at {mgr.url}: every one is corrupt "
            f"({'; '.join(skipped)}); not starting over from step 0 silently")
    if expect is not None:
        mgr.provenance = expect
    g.agree(lambda: mgr._after_resume(discard_uncommitted), what, ShardedLoadError)
    log.info("no committed checkpoint at %s: starting from step 0", mgr.url)
    return 0


def _check_provenance(mgr: CheckpointManager, step: int, expect: prov.Provenance,
                      mode: prov.ProvenanceMode) -> list[dict[str, Any]]:
    """On the writer rank only (a refusal writes one diagnostic file, not one per rank)."""
    info = mgr.store.info(step)
    recorded = info.metadata.get("provenance")
    return prov.check(mgr.store.storage, mgr._current_provenance(expect),
                      recorded if isinstance(recorded, dict) else None, step=step, mode=mode)
