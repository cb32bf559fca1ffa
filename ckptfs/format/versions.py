"""The format table, pure half: which manifest versions this ckptfs reads, how each is decoded,
and which of its documents have a reader limit.

Every manifest is read through `decode_manifest` (the reader) and every manifest a writer
is about to commit is checked through `check_committable` (the commit object), so the
writer refuses exactly what the reader would.  The I/O half of the table (how each version is
loaded and verified) is `ckptfs.protocol.formats`.

========  ===========  ============================================  =====================
version   layout       documents with a size limit (before reading)  spec
========  ===========  ============================================  =====================
1         single       ``state.msgpack``: ``MAX_STATE_DOC_BYTES``    docs/protocol.md §2-5
2         sharded      ``dcp.msgpack``: ``MAX_METADATA_BYTES``        docs/protocol.md §8
3         incremental  ``state.msgpack``: ``MAX_STATE_DOC_BYTES``    docs/protocol.md §9
4         sharded      ``dcp.msgpack``: ``MAX_METADATA_BYTES``        docs/protocol.md §9.6
========  ===========  ============================================  =====================

Version 4 (sharded incremental) is version 2 with version 3's ``references``.
"""

from __future__ import annotations

from typing import TypeGuard

from ckptfs.errors import CorruptCheckpointError, FormatVersionError, UnsupportedValueError
from ckptfs.format.incremental import (
    INCREMENTAL_FORMAT_VERSION,
    SHARDED_INCREMENTAL_FORMAT_VERSION,
    IncrementalManifest,
    ShardedIncrementalManifest,
)
from ckptfs.format.layout import FORMAT_VERSION, STATE_NAME
from ckptfs.format.limits import MAX_MANIFEST_BYTES, MAX_METADATA_BYTES, MAX_STATE_DOC_BYTES
from ckptfs.format.manifest import MANIFEST_SCHEMA, Manifest, check_document_size, load_json
from ckptfs.format.sharded import METADATA_NAME, SHARDED_FORMAT_VERSION, ShardedManifest

#: Manifest format versions this ckptfs reads (and writes).
READ_VERSIONS = (FORMAT_VERSION, SHARDED_FORMAT_VERSION, INCREMENTAL_FORMAT_VERSION,
                 SHARDED_INCREMENTAL_FORMAT_VERSION)
#: Highest manifest format version this ckptfs reads.
MAX_READ_VERSION = max(READ_VERSIONS)

#: Per version: the documents a reader bounds by size before reading them.
DOCUMENT_LIMITS: dict[int, dict[str, int]] = {
    FORMAT_VERSION: {STATE_NAME: MAX_STATE_DOC_BYTES},
    SHARDED_FORMAT_VERSION: {METADATA_NAME: MAX_METADATA_BYTES},
    INCREMENTAL_FORMAT_VERSION: {STATE_NAME: MAX_STATE_DOC_BYTES},
    SHARDED_INCREMENTAL_FORMAT_VERSION: {METADATA_NAME: MAX_METADATA_BYTES},
}


#: What each manifest format version holds, as features: ``"sharded"`` (one file per rank and
#: ``dcp.msgpack``, written collectively), ``"chunked"`` (every file tiled by chunks with their
#: own digests), ``"references"`` (chunks of other attempts' files used in place).  Code above
#: the format asks `features` about a manifest, never its version number.
SHARDED = "sharded"
CHUNKED = "chunked"
REFERENCES = "references"
FEATURES: dict[int, frozenset[str]] = {
    FORMAT_VERSION: frozenset(),
    SHARDED_FORMAT_VERSION: frozenset({SHARDED, CHUNKED}),
    INCREMENTAL_FORMAT_VERSION: frozenset({CHUNKED, REFERENCES}),
    SHARDED_INCREMENTAL_FORMAT_VERSION: frozenset({SHARDED, CHUNKED, REFERENCES}),
}


def features(manifest: Manifest) -> frozenset[str]:
    """The features of ``manifest``'s format (`FEATURES`): ``"sharded" in
    features(m)`` is the test for a collectively written checkpoint, whatever its version."""
    return FEATURES.get(manifest.format_version, frozenset())


def is_sharded(manifest: Manifest) -> TypeGuard[ShardedManifest]:
    """Whether ``manifest`` is of a collectively written format (``"sharded"`` in its
    `features`: v2, v4): the test code above the format uses before it reads a sharded
    manifest's chunk lists."""
    return SHARDED in features(manifest) and isinstance(manifest, ShardedManifest)


def decode_manifest(data: bytes, *, where: str = "manifest") -> Manifest:
    """Decode a manifest of any version this ckptfs reads: v1 (`Manifest`), v2
    (`ShardedManifest`) or v3 (`IncrementalManifest`).  A newer version raises
    `FormatVersionError`; anything malformed `CorruptCheckpointError` (or
    `UnsafeCheckpointError`)."""
    doc = load_json(data, MAX_MANIFEST_BYTES, where)  # bounded: size, depth, duplicate keys
    version = doc.get("format_version")
    newest = max(READ_VERSIONS)
    if isinstance(version, int) and not isinstance(version, bool) and version > newest:
        raise FormatVersionError(
            f"{where}: written by format version {version}; this ckptfs reads up to "
            f"{newest}: upgrade ckptfs")
    if version not in (SHARDED_FORMAT_VERSION, INCREMENTAL_FORMAT_VERSION,
                       SHARDED_INCREMENTAL_FORMAT_VERSION):
        return Manifest.from_bytes(data, where=where)  # v1: its own strict codec
    if doc.get("schema") != MANIFEST_SCHEMA:
        raise CorruptCheckpointError(f"{where}: schema is {doc.get('schema')!r}")
    if version == INCREMENTAL_FORMAT_VERSION:
        return IncrementalManifest.from_doc(doc, where=where)
    if version == SHARDED_INCREMENTAL_FORMAT_VERSION:
        return ShardedIncrementalManifest.from_doc(doc, where=where)
    return ShardedManifest.from_doc(doc, where=where)


def document_limits(manifest: Manifest) -> dict[str, int]:
    """The documents of ``manifest``'s format whose size a reader bounds, with their limits."""
    return DOCUMENT_LIMITS.get(manifest.format_version, {})


def check_committable(manifest: Manifest, data: bytes, *, where: str) -> None:
    """Refuse (with `UnsupportedValueError`, before anything is committed) a manifest a
    reader would refuse: ``data`` (its encoding) is decoded with the reader's own decoder, and
    every document with a reader limit is checked against it.  The commit object calls this for
    every writer; a save calls it earlier too, with placeholder digests, before writing."""
    check_document_size(data, MAX_MANIFEST_BYTES, "MANIFEST.json")
    try:
        decoded = decode_manifest(data, where=where)
    except CorruptCheckpointError as exc:
        raise UnsupportedValueError(
            f"{where}: this checkpoint would not be readable, so it is not committed: {exc}"
        ) from exc
    if decoded.format_version != manifest.format_version:  # pragma: no cover - codec bug
        raise UnsupportedValueError(f"{where}: manifest did not round-trip its format version")
    for path, limit in document_limits(manifest).items():
        entry = next((e for e in manifest.files if e.path == path), None)
        if entry is not None and entry.size > limit:
            raise UnsupportedValueError(
                f"{where}: {path} would be {entry.size} B, more than the {limit}-byte limit "
                "a reader enforces; the checkpoint is not committed")
