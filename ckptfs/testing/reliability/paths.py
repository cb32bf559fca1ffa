"""The write paths every reliability sweep can run through (every hardening check on every
path).

A checkpoint reaches storage through one of several writers, and each must give a reader
exactly what the single-process save gives it:

=========  ====================================================================================
``v1``     ``store.save`` in one process (format v1)
``v2``     ``store.save`` of a store opened with ``layout="ranks"`` in one process: the
           collective save's driver with a world of one (format v2)
``async``  ``store.save_async(...).result()`` (the snapshot, then the commit on the store's
           background thread)
``cp``     a save into a scratch ``memory://`` root, then ``ckptfs cp``
           (`copy_step`) into the store under test
``cp-v2``  the same from a format v2 source
``sub``    ``store.save`` through a `SubStorage` (how run
           artifacts and the Lightning integration store checkpoints): see `SubBackend`
``v3``     ``store.save`` of an incremental store (``ckptfs.open(url, incremental=True)``:
           format v3), saving `frozen_state_for`, whose model does not change from step
           to step: every save after the first references the model's tensors in the file an
           earlier checkpoint holds (`WritePath.references`)
``v4``     ``store.save`` of an incremental store of ``layout="ranks"`` (format v4): the store's
           reuse memory is kept between the saves of a run root (`reuse_memory`), and the
           frozen model is the same tensor objects at every step, so each save after the first
           references the model's items in an earlier checkpoint's rank file
``async-v2`` ``save_async`` of the state's tensors as DTensors on a one-rank mesh, under a
           one-rank gloo process group (`world_of_one`): the collective async save
``async-v2s`` ``save_async`` of a store of ``layout="ranks"`` (the collective driver in a world of
           one) with a staging budget the state's tensors exceed (`streamed_budget`): streamed
           group by group, its rank's items in several rank files (``data-0``, ``data-1``, ...)
``async-v3`` ``save_async`` on an incremental store (format v3), saving what ``v3`` saves
``async-v3s`` the same with a staging budget the state's tensors exceed (`streamed_budget`):
           the reuse decided before the call returns, the tensors it writes streamed through
           the budget in several files, the referenced ones never copied
``async-v4`` the collective async save on an incremental store (its reuse memory kept as
           for ``v4``)
``cp-v3``  ``ckptfs cp`` of a format v3 step: the source is a scratch root kept for the run
           root under test (`source_for`), written by ``v3``, and its steps are copied one by
           one, so a copy after the first references what the destination already holds
``cp-v4``  the same from a format v4 source written by ``v4``
``replica-v1`` the remote copy of a two-tier store: ``ckptfs.tiered(local, store)`` with a
           scratch local tier kept for the run root (`local_tier_for`), ``save`` then
           ``wait_replicated``; the store under test is the remote tier (what is read)
``replica-v3`` the same with ``incremental=True`` (format v3 on both tiers)
``replica-v2`` the same for the collective save (format v2): the state's tensors as DTensors
           on a one-rank mesh under a one-rank gloo process group (`world_of_one`), saved
           collectively on the local tier and replicated as a sharded step
``replica-v4`` the same on incremental tiers (format v4; the frozen model's DTensors kept
           between saves, as for ``async-v4``)
``v5``     ``store.save`` of a store of ``layout="ranks"`` and ``metadata_layout="per-rank"`` (v5:
           the rank's index document, the tensor spec and the table of rank files; the
           manifest lists only the spec and the table's blocks, docs/protocol.md §9.7)
``async-v5`` ``save_async`` of the same store (the collective driver's async save in a world of
           one, per-rank metadata)
``cp-v5``  a v5 save into a scratch root, then ``ckptfs cp``'s ``copy_step``
``replica-v5`` the two-tier store's remote copy of a v5 step: the local tier a store of
           ``layout="ranks"`` and ``metadata_layout="per-rank"`` given to ``ckptfs.tiered``
=========  ====================================================================================

Rollback reads (`ROLLBACK_READS`, `rollback_read`): ``load(allow_rollback=True)``,
``load(into=, allow_rollback=True)`` (of either layout) and the manager's
``restore_latest(allow_rollback=True)``: each reads the newest checkpoint, skipping one that
fails for the next older one.  A sweep damages the newest and checks that each returns the
previous step's state (or raises a typed error when that one is damaged too), never the
damaged bytes.

A sweep takes a `WritePath` and a `Backend`; it writes
``path.state(step)`` through ``path.save(store, step, state)`` on the store of
``path.at(backend)`` (the backend itself, or its sub-storage view), and reads with the
ordinary store API.  The two-rank gloo save cannot run inside a sweep's process; the tests add
it (tests/paths.py) as one more `WritePath` whose ``save`` launches the ranks.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ckptfs.format.features import AUTO
from ckptfs.format.versions import FEATURES, SHARDED
from ckptfs.protocol.resolve import CheckpointInfo, read_committed
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability.common import state_for

#: Where `SubBackend` roots its view (an artifact's store, as artifacts lay them out).
SUB_PREFIX = "artifacts/reliability"


@dataclass
class SubBackend(Backend):
    """The run root seen through a `SubStorage` at
    ``prefix``: `open` returns a store on the sub-storage (as the artifacts and the
    Lightning integration build theirs), and the backdoor's paths are relative to the prefix,
    so every sweep runs unchanged on it."""

    prefix: str = SUB_PREFIX

    def __post_init__(self) -> None:
        super().__post_init__()
        self.raw_root = f"{self.raw_root}/{self.prefix}"

    @classmethod
    def of(cls, backend: Backend, prefix: str = SUB_PREFIX) -> SubBackend:
        return cls(f"{backend.name}+sub", backend.url, backend.options, backend.env,
                   backend.raw_options, prefix)

    def open(self, **kwargs: Any) -> CheckpointStore:
        from ckptfs.lifecycle.artifacts import SubStorage

        base = super().open(**kwargs)
        return CheckpointStore(SubStorage(base.storage, self.prefix), algorithm=base.algorithm,
                               durable=base.durable, threads=base.threads)

    def sibling(self, suffix: str | None = None) -> SubBackend:
        parent = Backend(self.name, self.url, self.options, self.env, self.raw_options)
        return SubBackend.of(parent.sibling(suffix), self.prefix)


@dataclass(frozen=True)
class WritePath:
    """One way a checkpoint gets written (module docstring)."""

    name: str
    #: The manifest format version the checkpoint has.
    format_version: int = 1
    #: Whether the store under test is a sub-storage view (`SubBackend`).
    sub: bool = False
    #: Whether a save after the first references what an earlier checkpoint holds (format
    #: v3 of `frozen_state_for`): a sweep primes a first checkpoint, so the save it
    #: examines has references.
    references: bool = False

    def state(self, step: int) -> dict[str, Any]:
        """The state this path saves at ``step`` in every sweep (what a load must return)."""
        if not self.references:
            return state_for(step)
        # A sharded referencing save (v4) keeps the same tensor objects between its saves.
        return frozen_state_for(step, same_objects=SHARDED in FEATURES[self.format_version])

    @property
    def sharded(self) -> bool:
        """Whether this path writes a sharded checkpoint (rank files: v2, v4, v5), which needs
        torch >= 2.9 (``ckptfs/torch_versions.py``)."""
        return SHARDED in FEATURES[self.format_version]

    @property
    def copies(self) -> bool:
        """``ckptfs cp``: copying a step already committed with the same content is not an
        error (it reports "identical" and returns that commit)."""
        return self.name.startswith("cp")

    def at(self, backend: Backend) -> Backend:
        """The backend the sweep runs on: ``backend``, or its sub-storage view."""
        if self.sub and not isinstance(backend, SubBackend):
            return SubBackend.of(backend)
        return backend

    def save(self, store: CheckpointStore, step: int, state: Mapping[str, Any], *,
             metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Write and commit ``state`` as ``step`` of ``store`` through this path; raise what the
        path raises."""
        if self.name in ("v1", "sub"):
            return store.save(step, state, metadata=metadata)
        if self.name == "v2":
            return save_v2(store, step, state, metadata=metadata)
        if self.name == "v5":
            return save_v2(store, step, state, metadata=metadata, metadata_layout="per-rank")
        if self.name == "async":
            fut = store.save_async(step, state, metadata=metadata)
            try:
                return fut.result()
            finally:
                store.close()  # the background thread, so a sweep leaves none behind
        if self.name == "v3":
            return save_v3(store, step, state, metadata=metadata)
        if self.name == "v4":
            return save_v4(store, step, state, metadata=metadata)
        if self.name in ("async-v3", "async-v3s"):
            return save_async_v3(store, step, state, metadata=metadata,
                                 streamed=self.name == "async-v3s")
        if self.name in ("async-v2", "async-v4"):
            return save_async_sharded(store, step, state, metadata=metadata,
                                      incremental=self.name == "async-v4")
        if self.name == "async-v5":
            return save_async_v5(store, step, state, metadata=metadata)
        if self.name == "async-v2s":
            return save_async_streamed(store, step, state, metadata=metadata)
        if self.name in ("cp", "cp-v2", "cp-v5"):
            return copy_through(store, step, state, metadata=metadata,
                                sharded=self.name != "cp",
                                metadata_layout="per-rank" if self.name == "cp-v5" else None)
        if self.name in ("cp-v3", "cp-v4"):
            return copy_kept_source(store, step, state, metadata=metadata,
                                    version=self.format_version)
        if self.name == "replica-v5":
            return save_replicated(store, step, state, metadata=metadata, per_rank=True)
        if self.name.startswith("replica-"):
            return save_replicated(store, step, state, metadata=metadata,
                                   incremental=self.references,
                                   sharded=SHARDED in FEATURES[self.format_version])
        raise ValueError(f"unknown write path {self.name!r}")  # pragma: no cover

    def __str__(self) -> str:
        return self.name


def save_v2(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
            metadata: Mapping[str, Any] | None = None,
            metadata_layout: str | None = None) -> CheckpointInfo:
    """``store.save`` on a store of ``store``'s storage and settings opened with
    ``layout="ranks"``: the collective save's driver in a world of one (format v2);
    ``metadata_layout="per-rank"``: format v5 (the metadata split per rank, docs/protocol.md
    §9.7)."""
    return CheckpointStore(store.storage, algorithm=store.algorithm, durable=store.durable,
                           threads=store.threads, metadata_layout=metadata_layout,
                           layout="ranks").save(step, state, metadata=metadata)


_FROZEN_MODEL: dict[str, Any] = {}


def frozen_state_for(step: int, *, same_objects: bool = False) -> dict[str, Any]:
    """`state_for` of ``step`` with the model of step
    0 (a frozen model, as in a fine-tune of a frozen base): what the ``v3`` path saves, so that
    each save references the model's tensors an earlier checkpoint holds.  ``same_objects``:
    the model is the same tensor objects at every call (never written to), as a training
    process holds its frozen base: what a sharded incremental save (format v4) recognises as
    unchanged."""
    state = state_for(step)
    if not same_objects:
        state["model"] = state_for(0)["model"]
        return state
    if not _FROZEN_MODEL:
        _FROZEN_MODEL.update(state_for(0)["model"])
    state["model"] = dict(_FROZEN_MODEL)
    return state


def save_v3(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
            metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """An incremental (format v3) save on ``store``'s storage, with its settings: a store of
    its own each time, so the reuse index is read from the latest committed checkpoint."""
    return incremental_store(store).save(step, state, metadata=metadata)


def incremental_store(store: CheckpointStore) -> CheckpointStore:
    """An incremental store on ``store``'s storage, with its settings (`save_v3`,
    `save_async_v3`)."""
    return CheckpointStore(store.storage, algorithm=store.algorithm, durable=store.durable,
                           threads=store.threads, shard_bytes=store.shard_bytes,
                           incremental=True)


def save_async_v3(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
                  metadata: Mapping[str, Any] | None = None,
                  streamed: bool = False) -> CheckpointInfo:
    """``save_async`` on an incremental store (format v3), as `save_v3` opens it, waited
    for; the store's background thread is closed afterwards.  ``streamed``: within
    `streamed_budget` (docs/async.md section 5)."""
    incremental = incremental_store(store)
    budget = streamed_budget(state) if streamed else None
    try:
        return incremental.save_async(step, state, metadata=metadata,
                                      staging_bytes=budget).result()
    finally:
        incremental.close()


_KEPT_LOCK = threading.Lock()
#: Per run root under test (its URL): the sharded incremental reuse memory of its saves.
_MEMORIES: dict[str, Any] = {}
#: Per run root under test: the scratch ``memory://`` root a ``cp-v3``/``cp-v4`` source or a
#: two-tier local tier is kept in.
_KEPT: dict[tuple[str, str], str] = {}


def reuse_memory(store: CheckpointStore) -> Any:
    """The incremental reuse memory of the saves to ``store``'s run root in this process (a
    store opened per save forgets what the previous save wrote; a training process keeps its
    store, so its memory: this is that memory)."""
    from ckptfs.protocol.incremental import ReuseMemory

    with _KEPT_LOCK:
        return _MEMORIES.setdefault(store.storage.url, ReuseMemory())


def kept_root(store: CheckpointStore, kind: str) -> str:
    """A scratch ``memory://`` root of ``kind`` kept for ``store``'s run root."""
    with _KEPT_LOCK:
        key = (kind, store.storage.url)
        if key not in _KEPT:
            _KEPT[key] = f"memory://{kind}-{uuid.uuid4().hex[:12]}"
        return _KEPT[key]


def save_v4(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
            metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """``store.save`` of an incremental store of ``layout="ranks"`` (format v4) on ``store``'s
    storage, with the reuse memory of the run root (`reuse_memory`)."""
    saver = CheckpointStore(store.storage, algorithm=store.algorithm, durable=store.durable,
                            threads=store.threads, incremental=True, lease_s=store.lease_s,
                            metadata_layout=None, layout="ranks")
    saver.options = saver.options.but(reuse=reuse_memory(store))
    return saver.save(step, state, metadata=metadata)


@contextlib.contextmanager
def world_of_one() -> Iterator[Any]:
    """A one-rank gloo process group (unless one is already initialized) and a one-rank CPU
    device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_available() and dist.is_initialized():
        yield init_device_mesh("cpu", (dist.get_world_size(),))
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0,
                                world_size=1)
        try:
            yield init_device_mesh("cpu", (1,))
        finally:
            dist.destroy_process_group()


def as_dtensors(value: Any, mesh: Any, memo: dict[int, Any],
                _open: frozenset[int] = frozenset()) -> Any:
    """``value`` with every plain dense CPU tensor a DTensor on ``mesh`` (sharded by rows; a
    0-dim tensor replicated); one DTensor per distinct tensor object (``memo``, by id).  Any
    other value (a tensor subclass, a sparse, nested, meta or quantized tensor, a container
    holding itself) is left as it is, for the save to refuse."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if type(value) is torch.Tensor:
        plain = (value.layout == torch.strided and value.device.type == "cpu"
                 and not value.is_nested and not value.is_quantized)
        if not plain:
            return value
        if id(value) not in memo:
            placement = Shard(0) if value.dim() else Replicate()
            memo[id(value)] = (value, distribute_tensor(value, mesh, [placement],
                                                        src_data_rank=None))
        return memo[id(value)][1]
    if type(value) is dict and id(value) not in _open:
        inner = _open | {id(value)}
        return {k: as_dtensors(v, mesh, memo, inner) for k, v in value.items()}
    return value


#: The DTensors of the frozen model's tensors, kept (a training process keeps its parameters).
_DTENSORS: dict[int, Any] = {}


def save_async_sharded(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
                       metadata: Mapping[str, Any] | None = None,
                       incremental: bool = False) -> CheckpointInfo:
    """``save_async`` of ``state`` with its tensors as DTensors on a one-rank mesh, under a
    one-rank process group (`world_of_one`): the collective async save (``incremental``: of
    an incremental store, with the run root's reuse memory)."""
    saver = CheckpointStore(store.storage, algorithm=store.algorithm, durable=store.durable,
                            threads=store.threads, shard_bytes=store.shard_bytes,
                            incremental=incremental, lease_s=store.lease_s)
    if incremental:
        saver.options = saver.options.but(reuse=reuse_memory(store))
    with world_of_one() as mesh:
        memo = _DTENSORS if incremental else {}
        fut = saver.save_async(step, as_dtensors(dict(state), mesh, memo), metadata=metadata)
        try:
            return fut.result()
        finally:
            saver.close()


def streamed_budget(state: Mapping[str, Any]) -> int | None:
    """A staging budget that ``state``'s tensors exceed and its largest tensor fits twice
    (so a collective async save streams it in several groups); None when it has fewer than
    two tensors with bytes (nothing to split)."""
    from ckptfs.errors import CkptfsError
    from ckptfs.format.sharded_tree import dcp_view
    from ckptfs.protocol.snapshot import split
    from ckptfs.protocol.staging import staged_size

    try:  # what the save stages: the DCP view's tensors (a state it refuses: no budget)
        view, _ = dcp_view(state)
        tensors = split(view).tensors
    except CkptfsError:
        return None
    sizes = sorted(staged_size([t]) for t in tensors if t.numel())
    if len(sizes) < 2:
        return None
    return max(2 * sizes[-1], sum(sizes) // 3, 64)


def save_async_streamed(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
                        metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """``save_async`` of a store of ``store``'s storage and settings opened with
    ``layout="ranks"`` within `streamed_budget`: format v2, each group of the state's tensors
    in a rank file of its own (docs/async.md section 5)."""
    saver = CheckpointStore(store.storage, algorithm=store.algorithm, durable=store.durable,
                            threads=store.threads, shard_bytes=store.shard_bytes,
                            layout="ranks")
    fut = saver.save_async(step, state, metadata=metadata, staging_bytes=streamed_budget(state))
    try:
        return fut.result()
    finally:
        saver.close()


def save_async_v5(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
                  metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """``save_async`` of a store of ``store``'s storage and settings opened with
    ``layout="ranks"`` and ``metadata_layout="per-rank"`` (format v5, no process group)."""
    saver = CheckpointStore(store.storage, algorithm=store.algorithm, durable=store.durable,
                            threads=store.threads, shard_bytes=store.shard_bytes,
                            layout="ranks", metadata_layout="per-rank")
    fut = saver.save_async(step, state, metadata=metadata)
    try:
        return fut.result()
    finally:
        saver.close()


def copy_kept_source(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
                     metadata: Mapping[str, Any] | None = None,
                     version: int = 3) -> CheckpointInfo:
    """``ckptfs cp`` of an incremental step: ``state`` saved (format v3, or v4) into the
    scratch source kept for ``store``'s run root (`kept_root`: its earlier steps are there,
    so the saved step references them), then `copy_step` into ``store``.  A step the source
    already holds (a retry of a refused copy) is saved there again first, unless ``store``
    holds it committed (a copy that crashed after its marker: the retry copies the same
    source again, as a user's would, and finds it there)."""
    from ckptfs.protocol.copy import copy_step

    src = CheckpointStore(FsspecStorage(kept_root(store, f"cp-v{version}-source")),
                          algorithm=store.algorithm, threads=store.threads,
                          shard_bytes=store.shard_bytes)
    retry = step in src.steps()
    if not (retry and step in store.steps()):
        if retry:
            src.delete(step)
        if version == 4:
            save_v4(src, step, state, metadata=metadata)
        else:
            save_v3(src, step, state, metadata=metadata)
    copy_step(src.storage, store.storage, step, durable=store.durable, threads=store.threads)
    return read_committed(store.storage, step)


def save_replicated(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
                    metadata: Mapping[str, Any] | None = None,
                    incremental: bool = False, sharded: bool = False,
                    per_rank: bool = False) -> CheckpointInfo:
    """``ckptfs.tiered(local, store)`` with the local tier kept for ``store``'s run root
    (`kept_root`), ``save`` then ``wait_replicated``: ``store`` is the remote tier, and the
    checkpoint returned is its copy.  A step the local tier already holds (a retry of a
    refused replication) is saved there again first.  ``sharded``: the state's tensors as
    DTensors under a one-rank process group (`world_of_one`), saved collectively (format v2;
    v4 with ``incremental``: each save a new job's first, reusing what the local tier
    holds after one check, and its DTensors on that save's own mesh: a process group
    of an earlier save is gone).  ``per_rank``: the local tier a store of
    ``layout="ranks"`` and ``metadata_layout="per-rank"`` (format v5, no process group)."""
    from ckptfs.protocol.tiers import tiered

    kind = ("replica-local-v5" if per_rank else
            "replica-local-sharded" if sharded else "replica-local")
    local = CheckpointStore(FsspecStorage(kept_root(store, kind)),
                            algorithm=store.algorithm, threads=store.threads,
                            shard_bytes=store.shard_bytes, incremental=incremental,
                            layout="ranks" if per_rank else AUTO,
                            metadata_layout="per-rank" if per_rank else AUTO)
    if step in local.steps():
        local.delete(step)
    two = tiered(local, store, algorithm=store.algorithm, durable=store.durable,
                 threads=store.threads, incremental=incremental, replicate_threads=1,
                 max_attempts=1)
    try:
        if sharded:
            with world_of_one() as mesh:
                memo: dict[int, Any] = {}  # DTensors of this save's own mesh
                two.save(step, as_dtensors(dict(state), mesh, memo), metadata=metadata)
        else:
            two.save(step, state, metadata=metadata)
        two.wait_replicated(timeout=120)
    finally:
        two.close()
    return read_committed(store.storage, step)


def copy_through(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
                 metadata: Mapping[str, Any] | None = None,
                 sharded: bool = False, metadata_layout: str | None = None) -> CheckpointInfo:
    """Save ``state`` into a scratch ``memory://`` root (v1, or v2 with ``sharded``; v5 with
    ``metadata_layout="per-rank"`` too), then copy
    it into ``store`` with ``ckptfs cp``'s `copy_step` (the same
    threads, so the destination's calls come in a deterministic order when ``store`` has one
    thread).  The scratch root is removed afterwards."""
    from ckptfs.protocol.copy import copy_step

    src = CheckpointStore(FsspecStorage(f"memory://cp-source-{uuid.uuid4().hex[:12]}"),
                          algorithm=store.algorithm, threads=store.threads,
                          shard_bytes=store.shard_bytes)
    try:
        if sharded:
            save_v2(src, step, state, metadata=metadata, metadata_layout=metadata_layout)
        else:
            src.save(step, state, metadata=metadata)
        copy_step(src.storage, store.storage, step, durable=store.durable,
                  threads=store.threads)
    finally:
        src.storage.delete_tree("")
    return read_committed(store.storage, step)


V1 = WritePath("v1")
V2 = WritePath("v2", 2)
ASYNC = WritePath("async")
CP = WritePath("cp")
CP_V2 = WritePath("cp-v2", 2)
SUB = WritePath("sub", sub=True)
V3 = WritePath("v3", 3, references=True)
V4 = WritePath("v4", 4, references=True)
ASYNC_V2 = WritePath("async-v2", 2)
ASYNC_V2S = WritePath("async-v2s", 2)
ASYNC_V3 = WritePath("async-v3", 3, references=True)
ASYNC_V3S = WritePath("async-v3s", 3, references=True)
ASYNC_V4 = WritePath("async-v4", 4, references=True)
CP_V3 = WritePath("cp-v3", 3, references=True)
CP_V4 = WritePath("cp-v4", 4, references=True)
REPLICA_V1 = WritePath("replica-v1")
REPLICA_V3 = WritePath("replica-v3", 3, references=True)
REPLICA_V2 = WritePath("replica-v2", 2)
REPLICA_V4 = WritePath("replica-v4", 4, references=True)
V5 = WritePath("v5", 5)
ASYNC_V5 = WritePath("async-v5", 5)
CP_V5 = WritePath("cp-v5", 5)
REPLICA_V5 = WritePath("replica-v5", 5)

#: Every in-process write path, by name.
WRITE_PATHS: dict[str, WritePath] = {p.name: p for p in (
    V1, V2, ASYNC, CP, CP_V2, SUB, V3, V4, ASYNC_V2, ASYNC_V2S, ASYNC_V3, ASYNC_V3S, ASYNC_V4,
    CP_V3, CP_V4,
    REPLICA_V1, REPLICA_V3, REPLICA_V2, REPLICA_V4, V5, ASYNC_V5, CP_V5, REPLICA_V5)}


# -- rollback reads ----------------------------------------------------------------------------

#: The reads of "the newest checkpoint that is good" (module docstring).
ROLLBACK_READS = ("load-rollback", "load-into-rollback", "restore-rollback")


def rollback_reads(path: WritePath) -> tuple[str, ...]:
    """The rollback reads of a checkpoint of ``path``: every one, on every layout
    (``load(into=)`` reads either)."""
    return ROLLBACK_READS


def _zeros_like(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _zeros_like(v) for k, v in value.items()}
    return value


class _StateModule:
    """A module whose parameters are a state's ``"model"`` tensors (what the manager restores
    into), built lazily so that importing this module does not need torch.nn."""

    @staticmethod
    def of(model: Mapping[str, Any]) -> Any:
        import torch

        module = torch.nn.Module()
        for name, t in model.items():
            module.register_parameter(name, torch.nn.Parameter(torch.zeros_like(t),
                                                               requires_grad=False))
        return module


def rollback_read(how: str, store: CheckpointStore, template: Mapping[str, Any]) -> Any:
    """Read the newest good checkpoint of ``store`` through the rollback read ``how``; the
    state it returned, in the sweeps' shape (``template``: a state of the run, whose shapes
    the targets take): the whole state (``load-rollback``), the ``model`` and ``optimizer``
    filled (``load-into-rollback``), the ``model`` restored into a module
    (``restore-rollback``).  Raises what the read raises."""
    if how == "load-rollback":
        return store.load(allow_rollback=True)
    if how == "load-into-rollback":
        into = {k: _zeros_like(template[k]) for k in ("model", "optimizer")}
        store.load(into=into, allow_rollback=True)
        return into
    if how == "restore-rollback":
        from ckptfs.lifecycle.manager import CheckpointManager

        module = _StateModule.of(template["model"])
        CheckpointManager(store).restore_latest(model=module, allow_rollback=True)
        return {"model": {k: v.detach() for k, v in module.named_parameters()}}
    raise ValueError(f"unknown rollback read {how!r}")  # pragma: no cover


def read_part(state: Mapping[str, Any], how: str) -> dict[str, Any]:
    """The part of ``state`` the rollback read ``how`` returns (`rollback_read`)."""
    if how == "load-rollback":
        return dict(state)
    if how == "load-into-rollback":
        return {k: state[k] for k in ("model", "optimizer")}
    return {"model": dict(state["model"])}
