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


def find_dtensor(value: Any) -> tuple[Any, ...] | None:
    """The key path of the first DTensor in ``value`` (dicts, lists and tuples walked), or
    None.  Iterative and visiting each container once: a state that contains itself (which
    the serializer refuses, naming the cycle) or is nested beyond any limit never raises a
    ``RecursionError`` here."""
    seen: set[int] = set()
    todo: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while todo:
        node, path = todo.pop()
        if isinstance(node, torch.Tensor):
            if is_dtensor(node):
                return path
            continue
        if isinstance(node, Mapping):
            items: Any = node.items()
        elif isinstance(node, (list, tuple)):
            items = enumerate(node)
        else:
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(reversed([(v, (*path, k)) for k, v in items]))
    return None


def has_dtensor(value: Any) -> bool:
    return find_dtensor(value) is not None


def world_size() -> int:
    """The default process group's size: 1 without one (a world of one)."""
    if not is_distributed():
        return 1
    import torch.distributed as dist

    return int(dist.get_world_size())


def wants_sharded_save(state: Any, process_group: Any = None) -> bool:
    """Whether ``store.save`` is collective: a ``process_group`` was given, or
    torch.distributed is initialized and the world has more than one rank (or the state holds
    DTensors).  The one answer for every store (a plain one, a two-tier one: a one-rank group
    saving DTensors is collective on both)."""
    if process_group is not None:
        return True
    if not is_distributed():
        return False
    return world_size() > 1 or has_dtensor(state)
