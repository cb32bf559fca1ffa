"""The model and optimizer across torch.distributed.checkpoint's boundary, for the manager's
collective saves and restores (docs/lifecycle.md section 11; who calls what, in which order:
`ckptfs.lifecycle.coordinator`).

* A collective save stores DCP state dicts (``get_state_dict``: parameters by name, optimizer
  state keyed by parameter name; DTensors hold this rank's shards), never a gather to one rank.
* A collective restore loads them into fresh tensors of today's placement (so a checkpoint of
  W ranks restores into any W'), and each rank reads only its own RNG state and the small
  entries; the objects are touched only after everything loaded and verified.
* A one-process (format v1) checkpoint restores into a sharded model too: every rank loads the
  full state, and ``set_state_dict(full_state_dict=True)`` distributes it into the DTensors
  (the optimizer's state, saved by parameter index, is renamed by parameter name first).

``torch.distributed.checkpoint`` (seconds to import) is imported only when called.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ckptfs.errors import CorruptCheckpointError
from ckptfs.format.versions import SHARDED, features
from ckptfs.lifecycle import schema
from ckptfs.protocol.collective import wants_sharded_save
from ckptfs.protocol.load_options import MapLocation, select_and_map, tensor_map
from ckptfs.protocol.resolve import CheckpointInfo, tier_of
from ckptfs.protocol.store import CheckpointStore


def active(model: torch.nn.Module | None) -> bool:
    """Whether the manager runs collectively: the store's own answer for a save of the
    model's parameters (`ckptfs.protocol.collective.wants_sharded_save`: torch.distributed
    initialized and more than one rank, or DTensors, as FSDP2 on one rank holds)."""
    params = {} if model is None else dict(model.named_parameters())
    return wants_sharded_save(params)


def state_dicts(model: torch.nn.Module | None, optimizer: Any) -> dict[str, Any]:
    """The ``model``/``optimizer`` entries of a collective save (DCP state dicts)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    if model is None:
        return {}
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def fresh(value: Any) -> Any:
    """A copy of a state dict's structure with new, empty tensors of the same placement: the
    collective load fills these, and the model and optimizer are touched only once it has
    loaded and verified everything."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {k: fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(fresh(v) for v in value)
    return value


def is_sharded(info: CheckpointInfo) -> bool:
    """Whether ``info`` was written collectively (a format with the ``sharded`` feature:
    v2, and v4 of an incremental store), so that its model and optimizer are loaded into
    DCP state dicts of today's placement."""
    return SHARDED in features(info.manifest)


def load_entries(store: CheckpointStore, info: CheckpointInfo, rank: int,
                 names: Iterable[str], map_location: MapLocation) -> dict[Any, Any]:
    """The entries of a sharded checkpoint one rank restores itself: ``trainer``,
    ``manager``, this rank's RNG state, and ``names`` (scheduler, stateful objects), with
    ``map_location`` applied; no model or optimizer bytes are read.  Only which ranks have an
    RNG state matters for the others: their states are not read (None)."""
    from ckptfs.protocol import sharded
    keys = {"trainer", "manager", "rng.world_size", f"rng.ranks.{rank}", *names}
    storage = tier_of(store.read_tiers(), info)[1]  # a two-tier store: the copy's own tier
    state = sharded.load_full(storage, info, keys=keys, threads=store.threads)
    state = select_and_map(state, info.url, None, tensor_map(map_location))
    where = f"{info.url}/dcp.msgpack"
    present = info.metadata.get("rng_ranks")
    entry = state.get("rng")
    if isinstance(entry, dict):
        if not (isinstance(present, list) and all(isinstance(r, int) for r in present)):
            raise CorruptCheckpointError(f"{where}: manifest metadata 'rng_ranks' is "
                                         f"{present!r:.60}, not a list of ranks",
                                         step=info.step)
        raw = entry.get("ranks")
        ranks: dict[Any, Any] = raw if isinstance(raw, dict) else {}
        entry["ranks"] = {**{r: None for r in present}, **ranks}
    return state


def load_into_objects(state: Mapping[Any, Any], model: torch.nn.Module | None,
                      optimizer: Any, *, collective: bool) -> None:
    """Put the ``model``/``optimizer`` entries of a loaded state into the objects:
    ``set_state_dict`` for DCP state dicts (a collective save); a one-process save's
    ``state_dict()``s with ``load_state_dict`` in one process, and distributed into today's
    placement (`set_full_state`) under a process group."""
    if model is not None and schema.has_dcp_state_dicts(state):
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
    if model is not None and collective:
        set_full_state(model, optimizer, state)
        return
    if model is not None:
        model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])


def set_full_state(model: torch.nn.Module, optimizer: Any, state: Mapping[Any, Any]) -> None:
    """A one-process save's full ``state_dict()``s into a model of any placement (FSDP2,
    TP, DDP, plain), on every rank: ``set_state_dict`` with ``full_state_dict=True`` slices
    each full tensor into this rank's DTensor shard.  The optimizer's state, keyed by
    parameter index as ``optimizer.state_dict()`` saves it, is keyed by parameter name first
    (the index of a parameter is its position in today's param groups, as
    ``optimizer.load_state_dict`` assumes)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    options = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
        return
    by_name = optimizer_state_by_name(state["optimizer"],
                                      get_optimizer_state_dict(model, optimizer))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=by_name,
                   options=options)


def optimizer_state_by_name(saved: Any, current: Mapping[str, Any]) -> dict[str, Any]:
    """``saved`` (``optimizer.state_dict()``: state and param groups by parameter index)
    keyed by parameter name, as DCP's ``current`` (``get_optimizer_state_dict``) names
    today's parameters, group by group and position by position.  ``ValueError`` when the
    groups do not match (as ``optimizer.load_state_dict`` would raise)."""
    if not (isinstance(saved, Mapping) and isinstance(saved.get("param_groups"), list)
            and isinstance(saved.get("state"), Mapping)):
        raise ValueError("the checkpoint's optimizer entry is not an optimizer.state_dict() "
                         "(no 'state' map and 'param_groups' list)")
    groups, now = saved["param_groups"], current["param_groups"]
    sizes = [len(g.get("params", [])) if isinstance(g, Mapping) else -1 for g in groups]
    expected = [len(g["params"]) for g in now]
    if sizes != expected:
        raise ValueError(
            f"the checkpoint's optimizer has param groups of {sizes} parameters, this "
            f"optimizer {expected}: build the optimizer over the same parameters, in the same "
            "order, as the run that saved it")
    names: dict[Any, str] = {}
    renamed_groups = []
    for group, today in zip(groups, now, strict=True):
        for index, name in zip(group["params"], today["params"], strict=True):
            names[index] = name
        renamed_groups.append({**group, "params": list(today["params"])})
    renamed_state = {names[i]: s for i, s in saved["state"].items() if i in names}
    return {"state": renamed_state, "param_groups": renamed_groups}
