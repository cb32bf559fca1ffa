"""Small JSON records that the lifecycle layer keeps next to the checkpoints, written atomically
on every backend.

Design decision: **a record is a sequence of immutable generations, each created exclusively.**
Object stores have no atomic replace-if-unchanged that works the same everywhere (S3's
``If-Match`` is dropped by s3fs on some paths, fake-gcs ignores preconditions on resumable
uploads), but every backend ckptfs supports has the exclusive create the commit protocol already
relies on.  So a record named ``best`` lives as::

    lifecycle/best/gen-000000000001.json
    lifecycle/best/gen-000000000002.json      <- current: the highest generation that parses

A writer reads the current generation ``g`` and creates ``g + 1`` exclusively; if another writer
created it first the write fails with `CheckpointExistsError` instead of
silently overwriting (the caller re-reads and retries).  A reader lists the directory (one
request, caches bypassed) and reads the highest generation: a crash mid-write never leaves a torn
record, because a generation appears whole (single-request create) or not at all.  Old
generations are deleted after a successful write, keeping a few for forensics.

Pruning makes a generation number free again: a writer that read generation ``g - 1`` long ago
can create ``g`` a second time after the others went past it and pruned it.  Its create
succeeds, yet its update is not in the record's history.  So each generation carries its
**lineage**: a random id of its own and the ids of the generations it was built on (the newest
`LINEAGE` of them), under the reserved key ``"__record__"`` (stripped from what readers get).
A writer that finds newer generations right after its create asks the newest one: a lineage
that holds this write's id at ``g`` built on it (the update is in the history, whatever
happened since); another id at ``g`` means the write re-created a pruned number (withdrawn,
`CheckpointExistsError`, the caller re-reads).  A lineage that no longer reaches back to ``g``
(more than `LINEAGE` updates within one listing) cannot tell: `RecordOutcomeUnknownError`,
never a retry that could apply the update twice.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfs.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    StorageError,
    StorageNotFoundError,
    UnsupportedValueError,
)
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")

LIFECYCLE_DIR = "lifecycle"
# ASCII digits, whole name (``\d`` would admit Unicode digits, whose generation path could not
# be rebuilt; ``$`` a trailing newline).
_GEN_RE = re.compile(r"gen-([0-9]{12})\.json")
MAX_RECORD_BYTES = 16 * 1024 * 1024
#: The reserved key of a generation's own bookkeeping (its id and lineage).
LINEAGE_KEY = "__record__"
#: How many generations' ids a generation carries (itself included).
LINEAGE = 64


class RecordOutcomeUnknownError(StorageError):
    """A record write whose create succeeded while so many other updates followed it that
    the newest generation's lineage no longer reaches back to it: whether it is part of the
    record's history cannot be told.  Never retried automatically (a retry could apply the
    update twice); re-read the record and decide."""


class CorruptRecordError(CorruptCheckpointError):
    """A lifecycle record (the best pool, a side-commit record) or other store content that
    ckptfs wrote but that does not parse or has the wrong shape: tampering, or a bug.  Raised
    instead of guessing, because guessing could delete what the record protects; ``path`` names
    the file."""


def parse_json(data: bytes, where: str) -> Any:
    """Parse store content written by ckptfs as JSON, strictly: ``NaN``/``Infinity`` (never
    written: records are dumped with ``allow_nan=False``), nesting deep enough to exhaust the
    interpreter's recursion and integers beyond Python's digit limit all raise
    `CorruptRecordError` naming ``where``, never a raw ``RecursionError``/``ValueError``."""
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    if len(data) > MAX_RECORD_BYTES:
        raise CorruptRecordError(f"{where}: {len(data)} B, over the {MAX_RECORD_BYTES} B limit "
                                 "of a lifecycle record", path=where)
    try:
        return json.loads(data, parse_constant=no_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise CorruptRecordError(f"{where}: does not parse as JSON ({type(exc).__name__}: "
                                 f"{exc})", path=where) from None


@dataclass(frozen=True)
class Record:
    """One generation of a record: its number and its JSON document (``path``: its file,
    relative to the run root)."""

    generation: int
    doc: dict[str, Any]
    path: str = field(default="", compare=False)
    #: ``{generation: id}`` of this generation and the ones it was built on (empty for a
    #: generation written before lineages existed).
    lineage: dict[int, str] = field(default_factory=dict, compare=False, repr=False)


def _lineage_of(doc: dict[str, Any]) -> dict[int, str]:
    """The lineage a generation's document carries, popped from it; a malformed one is
    treated as absent (a generation of an older writer, or tampering: never trusted)."""
    raw = doc.pop(LINEAGE_KEY, None)
    if not isinstance(raw, dict) or not isinstance(raw.get("lineage"), list):
        return {}
    out: dict[int, str] = {}
    for item in raw["lineage"][:LINEAGE]:
        if (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                and isinstance(item[1], str)):
            out[item[0]] = item[1]
    return out


class RecordLog:
    """An atomically updated JSON record at ``lifecycle/<name>/`` of a store."""

    def __init__(self, storage: Storage, name: str, *, keep_generations: int = 3) -> None:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*",
                                                          name):
            raise ValueError(f"record name {name!r} must be [A-Za-z0-9_-] components")
        self.storage = storage
        self.dir = f"{LIFECYCLE_DIR}/{name}"
        self.keep_generations = max(1, keep_generations)

    def _generations(self) -> list[int]:
        gens = []
        for entry in self.storage.list_dir(self.dir):
            m = _GEN_RE.fullmatch(entry.basename)
            if m and not entry.is_dir:
                gens.append(int(m.group(1)))
        return sorted(set(gens))

    def _path(self, gen: int) -> str:
        return f"{self.dir}/gen-{gen:012d}.json"

    def read(self) -> Record | None:
        """The current generation, or ``None`` if the record was never written.  A generation
        that does not parse is reported and the previous one is used (it can only come from
        tampering: generations are created whole).  A generation pruned by a concurrent writer
        between the listing and the read means a newer one exists: list again."""
        # Never answer "no record" because the generations listed were pruned meanwhile: the
        # caller would rewrite generation 1 (pruned, so its create succeeds) and an update would
        # be lost.  List again instead; a record that keeps changing for this long is an error.
        # Nor because one listing came back without them: a listing is not a snapshot (a
        # generation created while it runs may be missed, one pruned meanwhile skipped, so a
        # listing can miss every one), so "nothing" is only believed when listed twice.
        empty = 0
        for _ in range(100):
            vanished, rec = self._read_listed()
            if vanished:
                continue
            if rec is not None or empty >= 1:
                return rec
            empty += 1
        raise StorageError(
            f"{self.storage.url}/{self.dir}: every generation listed was pruned before it could "
            "be read, 100 times in a row; too many writers are updating this record at once")

    def _read_listed(self) -> tuple[bool, Record | None]:
        for gen in reversed(self._generations()):
            path = self._path(gen)
            try:
                data = self.storage.read_bytes(path)
            except StorageNotFoundError:
                return True, None
            try:
                doc = parse_json(data, f"{self.storage.url}/{path}")
                if not isinstance(doc, dict):
                    raise CorruptRecordError("not a JSON object")
            except CorruptRecordError as exc:
                log.warning("%s/%s does not parse (%s); using the previous generation",
                            self.storage.url, path, exc)
                continue
            return False, Record(gen, doc, path, _lineage_of(doc))
        return False, None

    def write(self, doc: Mapping[str, Any], *, expect_generation: int | None,
              parent: Record | None = None) -> Record:
        """Create generation ``expect_generation + 1`` (1 if ``None``) with ``doc``.  Raises
        `CheckpointExistsError` if another writer got there first (or went past it: see the
        module docstring), `RecordOutcomeUnknownError` if that cannot be told.  ``parent``:
        the record ``doc`` was made from (read again from storage when not given)."""
        gen = (expect_generation or 0) + 1
        if LINEAGE_KEY in doc:
            raise UnsupportedValueError(f"{self.storage.url}/{self._path(gen)}: the key "
                                        f"{LINEAGE_KEY!r} is reserved for the record's lineage")
        if parent is None or parent.generation != gen - 1:
            parent = self._read_generation(gen - 1)
        own = secrets.token_hex(8)
        ancestors = sorted((parent.lineage if parent is not None else {}).items(),
                           reverse=True)
        lineage = [(gen, own), *((g, i) for g, i in ancestors if g < gen)][:LINEAGE]
        body = {**dict(doc), LINEAGE_KEY: {"id": own, "lineage": [list(p) for p in lineage]}}
        try:
            data = json.dumps(body, sort_keys=True, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise UnsupportedValueError(f"{self.storage.url}/{self._path(gen)}: the record must "
                                        f"be plain, finite JSON: {exc}") from None
        conflict = (f"{self.storage.url}/{self._path(gen)}: another writer updated this "
                    "record concurrently; re-read it and retry")
        try:
            self.storage.create_exclusive(self._path(gen), data)
        except CheckpointExistsError as exc:
            raise CheckpointExistsError(conflict) from exc
        mine = Record(gen, dict(doc), self._path(gen), dict(lineage))
        newest = max(self._generations(), default=gen)
        if newest <= gen:
            # "Nothing newer" from one listing is not believed: a listing is not a snapshot
            # (`read`), and one that missed the newer generations (created or pruned while it
            # ran) would let a re-created number stand.  A second listing must agree.
            newest = max(self._generations(), default=gen)
        if newest > gen and not self._in_history(mine, own):
            try:
                self.storage.delete(self._path(gen))
            except Exception:  # best effort: readers take the newest generation anyway
                log.debug("could not withdraw %s", self._path(gen), exc_info=True)
            raise CheckpointExistsError(conflict)
        self._prune(gen)
        return mine

    def _read_generation(self, gen: int) -> Record | None:
        """Generation ``gen`` alone, or ``None`` (never written, pruned, or not parsing)."""
        if gen < 1:
            return None
        try:
            data = self.storage.read_bytes(self._path(gen))
            doc = parse_json(data, f"{self.storage.url}/{self._path(gen)}")
        except (StorageNotFoundError, CorruptRecordError):
            return None
        if not isinstance(doc, dict):
            return None
        return Record(gen, doc, self._path(gen), _lineage_of(doc))

    def _in_history(self, mine: Record, own: str) -> bool:
        """Whether generation ``mine`` (just created with id ``own``, newer ones listed) is
        the one the newest generation was built on, rather than a pruned number re-created."""
        # A newer generation was listed, so the newest is newer than this one from then on (the
        # newest is never deleted: a prune keeps it, a withdrawal removes only a re-created
        # number below it).  A read that says otherwise came from a listing that missed the
        # newer ones (a listing is not a snapshot: `read`): read again.
        for _ in range(100):
            newest = self.read()
            if newest is not None and newest.generation > mine.generation:
                break
        else:
            raise RecordOutcomeUnknownError(
                f"{self.storage.url}/{mine.path}: newer generations were listed after this "
                "write, then 100 listings in a row did not show them: whether it took effect "
                "is unknown; re-read the record before writing again")
        if mine.generation in newest.lineage:
            return newest.lineage[mine.generation] == own
        if len(newest.lineage) >= LINEAGE:
            raise RecordOutcomeUnknownError(
                f"{self.storage.url}/{mine.path}: {newest.generation - mine.generation} "
                f"updates followed this write before it could be checked (more than the "
                f"{LINEAGE} a lineage holds): whether it took effect is unknown; re-read the "
                "record before writing again")
        # The newest lineage starts after this number: it was built on a generation written
        # before lineages existed.  Pruning this number needs a generation at least
        # ``keep_generations`` newer, created before the prune, so before this create.
        return not any(g >= mine.generation + self.keep_generations
                       for g in self._generations())

    def update(self, fn: Callable[[dict[str, Any] | None], Mapping[str, Any]], *,
               retries: int = 5) -> Record:
        """Read-modify-write with retries on a concurrent update: ``fn`` gets the current
        document (or ``None``) and returns the new one."""
        last: Exception | None = None
        for _ in range(retries):
            cur = self.read()
            new = fn(dict(cur.doc) if cur is not None else None)
            try:
                return self.write(new, expect_generation=cur.generation if cur else None,
                                  parent=cur)
            except CheckpointExistsError as exc:
                last = exc
        raise CorruptCheckpointError(
            f"{self.storage.url}/{self.dir}: could not update the record after {retries} "
            f"tries; several writers are updating it at once ({last})")

    def _prune(self, current: int) -> None:
        for gen in self._generations():
            if gen <= current - self.keep_generations:
                try:
                    self.storage.delete(self._path(gen))
                except Exception:  # best effort: an old generation is harmless
                    log.debug("could not prune %s", self._path(gen), exc_info=True)
