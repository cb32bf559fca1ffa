"""The manifest (one model for every format version) and the commit marker: frozen
dataclasses and their bytes.

A `Manifest` carries its *features* (`ckptfs.format.features`: ``"sharded"``, ``"chunked"``,
``"references"``); its ``format_version`` is the version that names them, and the one encoder
(`Manifest.to_bytes`) and the one decoder (`decode_doc`, behind
`ckptfs.format.versions.decode_manifest`) choose their rules by them: v1's key set and one-space
indent for a manifest without features, ``layout`` and chunk lists for a chunked one, ranks and
``world_size`` for a sharded one, ``references`` (docs/protocol.md §2.1, §8.2, §9.2, §9.6).

Both documents are UTF-8 JSON objects (``sort_keys``, no NaN), readable with nothing but
``json``.  Decoding is strict and bounded: sizes are checked before anything is allocated, a
key named twice, a missing key or nesting beyond `MAX_JSON_DEPTH` is an error, every path
goes through `ckptfs.format.layout.check_relpath`, unknown schema or a newer format version is
a typed error.  Unknown extra keys are ignored (docs/protocol.md, section 2.1).  The writer's
side (`check_metadata`, `check_document_size`) enforces the same limits before anything is
written.  The entries a manifest lists are `ckptfs.format.entries`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfs.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format.entries import (
    ChunkedFileEntry,
    RankTable,
    Reference,
    ReferencedFile,
    bound_entry,
    decode_chunks,
    decode_store_checksums,
    is_bound,
    rank_row_bytes,
    store_checksums_doc,
)
from ckptfs.format.entries import FileEntry as FileEntry  # re-exported: the v1 entry
from ckptfs.format.features import (
    CHUNKED,
    FEATURES,
    RANK_METADATA,
    REFERENCES,
    SHARDED,
    version_of,
)
from ckptfs.format.hashing import ALGORITHMS, digest_bytes, parse_digest
from ckptfs.format.layout import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    MARKER_NAME,
    MAX_STEP,
    METADATA_NAME,
    SPEC_NAME,
    STATE_NAME,
    check_relpath,
    is_attempt_name,
    rank_of_file,
    table_block_name,
)
from ckptfs.format.limits import (
    MAX_BIGINT_DIGITS,
    MAX_FILE_SIZE,
    MAX_FILES,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    MAX_MARKER_BYTES,
    MAX_ROWS_PER_BLOCK,
)

MANIFEST_SCHEMA = "ckptfs.manifest"
MARKER_SCHEMA = "ckptfs.commit"
#: The attempt-name rule of docs/protocol.md section 1, matched against the whole string (ASCII
#: digits only, no trailing newline), on top of the layout module's own check.
_ATTEMPT_NAME = re.compile(r"a-[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8,32}", re.ASCII)
#: Keys a v1 manifest, a v1 manifest's file entry and a marker must all have (`manifest_keys`,
#: `file_keys`: what the features add).
MANIFEST_KEYS = frozenset({"schema", "format_version", "step", "attempt", "created",
                           "hash_algorithm", "files", "metadata"})
FILE_KEYS = frozenset({"path", "size", "digest", "algorithm"})
#: Keys every reference must have (docs/protocol.md §9.2).
REFERENCE_KEYS = frozenset({"path", "step", "attempt", "source", "size", "algorithm", "chunks"})
#: The ``layout`` of a chunked manifest: sharded (v2, v4) or not (v3).
SHARDED_LAYOUT = "sharded"
INCREMENTAL_LAYOUT = "incremental"
MARKER_KEYS = frozenset({"schema", "format_version", "step", "attempt", "manifest",
                         "manifest_digest", "manifest_size", "created", "writer"})
#: The marker binds the manifest with sha256 whatever algorithm the files use, so the commit
#: itself (marker -> manifest) can always be checked with nothing but Python's hashlib.
MARKER_DIGEST_ALGORITHM = "sha256"


class DuplicateKeyError(ValueError):
    """A JSON object or msgpack map names a key twice (raised inside the decoders and turned
    into `CorruptCheckpointError` by them)."""


def unique_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """``object_pairs_hook`` for ``json`` and ``msgpack``: a map that names a key twice is
    malformed (the format never writes one, and "the last one wins" would let two readers
    disagree about the same bytes)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(f"duplicate key {key!r:.80}")
            seen.add(key)
    return out


def manifest_keys(feats: frozenset[str]) -> frozenset[str]:
    """Keys every manifest with the features ``feats`` must have: v1's (§2.1), ``layout`` for
    a chunked format, ``world_size`` for a sharded one (§8.2), ``references`` (§9.2)."""
    return (MANIFEST_KEYS | ({"layout"} if CHUNKED in feats else set())
            | ({"world_size"} if SHARDED in feats else set())
            | ({"references"} if REFERENCES in feats else set())
            | ({"rank_table"} if RANK_METADATA in feats else set()))


def file_keys(feats: frozenset[str]) -> frozenset[str]:
    """Keys every file entry of a manifest with the features ``feats`` must have: v1's,
    ``chunks`` for a chunked format, ``rank`` for a sharded one."""
    return (FILE_KEYS | ({"chunks"} if CHUNKED in feats else set())
            | ({"rank"} if SHARDED in feats else set()))


def layout_of(feats: frozenset[str]) -> str:
    """The ``layout`` key of a chunked manifest: ``"sharded"`` or ``"incremental"``."""
    return SHARDED_LAYOUT if SHARDED in feats else INCREMENTAL_LAYOUT


@dataclass(frozen=True)
class Manifest:
    """The manifest of a checkpoint of any format version: what it holds is its ``features``
    (`ckptfs.format.features`), and its ``format_version`` is the version that names them.

    ``files`` are this attempt's own files (`ChunkedFileEntry` in a chunked format);
    ``world_size`` is the number of ranks that wrote it (``"sharded"`` only, else 0);
    ``references`` the chunks it uses from other attempts' files (``"references"`` only, else
    ``()``); ``rank_table`` what the table of rank files holds (``"rank-metadata"``
    only).  A ``"rank-metadata"`` manifest lists only the coordinator's documents (entries
    with ``rank`` None); entries with a rank are those a reader added from the table
    (`ckptfs.protocol.rank_metadata`): never encoded, and counted in ``rank_table``."""

    step: int
    attempt: str
    files: tuple[FileEntry, ...]
    created: str  # ISO-8601 UTC
    hash_algorithm: str
    metadata: dict[str, Any] = field(default_factory=dict)
    features: frozenset[str] = frozenset()
    world_size: int = 0
    references: tuple[Reference, ...] = ()
    rank_table: RankTable | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", frozenset(self.features))
        version_of(self.features)  # a set no version names is a programming error
        if self.world_size and SHARDED not in self.features:
            raise ValueError("world_size is a feature of sharded manifests only")
        if self.references and REFERENCES not in self.features:
            raise ValueError("references need the 'references' feature")
        if (self.rank_table is None) != (RANK_METADATA not in self.features):
            raise ValueError("a rank table is what the 'rank-metadata' feature adds")

    @property
    def format_version(self) -> int:
        """The format version whose features this manifest has (`version_of`)."""
        return version_of(self.features)

    def file(self, path: str) -> FileEntry:
        return self._files_by_path[path]

    def reference(self, path: str) -> Reference | None:
        """The reference named ``path`` (``None``: none, or no references feature)."""
        return self._references_by_path.get(path) if self.references else None

    # Indexes built on first use (a frozen manifest never changes): a sharded checkpoint has a
    # file per rank, and a load or copy asks for thousands of them by path.
    @functools.cached_property
    def _files_by_path(self) -> dict[str, FileEntry]:
        out: dict[str, FileEntry] = {}
        for entry in self.files:
            out.setdefault(entry.path, entry)  # the first of a path, as a scan finds it
        return out

    @functools.cached_property
    def _references_by_path(self) -> dict[str, Reference]:
        out: dict[str, Reference] = {}
        for ref in self.references:
            out.setdefault(ref.path, ref)
        return out

    def chunked(self, path: str) -> ChunkedFileEntry:
        """The chunked file ``path`` of the manifest, or the reference named ``path`` as a
        `ReferencedFile` (read at its location, its used chunks only); ``KeyError`` if
        neither (a whole-file format has no chunked files)."""
        ref = self.reference(path)
        if ref is not None:
            return ReferencedFile.of(ref)
        entry = self.file(path)
        if not isinstance(entry, ChunkedFileEntry):
            raise KeyError(path)
        return entry

    @property
    def total_bytes(self) -> int:
        if self.rank_table is not None:
            return sum(e.size for e in self.files if _own(e)) + self.rank_table.rank_bytes
        return sum(e.size for e in self.files)

    @property
    def bytes_written(self) -> int:
        """Bytes this checkpoint's own files hold (what its save wrote, the manifest aside)."""
        return self.total_bytes

    @property
    def logical_bytes(self) -> int:
        """Bytes a full load reads: its own files and every chunk it references."""
        return self.total_bytes + sum(r.used_bytes for r in self.references)

    def as_doc(self) -> dict[str, Any]:
        """The manifest's JSON document: v1's keys (§2.1), and per feature ``layout`` and each
        file's ``chunks`` (chunked), ``world_size`` and each file's ``rank`` (sharded),
        ``references``."""
        feats = self.features
        doc: dict[str, Any] = {
            "schema": MANIFEST_SCHEMA, "format_version": self.format_version,
            "step": self.step, "attempt": self.attempt, "created": self.created,
            "hash_algorithm": self.hash_algorithm,
            "files": [self._file_doc(e) for e in self.files
                      if self.rank_table is None or _own(e)],
            "metadata": self.metadata,
        }
        if CHUNKED in feats:
            doc["layout"] = layout_of(feats)
        if SHARDED in feats:
            doc["world_size"] = self.world_size
        if REFERENCES in feats:
            doc["references"] = [r.as_doc() for r in self.references]
        if self.rank_table is not None:
            doc["rank_table"] = self.rank_table.as_doc()
        return doc

    def _file_doc(self, e: FileEntry) -> dict[str, Any]:
        out: dict[str, Any] = {"path": e.path, "size": e.size, "digest": e.digest,
                               "algorithm": e.algorithm}
        if CHUNKED in self.features:
            if not isinstance(e, ChunkedFileEntry):
                raise TypeError(
                    f"{e.path}: a v{self.format_version} manifest lists chunked files only")
            if SHARDED in self.features:
                out["rank"] = e.rank
            out["chunks"] = [[c.offset, c.length, c.digest] for c in e.chunks]
        return {**out, **store_checksums_doc(e)}

    def to_bytes(self) -> bytes:
        """The manifest's bytes: sorted keys, no NaN; a whole-file format (v1) indented by
        one space, a chunked one compact (its chunk lists would double it)."""
        if CHUNKED in self.features:
            text = json.dumps(self.as_doc(), sort_keys=True, separators=(",", ":"),
                              allow_nan=False)
        else:
            text = json.dumps(self.as_doc(), sort_keys=True, indent=1, allow_nan=False)
        return (text + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Decode a format v1 manifest: what a ckptfs that reads only format v1 runs (a newer
        version is `FormatVersionError`).  Every version this ckptfs reads:
        `ckptfs.format.versions.decode_manifest`."""
        doc = load_json(data, MAX_MANIFEST_BYTES, where)
        _check_header(doc, MANIFEST_SCHEMA, where)
        return decode_doc(doc, FEATURES[FORMAT_VERSION], where=where)


def _own(e: FileEntry) -> bool:
    """Whether a manifest lists ``e`` itself (not a rank file a v5 reader added from the
    table)."""
    return not isinstance(e, ChunkedFileEntry) or e.rank is None


def decode_doc(doc: dict[str, Any], feats: frozenset[str], *, where: str) -> Manifest:
    """Decode the manifest document ``doc`` (parsed by the bounded JSON reader, schema and
    version checked) of a format with the features ``feats``: the one decoder, whose rules
    the features choose.  Typed errors only (docs/protocol.md §2.1, §8.2, §9.2, §9.6)."""
    if CHUNKED not in feats:
        return _decode_whole(doc, where)
    return _decode_chunked(doc, feats, where)


def _decode_whole(doc: dict[str, Any], where: str) -> Manifest:
    """Format v1 (no features): whole files with their digests, v1's own key set."""
    try:
        _require(doc, MANIFEST_KEYS, "manifest")
        step = _step(doc["step"])
        attempt = _attempt(doc["attempt"])
        raw_files = doc["files"]
        if not isinstance(raw_files, list) or len(raw_files) > MAX_FILES:
            raise TypeError(f"'files' is not a list of at most {MAX_FILES} entries")
        files = []
        seen = set()
        for raw in raw_files:
            if not isinstance(raw, dict):
                raise TypeError("a 'files' entry is not an object")
            _require(raw, FILE_KEYS, "file entry")
            path = check_relpath(raw["path"])
            size = raw["size"]
            if not _is_int(size) or not 0 <= size <= MAX_FILE_SIZE:
                raise UnsafeCheckpointError(f"{where}: file {path!r} has bad size {size!r}")
            algo, _ = parse_digest(raw["digest"])
            if raw["algorithm"] != algo:
                raise TypeError(f"file {path!r}: 'algorithm' differs from its digest's")
            if path in seen:
                raise UnsafeCheckpointError(f"{where}: file {path!r} listed twice")
            seen.add(path)
            files.append(FileEntry(path, size, raw["digest"],
                                   store_checksums=decode_store_checksums(raw, path)))
        metadata = doc["metadata"]
        if not isinstance(metadata, dict):
            raise TypeError("'metadata' is not an object")
        created, hash_algorithm = doc["created"], doc["hash_algorithm"]
        if not isinstance(created, str):
            raise TypeError("'created' is not a string")
        if hash_algorithm not in ALGORITHMS:
            raise TypeError(f"unknown hash_algorithm {hash_algorithm!r:.40}")
    except (KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{where}: malformed manifest ({type(exc).__name__}: {exc})"
        ) from None
    return Manifest(step, attempt, tuple(files), created, hash_algorithm, metadata)


def _decode_chunked(doc: dict[str, Any], feats: frozenset[str], where: str) -> Manifest:
    """A chunked format (v2, v3, v4): every key of its features required, the algorithm known
    and the same in every digest, each chunk list tiling its file and bound by the file's
    digest; sharded: exactly one ``dcp.msgpack`` and every other file the canonical
    ``rank-NNNNN/data-K.safetensors`` of its ``rank`` (``0 <= rank < world_size``); else a
    ``state.msgpack``; references: each well formed (a safe source path, an attempt name,
    chunks sorted, disjoint, inside the file, the header chunk first; sharded: the source a
    rank file), no name used twice, at most ``MAX_FILES`` files and references in all."""
    label = f"v{version_of(feats)}"
    sharded = SHARDED in feats
    try:
        missing = sorted(manifest_keys(feats) - set(doc))
        if missing:
            raise KeyError(f"{label} manifest lacks {missing}")
        layout = layout_of(feats)
        if doc["layout"] != layout:
            raise TypeError(f"layout {doc['layout']!r:.40} is not {layout!r}")
        step, attempt = doc["step"], doc["attempt"]
        if not _is_int(step) or not 0 <= step <= MAX_STEP:
            raise TypeError(f"step {step!r:.40} is not an int in [0, {MAX_STEP}]")
        if not isinstance(attempt, str) or not is_attempt_name(attempt):
            raise TypeError(f"attempt {attempt!r:.80} is not an attempt name")
        world = 0
        if sharded:
            world = doc["world_size"]
            if not _is_int(world) or world < 1:
                raise TypeError(f"world_size {world!r:.40} is not a positive int")
        algo = doc["hash_algorithm"]
        if algo not in ALGORITHMS:
            raise TypeError(f"unknown hash_algorithm {algo!r:.40}")
        metadata, created = doc["metadata"], doc["created"]
        if not isinstance(metadata, dict) or not isinstance(created, str):
            raise TypeError("'metadata' is not an object or 'created' not a string")
        raw_files = doc["files"]
        raw_refs = doc["references"] if REFERENCES in feats else []
        if not isinstance(raw_files, list) or not isinstance(raw_refs, list) \
                or len(raw_files) + len(raw_refs) > MAX_FILES:
            raise TypeError(f"'files' and 'references' are not lists of at most "
                            f"{MAX_FILES} entries in all")
        seen: set[str] = set()
        files = [_decode_file(raw, seen, feats, world, where) for raw in raw_files]
        table = _decode_rank_table(doc, feats, files, world, algo)
        refs = _required_and_references(seen, list(raw_refs), attempt, sharded,
                                        table is not None, where)
    except Exception as exc:
        raise manifest_error(exc, where, label) from None
    return Manifest(step, attempt, tuple(files), created, algo, metadata, feats,
                    world_size=world, references=tuple(refs), rank_table=table)


def _decode_rank_table(doc: dict[str, Any], feats: frozenset[str],
                       files: list[ChunkedFileEntry], world: int, algo: str
                       ) -> RankTable | None:
    """Format v5: ``rank_table`` well formed, and the files exactly ``dcp-spec.msgpack`` and
    the table's blocks, each block of its rows' exact size (docs/protocol.md §9.7)."""
    if RANK_METADATA not in feats:
        return None
    raw = doc["rank_table"]
    if not isinstance(raw, dict) or not {"rows_per_block", "rank_files", "rank_bytes"} <= set(raw):
        raise TypeError("rank_table is not an object with rows_per_block, rank_files and "
                        "rank_bytes")
    return _check_rank_table(raw["rows_per_block"], raw["rank_files"], raw["rank_bytes"],
                             files, world, algo)


def _check_rank_table(rows: Any, count: Any, nbytes: Any, files: list[ChunkedFileEntry],
                      world: int, algo: str) -> RankTable:
    """The rules of a ``rank_table`` (the decoder's and `check_model`'s)."""
    if not _is_int(rows) or not 1 <= rows <= MAX_ROWS_PER_BLOCK:
        raise TypeError(f"rows_per_block {rows!r:.40} is not in [1, {MAX_ROWS_PER_BLOCK}]")
    if not _is_int(count) or not 0 <= count <= world or not _is_int(nbytes) \
            or not 0 <= nbytes <= MAX_FILE_SIZE * 2 * world:
        raise TypeError(f"rank_files {count!r:.40} or rank_bytes {nbytes!r:.40}")
    width = rank_row_bytes(algo)
    want = {SPEC_NAME: None}
    for b in range(-(-world // rows)):
        want[table_block_name(b)] = min(rows, world - b * rows) * width
    got = {e.path: e for e in files}
    if set(got) != set(want):
        raise TypeError(f"the files of a v5 manifest are {SPEC_NAME} and the blocks of its "
                        f"rank table ({len(want) - 1} for world_size {world}), found "
                        f"{sorted(set(got) ^ set(want))[:4]} in excess or missing")
    for path, size in want.items():
        if size is not None and got[path].size != size:
            raise TypeError(f"{path} is {got[path].size} B, its rows {size} B")
    return RankTable(rows, count, nbytes)


def check_model(manifest: Manifest, *, where: str) -> None:
    """What the reader's decoder (`decode_doc` of ``load_json``) raises for
    ``manifest.to_bytes()`` of a chunked format (v2-v5), found on the model itself: a
    writer checks the manifest it is about to commit without parsing it back.  The document
    is the model's `Manifest.as_doc` (every key of its features, its version's schema), its
    JSON is faithful but for ``metadata`` (decoded here, as the reader decodes it: duplicate
    keys, depth, constants), and the checks run in the decoder's order, with its errors:
    header, files (names, sizes, digests, ranks, each chunk a hex digest of the file's
    algorithm, tiling and the file digest: already checked by `make_entry` for the entries it
    made, `is_bound`), the rank table (v5), references."""
    feats = manifest.features
    label = f"v{version_of(feats)}"
    if CHUNKED not in feats:
        raise ValueError("check_model checks chunked manifests")  # pragma: no cover
    sharded = SHARDED in feats
    meta_doc = json.dumps({"metadata": manifest.metadata}, sort_keys=True,
                          separators=(",", ":"), allow_nan=False).encode()
    load_json(meta_doc, MAX_MANIFEST_BYTES, where)  # the same JSON, one level below the root
    try:
        step, attempt, world = manifest.step, manifest.attempt, manifest.world_size
        if not _is_int(step) or not 0 <= step <= MAX_STEP:
            raise TypeError(f"step {step!r:.40} is not an int in [0, {MAX_STEP}]")
        if not isinstance(attempt, str) or not is_attempt_name(attempt):
            raise TypeError(f"attempt {attempt!r:.80} is not an attempt name")
        if sharded and (not _is_int(world) or world < 1):
            raise TypeError(f"world_size {world!r:.40} is not a positive int")
        if manifest.hash_algorithm not in ALGORITHMS:
            raise TypeError(f"unknown hash_algorithm {manifest.hash_algorithm!r:.40}")
        if not isinstance(manifest.metadata, dict) or not isinstance(manifest.created, str):
            raise TypeError("'metadata' is not an object or 'created' not a string")
        refs = manifest.references if REFERENCES in feats else ()
        if len(manifest.files) + len(refs) > MAX_FILES:
            raise TypeError(f"'files' and 'references' are not lists of at most "
                            f"{MAX_FILES} entries in all")
        seen: set[str] = set()
        hexes: set[str] = set()
        own = [e for e in manifest.files if _own(e)]  # v5: a view's rank files are not encoded
        for entry in own if manifest.rank_table is not None else manifest.files:
            _check_file(entry, seen, hexes, feats, world, where)
        table = manifest.rank_table
        if table is not None:
            _check_rank_table(table.rows_per_block, table.rank_files, table.rank_bytes,
                              [e for e in own if isinstance(e, ChunkedFileEntry)], world,
                              manifest.hash_algorithm)
        _required_and_references(seen, [r.as_doc() for r in refs], manifest.attempt, sharded,
                                 table is not None, where)
    except Exception as exc:
        raise manifest_error(exc, where, label) from None


def _check_file(entry: FileEntry, seen: set[str], hexes: set[str], feats: frozenset[str],
                world: int, where: str) -> None:
    """`_decode_file` on the model's entry (``hexes``: the chunk digests found good so far)."""
    if not isinstance(entry, ChunkedFileEntry):
        raise TypeError(f"{entry.path}: a chunked manifest lists chunked files only")
    path = _name(entry.path, seen, where)
    size = _size(entry.size, path, where)
    algo, _ = parse_digest(entry.digest)
    rank: Any = entry.rank
    if RANK_METADATA in feats:
        if rank is not None:
            raise TypeError(f"file {path!r}: rank {rank!r:.20} (must be null)")
    elif SHARDED in feats:
        if path == METADATA_NAME:
            if rank is not None:
                raise TypeError(f"file {path!r}: rank {rank!r:.20} (must be null)")
        elif not _is_int(rank) or rank_of_file(path) != rank or not 0 <= rank < world:
            raise TypeError(f"file {path!r} (rank {rank!r:.20}) is neither {METADATA_NAME} "
                            f"nor the rank-NNNNN/data-K.safetensors file of its rank (0 <= "
                            f"rank < world_size {world})")
    for c in entry.chunks:
        if not _is_int(c.offset) or not _is_int(c.length) or not isinstance(c.digest, str):
            raise TypeError(f"file {path!r}: a chunk is not [offset, length, hex]")
        key = f"{algo}:{c.digest}"
        if key not in hexes:
            parse_digest(key)
            hexes.add(key)
    store_checksums = decode_store_checksums(store_checksums_doc(entry), path)
    if not is_bound(entry):
        bound_entry(path, size, entry.digest, algo, list(entry.chunks), rank, where=where,
                    store_checksums=store_checksums)


def manifest_error(exc: Exception, where: str, version: str) -> Exception:
    """What the decoder of a chunked format (v2-v4) raises for ``exc``: a typed ckptfs error
    (path, size, digest) named after the manifest ``where``, a malformed field as
    `CorruptCheckpointError`; anything else unchanged."""
    if isinstance(exc, CorruptCheckpointError):
        return exc if str(exc).startswith(where) else type(exc)(f"{where}: {exc}")
    if isinstance(exc, (KeyError, TypeError, ValueError, AttributeError)):
        return CorruptCheckpointError(
            f"{where}: malformed {version} manifest ({type(exc).__name__}: {exc})")
    return exc


def _name(raw: Any, seen: set[str], where: str) -> str:
    path = check_relpath(raw)
    if path in seen:
        raise UnsafeCheckpointError(f"{where}: file {path!r} listed twice")
    seen.add(path)
    return path


def _size(raw: Any, path: str, where: str) -> int:
    if not _is_int(raw) or not 0 <= raw <= MAX_FILE_SIZE:
        raise UnsafeCheckpointError(f"{where}: file {path!r} has bad size {raw!r:.40}")
    return int(raw)


def _decode_file(raw: Any, seen: set[str], feats: frozenset[str], world: int,
                 where: str) -> ChunkedFileEntry:
    if not isinstance(raw, dict):
        raise TypeError("a 'files' entry is not an object")
    missing = sorted(file_keys(feats) - set(raw))
    if missing:
        raise KeyError(f"file entry lacks {missing}")
    path = _name(raw["path"], seen, where)
    size = _size(raw["size"], path, where)
    algo, _ = parse_digest(raw["digest"])
    if raw["algorithm"] != algo:
        raise TypeError(f"file {path!r}: 'algorithm' differs from its digest's")
    rank = None
    if RANK_METADATA in feats:
        if raw["rank"] is not None:
            raise TypeError(f"file {path!r}: rank {raw['rank']!r:.20} (must be null)")
    elif SHARDED in feats:
        rank = raw["rank"]
        if path == METADATA_NAME:
            if rank is not None:
                raise TypeError(f"file {path!r}: rank {rank!r:.20} (must be null)")
        elif not _is_int(rank) or rank_of_file(path) != rank or not 0 <= rank < world:
            raise TypeError(f"file {path!r} (rank {rank!r:.20}) is neither {METADATA_NAME} "
                            f"nor the rank-NNNNN/data-K.safetensors file of its rank (0 <= "
                            f"rank < world_size {world})")
    chunks = decode_chunks(raw["chunks"], algo, path)
    return bound_entry(path, size, raw["digest"], algo, chunks, rank, where=where,
                       store_checksums=decode_store_checksums(raw, path))



def _required_and_references(seen: set[str], raw_refs: list[Any], attempt: str, sharded: bool,
                             ranked: bool, where: str) -> list[Reference]:
    """The decoder's and the model check's last rules, written once: the document the
    features require is among the files (the spec with rank metadata, else ``dcp.msgpack``
    sharded, else ``state.msgpack``), and every reference decodes, a sharded one naming a rank
    file."""
    required = SPEC_NAME if ranked else METADATA_NAME if sharded else STATE_NAME
    if required not in seen:
        raise KeyError(f"no {required} among the files")
    refs = [_decode_reference(raw, seen, attempt, where) for raw in raw_refs]
    for ref in refs:
        if sharded and rank_of_file(ref.source) is None:
            raise UnsafeCheckpointError(
                f"{where}: reference {ref.path!r} names {ref.source!r}, not a rank "
                "file (rank-NNNNN/data-K.safetensors)")
    return refs

def _decode_reference(raw: Any, seen: set[str], attempt: str, where: str) -> Reference:
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
class Marker:
    """The COMPLETE marker: binds a step to one attempt's manifest by digest."""

    step: int
    attempt: str
    manifest_digest: str
    manifest_size: int
    created: str
    writer: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        doc = {
            "schema": MARKER_SCHEMA,
            "format_version": self.format_version,
            "step": self.step,
            "attempt": self.attempt,
            "manifest": "MANIFEST.json",
            "manifest_digest": self.manifest_digest,
            "manifest_size": self.manifest_size,
            "created": self.created,
            "writer": self.writer,
        }
        return (json.dumps(doc, sort_keys=True, allow_nan=False) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "marker") -> Marker:
        doc = load_json(data, MAX_MARKER_BYTES, where)
        _check_header(doc, MARKER_SCHEMA, where)
        try:
            _require(doc, MARKER_KEYS, "commit marker")
            step, attempt = _step(doc["step"]), _attempt(doc["attempt"])
            if doc["manifest"] != MANIFEST_NAME:
                raise TypeError(f"'manifest' is not {MANIFEST_NAME!r}")
            mdigest, msize = doc["manifest_digest"], doc["manifest_size"]
            parse_digest(mdigest)
            if not _is_int(msize) or not 0 < msize <= MAX_MANIFEST_BYTES:
                raise TypeError(f"'manifest_size' is not an int in [1, {MAX_MANIFEST_BYTES}]")
            writer, created = doc["writer"], doc["created"]
            if not isinstance(writer, dict) or not isinstance(created, str):
                raise TypeError("'writer' is not an object or 'created' not a string")
        except (KeyError, TypeError) as exc:
            raise CorruptCheckpointError(
                f"{where}: malformed commit marker ({type(exc).__name__}: {exc})"
            ) from None
        return cls(step, attempt, mdigest, msize, created, writer, doc["format_version"])

    def check_manifest(self, manifest_bytes: bytes, *, where: str) -> None:
        """Raise `CorruptCheckpointError` unless ``manifest_bytes`` is the manifest this
        marker committed."""
        algo, _ = parse_digest(self.manifest_digest)
        actual = digest_bytes(algo, manifest_bytes)
        if len(manifest_bytes) != self.manifest_size or actual != self.manifest_digest:
            raise CorruptCheckpointError(
                f"{where}: manifest does not match its commit marker COMPLETE (marker records "
                f"{self.manifest_digest} / {self.manifest_size} B, found {actual} / "
                f"{len(manifest_bytes)} B): the manifest or the marker was replaced or corrupted "
                "after commit",
                step=self.step,
                path=where,
            )


def check_metadata(meta: Mapping[str, Any], *, what: str = "checkpoint metadata") -> None:
    """Writer side: raise `UnsupportedValueError` (naming the key path) unless ``meta``
    is JSON that every reader accepts and reads back equal: ``str`` keys only (``json`` would
    turn ``1`` into ``"1"`` silently), str/int/finite float/bool/None/list/tuple/dict values,
    ints of at most `MAX_BIGINT_DIGITS` digits, valid Unicode, and nesting that keeps the
    manifest within `MAX_JSON_DEPTH`.  Tuples are stored as JSON arrays (read back as
    lists)."""
    budget = MAX_JSON_DEPTH - 1  # the manifest object itself is one level

    def fail(path: tuple[Any, ...], why: str) -> UnsupportedValueError:
        where = "/".join(str(p) for p in path) or "<root>"
        return UnsupportedValueError(
            f"{what} at key path {where[:200]!r}: {why}. Metadata must be plain JSON: str keys; "
            "str, int, finite float, bool, None, lists and dicts")

    def walk(value: Any, path: tuple[Any, ...], depth: int, stack: set[int]) -> None:
        if value is None or isinstance(value, bool):
            return
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise fail(path, f"string is not valid Unicode ({exc.reason})") from None
            return
        if isinstance(value, int):
            if bigint_text(value) is None:
                raise fail(path, f"int has more than {MAX_BIGINT_DIGITS} decimal digits")
            return
        if isinstance(value, float):
            if not math.isfinite(value):
                raise fail(path, f"float {value} is not finite (JSON has no inf/nan)")
            return
        if not isinstance(value, (Mapping, list, tuple)):
            raise fail(path, f"type {type(value).__name__} is not JSON")
        if id(value) in stack:
            raise fail(path, "the container contains itself")
        if depth + 1 > budget:
            raise fail(path, f"nested deeper than {budget} levels")
        stack.add(id(value))
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise fail(path, f"key {k!r:.40} is a {type(k).__name__}, not a str")
                walk(k, (*path, "<key>"), depth, stack)
                walk(v, (*path, k), depth + 1, stack)
        else:
            for i, v in enumerate(value):
                walk(v, (*path, i), depth + 1, stack)
        stack.discard(id(value))

    walk(meta, (), 0, set())


def bigint_text(value: int) -> str | None:
    """``str(value)``, or ``None`` if it has more than `MAX_BIGINT_DIGITS` digits (checked
    from the bit length first: converting a huge int is slow, and raises past Python's own
    limit)."""
    if abs(value).bit_length() > 14_300:  # 10**4300 < 2**14_285
        return None
    try:
        text = str(int(value))
    except ValueError:  # this process lowered sys.set_int_max_str_digits
        return None
    return text if len(text.lstrip("-")) <= MAX_BIGINT_DIGITS else None


def check_document_size(data: bytes, limit: int, what: str) -> None:
    """Writer side: refuse to write a protocol document the reader would refuse for its size."""
    if len(data) > limit:
        raise UnsupportedValueError(
            f"{what} would be {len(data)} bytes, more than the {limit}-byte limit readers "
            "enforce; nothing was written. Keep checkpoint metadata small (store large data in "
            "the state, as tensors or bytes)")


def load_json(data: bytes, limit: int, where: str) -> dict[str, Any]:
    if len(data) > limit:
        raise UnsafeCheckpointError(f"{where}: {len(data)} bytes exceeds the {limit}-byte limit")
    if not data:
        raise CorruptCheckpointError(f"{where}: empty file")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant,
                         object_pairs_hook=unique_pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object")
    if _json_depth(doc) > MAX_JSON_DEPTH:
        raise UnsafeCheckpointError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return doc


def _json_depth(doc: object) -> int:
    """Nesting of a parsed JSON value: objects and arrays enclosing the deepest value (a
    scalar is 0, ``{}`` is 1).  Iterative: a hostile document cannot exhaust the stack."""
    deepest = 0
    todo: list[tuple[object, int]] = [(doc, 0)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            children = node.values() if isinstance(node, dict) else node
            todo.extend((c, depth) for c in children if isinstance(c, (dict, list)))
    return deepest


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require(doc: dict[str, Any], keys: frozenset[str], what: str) -> None:
    missing = sorted(keys - doc.keys())
    if missing:
        raise KeyError(f"{what} lacks required key(s) {', '.join(missing)}")


def _step(step: object) -> int:
    # docs/protocol.md: 0 <= step <= 10^12 - 1, the steps a step directory can name
    if not _is_int(step) or not 0 <= step <= MAX_STEP:  # type: ignore[operator]
        raise TypeError(f"'step' is not an int in [0, {MAX_STEP}]: {step!r:.40}")
    return step  # type: ignore[return-value]


def _attempt(attempt: object) -> str:
    if (not isinstance(attempt, str) or not _ATTEMPT_NAME.fullmatch(attempt)
            or not is_attempt_name(attempt)):
        raise TypeError(f"'attempt' is not an attempt name: {attempt!r:.80}")
    return attempt


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _check_header(doc: dict[str, Any], schema: str, where: str) -> None:
    if doc.get("schema") != schema:
        raise CorruptCheckpointError(f"{where}: schema is {doc.get('schema')!r}, not {schema!r}")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptCheckpointError(f"{where}: bad format_version {version!r}")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: written by format version {version}; this ckptfs reads up to "
            f"{FORMAT_VERSION}: upgrade ckptfs"
        )
