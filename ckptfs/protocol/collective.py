"""Whether a save or load is collective (format v2, every rank of a process group) or a plain
single-process one (format v1), decided without importing torch.distributed.checkpoint: the
single-process path must never pay DCP's import (~0.7-1 s in a fresh process)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch


def is_distributed() -> bool:
    """torch.distributed is available and its default process group initialized."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def is_dtensor(t: torch.Tensor) -> bool:
    # No DTensor exists unless its module was imported (importing it costs seconds).
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)


def has_dtensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return is_dtensor(value)
    if isinstance(value, Mapping):
        return any(has_dtensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_dtensor(v) for v in value)
    return False


def wants_sharded_save(state: Any, process_group: Any = None) -> bool:
    """Whether ``store.save`` is collective: a ``process_group`` was given, or
    torch.distributed is initialized and the world has more than one rank (or the state holds
    DTensors)."""
    if process_group is not None:
        return True
    if not is_distributed():
        return False
    import torch.distributed as dist

    return dist.get_world_size() > 1 or has_dtensor(state)
