"""Which checkpoints are committed, and which is the latest: decided by listing, never by a
pointer file.

``latest`` costs one listing of ``checkpoints/`` (names only, one level) plus, for the newest
step, one read of its marker and one of its manifest: three requests however many checkpoints
or files exist, more only when the newest steps are incomplete (a running or crashed writer:
then one more listing checks that no newer step appeared meanwhile).

*Incomplete* (no marker) steps are skipped: they are a writer still running, or one that
crashed; garbage collection removes them after a grace period.  A *corrupt* step (marker present
but not matching its manifest) is never skipped silently: it raises, naming the step, unless the
caller passes ``allow_rollback=True``, which logs what it skipped.  A step *deleted while it was
read* (a prune or another job removed it between two reads: its marker is gone, or names another
attempt, once a file it vouched for turned up missing) is neither: the listing is read again
(a bounded number of times), so a newer checkpoint committed meanwhile is found instead of an
older one.

Step directories are addressed by the name that was listed, never rebuilt from the step number:
``step-0000000000020`` (more than 12 digits) is step 20 but is not ``step-000000000020``.  Two
directory names of one step are an error (`CorruptCheckpointError` naming both).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn, TypeVar

from ckptfs.errors import (
    CheckpointDeletedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    ShardedLoadError,
    StorageError,
    StorageNotFoundError,
    TierMismatchError,
)
from ckptfs.format.content import same_content
from ckptfs.format.incremental import has_references
from ckptfs.format.layout import CHECKPOINTS_DIR, MARKER_NAME, StepPaths, parse_step_dir
from ckptfs.format.manifest import Manifest, Marker
from ckptfs.format.versions import decode_manifest
from ckptfs.protocol.group import Group, carried, describe
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")
T = TypeVar("T")

#: How many times resolving "latest" lists ``checkpoints/`` again after the step it was reading
#: was deleted under it (or a newer step appeared while it skipped incomplete ones).
MAX_RESOLVE_PASSES = 4


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: its step, the attempt that won, its manifest and marker.

    ``dir_name`` is the step directory's name as listed (empty: the canonical name)."""

    step: int
    attempt: str
    url: str
    manifest: Manifest
    marker: Marker
    dir_name: str = ""

    @property
    def paths(self) -> StepPaths:
        return StepPaths(self.step, self.dir_name)

    @property
    def path(self) -> str:
        """Path of the committed attempt directory, relative to the run root."""
        return self.paths.attempt_dir(self.attempt)

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    @property
    def bytes(self) -> int:
        """The checkpoint's logical size: every byte a full load reads (an incremental
        checkpoint's own files and the chunks it references in earlier ones)."""
        m = self.manifest
        return m.logical_bytes if has_references(m) else m.total_bytes

    @property
    def bytes_written(self) -> int:
        """Bytes its save wrote (its own files; the manifest and marker aside).  Equal to
        `bytes` but for an incremental checkpoint that reused stored bytes."""
        return self.manifest.total_bytes

    @property
    def created(self) -> str:
        return self.marker.created

    @property
    def metadata(self) -> dict[str, object]:
        return self.manifest.metadata

    def to_doc(self) -> dict[str, Any]:
        """This checkpoint as a message between ranks (`from_doc` reads it): its manifest
        and marker as the bytes they are stored as."""
        return {"step": self.step, "attempt": self.attempt, "url": self.url,
                "dir_name": self.dir_name, "manifest": self.manifest.to_bytes().decode(),
                "marker": self.marker.to_bytes().decode()}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> CheckpointInfo:
        """The checkpoint of `to_doc`, its manifest and marker read by the reader's own
        decoders."""
        where = f"{doc['url']} (as sent)"
        return cls(int(doc["step"]), str(doc["attempt"]), str(doc["url"]),
                   decode_manifest(str(doc["manifest"]).encode(), where=where),
                   Marker.from_bytes(str(doc["marker"]).encode(), where=where),
                   str(doc["dir_name"]))


def list_step_dirs(storage: Storage) -> dict[int, list[str]]:
    """Step -> the names of its directories under ``checkpoints/`` (normally one), ascending by
    step.  Entries whose names are not step names are ignored; an entry named like a step that
    is not a directory (a stray file ``checkpoints/step-000000000009``) is ignored and logged:
    it cannot hold a checkpoint, and must not block resolving the others."""
    found: dict[int, list[str]] = {}
    for entry in storage.list_dir(CHECKPOINTS_DIR):
        step = parse_step_dir(entry.basename)
        if step is None:
            continue
        if not entry.is_dir:
            log.warning("%s/%s is a file, not a step directory: ignored (remove it)",
                        storage.url, entry.name)
            continue
        names = found.setdefault(step, [])
        if entry.basename not in names:  # an object store may list a name twice
            names.append(entry.basename)
    return {s: sorted(found[s]) for s in sorted(found)}


def step_dirs(storage: Storage) -> list[int]:
    """Steps that have a directory (committed or not), ascending by integer value."""
    return list(list_step_dirs(storage))


def unique_dir(storage: Storage, step: int, names: list[str]) -> str:
    """The one directory name of ``step``; `CorruptCheckpointError` naming all of them if
    several names parse to the same step (``step-000000000020`` and ``step-0000000000020``):
    the reader never picks one silently."""
    if len(names) != 1:
        shown = ", ".join(f"{CHECKPOINTS_DIR}/{n}" for n in names)
        raise CorruptCheckpointError(
            f"step {step} at {storage.url} has {len(names)} directories ({shown}); a step must "
            "have exactly one, and the reader does not choose. Keep the one you trust and "
            "delete or rename the others", step=step, path=f"{CHECKPOINTS_DIR}/{names[0]}")
    return names[0]


def find_step_dir(storage: Storage, step: int) -> str | None:
    """The directory name of ``step`` found by listing, or ``None`` if it has none."""
    names = list_step_dirs(storage).get(step)
    return None if names is None else unique_dir(storage, step, names)


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose marker exists, ascending, from one recursive listing.  (Markers are checked
    against their manifests by `read_committed`, which ``latest``/``load`` use.)"""
    steps = set()
    for entry in storage.list_tree(CHECKPOINTS_DIR):
        parts = entry.name.split("/")
        if len(parts) == 3 and parts[0] == CHECKPOINTS_DIR and parts[2] == MARKER_NAME:
            step = parse_step_dir(parts[1])
            if step is not None:
                steps.add(step)
    return sorted(steps)


def read_marker(storage: Storage, step: int, name: str = "") -> Marker | None:
    """The marker of the step directory ``name`` (default: the canonical name of ``step``), or
    ``None`` if it has none."""
    paths = StepPaths(step, name)
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


def check_still_committed(storage: Storage, step: int, name: str, attempt: str) -> None:
    """Called when a file a marker vouches for is missing (or differs).  Raises
    `CheckpointDeletedError` if the step's marker is gone or now names another attempt
    (deleted or replaced while it was read); returns if the marker still names ``attempt``
    (then the caller's finding is corruption).  A marker that no longer parses counts as still
    committed (the caller reports its corruption); a storage failure propagates."""
    try:
        marker = read_marker(storage, step, name)
    except CorruptCheckpointError:
        return
    if marker is None or marker.attempt != attempt:
        raise CheckpointDeletedError(
            f"step {step} at {storage.url} was deleted or replaced while it was being read (a "
            "prune or another job); load again")


def read_committed(storage: Storage, step: int, name: str | None = None) -> CheckpointInfo:
    """The committed checkpoint of ``step`` in the step directory ``name`` (``None``: found by
    listing ``checkpoints/``).

    `CheckpointNotFoundError` if the step has no directory or no marker,
    `CheckpointDeletedError` if it was deleted while being read,
    `CorruptCheckpointError` if the marker and manifest disagree or the step has several
    directories, `FormatVersionError` if a newer ckptfs wrote it."""
    if name is None:
        name = find_step_dir(storage, step)
        if name is None:
            raise CheckpointNotFoundError(
                f"step {step} is not committed at {storage.url} (no step directory)")
    paths = StepPaths(step, name)
    marker = read_marker(storage, step, name)
    if marker is None:
        raise CheckpointNotFoundError(
            f"step {step} is not committed at {storage.url} (no {MARKER_NAME} marker)")
    mpath = paths.manifest(marker.attempt)
    where = storage_url(storage, mpath)
    try:
        mbytes = storage.read_bytes(mpath)
    except StorageNotFoundError:
        check_still_committed(storage, step, name, marker.attempt)
        raise CorruptCheckpointError(
            f"{where}: step {step} is marked committed but the manifest its marker "
            f"{MARKER_NAME} names is missing (attempt {marker.attempt})",
            step=step, path=mpath) from None
    marker.check_manifest(mbytes, where=where)
    manifest = decode_manifest(mbytes, where=where)  # v1, or v2 (sharded)
    if manifest.step != step or manifest.attempt != marker.attempt:
        raise CorruptCheckpointError(
            f"{where}: manifest names step {manifest.step} attempt {manifest.attempt}, the "
            f"marker step {step} attempt {marker.attempt}", step=step, path=mpath)
    return CheckpointInfo(step, marker.attempt, storage_url(storage, paths.attempt_dir(
        marker.attempt)), manifest, marker, name)


#: A tier the walk reads: a name for the log and errors (``"local"``, ``"remote"``; empty for
#: a one-tier store) and its storage.  Tiers are listed in order of preference.
Tier = tuple[str, Storage]


def walk_latest(storage: Storage, use: Callable[[CheckpointInfo], T], *,
                allow_rollback: bool = False,
                skipped: list[str] | None = None) -> tuple[CheckpointInfo, T] | None:
    """Apply ``use`` to the newest committed checkpoint of one store and return it with the
    result, or ``None`` if there is none: `walk_tiers` over one tier."""
    return walk_tiers([("", storage)], use, allow_rollback=allow_rollback, skipped=skipped)


def walk_tiers(tiers: Sequence[Tier], use: Callable[[CheckpointInfo], T], *,
               allow_rollback: bool = False, skipped: list[str] | None = None,
               group: Group | None = None) -> tuple[CheckpointInfo, T] | None:
    """Apply ``use`` to the newest committed checkpoint in any of ``tiers`` and return it with
    the result, or ``None`` if there is none.  The one walk behind ``latest``, ``load()``
    (``load(into=)`` of a two-tier store included), ``verify()`` and the manager's restore,
    for one store and for a two-tier store (docs/tiers.md), where ``tiers`` is
    ``[local, remote]``.

    Newest step (in any tier) first; for that step, each tier that lists it, in order: the
    first copy that reads and passes ``use`` is the answer (a later tier is tried when an
    earlier copy is incomplete, corrupt or unreadable, logged).  A step with no marker in any
    tier -> skipped (incomplete); every copy `CorruptCheckpointError` (from reading it
    or from ``use``) -> raised naming the step and each tier's error, or with
    ``allow_rollback`` logged, appended to ``skipped`` and the next older step tried; every
    copy a `StorageError` -> that error; `FormatVersionError` ->
    raised, never rolled back over; `CheckpointDeletedError` -> the listings are read
    again; a copy ``use`` refuses with `CheckpointNotFoundError` (read, but it cannot
    serve: a local copy missing a lost node's files) -> the next tier's copy, under the
    stand-in rule, else the step is skipped (logged).  When the answer comes after skipping
    newer steps, the tiers are listed once more, and a step that appeared meanwhile starts the
    walk over: a writer that committed a newer step and then pruned the one being read never
    makes this return an older one.

    A tier that cannot be listed (a remote outage) is left out, logged, when another tier can
    be; if none can, the first tier's error is raised.

    ``group``: every rank of the group walks together (`over_group`): its coordinator
    lists the tiers and decides, every rank runs ``use`` on each candidate; in a group of one
    this is the walk above."""
    def walk(run: Callable[[CheckpointInfo], T]) -> tuple[CheckpointInfo, T] | None:
        return _walk(tiers, run, allow_rollback=allow_rollback, skipped=skipped)

    if group is not None and group.world_size > 1:
        return over_group(group, tiers, walk, use)
    return walk(use)


def _walk(tiers: Sequence[Tier], use: Callable[[CheckpointInfo], T], *,
          allow_rollback: bool, skipped: list[str] | None) -> tuple[CheckpointInfo, T] | None:
    for _ in range(MAX_RESOLVE_PASSES):
        listings = _list_tiers(tiers)
        steps = sorted(set().union(*(listing for _, listing in listings)), reverse=True)
        passed_over = False
        relist = False
        for step in steps:
            holders = [(tier, listing[step]) for tier, listing in listings if step in listing]
            problems: list[tuple[Tier, Exception]] = []
            unusable: list[Exception] = []
            try:
                found = _use_step(step, holders, use, problems, unusable=unusable)
            except CheckpointDeletedError as exc:
                log.info("%s; listing again", exc)
                relist = True
                break
            if found is None:
                if not problems:
                    if unusable:
                        log.warning("step %d: no copy can be used (%s); trying the next older "
                                    "step", step, unusable[-1])
                    else:
                        log.debug("step %d is incomplete in %s; skipped", step,
                                  ", ".join(t[1].url for t, _ in holders))
                    passed_over = True
                    continue
                error = _step_error(step, problems, newest=True)
                if not allow_rollback or not isinstance(error, CorruptCheckpointError):
                    _raise(error, problems)
                log.warning("allow_rollback: skipping corrupt checkpoint step %d: %s", step,
                            error)
                if skipped is not None:
                    skipped.append(f"step {step}: " + "; ".join(
                        f"{_where(t)}{e}" for t, e in problems))
                passed_over = True
                continue
            if passed_over and _newer_step_appeared(listings, step):
                relist = True
                break
            return found
        if not relist and not (passed_over and _newer_step_appeared(listings, -1)):
            return None
    where = ", ".join(storage.url for _, storage in tiers)
    raise CheckpointDeletedError(
        f"checkpoints at {where} kept changing while the latest was resolved "
        f"({MAX_RESOLVE_PASSES} listings: steps deleted or committed by another job); retry")


def use_step(tiers: Sequence[Tier], step: int, use: Callable[[CheckpointInfo], T], *,
             group: Group | None = None) -> tuple[CheckpointInfo, T]:
    """``use`` on the first of ``tiers`` whose copy of ``step`` (its directory found by
    listing) reads and passes; the same per-step rule as `walk_tiers` for one step asked
    by number: every copy corrupt -> `CorruptCheckpointError` naming each tier's error
    (no rollback: the step was asked for), every copy unreadable -> the storage error, every
    copy refused by ``use`` -> its `CheckpointNotFoundError`, in no tier ->
    `CheckpointNotFoundError`.

    The tiers are asked one at a time: a later tier is not even listed while an earlier copy
    passes (a step the local tier serves costs the remote nothing, and an unreachable remote
    delays nothing).  A plain store's one tier (`one_store`): its committed copy
    (`committed_info`), and ``use``'s own error.  ``group``: as for `walk_tiers`."""
    def walk(run: Callable[[CheckpointInfo], T]) -> tuple[CheckpointInfo, T]:
        return _use_one_step(tiers, step, run)

    if group is not None and group.world_size > 1:
        found = over_group(group, tiers, walk, use)
        assert found is not None  # the coordinator's walk returns or raises
        return found
    return walk(use)


def one_store(tiers: Sequence[Tier]) -> bool:
    """Whether ``tiers`` is a plain store's one unnamed tier: no other copy can stand in for
    a failing one, so a copy's own error is the answer."""
    return len(tiers) == 1 and not tiers[0][0]


def committed_info(storage: Storage, step: int) -> CheckpointInfo:
    """`read_committed` of ``step``; one that is not committed raises
    `CheckpointNotFoundError` listing the committed steps (`existing_summary`)."""
    try:
        return read_committed(storage, step)
    except CheckpointNotFoundError as exc:
        raise type(exc)(f"{exc}; {existing_summary(storage)}") from None


def _use_one_step(tiers: Sequence[Tier], step: int, use: Callable[[CheckpointInfo], T]
                  ) -> tuple[CheckpointInfo, T]:
    if one_store(tiers):  # nothing stands in: the copy's own errors, as they are
        info = committed_info(tiers[0][1], step)
        return info, use(info)
    problems: list[tuple[Tier, Exception]] = []
    failed: list[tuple[Tier, CheckpointInfo | None]] = []
    unusable: list[Exception] = []
    for i, tier in enumerate(tiers):
        try:
            name = find_step_dir(tier[1], step)
        except (CorruptCheckpointError, StorageError) as exc:
            problems.append((tier, exc))
            continue
        if name is None:
            continue
        try:
            found = _use_step(step, [(tier, name)], use, problems,
                              later=[t[0] for t in tiers[i + 1:]], failed=failed,
                              unusable=unusable)
        except CheckpointDeletedError:
            found = None  # deleted while read here: the next tier's copy, if any
        if found is not None:
            return found
    if problems:
        _raise(_step_error(step, problems, newest=False), problems)
    if unusable:
        raise unusable[-1]
    raise CheckpointNotFoundError(
        f"step {step} is not committed at " + " or ".join(st.url for _, st in tiers))


#: A walk over given tiers, with the ``use`` it runs on each candidate.
Walk = Callable[[Callable[[CheckpointInfo], T]], tuple[CheckpointInfo, T] | None]


def over_group(group: Group, tiers: Sequence[Tier], walk: Walk[T],
               use: Callable[[CheckpointInfo], T]) -> tuple[CheckpointInfo, T] | None:
    """The walk of every rank of ``group`` together: the same checkpoint from the same tier
    on every rank, never one rank on step N and another on N-1.

    The coordinator runs ``walk`` (it lists the tiers, reads each candidate's marker and
    manifest, and decides the stand-in rule and what follows a failure); for each candidate
    it tries, it broadcasts the candidate (its tier's name, its manifest and marker), then
    every rank runs ``use`` on it and the ranks gather their outcomes: a failure on any rank
    is the candidate's failure on every rank (the coordinator's walk gets the error; the same
    class on every rank, `describe`/`carried`).  At the end the coordinator broadcasts the
    outcome: the candidate chosen, none, or the walk's error, which every rank raises.  The
    other ranks log what the coordinator's walk logs of each copy (its failure, the copy that
    stands in for it)."""
    if group.coordinator:
        return _lead(group, tiers, walk, use)
    return _follow(group, tiers, use)


def _lead(group: Group, tiers: Sequence[Tier], walk: Walk[T],
          use: Callable[[CheckpointInfo], T]) -> tuple[CheckpointInfo, T] | None:
    def try_one(info: CheckpointInfo) -> T:
        group.broadcast({"candidate": info.to_doc(), "tier": tier_of(tiers, info)[0]})
        return _agreed(group, info, use)

    try:
        found = walk(try_one)
    except Exception as exc:
        group.broadcast({"error": describe(exc)})
        raise
    group.broadcast({"done": found is not None})
    return found


def _follow(group: Group, tiers: Sequence[Tier], use: Callable[[CheckpointInfo], T]
            ) -> tuple[CheckpointInfo, T] | None:
    storages = dict(tiers)
    found: tuple[CheckpointInfo, T] | None = None
    failing: dict[int, list[str]] = {}  # step -> the tiers whose copy failed, for the log
    while True:
        msg = group.broadcast(None)
        if "candidate" in msg:
            found = None
            name = str(msg["tier"])
            info = CheckpointInfo.from_doc(msg["candidate"])
            info = replace(info, url=storage_url(storages[name], info.path))  # this rank's
            try:
                found = (info, _agreed(group, info, use))
            except Exception as exc:
                failing.setdefault(info.step, []).append(name)
                log.warning("the %s copy of step %d at %s fails (%s: %s)", name, info.step,
                            storages[name].url, type(exc).__name__, exc)
                continue
            if failing.get(info.step):
                log.warning("using the %s copy of step %d at %s (the same checkpoint as the "
                            "failing %s copy)", name, info.step, info.url,
                            ", ".join(failing[info.step]))
            continue
        if "error" in msg:
            raise carried(msg["error"], ShardedLoadError)
        return found if msg["done"] else None


def _agreed(group: Group, info: CheckpointInfo, use: Callable[[CheckpointInfo], T]) -> T:
    """``use(info)`` on this rank, then every rank's outcome gathered: this rank's error, or
    another rank's (the same class), or the result."""
    got = group.outcomes(lambda: use(info))
    if got.own is not None:
        raise got.own
    if got.failures:
        raise carried(got.failures[min(got.failures)], ShardedLoadError)
    return got.value  # type: ignore[return-value]


def _list_tiers(tiers: Sequence[Tier]) -> list[tuple[Tier, dict[int, list[str]]]]:
    listed: list[tuple[Tier, dict[int, list[str]]]] = []
    errors: list[StorageError] = []
    for tier in tiers:
        try:
            listed.append((tier, list_step_dirs(tier[1])))
        except StorageError as exc:
            if len(tiers) > 1:
                log.warning("the %s tier %s cannot be listed (%s): resolving from the other "
                            "tier(s) only", tier[0], tier[1].url, exc)
            errors.append(exc)
    if not listed:
        raise errors[0]
    return listed


def _use_step(step: int, holders: Sequence[tuple[Tier, list[str] | str]],
              use: Callable[[CheckpointInfo], T], problems: list[tuple[Tier, Exception]],
              *, later: Sequence[str] = (),
              failed: list[tuple[Tier, CheckpointInfo | None]] | None = None,
              unusable: list[Exception] | None = None
              ) -> tuple[CheckpointInfo, T] | None:
    """``use`` on the first holder's copy of ``step`` that reads and passes; the failures of
    the others go to ``problems``.  ``None`` if no copy is committed or every one failed.
    ``later``: the names of the tiers asked after these (for the log line of a failing copy).
    `CheckpointDeletedError` (a copy deleted while read) is raised if no later tier
    serves the step: the caller lists again.

    A copy stands in for an earlier tier's failing copy only if it is the same checkpoint
    (`stand_in`): ``failed`` collects the failing copies (with their info when their
    manifest was read), shared across the calls of one step; ``unusable`` the
    `CheckpointNotFoundError` of each copy that was read but that ``use`` refused (it
    cannot serve: not corrupt, and not the step's absence either)."""
    failed = [] if failed is None else failed
    unusable = [] if unusable is None else unusable
    deleted: CheckpointDeletedError | None = None
    for i, (tier, names) in enumerate(holders):
        name, storage = tier
        info: CheckpointInfo | None = None
        try:
            dir_name = names if isinstance(names, str) else unique_dir(storage, step, names)
            info = read_committed(storage, step, dir_name)
            if failed:
                stand_in(step, tier, info, failed)
            result = use(info)
            if failed:
                log.warning("using the %s copy of step %d at %s (the same checkpoint as the "
                            "failing %s copy)", name, step, info.url,
                            ", ".join(t[0] for t, _ in failed))
            return info, result
        except CheckpointDeletedError as exc:
            deleted = exc
            continue
        except CheckpointNotFoundError as exc:
            if info is None:
                continue  # no marker in this tier: incomplete here
            # read, but ``use`` says it cannot serve: another tier may stand in for it
            unusable.append(exc)
            failed.append((tier, info))
            rest = [t[0] for t, _ in holders[i + 1:]] + list(later)
            log.warning("the %scopy of step %d at %s cannot be used (%s)%s",
                        f"{name} " if name else "", step, storage.url, exc,
                        f"; trying the {rest[0]} copy" if rest else "")
        except FormatVersionError:
            raise  # written by a newer ckptfs: never skipped, never rolled back over
        except TierMismatchError as exc:  # another checkpoint of this step number: not used
            problems.append((tier, exc))
            log.warning("%s", exc)
        except (CorruptCheckpointError, StorageError) as exc:
            problems.append((tier, exc))
            if info is not None or isinstance(exc, CorruptCheckpointError):
                failed.append((tier, info))  # a copy is there and fails (not merely absent)
            if len(holders) > 1 or later or name:
                rest = [t[0] for t, _ in holders[i + 1:]] + list(later)
                log.warning("the %s copy of step %d at %s fails (%s: %s)%s", name, step,
                            storage.url, type(exc).__name__, exc,
                            f"; trying the {rest[0]} copy" if rest else "")
    if deleted is not None:
        raise deleted
    return None


def stand_in(step: int, tier: Tier, info: CheckpointInfo,
             failed: Sequence[tuple[Tier, CheckpointInfo | None]]) -> None:
    """Return if ``info`` (``tier``'s copy of ``step``) may be used in place of the
    ``failed`` copies of earlier tiers: it is the same checkpoint as each of them (the rule
    ``ckptfs cp`` and the replicator use for "already there": ``same_content`` of the
    manifests).  Else `TierMismatchError` naming both copies: another run's step of
    that number (or a copy whose manifest could not be read, so that nothing can be compared)
    is never returned for it."""
    for (name, storage), earlier in failed:
        where = storage_url(storage, "") if earlier is None else earlier.url
        if earlier is None:
            raise TierMismatchError(
                f"step {step}: the {name} copy at {where} fails before its manifest could be "
                f"read, so whether the {tier[0]} copy at {info.url} is the same checkpoint "
                f"cannot be checked: it is not used in its place (if it is the checkpoint you "
                f"want, load it from that tier alone, e.g. store.{tier[0]}.load({step}))",
                step=step, path=info.path)
        if not same_content(earlier.manifest, info.manifest):
            raise TierMismatchError(
                f"step {step}: the {tier[0]} copy at {info.url} is not the same checkpoint as "
                f"the failing {name} copy at {where} (other files or metadata: another run's "
                f"step {step}, or this run's before it restarted): it is not used in its place",
                step=step, path=info.path)


def _where(tier: Tier) -> str:
    return f"{tier[0]}: " if tier[0] else ""


def _step_error(step: int, problems: list[tuple[Tier, Exception]], *,
                newest: bool) -> Exception:
    """The error of a step whose every copy failed: the storage error if each was one (the
    tier is unreachable, not corrupt), else `CorruptCheckpointError` naming the step
    and each tier's error."""
    if all(isinstance(e, StorageError) for _, e in problems):
        return problems[0][1]
    mismatch = [e for _, e in problems if isinstance(e, TierMismatchError)]
    if mismatch:
        hint = (". Inspect the failing copy with 'ckptfs verify', delete it if it is damaged "
                "(then the other tier's checkpoint of that step number is the one found), or "
                "pass allow_rollback=True to use the previous committed checkpoint"
                if newest else "")
        return TierMismatchError(
            ("the newest checkpoint, " if newest else "") + f"step {step}: no copy can be used: "
            + "; ".join(f"{_where(t)}{t[1].url}: {type(e).__name__}: {e}" for t, e in problems
                        if not isinstance(e, TierMismatchError))
            + "; and " + "; ".join(str(e) for e in mismatch) + hint, step=step)
    refuse = (". Refusing to fall back silently: inspect it with 'ckptfs verify {url} --step "
              f"{step}', delete it, or pass allow_rollback=True to use the previous committed "
              "checkpoint") if newest else ""
    if len(problems) == 1 and not problems[0][0][0]:  # one store: the error as it was
        (_, storage), exc = problems[0]
        what = f"the newest checkpoint, step {step} at {storage.url}," if newest \
            else f"step {step} at {storage.url}"
        path = exc.path if isinstance(exc, CorruptCheckpointError) else None
        return CorruptCheckpointError(f"{what} fails its check: {exc}"
                                      + refuse.format(url=storage.url), step=step, path=path)
    what = f"the newest checkpoint, step {step}," if newest else f"step {step}"
    first = problems[0][0][1]
    return CorruptCheckpointError(
        f"{what} fails in every tier that holds it: "
        + "; ".join(f"{_where(t)}{t[1].url}: {type(e).__name__}: {e}" for t, e in problems)
        + refuse.format(url=first.url), step=step)


def _raise(error: Exception, problems: list[tuple[Tier, Exception]]) -> NoReturn:
    if any(error is e for _, e in problems):
        raise error
    raise error from problems[-1][1]


def _newer_step_appeared(listings: Sequence[tuple[Tier, dict[int, list[str]]]],
                         step: int) -> bool:
    known = set().union(*(listing for _, listing in listings))
    for (name, storage), _ in listings:
        try:
            fresh = list_step_dirs(storage)
        except StorageError as exc:
            if len(listings) == 1:
                raise
            log.warning("the %s tier %s cannot be listed again (%s)", name, storage.url, exc)
            continue
        if any(s > step and s not in known for s in fresh):
            return True
    return False


def tier_of(tiers: Sequence[Tier], info: CheckpointInfo) -> Tier:
    """The tier ``info`` was read from (by its URL); ``ValueError`` if none."""
    for tier in tiers:
        if info.url == storage_url(tier[1], info.path):
            return tier
    raise ValueError(f"{info.url} is in none of the tiers " + ", ".join(
        st.url for _, st in tiers))


def resolve_latest(storage: Storage, *, allow_rollback: bool = False) -> CheckpointInfo | None:
    """The newest committed checkpoint (marker and manifest checked, file contents not), or
    ``None`` if there is none."""
    found = walk_latest(storage, lambda info: info, allow_rollback=allow_rollback)
    return None if found is None else found[0]


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
