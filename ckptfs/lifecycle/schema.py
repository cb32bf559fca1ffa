"""What a `CheckpointManager` checkpoint holds: the state entries it reserves,
the shape of its own entries, and the manifest metadata it writes.  Shared by the one manager
body in every mode (one process, or every rank of a process group), by its checks on resume and
by the tools that read a run (docs/lifecycle.md section 1).

The state tree::

    {"model": ..., "optimizer": ..., "scheduler": ..., "<stateful name>": ...,
     "trainer": {"step", "attempted_updates", "successful_updates", "epoch", "extra": {...}},
     "rng": {"world_size": W, "ranks": {rank: rng state}},      (ckptfs.lifecycle.rng; no pickle)
     "manager": {"version": 1, "run_seed", "world_size", "resumed_from",
                 "state_dicts": "dcp", "entries": [...]}}        (the last two: collective saves)

``model``/``optimizer`` are ``state_dict()``s in a one-process save and DCP state dicts
(``get_state_dict``: parameters by name, optimizer state keyed by parameter name) in a collective
one, which ``manager.state_dicts == "dcp"`` marks (`DCP_STATE_DICTS`).

The manifest metadata (readable without loading the state; used by resume and the CLI):
``trainer`` counters, finite ``metrics`` (one value per name for the whole job),
``world_size``, ``rng_ranks`` (ranks that saved an RNG state), ``provenance`` (with accepted
``changes``), ``lifecycle`` (``resumed_from``, ``protected``) and ``side_outputs``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptfs.errors import CorruptCheckpointError

#: Top-level entries the manager writes itself: no ``stateful`` object may use these names.
RESERVED = ("model", "optimizer", "scheduler", "trainer", "rng", "manager")

#: ``manager.version`` of the state written now.
MANAGER_STATE_VERSION = 1

#: ``manager.state_dicts`` of a checkpoint whose model/optimizer entries are DCP state dicts.
DCP_STATE_DICTS = "dcp"


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

    def counters(self) -> dict[str, int]:
        """The counters as the manifest metadata records them (``extra`` stays in the state)."""
        return {k: v for k, v in self.to_state().items() if k != "extra"}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.step = int(state.get("step", 0))
        self.attempted_updates = int(state.get("attempted_updates", 0))
        self.successful_updates = int(state.get("successful_updates", 0))
        self.epoch = int(state.get("epoch", 0))
        self.extra = dict(state.get("extra") or {})


def check_stateful_names(names: Iterable[str]) -> None:
    """``ValueError`` for a ``stateful`` name the manager reserves."""
    for name in names:
        if name in RESERVED:
            raise ValueError(f"stateful name {name!r} is reserved by the manager")


def manager_entry(*, run_seed: int, world_size: int, resumed_from: int | None,
                  dcp_entries: Iterable[str] | None = None) -> dict[str, Any]:
    """The ``manager`` entry.  ``dcp_entries``: the state's entries, for a collective save
    (its model/optimizer are DCP state dicts; a restore checks what it holds before loading)."""
    entry: dict[str, Any] = {"version": MANAGER_STATE_VERSION, "run_seed": run_seed,
                             "world_size": world_size, "resumed_from": resumed_from}
    if dcp_entries is not None:
        names = sorted(n for n in dcp_entries if n != "rng")
        entry["state_dicts"] = DCP_STATE_DICTS
        entry["entries"] = [*names, "rng"]
    return entry


def has_dcp_state_dicts(state: Mapping[Any, Any]) -> bool:
    """Whether the state's model/optimizer entries are DCP state dicts (a collective save)."""
    manager = state.get("manager")
    return isinstance(manager, Mapping) and manager.get("state_dicts") == DCP_STATE_DICTS


def saved_entries(state: Mapping[Any, Any]) -> list[str] | None:
    """The entries a collective save recorded in ``manager.entries`` (None: not recorded)."""
    manager = state.get("manager")
    entries = manager.get("entries") if isinstance(manager, Mapping) else None
    return [str(e) for e in entries] if isinstance(entries, list) else None


def checkpoint_metadata(*, trainer: TrainerState, metrics: Mapping[str, Any], world_size: int,
                        rng_ranks: Iterable[int], resumed_from: int | None,
                        protected: Iterable[int], provenance: Mapping[str, Any],
                        side_outputs: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest metadata of a manager checkpoint (module docstring)."""
    metadata: dict[str, Any] = {
        "trainer": trainer.counters(),
        "metrics": dict(metrics),
        "world_size": world_size,
        "rng_ranks": sorted({int(r) for r in rng_ranks}),
        "lifecycle": {"resumed_from": resumed_from, "protected": sorted(protected)},
        "provenance": dict(provenance),
    }
    if side_outputs:
        metadata["side_outputs"] = dict(side_outputs)
    return metadata


def merge_rank_metrics(per_rank: Sequence[tuple[int, Mapping[str, Any]]]) -> dict[str, Any]:
    """One set of metrics for the checkpoint from each rank's recorded metrics
    (`record_metrics`): the union, so a metric given on one
    rank only (an evaluation on the last pipeline stage) is recorded and tracked.  A metric
    given on several ranks must have the same recorded value on each, else ``ValueError``
    naming the ranks and values (never one rank's value chosen silently)."""
    merged: dict[str, Any] = {}
    given_by: dict[str, list[tuple[int, Any]]] = {}
    for rank, metrics in per_rank:
        for name, value in metrics.items():
            given_by.setdefault(name, []).append((rank, value))
            merged.setdefault(name, value)
    differing = {name: vals for name, vals in given_by.items()
                 if len({json.dumps(v) for _, v in vals}) > 1}
    if differing:
        shown = "; ".join(f"{name!r}: " + ", ".join(f"rank {r}: {v!r}" for r, v in vals)
                          for name, vals in sorted(differing.items()))
        raise ValueError(
            f"metrics differ between ranks ({shown}); a checkpoint records one value per "
            "metric: reduce it across ranks first (e.g. all_reduce), or pass it on one rank "
            "only")
    return merged


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_manager_entries(state: Mapping[Any, Any], where: str, step: int) -> None:
    """The ``trainer`` and ``manager`` entries of a loaded state have the shape the manager
    writes, else `CorruptCheckpointError` (never a raw ``TypeError`` from
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
        entries = manager.get("entries")
        if entries is not None and not (isinstance(entries, list)
                                        and all(isinstance(e, str) for e in entries)):
            raise bad(f"manager 'entries' is {entries!r:.60}, not a list of names")
