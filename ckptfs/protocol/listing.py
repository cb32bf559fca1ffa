"""The listing checks of a committed checkpoint, shared by every format, by load, verify and
copy: one listing of the attempt, compared with the manifest, before any file is read.

What a listing can show, and what each reader does with it:

==============================  =====================================  ======================
finding                         load / copy (`check_listing`)    verify (report)
==============================  =====================================  ======================
a symbolic link (the step or    `UnsafeCheckpointError`         "symbolic link
attempt directory, any file)                                           (refused)"
a listed file missing           `CorruptCheckpointError`        "missing"
a listed file of another size   `CorruptCheckpointError`        "size ..."
a file the manifest does not    ignored, logged                        "not in the manifest
list (stray)                                                           (stray file)"
==============================  =====================================  ======================

Sizes are compared here, from the listing, before any buffer is allocated: a manifest that
declares a 1 PiB file fails as corrupt instead of making a reader allocate (or request) what it
declares.  Before that, without any I/O, `check_listing` refuses a document whose size the
format bounds (the format table's `document_limits`: v1
``state.msgpack``, v2 ``dcp.msgpack``) declared beyond its limit, as
`UnsafeCheckpointError`: what the document's own reader raises, whichever reader gets
there first (a collective load reads ``dcp.msgpack`` before the coordinator lists).

Links are found from the listing alone (``Entry.is_link``, part of the
`Storage` interface), so a storage wrapper that implements exactly
that interface keeps the refusal.  Directory links are looked for where directories are real
(``capabilities.real_directories``): object stores have none.

``files``: the files a selective load will read (``keys=``); a missing or resized file it will
not read does not stop it (verify still reports it).

The write side's check is here too (`check_written`): before a sharded save commits, its
coordinator, and each rank for its own file, list the attempt and find every file written
with its size, and none a link.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from ckptfs.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptfs.format.incremental import Reference, references_of
from ckptfs.format.layout import CHECKPOINTS_DIR, MANIFEST_NAME
from ckptfs.format.manifest import FileEntry
from ckptfs.format.versions import document_limits
from ckptfs.protocol.references import reference_target_problems
from ckptfs.protocol.resolve import CheckpointInfo, storage_url
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")


@dataclass(frozen=True)
class Problem:
    kind: str  # "link" | "missing" | "size" | "stray" | "target" (a reference's attempt)
    path: str  # relative to the run root
    text: str  # for a verify report: "<relpath>: <what>"

    def error(self, storage: Storage, info: CheckpointInfo) -> CorruptCheckpointError:
        return self.error_at(storage, info.step)

    def error_at(self, storage: Storage, step: int, *, suffix: str = ""
                 ) -> CorruptCheckpointError:
        """The typed error of this finding about ``step`` (``suffix``: appended to its
        message)."""
        where = storage_url(storage, self.path)
        if self.kind == "link":
            return UnsafeCheckpointError(
                f"{where} is a symbolic link; a checkpoint may not contain links (they can "
                f"point outside it). Refusing to read it{suffix}", step=step, path=self.path)
        what = self.text.split(": ", 1)[1]
        return CorruptCheckpointError(f"{where}: {what}{suffix}", step=step, path=self.path)


@dataclass
class AttemptListing:
    """One listing of a committed attempt: every file's size, and every symbolic link."""

    sizes: dict[str, int] = field(default_factory=dict)  # relpath -> size (links excluded)
    links: list[str] = field(default_factory=list)       # paths relative to the run root


def list_attempt(storage: Storage, info: CheckpointInfo) -> AttemptListing:
    out = AttemptListing()
    if storage.capabilities.real_directories:
        for parent, name in ((CHECKPOINTS_DIR, info.paths.dir_name),
                             (info.paths.dir, info.attempt)):
            for e in storage.list_dir(parent):
                if e.basename == name and e.is_link:
                    out.links.append(f"{parent}/{name}")
        if out.links:
            return out  # never list through a linked directory
    prefix = info.path + "/"
    for e in storage.list_tree(info.path):
        if not e.name.startswith(prefix):
            continue
        if e.is_link:
            out.links.append(e.name)
        else:
            out.sizes[e.name[len(prefix):]] = e.size
    return out


def problems(info: CheckpointInfo, listing: AttemptListing,
             files: Iterable[FileEntry] | None = None) -> list[Problem]:
    """Every finding of the table above, links first, then in manifest order, strays last."""
    prefix = info.path + "/"
    out = [Problem("link", p, f"{p.removeprefix(prefix)}: symbolic link (refused)")
           for p in listing.links]
    found = dict(listing.sizes)
    found.pop(MANIFEST_NAME, None)
    wanted = None if files is None else {e.path for e in files}
    for entry in info.manifest.files:
        size = found.pop(entry.path, None)
        if wanted is not None and entry.path not in wanted:
            continue
        if size is None:
            out.append(Problem("missing", prefix + entry.path,
                               f"{entry.path}: listed in the manifest but missing"))
        elif size != entry.size:
            out.append(Problem("size", prefix + entry.path,
                               f"{entry.path}: size differs from the manifest (declared "
                               f"{entry.size} B, found {size} B)"))
    out += [Problem("stray", prefix + s, f"{s}: not in the manifest (stray file)")
            for s in sorted(found)]
    return out


def reference_problems(storage: Storage, info: CheckpointInfo,
                       refs: Iterable[Reference] | None = None) -> list[Problem]:
    """The listing findings of the files a checkpoint references (formats v3 and v4, §9): each
    referenced file present in its attempt, of the size the reference declares, and neither it
    nor its step or attempt directory a link.  One listing per referenced attempt.  ``refs``:
    these references only (a selective load); default every reference of ``info``."""
    return dangling_references(storage, references_of(info.manifest) if refs is None else refs)


def dangling_references(storage: Storage, refs: Iterable[Reference]) -> list[Problem]:
    """`reference_problems` of the references ``refs`` (of a checkpoint committed or about to
    be: `ckptfs.protocol.commit.Attempt.commit` refuses, before the marker, a manifest with
    any finding here, for every writer)."""
    by_dir: dict[str, list[Reference]] = {}
    for ref in refs:
        by_dir.setdefault(ref.attempt_dir, []).append(ref)
    out: list[Problem] = []
    for adir, members in sorted(by_dir.items()):
        step_dir, attempt = adir.rsplit("/", 1)
        linked = False
        if storage.capabilities.real_directories:
            for parent, name in ((CHECKPOINTS_DIR, step_dir.rsplit("/", 1)[1]),
                                 (step_dir, attempt)):
                for e in storage.list_dir(parent):
                    if e.basename == name and e.is_link:
                        out.append(Problem("link", f"{parent}/{name}",
                                           f"{parent}/{name}: symbolic link (refused)"))
                        linked = True
        if linked:
            continue
        sizes: dict[str, int] = {}
        links: set[str] = set()
        for e in storage.list_tree(adir):
            if e.is_link:
                links.add(e.name)
            else:
                sizes[e.name] = e.size
        for ref in members:
            loc = ref.location
            if loc in links:
                out.append(Problem("link", loc, f"{ref.path}: references {loc}, a symbolic "
                                                "link (refused)"))
            elif loc not in sizes:
                out.append(Problem("missing", loc, f"{ref.path}: references {loc}, which is "
                                                   "missing (deleted while this checkpoint "
                                                   "needs it)"))
            elif sizes[loc] != ref.size:
                out.append(Problem("size", loc, f"{ref.path}: references {loc}, whose size "
                                                f"differs (declared {ref.size} B, found "
                                                f"{sizes[loc]} B)"))
        # the one rule deletes assume too: only files of a format with references are used
        has_manifest = f"{adir}/{MANIFEST_NAME}" in sizes
        for ref, what in reference_target_problems(storage, adir, members,
                                                    has_manifest=has_manifest):
            out.append(Problem("target", ref.location, f"{ref.path}: {what}"))
    return out


def check_references(storage: Storage, info: CheckpointInfo,
                     refs: Iterable[Reference] | None = None) -> None:
    """Raise the first `reference_problems` finding as its typed error."""
    for p in reference_problems(storage, info, refs):
        raise p.error(storage, info)


def check_document_sizes(storage: Storage, info: CheckpointInfo) -> None:
    """`UnsafeCheckpointError` for a document of ``info``'s format whose declared size
    exceeds the limit its reader enforces (no I/O)."""
    limits = document_limits(info.manifest)
    for entry in info.manifest.files:
        limit = limits.get(entry.path)
        if limit is not None and entry.size > limit:
            path = f"{info.path}/{entry.path}"
            raise UnsafeCheckpointError(
                f"{storage_url(storage, path)}: declared size {entry.size} B exceeds the "
                f"{limit} B a reader accepts for it", step=info.step, path=path)


def check_listing(storage: Storage, info: CheckpointInfo,
                  files: Iterable[FileEntry] | None = None) -> AttemptListing:
    """For load and copy: refuse a bounded document declared beyond its limit (module
    docstring), then raise the first finding of the listing (links first) as its typed error;
    strays are logged and ignored.  Returns the listing."""
    check_document_sizes(storage, info)
    listing = list_attempt(storage, info)
    found = problems(info, listing, files)
    for p in found:
        if p.kind != "stray":
            raise p.error(storage, info)
    if files is None:
        check_references(storage, info)
    strays = [p.text.split(":", 1)[0] for p in found]
    if strays:
        log.warning("%s: files not in the manifest are ignored by load (run 'ckptfs verify' "
                    "to report them): %s", info.url, ", ".join(strays[:10]))
    return listing


def listing_report(storage: Storage, info: CheckpointInfo
                   ) -> tuple[AttemptListing, list[Problem]]:
    """For verify: the listing and every finding."""
    listing = list_attempt(storage, info)
    return listing, problems(info, listing) + reference_problems(storage, info)


def check_written(storage: Storage, write_dir: str, files: list[tuple[str, int, int | None]],
                  *, step: int, who: str, hint: str = "", under: str = "") -> None:
    """The write side's listing check, before a sharded save commits: one listing of
    ``write_dir`` (only its subdirectory ``under`` if given), every file of ``files`` (path
    in the attempt, declared size, rank) there with that size, and not a link; else
    `CorruptCheckpointError` (nothing is committed).  Used by the coordinator of a sharded
    save and by each rank for its own file (``who``: who looked)."""
    prefix = write_dir + "/"
    listed = f"{write_dir}/{under}" if under else write_dir
    found = {e.name[len(prefix):]: e.size for e in storage.list_tree(listed)
             if e.name.startswith(prefix) and not e.is_link}
    for path, size, rank in files:
        if found.get(path) != size:
            raise CorruptCheckpointError(
                f"{storage_url(storage, prefix + path)}: rank {rank} reported {size} B, {who} "
                f"{found.get(path, 'no file')}{hint}", step=step)
