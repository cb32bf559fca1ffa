"""The one prepared save: what ``store.save`` writes and what ``save_async`` writes, decided once.

Design decision: **prepare once, write over whatever holds the bytes.**  A save is prepared on
the caller's thread (`prepare`): the layout decided (collective or not is the process group's
answer, `ckptfs.protocol.collective.wants_sharded_save`, the same for every store), the state
planned and checked (everything the save refuses before writing raises here), and the result is
a `Prepared`: ``reads``, what the write still reads of the caller's state, and `Prepared.over`,
the write bound to those objects or to a copy of them.  ``store.save`` runs it at once over the
caller's objects (`Prepared.write`); ``save_async`` copies ``reads`` first
(`ckptfs.protocol.snapshot.take`) and runs the very same write over the copy on the store's
thread.  The layout is a value of the prepared save, not a second function:

=================  ==========================================  =================================
layout             prepared (caller's thread)                  written (`Prepared.over`)
=================  ==========================================  =================================
one process        the serializer's plan                       `write_plan` over the plan,
``collective``     (`plan_single_process`: every non-tensor    rebound to the copies when there
False              value encoded now; `check_plan`: every      are (format v1, or v3)
                   reader limit); ``reads``: its tensors
a process group    `sharded.prepare_save` (a bad value raises  `sharded.save_prepared` (format
``collective``     inside DCP, on every rank together);        v2, or v4; its "write everything
True               ``reads``: the state's DCP view             again" retry included)
=================  ==========================================  =================================

A collective save runs its collectives on the caller's ``process_group`` or ckptfs's own gloo
group; a save written on the store's thread (``background``: the async saver's group factory)
on the store's own group, so that they never interleave with the training loop's.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ckptfs.errors import ShardedSaveError, StagingBudgetError, UnsupportedValueError
from ckptfs.format.features import RANKS
from ckptfs.format.layout import check_step
from ckptfs.format.serialize import StatePlan, key_str
from ckptfs.protocol.collective import find_dtensor, is_distributed, wants_sharded_save
from ckptfs.protocol.commit import FileGate, check_plan, plan_single_process
from ckptfs.protocol.incremental import Decided, decide_now, write_decided, write_plan
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.protocol.snapshot import Split, split
from ckptfs.protocol.staging import fit_files, fit_groups, staged_size
from ckptfs.storage.deadline import Deadline, bounded

if TYPE_CHECKING:
    from ckptfs.protocol.group import Liveness
    from ckptfs.protocol.store import CheckpointStore

__all__ = ["Hint", "Prepared", "prepare", "stream_groups"]

log = logging.getLogger("ckptfs")

#: The reuse hint of a tensor the write reads (`ckptfs.format.serialize.version_of`); a
#: snapshot's gives the caller's tensor's (`ckptfs.protocol.snapshot.Snapshot.hint`).
Hint = Callable[[torch.Tensor], tuple[int, int]]

#: The store's own group of a save written on its thread: ``(liveness, what) -> group``.
OwnGroup = Callable[["Liveness", str], Any]


@dataclass
class Prepared:
    """One save, prepared and checked (module docstring).  ``collective``: its layout;
    ``reads``: what its write still reads of the caller's state (the plan's tensors, or the
    DCP view), the one thing a snapshot copies."""

    step: int
    collective: bool
    reads: Any
    over: Callable[..., Callable[[], CheckpointInfo]]
    """``over(value, hint, gate=None)``: the write over ``reads`` itself or over a copy of the
    same structure (with the caller's tensors' reuse ``hint``), as a function to run: it
    holds nothing of the caller's objects but what it is given.  ``gate``: around each file's
    write (``Attempt.write_files``; a streamed save only)."""
    #: A save streamed through a staging budget (``staging_bytes`` smaller than its tensors):
    #: the indices into ``reads`` of each file it writes, in writing order (one process: empty
    #: for ``state.msgpack``; a collective save: each group of the view's tensors, which each
    #: rank writes as one rank file of what it holds of them); None otherwise.
    streamed: list[tuple[int, ...]] | None = None

    def write(self) -> CheckpointInfo:
        """Write and commit over the caller's objects, now (``store.save``)."""
        return self.over(self.reads, None)()


def prepare(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
            metadata: Mapping[str, Any] | None = None, process_group: Any = None,
            background: OwnGroup | None = None, staging_bytes: int | None = None
            ) -> Prepared:
    """The save of ``state`` as step ``step`` of ``store`` (module docstring), prepared.  The
    metadata is deep-copied (plain JSON).  ``background``: the save is written on the store's
    thread, its collectives on the group this gives.  ``staging_bytes``: an async save's
    staging budget; a save whose tensors exceed it is laid out to be streamed through it and
    says so (``streamed``): one process (format v1) in smaller files
    (`ckptfs.protocol.staging.fit_files`), an incremental one (format v3) likewise once its
    reuse is decided here, over the caller's tensors (`ckptfs.protocol.incremental.decide_now`:
    only the tensors it writes are staged), a collective save of format v2 in groups of the
    view's tensors, one rank file per group (`ckptfs.protocol.staging.fit_groups`); a tensor
    larger than the budget is refused.  A sharded incremental (v4) or per-rank (v5) save is
    not streamed (``streamed`` None)."""
    check_step(step)
    opts = store.options
    collective = store.layout == RANKS or wants_sharded_save(state, process_group)
    storage = bounded(store.storage, save_deadline(store, step, collective, process_group))
    if not collective:
        plan, meta = plan_or_refuse(state, metadata, store.shard_bytes)
        streamed = None
        decided: Decided | None = None
        if staging_bytes is not None and staged_size(plan.tensors) > staging_bytes:
            check_plan(step, plan, meta, opts.algorithm)  # before any hash or read
            if opts.incremental:  # only what it writes is staged: reuse decided now
                decided = decide_now(storage, plan, opts)
                plan = decided.plan
            plan = fit_files(plan, staging_bytes)
            streamed = [(), *(tf.members for tf in plan.tensor_files)]  # plan.files' order
        check_plan(step, plan, meta, opts.algorithm)
        meta = copy.deepcopy(meta)

        def over_plan(tensors: Any, hint: Hint | None, gate: FileGate | None = None
                      ) -> Callable[[], CheckpointInfo]:
            staged = plan if tensors is plan.tensors else plan.rebind(tensors)
            if decided is not None:
                return lambda: write_decided(storage, step, staged, decided, meta, opts,
                                             gate=gate)
            return lambda: write_plan(storage, step, staged, meta, opts, gate=gate)

        return Prepared(step, False, plan.tensors, over_plan, streamed)

    from ckptfs.protocol import sharded as sh  # imports DCP: collective saves only

    try:
        cmeta: Mapping[str, Any] | None = copy.deepcopy(dict(metadata or {}))
    except Exception:  # not copyable, so not JSON either: the planner refuses it on all ranks
        cmeta = metadata
    kind = "save" if background is None else "async-save"
    what = f"{'sharded' if background is None else 'async sharded'} save of step {step} at " \
           f"{storage.url}"
    live = sh.liveness(process_group, kind, step)  # before the group: an absent rank is named
    if background is None:
        group = sh.collective_group(process_group, what=what, default=ShardedSaveError,
                                    live=live)
    else:
        group = background(live, what)
    renew_on = process_group if background is None else group  # the thread's own counter
    prep = sh.prepare_save(storage, step, state, opts, group=group, kind=kind, metadata=cmeta,
                           live=live)

    def over_view(view: Any, hint: Hint | None, gate: None = None
                  ) -> Callable[[], CheckpointInfo]:
        prep.view = view
        if hint is not None:
            prep.writer.hint = hint
        return lambda: sh.save_prepared(prep, group,
                                        renew=lambda: sh.liveness(renew_on, kind, step))

    streaming = None if staging_bytes is None else stream_groups(prep, staging_bytes)
    if streaming is not None:
        from ckptfs.protocol.sharded_io import FileStream

        parts, groups = streaming
        # the planner runs before every group is staged: the digests from the caller's tensors
        prep.planner.digest_replicas_now((name, parts.tensors[i], like)
                                         for name, i, like in parts.places())
        group_of = parts.groups_of(groups)

        def over_stream(tensors: Any, hint: Hint | None, gate: FileGate | None = None
                        ) -> Callable[[], CheckpointInfo]:
            assert gate is not None
            run = over_view(parts.fill(tensors), None)
            prep.writer.stream = FileStream(group_of, len(groups), gate)
            return run

        return Prepared(step, True, parts.tensors, over_stream, groups)

    return Prepared(step, True, prep.view, over_view)


def stream_groups(prep: Any, budget: int) -> tuple[Split, list[tuple[int, ...]]] | None:
    """How a collective save (``prep``: `ckptfs.protocol.sharded.SavePrep`) streams through
    an async save's staging budget: its view taken apart (`ckptfs.protocol.snapshot.split`)
    and the groups of its tensors (`ckptfs.protocol.staging.fit_groups`), each rank writing
    one rank file per group (`ckptfs.protocol.sharded_io.FileStream`); None when it does not
    stream: it fits the budget, or its format cannot (`ShardedWriter.can_stream`), or a
    tensor of this rank is larger than the budget.  That rank is not refused alone (the other
    ranks would wait for it in the save's collectives): its part is written from the
    caller's tensors, as a save that cannot stream (logged)."""
    if not prep.writer.can_stream:
        return None
    sized = split(prep.view, copy_values=False)  # its values are copied only if it streams
    if staged_size(sized.tensors) <= budget:
        return None
    try:
        groups = fit_groups(sized.tensors, [key_str(k) for k in sized.keys], budget)
    except StagingBudgetError as exc:
        log.warning("%s; this rank's part of the collective save is not staged", exc)
        return None
    return split(prep.view), groups  # the same walk, the same tensors in the same order


def save_deadline(store: CheckpointStore, step: int, collective: bool, process_group: Any
                  ) -> Deadline | None:
    """The deadline of this save of ``store`` (its ``save_deadline_s``; None: unbounded),
    naming the rank of a collective save (docs/reliability.md "Bounded saves")."""
    seconds = store.save_deadline_s
    if seconds is None:
        return None
    rank = None
    if collective and is_distributed():
        import torch.distributed as dist
        rank = int(dist.get_rank())
    kind = "sharded save" if collective else "save"
    return Deadline(seconds, what=f"{kind} of step {step} at {store.storage.url}", rank=rank)


def plan_or_refuse(state: Mapping[str, Any], metadata: Mapping[str, Any] | None,
                   shard_bytes: int) -> tuple[StatePlan, dict[str, Any]]:
    """`plan_single_process`; a state it refuses because it holds a DTensor (torch.distributed
    is not initialized, so the collective save cannot run) is refused saying so: writing one rank's
    shards as a full state would be wrong."""
    try:
        return plan_single_process(state, metadata=metadata, shard_bytes=shard_bytes)
    except UnsupportedValueError:
        where = find_dtensor(state)  # only on failure: no second walk of a good state
        if where is None:
            raise
        path = "/".join(str(p) for p in where) or "<root>"
        raise UnsupportedValueError(
            f"a sharded tensor (DTensor) at key path {path!r} cannot be saved here: "
            "torch.distributed is not initialized, and a sharded state is saved collectively "
            "by every rank of its process group (docs/async.md, docs/sharded.md); initialize "
            "it, or save a full state dict") from None
