"""The manifest and the commit marker of format v1: frozen dataclasses and their bytes.

Both are UTF-8 JSON objects (``sort_keys``, no NaN), readable with nothing but ``json``.  Decoding
is strict and bounded: sizes are checked before anything is allocated, every path goes through
:func:`ckptfs.format.layout.check_relpath`, unknown schema or a newer format version is a typed
error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ckptfs.errors import CorruptCheckpointError, FormatVersionError, UnsafeCheckpointError
from ckptfs.format.hashing import digest_bytes, parse_digest
from ckptfs.format.layout import FORMAT_VERSION, check_relpath, is_attempt_name

MANIFEST_SCHEMA = "ckptfs.manifest"
MARKER_SCHEMA = "ckptfs.commit"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_MARKER_BYTES = 64 * 1024
MAX_FILES = 1_000_000
MAX_FILE_SIZE = 1 << 50  # 1 PiB: anything larger in a manifest is hostile
#: The marker binds the manifest with sha256 whatever algorithm the files use, so the commit
#: itself (marker -> manifest) can always be checked with nothing but Python's hashlib.
MARKER_DIGEST_ALGORITHM = "sha256"


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the attempt directory
    size: int
    digest: str  # "algorithm:hex"

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
                {"path": e.path, "size": e.size, "digest": e.digest, "algorithm": e.algorithm}
                for e in self.files
            ],
            "metadata": self.metadata,
        }
        return (json.dumps(doc, sort_keys=True, indent=1, allow_nan=False) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        doc = _load_json(data, MAX_MANIFEST_BYTES, where)
        _check_header(doc, MANIFEST_SCHEMA, where)
        try:
            step = doc["step"]
            attempt = doc["attempt"]
            raw_files = doc["files"]
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise TypeError("step")
            if not isinstance(attempt, str) or not is_attempt_name(attempt):
                raise TypeError("attempt")
            if not isinstance(raw_files, list) or len(raw_files) > MAX_FILES:
                raise TypeError("files")
            files = []
            seen = set()
            for raw in raw_files:
                path = check_relpath(raw["path"])
                size = raw["size"]
                if not isinstance(size, int) or isinstance(size, bool) or not (
                    0 <= size <= MAX_FILE_SIZE
                ):
                    raise UnsafeCheckpointError(f"{where}: file {path!r} has bad size {size!r}")
                algo, _ = parse_digest(raw["digest"])
                if raw.get("algorithm", algo) != algo:
                    raise TypeError("algorithm")
                if path in seen:
                    raise UnsafeCheckpointError(f"{where}: file {path!r} listed twice")
                seen.add(path)
                files.append(FileEntry(path, size, raw["digest"]))
            metadata = doc.get("metadata", {})
            if not isinstance(metadata, dict):
                raise TypeError("metadata")
            created = doc.get("created", "")
            hash_algorithm = doc.get("hash_algorithm", "")
            if not isinstance(created, str) or not isinstance(hash_algorithm, str):
                raise TypeError("created/hash_algorithm")
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
        doc = _load_json(data, MAX_MARKER_BYTES, where)
        _check_header(doc, MARKER_SCHEMA, where)
        try:
            step, attempt = doc["step"], doc["attempt"]
            mdigest, msize = doc["manifest_digest"], doc["manifest_size"]
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise TypeError("step")
            if not isinstance(attempt, str) or not is_attempt_name(attempt):
                raise TypeError("attempt")
            parse_digest(mdigest)
            if not isinstance(msize, int) or not 0 < msize <= MAX_MANIFEST_BYTES:
                raise TypeError("manifest_size")
            writer = doc.get("writer", {})
            created = doc.get("created", "")
            if not isinstance(writer, dict) or not isinstance(created, str):
                raise TypeError("writer/created")
        except (KeyError, TypeError) as exc:
            raise CorruptCheckpointError(
                f"{where}: malformed commit marker ({type(exc).__name__}: {exc})"
            ) from None
        return cls(step, attempt, mdigest, msize, created, writer, doc["format_version"])

    def check_manifest(self, manifest_bytes: bytes, *, where: str) -> None:
        """Raise :class:`CorruptCheckpointError` unless ``manifest_bytes`` is the manifest this
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


def _load_json(data: bytes, limit: int, where: str) -> dict[str, Any]:
    if len(data) > limit:
        raise UnsafeCheckpointError(f"{where}: {len(data)} bytes exceeds the {limit}-byte limit")
    if not data:
        raise CorruptCheckpointError(f"{where}: empty file")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object")
    return doc


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
