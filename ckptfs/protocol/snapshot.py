"""The snapshot of an asynchronous save: what the background save reads instead of the caller's
objects, taken on the caller's thread.

Design decision: **one snapshot for every layout.**  ``save_async`` hands `take` what the
store's synchronous save would still read of the state once it has planned it (for one process
the serializer's plan tensors, `ckptfs.format.serialize.StatePlan.tensors`; for a collective
save the state's DCP view, `ckptfs.format.sharded_tree.dcp_view`), and gets back the same
structure with nothing of the caller's left in it:

* every tensor, and every DTensor's local shard, is copied into the store's staging pool
  (`ckptfs.protocol.staging.stage`: pinned non-blocking copies for CUDA, one synchronize per
  device), once per distinct tensor by the serializer's identity
  (`ckptfs.format.serialize.tensor_identity`), so tied tensors stay one tensor; a DTensor is
  rebuilt around its staged shard with the same spec (mesh, placements, global shape);
* the containers (``dict``, ``list``, ``tuple``) are rebuilt; plain immutable values are
  shared;
* every other value (a NumPy array, a set, a ``Namespace``, a registered dataclass or
  container, with the tensors inside it) is replaced by its own copy, decoded from the bytes
  the format stores for it (`ckptfs.format.sharded.encode_value` then ``decode_value``), so
  the background save encodes a value that only it holds.  A value the format cannot hold is
  left in place: the save refuses it where it refuses it synchronously (a collective save: in
  DCP's planning, on every rank together; raising here would leave the other ranks waiting).

The tensors' reuse hints (`ckptfs.format.serialize.version_of`: address and autograd version
of the caller's tensor) are taken with the copies: an incremental save sees only the staged
copies, and asks `Snapshot.hint` what the caller's tensor looked like.

DTensor support is imported only when a DTensor is met (a single-process save never imports
torch.distributed).  See docs/async.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptfs.format.serialize import check_tensor, key_str, tensor_identity, version_of
from ckptfs.format.sharded import decode_value, encode_value
from ckptfs.protocol.collective import is_dtensor
from ckptfs.protocol.staging import PoolKey, StagingPool, stage, stage_within

__all__ = ["Snapshot", "Split", "split", "take"]

log = logging.getLogger("ckptfs")

#: Values shared, not copied, by the snapshot: immutable, and stored as themselves.
_IMMUTABLE = (type(None), bool, int, float, str, bytes, torch.dtype, torch.Size)


@dataclass
class Snapshot:
    """The copy of a structure taken by `take`: ``value`` (the structure, over staged
    copies), the pool ``buffers`` they live in (given back once the save no longer reads them)
    and the caller's tensors' reuse hints by staged address."""

    value: Any
    buffers: list[tuple[PoolKey, torch.Tensor]]
    hints: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: The pool's slab regions the copies live in (a snapshot within a staging budget).
    regions: list[int] = field(default_factory=list)

    def give_back(self, pool: StagingPool) -> None:
        """Give the buffers and regions back to ``pool`` (the save no longer reads them)."""
        pool.give_back(self.buffers)
        pool.release(self.regions)

    def hint(self, t: torch.Tensor) -> tuple[int, int]:
        """The reuse hint of ``t``: a staged copy (by its storage address) gets the hint of the
        caller's tensor it copies; any other tensor its own (`version_of`)."""
        own = version_of(t)
        return self.hints.get(own[0], own)


class _Slot:
    """Where staged tensor ``index`` goes (``like``: the DTensor whose local shard it is, to
    rebuild one of the same spec around the staged shard)."""

    __slots__ = ("index", "like")

    def __init__(self, index: int, like: Any) -> None:
        self.index = index
        self.like = like


@dataclass
class Split:
    """A structure taken apart by `split`: ``tree`` (the structure with a slot where each
    tensor was, every non-tensor value its own copy), the distinct local ``tensors`` it reads
    (a DTensor's local shard), each one's reuse ``hints`` (the caller's tensor's) and the key
    of each tensor's first place (``keys``; top-level keys of a DCP view are its names)."""

    tree: Any
    tensors: list[torch.Tensor]
    hints: list[tuple[int, int]]
    keys: list[tuple[Any, ...]]

    def fill(self, tensors: list[torch.Tensor]) -> Any:
        """The structure again over ``tensors`` (copies of `tensors`, in order): a DTensor is
        rebuilt around its copy with the same spec."""
        return _fill(self.tree, tensors)

    def places(self) -> Iterator[tuple[str, int, Any]]:
        """Every place of a tensor in the tree: its DCP name (the key path joined with
        ``"."``, as DCP flattens a state), the index of its tensor in `tensors`, and the
        DTensor it is the local shard of (None for a plain tensor)."""

        def walk(v: Any, path: tuple[Any, ...]) -> Iterator[tuple[str, int, Any]]:
            if isinstance(v, _Slot):
                yield ".".join(str(p) for p in path), v.index, v.like
            elif type(v) is dict:
                for k, x in v.items():
                    yield from walk(x, (*path, k))
            elif type(v) in (list, tuple):
                for i, x in enumerate(v):
                    yield from walk(x, (*path, i))

        return walk(self.tree, ())

    def groups_of(self, groups: list[tuple[int, ...]]) -> dict[str, int]:
        """For a DCP view split into ``groups`` of tensor indices: the DCP name of each place
        of a tensor (`places`) -> the group holding that tensor."""
        where = {i: k for k, members in enumerate(groups) for i in members}
        return {name: where[i] for name, i, _ in self.places()}


def split(value: Any, *, copy_values: bool = True) -> Split:
    """``value`` taken apart (`Split`): nothing of the caller's objects is left in its tree
    but the tensors it lists (module docstring: values copied, containers rebuilt).
    ``copy_values=False``: values left as they are (to size what a snapshot would stage)."""
    tensors: list[torch.Tensor] = []
    keys: list[tuple[Any, ...]] = []
    index: dict[tuple[Any, ...], int] = {}

    def walk(v: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(v, torch.Tensor):
            like = v if is_dtensor(v) else None
            if like is None:
                local = v
                # A save whose plan checks its tensors later (the collective driver's,
                # layout="ranks") must not meet a nested, sparse or wrapper one here first.
                check_tensor(v, key_str(path))
            else:
                from ckptfs.torch_compat import dtensor_local  # imports DCP: DTensors only

                local = dtensor_local(like)
            ident = tensor_identity(local)
            i = index.get(ident)
            if i is None:
                i = index[ident] = len(tensors)
                tensors.append(local)
                keys.append(path)
            return _Slot(i, like)
        if type(v) is dict:
            return {k: walk(x, (*path, k)) for k, x in v.items()}
        if type(v) is list:
            return [walk(x, (*path, i)) for i, x in enumerate(v)]
        if type(v) is tuple:
            return tuple(walk(x, (*path, i)) for i, x in enumerate(v))
        if type(v) in _IMMUTABLE or not copy_values:
            return v
        return own_copy(v, ".".join(str(p) for p in path))

    tree = walk(value, ())
    return Split(tree, tensors, [version_of(t) for t in tensors], keys)


def take(pool: StagingPool, value: Any, budget: int | None = None) -> Snapshot | None:
    """The snapshot of ``value`` (module docstring), every copy complete when it returns: the
    caller may change or free its objects then.  On failure the buffers taken go back to the
    pool.  ``budget``: the copies go into the pool's slab, or, when they would take more than
    ``budget`` bytes, nothing is copied and None is returned
    (`ckptfs.protocol.staging.stage_within`)."""
    parts = split(value)
    tensors = parts.tensors
    if budget is None:
        staged = stage(pool, tensors)
    else:
        within = stage_within(pool, tensors, budget)
        if within is None:
            return None
        staged = within
    parts.tensors = []  # the caller's: not read again
    try:
        out = parts.fill(staged.tensors)
    except BaseException:  # pragma: no cover - rebuilding a DTensor of a valid spec
        pool.give_back(staged.buffers)
        pool.release(staged.regions)
        raise
    by_ptr = {version_of(t)[0]: h for t, h in zip(staged.tensors, parts.hints, strict=True)
              if t.numel()}
    return Snapshot(out, staged.buffers, by_ptr, staged.regions)


def _fill(value: Any, staged: list[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        local = staged[value.index]
        if value.like is None:
            return local
        from ckptfs.torch_compat import dtensor_like

        # as DCP's own stager does: the same spec (mesh, placements, global shape)
        return dtensor_like(local, value.like)
    if type(value) is dict:
        return {k: _fill(v, staged) for k, v in value.items()}
    if type(value) is list:
        return [_fill(v, staged) for v in value]
    if type(value) is tuple:
        return tuple(_fill(v, staged) for v in value)
    return value


def own_copy(value: Any, key: str) -> Any:
    """A copy of a non-tensor value that shares nothing with it: decoded from the bytes the
    format stores for it (so it is exactly what would be stored, and of the same registered
    type).  A value the format cannot hold is returned as it is (module docstring)."""
    try:
        blob = encode_value(value, key=key)
    except Exception:
        return value
    try:
        return decode_value(blob, where=f"snapshot of {key!r}")
    except Exception as exc:  # a registered decode function that refuses its own encoding
        log.warning("save_async: the value at %r could not be copied (its registered decode "
                    "refused its own encoding: %s: %s); the background save reads it as it is "
                    "then", key, type(exc).__name__, exc)
        return value
