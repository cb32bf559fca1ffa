"""Random-number-generator state: capture, restore, and what happens when the world size changes.

A training run's randomness lives in several generators per process: Python's ``random``,
NumPy's global generator (when NumPy is installed), torch's CPU generator and one CUDA generator
per visible device.  A resumed run only continues *exactly* if every one of them is restored, on
every rank.  The states are stored without pickle, as plain values of the checkpoint's state
tree::

    {"python": {"version": 3, "internal": [625 ints], "gauss_next": None},
     "numpy":  {"bit_generator": "MT19937", "key": [624 ints], "pos": 624,
                "has_gauss": 0, "gauss": 0.0},
     "torch":  uint8 tensor (torch.get_rng_state()),
     "cuda":   [uint8 tensor per device]}          (absent without CUDA)

and the checkpoint holds one such entry per rank: ``{"world_size": W, "ranks": {0: ..., 1: ...}}``.

On resume with a different world size (`restore_for_rank`): a rank that has a saved state
gets it; a *new* rank (beyond the saved world size) is reseeded deterministically from the run
seed and its rank through a SplitMix64 mix, so neighbouring ranks get uncorrelated streams and a
rerun reseeds identically; a checkpoint that lacks some ranks' states (a partial gather) is
reported by rank number.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptfs.errors import RngStateError
from ckptfs.protocol.group import RankGroup, decode, decode_bytes, encode, encode_bytes

log = logging.getLogger("ckptfs")

_MASK64 = (1 << 64) - 1



def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def capture() -> dict[str, Any]:
    """The current process's RNG states, as plain values and uint8 tensors (no pickle)."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": int(version), "internal": [int(x) for x in internal],
                   "gauss_next": gauss_next},
        "torch": torch.get_rng_state().clone(),
    }
    np = _numpy()
    if np is not None:
        st = np.random.get_state(legacy=False)
        state["numpy"] = {"bit_generator": str(st["bit_generator"]),
                          "key": [int(x) for x in st["state"]["key"]],
                          "pos": int(st["state"]["pos"]),
                          "has_gauss": int(st["has_gauss"]), "gauss": float(st["gauss"])}
    if torch.cuda.is_available():
        state["cuda"] = [t.clone() for t in torch.cuda.get_rng_state_all()]
    return state


def restore(state: Mapping[str, Any]) -> None:
    """Set the process's RNG states from `capture`'s output.  Generators absent from
    ``state`` (NumPy not installed when saved, no CUDA then) are left alone, with a log line.
    A malformed state raises `RngStateError`, never a raw ``KeyError``/``TypeError``."""
    try:
        _restore(state)
    except RngStateError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError,
            OverflowError, RecursionError) as exc:
        raise RngStateError(f"malformed RNG state ({type(exc).__name__}: {exc}); the checkpoint "
                            "was not written by ckptfs.lifecycle.rng.capture") from exc


def _restore(state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping):
        raise TypeError(f"an RNG state is a map, not a {type(state).__name__}")
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["internal"]),
                     py["gauss_next"]))
    t = state["torch"]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise TypeError("torch RNG state must be a uint8 tensor")
    torch.set_rng_state(t.cpu())
    np = _numpy()
    if "numpy" in state and np is not None:
        n = state["numpy"]
        np.random.set_state({"bit_generator": n["bit_generator"],
                             "state": {"key": np.asarray(n["key"], dtype=np.uint32),
                                       "pos": int(n["pos"])},
                             "has_gauss": int(n["has_gauss"]), "gauss": float(n["gauss"])})
    elif np is not None:
        log.info("checkpoint has no NumPy RNG state (NumPy was not installed when it was "
                 "saved); NumPy's generator is left as it is")
    if torch.cuda.is_available():
        saved = list(state.get("cuda") or [])
        if not saved:
            log.info("checkpoint has no CUDA RNG state (saved without CUDA); left as it is")
        else:
            n_dev = torch.cuda.device_count()
            if len(saved) != n_dev:
                log.warning("checkpoint has CUDA RNG states for %d devices, this process sees "
                            "%d; restoring the first %d", len(saved), n_dev,
                            min(len(saved), n_dev))
            for i, dev_state in enumerate(saved[:n_dev]):
                torch.cuda.set_rng_state(dev_state.cpu(), i)


def splitmix64(x: int) -> int:
    """One SplitMix64 step: a bijective 64-bit mix whose outputs for consecutive inputs are
    uncorrelated (used to derive per-rank seeds)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rank_seed(run_seed: int, rank: int) -> int:
    """Deterministic, decorrelated seed for ``rank`` of a run seeded with ``run_seed``
    (63 bits, accepted by every generator)."""
    return splitmix64(splitmix64(run_seed & _MASK64) ^ (rank & _MASK64)) >> 1


def seed_all(seed: int) -> None:
    """Seed Python, NumPy (if installed), torch CPU and every CUDA device with ``seed``."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    np = _numpy()
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


@dataclass
class RestoreOutcome:
    """What `restore_for_rank` did, for logs and tests."""

    rank: int
    action: str  # "restored" | "reseeded-new-rank" | "reseeded-missing"
    saved_world_size: int
    world_size: int
    missing_ranks: list[int] = field(default_factory=list)
    ignored_ranks: list[int] = field(default_factory=list)
    seed: int | None = None


def pack_ranks(states: Mapping[int, Mapping[str, Any]], world_size: int) -> dict[str, Any]:
    """The checkpoint entry for the RNG states of all ranks."""
    return {"world_size": int(world_size), "ranks": {int(r): dict(s) for r, s in states.items()}}


def restore_for_rank(entry: Mapping[str, Any] | None, *, rank: int, world_size: int,
                     run_seed: int, per_rank_batch_size: int | None = None,
                     strict: bool = False) -> RestoreOutcome:
    """Restore this rank's RNG from a checkpoint's RNG entry, handling world-size changes.

    - the rank has a saved state: it is restored;
    - the rank is new (``rank >= saved world size``): reseeded with `rank_seed` and a
      warning says how the global batch size changed;
    - fewer ranks than saved: the extra states are ignored, with an info message;
    - the checkpoint lacks some ranks' states: they are named in a warning; this rank, if among
      them, is reseeded (or, with ``strict``, `RngStateError` is raised).
    """
    if entry is None:
        seed = rank_seed(run_seed, rank)
        if strict:
            raise RngStateError("the checkpoint has no RNG state; cannot restore exactly")
        log.warning("checkpoint has no RNG state: rank %d reseeded from run seed %d (seed %d)",
                    rank, run_seed, seed)
        seed_all(seed)
        return RestoreOutcome(rank, "reseeded-missing", 0, world_size, seed=seed)
    saved_ws, ranks = check_entry(entry)
    missing = [r for r in range(saved_ws) if r not in ranks]
    ignored = sorted(r for r in ranks if r >= world_size)
    if missing:
        log.warning("checkpoint is missing the RNG state of rank(s) %s (saved world size %d)",
                    ", ".join(map(str, missing)), saved_ws)
    if saved_ws != world_size:
        if world_size > saved_ws:
            log.warning(
                "world size changed %d -> %d: ranks %d..%d have no saved RNG state and are "
                "reseeded deterministically from the run seed and their rank; the global batch "
                "size changes %s", saved_ws, world_size, saved_ws, world_size - 1,
                _batch_change(saved_ws, world_size, per_rank_batch_size))
        else:
            log.info("world size changed %d -> %d: the RNG states of rank(s) %s are ignored; "
                     "the global batch size changes %s", saved_ws, world_size,
                     ", ".join(map(str, ignored)) or "-",
                     _batch_change(saved_ws, world_size, per_rank_batch_size))
    if rank in ranks:
        restore(ranks[rank])
        return RestoreOutcome(rank, "restored", saved_ws, world_size, missing, ignored)
    seed = rank_seed(run_seed, rank)
    if rank < saved_ws:
        if strict:
            raise RngStateError(f"the checkpoint has no RNG state for rank {rank} (missing: "
                                f"{missing}); cannot restore exactly")
        log.warning("rank %d: RNG state missing from the checkpoint; reseeded (seed %d)", rank,
                    seed)
        action = "reseeded-missing"
    else:
        action = "reseeded-new-rank"
    seed_all(seed)
    return RestoreOutcome(rank, action, saved_ws, world_size, missing, ignored, seed)


#: More ranks than any job has: a saved world size beyond it is not a real one.
MAX_WORLD_SIZE = 1 << 24


def check_entry(entry: object) -> tuple[int, dict[int, Any]]:
    """(saved world size, rank -> state) of a checkpoint's RNG entry; `RngStateError`
    for an entry of the wrong shape (hostile or edited content), never a raw error or a loop
    over a world size of 10**12."""
    def bad(why: str) -> RngStateError:
        return RngStateError(f"malformed RNG entry in the checkpoint: {why}; it was not written "
                             "by ckptfs (pack_ranks)")

    if not isinstance(entry, Mapping):
        raise bad(f"a {type(entry).__name__}, not a map")
    ws = entry.get("world_size", 0)
    if not isinstance(ws, int) or isinstance(ws, bool) or not 0 <= ws <= MAX_WORLD_SIZE:
        raise bad(f"world_size {ws!r:.40} is not an int in [0, {MAX_WORLD_SIZE}]")
    raw = entry.get("ranks") or {}
    if not isinstance(raw, Mapping):
        raise bad(f"'ranks' is a {type(raw).__name__}, not a map")
    ranks: dict[int, Any] = {}
    for k, v in raw.items():
        if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 8:
            k = int(k)
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < MAX_WORLD_SIZE:
            raise bad(f"rank key {k!r:.40} is not a rank number")
        ranks[k] = v
    return ws, ranks


def _batch_change(old: int, new: int, per_rank: int | None) -> str:
    if per_rank:
        return (f"from {old * per_rank} to {new * per_rank} ({old} x {per_rank} -> "
                f"{new} x {per_rank}); adjust the learning rate or gradient accumulation if "
                "the global batch size must stay the same")
    return (f"by a factor {new}/{old} = {new / old:.3g} (per-rank batch size unknown: pass "
            "per_rank_batch_size to see the numbers)")


# -- the RNG states of every rank, gathered through the group (JSON: no pickle, no device tensor)

#: The key of a tensor in an RNG state's message: ``{"__u8__": base64 of its bytes}``.
_U8 = "__u8__"


def state_doc(state: Mapping[str, Any]) -> dict[str, Any]:
    """An RNG state as a JSON document, for a message between ranks: each tensor as
    ``{"__u8__": base64 of its bytes}`` (`group.encode_bytes`), tuples as lists, every other
    value as it is."""
    def enc(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {_U8: encode_bytes(v.cpu().contiguous().numpy().tobytes())}
        if isinstance(v, Mapping):
            return {k: enc(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        return v

    return {k: enc(x) for k, x in state.items()}


def state_of(doc: Any) -> dict[str, Any]:
    """The RNG state of `state_doc`'s document: its tensors uint8 CPU tensors again;
    `RngStateError` for a document that is not a map."""
    def dec(v: Any) -> Any:
        if isinstance(v, dict):
            if set(v) == {_U8}:
                data = decode_bytes(v[_U8])
                if not data:
                    return torch.empty(0, dtype=torch.uint8)
                return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
            return {k: dec(x) for k, x in v.items()}
        if isinstance(v, list):
            return [dec(x) for x in v]
        return v

    if not isinstance(doc, dict):
        raise RngStateError("gathered RNG state is not a mapping")
    out: dict[str, Any] = dec(doc)
    return out


def encode_rng(state: Mapping[str, Any]) -> bytes:
    """An RNG state as the bytes of its message between ranks (`state_doc`, JSON)."""
    return encode(state_doc(state))


def decode_rng(data: bytes) -> dict[str, Any]:
    """`encode_rng`'s inverse."""
    return state_of(decode(data))


def dist_gather(mine: Mapping[str, Any], world_size: int) -> dict[int, dict[str, Any]]:
    """Every rank's RNG state (rank -> state), on every rank; collective: every rank calls it.
    Each rank's `state_doc` is gathered as JSON through a `RankGroup` on ckptfs's dedicated
    gloo group (``protocol.sharded.collective_group``), so no tensor goes to a device, whatever
    the default group's backend (NCCL included)."""
    from ckptfs.protocol import sharded  # lazily: DCP takes seconds to import

    group = RankGroup(sharded.collective_group(None, what="gathering the RNG states"))
    if world_size != group.world_size:
        raise ValueError(f"world_size={world_size}, but torch.distributed has "
                         f"{group.world_size} ranks")
    docs = group.all_gather(state_doc(mine))
    return {r: state_of(d) for r, d in zip(group.ranks, docs, strict=True)}


def states_for_save(*, collective: bool, rank: int, world_size: int,
                    gather: Callable[[dict[str, Any]], Mapping[int, Mapping[str, Any]]] | None
                    ) -> dict[int, dict[str, Any]]:
    """The RNG states a manager save writes from this process: under a process group each
    rank its own (a rank-keyed value every rank writes itself); else what ``gather`` collects
    from every rank, or this rank's only (logged when the world has more ranks)."""
    mine = capture()
    if collective:
        return {rank: mine}
    if gather is not None:
        return {int(r): dict(s) for r, s in gather(mine).items()}
    if world_size > 1:
        log.warning("world size %d but torch.distributed is not initialized and no "
                    "rng_gather was given: only rank %d's RNG state is saved", world_size, rank)
    return {rank: mine}
