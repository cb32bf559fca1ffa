"""Garbage collection: what crashed or losing writers leave behind.

Four kinds of garbage, each removed only when it is older than a grace period:

- **uncommitted attempts**: ``checkpoints/step-N/a-<UTC time>-<token>/`` directories that the
  step's marker does not name (a crash before the commit, or the loser of a race).  The age is
  read from the attempt *name* (its UTC creation time), not from storage timestamps, so it is the
  same on every backend and a writer that is still running (a young attempt) always survives;
- **temporary directories and files**: ``.tmp-a-...`` attempt directories on local disk (a crash
  before the rename; aged by the attempt name they embed) and ``.tmp-<uuid>`` files of a crashed
  local marker creation (aged by the file's modification time where the storage offers
  `ModifiedTimes`; never removed when it does not);
- **empty step directories** (local disk) that a crashed save left with nothing in them: aged
  by the directory's modification time (the last entry made or removed in it; never removed
  where the storage offers no `ModifiedTimes`), removed by a non-recursive ``rmdir`` that
  never takes what a writer put in it meanwhile.  (A step directory whose attempts gc removes
  in the same run goes with them.)  A failed save removes its own empty step directory when
  it discards its attempt;
- **orphaned multipart uploads** of files inside attempt directories
  (``checkpoints/step-N/a-.../<file>``, also ``.tmp-a-...`` and under ``artifacts/<name>/``) on
  stores that have them (S3): found and aborted through the storage interface's optional
  `MultipartUploads` capability, only where the storage offers it
  (a declared capability, never a URL test).  Any other upload, under the run root or
  elsewhere in the bucket (``run/exports/model.bin``), belongs to another program and is never
  touched.

Concurrent ``gc`` and ``prune`` runs on one run root are safe: something another process
removed first is noted (``note``), not reported as a failure.

Incremental (format v3, v4) attempts share bytes: an uncommitted attempt older than the grace
that may be referenced (`ckptfs.protocol.references.attempt_sharing`, the rule readers
enforce too: a manifest with references, or one that does not decode) is removed only if none
of its files is referenced.  Every
step's marker is read first, then one reference scan runs with gc's grace
(`ckptfs.protocol.references.scan_references`, docs/protocol.md §9.5), then gc decides.
An attempt still referenced (*retired* by a delete) is kept and reported in
`GcReport.retired` with the bytes it keeps stored; if a committed manifest cannot be read,
every such attempt is kept and the refusal is listed in ``skipped``.

A step's committed attempt and its marker are never touched; a step whose marker does not parse
is left alone entirely (that is for ``verify`` and a human, not for a collector).  Everything
removed (or that would be, with ``dry_run``) is listed with its size in a `GcReport`.
Artifacts (``artifacts/<name>/``) are collected the same way.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, cast

from ckptfs.errors import CkptfsError, CorruptCheckpointError, StorageError, StorageNotFoundError
from ckptfs.format.incremental import DEFAULT_GRACE_S, DEFAULT_LEASE_S
from ckptfs.format.layout import (
    CHECKPOINTS_DIR,
    MARKER_NAME,
    TMP_PREFIX,
    StepPaths,
    parse_attempt_name,
    parse_step_dir,
)
from ckptfs.protocol.references import (
    References,
    free_unreferenced,
    may_be_referenced,
    referenced_attempts,
    scan_references,
)
from ckptfs.protocol.resolve import read_marker
from ckptfs.storage.base import (
    EmptyDirRemoval,
    ModifiedTimes,
    MultipartUploads,
    Storage,
    supports,
)
from ckptfs.storage.sub import SubStorage

log = logging.getLogger("ckptfs")

DEFAULT_GRACE = timedelta(seconds=DEFAULT_GRACE_S)
ARTIFACTS_DIR = "artifacts"


@dataclass
class GcItem:
    kind: str  # "attempt" | "tmp" | "tmp-file" | "multipart" | "empty-step" | "retired"
    path: str
    bytes: int
    age_s: float | None
    removed: bool = False
    error: str | None = None
    #: why an item was not removed without that being a failure (another gc or prune removed
    #: it first; a writer put something in an empty step directory meanwhile)
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "bytes": self.bytes,
                "age_s": None if self.age_s is None else round(self.age_s, 1),
                "removed": self.removed, "error": self.error, "note": self.note}


@dataclass
class GcReport:
    url: str
    dry_run: bool
    grace_s: float
    items: list[GcItem] = field(default_factory=list)
    kept_young: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    #: uncommitted incremental attempts kept because committed (or in-flight) checkpoints
    #: reference their files (kind "retired"; ``bytes``: what they keep stored)
    retired: list[GcItem] = field(default_factory=list)

    @property
    def bytes_retired(self) -> int:
        return sum(i.bytes for i in self.retired)

    @property
    def bytes_freed(self) -> int:
        return sum(i.bytes for i in self.items if i.removed)

    @property
    def bytes_found(self) -> int:
        return sum(i.bytes for i in self.items)

    def as_dict(self) -> dict[str, Any]:
        return {"url": self.url, "dry_run": self.dry_run, "grace_s": self.grace_s,
                "items": [i.as_dict() for i in self.items], "bytes_freed": self.bytes_freed,
                "bytes_found": self.bytes_found, "kept_young": self.kept_young,
                "skipped": self.skipped, "retired": [i.as_dict() for i in self.retired],
                "bytes_retired": self.bytes_retired}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``1h``, ``2d``, ``1h30m`` or plain seconds -> timedelta."""
    text = text.strip().lower()
    if re.fullmatch(r"[0-9]+(\.[0-9]+)?", text):
        return _seconds(float(text), text)
    parts = re.findall(r"([0-9]+(?:\.[0-9]+)?)([smhd])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise InvalidDurationError(f"bad duration {text!r}: use e.g. 90s, 15m, 1h, 2d or 1h30m")
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return _seconds(sum(float(n) * unit[u] for n, u in parts), text)


class InvalidDurationError(CkptfsError, ValueError):
    """A grace period that is not a duration `parse_duration` reads, or is too long."""


MAX_GRACE = timedelta(days=36500)


def _seconds(value: float, text: str) -> timedelta:
    if not value <= MAX_GRACE.total_seconds():  # also catches inf from a huge digit string
        raise InvalidDurationError(f"duration {text!r:.40} is longer than "
                                   f"{MAX_GRACE.days} days")
    return timedelta(seconds=value)


def collect(storage: Storage, *, older_than: timedelta = DEFAULT_GRACE, dry_run: bool = False,
            now: datetime | None = None, multipart: bool = True) -> GcReport:
    """Remove garbage older than ``older_than`` under a run root (checkpoints and artifacts)."""
    now = now or datetime.now(timezone.utc)
    report = GcReport(storage.url, dry_run, older_than.total_seconds())
    for prefix in ["", *_artifact_prefixes(storage)]:
        _collect_checkpoints(storage, prefix, older_than, now, report, dry_run)
    if multipart:
        _collect_multipart(storage, older_than, now, report)
    for item in report.items:
        if dry_run or item.kind == "multipart":
            continue
        try:
            if item.kind == "empty-step":
                item.note = _remove_empty_dir(storage, item.path)
                if item.note is not None:
                    continue
            elif item.kind == "tmp-file":
                storage.delete(item.path)
            else:
                storage.delete_tree(item.path)
            item.removed = True
            log.info("gc: removed %s (%d bytes)", item.path, item.bytes)
        except StorageNotFoundError:  # another gc or prune removed it first: not a failure
            item.note = "already removed by another process"
        except StorageError as exc:
            item.error = str(exc)
            log.warning("gc: could not remove %s/%s: %s", storage.url, item.path, exc)
    return report


def _artifact_prefixes(storage: Storage) -> list[str]:
    return [f"{e.name.rstrip('/')}/" for e in storage.list_dir(ARTIFACTS_DIR) if e.is_dir]


@dataclass
class _StepScan:
    """One step directory as gc listed it: its entry count, whether it is committed, and the
    items found in it (removal candidates)."""

    path: str
    entries: int
    committed: bool
    items: list[GcItem] = field(default_factory=list)


def _collect_checkpoints(storage: Storage, prefix: str, grace: timedelta, now: datetime,
                         report: GcReport, dry_run: bool = False) -> None:
    base = f"{prefix}{CHECKPOINTS_DIR}"
    sub = SubStorage(storage, prefix.rstrip("/")) if prefix else storage
    steps: list[_StepScan] = []
    shared: dict[int, tuple[int, str]] = {}  # id(item) -> (step, attempt): v3, maybe used
    for step_entry in storage.list_dir(base):
        step = parse_step_dir(step_entry.basename)
        if step is None or not step_entry.is_dir:
            continue
        step_dir = f"{base}/{step_entry.basename}"
        children = storage.list_dir(step_dir)
        committed: str | None = None
        if any(c.basename == MARKER_NAME for c in children):
            try:
                committed = _marker_attempt(storage, prefix, step, step_entry.basename)
            except CorruptCheckpointError as exc:
                report.skipped.append(f"{step_dir}: marker does not parse ({exc}); left alone")
                continue
        scan = _StepScan(step_dir, len(children), committed is not None)
        steps.append(scan)
        if not children:  # left empty by a crashed save: removed once older than the grace
            _consider_empty_step(storage, step_dir, grace, now, report)
            continue
        for child in children:
            name = child.basename
            if name in (MARKER_NAME, committed):
                continue
            path = f"{step_dir}/{name}"
            if name.startswith(TMP_PREFIX):
                created = parse_attempt_name(name[len(TMP_PREFIX):])
                if created is None:
                    _consider_tmp_file(storage, path, child.size, grace, now, report)
                    continue
                kind = "tmp"
            else:
                created = parse_attempt_name(name)
                if created is None:
                    continue  # not ours: never delete what the layout does not name
                kind = "attempt"
            age = now - created
            if age < grace:
                report.kept_young.append(path)
                continue
            files = storage.list_tree(path) if child.is_dir else []
            size = sum(e.size for e in files) if child.is_dir else child.size
            item = GcItem(kind, path, size, age.total_seconds())
            scan.items.append(item)
            if kind == "attempt" and may_be_referenced(
                    sub, StepPaths(step, step_entry.basename).attempt_dir(name), files):
                shared[id(item)] = (step, name)
    # Every marker above was read before this scan starts (docs/protocol.md §9.5): an
    # attempt found uncommitted is freed only if nothing read after its marker went away
    # references it.
    refs = _referenced(sub, base, grace, now, report) if shared else {}
    used = None if refs is None else referenced_attempts(refs)
    for scan in steps:
        removable = 0
        for item in scan.items:
            key = shared.get(id(item))
            if key is not None and (used is None or key in used):
                kept = "unknown" if used is None else f"{used[key]} B"
                freed = 0 if refs is None else free_unreferenced(
                    sub, item.path[len(prefix):], refs, dry_run=dry_run)
                report.retired.append(GcItem(
                    "retired", item.path, item.bytes - freed, item.age_s,
                    note=f"kept: no marker, but {kept} of its files are referenced by "
                         f"committed (or in-flight) checkpoints; {freed} B of its other files "
                         f"{'would be ' if dry_run else ''}freed"))
                continue
            report.items.append(item)
            removable += 1
        if not scan.committed and removable and removable == scan.entries:
            report.items.append(GcItem("empty-step", scan.path, 0, None))


def _referenced(storage: Storage, base: str, grace: timedelta, now: datetime,
                report: GcReport) -> References | None:
    """The referenced files (one scan of the run root, with gc's grace), or ``None`` (keep
    every v3 attempt whole) when a committed manifest cannot be read."""
    if grace.total_seconds() < DEFAULT_LEASE_S:
        log.warning("gc at %s: grace %s is shorter than the default lease of an incremental "
                    "save (%d s): an in-flight save's references are protected only while it "
                    "is younger than the grace (keep the grace above every saver's lease_s "
                    "plus clock skew)", storage.url, grace, DEFAULT_LEASE_S)
    try:
        return scan_references(storage, grace_s=grace.total_seconds(), now=now)
    except CorruptCheckpointError as exc:
        report.skipped.append(f"{base}: uncommitted incremental attempts kept: {exc}")
        log.warning("gc at %s: %s", storage.url, exc)
        return None


def _marker_attempt(storage: Storage, prefix: str, step: int, name: str) -> str | None:
    # ``name``: the listed step directory (never rebuilt from ``step``: step-0000000000020).
    marker = read_marker(SubStorage(storage, prefix.rstrip("/")) if prefix else storage, step,
                         name)
    return marker.attempt if marker is not None else None


def _consider_tmp_file(storage: Storage, path: str, size: int, grace: timedelta, now: datetime,
                       report: GcReport) -> None:
    mtime = _mtime(storage, path)
    if mtime is None:
        report.skipped.append(f"{path}: temporary file of unknown age; left alone")
        return
    age = now - mtime
    if age < grace:
        report.kept_young.append(path)
        return
    report.items.append(GcItem("tmp-file", path, size, age.total_seconds()))


def _consider_empty_step(storage: Storage, path: str, grace: timedelta, now: datetime,
                         report: GcReport) -> None:
    """A step directory with nothing in it (a save that crashed after making it, before or
    after its attempt directory was removed): removed by gc like an attempt, once its
    modification time (the last entry made or removed in it) is older than the grace, so the
    directory a writer made a moment ago for its attempt survives; the removal is a
    non-recursive ``rmdir`` (`_remove_empty_dir`), so what a writer put in it meanwhile is
    never removed.  Unknown age: left alone."""
    mtime = _mtime(storage, path)
    if mtime is None:
        report.skipped.append(f"{path}: empty step directory of unknown age; left alone")
        return
    age = now - mtime
    if age < grace:
        report.kept_young.append(path)
        return
    report.items.append(GcItem("empty-step", path, 0, age.total_seconds()))


def _mtime(storage: Storage, path: str) -> datetime | None:
    """The file's modification time where the storage offers them
    (`ModifiedTimes`); ``None`` (unknown) otherwise or when it
    cannot be read."""
    if not supports(storage, ModifiedTimes):
        return None
    try:
        return cast(ModifiedTimes, storage).modified(path)
    except StorageError:
        return None


def _remove_empty_dir(storage: Storage, path: str) -> str | None:
    """Remove a step directory left empty, without ever removing something a writer created in
    it meanwhile: non-recursive ``rmdir`` where directories are real
    (`EmptyDirRemoval`); object stores have no empty directories to
    remove.  Returns why it was not removed when that is no failure (gone already; not empty
    any more), ``None`` once removed."""
    if not storage.capabilities.real_directories:
        return None
    if not supports(storage, EmptyDirRemoval):
        return "left in place: this storage cannot remove only an empty directory"
    try:
        removed = cast(EmptyDirRemoval, storage).remove_empty_dir(path)
    except StorageNotFoundError:
        return "already removed by another process"
    if not removed:
        return "not empty any more (a writer started an attempt in it): left alone"
    return None


def owned_upload_time(rel: str) -> datetime | None:
    """The attempt's creation time if ``rel`` (a key relative to the run root) names a file
    inside an attempt directory, the only place ckptfs streams multi-part uploads to::

        checkpoints/step-N/a-<time>-<token>/<file>          (or .tmp-a-...)
        artifacts/<name>/checkpoints/step-N/a-<time>-<token>/<file>

    ``None`` for every other key: an upload there is not ckptfs's, and GC never aborts it."""
    parts = rel.split("/")
    if len(parts) >= 2 and parts[0] == ARTIFACTS_DIR:
        parts = parts[2:]
    if (len(parts) < 4 or parts[0] != CHECKPOINTS_DIR or parse_step_dir(parts[1]) is None
            or not all(parts[3:])):
        return None
    return parse_attempt_name(parts[2].removeprefix(TMP_PREFIX))


def _upload_age(initiated: datetime | None, created: datetime, now: datetime) -> timedelta:
    """Age of a multipart upload: from the server's ``Initiated`` time and the attempt name's
    time, whichever is younger (an emulator may report a fixed ``Initiated``; moto says
    2010-11-10 for every upload)."""
    times = [created]
    if initiated is not None:
        times.append(initiated)
    return now - max(times)


def _collect_multipart(storage: Storage, grace: timedelta, now: datetime,
                       report: GcReport) -> None:
    if not supports(storage, MultipartUploads):
        return
    uploads_api = cast(MultipartUploads, storage)
    try:
        uploads = uploads_api.list_uploads("")
    except StorageError as exc:
        report.skipped.append(f"multipart uploads under {storage.url}: listing failed ({exc})")
        return
    for up in uploads:
        created = owned_upload_time(up.path)
        if created is None:
            continue  # not an attempt file: another program's upload, never touched
        age = _upload_age(up.initiated, created, now)
        if age < grace:
            report.kept_young.append(f"multipart:{up.path}")
            continue
        item = GcItem("multipart", f"multipart:{up.path}#{up.upload_id}", up.size,
                      age.total_seconds())
        report.items.append(item)
        if report.dry_run:
            continue
        try:
            if uploads_api.abort_upload(up):
                item.removed = True
            else:  # aborted or completed meanwhile (another gc)
                item.note = "already gone (aborted by another process, or completed)"
        except StorageError as exc:
            item.error = f"{type(exc).__name__}: {exc}"
