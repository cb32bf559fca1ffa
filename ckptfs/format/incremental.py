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

The manifest is the one model (`ckptfs.format.manifest.Manifest`) with the ``"chunked"`` and
``"references"`` features (v4: ``"sharded"`` too); `Reference` is an entry type
(`ckptfs.format.entries`).  This module holds what the reuse of stored bytes adds: the lease
and grace defaults, reference names, and the questions every reader, listing check and delete
asks (`has_references`, `references_of`, `referenced_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterable

from ckptfs.format.entries import Reference, ReferencedFile
from ckptfs.format.features import (
    INCREMENTAL_FORMAT_VERSION,
    REFERENCES,
    SHARDED_INCREMENTAL_FORMAT_VERSION,
)
from ckptfs.format.manifest import FILE_KEYS, INCREMENTAL_LAYOUT, MANIFEST_KEYS, Manifest

#: Keys every v3 manifest and file entry must have (docs/protocol.md §9.2;
#: `ckptfs.format.manifest.manifest_keys` is the rule for every feature set).
V3_MANIFEST_KEYS = MANIFEST_KEYS | {"layout", "references"}
V3_FILE_KEYS = FILE_KEYS | {"chunks"}
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


def has_references(manifest: Manifest) -> bool:
    """Whether ``manifest``'s format carries references (``"references"`` among its features:
    v3, v4): the one test every reader, listing check and delete uses."""
    return REFERENCES in manifest.features


def references_of(manifest: Manifest) -> tuple[Reference, ...]:
    """The references of ``manifest`` (none for a format without them)."""
    return manifest.references


def referenced_chunks(manifests: Iterable[Manifest]) -> dict[str, set[tuple[int, int]]]:
    """Every file (path relative to the run root) the given manifests reference, with the
    ``(offset, length)`` of each chunk they use: what no delete may take."""
    out: dict[str, set[tuple[int, int]]] = {}
    for m in manifests:
        for ref in m.references:
            out.setdefault(ref.location, set()).update((c.offset, c.length) for c in ref.chunks)
    return out


__all__ = ["DEFAULT_GRACE_S", "DEFAULT_LEASE_S", "INCREMENTAL_FORMAT_VERSION",
           "INCREMENTAL_LAYOUT", "REFERENCE_TEMPLATE", "SHARDED_INCREMENTAL_FORMAT_VERSION",
           "V3_FILE_KEYS", "V3_MANIFEST_KEYS", "Reference", "ReferencedFile", "has_references",
           "reference_name", "referenced_chunks", "references_of"]
