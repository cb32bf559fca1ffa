"""The user-facing API: :func:`open` a run root by URL, then save, load, list and verify."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ckptfs.errors import (
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    FormatVersionError,
)
from ckptfs.format.hashing import DEFAULT_ALGORITHM, new_hasher
from ckptfs.format.layout import StepPaths, check_step
from ckptfs.format.serialize import DEFAULT_SHARD_BYTES
from ckptfs.protocol.commit import default_threads, save_checkpoint
from ckptfs.protocol.reader import MapLocation, VerifyReport, load_checkpoint, verify_checkpoint
from ckptfs.protocol.resolve import (
    CheckpointInfo,
    committed_steps,
    existing_summary,
    read_committed,
    read_marker,
    resolve_latest,
    step_dirs,
)
from ckptfs.storage.base import Capabilities, Storage
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.storage.retry import RetryingStorage

log = logging.getLogger("ckptfs")


class CheckpointStore:
    """Checkpoints of one training run, under ``<root>/checkpoints/``.

    Thread-safe for concurrent readers; concurrent writers of the same step are resolved by the
    commit protocol (one wins, the others get :class:`~ckptfs.CheckpointExistsError`)."""

    def __init__(self, storage: Storage, *, algorithm: str = DEFAULT_ALGORITHM,
                 durable: bool = True, threads: int | None = None,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        new_hasher(algorithm)
        self.storage = storage
        self.algorithm = algorithm
        self.durable = durable
        self.threads = threads or default_threads()
        self.shard_bytes = shard_bytes
        caveat = getattr(getattr(storage, "spec", None), "caveat", "")
        if storage.capabilities.exclusive_create == "none":
            log.warning("%s: %s", storage.url, caveat or "no exclusive create on this backend")

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def capabilities(self) -> Capabilities:
        return self.storage.capabilities

    # -- writing -------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *,
             metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Write ``state`` as the checkpoint of ``step`` and commit it.

        Returns the committed :class:`CheckpointInfo`.  Raises
        :class:`~ckptfs.UnsupportedValueError` (before writing anything) for values the format
        cannot hold, :class:`~ckptfs.CheckpointExistsError` if the step is already committed
        (or another writer commits it first)."""
        return save_checkpoint(self.storage, step, state, algorithm=self.algorithm,
                               durable=self.durable, threads=self.threads, metadata=metadata,
                               shard_bytes=self.shard_bytes)

    def delete(self, step: int) -> None:
        """Delete a checkpoint: the marker first, so a half-deleted checkpoint never reads as
        committed, then every attempt of the step."""
        paths = StepPaths(check_step(step))
        self.storage.delete(paths.marker)
        if self.durable and self.capabilities.fsync and self.storage.exists(paths.dir):
            self.storage.sync_dir(paths.dir)  # the marker's removal is durable before the rest
        self.storage.delete_tree(paths.dir)

    # -- reading -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps (marker present), ascending by integer value."""
        return committed_steps(self.storage)

    def all_steps(self) -> list[int]:
        """Every step with a directory, committed or not."""
        return step_dirs(self.storage)

    def latest(self, *, allow_rollback: bool = False) -> CheckpointInfo | None:
        """The newest committed checkpoint, or ``None``.  Raises
        :class:`~ckptfs.CorruptCheckpointError` if the newest committed one fails its check,
        unless ``allow_rollback``."""
        return resolve_latest(self.storage, allow_rollback=allow_rollback)

    def info(self, step: int) -> CheckpointInfo:
        """The committed checkpoint of ``step``."""
        check_step(step)
        try:
            return read_committed(self.storage, step)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(f"{exc}; {existing_summary(self.storage)}") from None

    def load(self, step: int | None = None, *, map_location: MapLocation = None,
             verify: bool = True, allow_rollback: bool = False) -> dict[Any, Any]:
        """Load a committed checkpoint (the latest if ``step`` is None).

        With ``verify`` (default) every file is hashed while it is read and compared with the
        manifest before anything is returned.  If the newest checkpoint fails, the error names it;
        with ``allow_rollback`` the next older committed checkpoint is tried (and logged)."""
        if step is not None:
            return self._load_info(self.info(step), verify, map_location)
        tried: list[str] = []
        for s in reversed(step_dirs(self.storage)):
            try:
                info = read_committed(self.storage, s)
                return self._load_info(info, verify, map_location)
            except CheckpointNotFoundError:
                continue
            except FormatVersionError:
                raise
            except CorruptCheckpointError as exc:
                if not allow_rollback:
                    raise CorruptCheckpointError(
                        f"the newest committed checkpoint, step {s} at {self.url}, is corrupt: "
                        f"{exc}. Refusing to fall back silently: run 'ckptfs verify {self.url} "
                        f"--step {s}', delete it, or pass allow_rollback=True",
                        step=s, path=exc.path) from exc
                log.warning("allow_rollback: skipping corrupt checkpoint step %d at %s: %s",
                            s, self.url, exc)
                tried.append(f"step {s}: {exc}")
        raise CheckpointNotFoundError(
            f"no committed checkpoint to load at {self.url}"
            + (f" (skipped corrupt: {'; '.join(tried)})" if tried else ""))

    def _load_info(self, info: CheckpointInfo, verify: bool,
                   map_location: MapLocation) -> dict[Any, Any]:
        """Load, telling a checkpoint deleted while it was read (a prune, another job) from a
        corrupt one: a file that went missing is only corruption if the marker still names
        this attempt."""
        try:
            return load_checkpoint(self.storage, info, verify=verify, map_location=map_location,
                                   threads=self.threads)
        except CorruptCheckpointError as exc:
            try:
                marker = read_marker(self.storage, info.step)
            except CkptfsError:
                raise exc from None
            if marker is None or marker.attempt != info.attempt:
                raise CheckpointNotFoundError(
                    f"step {info.step} at {self.url} was deleted or replaced while it was being "
                    "loaded (a prune or another job); load again") from None
            raise

    def verify(self, step: int | None = None, *, quick: bool = False) -> VerifyReport:
        """Verify a committed checkpoint (the latest if ``step`` is None).

        Full (default) re-hashes every file; ``quick`` compares names and sizes from one
        listing.  Returns the report if everything matches, else raises
        :class:`~ckptfs.CorruptCheckpointError` listing every problem."""
        if step is None:
            info = self.latest()
            if info is None:
                raise CheckpointNotFoundError(f"no committed checkpoint at {self.url}")
        else:
            info = self.info(step)
        report = verify_checkpoint(self.storage, info, quick=quick, threads=self.threads)
        if not report.ok:
            raise CorruptCheckpointError(
                f"step {info.step} at {info.url} fails {report.mode} verification: "
                + "; ".join(report.problems), step=info.step, path=info.path)
        return report

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"


def open(url: str, *, algorithm: str = DEFAULT_ALGORITHM, durable: bool = True,
         threads: int | None = None, retries: int = 3,
         **storage_options: Any) -> CheckpointStore:
    """Open the run root at ``url`` (any fsspec URL; a plain path means local disk).

    ``retries``: how many times an idempotent storage call that failed transiently is repeated
    (with capped exponential backoff; 0 disables, see :mod:`ckptfs.storage.retry`).
    ``storage_options`` go to the fsspec implementation (e.g. ``endpoint_url``, ``key``,
    ``secret`` for S3; ``token`` for GCS; ``connection_string`` for Azure)."""
    storage: Storage = FsspecStorage(url, **storage_options)
    if retries > 0:
        storage = RetryingStorage(storage, attempts=retries + 1)
    return CheckpointStore(storage, algorithm=algorithm, durable=durable, threads=threads)
