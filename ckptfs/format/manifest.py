"""The manifest and the commit marker of format v1: frozen dataclasses and their bytes.

Both are UTF-8 JSON objects (``sort_keys``, no NaN), readable with nothing but ``json``.  Decoding
is strict and bounded: sizes are checked before anything is allocated, a key named twice, a
missing key or nesting beyond `MAX_JSON_DEPTH` is an error, every
path goes through `ckptfs.format.layout.check_relpath`, unknown schema or a newer format
version is a typed error.  Unknown extra keys are ignored (docs/protocol.md, section 2.1).
The writer's side (`check_metadata`, `check_document_size`) enforces the same
limits before anything is written.
"""

from __future__ import annotations

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
from ckptfs.format.hashing import (
    ALGORITHMS,
    STORE_CHECKSUM_HEX,
    digest_bytes,
    parse_digest,
)
from ckptfs.format.layout import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_STEP,
    check_relpath,
    is_attempt_name,
)
from ckptfs.format.limits import (
    MAX_BIGINT_DIGITS,
    MAX_FILE_SIZE,
    MAX_FILES,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    MAX_MARKER_BYTES,
)

MANIFEST_SCHEMA = "ckptfs.manifest"
MARKER_SCHEMA = "ckptfs.commit"
#: The attempt-name rule of docs/protocol.md section 1, matched against the whole string (ASCII
#: digits only, no trailing newline), on top of the layout module's own check.
_ATTEMPT_NAME = re.compile(r"a-[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8,32}", re.ASCII)
#: Keys a v1 manifest, a manifest's file entry and a v1 marker must all have.
MANIFEST_KEYS = frozenset({"schema", "format_version", "step", "attempt", "created",
                           "hash_algorithm", "files", "metadata"})
FILE_KEYS = frozenset({"path", "size", "digest", "algorithm"})
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


#: The optional per-file key holding the store's whole-object checksums (section 2.1).
STORE_CHECKSUMS_KEY = "store_checksums"


def store_checksums_doc(entry: FileEntry) -> dict[str, Any]:
    """The optional ``store_checksums`` key of a file entry (nothing when it has none, so a
    manifest without them is byte-identical to one written before the key existed)."""
    if not entry.store_checksums:
        return {}
    return {STORE_CHECKSUMS_KEY: dict(entry.store_checksums)}


def decode_store_checksums(raw: Mapping[str, Any], path: str) -> tuple[tuple[str, str], ...]:
    """The ``store_checksums`` of a file entry: an object of ``name: hex``.  Names this reader
    does not know are ignored (a newer writer's); a known name with a malformed value, or a
    value that is not an object, is a malformed manifest (``TypeError``, reported by the
    decoder as `CorruptCheckpointError`)."""
    value = raw.get(STORE_CHECKSUMS_KEY)
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise TypeError(f"file {path!r}: {STORE_CHECKSUMS_KEY!r} is not an object")
    out = []
    for name, hexdigest in sorted(value.items()):
        width = STORE_CHECKSUM_HEX.get(name)
        if width is None:
            continue
        if (not isinstance(hexdigest, str) or len(hexdigest) != width
                or any(c not in "0123456789abcdef" for c in hexdigest)):
            raise TypeError(f"file {path!r}: store checksum {name} is not {width} hex digits")
        out.append((name, hexdigest))
    return tuple(out)


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the attempt directory
    size: int
    digest: str  # "algorithm:hex"
    #: Optional (docs/protocol.md section 2.1): ``(algorithm, hex)`` of the whole-object
    #: checksums the object store keeps (``ckptfs.format.hashing.STORE_CHECKSUMS``), computed
    #: while writing, for ``verify(remote=True)``.  Older readers ignore the key.
    store_checksums: tuple[tuple[str, str], ...] = field(default=(), kw_only=True)

    @property
    def algorithm(self) -> str:
        return self.digest.split(":", 1)[0]


@dataclass(frozen=True)
class Manifest:
    step: int
    attempt: str
    files: tuple[FileEntry, ...]
    created: str  # ISO-8601 UTC
    hash_algorithm: str
    metadata: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(path)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files)

    def to_bytes(self) -> bytes:
        doc = {
            "schema": MANIFEST_SCHEMA,
            "format_version": self.format_version,
            "step": self.step,
            "attempt": self.attempt,
            "created": self.created,
            "hash_algorithm": self.hash_algorithm,
            "files": [
                {"path": e.path, "size": e.size, "digest": e.digest, "algorithm": e.algorithm,
                 **store_checksums_doc(e)}
                for e in self.files
            ],
            "metadata": self.metadata,
        }
        return (json.dumps(doc, sort_keys=True, indent=1, allow_nan=False) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        doc = load_json(data, MAX_MANIFEST_BYTES, where)
        _check_header(doc, MANIFEST_SCHEMA, where)
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
        return cls(step, attempt, tuple(files), created, hash_algorithm, metadata,
                   doc["format_version"])


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
