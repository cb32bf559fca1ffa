"""The write paths every reliability sweep can run through (issue 16, part 7: every hardening
check on every path).

A checkpoint reaches storage through one of several writers, and each must give a reader
exactly what the single-process save gives it:

=========  ====================================================================================
``v1``     ``store.save`` in one process (format v1)
``v2``     the collective save on one rank (``save_sharded`` with no process group:
           ``dcp.save(no_dist=True)`` driving `ShardedWriter`,
           as ``ckptfs.dcp.Writer`` is driven)
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
=========  ====================================================================================

A sweep takes a `WritePath` and a `Backend`; it writes
``path.state(step)`` through ``path.save(store, step, state)`` on the store of
``path.at(backend)`` (the backend itself, or its sub-storage view), and reads with the
ordinary store API.  The two-rank gloo save cannot run inside a sweep's process; the tests add
it (tests/paths.py) as one more `WritePath` whose ``save`` launches the ranks.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
        return frozen_state_for(step) if self.references else state_for(step)

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
        if self.name == "async":
            fut = store.save_async(step, state, metadata=metadata)
            try:
                return fut.result()
            finally:
                store.close()  # the background thread, so a sweep leaves none behind
        if self.name == "v3":
            return save_v3(store, step, state, metadata=metadata)
        if self.name in ("cp", "cp-v2"):
            return copy_through(store, step, state, metadata=metadata,
                                sharded=self.name == "cp-v2")
        raise ValueError(f"unknown write path {self.name!r}")  # pragma: no cover

    def __str__(self) -> str:
        return self.name


def save_v2(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
            metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """The collective (format v2) save, on one rank."""
    from ckptfs.protocol.sharded import save_sharded  # imports DCP: only when used

    return save_sharded(store.storage, step, state, algorithm=store.algorithm,
                        durable=store.durable, threads=store.threads, metadata=metadata)


def frozen_state_for(step: int) -> dict[str, Any]:
    """`state_for` of ``step`` with the model of step
    0 (a frozen model, as in a fine-tune of a frozen base): what the ``v3`` path saves, so that
    each save references the model's tensors an earlier checkpoint holds."""
    state = state_for(step)
    state["model"] = state_for(0)["model"]
    return state


def save_v3(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
            metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """An incremental (format v3) save on ``store``'s storage, with its settings: a store of
    its own each time, so the reuse index is read from the latest committed checkpoint."""
    incremental = CheckpointStore(store.storage, algorithm=store.algorithm,
                                  durable=store.durable, threads=store.threads,
                                  shard_bytes=store.shard_bytes, incremental=True)
    return incremental.save(step, state, metadata=metadata)


def copy_through(store: CheckpointStore, step: int, state: Mapping[str, Any], *,
                 metadata: Mapping[str, Any] | None = None,
                 sharded: bool = False) -> CheckpointInfo:
    """Save ``state`` into a scratch ``memory://`` root (v1, or v2 with ``sharded``), then copy
    it into ``store`` with ``ckptfs cp``'s `copy_step` (the same
    threads, so the destination's calls come in a deterministic order when ``store`` has one
    thread).  The scratch root is removed afterwards."""
    from ckptfs.protocol.copy import copy_step

    src = CheckpointStore(FsspecStorage(f"memory://cp-source-{uuid.uuid4().hex[:12]}"),
                          algorithm=store.algorithm, threads=store.threads,
                          shard_bytes=store.shard_bytes)
    try:
        if sharded:
            save_v2(src, step, state, metadata=metadata)
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

#: Every in-process write path, by name.
WRITE_PATHS: dict[str, WritePath] = {p.name: p for p in (V1, V2, ASYNC, CP, CP_V2, SUB, V3)}
