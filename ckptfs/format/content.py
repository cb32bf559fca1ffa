"""Whether two manifests describe the same checkpoint, whatever attempt name or time either copy
has: the one rule behind "the destination already holds this step" (``ckptfs cp``, the
replicator, a two-tier store's open-time scan) and "this other tier's copy of the step may stand
in for a failing one" (the walk across tiers, `ckptfs.protocol.resolve`).

A copy of a checkpoint keeps its step, its format version, its metadata and what it holds (the
files with their sizes, digests and chunks; for an incremental checkpoint, the state document and
the digests of the tensors each file name holds, wherever those bytes live), and changes only its
attempt name (and, for format v4, the attempt each reference names: a replica's references name
the remote's own copy of the step they take bytes from, docs/protocol.md section 10).  Another
run's checkpoint of the same step number differs in at least one of these.
"""

from __future__ import annotations

from typing import Any

from ckptfs.format.entries import ChunkedFileEntry
from ckptfs.format.features import RANK_METADATA, REFERENCES, SHARDED
from ckptfs.format.layout import STATE_NAME
from ckptfs.format.manifest import Manifest


def same_content(a: Manifest, b: Manifest) -> bool:
    """Same step, files (paths, sizes, digests, chunks) and metadata: the same checkpoint,
    whatever attempt name or time either copy has."""
    def files(m: Manifest) -> list[tuple[Any, ...]]:
        # Format v5: the files the manifest lists (the spec and the table's blocks bind every
        # rank file and index document by digest), not those a reader added from the table.
        own = [e for e in m.files if RANK_METADATA not in m.features
               or not isinstance(e, ChunkedFileEntry) or e.rank is None]
        return sorted((e.path, e.size, e.digest,
                       e.chunks if isinstance(e, ChunkedFileEntry) else ()) for e in own)

    if a.step != b.step or a.features != b.features or a.metadata != b.metadata \
            or a.rank_table != b.rank_table:
        return False
    if REFERENCES in a.features and SHARDED not in a.features:
        # v3: what the state reads, wherever it lives (a copy may materialize a reference).
        return v3_content(a) == v3_content(b)
    if files(a) != files(b):
        return False
    # With references (v4): each reference's file and chunks; not the attempt it names.
    return [(r.path, r.step, r.source, r.size, r.chunks) for r in a.references] \
        == [(r.path, r.step, r.source, r.size, r.chunks) for r in b.references]


def v3_content(m: Manifest) -> tuple[Any, ...]:
    """What a v3 checkpoint holds, wherever its bytes live: its state document's digest and,
    for each file name the state uses (own file or reference), the digests of the tensor
    chunks it reads there.  A copy that materializes or re-references a file keeps these."""
    state = m.file(STATE_NAME) if any(e.path == STATE_NAME for e in m.files) else None
    tensors: dict[str, tuple[str, ...]] = {}
    for e in m.files:
        if isinstance(e, ChunkedFileEntry) and e.path != STATE_NAME:
            tensors[e.path] = tuple(sorted(c.digest for c in e.chunks[1:]))
    for r in m.references:
        tensors[r.path] = tuple(sorted(c.digest for c in r.chunks[1:]))
    return (None if state is None else state.digest), sorted(tensors.items())
