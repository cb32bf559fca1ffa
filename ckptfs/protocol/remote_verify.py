"""Verify a committed checkpoint's copy on an object store from metadata requests alone.

A writer records, per file, the whole-object checksum the store itself keeps
(``files[].store_checksums``, docs/protocol.md section 2.1), computed in the same pass as the
content digest.  `verify_remote` reads the checkpoint's marker and manifest (as every
reader does), lists the attempt once with the listing checks every verify runs
(`ckptfs.protocol.listing`: missing, resized and stray files, links) and asks the store for
each file's stored checksum (one metadata request per file: ``HeadObject`` on S3, the object's
metadata on GCS), reading none of the data.  Each file is reported as ``match``, ``mismatch``
or ``not available`` (the store keeps no comparable checksum for it, or the manifest recorded
none): never counted as a pass.  A listing finding (a missing or resized file, a file the
manifest does not list, a link) is a ``mismatch``, as a full verify reports it.  See
docs/remote-verify.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptfs.errors import RemoteChecksumMismatchError
from ckptfs.protocol.listing import list_attempt, problems
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.storage.base import ServerChecksums, Storage, StoredChecksum, supports

Status = Literal["match", "mismatch", "not available"]


@dataclass(frozen=True)
class RemoteFileResult:
    path: str
    status: Status
    #: Why, in words (the algorithm compared, or what is missing).
    detail: str


@dataclass
class RemoteVerifyReport:
    step: int
    attempt: str
    url: str
    files: list[RemoteFileResult] = field(default_factory=list)
    #: Metadata requests made for the per-file checks (one listing, one per file).
    requests: int = 0

    def count(self, status: Status) -> int:
        return sum(1 for f in self.files if f.status == status)

    @property
    def ok(self) -> bool:
        """No mismatch.  Files ``not available`` are not mismatches, and not passes either:
        `complete` says whether every file was compared."""
        return self.count("mismatch") == 0

    @property
    def complete(self) -> bool:
        """Every file was compared and matched."""
        return all(f.status == "match" for f in self.files)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "attempt": self.attempt, "url": self.url, "mode": "remote",
                "ok": self.ok, "complete": self.complete, "requests": self.requests,
                "match": self.count("match"), "mismatch": self.count("mismatch"),
                "not_available": self.count("not available"),
                "files": [{"path": f.path, "status": f.status, "detail": f.detail}
                          for f in self.files]}


def verify_remote(storage: Storage, info: CheckpointInfo) -> RemoteVerifyReport:
    """Compare each of ``info``'s own files with the store's stored checksum (see the module
    docstring).  Raises `RemoteChecksumMismatchError` (with the report) if any
    file mismatches, is missing or resized; returns the report otherwise (check
    `RemoteVerifyReport.complete`: files the store cannot vouch for are ``not
    available``)."""
    report = RemoteVerifyReport(info.step, info.attempt, info.url)
    base = info.path
    listing = list_attempt(storage, info)  # the listing checks of every verify
    report.requests += 1
    for entry in info.manifest.files:
        full = f"{base}/{entry.path}"
        size = listing.sizes.get(entry.path)
        if size is None:
            report.files.append(RemoteFileResult(entry.path, "mismatch", "missing"))
            continue
        if size != entry.size:
            report.files.append(RemoteFileResult(
                entry.path, "mismatch", f"{size} bytes stored, {entry.size} in the manifest"))
            continue
        result, asked = compare_stored(storage, full, entry.path, entry.store_checksums)
        report.requests += asked
        report.files.append(result)
    # What else the listing shows (a stray file, a link), as a full verify reports it.
    for p in problems(info, listing):
        if p.kind in ("stray", "link"):
            path, what = p.text.split(": ", 1)
            report.files.append(RemoteFileResult(path, "mismatch", what))
    bad = [f for f in report.files if f.status == "mismatch"]
    if bad:
        raise RemoteChecksumMismatchError(
            f"step {info.step} at {info.url} fails remote verification: "
            + "; ".join(f"{f.path}: {f.detail}" for f in bad),
            step=info.step, path=info.path, report=report)
    return report


def compare_stored(storage: Storage, full: str, path: str,
                   recorded: Iterable[tuple[str, str]]) -> tuple[RemoteFileResult, int]:
    """Compare the store's checksum of the object ``full`` (``path`` in the report) with the
    ``recorded`` ``(algorithm, hex)`` pairs; and the number of requests made (0 or 1).  Used by
    `verify_remote` and by a copy before it commits (``copy_step(check_stored=True)``)."""
    wanted = dict(recorded)
    if not supports(storage, ServerChecksums):
        return RemoteFileResult(
            path, "not available",
            f"{storage.capabilities.protocol}: the store keeps no whole-object checksum ckptfs "
            "can compare"), 0
    if not wanted:
        return RemoteFileResult(
            path, "not available", "the manifest records no store checksum (written before "
            "store checksums were recorded, or by a writer that does not record them)"), 0
    stored: StoredChecksum | None = storage.server_checksum(full)  # type: ignore[attr-defined]
    return _compare(path, wanted, stored), 1


def _compare(path: str, recorded: dict[str, str], stored: StoredChecksum | None
             ) -> RemoteFileResult:
    if stored is None:
        return RemoteFileResult(path, "not available",
                                "the store keeps no full-object checksum for this object "
                                "(e.g. an S3 multi-part upload without one)")
    want = recorded.get(stored.algorithm)
    if want is None:
        return RemoteFileResult(
            path, "not available",
            f"the store keeps {stored.algorithm}, the manifest records "
            f"{', '.join(sorted(recorded))}")
    if want != stored.hexdigest:
        return RemoteFileResult(
            path, "mismatch",
            f"{stored.algorithm} {stored.hexdigest} stored, {want} in the manifest")
    return RemoteFileResult(path, "match", f"{stored.algorithm} {want}")
