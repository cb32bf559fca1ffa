"""Asynchronous saves of sharded states (several ranks, one commit): the collective form of
`save_async`.

Design decision: **ckptfs snapshots, DCP runs the save, ckptfs's writer commits.**  Every rank
snapshots its part of the state on the caller's thread, then hands the snapshot to
``torch.distributed.checkpoint.async_save`` (thread mode) with
`ShardedWriter` and the pickle-free planner: planning,
writing, hashing and the one exclusive marker (by the coordinator, after every rank reported)
run on DCP's thread exactly as in a synchronous sharded save.

The snapshot is the state's DCP view with nothing of the caller's left in it, because DCP plans
(and so reads every value) on its own thread:

* every tensor and every DTensor's local shard is copied into the store's staging pool
  (`ckptfs.protocol.staging.stage`), once per distinct tensor by the serializer's identity
  (`ckptfs.format.serialize.tensor_identity`); a DTensor is rebuilt around its staged
  shard with the same spec;
* containers are rebuilt; plain immutable values are shared;
* every other value (a NumPy array, a set, a ``Namespace``, a registered dataclass or
  container, with the tensors inside it) is replaced by its own copy, decoded from the bytes the
  format stores for it (`ckptfs.format.sharded.encode_value` then ``decode_value``), so
  DCP's planner encodes, on its thread, a value that only it holds.  A value the format cannot
  hold is left in place: the planner refuses it inside DCP, on every rank together.

The collectives run on a gloo group of the store's own (created once per store, collectively),
never on the training loop's group (sharing it hung) nor on the synchronous saves' group; a
store's sharded saves run one after the other on it.  The returned
`SaveFuture` is the store's like any other: back-pressure,
``wait``/``close``, re-raised uncollected failures and the exit hook all apply, through the
saver's internal API (`AsyncSaver`).  See docs/async.md.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.tensor import DTensor

from ckptfs.errors import ShardedSaveError
from ckptfs.format.layout import check_step
from ckptfs.format.serialize import tensor_identity, version_of
from ckptfs.format.sharded import decode_value, encode_value
from ckptfs.protocol import sharded as sh
from ckptfs.protocol.group import Liveness, gloo_group
from ckptfs.protocol.incremental import ProtectorGoneError
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.protocol.staging import stage
from ckptfs.torch_compat import dtensor_like, dtensor_local

if TYPE_CHECKING:  # async_save imports this module (lazily): annotations only, no cycle
    from ckptfs.protocol.async_save import AsyncSaver, SaveFuture
    from ckptfs.protocol.store import CheckpointStore

log = logging.getLogger("ckptfs")


@dataclass
class _Collective:
    """What the collective form keeps per saver: the store's own gloo group (with the default
    group it was made under) and the DCP future of its last save."""

    group: tuple[int, Any] | None = None
    last: Future[Any] | None = None


_STATE: weakref.WeakKeyDictionary[AsyncSaver, _Collective] = weakref.WeakKeyDictionary()


def _state_of(saver: AsyncSaver) -> _Collective:
    st = _STATE.get(saver)
    if st is None:
        st = _STATE[saver] = _Collective()
    return st


def async_group(saver: AsyncSaver) -> Any:
    """The saver's own gloo group of async saves (None before its first sharded save)."""
    st = _STATE.get(saver)
    return None if st is None or st.group is None else st.group[1]


# A forked child holds none of the parent's groups' peers nor DCP's threads.
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_STATE.clear)


def submit_sharded(saver: AsyncSaver, store: CheckpointStore, step: int,
                   state: Mapping[str, Any], metadata: Mapping[str, Any] | None,
                   max_in_flight: int) -> SaveFuture:
    """Collective: every rank of the job calls it (docs/async.md, "Sharded states").  The
    snapshot (module docstring) is taken here, then ``dcp.async_save`` runs DCP's planning,
    ckptfs's ShardedWriter and the one commit on DCP's thread, on this store's own gloo
    group."""
    t0 = time.perf_counter()
    check_step(step)
    saver.check_step_free(step)
    try:
        meta: Mapping[str, Any] | None = copy.deepcopy(dict(metadata or {}))
    except Exception:  # not copyable, so not JSON either: the planner refuses it on all ranks
        meta = metadata
    coll = _state_of(saver)
    what = f"async sharded save of step {step} at {store.url}"
    live = sh.liveness(None, "async-save", step)  # before the group: an absent rank is named
    group = _group(coll, live, what)
    # An incremental store writes format v4 here too, with the synchronous sharded save's
    # writer (its reuse memory and lease): the same cell of the matrix as `store.save`.
    prep = sh.prepare_save(store.storage, step, state, group=group, kind="async-save",
                           algorithm=store.algorithm, durable=store.durable,
                           threads=store.threads, metadata=meta, node_local=store.node_local,
                           memory=store.reuse, lease_s=store.lease_s, live=live)
    validated = time.perf_counter() - t0
    saver.wait_for_slot(step, max_in_flight)
    saver.raise_uncollected()
    t1 = time.perf_counter()
    snap = _Snapshot()
    tree = snap.walk(prep.view, ())
    # the reuse hint of the caller's tensors, now: the writer sees only their staged copies
    hints = [version_of(t) for t in snap.tensors]
    staged = stage(saver.pool, snap.tensors)
    try:
        view = snap.fill(tree, staged.tensors)
        del tree, snap  # the caller's tensors: not read again
        prep.writer.hint = _staged_hint(staged.tensors, hints)
        out: Any = dcp_async_save(view, storage_writer=prep.writer, planner=prep.planner,
                                  process_group=group, async_stager=_Staged(coll.last))
    except BaseException:
        saver.pool.give_back(staged.buffers)
        raise
    saver.pool.trim()
    dcp_fut: Future[Any] = getattr(out, "upload_completion", None) or out
    fut = saver.track(step)
    # The next save of this store starts its collectives once this one is settled (its retry
    # included), never while this one's done callback still runs collectives on the group.
    coll.last = fut
    buffers = staged.buffers
    held: dict[str, Any] = {"view": view}
    del view

    def done(f: Future[Any]) -> None:
        with saver.background_thread():
            info: CheckpointInfo | None = None
            exc = f.exception()
            try:
                if exc is None:
                    info = prep.finished(f.result())  # the committed checkpoint, every rank
                    prep.live.done()
                else:
                    exc = _mapped(exc, prep)
                    if isinstance(exc, ProtectorGoneError) and store.reuse is not None:
                        # every rank got it from the coordinator's fence: every rank retries,
                        # once, writing every byte, as the synchronous save does
                        info = sh.save_prepared(prep.in_full(exc, view=held["view"]), group)
                        exc = None
                if info is not None:
                    store.after_sharded_commit(info)
            except BaseException as e:
                info, exc = None, _mapped(e, prep)
            held.clear()
            saver.pool.give_back(buffers)
            buffers.clear()
            saver.settle(fut, exc, info)

    dcp_fut.add_done_callback(done)
    saver.record_blocked(validated + time.perf_counter() - t1)
    return fut


def _mapped(exc: BaseException, prep: sh.SavePrep) -> BaseException:
    """ckptfs's typed error for what a background collective save raised (DCP's
    ``CheckpointException`` is a ``BaseException``), naming absent ranks (`sh.failure`)."""
    try:
        err = sh.failure(exc, prep.what, ShardedSaveError, prep.live)
    except BaseException as e:  # pragma: no cover - never leave a future unresolved
        err = e
    if err is not exc:
        err.__cause__ = exc
    return err


def _staged_hint(staged: list[torch.Tensor], hints: list[tuple[int, int]]
                 ) -> Callable[[torch.Tensor], tuple[int, int]]:
    """The writer's reuse hint for a snapshot: a tensor the planner resolves from a staged
    copy (by its storage address) gets the hint of the caller's tensor it copies; any other
    its own (`version_of`)."""
    by_ptr = {version_of(t)[0]: h for t, h in zip(staged, hints, strict=True) if t.numel()}

    def hint(t: torch.Tensor) -> tuple[int, int]:
        own = version_of(t)
        return by_ptr.get(own[0], own)

    return hint


def _group(coll: _Collective, live: Liveness, what: str) -> Any:
    """This store's dedicated gloo group for async saves, created once (collectively: every
    rank creates its stores' groups in the same order), so that a background save's
    collectives never share a group with the training loop's or a synchronous save's.  Its
    creation is bounded by `sh.COLLECTIVE_TIMEOUT`; a rank that never joins it fails it on
    the others with `ShardedSaveError` naming that rank (``live``)."""
    world = id(dist.group.WORLD)
    if coll.group is None or coll.group[0] != world:
        group = gloo_group(sh.COLLECTIVE_TIMEOUT, what=f"{what}: creating the store's gloo "
                           "group for async saves", default=ShardedSaveError, live=live)
        coll.group = (world, group)
    return coll.group[1]


#: Values shared, not copied, by the snapshot: immutable, and stored as themselves.
_IMMUTABLE = (type(None), bool, int, float, str, bytes, torch.dtype, torch.Size)


class _Slot:
    """Where staged tensor ``index`` goes in the snapshot (``like``: the DTensor whose local
    shard it is, to rebuild one of the same spec around the staged shard)."""

    __slots__ = ("index", "like")

    def __init__(self, index: int, like: DTensor | None) -> None:
        self.index = index
        self.like = like


class _Snapshot:
    """The snapshot of a DCP view (module docstring), in two steps: `walk` copies every
    value and collects the tensors to stage (one per `tensor_identity`), `fill`
    puts the staged copies in their places."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index: dict[tuple[Any, ...], int] = {}

    def walk(self, value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            like = value if isinstance(value, DTensor) else None
            local = value if like is None else dtensor_local(like)
            ident = tensor_identity(local)
            index = self._index.get(ident)
            if index is None:
                index = self._index[ident] = len(self.tensors)
                self.tensors.append(local)
            return _Slot(index, like)
        if type(value) is dict:  # the view's own containers (dcp_view builds them)
            return {k: self.walk(v, (*path, k)) for k, v in value.items()}
        if type(value) is list:
            return [self.walk(v, (*path, i)) for i, v in enumerate(value)]
        if type(value) is tuple:
            return tuple(self.walk(v, (*path, i)) for i, v in enumerate(value))
        if type(value) in _IMMUTABLE:
            return value
        return _own_copy(value, path)

    def fill(self, value: Any, staged: list[torch.Tensor]) -> Any:
        if isinstance(value, _Slot):
            local = staged[value.index]
            if value.like is None:
                return local
            # as DCP's own stager does: the same spec (mesh, placements, global shape)
            return dtensor_like(local, value.like)
        if type(value) is dict:
            return {k: self.fill(v, staged) for k, v in value.items()}
        if type(value) is list:
            return [self.fill(v, staged) for v in value]
        if type(value) is tuple:
            return tuple(self.fill(v, staged) for v in value)
        return value


def _own_copy(value: Any, path: tuple[Any, ...]) -> Any:
    """A copy of a non-tensor value that shares nothing with it: decoded from the bytes the
    format stores for it (so it is exactly what would be stored, and of the same registered
    type).  A value the format cannot hold is returned as it is: DCP's planner refuses it on
    every rank (raising here would leave the other ranks waiting in the collective)."""
    key = ".".join(str(p) for p in path)
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


class _Staged(AsyncStager):
    """DCP's ``AsyncStager`` for a state ckptfs already snapshotted: nothing to copy.  If the
    store's previous sharded save is still running, this one's collectives wait for it (both
    run on the store's group, and must not interleave): its staging completes then."""

    _synchronize_after_execute = False

    def __init__(self, after: Future[Any] | None) -> None:
        self.after = after

    def stage(self, state_dict: Any) -> Any:
        after = self.after
        if after is None or after.done():
            return state_dict
        staged: Future[Any] = Future()
        after.add_done_callback(lambda _: staged.set_result(state_dict))
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
