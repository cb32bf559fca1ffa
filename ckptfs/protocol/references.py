"""Which stored bytes incremental checkpoints use, and freeing a deleted step without taking
them (docs/protocol.md §9.5).

Design decision: **a delete removes the marker first and only then scans for references; the
scan reads every committed manifest first and only then lists the in-flight ones.**  Only files
of attempts whose manifest has the ``references`` feature (formats v3, v4) are ever referenced
(a reference names the file that physically holds the bytes, never another reference), so a
step none of whose attempts is such an attempt is deleted as before, without a scan.

That rule is one function, `attempt_sharing`, asked by both sides: a delete and gc
(`shared_attempts`, `may_be_referenced`) scan before freeing an attempt it says may be
referenced, and every reader (load, verify, copy, a save's own check, through
`ckptfs.protocol.listing.reference_problems`) refuses, with `reference_target_problems`, a
reference into any other attempt: one without a manifest, of a format without references (v1,
v2), or whose manifest does not decode.  So a reference a reader accepts always points into an
attempt a delete scans for (docs/protocol.md §9.5).

The scan (`scan_references`), strictly in this order:

1. every committed step: its marker and the manifest it binds (`read_committed`); the
   references of every committed checkpoint are kept.  A committed step whose marker or
   manifest cannot be read makes the scan raise `CorruptCheckpointError` naming it: an
   unreadable committed manifest might reference anything, so nothing may be freed (except
   ``skip_step``, the step being deleted, whose marker the deleter has just removed);
2. then a *fresh* listing of every attempt directory that has a ``MANIFEST.json``, was not
   read in (1), and whose name's time is younger than ``grace_s``: a save that may be past its
   fence (it wrote its manifest, re-read its protectors' markers, and is about to create its
   own).  Their references are kept too.  A manifest that does not decode is a save still
   writing it (it has not fenced yet, and its fence will see the deleted marker): ignored.
   One written by a newer ckptfs raises `FormatVersionError` (never guessed at).

Why the order makes it safe (the argument of §9.5): a saver S writes its manifest at p1, then
fences on its protector C at t1 > p1.  A deleter removes C's marker at t2, then scans.  If
t1 > t2, S's fence sees C gone and S aborts.  If t1 < t2, phase (1) read C either before t2
(then C's references, which include everything S took from C's references, are kept) or after
t2 > t1 > p1, and phase (2), later still, lists S's manifest (strong list-after-write on every
backend) unless S is older than the grace, which exceeds S's lease plus clock skew: by then S
has committed (and phase (1) read it) or given up.

An attempt with a referenced file is kept whole, without its marker (*retired*); garbage
collection removes it once nothing references it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ckptfs.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    StorageNotFoundError,
)
from ckptfs.format.incremental import Reference, referenced_chunks
from ckptfs.format.layout import (
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    MARKER_NAME,
    TMP_PREFIX,
    StepPaths,
    parse_attempt_name,
    parse_step_dir,
)
from ckptfs.format.manifest import Manifest
from ckptfs.format.versions import REFERENCES, decode_manifest, features
from ckptfs.protocol.resolve import CheckpointInfo, read_committed, storage_url
from ckptfs.storage.base import Entry, Storage

log = logging.getLogger("ckptfs")

#: ``{file (path from the run root): {(offset, length) of each chunk used}}``.
References = dict[str, set[tuple[int, int]]]


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


# -- phase 1: committed checkpoints -----------------------------------------------------------


@dataclass
class Committed:
    """Every committed checkpoint found by one listing: those read, and those that could not
    be (step directory name -> the error)."""

    infos: list[CheckpointInfo] = field(default_factory=list)
    unreadable: dict[str, CorruptCheckpointError] = field(default_factory=dict)
    #: ``(step directory, attempt)`` of each checkpoint read.
    read: set[tuple[str, str]] = field(default_factory=set)
    #: the listing it was found by (files under ``checkpoints/``)
    listing: list[Entry] = field(default_factory=list)


def _parts(entry: Entry) -> list[str]:
    return entry.name.strip("/").split("/")


def read_all_committed(storage: Storage) -> Committed:
    """Every committed checkpoint under ``checkpoints/`` (one recursive listing, then the
    marker and manifest of each step whose marker is listed).  A step deleted meanwhile (its
    marker gone) is skipped; one whose marker or manifest does not read is recorded in
    ``unreadable``.  Storage failures propagate."""
    out = Committed(listing=storage.list_tree(CHECKPOINTS_DIR))
    for entry in out.listing:
        parts = _parts(entry)
        if len(parts) != 3 or parts[0] != CHECKPOINTS_DIR or parts[2] != MARKER_NAME:
            continue
        step = parse_step_dir(parts[1])
        if step is None:
            continue
        try:
            info = read_committed(storage, step, parts[1])
        except CheckpointNotFoundError:  # deleted since the listing (Deleted is a subclass)
            continue
        except CorruptCheckpointError as exc:
            out.unreadable[parts[1]] = exc
            continue
        out.infos.append(info)
        out.read.add((parts[1], info.attempt))
    return out


# -- phase 2: in-flight saves -----------------------------------------------------------------


def _in_flight(storage: Storage, read: set[tuple[str, str]], grace_s: float,
               now: datetime) -> list[Manifest]:
    manifests: list[Manifest] = []
    for entry in storage.list_tree(CHECKPOINTS_DIR):  # a fresh listing, after phase 1
        parts = _parts(entry)
        if len(parts) != 4 or parts[0] != CHECKPOINTS_DIR or parts[3] != MANIFEST_NAME:
            continue
        if parse_step_dir(parts[1]) is None:
            continue
        attempt = parts[2].removeprefix(TMP_PREFIX)
        created = parse_attempt_name(attempt)
        if created is None or (parts[1], attempt) in read:
            continue
        if (now - created).total_seconds() >= grace_s:
            continue  # older than any save's lease: committed (read in phase 1) or given up
        path = "/".join(parts)
        try:
            data = storage.read_bytes(path)
        except StorageNotFoundError:
            continue  # discarded or deleted since the listing
        try:
            manifests.append(decode_manifest(data, where=storage_url(storage, path)))
        except FormatVersionError:
            raise
        except CorruptCheckpointError as exc:
            log.debug("reference scan: in-flight manifest %s ignored: %s", path, exc)
    return manifests


def scan_references(storage: Storage, *, grace_s: float, skip_step: int | None = None,
                    now: datetime | None = None) -> References:
    """Every chunk of a stored file that a committed checkpoint, or a save that may still
    commit (an attempt younger than ``grace_s`` with a manifest), references: what no delete
    may take.  Phase 1 (committed) strictly before phase 2 (in flight): see the module
    docstring.

    Raises `CorruptCheckpointError` naming a committed step whose marker or manifest
    cannot be read (unless it is ``skip_step``, the step being deleted), and
    `FormatVersionError` for a manifest of a newer ckptfs: the caller then frees
    nothing."""
    now = now or _utcnow()
    committed = read_all_committed(storage)
    for name, exc in sorted(committed.unreadable.items()):
        if parse_step_dir(name) == skip_step:
            log.info("reference scan: step being deleted (%s) does not read: %s", name, exc)
            continue
        raise CorruptCheckpointError(
            f"cannot tell which stored bytes the committed checkpoint {CHECKPOINTS_DIR}/{name} "
            f"at {storage.url} references ({exc}); nothing it might reference is freed. Check "
            f"it with 'ckptfs verify {storage.url} --step {parse_step_dir(name)}', and delete "
            "or repair it", step=parse_step_dir(name), path=f"{CHECKPOINTS_DIR}/{name}"
        ) from exc
    manifests: list[Manifest] = [i.manifest for i in committed.infos]
    manifests += _in_flight(storage, committed.read, grace_s, now)
    return referenced_chunks(manifests)


def location_attempt(location: str) -> tuple[int, str] | None:
    """``(step, attempt)`` of a referenced file's location, ``None`` if it names none."""
    parts = location.split("/")
    if len(parts) < 4 or parts[0] != CHECKPOINTS_DIR:
        return None
    step = parse_step_dir(parts[1])
    return None if step is None else (step, parts[2])


def referenced_attempts(refs: References) -> dict[tuple[int, str], int]:
    """``(step, attempt)`` of every attempt holding a referenced file -> the bytes referenced
    there (sum of its referenced chunks)."""
    out: dict[tuple[int, str], int] = {}
    for location, chunks in refs.items():
        key = location_attempt(location)
        if key is not None:
            out[key] = out.get(key, 0) + sum(length for _, length in chunks)
    return out


# -- which attempts may hold referenced files: the one rule of readers and deletes -------------


@dataclass(frozen=True)
class Sharing:
    """What an attempt's ``MANIFEST.json`` says about references into its files.

    ============================================  ======================  ===================
    the attempt's manifest                        a reference into it     a delete or gc
    ============================================  ======================  ===================
    decodes, format with ``references`` (v3, v4)  valid (``shares``)      scans first
    present, does not decode (or a newer format)  refused                 scans first
    absent, or a format without references        refused                 frees, no scan
    ============================================  ======================  ===================

    ``why``: in words, why a reference into it is refused (empty when ``shares``)."""

    shares: bool
    unknown: bool
    why: str
    manifest: Manifest | None = None

    @property
    def may_be_referenced(self) -> bool:
        """Whether a delete or gc must scan for references before freeing the attempt."""
        return self.shares or self.unknown


def attempt_sharing(storage: Storage, attempt_dir: str, *,
                    has_manifest: bool | None = None) -> Sharing:
    """The rule of `Sharing` for the attempt directory ``attempt_dir`` (from the run root):
    one read of its ``MANIFEST.json`` (none when ``has_manifest`` is False: the caller's
    listing shows none).  Storage failures other than a missing manifest propagate."""
    mpath = f"{attempt_dir}/{MANIFEST_NAME}"
    where = storage_url(storage, mpath)
    if has_manifest is False:
        return Sharing(False, False, "it has no MANIFEST.json")
    try:
        data = storage.read_bytes(mpath)
    except StorageNotFoundError:
        return Sharing(False, False, "it has no MANIFEST.json")
    try:
        manifest = decode_manifest(data, where=where)
    except FormatVersionError as exc:
        return Sharing(False, True, f"its manifest is of a newer format: {exc}")
    except CorruptCheckpointError as exc:
        return Sharing(False, True, f"its manifest does not decode: {exc}")
    if REFERENCES not in features(manifest):
        return Sharing(False, False, f"it is a format v{manifest.format_version} attempt, "
                       "whose files are never referenced", manifest)
    return Sharing(True, False, "", manifest)


def reference_target_problems(storage: Storage, attempt_dir: str, refs: list[Reference], *,
                              has_manifest: bool | None = None) -> list[tuple[Reference, str]]:
    """The references of ``refs`` (all into ``attempt_dir``) that the rule refuses, each with
    what is wrong: the attempt's files may not be referenced (`attempt_sharing`: a delete
    or gc would free them without looking for references), or the referenced file is not one
    of that attempt's own files (a reference names the file that holds the bytes, never
    another reference).  One read of the attempt's manifest."""
    sharing = attempt_sharing(storage, attempt_dir, has_manifest=has_manifest)
    if not sharing.shares:
        return [(r, f"references {r.location}, in an attempt whose files may not be "
                    f"referenced ({sharing.why}): a delete or gc frees such files without "
                    "looking for references") for r in refs]
    assert sharing.manifest is not None
    own = {e.path for e in sharing.manifest.files}
    return [(r, f"references {r.location}, which is not one of the files that attempt's "
                "manifest lists (a reference names the file holding the bytes)")
            for r in refs if r.source not in own]


# -- deleting a step --------------------------------------------------------------------------


def shared_attempts(storage: Storage, paths: StepPaths) -> list[str]:
    """Attempts of the step directory whose files another checkpoint may reference
    (`attempt_sharing`: a format with references, or a manifest that does not decode).
    One listing of the step directory and one read per attempt directory."""
    out = []
    for child in storage.list_dir(paths.dir):
        name = child.basename
        if not child.is_dir or parse_attempt_name(name) is None:
            continue  # .tmp- attempts never committed under that name: never referenced
        if attempt_sharing(storage, paths.attempt_dir(name)).may_be_referenced:
            out.append(name)
    return out


def may_be_referenced(storage: Storage, attempt_dir: str, files: list[Entry]) -> bool:
    """gc's question for an old uncommitted attempt whose listing is ``files``: whether
    another checkpoint may reference its files (`attempt_sharing`), so that it is freed
    only after the reference scan."""
    has = any(e.basename == MANIFEST_NAME for e in files)
    return attempt_sharing(storage, attempt_dir, has_manifest=has).may_be_referenced


def free_unreferenced(storage: Storage, attempt_dir: str, refs: References, *,
                      dry_run: bool = False) -> int:
    """Delete the files of a retired attempt that nothing references (its ``state.msgpack``,
    the files of tensors that changed since), keeping its referenced files and its
    ``MANIFEST.json`` (what tells a later delete or gc that the attempt is format v3 and may be
    referenced).  Returns the bytes freed.  Safe for the reason the scan is (§9.5): a save can
    reference only a file its protector references, which the scan kept."""
    freed = 0
    for e in storage.list_tree(attempt_dir):
        if e.name in refs or e.basename == MANIFEST_NAME or e.is_link:
            continue
        if not dry_run:
            try:
                storage.delete(e.name)
            except StorageNotFoundError:
                continue  # another delete or gc freed it first
        freed += e.size
    return freed


def free_step(storage: Storage, paths: StepPaths, *, grace_s: float,
              now: datetime | None = None) -> list[str]:
    """Called after the step's marker was deleted: scan for references, then delete every
    entry of the step directory except the attempts holding a referenced file, which are
    *retired* (logged): only their referenced files and manifest are kept
    (`free_unreferenced`).  Returns the retired attempts.  Raises what
    `scan_references` raises, having deleted nothing."""
    refs = scan_references(storage, grace_s=grace_s, skip_step=paths.step, now=now)
    used = referenced_attempts(refs)
    children = storage.list_dir(paths.dir)
    kept = [c.basename for c in children
            if (paths.step, c.basename.removeprefix(TMP_PREFIX)) in used]
    if not kept:
        storage.delete_tree(paths.dir)
        return []
    for child in children:
        if child.basename in kept:
            freed = free_unreferenced(storage, child.name, refs)
            log.info("step %d at %s: attempt %s retired (no marker; %d B of its files are "
                     "referenced by other checkpoints and kept, %d B freed); garbage "
                     "collection removes the rest once nothing references it", paths.step,
                     storage.url, child.basename,
                     used[(paths.step, child.basename.removeprefix(TMP_PREFIX))], freed)
        elif child.is_dir:
            storage.delete_tree(child.name)
        else:
            storage.delete(child.name)
    return kept


# -- what a run stores (ckptfs ls) ------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointUsage:
    """Sizes of one committed checkpoint.  ``bytes``: its logical size (a full load reads
    this much); ``bytes_written``: its own files; ``exclusive_bytes``: what deleting it would
    free (its own files that no other committed checkpoint references: a referenced file is
    kept, with the attempt's manifest); ``None`` when an unreadable committed checkpoint makes
    it unknown."""

    step: int
    attempt: str
    bytes: int
    bytes_written: int
    exclusive_bytes: int | None


@dataclass
class RunUsage:
    """What a run stores: each committed checkpoint's sizes, the retired attempts (no marker,
    files referenced by a committed checkpoint) and ``stored_bytes``, every file of every
    committed or retired attempt (manifests included)."""

    checkpoints: list[CheckpointUsage] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    stored_bytes: int = 0
    unreadable: dict[int, str] = field(default_factory=dict)


def run_usage(storage: Storage) -> RunUsage:
    """Sizes of every committed checkpoint and the run's stored bytes, from one listing and
    the marker and manifest of each committed step."""
    committed = read_all_committed(storage)
    usage = RunUsage(unreadable={parse_step_dir(n) or 0: str(e)
                                 for n, e in committed.unreadable.items()})
    by_checkpoint = {(i.step, i.attempt): set(referenced_chunks([i.manifest]))
                     for i in committed.infos}
    for info in committed.infos:
        key = (info.step, info.attempt)
        used_by_others: set[str] = set()
        for other, files in by_checkpoint.items():
            if other != key:
                used_by_others |= files
        # what a delete frees: its own files no other committed checkpoint references
        free = sum(f.size for f in info.manifest.files
                   if f"{info.path}/{f.path}" not in used_by_others)
        exclusive = None if committed.unreadable else free
        usage.checkpoints.append(CheckpointUsage(info.step, info.attempt, info.bytes,
                                                 info.bytes_written, exclusive))
    usage.checkpoints.sort(key=lambda c: c.step)
    live = {(c.step, c.attempt) for c in usage.checkpoints}
    used_anywhere = {location_attempt(loc) for files in by_checkpoint.values() for loc in files}
    retired: set[tuple[str, str]] = set()
    for entry in committed.listing:
        parts = _parts(entry)
        if len(parts) < 4 or parts[0] != CHECKPOINTS_DIR:
            continue
        step = parse_step_dir(parts[1])
        if step is None:
            continue
        key = (step, parts[2])
        if key in live:
            usage.stored_bytes += entry.size
        elif key in used_anywhere:
            usage.stored_bytes += entry.size
            retired.add((parts[1], parts[2]))
    usage.retired = sorted(f"{CHECKPOINTS_DIR}/{d}/{a}" for d, a in retired)
    return usage


__all__ = ["CheckpointUsage", "Committed", "References", "RunUsage", "Sharing",
           "attempt_sharing", "free_step", "location_attempt", "may_be_referenced",
           "read_all_committed", "reference_target_problems", "referenced_attempts",
           "run_usage", "scan_references", "shared_attempts"]
