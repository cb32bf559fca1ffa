"""Which checkpoints are committed, and which is the latest: decided by listing, never by a
pointer file.

``latest`` costs one listing of ``checkpoints/`` (names only, one level) plus, for the newest
step, one read of its marker and one of its manifest: three requests however many checkpoints
or files exist, more only when the newest steps are incomplete (a running or crashed writer).

*Incomplete* (no marker) steps are skipped: they are a writer still running, or one that
crashed; garbage collection removes them after a grace period.  A *corrupt* step (marker present
but not matching its manifest) is never skipped silently: it raises, naming the step, unless the
caller passes ``allow_rollback=True``, which logs what it skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ckptfs.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    StorageNotFoundError,
)
from ckptfs.format.layout import CHECKPOINTS_DIR, MARKER_NAME, StepPaths, parse_step_dir
from ckptfs.format.manifest import Manifest, Marker
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: its step, the attempt that won, its manifest and marker."""

    step: int
    attempt: str
    url: str
    manifest: Manifest
    marker: Marker

    @property
    def path(self) -> str:
        """Path of the committed attempt directory, relative to the run root."""
        return StepPaths(self.step).attempt_dir(self.attempt)

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    @property
    def created(self) -> str:
        return self.marker.created

    @property
    def metadata(self) -> dict[str, object]:
        return self.manifest.metadata


def step_dirs(storage: Storage) -> list[int]:
    """Steps that have a directory (committed or not), ascending by integer value."""
    steps = set()
    for entry in storage.list_dir(CHECKPOINTS_DIR):
        step = parse_step_dir(entry.basename)
        if step is not None:
            steps.add(step)
    return sorted(steps)


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose marker exists, ascending, from one recursive listing.  (Markers are checked
    against their manifests by :func:`read_committed`, which ``latest``/``load`` use.)"""
    steps = set()
    for entry in storage.list_tree(CHECKPOINTS_DIR):
        parts = entry.name.split("/")
        if len(parts) == 3 and parts[0] == CHECKPOINTS_DIR and parts[2] == MARKER_NAME:
            step = parse_step_dir(parts[1])
            if step is not None:
                steps.add(step)
    return sorted(steps)


def read_marker(storage: Storage, step: int) -> Marker | None:
    paths = StepPaths(step)
    try:
        data = storage.read_bytes(paths.marker)
    except StorageNotFoundError:
        return None
    marker = Marker.from_bytes(data, where=storage_url(storage, paths.marker))
    if marker.step != step:
        raise CorruptCheckpointError(
            f"{storage_url(storage, paths.marker)}: marker is for step {marker.step}, found in "
            f"the directory of step {step}", step=step, path=paths.marker)
    return marker


def read_committed(storage: Storage, step: int) -> CheckpointInfo:
    """The committed checkpoint of ``step``; :class:`CheckpointNotFoundError` if it has no
    marker, :class:`CorruptCheckpointError` if the marker and manifest disagree."""
    paths = StepPaths(step)
    marker = read_marker(storage, step)
    if marker is None:
        raise CheckpointNotFoundError(
            f"step {step} is not committed at {storage.url} (no {MARKER_NAME} marker)")
    mpath = paths.manifest(marker.attempt)
    where = storage_url(storage, mpath)
    try:
        mbytes = storage.read_bytes(mpath)
    except StorageNotFoundError:
        raise CorruptCheckpointError(
            f"{where}: step {step} is marked committed but the manifest its marker "
            f"{MARKER_NAME} names is missing (attempt {marker.attempt})",
            step=step, path=mpath) from None
    marker.check_manifest(mbytes, where=where)
    manifest = Manifest.from_bytes(mbytes, where=where)
    if manifest.step != step or manifest.attempt != marker.attempt:
        raise CorruptCheckpointError(
            f"{where}: manifest names step {manifest.step} attempt {manifest.attempt}, the "
            f"marker step {step} attempt {marker.attempt}", step=step, path=mpath)
    return CheckpointInfo(step, marker.attempt, storage_url(storage, paths.attempt_dir(
        marker.attempt)), manifest, marker)


def resolve_latest(storage: Storage, *, allow_rollback: bool = False) -> CheckpointInfo | None:
    """The newest committed checkpoint, or ``None`` if there is none."""
    for step in reversed(step_dirs(storage)):
        try:
            return read_committed(storage, step)
        except CheckpointNotFoundError:
            log.debug("step %d at %s is incomplete; skipped", step, storage.url)
            continue
        except FormatVersionError:
            raise  # written by a newer ckptfs: never skipped, never rolled back over
        except CorruptCheckpointError as exc:
            if not allow_rollback:
                raise CorruptCheckpointError(
                    f"the newest committed checkpoint, step {step} at {storage.url}, fails its "
                    f"check: {exc}. Refusing to fall back silently: inspect it with "
                    f"'ckptfs verify {storage.url} --step {step}', delete it, or pass "
                    "allow_rollback=True to use the previous committed checkpoint",
                    step=step, path=exc.path) from exc
            log.warning("skipping corrupt committed checkpoint step %d at %s (allow_rollback): "
                        "%s", step, storage.url, exc)
    return None


def storage_url(storage: Storage, path: str) -> str:
    return f"{storage.url}/{path}"


def existing_summary(storage: Storage) -> str:
    """Human-readable list of committed steps for error messages."""
    steps = committed_steps(storage)
    if not steps:
        return f"no committed checkpoints at {storage.url}"
    shown = ", ".join(str(s) for s in steps[-10:])
    more = f" (and {len(steps) - 10} older)" if len(steps) > 10 else ""
    return f"committed steps at {storage.url}: {shown}{more}"
