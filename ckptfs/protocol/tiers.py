"""Two tiers: save at local-disk speed, replicate to a remote store in the background, resume
from whichever tier holds the newest good checkpoint (docs/tiers.md).

`tiered` opens a `TieredStore`, a `CheckpointStore`
whose own storage is the local tier: ``save`` commits there and returns; the step is then
queued for the `Replicator`, which copies it to the remote
tier with ``ckptfs cp``'s copy (one commit object, every byte verified, marker last).

Design decisions (argued in docs/tiers.md):

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
from typing import Any, Literal, TypeVar, overload

from ckptfs.errors import (
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    LoadOptionError,
    ReplicationError,
    ShardedSaveError,
    StorageAccessError,
    StorageError,
    StorageNotFoundError,
    UnreplicatedCheckpointError,
    UnsafeCheckpointError,
)
from ckptfs.format.content import same_content
from ckptfs.format.hashing import DEFAULT_ALGORITHM
from ckptfs.format.incremental import DEFAULT_LEASE_S
from ckptfs.format.layout import StepPaths, check_step
from ckptfs.format.versions import is_sharded
from ckptfs.protocol import async_save
from ckptfs.protocol.collective import wants_sharded_save, world_size
from ckptfs.protocol.formats import VerifyReport
from ckptfs.protocol.listing import list_attempt, problems
from ckptfs.protocol.load_options import KeyPath, MapLocation, parse_keys, tensor_map
from ckptfs.protocol.remote_verify import RemoteVerifyReport
from ckptfs.protocol.replication import ReplicationStatus, Replicator
from ckptfs.protocol.resolve import (
    CheckpointInfo,
    committed_steps,
    list_step_dirs,
    read_committed,
    use_step,
)
from ckptfs.protocol.resolve import Tier as ReadTier
from ckptfs.protocol.resolve import tier_of as resolve_tier
from ckptfs.protocol.store import CheckpointStore
from ckptfs.protocol.store import open as open_store
from ckptfs.storage.base import check_tier_roots

log = logging.getLogger("ckptfs")

#: How long opening a two-tier store waits for the remote tier's listing: past it, every local
#: checkpoint is queued (the copy recognizes what the remote already holds), so a remote that is
#: down at open delays the job by at most this.
SCAN_TIMEOUT_S = 10.0
#: How long a collective manager restore on a sharded two-tier store waits for the steps its
#: local tiers hold to reach the remote tier, whose copy it reads
#: (`TieredStore.restore_source`).
RESTORE_WAIT_S = 300.0

T = TypeVar("T")
Tier = tuple[str, CheckpointStore]


def check_tiers(local: CheckpointStore, remote: CheckpointStore) -> None:
    """Refuse two tiers that are the same run root or nested (`TierOverlapError`)."""
    check_tier_roots(local.storage, remote.storage)


class TieredStore(CheckpointStore):
    """A store with a local tier (its own ``storage``) and a remote tier replicated in the
    background (module docstring; docs/tiers.md).  Opened on every rank of a process group
    (each rank with its own node's local tier), it saves, replicates and loads sharded
    checkpoints (docs/tiers.md "Sharded")."""

    def __init__(self, local: CheckpointStore, remote: CheckpointStore, *,
                 delete_unreplicated: bool = False, replicate_threads: int = 2,
                 bytes_per_s: float | None = None, retry_base_s: float = 1.0,
                 retry_max_s: float = 60.0, max_attempts: int | None = None,
                 sharded: bool | None = None,
                 replicate_timeout: timedelta | None = None) -> None:
        super().__init__(local.storage, algorithm=local.algorithm, durable=local.durable,
                         threads=local.threads, shard_bytes=local.shard_bytes,
                         incremental=local.incremental, lease_s=local.lease_s)
        check_tiers(local, remote)
        #: Plain one-tier stores of each tier (the local one shares this store's storage).
        self.local = local
        self.remote = remote
        #: Allow deleting (and retention to delete) a local checkpoint that has not reached
        #: the remote tier: for a local disk about to fill up (docs/tiers.md).
        self.delete_unreplicated = delete_unreplicated
        #: Opened on every rank of a process group (each with its own node's local tier):
        #: sharded saves, per-rank replication, loads across tiers (docs/tiers.md "Sharded").
        self.sharded = world_size() > 1 if sharded is None else sharded
        self.node_local = self.sharded
        self._copier: Any = None
        if self.sharded:
            from ckptfs.protocol import replication_sharded as rs  # torch.distributed: only here
            self._copier = rs.ShardedCopier(
                local.storage, remote.storage,
                rs.replication_group(replicate_timeout or rs.REPLICATE_TIMEOUT),
                durable=remote.durable, threads=replicate_threads)
        self.replicator = Replicator(local.storage, remote.storage, durable=remote.durable,
                                     threads=replicate_threads, bytes_per_s=bytes_per_s,
                                     retry_base_s=retry_base_s, retry_max_s=retry_max_s,
                                     max_attempts=max_attempts, copier=self._copier)
        try:
            self._scan()
        except BaseException:  # refused at open (credentials): stop what was started
            self.replicator.close()
            raise

    def _tiers(self) -> list[Tier]:
        return [("local", self.local), ("remote", self.remote)]

    def _scan(self) -> None:
        """Queue every step committed locally but not at the remote (oldest first).  Sharded:
        the coordinator's scan (its node holds the markers), broadcast to every rank, so every
        rank's replicator processes the same steps in the same order."""
        if self._copier is None:
            found = self._scan_tiers()
        else:  # the coordinator's refusal (credentials) is every rank's, never a rank left waiting
            scan: Any = None
            if self._copier.coordinator:
                try:
                    scan = self._scan_tiers()
                except StorageAccessError as exc:
                    scan = str(exc)
            scan = self._copier.broadcast_scan(scan)
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
                     self.url, len(queued), self.remote.url, queued)

    def _scan_tiers(self) -> list[tuple[int, int, bool]]:
        """(step, bytes, replicated) of every step committed locally.  Replicated means the
        remote's committed step has the local copy's content: a marker alone does not say so
        (another run, or this run before a rollback, may have committed that step there with
        other content), and the local copy would then count as replicated and retention could
        delete its only copy.  Else the step is queued, and the copy decides (``identical``,
        or ``failed`` with CheckpointExistsError, kept locally)."""
        try:
            local = committed_steps(self.storage)
        except StorageError as exc:
            log.warning("local tier %s cannot be listed (%s): nothing to replicate", self.url,
                        exc)
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
                info: CheckpointInfo | None = read_committed(self.storage, step)
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

    # -- writing ---------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *,
             metadata: Mapping[str, Any] | None = None,
             process_group: Any = None) -> CheckpointInfo:
        """Commit ``step`` on the local tier and return; it is replicated in the background
        (`replication`, `wait_replicated`)."""
        with self.replicator.foreground():  # copying pauses while this save writes
            if wants_sharded_save(state, process_group) and self._node_sharded(process_group):
                info = self._save_sharded(step, state, metadata, process_group)
            else:  # the plain store's save: collective or not, as the group says
                info = super().save(step, state, metadata=metadata,
                                    process_group=process_group)
        self.replicator.enqueue(info.step, info.bytes)
        return info

    def _save_sharded(self, step: int, state: Mapping[str, Any],
                      metadata: Mapping[str, Any] | None, process_group: Any) -> CheckpointInfo:
        """Every rank writes its file on its own node's local tier; the coordinator commits
        there (docs/tiers.md "Sharded")."""
        async_save.before_sync_save(self)
        from ckptfs.protocol import sharded
        info = sharded.save_sharded(self.storage, step, state, algorithm=self.algorithm,
                                    durable=self.durable, threads=self.threads,
                                    metadata=metadata, memory=self.reuse, lease_s=self.lease_s,
                                    node_local=True)
        self.after_sharded_commit(info)
        return info

    def _node_sharded(self, process_group: Any) -> bool:
        """Whether a collective save takes the per-node path (each rank's file on its own
        node's local tier, replicated per rank): on a store opened sharded (by default: a
        world of more than one rank).  A world of one saves collectively as a plain store
        does, onto the local tier, and replicates like any other step.  Refused
        (`ShardedSaveError`): another ``process_group`` on a sharded store, and a collective
        save of several ranks on a store opened with ``sharded=False``."""
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

    def after_sharded_commit(self, info: CheckpointInfo) -> None:
        """Each rank's files of a committed sharded save get their committed path on its own
        node (the coordinator's commit renamed only its node's attempt)."""
        if self.sharded:
            from ckptfs.protocol.replication_sharded import settle_node_attempt
            settle_node_attempt(self.storage, info.step, info.attempt, durable=self.durable)

    def save_async(self, step: int, state: Mapping[str, Any], *,
                   metadata: Mapping[str, Any] | None = None,
                   max_in_flight: int = 1) -> async_save.SaveFuture:
        """`CheckpointStore.save_async`; the step is queued for replication once it
        committed locally.  A sharded state (on every rank of a store opened on every rank):
        the collective async save of a plain store (format v2), each rank writing its file on
        its own node, then settled there."""
        if wants_sharded_save(state, None):
            self._node_sharded(None)  # refuses what a synchronous save refuses
        self.replicator.hold()  # copying pauses until this save's local write is done
        try:
            future = super().save_async(step, state, metadata=metadata,
                                        max_in_flight=max_in_flight)
        except BaseException:
            self.replicator.release()
            raise
        future.add_done_callback(self._committed_async)
        return future

    def _committed_async(self, future: Future[CheckpointInfo]) -> None:
        self.replicator.release()
        if future.cancelled() or future.exception() is not None:
            return
        info = future.result()
        self.replicator.enqueue(info.step, info.bytes)

    def delete(self, step: int) -> None:
        """Delete the local copy of ``step`` (the remote tier is left alone: use
        ``store.remote.delete``).  Refused with
        `UnreplicatedCheckpointError` while the step has not reached the
        remote tier, unless the store allows it (``delete_unreplicated``)."""
        check_step(step)
        if not self.delete_unreplicated and step in self.replicator.unreplicated():
            state = self.replicator.status().steps[step]
            raise UnreplicatedCheckpointError(
                f"step {step} at {self.url} is not replicated to {self.remote.url} yet "
                f"({state.state}{': ' + state.error if state.error else ''}): deleting it "
                "would lose its only copy. Wait for store.wait_replicated(), or open the store "
                "with delete_unreplicated=True to allow it")
        super().delete(step)
        self.replicator.forget(step)

    def retention_holds(self) -> frozenset[int]:
        """Steps retention must keep: those not replicated yet (unless allowed)."""
        if self.delete_unreplicated:
            return frozenset()
        return frozenset(self.replicator.unreplicated())

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

    def close(self) -> None:
        """Wait for pending async saves, then stop the replicator after its current copy
        attempt; what is not replicated yet is queued again by the next open (an interrupted
        remote attempt is never committed; gc removes it)."""
        try:
            super().close()
        finally:
            self.replicator.close()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self.replicator.close()

    # -- reading across tiers --------------------------------------------------------------------

    def tier_steps(self) -> dict[str, list[int]]:
        """The committed steps of each tier (``steps()`` is their union)."""
        return {name: committed_steps(st.storage) for name, st in self._tiers()}

    def steps(self) -> list[int]:
        """The steps committed in either tier, ascending: the steps `latest` and `load`
        choose from (one only the remote holds, after the local copy was lost or pruned,
        included).  A tier that cannot be listed (the remote is down) is left out, logged, as
        the walk leaves it out; if neither can be, the local tier's error is raised.
        ``store.local.steps()`` is the local tier's (what local retention prunes);
        `tier_steps` lists each tier's."""
        found: set[int] = set()
        errors: list[StorageError] = []
        for name, st in self._tiers():
            try:
                found.update(committed_steps(st.storage))
            except StorageError as exc:
                log.warning("the %s tier %s cannot be listed (%s): steps() lists the other "
                            "tier only", name, st.url, exc)
                errors.append(exc)
        if len(errors) == 2:
            raise errors[0]
        return sorted(found)

    def read_tiers(self) -> list[ReadTier]:
        """``[("local", local storage), ("remote", remote storage)]``: every read
        (``latest``, ``load``, ``verify``, the manager's restore through `walk`)
        resolves across both, the local copy first."""
        return [(name, st.storage) for name, st in self._tiers()]

    def tier_of(self, info: CheckpointInfo) -> str:
        """``"local"`` or ``"remote"``: the tier ``info`` was read from."""
        return resolve_tier(self.read_tiers(), info)[0]

    def _store_of(self, info: CheckpointInfo) -> CheckpointStore:
        return self.local if self.tier_of(info) == "local" else self.remote

    def use_step(self, step: int, use: Callable[[CheckpointInfo], T]
                 ) -> tuple[CheckpointInfo, T]:
        """``use`` on the first copy of ``step`` that passes it, the local one first (the
        remote one when the local one is missing or fails, logged); a step bad in both tiers
        raises naming each tier's error."""
        check_step(step)
        return use_step(self.read_tiers(), step, use)

    # latest(): CheckpointStore.latest, through walk() over read_tiers(): the newest step
    # committed in either tier, the local copy when it passes; ``tier_of(info)`` says which.

    def info(self, step: int) -> CheckpointInfo:
        return self.use_step(step, lambda info: info)[0]

    def load(self, step: int | None = None, *, map_location: MapLocation = None,
             verify: bool = True, allow_rollback: bool = False,
             into: dict[str, Any] | None = None, process_group: Any = None,
             keys: Iterable[str | KeyPath] | None = None, mmap: bool = False
             ) -> dict[Any, Any]:
        """`CheckpointStore.load` across tiers: the newest step in either tier (or
        ``step``), from the local copy when it loads and verifies, else from the remote copy
        (logged).  A step bad in both tiers raises (``allow_rollback``: the next older)."""
        if into is not None or process_group is not None:
            return self._load_sharded(step, into, process_group, verify=verify,
                                      allow_rollback=allow_rollback, keys=keys, mmap=mmap)
        tensor_map(map_location)
        paths = parse_keys(keys)

        def use(info: CheckpointInfo) -> dict[Any, Any]:
            return self.load_info(info, verify=verify, map_location=map_location, keys=paths,
                                  mmap=mmap)

        if step is not None:
            return self.use_step(step, use)[1]
        tried: list[str] = []
        found = self.walk(use, allow_rollback=allow_rollback, skipped=tried)
        if found is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint to load at {self.url} or {self.remote.url}"
                + (f" (skipped corrupt: {'; '.join(tried)})" if tried else ""))
        return found[1]

    def _load_sharded(self, step: int | None, into: dict[str, Any] | None, process_group: Any,
                      *, verify: bool, allow_rollback: bool, keys: Any, mmap: bool
                      ) -> dict[Any, Any]:
        """``load(into=...)`` on every rank: the newest step in either tier, the local copy
        (spread over the nodes) when it serves, else the remote copy, the same decision on
        every rank (docs/tiers.md "Sharded")."""
        if into is None or keys is not None or mmap or process_group is not None:
            raise LoadOptionError(
                "a tiered store loads a sharded checkpoint with load(into=state) on every rank "
                "of the default process group (no process_group=, keys or mmap)")
        if not self.sharded:  # a world of one: the one walk, each copy loaded into ``into``
            from ckptfs.protocol import sharded

            def use(info: CheckpointInfo) -> dict[str, Any]:
                return sharded.load_into(self._store_of(info).storage, info.step, into,
                                         verify=verify, threads=self.threads)

            if step is not None:
                return self.use_step(step, use)[1]
            found = self.walk(use, allow_rollback=allow_rollback)
            if found is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint to load at {self.url} or {self.remote.url}")
            return found[1]
        from ckptfs.protocol.tiers_sharded import load_across_tiers
        return load_across_tiers(self.storage, self.remote.storage, step, into, verify=verify,
                                 threads=self.threads, allow_rollback=allow_rollback,
                                 durable=self.durable)

    def load_info(self, info: CheckpointInfo, *, verify: bool = True,
                  map_location: MapLocation = None,
                  keys: Iterable[str | KeyPath] | None = None, mmap: bool = False
                  ) -> dict[Any, Any]:
        """Load exactly ``info``, from the tier it was read from."""
        return self._store_of(info).load_info(info, verify=verify, map_location=map_location,
                                              keys=keys, mmap=mmap)

    @overload
    def verify(self, step: int | None = None, *, quick: bool = False,
               remote: Literal[False] = False) -> VerifyReport: ...

    @overload
    def verify(self, step: int | None = None, *, quick: bool = False,
               remote: Literal[True]) -> RemoteVerifyReport: ...

    def verify(self, step: int | None = None, *, quick: bool = False,
               remote: bool = False) -> VerifyReport | RemoteVerifyReport:
        """Verify the copy a load would use: the local one if it verifies, else the remote
        one (logged); raises if no tier holds a good copy.  ``store.local.verify`` /
        ``store.remote.verify`` check one tier.  ``remote``: the remote tier's copy from the
        object store's checksums alone (``CheckpointStore.verify(remote=True)``)."""
        if remote:
            return self.remote.verify(step, remote=True)

        def use(info: CheckpointInfo) -> VerifyReport:
            if quick and self.node_local and self.tier_of(info) == "local":
                return self._verify_node_copy(info)
            return self._store_of(info).verify(info.step, quick=quick)

        if step is not None:
            return self.use_step(step, use)[1]
        found = self.walk(use, allow_rollback=False)
        if found is None:
            raise CheckpointNotFoundError(f"no committed checkpoint at {self.url} or "
                                          f"{self.remote.url}")
        return found[1]

    def _verify_node_copy(self, info: CheckpointInfo) -> VerifyReport:
        """The quick verify of a sharded step's local copy on node-local storage: the listing
        checks (links, missing, resized) of the files this node holds, its rank files (and on
        the coordinator's node ``dcp.msgpack``, besides the marker and manifest the read
        checked); the other nodes' files are not visible from here.  This is what retention
        asks of the newest step before it deletes older local copies (their remote copies
        stay the fallbacks)."""
        if not is_sharded(info.manifest) or self._copier is None:
            return self.local.verify(info.step, quick=True)
        from ckptfs.protocol.replication_sharded import own_files
        mine = own_files(info.manifest, self._copier.rank, self._copier.coordinator)
        found = problems(info, list_attempt(self.storage, info), files=mine)
        report = VerifyReport(info.step, info.attempt, info.url, "quick")
        report.problems = [p.text for p in found]
        report.unsafe = [p.text for p in found if p.kind == "link"]
        report.files = len(mine)
        report.bytes = sum(e.size for e in mine)
        if found:
            cls = UnsafeCheckpointError if report.unsafe else CorruptCheckpointError
            raise cls(f"step {info.step} at {info.url} fails quick verification on this node: "
                      + "; ".join(report.problems), step=info.step, path=info.path)
        return report

    def restore_source(self) -> CheckpointStore:
        """A sharded two-tier store's nodes each hold only their own files, so a collective
        manager restore walks the remote tier, the one complete copy, after waiting (at most
        `RESTORE_WAIT_S`) for the local steps to get there (a job restarted on its nodes
        replicates at open what its last run left); the model and optimizer still load through
        this store, each node's own files first.  A step that cannot reach the remote (its
        files lost with a node, or the remote down) is not a candidate: logged."""
        if not self.node_local:
            return self
        try:
            self.wait_replicated(timeout=RESTORE_WAIT_S)
        except (ReplicationError, TimeoutError) as exc:
            log.warning("restore at %s: the local steps did not all reach %s (%s); the restore "
                        "resumes from the newest step the remote tier holds", self.url,
                        self.remote.url, exc)
        return self.remote

    def after_prune(self, deleted: Iterable[int]) -> None:
        """On a node-local sharded store, a rank other than the coordinator removes its node's
        files of the steps the coordinator's prune deleted (the coordinator deleted its own,
        marker first); a step committed on this node is left alone."""
        if not self.node_local or self._copier is None or self._copier.coordinator:
            return
        listed = list_step_dirs(self.storage)
        for step in deleted:
            for name in listed.get(step, []):
                paths = StepPaths(step, name)
                if self.storage.exists(paths.marker):
                    continue
                try:
                    self.storage.delete_tree(paths.dir)
                except StorageError as exc:
                    log.warning("prune: could not remove this node's files of step %d at %s: "
                                "%s", step, self.url, exc)

    def __repr__(self) -> str:
        return f"TieredStore({self.url!r}, remote={self.remote.url!r})"


def tiered(local: str | CheckpointStore, remote: str | CheckpointStore, *,
           algorithm: str = DEFAULT_ALGORITHM, durable: bool = True,
           threads: int | None = None, retries: int = 3, incremental: bool = False,
           lease_s: float = DEFAULT_LEASE_S, local_options: Mapping[str, Any] | None = None,
           remote_options: Mapping[str, Any] | None = None,
           delete_unreplicated: bool = False, replicate_threads: int = 2,
           bytes_per_s: float | None = None, retry_base_s: float = 1.0,
           retry_max_s: float = 60.0, max_attempts: int | None = None,
           sharded: bool | None = None,
           replicate_timeout: timedelta | None = None) -> TieredStore:
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
    30 min: a dead or hung rank, docs/tiers.md "Sharded")."""
    def opened(t: str | CheckpointStore, options: Mapping[str, Any] | None) -> CheckpointStore:
        if isinstance(t, CheckpointStore):
            return t
        return open_store(t, algorithm=algorithm, durable=durable, threads=threads,
                          retries=retries, incremental=incremental, lease_s=lease_s,
                          **dict(options or {}))

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
