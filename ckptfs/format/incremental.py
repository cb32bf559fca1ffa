"""Format v3, incremental checkpoints: format v1's state tree and safetensors files, every file
tiled by chunks with their own digests (as format v2), and *references*: the chunks of files
that earlier checkpoints of the same run committed, used instead of writing the same bytes again.
Pure: no I/O, no clock (docs/protocol.md §9).

A v3 attempt::

    a-20261201T120000Z-.../
      MANIFEST.json               format_version 3, layout "incremental": its own files (each
                                  with a chunk list) and its references
      state.msgpack               the v1 state document (§2.3): tensor i is entry ``name`` of
                                  the safetensors file ``file``, a file of this attempt or a
                                  reference's ``path``
      tensors-00000.safetensors   the tensors that changed (header chunk, one chunk per tensor)

A reference names a file of another attempt of the run (``step``, ``attempt``, ``source``), its
size, and the chunks this checkpoint uses from it: the header chunk (at offset 0) and one chunk
per tensor it reads there, each with its digest.  The marker binds the manifest, the manifest
binds every chunk a reader uses, wherever it lives, so a reference is verified exactly like a
local file: a reader checks a chunk's digest before it uses a byte of it.

A reference always names the file that physically holds the bytes (a reference is never to a
reference), so reading one never needs another checkpoint's manifest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from ckptfs.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptfs.format.hashing import ALGORITHMS, parse_digest
from ckptfs.format.layout import (
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    MARKER_NAME,
    MAX_STEP,
    STATE_NAME,
    check_relpath,
    is_attempt_name,
    step_dir_name,
)
from ckptfs.format.limits import MAX_FILE_SIZE, MAX_FILES
from ckptfs.format.manifest import (
    FILE_KEYS,
    MANIFEST_KEYS,
    MANIFEST_SCHEMA,
    Manifest,
    decode_store_checksums,
    store_checksums_doc,
)
from ckptfs.format.sharded import (
    Chunk,
    ChunkedFileEntry,
    ShardedManifest,
    bound_entry,
    chunk_list_digest,
    decode_chunks,
    manifest_error,
    rank_of_file,
)

INCREMENTAL_FORMAT_VERSION = 3
#: Format v4, sharded incremental: format v2's layout, manifest and documents, plus v3's
#: ``references`` (docs/protocol.md §9.6).
SHARDED_INCREMENTAL_FORMAT_VERSION = 4
INCREMENTAL_LAYOUT = "incremental"
#: Keys every v3 manifest, file entry and reference must have (docs/protocol.md §9.2).
V3_MANIFEST_KEYS = MANIFEST_KEYS | {"layout", "references"}
V3_FILE_KEYS = FILE_KEYS | {"chunks"}
REFERENCE_KEYS = frozenset({"path", "step", "attempt", "source", "size", "algorithm", "chunks"})
#: A save that references stored bytes commits within this many seconds of opening its attempt,
#: or not at all (docs/protocol.md §9.4); garbage collection's grace must exceed it.
DEFAULT_LEASE_S = 30 * 60
#: Default grace of a delete's reference scan and of garbage collection (docs/protocol.md §9.5):
#: an uncommitted attempt younger than this may be a save still running (its manifest's
#: references are kept; its files are not collected).  Must exceed the lease plus clock skew.
DEFAULT_GRACE_S = 60 * 60
#: Name of the ``k``-th reference of an attempt (the ``file`` of state.msgpack's slots).
REFERENCE_TEMPLATE = "ref-{index:05d}.safetensors"


def reference_name(index: int) -> str:
    return REFERENCE_TEMPLATE.format(index=index)


@dataclass(frozen=True)
class Reference:
    """Chunks of a file another attempt of the run holds, used by this checkpoint under the
    name ``path``.  ``chunks`` are sorted by offset, disjoint, inside ``size``; the first is the
    file's safetensors header chunk (offset 0)."""

    path: str
    step: int
    attempt: str
    source: str
    size: int
    algorithm: str
    chunks: tuple[Chunk, ...]

    @property
    def location(self) -> str:
        """The file's path relative to the run root."""
        return f"{CHECKPOINTS_DIR}/{step_dir_name(self.step)}/{self.attempt}/{self.source}"

    @property
    def attempt_dir(self) -> str:
        return f"{CHECKPOINTS_DIR}/{step_dir_name(self.step)}/{self.attempt}"

    @property
    def used_bytes(self) -> int:
        """Bytes of the file this checkpoint reads (its chunks)."""
        return sum(c.length for c in self.chunks)

    def chunk_at(self, offset: int, length: int) -> Chunk | None:
        for c in self.chunks:
            if c.offset == offset and c.length == length:
                return c
        return None

    def as_doc(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "attempt": self.attempt,
                "source": self.source, "size": self.size, "algorithm": self.algorithm,
                "chunks": [[c.offset, c.length, c.digest] for c in self.chunks]}


@dataclass(frozen=True)
class IncrementalManifest(Manifest):
    """The manifest of an incremental checkpoint (format v3): ``files`` are
    `ChunkedFileEntry` (this attempt's own files), ``references`` the chunks it uses
    from files of other attempts."""

    references: tuple[Reference, ...] = field(default=())
    format_version: int = INCREMENTAL_FORMAT_VERSION

    def chunked(self, path: str) -> ChunkedFileEntry:
        entry = self.file(path)
        if not isinstance(entry, ChunkedFileEntry):  # pragma: no cover - decode guarantees
            raise KeyError(path)
        return entry

    def reference(self, path: str) -> Reference | None:
        for ref in self.references:
            if ref.path == path:
                return ref
        return None

    @property
    def bytes_written(self) -> int:
        """Bytes this checkpoint's own files hold (what its save wrote, the manifest aside)."""
        return self.total_bytes

    @property
    def logical_bytes(self) -> int:
        """Bytes a full load reads: its own files and every chunk it references."""
        return self.total_bytes + sum(r.used_bytes for r in self.references)

    def to_bytes(self) -> bytes:
        files = []
        for e in self.files:
            if not isinstance(e, ChunkedFileEntry):
                raise TypeError(f"{e.path}: a v3 manifest lists chunked files only")
            files.append({"path": e.path, "size": e.size, "digest": e.digest,
                          "algorithm": e.algorithm,
                          "chunks": [[c.offset, c.length, c.digest] for c in e.chunks],
                          **store_checksums_doc(e)})
        doc = {
            "schema": MANIFEST_SCHEMA, "format_version": INCREMENTAL_FORMAT_VERSION,
            "layout": INCREMENTAL_LAYOUT, "step": self.step, "attempt": self.attempt,
            "created": self.created, "hash_algorithm": self.hash_algorithm,
            "files": files, "references": [r.as_doc() for r in self.references],
            "metadata": self.metadata,
        }
        return (json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
                + "\n").encode()

    @classmethod
    def from_doc(cls, doc: dict[str, Any], *, where: str) -> IncrementalManifest:
        """Decode a v3 manifest (parsed by the bounded JSON reader, schema checked): every key
        of §9.2 required, each file's chunk list tiling it and bound by its digest, each
        reference well formed (a safe source path, an attempt name, chunks sorted, disjoint,
        inside the file, the header chunk first), no name used twice.  Typed errors only."""
        try:
            missing = sorted(V3_MANIFEST_KEYS - set(doc))
            if missing:
                raise KeyError(f"v3 manifest lacks {missing}")
            if doc["layout"] != INCREMENTAL_LAYOUT:
                raise TypeError(f"layout {doc['layout']!r:.40} is not {INCREMENTAL_LAYOUT!r}")
            step, attempt = doc["step"], doc["attempt"]
            if not _is_int(step) or not 0 <= step <= MAX_STEP:
                raise TypeError(f"step {step!r:.40} is not an int in [0, {MAX_STEP}]")
            if not isinstance(attempt, str) or not is_attempt_name(attempt):
                raise TypeError(f"attempt {attempt!r:.80} is not an attempt name")
            algo = doc["hash_algorithm"]
            if algo not in ALGORITHMS:
                raise TypeError(f"unknown hash_algorithm {algo!r:.40}")
            metadata, created = doc["metadata"], doc["created"]
            if not isinstance(metadata, dict) or not isinstance(created, str):
                raise TypeError("'metadata' is not an object or 'created' not a string")
            raw_files, raw_refs = doc["files"], doc["references"]
            if not isinstance(raw_files, list) or not isinstance(raw_refs, list) \
                    or len(raw_files) + len(raw_refs) > MAX_FILES:
                raise TypeError(f"'files' and 'references' are not lists of at most "
                                f"{MAX_FILES} entries in all")
            seen: set[str] = set()
            files = [_decode_file(raw, seen, where) for raw in raw_files]
            refs = [_decode_reference(raw, seen, step, attempt, where) for raw in raw_refs]
            if STATE_NAME not in {f.path for f in files}:
                raise KeyError(f"no {STATE_NAME} among the files")
        except Exception as exc:
            raise manifest_error(exc, where, "v3") from None
        return cls(step, attempt, tuple(files), created, algo, metadata,
                   references=tuple(refs))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _name(raw: Any, seen: set[str], where: str) -> str:
    path = check_relpath(raw)
    if path in (MANIFEST_NAME, MARKER_NAME):
        raise UnsafeCheckpointError(f"{where}: {path!r} may not be listed")
    if path in seen:
        raise UnsafeCheckpointError(f"{where}: {path!r} listed twice")
    seen.add(path)
    return path


def _size(raw: Any, path: str, where: str) -> int:
    if not _is_int(raw) or not 0 <= raw <= MAX_FILE_SIZE:
        raise UnsafeCheckpointError(f"{where}: file {path!r} has bad size {raw!r:.40}")
    return int(raw)


def _decode_file(raw: Any, seen: set[str], where: str) -> ChunkedFileEntry:
    if not isinstance(raw, dict):
        raise TypeError("a 'files' entry is not an object")
    missing = sorted(V3_FILE_KEYS - set(raw))
    if missing:
        raise KeyError(f"file entry lacks {missing}")
    path = _name(raw["path"], seen, where)
    size = _size(raw["size"], path, where)
    algo, _ = parse_digest(raw["digest"])
    if raw["algorithm"] != algo:
        raise TypeError(f"file {path!r}: 'algorithm' differs from its digest's")
    chunks = decode_chunks(raw["chunks"], algo, path)
    return bound_entry(path, size, raw["digest"], algo, chunks, None, where=where,
                       store_checksums=decode_store_checksums(raw, path))


def _decode_reference(raw: Any, seen: set[str], step: int, attempt: str,
                      where: str) -> Reference:
    if not isinstance(raw, dict):
        raise TypeError("a 'references' entry is not an object")
    missing = sorted(REFERENCE_KEYS - set(raw))
    if missing:
        raise KeyError(f"reference lacks {missing}")
    path = _name(raw["path"], seen, where)
    ref_step, ref_attempt = raw["step"], raw["attempt"]
    if not _is_int(ref_step) or not 0 <= ref_step <= MAX_STEP:
        raise TypeError(f"reference {path!r}: step {ref_step!r:.40} is not a step")
    if not isinstance(ref_attempt, str) or not is_attempt_name(ref_attempt):
        raise UnsafeCheckpointError(
            f"{where}: reference {path!r}: attempt {ref_attempt!r:.80} is not an attempt name")
    if ref_attempt == attempt:
        raise TypeError(f"reference {path!r} names this attempt itself")
    source = check_relpath(raw["source"])
    if source in (MANIFEST_NAME, MARKER_NAME, STATE_NAME):
        raise UnsafeCheckpointError(f"{where}: reference {path!r} names {source!r}")
    size = _size(raw["size"], path, where)
    algo = raw["algorithm"]
    if algo not in ALGORITHMS:
        raise TypeError(f"reference {path!r}: unknown algorithm {algo!r:.40}")
    chunks = decode_chunks(raw["chunks"], algo, path)
    if not chunks or chunks[0].offset != 0:
        raise CorruptCheckpointError(
            f"{where}: reference {path!r}: its first chunk must be the file's header (offset 0)")
    end = 0
    for c in chunks:
        if c.offset < end or c.length < 0 or c.offset + c.length > size:
            raise CorruptCheckpointError(
                f"{where}: reference {path!r}: chunk [{c.offset}, {c.length}] overlaps another, "
                f"is out of order or lies outside its {size} B file")
        end = c.offset + c.length
    return Reference(path, ref_step, ref_attempt, source, size, algo, tuple(chunks))


@dataclass(frozen=True)
class ReferencedFile(ChunkedFileEntry):
    """A v4 reference seen as a rank file (what `ShardedIncrementalManifest.chunked`
    returns for a reference's ``path``): ``location`` (from the run root) is where its bytes
    are read, and ``chunks`` are only the chunks this checkpoint uses (the header chunk first,
    then one per item it reads there): sorted and disjoint, not a tiling."""

    location: str = ""


@dataclass(frozen=True)
class ShardedIncrementalManifest(ShardedManifest):
    """The manifest of a sharded incremental checkpoint (format v4, docs/protocol.md §9.6):
    format v2's (its own ``files``: rank files and ``dcp.msgpack``) plus ``references``, the
    chunks of rank files of other attempts of the run that ``dcp.msgpack`` places items in
    (under the reference's ``path``, at the chunk's offset in the source file)."""

    references: tuple[Reference, ...] = field(default=())
    format_version: int = SHARDED_INCREMENTAL_FORMAT_VERSION

    def reference(self, path: str) -> Reference | None:
        for ref in self.references:
            if ref.path == path:
                return ref
        return None

    def chunked(self, path: str) -> ChunkedFileEntry:
        """The file ``path`` of the manifest, or the reference named ``path`` as a
        `ReferencedFile` (read at its location, its used chunks only)."""
        ref = self.reference(path)
        if ref is None:
            return super().chunked(path)
        return ReferencedFile(ref.path, ref.size, chunk_list_digest(ref.algorithm, ref.chunks),
                              ref.chunks, None, ref.location)

    @property
    def bytes_written(self) -> int:
        return self.total_bytes

    @property
    def logical_bytes(self) -> int:
        return self.total_bytes + sum(r.used_bytes for r in self.references)

    def as_doc(self) -> dict[str, Any]:
        doc = super().as_doc()
        doc["references"] = [r.as_doc() for r in self.references]
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any], *, where: str) -> ShardedIncrementalManifest:
        """Decode a v4 manifest: every rule of v2 (`ShardedManifest.from_doc`), and
        ``references`` as in v3 (each well formed, no name shared with a file or another
        reference, at most ``MAX_FILES`` entries in all).  Typed errors only."""
        base = super().from_doc(doc, where=where)
        try:
            raw_refs = doc.get("references")
            if not isinstance(raw_refs, list) or len(raw_refs) + len(base.files) > MAX_FILES:
                raise TypeError(f"'references' is not a list of at most {MAX_FILES} entries "
                                "with the files")
            seen = {f.path for f in base.files}
            refs = [_decode_reference(raw, seen, base.step, base.attempt, where)
                    for raw in raw_refs]
            for ref in refs:
                if rank_of_file(ref.source) is None:
                    raise UnsafeCheckpointError(
                        f"{where}: reference {ref.path!r} names {ref.source!r}, not a rank "
                        "file (rank-NNNNN/data-K.safetensors)")
        except Exception as exc:
            raise manifest_error(exc, where, "v4") from None
        return cls(base.step, base.attempt, base.files, base.created, base.hash_algorithm,
                   base.metadata, world_size=base.world_size, references=tuple(refs))


#: A manifest whose checkpoint references chunks of other attempts (format v3 or v4).
ReferencingManifest = IncrementalManifest | ShardedIncrementalManifest


def has_references(manifest: Manifest) -> TypeGuard[ReferencingManifest]:
    """Whether ``manifest``'s format carries references (v3, v4): the one test every reader,
    listing check and delete uses."""
    return isinstance(manifest, (IncrementalManifest, ShardedIncrementalManifest))


def references_of(manifest: Manifest) -> tuple[Reference, ...]:
    """The references of ``manifest`` (none for a format without them)."""
    return manifest.references if has_references(manifest) else ()


def referenced_chunks(manifests: Iterable[Manifest]) -> dict[str, set[tuple[int, int]]]:
    """Every file (path relative to the run root) the given manifests reference, with the
    ``(offset, length)`` of each chunk they use: what no delete may take."""
    out: dict[str, set[tuple[int, int]]] = {}
    for m in manifests:
        if not has_references(m):
            continue
        for ref in m.references:
            out.setdefault(ref.location, set()).update((c.offset, c.length) for c in ref.chunks)
    return out


__all__ = ["DEFAULT_GRACE_S", "DEFAULT_LEASE_S", "INCREMENTAL_FORMAT_VERSION",
           "INCREMENTAL_LAYOUT", "SHARDED_INCREMENTAL_FORMAT_VERSION", "IncrementalManifest",
           "Reference", "ReferencedFile", "ReferencingManifest", "ShardedIncrementalManifest",
           "has_references", "reference_name", "referenced_chunks", "references_of"]
