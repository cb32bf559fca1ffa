"""Two tiers: save at local-disk speed, replicate to a remote store in the background, resume
from whichever tier holds the newest good checkpoint (docs/tiers.md).

`tiered` opens a `TieredStore`, a `CheckpointStore` over two tiers (`TwoTiers`) whose own
storage is the local tier: ``save`` commits there and returns; the step is then queued for the
`Replicator`, which copies it to the remote tier with ``ckptfs cp``'s copy (one commit object,
every byte verified, marker last).

Design decisions (argued in docs/tiers.md):

* **Tiers by composition.**  A store is a store over its tiers
  (`ckptfs.protocol.store.Tiers`): a plain store's are its own storage (``OneTier``), a
  two-tier store's are `TwoTiers`: the two tier stores (``local``, ``remote``) and the
  `Replicator`.  Every operation (``save``/``save_async``, ``delete``, the reads across
  ``read_tiers``, ``close``) is `CheckpointStore`'s one method, which asks the tiers where
  the two cases differ: whether a save writes each rank's files on its own node
  (``node_save``) and what follows its commit (``committed``: the node's files settled, the
  step queued; the async future, ``future``), whether a step may be deleted
  (``check_delete``) and that it was (``deleted``), what a collective read waits for
  (``before_collective_read``), how a copy is verified (``verify_copy``: the node's part of
  a node-spread local copy) and a sharded state loaded (``load_into``).  `TieredStore` only
  opens the store over two tiers and adds the replication accessors (``replication``,
  ``wait_replicated``, ``tier_steps``, ``tier_of``): it overrides no store method, so
  ``isinstance(store, ckptfs.CheckpointStore)`` holds and every call a user, the manager or
  an integration makes on a store works on it.  What the layers above ask are the tiers'
  answers, through the store: `CheckpointStore.holds` (the steps retention keeps: not
  replicated yet), ``node_local`` (each rank's local tier is its own node's) and
  ``read_tiers(collective=True)`` (the tiers every rank reads a complete copy from).
* **One walk.**  Every read is a use of the store's one walk
  (`ckptfs.protocol.resolve.walk_tiers` over `read_tiers`), ``load(into=)`` included: on
  every rank of a sharded store the walk runs over the group (its coordinator lists both
  tiers and decides, every rank loads each candidate), and the node-spread local copy is
  that walk's ``use`` for a local candidate (`ckptfs.protocol.node_copy`).  The remote copy
  of a step stands in for a failing local copy only if it is the same checkpoint (logged,
  with the reason): never another run's step of that number.

* A constructor of its own, not ``ckptfs.open(..., replicate_to=)``: each tier has its own
  storage options (credentials and endpoint of the object store, none for local disk), retries
  and durability, which one ``**storage_options`` cannot say; and ``open`` stays the one-tier
  function the layers below use.
* Retention and deletes (``delete``, what `CheckpointManager` prunes) act on the local
  tier; ``store.local``/``store.remote`` are plain stores of each tier for anything done in one.
  ``steps``/``latest``/``info``/``load``/``verify`` read across both (``steps``: the union of
  the tiers' committed steps, the steps ``latest`` and ``load`` choose from).
* A local checkpoint not yet replicated is never deleted (``delete`` raises
  `UnreplicatedCheckpointError`, retention keeps it) unless the store was
  opened with ``delete_unreplicated=True``.
* Opening scans both tiers: every step committed locally and not at the remote is queued
  (oldest first), so a process killed mid-replication resumes on its next open.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from datetime import timedelta
from typing import Any

from ckptfs.errors import (
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    LoadOptionError,
    ReplicationError,
    ShardedLoadError,
    ShardedSaveError,
    StorageAccessError,
    StorageError,
    StorageNotFoundError,
    UnreplicatedCheckpointError,
)
from ckptfs.format.content import same_content
from ckptfs.format.hashing import DEFAULT_ALGORITHM
from ckptfs.format.incremental import DEFAULT_LEASE_S
from ckptfs.format.layout import check_step
from ckptfs.format.versions import is_sharded
from ckptfs.protocol import async_save
from ckptfs.protocol.collective import wants_sharded_save, world_size
from ckptfs.protocol.formats import VerifyReport, verified
from ckptfs.protocol.group import Group, RankGroup
from ckptfs.protocol.load_options import KeyPath
from ckptfs.protocol.replication import ReplicationStatus, Replicator
from ckptfs.protocol.resolve import (
    CheckpointInfo,
    committed_steps,
    read_committed,
    use_step,
    walk_tiers,
)
from ckptfs.protocol.resolve import Tier as ReadTier
from ckptfs.protocol.resolve import tier_of as resolve_tier
from ckptfs.protocol.store import CheckpointStore, Tiers
from ckptfs.protocol.store import open as open_store
from ckptfs.storage.base import Storage, check_tier_roots
from ckptfs.torch_versions import sharded_supported

log = logging.getLogger("ckptfs")

#: How long opening a two-tier store waits for the remote tier's listing: past it, every local
#: checkpoint is queued (the copy recognizes what the remote already holds), so a remote that is
#: down at open delays the job by at most this.
SCAN_TIMEOUT_S = 10.0
#: How long a collective read on a sharded two-tier store (a manager's restore) waits for the
#: steps its local tiers hold to reach the remote tier, whose copy it reads
#: (``walk(collective=True)``).
RESTORE_WAIT_S = 300.0

def check_tiers(local: CheckpointStore, remote: CheckpointStore) -> None:
    """Refuse two tiers that are the same run root or nested (`TierOverlapError`)."""
    check_tier_roots(local.storage, remote.storage)


class TwoTiers(Tiers):
    """The tiers of a two-tier store (module docstring; docs/tiers.md): ``local`` (the
    store's own storage) and ``remote``, with the `Replicator` between them.  Opened on
    every rank of a process group (each rank with its own node's local tier), it saves,
    replicates and loads sharded checkpoints (docs/tiers.md "Sharded")."""

    def __init__(self, local: CheckpointStore, remote: CheckpointStore, *,
                 delete_unreplicated: bool = False, replicate_threads: int = 2,
                 bytes_per_s: float | None = None, retry_base_s: float = 1.0,
                 retry_max_s: float = 60.0, max_attempts: int | None = None,
                 sharded: bool | None = None,
                 replicate_timeout: timedelta | None = None) -> None:
        check_tiers(local, remote)
        #: Plain one-tier stores of each tier (the local one shares the store's storage).
        self.local = local
        self.remote = remote
        #: Allow deleting (and retention to delete) a local checkpoint that has not reached
        #: the remote tier: for a local disk about to fill up (docs/tiers.md).
        self.delete_unreplicated = delete_unreplicated
        #: Opened on every rank of a process group (each with its own node's local tier):
        #: sharded saves, per-rank replication, loads across tiers (docs/tiers.md "Sharded").
        self.sharded = world_size() > 1 if sharded is None else sharded
        self.node_local = self.sharded
        self.copier: Any = None
        if self.sharded:
            from ckptfs.protocol.copy import StepCopier
            from ckptfs.protocol.replication import REPLICATE_TIMEOUT, replication_group
            self.copier = StepCopier(
                local.storage, remote.storage,
                replication_group(replicate_timeout or REPLICATE_TIMEOUT),
                durable=remote.durable, threads=replicate_threads,
                deadline_s=local.save_deadline_s)
        self.replicator = Replicator(local.storage, remote.storage, durable=remote.durable,
                                     threads=replicate_threads, bytes_per_s=bytes_per_s,
                                     retry_base_s=retry_base_s, retry_max_s=retry_max_s,
                                     max_attempts=max_attempts, copier=self.copier,
                                     deadline_s=local.save_deadline_s)
        try:
            self._scan()
        except BaseException:  # refused at open (credentials): stop what was started
            self.replicator.close()
            raise

    # -- opening: what is left to replicate ------------------------------------------------------

    def _scan(self) -> None:
        """Queue every step committed locally but not at the remote (oldest first).  Sharded:
        the coordinator's scan (its node holds the markers), broadcast to every rank, so every
        rank's replicator processes the same steps in the same order."""
        if self.copier is None:
            found = self._scan_tiers()
        else:  # the coordinator's refusal (credentials) is every rank's, never a rank left waiting
            scan: Any = None
            if self.copier.coordinator:
                try:
                    scan = self._scan_tiers()
                except StorageAccessError as exc:
                    scan = str(exc)
            scan = self.copier.broadcast_scan(scan)
            if isinstance(scan, str):
                raise StorageAccessError(scan)
            found = scan
        queued = []
        for step, nbytes, replicated in found:
            if replicated:
                self.replicator.mark_replicated(step, nbytes)
            else:
                queued.append(step)
                self.replicator.enqueue(step, nbytes)
        if queued:
            log.info("%s: %d local checkpoints not at %s yet, queued for replication: %s",
                     self.local.url, len(queued), self.remote.url, queued)

    def _scan_tiers(self) -> list[tuple[int, int, bool]]:
        """(step, bytes, replicated) of every step committed locally.  Replicated means the
        remote's committed step has the local copy's content: a marker alone does not say so
        (another run, or this run before a rollback, may have committed that step there with
        other content), and the local copy would then count as replicated and retention could
        delete its only copy.  Else the step is queued, and the copy decides (``identical``,
        or ``failed`` with CheckpointExistsError, kept locally)."""
        try:
            local = committed_steps(self.local.storage)
        except StorageError as exc:
            log.warning("local tier %s cannot be listed (%s): nothing to replicate",
                        self.local.url, exc)
            return []
        try:
            remote = self._remote_steps()
        except StorageAccessError:
            raise  # missing or refused credentials: the configuration, not an outage
        except StorageError as exc:
            log.warning("remote tier %s cannot be listed (%s): every local checkpoint is queued "
                        "(one the remote already holds is recognized by the copy)",
                        self.remote.url, exc)
            remote = set()
        found = []
        for step in local:
            try:
                info: CheckpointInfo | None = read_committed(self.local.storage, step)
            except (CheckpointNotFoundError, CorruptCheckpointError, StorageError):
                info = None  # the copy reports what is wrong with it
            nbytes = 0 if info is None else info.bytes
            found.append((step, nbytes, step in remote and info is not None
                          and self._same_at_remote(info)))
        return found

    def _remote_steps(self) -> set[int]:
        """The remote's committed steps, or `StorageError` if its listing takes longer
        than `SCAN_TIMEOUT_S` (a remote that is down answers after its retries, tens of
        seconds: the open does not wait for them; the listing is abandoned)."""
        listing: Future[list[int]] = Future()

        def run() -> None:
            try:
                listing.set_result(committed_steps(self.remote.storage))
            except BaseException as exc:  # handed to the opener
                listing.set_exception(exc)

        threading.Thread(target=run, name="ckptfs-tier-scan", daemon=True).start()
        try:
            return set(listing.result(timeout=SCAN_TIMEOUT_S))
        except FutureTimeoutError:
            raise StorageError(f"{self.remote.url}: no listing in {SCAN_TIMEOUT_S:.0f} s") \
                from None

    def _same_at_remote(self, info: CheckpointInfo) -> bool:
        """Whether the remote's committed ``info.step`` has the local copy's content."""
        try:
            return same_content(read_committed(self.remote.storage, info.step).manifest,
                                info.manifest)
        except CkptfsError:
            return False

    # -- reading across tiers --------------------------------------------------------------------

    def read_tiers(self, *, collective: bool = False) -> list[ReadTier]:
        """``[("local", local storage), ("remote", remote storage)]``: every read
        (``latest``, ``load``, ``verify``, the manager's restore through ``walk``)
        resolves across both, the local copy first.  ``collective`` on tiers whose local
        one is each node's own (``node_local``): the remote tier alone, the one copy every
        rank can read whole."""
        if collective and self.node_local:
            return [("remote", self.remote.storage)]
        return [("local", self.local.storage), ("remote", self.remote.storage)]

    def tier_of(self, info: CheckpointInfo) -> ReadTier:
        return resolve_tier(self.read_tiers(), info)

    def storage_of(self, info: CheckpointInfo) -> Storage:
        return self.tier_of(info)[1]

    def before_collective_read(self, store: CheckpointStore) -> None:
        """A collective read on node-local tiers first waits (at most `RESTORE_WAIT_S`)
        for the steps the local tiers hold to reach the remote tier it reads (a job restarted
        on its nodes replicates at open what its last run left); a step that cannot reach it
        (its files lost with a node, or the remote down) is not a candidate: logged."""
        if not self.node_local:
            return
        try:
            store.wait()  # pending save_async: committed locally and queued first
            self.replicator.wait(RESTORE_WAIT_S)
        except (ReplicationError, TimeoutError) as exc:
            log.warning("a collective read at %s: the local steps did not all reach %s (%s); "
                        "it resumes from the newest step the remote tier holds",
                        self.local.url, self.remote.url, exc)

    def check_load(self, *, into: dict[str, Any] | None, process_group: Any,
                   keys: Iterable[str | KeyPath] | None, mmap: bool) -> None:
        if process_group is not None or (into is not None and (keys is not None or mmap)):
            raise LoadOptionError(
                "a tiered store loads a sharded checkpoint with load(into=state) on every rank "
                "of the default process group (no process_group=, keys or mmap)")

    def load_into(self, step: int | None, into: dict[str, Any], process_group: Any, *,
                  verify: bool, allow_rollback: bool, threads: int) -> dict[Any, Any]:
        """``load(into=...)`` on every rank: the one walk over both tiers (on a sharded store,
        over the group: the same decision on every rank), each candidate loaded into
        ``into``; the local copy of node-local tiers is spread over the nodes
        (`ckptfs.protocol.node_copy`; docs/tiers.md "Sharded")."""
        group: Group | None
        use: Callable[[CheckpointInfo], dict[str, Any]]
        if not self.sharded and not sharded_supported():  # torch < 2.9: files layouts only
            from ckptfs.protocol.files_into import load_one_files_into

            def files(info: CheckpointInfo) -> dict[str, Any]:
                return load_one_files_into(self.storage_of(info), info, into, verify=verify,
                                           threads=threads)

            group, use = None, files
        else:
            group, use = self._sharded_load(into, verify=verify, threads=threads)

        tiers = self.read_tiers()
        if step is not None:
            check_step(step)
            return use_step(tiers, step, use, group=group)[1]
        found = walk_tiers(tiers, use, allow_rollback=allow_rollback, group=group)
        if found is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint to load at {self.local.url} or {self.remote.url}")
        return found[1]

    def _sharded_load(self, into: dict[str, Any], *, verify: bool, threads: int
                      ) -> tuple[Group | None, Callable[[CheckpointInfo], dict[str, Any]]]:
        """The group and the per-candidate load of `load_into` through the collective load's
        entry (torch >= 2.9), which reads either layout."""
        from ckptfs.protocol import sharded
        from ckptfs.protocol.sharded_read import ShardedReader
        group: Group | None = None
        if self.sharded:
            group = RankGroup(sharded.collective_group(
                None, what=f"a sharded load across tiers at {self.local.url}",
                default=ShardedLoadError))

        def use(info: CheckpointInfo) -> dict[str, Any]:
            if self.node_local and group is not None and is_sharded(info.manifest) and \
                    self.tier_of(info)[0] == "local":
                from ckptfs.protocol.node_copy import load_node_copy
                return load_node_copy(self.local.storage, self.remote.storage, info, into,
                                      group, verify=verify, threads=threads,
                                      durable=self.local.durable)
            storage = self.storage_of(info)
            reader = ShardedReader(storage, info.step, verify=verify, threads=threads)
            reader.info = info
            return sharded.load_into(storage, info.step, into, verify=verify,
                                     threads=threads, reader=reader)

        return group, use

    def verify_copy(self, info: CheckpointInfo, *, quick: bool, threads: int
                    ) -> VerifyReport:
        """The copy ``info`` names, from its tier; a quick verify of the local copy of a
        sharded step on sharded tiers checks this node's part of it (`verify_node_copy`)."""
        if quick and self.copier is not None and is_sharded(info.manifest) \
                and self.tier_of(info)[0] == "local":  # this node's part of the local copy
            from ckptfs.protocol.node_copy import verify_node_copy
            return verify_node_copy(self.local.storage, info, self.copier.rank,
                                    self.copier.coordinator)
        return verified(self.storage_of(info), info, quick=quick, threads=threads)

    # -- writing ---------------------------------------------------------------------------------

    def node_save(self, state: Mapping[str, Any], process_group: Any) -> bool:
        """Whether a collective save takes the per-node path (each rank's file on its own
        node's local tier, replicated per rank): on tiers opened sharded (by default: a
        world of more than one rank).  A world of one saves collectively as a plain store
        does, onto the local tier, and replicates like any other step.  Refused
        (`ShardedSaveError`): another ``process_group`` on a sharded store, and a collective
        save of several ranks on a store opened with ``sharded=False``."""
        if not wants_sharded_save(state, process_group):
            return False
        if self.sharded:
            if process_group is not None:
                raise ShardedSaveError(
                    "a sharded tiered store saves on the default process group only: save "
                    "without process_group=")
            return True
        if world_size() > 1:
            raise ShardedSaveError(
                f"this tiered store was opened with sharded=False in a world of "
                f"{world_size()} ranks: a collective save needs every rank's replicator (open "
                "it with ckptfs.tiered(local, remote) on every rank, each with its own node's "
                "local tier)")
        return False

    def hold(self) -> None:
        self.replicator.hold()  # copying pauses while a save writes (Replicator.foreground)

    def release(self) -> None:
        self.replicator.release()

    def committed(self, info: CheckpointInfo, node: bool) -> None:
        """A per-node save's files get their committed path on this node (the coordinator's
        commit renamed only its node's attempt); then the step is queued for replication."""
        if node:
            from ckptfs.protocol.copy import settle_node_attempt
            settle_node_attempt(self.local.storage, info.step, info.attempt,
                                durable=self.local.durable)
        self.replicator.enqueue(info.step, info.bytes)

    def future(self, inner: async_save.SaveFuture, node: bool) -> async_save.SaveFuture:
        """``inner``, or for a per-node save a future done once this node's files have their
        committed path too (`_Settled`)."""
        outer = _Settled(inner) if node else None
        inner.add_done_callback(lambda _: self._committed_async(inner, outer))
        return inner if outer is None else outer

    def _committed_async(self, future: async_save.SaveFuture, outer: _Settled | None) -> None:
        self.release()
        if future.cancelled():  # pragma: no cover - a save's future is never cancelled
            if outer is not None:
                outer.cancel()
            return
        failure = future.failure()  # not collected here: the store raises it until it is
        if failure is not None:
            if outer is not None:
                outer.set_exception(failure)
            return
        info = future.result()
        try:
            self.committed(info, outer is not None)
        except BaseException as exc:  # the step is committed: the settling failed
            if outer is None:
                raise
            outer.set_exception(exc)
            return
        if outer is not None:
            outer.set_result(info)

    def check_delete(self, step: int) -> None:
        """Refuse (`UnreplicatedCheckpointError`) a step that has not reached the remote
        tier, unless deleting it is allowed (``delete_unreplicated``)."""
        if step in self.holds:
            state = self.replicator.status().steps[step]
            raise UnreplicatedCheckpointError(
                f"step {step} at {self.local.url} is not replicated to {self.remote.url} yet "
                f"({state.state}{': ' + state.error if state.error else ''}): deleting it "
                "would lose its only copy. Wait for store.wait_replicated(), or open the store "
                "with delete_unreplicated=True to allow it")

    def deleted(self, step: int) -> None:
        self.replicator.forget(step)

    @property
    def holds(self) -> frozenset[int]:
        """The local steps that must not be deleted yet: those the replicator reports not
        replicated (none with ``delete_unreplicated``)."""
        if self.delete_unreplicated:
            return frozenset()
        return frozenset(self.replicator.unreplicated())

    def close(self) -> None:
        self.replicator.close()


class TieredStore(CheckpointStore):
    """A `CheckpointStore` over two tiers (`TwoTiers`): the local tier (its own
    ``storage``) and a remote tier replicated in the background (module docstring;
    docs/tiers.md).  It only opens the store over them and adds the replication accessors:
    every store method is `CheckpointStore`'s.  Opened on every rank of a process group
    (each rank with its own node's local tier), it saves, replicates and loads sharded
    checkpoints (docs/tiers.md "Sharded")."""

    tiers: TwoTiers

    def __init__(self, local: CheckpointStore, remote: CheckpointStore, *,
                 delete_unreplicated: bool = False, replicate_threads: int = 2,
                 bytes_per_s: float | None = None, retry_base_s: float = 1.0,
                 retry_max_s: float = 60.0, max_attempts: int | None = None,
                 sharded: bool | None = None,
                 replicate_timeout: timedelta | None = None) -> None:
        tiers = TwoTiers(local, remote, delete_unreplicated=delete_unreplicated,
                         replicate_threads=replicate_threads, bytes_per_s=bytes_per_s,
                         retry_base_s=retry_base_s, retry_max_s=retry_max_s,
                         max_attempts=max_attempts, sharded=sharded,
                         replicate_timeout=replicate_timeout)
        super().__init__(local.storage, algorithm=local.algorithm, durable=local.durable,
                         threads=local.threads, shard_bytes=local.shard_bytes,
                         incremental=local.incremental, lease_s=local.lease_s, tiers=tiers,
                         save_deadline_s=local.save_deadline_s,
                         metadata_layout=local.metadata_layout, layout=local.layout,
                         divergent_keys=local.divergent_keys)

    @property
    def local(self) -> CheckpointStore:
        """A plain one-tier store of the local tier (it shares this store's storage)."""
        return self.tiers.local

    @property
    def remote(self) -> CheckpointStore:
        """A plain one-tier store of the remote tier."""
        return self.tiers.remote

    @property
    def replicator(self) -> Replicator:
        return self.tiers.replicator

    @property
    def sharded(self) -> bool:
        """Opened on every rank of a process group (each with its own node's local tier):
        sharded saves, per-rank replication, loads across tiers (docs/tiers.md "Sharded")."""
        return self.tiers.sharded

    @property
    def delete_unreplicated(self) -> bool:
        """Allow deleting (and retention to delete) a local checkpoint that has not reached
        the remote tier: for a local disk about to fill up (docs/tiers.md)."""
        return self.tiers.delete_unreplicated

    @delete_unreplicated.setter
    def delete_unreplicated(self, allow: bool) -> None:
        self.tiers.delete_unreplicated = allow

    # -- replication -----------------------------------------------------------------------------

    def replication(self) -> ReplicationStatus:
        """Per step: ``local`` (queued), ``replicating``, ``replicated``, ``failed`` (with the
        error); the lag in steps and bytes; the current outage, if any."""
        return self.replicator.status()

    def wait_replicated(self, timeout: float | None = None) -> ReplicationStatus:
        """Wait until every checkpoint saved (or found unreplicated at open) is at the remote
        tier.  Raises `ReplicationError` if a step failed for good,
        `TimeoutError` (with the lag) after ``timeout`` seconds."""
        self.wait()  # pending save_async: committed locally and queued first
        return self.replicator.wait(timeout)

    # -- reading across tiers --------------------------------------------------------------------

    def tier_steps(self) -> dict[str, list[int]]:
        """The committed steps of each tier (``steps()`` is their union)."""
        return {name: committed_steps(st) for name, st in self.read_tiers()}

    def tier_of(self, info: CheckpointInfo) -> str:
        """``"local"`` or ``"remote"``: the tier ``info`` was read from."""
        return self.tiers.tier_of(info)[0]

    # latest(): CheckpointStore.latest, through walk() over read_tiers(): the newest step
    # committed in either tier, the local copy when it passes; ``tier_of(info)`` says which.

    def __repr__(self) -> str:
        return f"TieredStore({self.url!r}, remote={self.remote.url!r})"


class _Settled(async_save.SaveFuture):
    """The future of a sharded two-tier store's `save_async`: done once the save
    committed and this node's files have their committed path (``inner``: the save's own
    future).  Collecting its failure collects the save's, so the store does not raise it
    again."""

    def __init__(self, inner: async_save.SaveFuture) -> None:
        super().__init__(inner.step, inner.url)
        self.inner = inner

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        try:
            return super().result(timeout)
        finally:
            if self.collected:
                self.inner.collected = True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = super().exception(timeout)
        if exc is not None:
            self.inner.collected = True
        return exc


def tiered(local: str | CheckpointStore, remote: str | CheckpointStore, *,
           algorithm: str = DEFAULT_ALGORITHM, durable: bool = True,
           threads: int | None = None, retries: int = 3, incremental: bool = False,
           lease_s: float = DEFAULT_LEASE_S, local_options: Mapping[str, Any] | None = None,
           remote_options: Mapping[str, Any] | None = None,
           delete_unreplicated: bool = False, replicate_threads: int = 2,
           bytes_per_s: float | None = None, retry_base_s: float = 1.0,
           retry_max_s: float = 60.0, max_attempts: int | None = None,
           sharded: bool | None = None,
           replicate_timeout: timedelta | None = None,
           save_deadline_s: float | None = None) -> TieredStore:
    """Open a two-tier store: checkpoints commit on ``local`` (a URL, usually local disk, or
    an open store) and are replicated to ``remote`` in the background (docs/tiers.md).

    ``local_options`` / ``remote_options``: each tier's storage options (as
    `ckptfs.open`'s ``**storage_options``); the other keywords up to ``lease_s`` are
    `ckptfs.open`'s, for both tiers (ignored for a tier given as a store).
    ``delete_unreplicated``: let ``delete`` and retention remove a local checkpoint that has
    not reached the remote (default: never).  ``replicate_threads``: files copied at once
    (memory: about 8 MiB per thread plus the remote's write buffer); ``bytes_per_s``: a
    bandwidth bound for replication; ``retry_base_s``/``retry_max_s``: the capped exponential
    backoff between attempts after a storage error; ``max_attempts``: give a step up
    (``failed``) after that many (default: retry until the remote returns).  ``sharded``:
    whether the store is opened on every rank of a process group (default: torch.distributed
    is initialized with more than one rank); ``replicate_timeout``: how long a rank's
    replication waits for the other ranks before its replicator stops (sharded only; default
    30 min: a dead or hung rank, docs/tiers.md "Sharded").  ``save_deadline_s``: each local
    save, and each step's replication, commits or fails with `SaveDeadlineError` within this
    many seconds (docs/reliability.md "Bounded saves"; the local tier's own when it is given
    as a store)."""
    def opened(t: str | CheckpointStore, options: Mapping[str, Any] | None) -> CheckpointStore:
        if isinstance(t, CheckpointStore):
            return t
        return open_store(t, algorithm=algorithm, durable=durable, threads=threads,
                          retries=retries, incremental=incremental, lease_s=lease_s,
                          save_deadline_s=save_deadline_s, **dict(options or {}))

    def opened_remote(t: str | CheckpointStore) -> CheckpointStore:
        """The remote tier; one that does not answer at open (an outage, a restart during one)
        is opened without its reachability probe: the job saves locally and replication
        retries until it answers.  A missing bucket or refused credentials still raise: those
        are the configuration's, not an outage."""
        try:
            return opened(t, remote_options)
        except (StorageAccessError, StorageNotFoundError):
            raise
        except StorageError as exc:
            if isinstance(t, CheckpointStore) or (remote_options or {}).get("probe") is False:
                raise
            log.warning("the remote tier %s does not answer at open (%s): local saves go on "
                        "and replication retries until it answers", t, exc)
            return opened(t, {**(remote_options or {}), "probe": False})

    return TieredStore(opened(local, local_options), opened_remote(remote),
                       delete_unreplicated=delete_unreplicated,
                       replicate_threads=replicate_threads, bytes_per_s=bytes_per_s,
                       retry_base_s=retry_base_s, retry_max_s=retry_max_s,
                       max_attempts=max_attempts, sharded=sharded,
                       replicate_timeout=replicate_timeout)
