"""Asynchronous saves of sharded states (several ranks, one commit): the collective form of
:meth:`~ckptfs.CheckpointStore.save_async`.

Design decision: **ckptfs snapshots, DCP runs the save, ckptfs's writer commits.**  Every rank
snapshots its part of the state on the caller's thread into the store's staging pool (a
DTensor's local shard, wrapped in a DTensor of the same spec), then hands the snapshot to
``torch.distributed.checkpoint.async_save`` (thread mode) with
:class:`~ckptfs.protocol.sharded_io.ShardedWriter` and the pickle-free planner: planning,
writing, hashing and the one exclusive marker (by the coordinator, after every rank reported)
run on DCP's thread exactly as in a synchronous sharded save.  The collectives run on a gloo
group of the store's own (created once per store, collectively), never on the training loop's
group (sharing it hung) nor on the synchronous saves' group; a store's sharded saves run one
after the other on it.  The returned :class:`~ckptfs.protocol.async_save.SaveFuture` is the
store's like any other: back-pressure, ``wait``/``close``, re-raised uncollected failures and
the exit hook all apply.  See docs/async.md.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.tensor import DTensor

from ckptfs.errors import ShardedSaveError
from ckptfs.format.layout import check_step
from ckptfs.protocol import sharded as sh
from ckptfs.protocol.async_save import (
    AsyncSaver,
    SaveFuture,
    _register_exit_hook,
    _worker,
)
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.protocol.staging import Snapshot

if TYPE_CHECKING:
    from ckptfs.protocol.store import CheckpointStore


def submit_sharded(saver: AsyncSaver, store: CheckpointStore, step: int,
                    state: Mapping[str, Any], metadata: Mapping[str, Any] | None,
                    max_in_flight: int) -> SaveFuture:
    """Collective: every rank of the job calls it (docs/async.md, "Sharded states").  The
    snapshot (DTensors: their local shards) is taken here, then ``dcp.async_save`` runs
    DCP's planning, ckptfs's ShardedWriter and the one commit on DCP's thread, on this
    store's own gloo group."""
    t0 = time.perf_counter()
    check_step(step)
    saver._check_step_free(step)
    try:
        meta: Mapping[str, Any] | None = copy.deepcopy(dict(metadata or {}))
    except Exception:  # not copyable, so not JSON either: the planner refuses it on all ranks
        meta = metadata
    group = _group(saver)
    prep = sh.prepare_save(store.storage, step, state, group=group, kind="async-save",
                           algorithm=store.algorithm, durable=store.durable,
                           threads=store.threads, metadata=meta)
    validated = time.perf_counter() - t0
    saver._wait_for_slot(step, max_in_flight)
    saver.raise_uncollected()
    t1 = time.perf_counter()
    snap = Snapshot(saver.pool)
    try:
        try:
            view = _stage_view(snap, prep.view)
        finally:
            snap.finish()
        out: Any = dcp_async_save(view, storage_writer=prep.writer, planner=prep.planner,
                                  process_group=group,
                                  async_stager=_Staged(saver._last_dcp))
    except BaseException:
        saver.pool.give_back(snap.buffers)
        raise
    saver.pool.trim()
    dcp_fut: Future[Any] = getattr(out, "upload_completion", None) or out
    saver._last_dcp = dcp_fut
    fut = SaveFuture(step, store.url)
    with saver._lock:
        _register_exit_hook()
        saver._futures.append(fut)
        saver.stats.submitted += 1
    buffers = snap.buffers

    def done(f: Future[Any]) -> None:
        _worker.saver = saver
        info: CheckpointInfo | None = None
        exc = f.exception()
        try:
            if exc is None:
                info = prep.info(f.result())  # the committed checkpoint, on every rank
                prep.live.done()
        except BaseException as e:
            exc = e
        saver.pool.give_back(buffers)
        buffers.clear()
        if exc is not None:
            try:  # DCP's CheckpointException (a BaseException) -> ckptfs's typed error
                err = sh.failure(exc, prep.what, ShardedSaveError, prep.live)
            except BaseException as e:  # pragma: no cover - never leave the future unresolved
                err = e
            if err is not exc:
                err.__cause__ = exc
            exc = err
        try:
            saver._settle(fut, exc, info)
        finally:
            _worker.saver = None

    dcp_fut.add_done_callback(done)
    blocked = validated + time.perf_counter() - t1
    saver.stats.last_snapshot_seconds = blocked
    saver.stats.snapshot_seconds += blocked
    return fut


def _group(saver: AsyncSaver) -> Any:
    """This store's dedicated gloo group for async saves, created once (collectively: every
    rank creates its stores' groups in the same order), so that a background save's
    collectives never share a group with the training loop's or a synchronous save's."""
    world = id(dist.group.WORLD)
    if saver._async_group is None or saver._async_group[0] != world:
        group = dist.new_group(backend="gloo", timeout=sh.COLLECTIVE_TIMEOUT)
        saver._async_group = (world, group)
    return saver._async_group[1]


def _stage_view(snap: Snapshot, value: Any) -> Any:
    """The snapshot of a DCP view (dicts, lists, leaves): a DTensor's local shard is staged and
    wrapped in a DTensor of the same spec (placements, global shape), as DCP's own stager does."""
    if isinstance(value, torch.Tensor):
        if isinstance(value, DTensor):
            local = snap.copy(value._local_tensor)
            return DTensor(local, value._spec, requires_grad=False)  # type: ignore[no-untyped-call]
        return snap.copy(value)
    if isinstance(value, dict):
        return {k: _stage_view(snap, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_stage_view(snap, v) for v in value]
    return value  # immutable leaves (validated by the planner on every rank)


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
