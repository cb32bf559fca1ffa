"""Write-once run artifacts, and side outputs that commit with a checkpoint.

**Run artifacts** (the RL code base's frozen reference model): a state saved once per run under
a name, with a *descriptor* (a small JSON dict saying what it is: model id, revision, dtype...).
Each artifact is a one-step checkpoint store of its own, ``artifacts/<name>/``, committed by the
same exclusive marker as any checkpoint, so "saved once" is enforced by the storage: a second
save with the same descriptor is a no-op, with a different descriptor an
`ArtifactConflictError`, and two racing first saves produce one artifact.
The manifest's metadata records the descriptor and its digest; the marker binds that manifest,
so descriptor and content are committed together.  `RunArtifacts.load` verifies every byte
against the manifest, the recorded descriptor against its digest, and the descriptor the caller
expects against the recorded one.  ``ArtifactInfo.content_digest`` (a digest over the manifest's
file entries) identifies the content for logs and comparisons across runs.

**Side outputs** (the RL code base's COMMITTED markers): files a step produces before its
checkpoint (eval results, update logs) are written under ``lifecycle/side/step-N/<name>`` at
once, but they belong to the run's history only once the checkpoint that lists them commits:
the manager puts ``{path: {"size", "digest"}}`` of every side output written since the previous
checkpoint into the new checkpoint's manifest metadata (``side_outputs``), so the checkpoint's
marker commits them in the same atomic step.  After the commit, a small record
``lifecycle/side-commits/step-N.json`` repeats the list, so side outputs stay committed after
retention deletes the checkpoint that committed them.  A resume classifies every side output
as committed (listed, digest matches), uncommitted (written by a run that crashed before its
checkpoint: discard) or modified (listed, but the bytes changed).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from ckptfs.errors import (
    ArtifactConflictError,
    ArtifactMismatchError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageNotFoundError,
    UnsupportedValueError,
)
from ckptfs.format.hashing import ALGORITHMS, digest_bytes
from ckptfs.format.layout import MAX_STEP, parse_step_dir, step_dir_name
from ckptfs.lifecycle.records import LIFECYCLE_DIR, CorruptRecordError, parse_json
from ckptfs.protocol.load_options import MapLocation
from ckptfs.protocol.resolve import committed_steps
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.sub import SubStorage as SubStorage  # re-exported (Lightning, transformers)

log = logging.getLogger("ckptfs")

ARTIFACTS_DIR = "artifacts"
ARTIFACT_STEP = 0
SIDE_DIR = f"{LIFECYCLE_DIR}/side"
SIDE_COMMITS_DIR = f"{LIFECYCLE_DIR}/side-commits"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: no trailing newline


def check_name(name: str, what: str = "artifact") -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise ValueError(f"{what} name {name!r} must be 1-128 characters of [A-Za-z0-9._-], "
                         "starting with a letter or digit")
    return name


def _canonical(doc: Mapping[str, Any], what: str) -> bytes:
    try:
        return json.dumps(dict(doc), sort_keys=True, separators=(",", ":"),
                          allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(f"{what} must be plain JSON (str keys; str, int, finite "
                                    f"float, bool, None, lists, dicts): {exc}") from None


def descriptor_digest(descriptor: Mapping[str, Any]) -> str:
    """The digest of a descriptor's canonical JSON (sorted keys, no spaces)."""
    return digest_bytes("sha256", _canonical(descriptor, "artifact descriptor"))


@dataclass(frozen=True)
class ArtifactInfo:
    name: str
    url: str
    descriptor: dict[str, Any]
    descriptor_digest: str
    content_digest: str
    bytes: int
    created: str


class RunArtifacts:
    """The write-once artifacts of one run root (``artifacts/<name>/``)."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store

    def _sub(self, name: str) -> CheckpointStore:
        sub = SubStorage(self.store.storage, f"{ARTIFACTS_DIR}/{check_name(name)}")
        return CheckpointStore(sub, algorithm=self.store.algorithm, durable=self.store.durable,
                               threads=self.store.threads, shard_bytes=self.store.shard_bytes)

    def names(self) -> list[str]:
        out = []
        for e in self.store.storage.list_dir(ARTIFACTS_DIR):
            if e.is_dir and _NAME_RE.fullmatch(e.basename) and self._sub(e.basename).steps():
                out.append(e.basename)
        return sorted(out)

    def info(self, name: str) -> ArtifactInfo:
        sub = self._sub(name)
        try:
            ci = sub.info(ARTIFACT_STEP)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"no artifact {name!r} at {self.store.url}/{ARTIFACTS_DIR}/{name}; save it "
                "first with artifacts.save(name, state, descriptor=...)") from None
        meta = ci.metadata
        desc = meta.get("descriptor")
        if not isinstance(desc, dict):
            raise ArtifactMismatchError(f"{ci.url}: artifact has no descriptor in its manifest",
                                        step=ARTIFACT_STEP, path=ci.path)
        return ArtifactInfo(name, ci.url, desc, str(meta.get("descriptor_digest")),
                            content_digest(ci.manifest), ci.total_bytes, ci.created)

    def save(self, name: str, state: Mapping[str, Any], *,
             descriptor: Mapping[str, Any]) -> tuple[ArtifactInfo, bool]:
        """Save ``state`` as artifact ``name`` once.  Returns (info, created): ``created`` is
        False when the artifact already existed with the same descriptor (nothing written).
        Raises `ArtifactConflictError` if it exists with a different descriptor."""
        ddig = descriptor_digest(descriptor)
        desc = json.loads(_canonical(descriptor, "artifact descriptor"))
        sub = self._sub(name)
        try:
            existing = self.info(name)
        except CheckpointNotFoundError:
            existing = None
        if existing is None:
            try:
                ci = sub.save(ARTIFACT_STEP, state, metadata={
                    "artifact": name, "descriptor": desc, "descriptor_digest": ddig})
            except CheckpointExistsError:
                existing = self.info(name)  # lost a race: compare with the winner
            else:
                log.info("artifact %r saved at %s", name, ci.url)
                return self.info(name), True
        if existing.descriptor_digest != ddig:
            raise ArtifactConflictError(
                f"artifact {name!r} at {existing.url} already exists with descriptor "
                f"{existing.descriptor}, not {desc}; artifacts are write-once per run: use "
                "another name, or start a new run root")
        return existing, False

    def load(self, name: str, *, descriptor: Mapping[str, Any] | None = None,
             map_location: MapLocation = None) -> dict[Any, Any]:
        """Load artifact ``name``, verifying every byte against its manifest, the recorded
        content digest against the manifest, and (if given) ``descriptor`` against the
        recorded one.  Raises `ArtifactMismatchError` on any disagreement."""
        info = self.info(name)
        sub = self._sub(name)
        ci = sub.info(ARTIFACT_STEP)
        if descriptor_digest(info.descriptor) != info.descriptor_digest:
            raise ArtifactMismatchError(
                f"{info.url}: the recorded descriptor does not match its recorded digest; the "
                "artifact's manifest was edited", step=ARTIFACT_STEP, path=ci.path)
        if descriptor is not None and descriptor_digest(descriptor) != info.descriptor_digest:
            want = json.loads(_canonical(descriptor, "artifact descriptor"))
            diff = sorted(k for k in set(want) | set(info.descriptor)
                          if want.get(k) != info.descriptor.get(k))
            raise ArtifactMismatchError(
                f"artifact {name!r} at {info.url} was saved with descriptor {info.descriptor}, "
                f"the caller expects {want} (differing keys: {diff})", step=ARTIFACT_STEP,
                path=ci.path)
        return sub.load(ARTIFACT_STEP, map_location=map_location, verify=True)


def content_digest(manifest: Any) -> str:
    """Digest over a manifest's file entries (path, size, digest), sorted by path."""
    rows = sorted((f.path, f.size, f.digest) for f in manifest.files)
    return digest_bytes("sha256", json.dumps(rows, separators=(",", ":")).encode())


# -- side outputs -------------------------------------------------------------------------------


def check_listing(listed: object, where: str) -> dict[str, dict[str, Any]]:
    """A side-output listing (``path -> {"size": int, "digest": "<algorithm>:<hex>"}``) as
    written by the manager, from a side-commit record or a checkpoint's metadata; anything else
    raises `CorruptRecordError` naming ``where``.  Raising,
    not skipping: an entry ignored here would make a committed side output read as uncommitted,
    and a resume would delete it."""
    def bad(why: str) -> CorruptRecordError:
        return CorruptRecordError(f"{where}: side-output listing {why}; ckptfs did not write "
                                  "this (tampering or a bug): repair or remove it", path=where)

    if not isinstance(listed, Mapping):
        raise bad(f"is a {type(listed).__name__}, not a map")
    out: dict[str, dict[str, Any]] = {}
    for path, rec in listed.items():
        if not isinstance(path, str) or not path.startswith(SIDE_DIR + "/"):
            raise bad(f"names {path!r:.80}, not a path under {SIDE_DIR}/")
        if not isinstance(rec, Mapping):
            raise bad(f"entry {path!r:.80} is not a map")
        size, digest = rec.get("size"), rec.get("digest")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"entry {path!r:.80} has size {size!r:.40}")
        if (not isinstance(digest, str) or ":" not in digest
                or digest.split(":", 1)[0] not in ALGORITHMS):
            raise bad(f"entry {path!r:.80} has digest {digest!r:.80}")
        out[path] = {"size": size, "digest": digest}
    return out


@dataclass
class SideOutputStatus:
    """Side outputs by status; each entry is the path relative to the run root."""

    committed: list[str] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)
    modified: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[str]]:
        return {"committed": self.committed, "uncommitted": self.uncommitted,
                "modified": self.modified}


class SideOutputs:
    """Side outputs of steps, committed together with the checkpoint that lists them."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._pending: dict[str, dict[str, Any]] = {}

    @staticmethod
    def path(step: int, name: str) -> str:
        return f"{SIDE_DIR}/{step_dir_name(step)}/{check_name(name, 'side output')}"

    def write(self, step: int, name: str, data: bytes) -> str:
        """Write a side output of ``step`` now; it is committed by the next checkpoint the
        manager saves.  Returns its path relative to the run root."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UnsupportedValueError(f"side output {name!r} must be bytes, got "
                                        f"{type(data).__name__}; encode it (e.g. json.dumps)")
        path = self.path(step, name)
        raw = bytes(data)
        self.store.storage.write_bytes(path, raw)
        self._pending[path] = {"size": len(raw),
                               "digest": digest_bytes(self.store.algorithm, raw)}
        return path

    def read(self, step: int, name: str) -> bytes:
        return self.store.storage.read_bytes(self.path(step, name))

    def take_pending(self) -> dict[str, dict[str, Any]]:
        """The side outputs to list in the next checkpoint (cleared by `committed`)."""
        return dict(self._pending)

    def committed(self, step: int, listed: Mapping[str, Any]) -> None:
        """Called after checkpoint ``step`` committed listing ``listed``: write its record."""
        for p in listed:
            self._pending.pop(p, None)
        if listed:
            self._write_record(step, listed)

    def _write_record(self, step: int, listed: Mapping[str, Any]) -> None:
        doc = {"schema": "ckptfs.side-commit", "version": 1, "step": step,
               "side_outputs": dict(listed)}
        with suppress(CheckpointExistsError):  # already recorded (a reconcile, a retry)
            self.store.storage.create_exclusive(
                f"{SIDE_COMMITS_DIR}/{step_dir_name(step)}.json",
                json.dumps(doc, sort_keys=True).encode())

    def reconcile(self) -> None:
        """Write the side-commit records of committed checkpoints that lack one (a crash
        between a checkpoint's commit and its record).  Run before pruning."""
        for step, listed in self._unrecorded_listings():
            if listed:
                self._write_record(step, listed)

    def _unrecorded_listings(self, unreadable: list[int] | None = None
                             ) -> Iterator[tuple[int, dict[str, Any]]]:
        """(step, side outputs its metadata lists) for committed checkpoints without a record.
        A checkpoint whose manifest fails its check (a corrupt newest step a rollback restore
        skipped) lists nothing that can be trusted: skipped, logged, and added to
        ``unreadable``."""
        recorded = self._recorded_steps()
        for step in committed_steps(self.store.storage):  # this storage's (two tiers: local)
            if step in recorded:
                continue
            try:
                info = self.store.info(step)
            except (CheckpointNotFoundError, StorageNotFoundError):
                continue
            except CorruptCheckpointError as exc:
                log.warning("side outputs: step %d at %s cannot be read (%s); what it lists "
                            "is not known", step, self.store.url, exc)
                if unreadable is not None:
                    unreadable.append(step)
                continue
            listed = info.metadata.get("side_outputs")
            if listed is not None:
                yield step, check_listing(listed, f"{info.url}/MANIFEST.json")

    def _recorded_steps(self) -> set[int]:
        out = set()
        for e in self.store.storage.list_dir(SIDE_COMMITS_DIR):
            if e.basename.endswith(".json"):
                step = parse_step_dir(e.basename[:-5])
                if step is not None:
                    out.add(step)
        return out

    def committed_index(self, unreadable: list[int] | None = None
                        ) -> dict[str, dict[str, Any]]:
        """Every committed side output: path -> {size, digest}, from the records and from the
        metadata of committed checkpoints (which commit them even before their record);
        ``unreadable`` gets the committed steps whose manifest could not be read."""
        index: dict[str, dict[str, Any]] = {}
        for e in self.store.storage.list_dir(SIDE_COMMITS_DIR):
            if not e.basename.endswith(".json"):
                continue
            where = f"{self.store.storage.url}/{e.name}"
            try:
                doc = parse_json(self.store.storage.read_bytes(e.name), where)
            except StorageNotFoundError:
                continue
            if not isinstance(doc, dict):
                raise CorruptRecordError(f"{where}: side-commit record is not a JSON object",
                                         path=where)
            index.update(check_listing(doc.get("side_outputs"), where))
        for _, listed in self._unrecorded_listings(unreadable):
            index.update(listed)
        return index

    def status(self, *, after_step: int | None = None,
               unreadable: list[int] | None = None) -> SideOutputStatus:
        """Classify every side output under ``lifecycle/side/``.  Content is re-hashed to tell
        committed from modified (``unreadable``: as for `committed_index`)."""
        index = self.committed_index(unreadable)
        out = SideOutputStatus()
        for e in sorted(self.store.storage.list_tree(SIDE_DIR), key=lambda e: e.name):
            rec = index.get(e.name)
            if rec is None:
                out.uncommitted.append(e.name)
                continue
            algo = str(rec.get("digest", "sha256:")).split(":", 1)[0]
            data = self.store.storage.read_bytes(e.name)
            if len(data) == rec.get("size") and digest_bytes(algo, data) == rec.get("digest"):
                out.committed.append(e.name)
            else:
                out.modified.append(e.name)
        return out

    def discard_uncommitted(self, *, dry_run: bool = False) -> list[str]:
        """Delete side outputs no committed checkpoint lists (a crashed run's leftovers).
        Nothing is deleted while a committed checkpoint's manifest cannot be read (it may list
        them): logged."""
        unreadable: list[int] = []
        gone = self.status(unreadable=unreadable).uncommitted
        if unreadable and gone:
            log.warning("side outputs: %d not listed by a readable checkpoint are kept, since "
                        "step(s) %s at %s cannot be read and may list them (delete or repair "
                        "those steps, then resume again)", len(gone),
                        ", ".join(map(str, unreadable)), self.store.url)
            gone = []
        if not dry_run:
            for p in gone:
                self.store.storage.delete(p)
        self._pending.clear()
        return gone

    def steps(self) -> Iterator[int]:
        for e in self.store.storage.list_dir(SIDE_DIR):
            s = parse_step_dir(e.basename)
            if s is not None and s <= MAX_STEP:
                yield s
