"""The user-facing API: `open` a run root by URL, then save, load, list and verify."""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

from ckptfs.errors import (
    CheckpointDeletedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LoadOptionError,
    StorageError,
)
from ckptfs.format.features import AUTO, check_layout
from ckptfs.format.hashing import DEFAULT_ALGORITHM
from ckptfs.format.incremental import DEFAULT_GRACE_S, DEFAULT_LEASE_S
from ckptfs.format.layout import StepPaths, check_step, step_dir_name
from ckptfs.format.serialize import DEFAULT_SHARD_BYTES
from ckptfs.protocol import async_save
from ckptfs.protocol.collective import is_distributed
from ckptfs.protocol.formats import VerifyReport, load_checkpoint, verified
from ckptfs.protocol.incremental import ReuseMemory
from ckptfs.protocol.load_options import KeyPath, MapLocation, parse_keys, tensor_map
from ckptfs.protocol.options import SaveOptions
from ckptfs.protocol.prepare import prepare
from ckptfs.protocol.references import free_step, shared_attempts
from ckptfs.protocol.remote_verify import RemoteVerifyReport, verify_remote
from ckptfs.protocol.replicas import check_divergent_keys
from ckptfs.protocol.resolve import (
    MAX_RESOLVE_PASSES,
    CheckpointInfo,
    Tier,
    check_still_committed,
    committed_info,
    committed_steps,
    list_step_dirs,
    one_store,
    resolve_latest,
    step_dirs,
    use_step,
    walk_tiers,
)
from ckptfs.storage.base import Capabilities, Storage
from ckptfs.storage.deadline import check_deadline
from ckptfs.storage.fsspec import DEFAULT_PROBE_TIMEOUT, FsspecStorage
from ckptfs.storage.retry import RetryingStorage
from ckptfs.torch_versions import sharded_supported

log = logging.getLogger("ckptfs")
T = TypeVar("T")


class Tiers(abc.ABC):
    """The tiers a `CheckpointStore` is a store over: what its reads resolve across, and what
    it tells of each commit and delete (docs/architecture.md "Tiers").  A plain store's are
    `OneTier` (its own storage); a two-tier store's are `ckptfs.protocol.tiers.TwoTiers`
    (the local tier, the remote one, and the replicator between them).  The store's methods
    are written once, over these; every method has an answer in both (one tier's is trivial
    where there is nothing else to do)."""

    #: Each rank's storage is its own node's (a sharded two-tier store's local tier): a sharded
    #: save checks each rank's file on its own node, a collective read walks only the tiers
    #: every rank reads whole (``read_tiers(collective=True)``), and a collective manager's
    #: prune has every node remove its files of the steps it deleted (docs/tiers.md
    #: "Sharded").  False: every rank sees one storage.
    node_local: bool = False

    @abc.abstractmethod
    def read_tiers(self, *, collective: bool = False) -> list[Tier]:
        """The tiers a read resolves across, in order of preference (the last one is the
        outermost: the copy ``verify(remote=True)`` checks).  ``collective``: those every rank
        of a process group can read a complete copy from."""

    @property
    @abc.abstractmethod
    def holds(self) -> frozenset[int]:
        """The steps that must not be deleted yet (`check_delete` refuses them; retention
        keeps them)."""

    @abc.abstractmethod
    def storage_of(self, info: CheckpointInfo) -> Storage:
        """The storage of the tier ``info`` was read from."""

    @abc.abstractmethod
    def before_collective_read(self, store: CheckpointStore) -> None:
        """Before a read over ``read_tiers(collective=True)``: what those tiers must hold
        first."""

    @abc.abstractmethod
    def node_save(self, state: Mapping[str, Any], process_group: Any) -> bool:
        """Whether a save of ``state`` writes each rank's files on its own node (then
        `committed` gives them their committed path); a save these tiers cannot take raises
        here, before anything is written."""

    @abc.abstractmethod
    def hold(self) -> None:
        """A save is writing: background work on the tiers pauses until `release`."""

    @abc.abstractmethod
    def release(self) -> None:
        """The save that `hold` announced is done writing."""

    @abc.abstractmethod
    def committed(self, info: CheckpointInfo, node: bool) -> None:
        """``info`` committed (``node``: as `node_save` answered for it)."""

    @abc.abstractmethod
    def future(self, inner: async_save.SaveFuture, node: bool) -> async_save.SaveFuture:
        """The future ``save_async`` returns for ``inner``, submitted after `hold`: once it
        is done the tiers `release`, and if it committed they are told (`committed`)."""

    @abc.abstractmethod
    def check_delete(self, step: int) -> None:
        """Raise if ``step`` may not be deleted now."""

    @abc.abstractmethod
    def deleted(self, step: int) -> None:
        """``step`` was deleted."""

    @abc.abstractmethod
    def check_load(self, *, into: dict[str, Any] | None, process_group: Any,
                   keys: Iterable[str | KeyPath] | None, mmap: bool) -> None:
        """Raise `LoadOptionError` for load options these tiers cannot honour (before the
        store's own checks)."""

    @abc.abstractmethod
    def load_into(self, step: int | None, into: dict[str, Any], process_group: Any, *,
                  verify: bool, allow_rollback: bool, threads: int) -> dict[Any, Any]:
        """``load(into=...)``: fill ``into`` in place from a sharded checkpoint."""

    @abc.abstractmethod
    def verify_copy(self, info: CheckpointInfo, *, quick: bool, threads: int
                    ) -> VerifyReport:
        """Verify the copy ``info`` names (`ckptfs.protocol.formats.verified`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """The store is closed: stop what runs in the background."""


class OneTier(Tiers):
    """A plain store's tiers: its own storage, nothing to tell."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def read_tiers(self, *, collective: bool = False) -> list[Tier]:
        return [("", self.storage)]

    @property
    def holds(self) -> frozenset[int]:
        return frozenset()

    def storage_of(self, info: CheckpointInfo) -> Storage:
        return self.storage

    def before_collective_read(self, store: CheckpointStore) -> None:
        pass  # every rank reads the one storage

    def node_save(self, state: Mapping[str, Any], process_group: Any) -> bool:
        return False

    def hold(self) -> None:
        pass

    def release(self) -> None:
        pass

    def committed(self, info: CheckpointInfo, node: bool) -> None:
        pass

    def future(self, inner: async_save.SaveFuture, node: bool) -> async_save.SaveFuture:
        return inner

    def check_delete(self, step: int) -> None:
        pass

    def deleted(self, step: int) -> None:
        pass

    def check_load(self, *, into: dict[str, Any] | None, process_group: Any,
                   keys: Iterable[str | KeyPath] | None, mmap: bool) -> None:
        pass  # the store's own checks are all there is

    def load_into(self, step: int | None, into: dict[str, Any], process_group: Any, *,
                  verify: bool, allow_rollback: bool, threads: int) -> dict[Any, Any]:
        if not sharded_supported() and process_group is None and not is_distributed():
            from ckptfs.protocol.files_into import load_into_alone  # torch < 2.9

            return load_into_alone(self.storage, step, into, verify=verify,
                                   allow_rollback=allow_rollback, threads=threads)
        from ckptfs.protocol import sharded
        return sharded.load_into(self.storage, step, into, process_group=process_group,
                                 verify=verify, threads=threads,
                                 allow_rollback=allow_rollback)

    def verify_copy(self, info: CheckpointInfo, *, quick: bool, threads: int
                    ) -> VerifyReport:
        return verified(self.storage, info, quick=quick, threads=threads)

    def close(self) -> None:
        pass


class CheckpointStore:
    """Checkpoints of one training run, under ``<root>/checkpoints/``.

    Thread-safe for concurrent readers; concurrent writers of the same step are resolved by the
    commit protocol (one wins, the others get `CheckpointExistsError`).

    A store over its tiers (`Tiers`): ``storage`` alone for a plain store, the local and the
    remote tier for a two-tier one (`ckptfs.tiered`); every method below is written once
    over them."""

    def __init__(self, storage: Storage, *, algorithm: str = DEFAULT_ALGORITHM,
                 durable: bool = True, threads: int | None = None,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, incremental: bool = False,
                 lease_s: float = DEFAULT_LEASE_S, tiers: Tiers | None = None,
                 metadata_layout: str | None = AUTO,
                 divergent_keys: Sequence[str] = (), layout: str = AUTO,
                 save_deadline_s: float | None = None) -> None:
        self.storage = storage
        #: Every save commits or raises `SaveDeadlineError` within this many seconds of its
        #: first storage request (None: unbounded; docs/reliability.md "Bounded saves").
        self.save_deadline_s = check_deadline(save_deadline_s)
        #: What reads resolve across and what is told of commits and deletes (default: this
        #: store's ``storage`` alone).
        self.tiers: Tiers = OneTier(storage) if tiers is None else tiers
        #: Single-process saves write format v3, referencing bytes an earlier checkpoint
        #: holds instead of writing them again (docs/incremental.md); sharded saves write
        #: format v4, each rank referencing its own unchanged items (docs/protocol.md §9.6).
        self.incremental = incremental
        #: How every save of this store writes, one value given whole to each stage of a save
        #: (`ckptfs.protocol.options`): the hash algorithm, durability, threads, the reuse
        #: memory of an incremental store and its lease, the metadata layout of sharded saves
        #: (``"per-rank"``: format v5, whose metadata each loading rank reads in part,
        #: docs/protocol.md §9.7; None: one ``dcp.msgpack``, v2 and v4; ``"auto"``, the
        #: default: ``"per-rank"`` from `PER_RANK_MIN_WORLD` ranks where the store allows it,
        #: not incremental, not per-node storage), whether each rank's storage is its node's
        #: own, and the key prefixes of replicated tensors meant to differ between ranks (not
        #: compared; stored whole from the lowest holder: `ckptfs.protocol.replicas`).
        self.options = SaveOptions(
            algorithm, durable, threads, lease_s, ReuseMemory() if incremental else None,
            metadata_layout, self.tiers.node_local, check_divergent_keys(divergent_keys))
        #: ``"ranks"``: every save writes the rank files of a sharded checkpoint (v2, v4, v5),
        #: in one process too (the world of one of the collective save); ``"auto"``: only
        #: under a process group (docs/sharded.md).
        self.layout = check_layout(layout)
        self.shard_bytes = shard_bytes
        #: An uncommitted attempt younger than this may be a save still running: a delete
        #: keeps what its manifest references (docs/protocol.md §9.5).  Exceeds the lease by
        #: the default margin for clock skew (1 h against the default 30 min lease).
        self.grace_s: float = max(DEFAULT_GRACE_S, lease_s + DEFAULT_GRACE_S - DEFAULT_LEASE_S)
        caps = storage.capabilities
        if caps.exclusive_create == "none":
            log.warning("%s: %s", storage.url, caps.caveat or "no exclusive create on this "
                        "backend")

    @property
    def url(self) -> str:
        return self.storage.url

    # The fields of `options` read one by one (loads, verify, copies, the front ends).
    @property
    def algorithm(self) -> str:
        return self.options.algorithm

    @property
    def durable(self) -> bool:
        return self.options.durable

    @property
    def threads(self) -> int:
        return self.options.workers

    @property
    def reuse(self) -> ReuseMemory | None:
        return self.options.reuse

    @property
    def lease_s(self) -> float:
        return self.options.lease_s

    @property
    def metadata_layout(self) -> str | None:
        return self.options.metadata_layout

    @property
    def divergent_keys(self) -> tuple[str, ...]:
        return self.options.divergent_keys

    @property
    def capabilities(self) -> Capabilities:
        return self.storage.capabilities

    @property
    def node_local(self) -> bool:
        """Each rank's ``storage`` is its own node's (`Tiers.node_local`)."""
        return self.tiers.node_local

    @property
    def holds(self) -> frozenset[int]:
        """The steps that must not be deleted yet: `delete` refuses them and retention
        (`ckptfs.lifecycle.retention.prune`) keeps them whatever its policy says (a two-tier
        store: its local steps not replicated yet; a plain store: none)."""
        return self.tiers.holds

    # -- writing -------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *,
             metadata: Mapping[str, Any] | None = None,
             process_group: Any = None) -> CheckpointInfo:
        """Write ``state`` as the checkpoint of ``step`` and commit it.

        Returns the committed `CheckpointInfo`.  Raises
        `UnsupportedValueError` (before writing anything) for values the format
        cannot hold, `CheckpointExistsError` if the step is already committed
        (or another writer commits it first).  Pending `save_async` saves are waited for
        first (and an uncollected failure of one raises here).  A two-tier store commits on
        the local tier and returns; the step is replicated in the background
        (``replication``, ``wait_replicated``)."""
        node = self.tiers.node_save(state, process_group)
        self.tiers.hold()  # a two-tier store's copying pauses while this save writes
        try:
            async_save.before_sync_save(self)
            info = prepare(self, step, state, metadata=metadata,
                           process_group=process_group).write()  # the save save_async runs
        finally:
            self.tiers.release()
        self.tiers.committed(info, node)
        return info

    def delete(self, step: int) -> None:
        """Delete a checkpoint: the marker first, so a half-deleted checkpoint never reads as
        committed, then every attempt of the step.  Every directory of the step is deleted,
        by its listed name (a non-canonical ``step-0000000000020`` included).

        An incremental (format v3) attempt whose files another checkpoint references (a
        committed one, or a save younger than `grace_s`) is kept whole, without its
        marker (*retired*, logged); garbage collection removes it once nothing references it
        (docs/protocol.md §9.5).  If a committed checkpoint's manifest cannot be read, the
        step is still deleted (no marker) but its v3 attempts are all kept, with a warning
        naming the unreadable checkpoint.

        A two-tier store deletes the local copy (the remote tier is left alone: use
        ``store.remote.delete``), and refuses with `UnreplicatedCheckpointError` while the
        step has not reached the remote tier, unless it allows it (``delete_unreplicated``)."""
        check_step(step)
        self.tiers.check_delete(step)
        names = list_step_dirs(self.storage).get(step) or [step_dir_name(step)]
        for name in names:
            paths = StepPaths(step, name)
            shared = shared_attempts(self.storage, paths)  # v3 attempts: may be referenced
            self.storage.delete(paths.marker)
            if self.durable and self.capabilities.fsync and self.storage.exists(paths.dir):
                self.storage.sync_dir(paths.dir)  # the marker's removal is durable first
            if not shared:
                self.storage.delete_tree(paths.dir)
                continue
            try:
                free_step(self.storage, paths, grace_s=self.grace_s)
            except CorruptCheckpointError as exc:
                log.warning("step %d at %s is deleted (its marker is gone) but its files are "
                            "kept: %s; then run 'ckptfs gc'", step, self.url, exc)
        self.tiers.deleted(step)

    # -- reading -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps (marker present), ascending by integer value.  A two-tier store:
        the steps committed in either tier (the steps `latest` and `load` choose from; a
        tier that cannot be listed is left out, logged, as the walk leaves it out; if
        neither can be, the local tier's error is raised)."""
        tiers = self.read_tiers()
        found: set[int] = set()
        errors: list[StorageError] = []
        for name, storage in tiers:
            try:
                found.update(committed_steps(storage))
            except StorageError as exc:
                if len(tiers) == 1:
                    raise
                log.warning("the %s tier %s cannot be listed (%s): steps() lists the other "
                            "tier only", name, storage.url, exc)
                errors.append(exc)
        if len(errors) == len(tiers):
            raise errors[0]
        return sorted(found)

    def all_steps(self) -> list[int]:
        """Every step with a directory, committed or not."""
        return step_dirs(self.storage)

    def latest(self, *, allow_rollback: bool = False) -> CheckpointInfo | None:
        """The newest committed checkpoint, or ``None``.  Raises
        `CorruptCheckpointError` if the newest committed one fails its check,
        unless ``allow_rollback``."""
        found = self.walk(lambda info: info, allow_rollback=allow_rollback)
        return None if found is None else found[0]

    def info(self, step: int) -> CheckpointInfo:
        """The committed checkpoint of ``step`` (its directory found by listing)."""
        return self.use_step(step, lambda info: info)[0]

    def load(self, step: int | None = None, *, map_location: MapLocation = None,
             verify: bool = True, allow_rollback: bool = False,
             into: dict[str, Any] | None = None, process_group: Any = None,
             keys: Iterable[str | KeyPath] | None = None, mmap: bool = False
             ) -> dict[Any, Any]:
        """Load a committed checkpoint (the latest if ``step`` is None).

        With ``verify`` (default) every file is hashed while it is read and compared with the
        manifest before anything is returned.  If the newest checkpoint fails, the error names it;
        with ``allow_rollback`` the next older committed checkpoint is tried (and logged).

        ``into``: fill this state dict in place from a sharded checkpoint and return it
        (collective when torch.distributed is initialized, or on ``process_group``; its
        tensors and DTensors define the placement: docs/sharded.md).

        ``keys``: load only these key paths (``["model"]``, ``["model/layer.weight"]``,
        ``[("model", 0)]`` for non-str keys); only the files holding them are read and verified.
        ``map_location``: every form ``torch.load`` accepts (str, torch.device, dict, callable).
        ``mmap``: local disk only, tensors view memory-mapped files.  See docs/loading.md.

        A two-tier store: the newest step in either tier (or ``step``), from the local copy
        when it loads and verifies, else from the remote copy (logged).  A step bad in both
        tiers raises (``allow_rollback``: the next older)."""
        self.tiers.check_load(into=into, process_group=process_group, keys=keys, mmap=mmap)
        tensor_map(map_location)  # bad options fail before any I/O (LoadOptionError)
        paths = parse_keys(keys)  # malformed keys fail before any I/O
        if into is not None and (keys is not None or mmap):
            raise LoadOptionError("load(into=...) fills the given state dict in place: keys "
                                  "and mmap do not apply (the state dict selects what is read)")
        if into is not None:
            return self.tiers.load_into(step, into, process_group, verify=verify,
                                        allow_rollback=allow_rollback, threads=self.threads)

        def use(info: CheckpointInfo) -> dict[Any, Any]:
            return self.load_info(info, verify=verify, map_location=map_location, keys=paths,
                                  mmap=mmap)

        if step is not None:
            return self.use_step(step, use)[1]
        tried: list[str] = []
        found = self.walk(use, allow_rollback=allow_rollback, skipped=tried)
        if found is None:
            where = " or ".join(st.url for _, st in self.read_tiers())
            raise CheckpointNotFoundError(
                f"no committed checkpoint to load at {where}"
                + (f" (skipped corrupt: {'; '.join(tried)})" if tried else ""))
        return found[1]

    def read_tiers(self, *, collective: bool = False) -> list[Tier]:
        """The tiers a read resolves across, in order of preference (`Tiers.read_tiers`):
        this store's storage (a two-tier store: the local tier, then the remote one;
        docs/tiers.md).  ``collective``: the tiers of a read by every rank of a process group
        together, each one every rank can read a complete copy from (the same here; a store
        whose own storage is each node's own, `node_local`, leaves that tier out)."""
        return self.tiers.read_tiers(collective=collective)

    def walk(self, use: Callable[[CheckpointInfo], T], *, allow_rollback: bool = False,
             skipped: list[str] | None = None, collective: bool = False
             ) -> tuple[CheckpointInfo, T] | None:
        """``use`` on the newest committed checkpoint that passes it, with the checkpoint, or
        ``None`` if there is none: the one walk behind `load` and the manager's
        restore, over `read_tiers` (`ckptfs.protocol.resolve.walk_tiers`).
        ``use`` gets the `CheckpointInfo` of one tier's copy; `load_info` loads
        it from that tier.  ``collective``: over ``read_tiers(collective=True)``, once the
        tiers hold what it reads (`Tiers.before_collective_read`: a node-local two-tier
        store first waits, at most ``RESTORE_WAIT_S``, for its local steps to reach the
        remote tier; a step that cannot is not a candidate, logged)."""
        if collective:
            self.tiers.before_collective_read(self)
        return walk_tiers(self.read_tiers(collective=collective), use,
                          allow_rollback=allow_rollback, skipped=skipped)

    def use_step(self, step: int, use: Callable[[CheckpointInfo], T], *,
                 collective: bool = False) -> tuple[CheckpointInfo, T]:
        """``use`` on the committed checkpoint of ``step``, with it: the walk's rule for a
        step asked by number (`ckptfs.protocol.resolve.use_step`: a two-tier store tries
        the remote copy when the local one is missing or fails ``use``, logged; a step bad
        in both tiers raises naming each tier's error).  ``collective``: as for `walk`."""
        check_step(step)
        if collective:
            self.tiers.before_collective_read(self)
        return use_step(self.read_tiers(collective=collective), step, use)

    def load_info(self, info: CheckpointInfo, *, verify: bool = True,
                  map_location: MapLocation = None,
                  keys: Iterable[str | KeyPath] | None = None, mmap: bool = False
                  ) -> dict[Any, Any]:
        """Load exactly the committed attempt ``info`` names (as resolved by `info` or
        `latest`, or agreed by several ranks), never a newer one, from the tier it was read
        from.  A file that went missing is corruption only if the marker still names this
        attempt; else the checkpoint was deleted while it was read (`CheckpointDeletedError`)."""
        storage = self.tiers.storage_of(info)
        try:
            return load_checkpoint(storage, info, verify=verify, map_location=map_location,
                                   threads=self.threads, keys=keys, mmap=mmap)
        except CorruptCheckpointError:
            check_still_committed(storage, info.step, info.dir_name, info.attempt)
            raise

    @overload
    def verify(self, step: int | None = None, *, quick: bool = False,
               remote: Literal[False] = False) -> VerifyReport: ...

    @overload
    def verify(self, step: int | None = None, *, quick: bool = False,
               remote: Literal[True]) -> RemoteVerifyReport: ...

    def verify(self, step: int | None = None, *, quick: bool = False,
               remote: bool = False) -> VerifyReport | RemoteVerifyReport:
        """Verify a committed checkpoint (the latest if ``step`` is None).

        Full (default) re-hashes every file and checks the documents as a load does (what a
        load refuses, a full verify refuses); ``quick`` compares names and sizes from one
        listing.  Returns the report if everything matches, else raises
        `CorruptCheckpointError` listing every problem.  A two-tier store verifies the copy
        a load would use: the local one if it verifies, else the remote one (logged); it
        raises if no tier holds a good copy (``store.local.verify`` / ``store.remote.verify``
        check one tier).

        ``remote``: compare each file with the object store's own stored checksum, from
        metadata requests alone, reading no data (docs/remote-verify.md): raises
        `RemoteChecksumMismatchError` on a mismatch; files the store cannot
        vouch for are reported ``not available`` (``report.complete`` is then False).  A
        two-tier store checks its remote tier's copy."""
        tiers = self.read_tiers()
        if remote:
            storage = tiers[-1][1]  # the outermost tier (a plain store's own)
            if step is not None:
                check_step(step)
            info = committed_info(storage, step) if step is not None else \
                resolve_latest(storage)
            if info is None:
                raise CheckpointNotFoundError(f"no committed checkpoint at {storage.url}")
            return verify_remote(storage, info)

        def use(info: CheckpointInfo) -> VerifyReport:
            return self.tiers.verify_copy(info, quick=quick, threads=self.threads)

        if step is not None:
            return self.use_step(step, use)[1]
        where = " or ".join(st.url for _, st in tiers)
        if not one_store(tiers):  # a later tier's copy may stand in: the walk's rule
            found = self.walk(use)
            if found is None:
                raise CheckpointNotFoundError(f"no committed checkpoint at {where}")
            return found[1]
        for _ in range(MAX_RESOLVE_PASSES):  # one store: the newest copy's own error
            info = self.latest()
            if info is None:
                raise CheckpointNotFoundError(f"no committed checkpoint at {where}")
            try:
                return use(info)
            except CheckpointDeletedError as exc:
                log.info("%s; resolving the latest again", exc)
        raise CheckpointDeletedError(
            f"the latest checkpoint at {self.url} kept being deleted while it was verified; "
            "retry")

    # -- asynchronous saves: thin hooks into ckptfs.protocol.async_save (docs/async.md) -------

    def save_async(self, step: int, state: Mapping[str, Any], *,
                   metadata: Mapping[str, Any] | None = None,
                   max_in_flight: int = 1,
                   staging_bytes: int | None = None) -> async_save.SaveFuture:
        """Snapshot ``state`` and return; write and commit it on the store's background thread.

        The snapshot is taken on the calling thread, during this call, and after it returns
        nothing of ``state`` or ``metadata`` is read again: the caller may change, free or
        reuse every tensor, array, container and value at once.  First the state is planned
        exactly as `save` plans it: every non-tensor value (the tree, keys, numbers,
        strings, and extension values such as NumPy arrays' dtype and shape, sets,
        ``Namespace`` objects, registered dataclasses and containers; a registered ``encode``
        function runs here) is encoded into the checkpoint's bytes, and ``metadata`` is
        deep-copied.  Then, after any back-pressure wait, the bytes of every tensor of the
        plan (NumPy array data and tensors inside extension values included; one per distinct
        tensor as `save` stores them: tied weights once, a conjugate or negative view and
        an empty tensor each on its own) are copied into reused host buffers (CUDA: pinned,
        synchronized before returning).  The checkpoint is byte for byte what `save`
        would have written during this call.  A collective (sharded) state is snapshotted the
        same way on every rank (docs/async.md, section 7).

        The future's ``result()`` is the committed `CheckpointInfo` or raises what went
        wrong; uncollected failures raise again from the next `save`,
        `save_async`, `wait` or `close`, one per call, oldest first (each with a note naming
        those still to come).
        With ``max_in_flight`` saves pending, this call first waits (logged, counted in
        `async_stats`).  Invalid values raise here, naming their key path.

        ``staging_bytes``: the most host memory the copies may take (None: the state's
        tensors, whole).  A single-process state larger than it is streamed through it: this
        call copies a part, the background thread writes it, the buffers are reused for the
        next part, and the call returns once the last part is copied (the earlier ones
        written); a tensor larger than the budget raises `StagingBudgetError`.  A collective
        save or an incremental store's save over the budget is not copied: it is written
        from ``state`` and this call returns once it is done (docs/async.md, section 5).

        A two-tier store queues the step for replication once it committed locally; a
        sharded state (on every rank of a store opened on every rank): each rank writes its
        file on its own node, and the future is done once this node's files have their
        committed path too."""
        node = self.tiers.node_save(state, None)  # refuses before anything is written
        self.tiers.hold()  # a two-tier store's copying pauses until the write is done
        try:
            inner = async_save.saver_for(self).submit(self, step, state, metadata=metadata,
                                                      max_in_flight=max_in_flight,
                                                      staging_bytes=staging_bytes)
        except BaseException:
            self.tiers.release()
            raise
        return self.tiers.future(inner, node)

    def wait(self) -> None:
        """Wait for every pending `save_async`; raise a failure nobody collected."""
        async_save.wait(self)

    def close(self) -> None:
        """`wait`, then release the background thread and the staging buffers (a later
        `save_async` starts them again).  A two-tier store then stops its replicator after
        its current copy attempt; what is not replicated yet is queued again by the next open
        (an interrupted remote attempt is never committed; gc removes it)."""
        try:
            async_save.close(self)
        finally:
            self.tiers.close()

    @property
    def async_stats(self) -> async_save.AsyncStats:
        """Counters of `save_async`: submitted, committed, failed, back-pressure waits,
        snapshot time, staging memory."""
        return async_save.stats_of(self)

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            async_save.exit_context(self, exc_type is not None)
        finally:
            self.tiers.close()

    # -- end of the async hooks ----------------------------------------------------------------

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"


def open(url: str, *, algorithm: str = DEFAULT_ALGORITHM, durable: bool = True,
         threads: int | None = None, retries: int = 3, incremental: bool = False,
         lease_s: float = DEFAULT_LEASE_S, metadata_layout: str | None = AUTO,
         divergent_keys: Sequence[str] = (), layout: str = AUTO,
         probe: bool = True, probe_timeout: float = DEFAULT_PROBE_TIMEOUT,
         save_deadline_s: float | None = None, **storage_options: Any) -> CheckpointStore:
    """Open the run root at ``url`` (any fsspec URL; a plain path means local disk).

    A URL whose protocol lacks its ``//`` (``s3:/bucket/run``, ``s3:bucket/run``, ``gs:/b``),
    which fsspec would read as a local relative path, is refused with `InvalidURLError`
    naming the intended ``s3://bucket/run``.

    ``algorithm``: the content hash of new checkpoints' files (``ckptfs.ALGORITHMS``; the
    default `DEFAULT_ALGORITHM` needs no optional package, ``xxh3-128`` and ``crc32c`` need
    ``ckptfs[xxhash]`` / ``ckptfs[crc32c]``); reading verifies each checkpoint with the one
    its manifest names.
    ``durable``: fsync each file and directory on local disk before the commit marker
    (``False`` is faster and loses crash consistency across a power loss, not a process kill).
    ``threads``: parallel file writes and reads of one save or load (default: by CPU count).
    ``retries``: how many times an idempotent storage call that failed transiently is repeated
    (with capped exponential backoff; 0 disables, see `ckptfs.storage.retry`).
    ``incremental``: single-process saves write format v3 and reference the bytes an earlier
    checkpoint of the run already holds instead of writing them again (docs/incremental.md);
    sharded saves (under a process group) write format v4, every rank referencing the items
    of its previous save in this process that did not change (docs/protocol.md §9.6);
    ``lease_s``: how long such a save may take before it gives up its references.
    ``metadata_layout``: how sharded saves store their metadata: ``"per-rank"``, format v5,
    whose metadata every loading rank reads only in part (docs/protocol.md §9.7; not yet with
    ``incremental`` nor a two-tier store's per-node storage); None, one ``dcp.msgpack`` that
    every loading rank reads whole (v2, v4); ``"auto"`` (the default), ``"per-rank"`` for a
    save of at least 64 ranks (`PER_RANK_MIN_WORLD`) where the store allows it, else None.
    ``divergent_keys``: key prefixes (``"loss_buf"``, ``"model.head"``) of tensors that the
    ranks of a sharded save hold under one key but that are meant to differ between them.
    Every other tensor several ranks hold is compared (digests) before anything is written,
    and a save whose copies differ raises `ReplicaMismatchError` naming the key and ranks
    (docs/sharded.md); a divergent one is stored whole from the lowest rank holding it.
    ``layout``: ``"auto"`` (the default): a single process writes its files (format v1, v3),
    a process group the rank files of a sharded checkpoint (v2, v4, v5); ``"ranks"``: every
    save writes the rank files, in one process too (a world of one; docs/sharded.md). Either
    layout loads into any world size and placement.
    These options are the store's `SaveOptions` (``store.options``), checked here: a bad
    value raises before anything is written (`SaveOptionError` naming the option;
    an unknown algorithm `HashAlgorithmUnavailableError`).
    ``probe``: on object stores (S3, GCS, Azure), check the bucket/container at once, so a
    missing bucket, refused credentials or a dead endpoint raise here (`StorageError` and its
    subclasses, naming the URL and the cause) before anything is written; ``False`` skips it
    (one request fewer per open).  The probe first resolves the endpoint's host name (at most
    5 s): a name that cannot be resolved fails at once, naming the host.
    ``probe_timeout``: seconds the probe's request may take (default 10) against an endpoint
    that refuses connections or cannot be reached; one that accepts connections but does not
    answer (a loaded or cold-starting server) gets ``SLOW_PROBE_FACTOR`` (5) times more before
    the open fails, saying so.
    ``save_deadline_s``: every save (``save``, ``save_async``, a collective save on each rank,
    a two-tier store's replication of each step) commits or raises `SaveDeadlineError` within
    this many seconds of its first storage request, naming the rank and the stalled file; a
    stalled upload is discarded, never completed (docs/reliability.md "Bounded saves").
    ``storage_options`` go to the fsspec implementation (e.g. ``endpoint_url``, ``key``,
    ``secret`` for S3; ``token`` for GCS; ``connection_string`` for Azure), except
    ``full_object_checksums`` (S3; default True): multi-part uploads ask the store to keep a
    full-object CRC32 for ``verify(remote=True)``; ``False`` for an S3-compatible server that
    refuses those requests."""
    storage: Storage = FsspecStorage(url, probe=probe, probe_timeout=probe_timeout,
                                     **storage_options)
    if retries > 0:
        storage = RetryingStorage(storage, attempts=retries + 1)
    return CheckpointStore(storage, algorithm=algorithm, durable=durable, threads=threads,
                           incremental=incremental, lease_s=lease_s,
                           metadata_layout=metadata_layout, divergent_keys=divergent_keys,
                           layout=layout, save_deadline_s=save_deadline_s)
