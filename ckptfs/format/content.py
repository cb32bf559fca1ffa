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

from ckptfs.format.incremental import IncrementalManifest, ShardedIncrementalManifest
from ckptfs.format.layout import STATE_NAME
from ckptfs.format.manifest import Manifest
from ckptfs.format.sharded import ChunkedFileEntry


def same_content(a: Manifest, b: Manifest) -> bool:
    """Same step, files (paths, sizes, digests, chunks) and metadata: the same checkpoint,
    whatever attempt name or time either copy has."""
    def files(m: Manifest) -> list[tuple[Any, ...]]:
        return sorted((e.path, e.size, e.digest,
                       e.chunks if isinstance(e, ChunkedFileEntry) else ()) for e in m.files)

    if isinstance(a, IncrementalManifest) or isinstance(b, IncrementalManifest):
        return (a.step == b.step and a.format_version == b.format_version
                and a.metadata == b.metadata and v3_content(a) == v3_content(b))
    same = (a.step == b.step and a.format_version == b.format_version
            and files(a) == files(b) and a.metadata == b.metadata)
    if isinstance(a, ShardedIncrementalManifest) or isinstance(b, ShardedIncrementalManifest):
        # v4: the rank files, and each reference's file and chunks; not the attempt a
        # reference names.
        if not (isinstance(a, ShardedIncrementalManifest)
                and isinstance(b, ShardedIncrementalManifest)):
            return False
        return same and [(r.path, r.step, r.source, r.size, r.chunks) for r in a.references] \
            == [(r.path, r.step, r.source, r.size, r.chunks) for r in b.references]
    return same


def v3_content(m: Manifest) -> tuple[Any, ...]:
    """What a v3 checkpoint holds, wherever its bytes live: its state document's digest and,
    for each file name the state uses (own file or reference), the digests of the tensor
    chunks it reads there.  A copy that materializes or re-references a file keeps these."""
    state = m.file(STATE_NAME) if any(e.path == STATE_NAME for e in m.files) else None
    tensors: dict[str, tuple[str, ...]] = {}
    for e in m.files:
        if isinstance(e, ChunkedFileEntry) and e.path != STATE_NAME:
            tensors[e.path] = tuple(sorted(c.digest for c in e.chunks[1:]))
    if isinstance(m, IncrementalManifest):
        for r in m.references:
            tensors[r.path] = tuple(sorted(c.digest for c in r.chunks[1:]))
    return (None if state is None else state.digest), sorted(tensors.items())
