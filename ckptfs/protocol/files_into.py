"""``load(into=...)`` of a checkpoint of the files layout (format v1, v3): any placement.

Design decision: **every checkpoint loads into any world size and placement through the one
``load(into=)`` entry.**  A single-process checkpoint (fine-tuned on one GPU) stores each tensor
whole; a job continuing under FSDP passes DTensors (or FSDP1's ShardedTensors, or plain tensors)
as ``into``.  Each rank reads the tensors its targets need, through the one verified reader
(`ckptfs.protocol.reader.load_single_process` with ``keys``: every byte checked against the
manifest, a few hundred MiB at a time), and copies into each target the region it holds (a
DTensor's local shard, each local shard of a ShardedTensor, a plain tensor whole); non-tensor
values replace the target's as a sharded load does (`ckptfs.format.sharded_tree.write_back`).
Everything a load refuses (a name the checkpoint lacks, another dtype or global shape) is found
before any target is touched.  The ranks then agree on the outcome (one exchange of JSON
documents over the load's group): every rank raises when any rank failed, each its own error
or the failing rank's rebuilt, so no rank continues with a state the others did not load.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckptfs.errors import (
    CheckpointKeyError,
    CheckpointNotFoundError,
    CkptfsError,
    ShardedLoadError,
)
from ckptfs.format.sharded_tree import dcp_view, write_back
from ckptfs.format.versions import is_sharded
from ckptfs.protocol.group import Group, WorldOfOne, carried, describe
from ckptfs.protocol.load_options import dtype_mismatch
from ckptfs.protocol.reader import check_single_process, load_single_process
from ckptfs.protocol.resolve import CheckpointInfo, read_committed, walk_latest
from ckptfs.storage.base import Storage

__all__ = ["BATCH_BYTES", "load_files_into", "load_into_alone", "load_one_files_into"]

#: Bytes of stored tensors read per batch (each batch is freed before the next is read).
BATCH_BYTES = 256 << 20


def _walks(v: Any) -> bool:
    """DCP's rule (``ckptfs.format.sharded_tree``): a list holding a tensor, a dict or such a
    list is walked; other lists are values."""
    return isinstance(v, dict) or (isinstance(v, list) and any(
        isinstance(x, torch.Tensor) or _walks(x) for x in v))


def _leaves(view: Any, state: Any = None) -> Iterator[tuple[str, tuple[Any, ...], Any]]:
    """(DCP name, key path in ``state``, leaf) of every value of a DCP view; ``state``: the
    tree the view was made of (its keys give the paths; None: the view's own keys)."""
    def walk(v: Any, s: Any, name: str, path: tuple[Any, ...]
             ) -> Iterator[tuple[str, tuple[Any, ...], Any]]:
        if isinstance(v, dict):
            keys = list(s.keys()) if isinstance(s, Mapping) else list(v.keys())
            for (k, child), key in zip(v.items(), keys, strict=True):
                yield from walk(child, s[key] if isinstance(s, Mapping) else None,
                                f"{name}.{k}" if name else str(k), (*path, key))
        elif isinstance(v, list) and _walks(v):
            for i, child in enumerate(v):
                yield from walk(child, s[i] if isinstance(s, (list, tuple)) else None,
                                f"{name}.{i}", (*path, i))
        else:
            yield name, path, v

    yield from walk(view, state, "", ())


def _regions(target: torch.Tensor) -> list[tuple[torch.Tensor, tuple[slice, ...]]]:
    """Each tensor of ``target`` this rank holds, with the slices of the global tensor it
    holds: a DTensor's local shard, a ShardedTensor's local shards, a plain tensor whole."""
    if type(target) is torch.Tensor or isinstance(target, torch.nn.Parameter):
        return [(target, tuple(slice(0, int(n)) for n in target.shape))]
    # A tensor subclass: its DTensor / ShardedTensor internals (torch >= 2.9, imports DCP).
    from ckptfs.torch_compat import dtensor_local, sharded_tensor_shards

    shards = sharded_tensor_shards(target)
    if shards is not None or hasattr(target, "__create_chunk_list__"):
        chunks = target.__create_chunk_list__()  # type: ignore[attr-defined]
        tensors = shards if shards is not None else [dtensor_local(target)]
        return [(t, tuple(slice(int(o), int(o) + int(n)) for o, n in
                          zip(c.offsets, c.sizes, strict=True)))
                for t, c in zip(tensors, chunks, strict=True)]
    return [(target, tuple(slice(0, int(n)) for n in target.shape))]


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def load_files_into(storage: Storage, info: CheckpointInfo, into: dict[str, Any],
                    group: Group, *, verify: bool = True, threads: int = 4) -> dict[str, Any]:
    """Fill ``into`` in place from the files-layout checkpoint ``info`` (module docstring);
    every rank of ``group`` calls it.  Returns ``into``."""
    error: BaseException | None = None
    try:
        _fill(storage, info, into, verify=verify, threads=threads)
    except CkptfsError as exc:
        error = exc
    docs = group.all_gather(None if error is None else describe(error))
    failed = {group.ranks[r]: d for r, d in enumerate(docs) if d is not None}
    if error is not None:
        raise error
    if failed:
        rank, doc = min(failed.items())
        raise carried(doc, ShardedLoadError,
                      message=f"{info.url}: the load of step {info.step} failed on rank(s) "
                      f"{sorted(failed)} (rank {rank}: {doc.get('name')}: "
                      f"{doc.get('message')}); nothing can be trusted of it on this rank")
    return into


def load_into_alone(storage: Storage, step: int | None, into: dict[str, Any], *,
                    verify: bool = True, allow_rollback: bool = False, threads: int = 4
                    ) -> dict[str, Any]:
    """``load(into=)`` in a process without a process group on a torch older than the sharded
    floor (``ckptfs/torch_versions.py``: single-process checkpoints need torch >= 2.6, the
    sharded machinery 2.9): a files-layout checkpoint (v1, v3) fills ``into`` as
    `load_files_into` does in a world of one, through the one walk (``allow_rollback``: a
    corrupt newest step is logged and the next older one loaded).  A sharded checkpoint, or a
    DTensor target, needs the sharded machinery: `TorchCompatError` names the torch to
    install.  On a newer torch ``load(into=)`` takes the collective load's entry
    (``sharded.load_into``), which reads either layout."""
    def use(info: CheckpointInfo) -> dict[str, Any]:
        return load_one_files_into(storage, info, into, verify=verify, threads=threads)

    if step is not None:
        return use(read_committed(storage, step))
    found = walk_latest(storage, use, allow_rollback=allow_rollback)
    if found is None:
        raise CheckpointNotFoundError(f"no committed checkpoint to load at {storage.url}")
    return into


def load_one_files_into(storage: Storage, info: CheckpointInfo, into: dict[str, Any], *,
                        verify: bool = True, threads: int = 4) -> dict[str, Any]:
    """`load_files_into` of ``info`` in a world of one, for `load_into_alone` and a two-tier
    store's walk on a torch below the sharded floor: a sharded ``info`` raises
    `TorchCompatError` (torch < 2.9)."""
    if is_sharded(info.manifest):
        import ckptfs.torch_compat  # noqa: F401  (raises TorchCompatError: torch < 2.9)
    return load_files_into(storage, info, into, WorldOfOne(), verify=verify, threads=threads)


def _fill(storage: Storage, info: CheckpointInfo, into: dict[str, Any], *, verify: bool,
          threads: int) -> None:
    checked = check_single_process(storage, info)  # listing, state document, headers
    assert checked.state is not None
    stored_view, _ = dcp_view(checked.state)
    stored = {name: (path, leaf) for name, path, leaf in _leaves(stored_view, checked.state)}
    view, skeleton = dcp_view(into)
    wanted = list(_leaves(view))
    # Everything refused is refused before a target is touched.
    for name, _, target in wanted:
        if name not in stored:
            raise CheckpointKeyError(
                f"{info.url}: step {info.step} holds no {name!r} (load(into=) fills every "
                f"entry of the state given; the checkpoint holds {len(stored)} entries, e.g. "
                f"{sorted(stored)[:5]})")
        src = stored[name][1]
        if isinstance(target, torch.Tensor):
            if not isinstance(src, torch.Tensor):
                raise CheckpointKeyError(f"{info.url}: step {info.step} stores {name!r} as a "
                                         f"{type(src).__name__}, not a tensor")
            if src.dtype != target.dtype:
                raise dtype_mismatch(name, src.dtype, target.dtype, info.url)
            if tuple(src.shape) != tuple(target.shape):
                raise CheckpointKeyError(
                    f"{info.url}: step {info.step} stores {name!r} of shape "
                    f"{list(src.shape)}, the target's (global) shape is {list(target.shape)}")
    # Read in batches (tensors by their stored bytes; values are small), copy, free.
    batch: list[tuple[str, tuple[Any, ...], Any]] = []
    size = 0
    loaded_values: dict[str, Any] = {}

    def flush() -> None:
        if not batch:
            return
        got = load_single_process(storage, info, verify=verify, threads=threads,
                                  keys=[stored[name][0] for name, _, _ in batch])
        for name, _, target in batch:
            value = _get(got, stored[name][0])
            if isinstance(target, torch.Tensor):
                for local, region in _regions(target):
                    with torch.no_grad():
                        local.copy_(value[region])
            else:
                loaded_values[name] = value
        batch.clear()

    for name, path, target in wanted:
        src = stored[name][1]
        nbytes = src.numel() * src.element_size() if isinstance(src, torch.Tensor) else 0
        if batch and size + nbytes > BATCH_BYTES:
            flush()
            size = 0
        batch.append((name, path, target))
        size += nbytes
    flush()
    loaded_view = _replaced(view, loaded_values)
    write_back(into, skeleton, loaded_view)


def _replaced(view: Any, values: dict[str, Any], name: str = "") -> Any:
    """``view`` with each value named in ``values`` replaced (tensors kept)."""
    if isinstance(view, dict):
        return {k: _replaced(v, values, f"{name}.{k}" if name else str(k))
                for k, v in view.items()}
    if isinstance(view, list) and _walks(view):
        return [_replaced(v, values, f"{name}.{i}") for i, v in enumerate(view)]
    return values.get(name, view)
