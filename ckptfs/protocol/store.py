"""The user-facing API: `open` a run root by URL, then save, load, list and verify."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar, overload

from ckptfs.errors import (
    CheckpointDeletedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LoadOptionError,
    UnsafeCheckpointError,
)
from ckptfs.format.hashing import DEFAULT_ALGORITHM, new_hasher
from ckptfs.format.incremental import DEFAULT_GRACE_S, DEFAULT_LEASE_S
from ckptfs.format.layout import StepPaths, check_step, step_dir_name
from ckptfs.format.serialize import DEFAULT_SHARD_BYTES
from ckptfs.protocol import async_save
from ckptfs.protocol.commit import default_threads
from ckptfs.protocol.formats import VerifyReport, load_checkpoint, verify_checkpoint
from ckptfs.protocol.incremental import ReuseMemory
from ckptfs.protocol.load_options import KeyPath, MapLocation, parse_keys, tensor_map
from ckptfs.protocol.prepare import prepare
from ckptfs.protocol.references import free_step, shared_attempts
from ckptfs.protocol.remote_verify import RemoteVerifyReport, verify_remote
from ckptfs.protocol.resolve import (
    MAX_RESOLVE_PASSES,
    CheckpointInfo,
    Tier,
    check_still_committed,
    committed_steps,
    existing_summary,
    list_step_dirs,
    read_committed,
    step_dirs,
    walk_tiers,
)
from ckptfs.storage.base import Capabilities, Storage
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.storage.retry import RetryingStorage

log = logging.getLogger("ckptfs")
T = TypeVar("T")


class CheckpointStore:
    """Checkpoints of one training run, under ``<root>/checkpoints/``.

    Thread-safe for concurrent readers; concurrent writers of the same step are resolved by the
    commit protocol (one wins, the others get `CheckpointExistsError`)."""

    def __init__(self, storage: Storage, *, algorithm: str = DEFAULT_ALGORITHM,
                 durable: bool = True, threads: int | None = None,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, incremental: bool = False,
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        new_hasher(algorithm)
        self.storage = storage
        #: Single-process saves write format v3, referencing bytes an earlier checkpoint
        #: holds instead of writing them again (docs/incremental.md); sharded saves write
        #: format v4, each rank referencing its own unchanged items (docs/protocol.md §9.6).
        self.incremental = incremental
        self.reuse: ReuseMemory | None = ReuseMemory() if incremental else None
        self.lease_s = lease_s
        self.algorithm = algorithm
        self.durable = durable
        self.threads = threads or default_threads()
        self.shard_bytes = shard_bytes
        #: An uncommitted attempt younger than this may be a save still running: a delete
        #: keeps what its manifest references (docs/protocol.md §9.5).  Exceeds the lease by
        #: the default margin for clock skew (1 h against the default 30 min lease).
        self.grace_s: float = max(DEFAULT_GRACE_S, lease_s + DEFAULT_GRACE_S - DEFAULT_LEASE_S)
        #: Each rank's ``storage`` is its own node's (a sharded two-tier store's local tier): a
        #: sharded save checks each rank's file on its own node, a collective read walks only
        #: the tiers every rank reads whole (``read_tiers(collective=True)``), and a
        #: collective manager's prune has every node remove its files of the steps it deleted
        #: (docs/tiers.md "Sharded").  False: every rank sees one storage.
        self.node_local = False
        caps = storage.capabilities
        if caps.exclusive_create == "none":
            log.warning("%s: %s", storage.url, caps.caveat or "no exclusive create on this "
                        "backend")

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def capabilities(self) -> Capabilities:
        return self.storage.capabilities

    # -- writing -------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *,
             metadata: Mapping[str, Any] | None = None,
             process_group: Any = None) -> CheckpointInfo:
        """Write ``state`` as the checkpoint of ``step`` and commit it.

        Returns the committed `CheckpointInfo`.  Raises
        `UnsupportedValueError` (before writing anything) for values the format
        cannot hold, `CheckpointExistsError` if the step is already committed
        (or another writer commits it first).  Pending `save_async` saves are waited for
        first (and an uncollected failure of one raises here)."""
        async_save.before_sync_save(self)
        return prepare(self, step, state, metadata=metadata,
                       process_group=process_group).write()  # the save save_async runs

    def delete(self, step: int) -> None:
        """Delete a checkpoint: the marker first, so a half-deleted checkpoint never reads as
        committed, then every attempt of the step.  Every directory of the step is deleted,
        by its listed name (a non-canonical ``step-0000000000020`` included).

        An incremental (format v3) attempt whose files another checkpoint references (a
        committed one, or a save younger than `grace_s`) is kept whole, without its
        marker (*retired*, logged); garbage collection removes it once nothing references it
        (docs/protocol.md §9.5).  If a committed checkpoint's manifest cannot be read, the
        step is still deleted (no marker) but its v3 attempts are all kept, with a warning
        naming the unreadable checkpoint."""
        check_step(step)
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

    # -- reading -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps (marker present), ascending by integer value."""
        return committed_steps(self.storage)

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
        check_step(step)
        try:
            return read_committed(self.storage, step)
        except CheckpointNotFoundError as exc:
            raise type(exc)(f"{exc}; {existing_summary(self.storage)}") from None

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
        ``mmap``: local disk only, tensors view memory-mapped files.  See docs/loading.md."""
        tensor_map(map_location)  # bad options fail before any I/O (LoadOptionError)
        paths = parse_keys(keys)  # malformed keys fail before any I/O
        if into is not None and (keys is not None or mmap):
            raise LoadOptionError("load(into=...) fills the given state dict in place: keys "
                                  "and mmap do not apply (the state dict selects what is read)")
        if into is not None:
            from ckptfs.protocol import sharded
            return sharded.load_into(self.storage, step, into, process_group=process_group,
                                     verify=verify, threads=self.threads,
                                     allow_rollback=allow_rollback)

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
        """The tiers a read resolves across, in order of preference: this store's storage
        (a two-tier store: the local tier, then the remote one; docs/tiers.md).
        ``collective``: the tiers of a read by every rank of a process group together, each
        one every rank can read a complete copy from (the same here; a store whose own
        storage is each node's own, `node_local`, leaves that tier out)."""
        return [("", self.storage)]

    def walk(self, use: Callable[[CheckpointInfo], T], *, allow_rollback: bool = False,
             skipped: list[str] | None = None, collective: bool = False
             ) -> tuple[CheckpointInfo, T] | None:
        """``use`` on the newest committed checkpoint that passes it, with the checkpoint, or
        ``None`` if there is none: the one walk behind `load` and the manager's
        restore, over `read_tiers` (`ckptfs.protocol.resolve.walk_tiers`).
        ``use`` gets the `CheckpointInfo` of one tier's copy; `load_info` loads
        it from that tier.  ``collective``: over ``read_tiers(collective=True)``."""
        return walk_tiers(self.read_tiers(collective=collective), use,
                          allow_rollback=allow_rollback, skipped=skipped)

    def use_step(self, step: int, use: Callable[[CheckpointInfo], T], *,
                 collective: bool = False) -> tuple[CheckpointInfo, T]:
        """``use`` on the committed checkpoint of ``step`` (`info`), with it: the
        walk's rule for a step asked by number (a two-tier store tries the remote copy when
        the local one fails ``use``).  ``collective``: as for `walk` (one tier here)."""
        info = self.info(step)
        return info, use(info)

    def load_info(self, info: CheckpointInfo, *, verify: bool = True,
                  map_location: MapLocation = None,
                  keys: Iterable[str | KeyPath] | None = None, mmap: bool = False
                  ) -> dict[Any, Any]:
        """Load exactly the committed attempt ``info`` names (as resolved by `info` or
        `latest`, or agreed by several ranks), never a newer one.  A file that went
        missing is corruption only if the marker still names this attempt; else the checkpoint
        was deleted while it was read (`CheckpointDeletedError`)."""
        try:
            return load_checkpoint(self.storage, info, verify=verify, map_location=map_location,
                                   threads=self.threads, keys=keys, mmap=mmap)
        except CorruptCheckpointError:
            check_still_committed(self.storage, info.step, info.dir_name, info.attempt)
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
        `CorruptCheckpointError` listing every problem.

        ``remote``: compare each file with the object store's own stored checksum, from
        metadata requests alone, reading no data (docs/remote-verify.md): raises
        `RemoteChecksumMismatchError` on a mismatch; files the store cannot
        vouch for are reported ``not available`` (``report.complete`` is then False)."""
        if remote:
            info = self.info(step) if step is not None else self.latest()
            if info is None:
                raise CheckpointNotFoundError(f"no committed checkpoint at {self.url}")
            return verify_remote(self.storage, info)
        if step is not None:
            return self._verify_info(self.info(step), quick)
        for _ in range(MAX_RESOLVE_PASSES):
            info = self.latest()
            if info is None:
                raise CheckpointNotFoundError(f"no committed checkpoint at {self.url}")
            try:
                return self._verify_info(info, quick)
            except CheckpointDeletedError as exc:
                log.info("%s; resolving the latest again", exc)
        raise CheckpointDeletedError(
            f"the latest checkpoint at {self.url} kept being deleted while it was verified; "
            "retry")

    def _verify_info(self, info: CheckpointInfo, quick: bool) -> VerifyReport:
        report = verify_checkpoint(self.storage, info, quick=quick, threads=self.threads)
        if not report.ok:
            check_still_committed(self.storage, info.step, info.dir_name, info.attempt)
            cls = UnsafeCheckpointError if report.unsafe else CorruptCheckpointError
            raise cls(f"step {info.step} at {info.url} fails {report.mode} verification: "
                      + "; ".join(report.problems), step=info.step, path=info.path)
        return report

    # -- asynchronous saves: thin hooks into ckptfs.protocol.async_save (docs/async.md) -------

    def save_async(self, step: int, state: Mapping[str, Any], *,
                   metadata: Mapping[str, Any] | None = None,
                   max_in_flight: int = 1) -> async_save.SaveFuture:
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
        `async_stats`).  Invalid values raise here, naming their key path."""
        return async_save.saver_for(self).submit(self, step, state, metadata=metadata,
                                                 max_in_flight=max_in_flight)

    def wait(self) -> None:
        """Wait for every pending `save_async`; raise a failure nobody collected."""
        async_save.wait(self)

    def close(self) -> None:
        """`wait`, then release the background thread and the staging buffers (a later
        `save_async` starts them again)."""
        async_save.close(self)

    @property
    def async_stats(self) -> async_save.AsyncStats:
        """Counters of `save_async`: submitted, committed, failed, back-pressure waits,
        snapshot time, staging memory."""
        return async_save.stats_of(self)

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        async_save.exit_context(self, exc_type is not None)

    # -- end of the async hooks ----------------------------------------------------------------

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"


def open(url: str, *, algorithm: str = DEFAULT_ALGORITHM, durable: bool = True,
         threads: int | None = None, retries: int = 3, incremental: bool = False,
         lease_s: float = DEFAULT_LEASE_S, **storage_options: Any) -> CheckpointStore:
    """Open the run root at ``url`` (any fsspec URL; a plain path means local disk).

    ``retries``: how many times an idempotent storage call that failed transiently is repeated
    (with capped exponential backoff; 0 disables, see `ckptfs.storage.retry`).
    ``incremental``: single-process saves write format v3 and reference the bytes an earlier
    checkpoint of the run already holds instead of writing them again (docs/incremental.md);
    sharded saves (under a process group) write format v4, every rank referencing the items
    of its previous save in this process that did not change (docs/protocol.md §9.6);
    ``lease_s``: how long such a save may take before it gives up its references.
    ``storage_options`` go to the fsspec implementation (e.g. ``endpoint_url``, ``key``,
    ``secret`` for S3; ``token`` for GCS; ``connection_string`` for Azure)."""
    storage: Storage = FsspecStorage(url, **storage_options)
    if retries > 0:
        storage = RetryingStorage(storage, attempts=retries + 1)
    return CheckpointStore(storage, algorithm=algorithm, durable=durable, threads=threads,
                           incremental=incremental, lease_s=lease_s)
