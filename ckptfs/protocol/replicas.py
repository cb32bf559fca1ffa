"""Replicated tensors must be equal on every rank that holds them: each holder's digest, compared
by the coordinator before anything is written.

Design decision: **a collective save refuses replicated tensors whose copies differ.**  DCP
stores one copy of a tensor that several ranks hold (a plain tensor, a DTensor's shard
replicated over a mesh dimension), and ckptfs's replica-parallel save writes a large replicated
tensor in row pieces taken from several holders.  Where the holders' copies differ (a bug in the
training loop, a rank that skipped a step or loaded another checkpoint) the checkpoint would
silently hold a row-wise mix that no rank ever held, with different tensors of one state taken
from different ranks.  So every rank hashes each tensor it holds that another rank may hold too
(`replica_digests`: xxh3-64, about 9 GB/s here, else BLAKE3), the digests travel with its local
plan as one int64 column, and the coordinator compares the digests of every key several ranks
hold while it plans (`GlobalPlan.check_replicas`, `check_replicas`): a mismatch refuses the save
on every rank, naming the key and which ranks hold which copy.  Tensors meant to differ are
named in ``divergent_keys`` (key prefixes): not compared, and stored whole from the lowest rank
holding them (never split between holders).  Non-tensor values keep DCP's documented rule: every
value from the lowest rank holding it (one rank's copy, never mixed key by key;
docs/sharded.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ckptfs.errors import ReplicaMismatchError, UnsupportedValueError
from ckptfs.format.serialize import cpu_contiguous, tensor_memoryview
from ckptfs.protocol.collective import is_dtensor

__all__ = ["check_divergent_keys", "check_replicas", "compared", "digests_of", "is_divergent",
           "replica_digests", "tensor_digest"]

#: A tensor not in host memory is hashed through host copies of at most this many bytes.
_HOST_BLOCK = 64 << 20


def _hasher() -> Any:
    try:
        import xxhash

        return xxhash.xxh3_64()
    except ImportError:
        import blake3

        return blake3.blake3()


def _as_int64(raw: bytes) -> int:
    v = int.from_bytes(raw[:8], "little", signed=True)
    return v if v != 0 else 1  # 0 means "not hashed"


def tensor_digest(t: torch.Tensor) -> int:
    """A nonzero int64 digest of ``t``'s values, its dtype and shape (a tensor off the host is
    copied to it in blocks, never whole)."""
    h = _hasher()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    t = t.detach()
    if t.device.type == "cpu":
        h.update(tensor_memoryview(cpu_contiguous(t)))
    else:
        flat = t.reshape(-1)
        step = max(1, _HOST_BLOCK // max(1, flat.element_size()))
        for start in range(0, flat.numel(), step):
            h.update(tensor_memoryview(cpu_contiguous(flat[start:start + step])))
    return _as_int64(h.digest())


def _replicated_shard(obj: Any) -> bool:
    """Whether a DTensor's local shard is held by other ranks too (a Replicate placement)."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if cls is None or not isinstance(obj, cls):
        return False
    return any(p.is_replicate() for p in obj.placements)


def replica_digests(items: Sequence[Any], state: dict[str, Any],
                    lookup: Callable[[Any], Any], divergent: Iterable[str] = (),
                    known: Mapping[str, int] | None = None) -> list[int]:
    """Per write item of a local plan (DCP's ``WriteItem``s), the digest of this rank's copy
    where other ranks may hold the same tensor (a whole tensor, a DTensor's shard replicated
    over a mesh dimension; 0 elsewhere).  ``state``: the flattened state (the objects by
    name); ``lookup``: the planner's ``lookup_object``; ``divergent``: key prefixes meant to
    differ between ranks (not hashed); ``known``: the digests taken earlier by name
    (`digests_of`), used instead of reading the objects."""
    from torch.distributed.checkpoint.planner import WriteItemType

    skip = tuple(divergent)
    out: list[int] = []
    for item in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO or not compared(fqn, state.get(fqn), skip):
            out.append(0)
            continue
        if known is not None:
            out.append(known.get(fqn, 0))
            continue
        obj = lookup(item.index)
        out.append(tensor_digest(obj) if isinstance(obj, torch.Tensor) else 0)
    return out


def compared(fqn: str, obj: Any, divergent: Sequence[str]) -> bool:
    """Whether the object ``obj`` named ``fqn`` is hashed for the replica comparison: a plain
    tensor (every rank may hold it), or a DTensor whose shard is replicated over a mesh
    dimension, unless it is under one of the ``divergent`` prefixes."""
    if not isinstance(obj, torch.Tensor) or is_divergent(fqn, divergent):
        return False
    return not is_dtensor(obj) or _replicated_shard(obj)


def digests_of(places: Iterable[tuple[str, torch.Tensor, Any]],
               divergent: Iterable[str] = ()) -> dict[str, int]:
    """`replica_digests`'s digests by name, taken before planning from each place of a
    tensor (``(DCP name, local tensor, its DTensor or None)``: `ckptfs.protocol.snapshot.
    Split.places`), each distinct tensor hashed once (the planner's ``lookup_object`` gives
    the same tensor: the plain one, or the DTensor's local shard)."""
    skip = tuple(divergent)
    out: dict[str, int] = {}
    done: dict[int, int] = {}
    for name, local, like in places:
        if compared(name, local if like is None else like, skip):
            if id(local) not in done:
                done[id(local)] = tensor_digest(local)
            out[name] = done[id(local)]
    return out


def check_divergent_keys(keys: Any) -> tuple[str, ...]:
    """``divergent_keys`` as a tuple of key prefixes, or `UnsupportedValueError` (a bare
    string, which would be read as its characters, or anything but non-empty strings)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise UnsupportedValueError(
            f"divergent_keys {keys!r:.60}: a list of key prefixes wanted, e.g. "
            f"divergent_keys=[{keys!r:.40}]")
    out = tuple(keys)
    for k in out:
        if not isinstance(k, str) or not k:
            raise UnsupportedValueError(f"divergent_keys: {k!r:.60} is not a key prefix "
                                        "(a non-empty string such as 'model.head')")
    return out


def is_divergent(fqn: str, prefixes: Sequence[str]) -> bool:
    """Whether the key ``fqn`` is one of (or under one of) ``prefixes``."""
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


def check_replicas(groups: Iterable[tuple[str, Sequence[int], Sequence[int]]]) -> None:
    """Raise `ReplicaMismatchError` for the keys whose holders' digests differ: ``groups``
    gives per key several ranks hold its name, the holders' ranks and their digests (0: not
    hashed, ignored)."""
    bad: list[str] = []
    for name, ranks, digests in groups:
        copies: dict[int, list[int]] = {}
        for r, d in zip(ranks, digests, strict=True):
            if d != 0:
                copies.setdefault(d, []).append(r)
        if len(copies) > 1:
            held = "; ".join(f"ranks {_ranges(sorted(set(rs)))}" for rs in copies.values())
            bad.append(f"{name!r} differs between ranks ({len(copies)} different copies: "
                       f"{held})")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ReplicaMismatchError(
            "a collective save stores one copy of a tensor several ranks hold, but their "
            "copies differ: " + "; ".join(bad[:5]) + more + ".  Make the ranks agree (a rank "
            "that skipped a step or loaded another checkpoint?), save per-rank tensors under "
            "rank-specific keys, or name the keys meant to differ in divergent_keys "
            "(ckptfs.open(url, divergent_keys=[...]) or ckptfs.dcp.SavePlanner("
            "divergent_keys=[...])): the lowest rank's copy is stored whole")


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:]:
        if r != prev + 1:
            out.append(f"{start}-{prev}" if prev > start else str(start))
            start = r
        prev = r
    out.append(f"{start}-{prev}" if prev > start else str(start))
    return ", ".join(out)
