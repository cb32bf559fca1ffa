"""The format table, pure half: a format version is the name of a set of features.  Which
versions this ckptfs reads, how a manifest of any of them is decoded, and which of its
documents have a reader limit.

Normative mapping (docs/protocol.md; the table itself is `FEATURES`, defined in
`ckptfs.format.features` below the manifest model and re-exported here, with its inverse
`VERSIONS`):

==========================================  =======  ==========================================
features                                    version  documents with a size limit (before read)
==========================================  =======  ==========================================
(none): whole files, ``state.msgpack``      1        ``state.msgpack``: ``MAX_STATE_DOC_BYTES``
``sharded``, ``chunked``                    2        ``dcp.msgpack``: ``MAX_METADATA_BYTES``
``chunked``, ``references``                 3        ``state.msgpack``: ``MAX_STATE_DOC_BYTES``
``sharded``, ``chunked``, ``references``    4        ``dcp.msgpack``: ``MAX_METADATA_BYTES``
``sharded``, ``chunked``, ``rank-metadata`` 5        ``dcp-spec.msgpack``: ``MAX_METADATA_BYTES``
==========================================  =======  ==========================================

- ``sharded``: one data file per rank (``rank-NNNNN/data-K.safetensors``) and
  ``dcp.msgpack``, written collectively; the manifest has ``world_size``, each file its
  ``rank`` (§8).
- ``chunked``: every file tiled by chunks with their own digests, the file's digest that of
  its chunk list; the manifest has ``layout`` (§8.2, §9.2).
- ``references``: chunks of other attempts' files used in place; the manifest has
  ``references`` (§9, §9.6).
- ``rank-metadata``: the sharded metadata split per rank (a tensor spec, a table of rank
  files in blocks, one index document per rank); the manifest has ``rank_table`` and lists
  only the spec and the blocks (§9.7).  Each rank's index document is bounded by
  ``MAX_RANK_INDEX_BYTES``, checked against its table row before it is read.

No other set is a format.  A writer chooses features, never a version: the one manifest model
(`ckptfs.format.manifest.Manifest`) carries its features and derives ``format_version`` from
them (`version_of`), and its one encoder and decoder choose their rules by them.  Code above
the format asks `features` (or `is_sharded`, `has_references`) about a manifest, never its
version number.

Every manifest is read through `decode_manifest` (the reader) and every manifest a writer
is about to commit is checked through `check_committable` (the commit object), so the
writer refuses exactly what the reader would.  The I/O half of the table (how each version is
loaded and verified) is `ckptfs.protocol.formats`.
"""

from __future__ import annotations

from ckptfs.errors import CorruptCheckpointError, FormatVersionError, UnsupportedValueError
from ckptfs.format.features import CHUNKED as CHUNKED
from ckptfs.format.features import FEATURES as FEATURES
from ckptfs.format.features import RANK_METADATA as RANK_METADATA
from ckptfs.format.features import REFERENCES as REFERENCES
from ckptfs.format.features import SHARDED as SHARDED
from ckptfs.format.features import VERSIONS as VERSIONS
from ckptfs.format.features import version_of as version_of
from ckptfs.format.layout import METADATA_NAME, SPEC_NAME, STATE_NAME
from ckptfs.format.limits import MAX_MANIFEST_BYTES, MAX_METADATA_BYTES, MAX_STATE_DOC_BYTES
from ckptfs.format.manifest import (
    MANIFEST_SCHEMA,
    Manifest,
    check_document_size,
    check_model,
    decode_doc,
    load_json,
)

#: Manifest format versions this ckptfs reads (and writes).
READ_VERSIONS = tuple(FEATURES)
#: Highest manifest format version this ckptfs reads.
MAX_READ_VERSION = max(READ_VERSIONS)

#: Per version: the documents a reader bounds by size before reading them (the state document
#: of a format without ``sharded``, DCP's metadata of one with it).
DOCUMENT_LIMITS: dict[int, dict[str, int]] = {
    version: ({SPEC_NAME: MAX_METADATA_BYTES} if RANK_METADATA in feats
              else {METADATA_NAME: MAX_METADATA_BYTES} if SHARDED in feats
              else {STATE_NAME: MAX_STATE_DOC_BYTES})
    for version, feats in FEATURES.items()
}


def features(manifest: Manifest) -> frozenset[str]:
    """The features of ``manifest``'s format (`FEATURES`): ``"sharded" in features(m)`` is
    the test for a collectively written checkpoint, whatever its version."""
    return manifest.features


def is_sharded(manifest: Manifest) -> bool:
    """Whether ``manifest`` is of a collectively written format (``"sharded"`` in its
    `features`: v2, v4): the test code above the format uses before it reads a sharded
    manifest's rank files and ``dcp.msgpack``."""
    return SHARDED in manifest.features


def has_rank_metadata(manifest: Manifest) -> bool:
    """Whether ``manifest``'s sharded metadata is split per rank (``"rank-metadata"`` in its
    `features`: v5): a reader then finds rank files through the table, not the manifest."""
    return RANK_METADATA in manifest.features


def decode_manifest(data: bytes, *, where: str = "manifest") -> Manifest:
    """Decode a manifest of any version this ckptfs reads (`READ_VERSIONS`), by the rules of
    its features.  A newer version raises `FormatVersionError`; anything malformed
    `CorruptCheckpointError` (or `UnsafeCheckpointError`)."""
    doc = load_json(data, MAX_MANIFEST_BYTES, where)  # bounded: size, depth, duplicate keys
    version = doc.get("format_version")
    newest = max(READ_VERSIONS)
    if not isinstance(version, int) or isinstance(version, bool):
        # 2.0 or true equal 2 or 1 in Python: never a version
        raise CorruptCheckpointError(f"{where}: bad format_version {version!r:.40}")
    if version > newest:
        raise FormatVersionError(
            f"{where}: written by format version {version}; this ckptfs reads up to "
            f"{newest}: upgrade ckptfs")
    chunked = [v for v in READ_VERSIONS if v == version and CHUNKED in FEATURES[v]]
    if not chunked:
        return Manifest.from_bytes(data, where=where)  # v1: its own strict header checks
    if doc.get("schema") != MANIFEST_SCHEMA:
        raise CorruptCheckpointError(f"{where}: schema is {doc.get('schema')!r}")
    return decode_doc(doc, FEATURES[chunked[0]], where=where)


def document_limits(manifest: Manifest) -> dict[str, int]:
    """The documents of ``manifest``'s format whose size a reader bounds, with their limits."""
    return DOCUMENT_LIMITS.get(manifest.format_version, {})


def check_committable(manifest: Manifest, data: bytes, *, where: str) -> None:
    """Refuse (with `UnsupportedValueError`, before anything is committed) a manifest a
    reader would refuse: ``data`` (its encoding) is bounded by the reader's size limit; a
    chunked manifest is checked on the model by the reader's decoder's rules (`check_model`,
    no parse back of what was just encoded), a whole-file one (v1) decoded with the reader's
    own decoder; every document with a reader limit is checked against it.  The commit
    object calls this for every writer; a save calls it earlier too, with placeholder
    digests, before writing."""
    check_document_size(data, MAX_MANIFEST_BYTES, "MANIFEST.json")
    # A chunked manifest (the large ones: a chunk list per file) is checked on the model, by
    # the decoder's own rules (`check_model`), not parsed back: the same refusals.
    model = CHUNKED in manifest.features and manifest.format_version in READ_VERSIONS
    try:
        if model:
            check_model(manifest, where=where)
        else:
            decoded = decode_manifest(data, where=where)
    except CorruptCheckpointError as exc:
        raise UnsupportedValueError(
            f"{where}: this checkpoint would not be readable, so it is not committed: {exc}"
        ) from exc
    if not model and decoded.features != manifest.features:  # pragma: no cover - codec bug
        raise UnsupportedValueError(f"{where}: manifest did not round-trip its features")
    for path, limit in document_limits(manifest).items():
        entry = next((e for e in manifest.files if e.path == path), None)
        if entry is not None and entry.size > limit:
            raise UnsupportedValueError(
                f"{where}: {path} would be {entry.size} B, more than the {limit}-byte limit "
                "a reader enforces; the checkpoint is not committed")
