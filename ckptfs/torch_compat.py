"""Every private torch API ckptfs uses, in one place, checked against the torch version.

ckptfs's sharded machinery (format v2: ``ckptfs.protocol.sharded*``, ``ckptfs.dcp``, the
benchmarks) builds on ``torch.distributed.checkpoint`` (DCP).  Its public API is imported where
it is used; the few private names below are not part of torch's compatibility promise, so they
are looked up here and only here.  Each is looked up when this module is imported (which
imports DCP, about 0.7 s: only the sharded machinery imports this module, never a
single-process save or load), and a torch that lacks one fails at once with
`TorchCompatError` naming it, the torch found and the version ckptfs is tested with,
instead of an ``AttributeError`` from deep inside a collective save.

==================================  ==============================================  ==========
here                                torch's private API                             used by
==================================  ==============================================  ==========
`EmptyStateDictLoadPlanner`   ``checkpoint.default_planner.                   full load
                                    _EmptyStateDictLoadPlanner``                    (one rank)
`load_state_dict`             ``checkpoint.state_dict_loader.                 full load,
                                    _load_state_dict`` (fills an empty dict; the    benchmark
                                    public ``load`` only fills existing keys)
`set_element`                 ``checkpoint._traverse.set_element``            value load
`narrow_tensor_by_index`      ``_shard._utils.narrow_tensor_by_index``        ranged load
`default_store`               ``distributed_c10d._get_default_store``         dead-rank
                                                                                    report
`group_timeout`               ``ProcessGroup._get_backend(...).options.       dead-rank
                                    _timeout``                                      wait bound
`dtensor_local`,              ``DTensor._local_tensor``, ``DTensor._spec``,   async
`dtensor_like`                ``DTensor(local, spec, requires_grad=)``        snapshot
`SavePlanner`'s hooks         ``DefaultSavePlanner._create_global_plan``,     sharded
                                    ``DefaultSavePlanner._dedup_save_plans``        save's
                                    (overridden, called: ckptfs checks the plan)    global plan
`shard_size_and_offset`       ``Shard.local_shard_size_and_offset`` (public   scale
                                    in 2.13; ``_local_shard_size_and_offset``       benchmark
                                    in 2.9)
`sharded_tensor_shards`       ``_shard.sharded_tensor.ShardedTensor``         FSDP1 save
                                    (``local_shards()``: its shards' tensors;       checks
                                    optional: none to save if missing)
`FsspecWriter`,               ``checkpoint._fsspec_filesystem``               benchmark
`FsspecReader`                (optional: an error when used, if missing)      baseline
==================================  ==============================================  ==========

`MIN_TORCH` (``SHARDED_TORCH_FLOOR`` of ``ckptfs/torch_versions.py``: 2.9) is the oldest torch the
sharded tests run on (``scripts/run-torch-matrix.sh`` runs the sharded, DCP and async tests on
it; the tested versions: docs/installation.md); an older torch is refused here with the same
error, even if it happens to have the names, because nothing else was tested.  Single-process
checkpoints never import this module and install from an older torch (``TORCH_FLOOR``, 2.6,
which pyproject.toml declares).  ``tests/project/test_torch_compat.py`` uses each name above
on every tested version.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from ckptfs.errors import CkptfsError
from ckptfs.torch_versions import SHARDED_TORCH_FLOOR, torch_version

#: The oldest torch ckptfs's sharded checkpoints run on (docs/installation.md).
MIN_TORCH = SHARDED_TORCH_FLOOR


class TorchCompatError(CkptfsError, ImportError):
    """The installed torch lacks a (private) torch API ckptfs's sharded checkpoints need, or is
    older than `MIN_TORCH`.  Single-process saves and loads do not need them."""


def _need(what: str) -> TorchCompatError:
    return TorchCompatError(
        f"ckptfs's sharded checkpoints need {what} (a private torch API, present in torch "
        f"{MIN_TORCH[0]}.{MIN_TORCH[1]}); this torch is {torch.__version__}. Install torch >= "
        f"{MIN_TORCH[0]}.{MIN_TORCH[1]} (single-process saves and loads do not need it)")


def check_version(version: str | None = None) -> None:
    """Refuse a torch older than `MIN_TORCH` with `TorchCompatError`."""
    found = torch_version(version)
    if found < MIN_TORCH:
        raise TorchCompatError(
            f"ckptfs's sharded checkpoints need torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (the "
            f"oldest version its tests run on); this torch is "
            f"{version or torch.__version__}. Upgrade torch (single-process saves and loads "
            "do not need it)")


def lookup(module: str, name: str) -> Any:
    """``module.name``, or `TorchCompatError` naming it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _need(f"{module}.{name}") from None


def optional_module(module: str) -> Any:
    """The module ``module``, or ``None`` if this torch lacks it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


check_version()

if TYPE_CHECKING:  # the type checker sees torch's own class
    from torch.distributed.checkpoint.default_planner import (
        _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner,
    )
else:
    #: DCP's planner that builds the state dict from the checkpoint's metadata (a full load).
    EmptyStateDictLoadPlanner = lookup("torch.distributed.checkpoint.default_planner",
                                       "_EmptyStateDictLoadPlanner")
_load_state_dict = lookup("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict")
_set_element = lookup("torch.distributed.checkpoint._traverse", "set_element")
_narrow = lookup("torch.distributed._shard._utils", "narrow_tensor_by_index")
_get_default_store = lookup("torch.distributed.distributed_c10d", "_get_default_store")
_DTensor = lookup("torch.distributed.tensor", "DTensor")
for _attr in ("_local_tensor", "_spec"):  # slots: descriptors on the class
    if not hasattr(_DTensor, _attr):
        raise _need(f"torch.distributed.tensor.DTensor.{_attr}")
_DefaultSavePlanner = lookup("torch.distributed.checkpoint.default_planner",
                             "DefaultSavePlanner")
for _attr in ("_create_global_plan", "_dedup_save_plans"):  # the save planner's hooks
    if not hasattr(_DefaultSavePlanner, _attr):
        raise _need(f"torch.distributed.checkpoint.default_planner.DefaultSavePlanner.{_attr}")
#: FSDP1's sharded state dict's tensor (deprecated by torch; a torch without it has no
#: ShardedTensor to save, so its absence is no error: `sharded_tensor_shards` is then None).
_ShardedTensor: Any = getattr(
    optional_module("torch.distributed._shard.sharded_tensor"), "ShardedTensor", None)
if _ShardedTensor is not None and not hasattr(_ShardedTensor, "local_shards"):
    raise _need("torch.distributed._shard.sharded_tensor.ShardedTensor.local_shards")
if not hasattr(torch.distributed.ProcessGroup, "_get_backend"):
    raise _need("torch.distributed.ProcessGroup._get_backend")


def load_state_dict(state_dict: dict[str, Any], *, storage_reader: Any, planner: Any,
                    no_dist: bool = True, process_group: Any = None) -> None:
    """DCP's ``_load_state_dict``: fill ``state_dict`` (possibly empty) in place."""
    _load_state_dict(state_dict, storage_reader=storage_reader, planner=planner,
                     no_dist=no_dist, process_group=process_group)


def set_element(root: Any, path: Any, value: Any) -> None:
    """DCP's ``set_element``: put ``value`` at ``path`` (a DCP object path) of ``root``,
    creating the dicts and lists on the way."""
    _set_element(root, path, value)


def narrow_tensor_by_index(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The part of ``tensor`` at ``offsets`` of ``sizes`` (a view)."""
    out: torch.Tensor = _narrow(tensor, offsets, sizes)
    return out


def default_store() -> Any:
    """The default process group's c10d store (``RuntimeError`` when there is none)."""
    return _get_default_store()


def group_timeout(group: Any) -> timedelta | None:
    """The collective timeout of ``group`` (a gloo or NCCL group), or ``None`` if its backend
    does not say (a custom backend)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def dtensor_local(t: Any) -> torch.Tensor:
    """A DTensor's local shard (no autograd, no copy)."""
    local: torch.Tensor = t._local_tensor
    return local


def dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """A DTensor holding ``local`` with the spec (mesh, placements, global shape) of
    ``like``, without communication."""
    return _DTensor(local, like._spec, requires_grad=False)


def sharded_tensor_shards(t: Any) -> list[torch.Tensor] | None:
    """The tensors of this rank's local shards of ``t`` if it is a ``ShardedTensor`` (FSDP1's
    ``SHARDED_STATE_DICT``; DCP plans each shard as a chunk at its global offsets), else
    ``None``."""
    if _ShardedTensor is None or not isinstance(t, _ShardedTensor):
        return None
    return [shard.tensor for shard in t.local_shards()]


def shard_size_and_offset(size: int, shards: int, index: int) -> tuple[int, int]:
    """(size, offset) of shard ``index`` of ``shards`` of a dimension of ``size`` (DTensor's
    ``Shard`` rule: ``torch.chunk``'s cut, empty shards at the end).  Public as
    ``Shard.local_shard_size_and_offset`` in 2.13 and 2.14, private in 2.9
    (``_local_shard_size_and_offset``)."""
    from torch.distributed.tensor import Shard

    rule = getattr(Shard, "local_shard_size_and_offset", None) or getattr(
        Shard, "_local_shard_size_and_offset", None)
    if rule is None:
        raise _need("torch.distributed.tensor.Shard.local_shard_size_and_offset")
    got, offset = rule(size, shards, index)
    return int(got), int(offset)


def optional_lookup(module: str, name: str) -> Any:
    """``module.name``, or a class whose construction raises `TorchCompatError`
    naming it (for the benchmarks' baselines: their absence must not break checkpoints)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        missing = _need(f"{module}.{name}")

        class Missing:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise missing

        return Missing


#: DCP's fsspec storage writer and reader (the benchmarks' DCP baseline only).
_FSSPEC = "torch.distributed.checkpoint._fsspec_filesystem"
FsspecWriter: Any = optional_lookup(_FSSPEC, "FsspecWriter")
FsspecReader: Any = optional_lookup(_FSSPEC, "FsspecReader")

__all__ = ["MIN_TORCH", "EmptyStateDictLoadPlanner", "FsspecReader", "FsspecWriter",
           "TorchCompatError", "check_version", "default_store", "dtensor_like",
           "dtensor_local", "group_timeout", "load_state_dict", "lookup",
           "narrow_tensor_by_index", "optional_lookup", "optional_module", "set_element",
           "shard_size_and_offset", "sharded_tensor_shards", "torch_version"]
