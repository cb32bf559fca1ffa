"""Incremental saves (format v3, docs/protocol.md §9): bytes that did not change are referenced,
never written again.

A save plans the state as a single-process save does (`ckptfs.protocol.commit.plan_single_process`),
then looks each tensor up in a *reuse index*: the tensors a committed v3 checkpoint of the run
holds (its own files and what it references, flattened), by ``(algorithm, digest, length,
dtype, shape)``.  Reuse is decided by digest only, with the store's (cryptographic) algorithm.
What to hash first is guided by a hint: a tensor is a candidate when the index holds one under
the same key path with the same dtype and shape, unless the caller's tensor was written to in
place since the previous save in this process (the same ``data_ptr`` with a new autograd
``_version``).  A candidate whose digest matches is referenced; every other tensor goes into new
files, hashed while written (no second hash), exactly as a full save.  So a run where everything
changes in place (full fine-tuning) hashes each tensor once after its first save in a process;
a tensor handed over as a new object at each save (a copy, ``.cpu()`` of a GPU tensor) is
hashed first, and again while written if it changed.

The checkpoint a save takes references from is its *protector*.  Before the marker, the commit
object calls this module's fence: the protector must still be committed (same attempt) and the
save must be within its lease; after the marker, a save that outlived its lease lists every file
of its checkpoint again, its own and those it references (``Attempt.commit(lease_expired=)``),
and uncommits itself if one is gone.  Why that is enough against a
concurrent delete or garbage collection: docs/protocol.md §9.5.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckptfs.errors import CkptfsError, CorruptCheckpointError
from ckptfs.format.hashing import ALGORITHMS, new_hasher
from ckptfs.format.incremental import (
    Reference,
    reference_name,
)
from ckptfs.format.layout import CHECKPOINTS_DIR, STATE_NAME, step_dir_name
from ckptfs.format.serialize import (
    StatePlan,
    TensorSlot,
    cpu_contiguous,
    dtype_code,
    relayout,
    tensor_memoryview,
)
from ckptfs.format.sharded import Chunk, ChunkedFileEntry
from ckptfs.format.versions import CHUNKED, REFERENCES, SHARDED, features
from ckptfs.protocol.chunks import StoredChunks, read_chunk
from ckptfs.protocol.commit import (
    FileGate,
    ProtectorGoneError,
    save_plan,
    write_again_if_gone,
)
from ckptfs.protocol.options import SaveOptions
from ckptfs.protocol.reader import local_header, reference_chunks
from ckptfs.protocol.resolve import CheckpointInfo, resolve_latest
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")

#: (algorithm, hex digest, length, dtype code, shape): what makes two tensors the same bytes.
Key = tuple[str, str, int, str, tuple[int, ...]]


@dataclass(frozen=True)
class Stored:
    """A tensor a committed checkpoint holds: the file (of attempt ``attempt`` of ``step``)
    that physically holds it, that file's header chunk, and the tensor's chunk and name."""

    step: int
    attempt: str
    source: str
    size: int
    algorithm: str
    header: Chunk
    chunk: Chunk
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def key(self) -> Key:
        return (self.algorithm, self.chunk.digest, self.chunk.length, self.dtype, self.shape)

    @property
    def location(self) -> tuple[int, str, str]:
        return self.step, self.attempt, self.source

    @property
    def path(self) -> str:
        """The file's path from the run root."""
        return f"{CHECKPOINTS_DIR}/{step_dir_name(self.step)}/{self.attempt}/{self.source}"

    @property
    def chunk_id(self) -> tuple[str, int, int]:
        return self.path, self.chunk.offset, self.chunk.length


@dataclass
class ReuseIndex:
    """The tensors of one committed checkpoint (the protector), by content and by key path."""

    protector: tuple[int, str]
    by_key: dict[Key, Stored] = field(default_factory=dict)
    by_name: dict[str, Stored] = field(default_factory=dict)

    def add(self, name: str, stored: Stored) -> None:
        self.by_key.setdefault(stored.key, stored)
        self.by_name[name] = stored


@dataclass
class ReuseMemory:
    """What a store remembers between its incremental saves in this process: the index of its
    last committed save (so the next one reads nothing to build it) and each tensor's
    ``(data_ptr, _version)`` at that save (the hint of what did not change)."""

    index: ReuseIndex | None = None
    versions: dict[str, tuple[int, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    warned: bool = False
    #: Sharded saves (format v4): this rank's items at its last committed save (by item name,
    #: ``fqn@offsets``) and their tensors' ``(data_ptr, _version)`` then.
    rank_index: ReuseIndex | None = None
    rank_versions: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: With no ``rank_index``: whether the next sharded save indexes the run's newest committed
    #: checkpoint (`latest_index`: the first save of a new job) or writes every byte (the
    #: retry after its protector went away).
    rank_resume: bool = True
    #: Stored chunks this process knows hold their digest's bytes (it wrote them, or read and
    #: checked them once): ``(file path from the run root, offset, length)``.  A chunk it has
    #: not seen is read and checked before its first reuse, so rot in an old file is never
    #: carried into a new checkpoint while the saver holds the right bytes in memory.
    checked: set[tuple[str, int, int]] = field(default_factory=set)


def index_of(storage: Storage, info: CheckpointInfo) -> ReuseIndex | None:
    """The reuse index of a committed checkpoint (a single-process chunked one, format v3;
    others hold no chunk digests of a state's tensors to reuse): every safetensors file's
    header chunk read and checked, each tensor's chunk found."""
    m = info.manifest
    if CHUNKED not in features(m) or SHARDED in features(m):
        return None
    index = ReuseIndex((info.step, info.attempt))
    for entry in m.files:
        if entry.path == STATE_NAME or not isinstance(entry, ChunkedFileEntry):
            continue
        start, entries = local_header(storage, info, entry)
        for name, e in entries.items():
            chunk = entry.chunk_at(start + e.begin, e.end - e.begin)
            if chunk is not None:
                index.add(_key_path(name), Stored(info.step, info.attempt, entry.path, entry.size,
                                                  entry.algorithm, entry.chunks[0], chunk, name,
                                                  e.dtype, e.shape))
    for ref in m.references:
        for name, (e, chunk) in reference_chunks(storage, info, ref, None).items():
            index.add(_key_path(name), Stored(ref.step, ref.attempt, ref.source, ref.size,
                                              ref.algorithm, ref.chunks[0], chunk, name,
                                              e.dtype, e.shape))
    return index


def _key_path(name: str) -> str:
    """The key path a tensor name in a file stands for (``#2`` suffixes of a clash removed)."""
    head, sep, tail = name.rpartition("#")
    return head if sep and tail.isdigit() else name


def tensor_digest(t: Any, algorithm: str) -> str:
    h = new_hasher(algorithm)
    h.update(tensor_memoryview(cpu_contiguous(t)))
    return h.hexdigest()


#: How a format builds the reuse index of a committed checkpoint (`index_of` for format v3;
#: the sharded save's for format v4); ``None`` for a checkpoint it cannot reuse from.
Indexer = Callable[[Storage, CheckpointInfo], "ReuseIndex | None"]


def latest_index(storage: Storage, indexer: Indexer = index_of) -> ReuseIndex | None:
    """The reuse index of the run's newest committed checkpoint (``indexer``): what the first
    incremental save in a process (a new job resuming a run, single-process or sharded) reuses
    from, after one check of each stored chunk before its first reuse
    (`stored_chunk_intact`).  A newest checkpoint that cannot be indexed: nothing is reused,
    everything is written (logged)."""
    try:
        info = resolve_latest(storage)
        return None if info is None else indexer(storage, info)
    except CkptfsError as exc:  # a corrupt newest checkpoint: reuse nothing, write everything
        log.warning("%s: incremental save reuses nothing: the newest checkpoint cannot be "
                    "indexed (%s)", storage.url, exc)
        return None


def _chunk_intact(storage: Storage, st: Stored, chunk: Chunk, memory: ReuseMemory) -> bool:
    """Whether ``chunk`` of the file holding ``st`` holds its digest's bytes: known in this
    process (``memory.checked``), or read and checked now by the chunk reader, whose error
    (missing, short, differs) means no."""
    chunk_id = (st.path, chunk.offset, chunk.length)
    if chunk_id in memory.checked:
        return True
    try:
        read_chunk(storage, StoredChunks(st.path, st.size, st.algorithm, (chunk,), st.step),
                   chunk)
    except CkptfsError:
        return False
    with memory.lock:
        memory.checked.add(chunk_id)
    return True


def stored_chunk_intact(storage: Storage, st: Stored, memory: ReuseMemory, *,
                        header: bool = False) -> bool:
    """Whether the stored chunk holds the bytes its digest names: known in this process, or
    read and checked now (once).  ``header``: its file's header chunk too (a sharded save's
    index is built from ``dcp.msgpack`` without reading the rank files' headers).  A chunk
    that is missing or differs is never reused (logged: the file it is in is damaged)."""
    if (not header or _chunk_intact(storage, st, st.header, memory)) \
            and _chunk_intact(storage, st, st.chunk, memory):
        return True
    log.warning("%s: bytes %d..%d of %s (or its header) differ from their digest or are "
                "missing: tensor %r is written again instead of referenced (run 'ckptfs "
                "verify' on the checkpoints that use that file)", storage.url, st.chunk.offset,
                st.chunk.offset + st.chunk.length, st.path, st.name)
    return False


#: One tensor an incremental save may reuse: its name (the key path of a v3 save, the item
#: name ``fqn@offsets`` of a sharded one), the tensor, and its reuse hint now (``(data_ptr,
#: _version)``; ``None``: no hint).
Item = tuple[str, Any, "tuple[int, int] | None"]


def decide_reuse(items: Sequence[Item], index: ReuseIndex, memory: ReuseMemory,
                 before: Mapping[str, tuple[int, int]], *, algorithm: str, threads: int,
                 storage: Storage | None, by_content: bool) -> dict[int, Stored]:
    """The one reuse decision of every incremental save (formats v3 and v4, in a process
    that saved before or in a new one): which of ``items`` to reference (position -> the
    stored copy).

    1. A candidate: the index holds the name with the same dtype, shape and length, and the
       tensor was not written to in place since the previous save in this process (``before``:
       the hints then; the same ``data_ptr`` with a new ``_version``: not a candidate).  No
       hint, the same version, or another tensor (a copy, a ``.cpu()`` of a GPU tensor): its
       digest decides.
    2. The candidate's digest with the store's (cryptographic) ``algorithm`` must equal a
       stored chunk's: any tensor of the index with the same content (``by_content``, format
       v3: a file's tensor is read by its slot), or the stored chunk of the same name (format
       v4: an item is placed in a rank file under its own name).
    3. ``storage``: the stored chunk (and, for v4, its file's header chunk) is read and
       checked before this process first reuses it (`stored_chunk_intact`)."""
    candidates: list[int] = []
    for i, (name, t, hint) in enumerate(items):
        st = index.by_name.get(name)
        if st is None or st.dtype != dtype_code(t.dtype) or st.shape != tuple(t.shape) \
                or st.chunk.length != t.numel() * t.element_size() \
                or (not by_content and st.algorithm != algorithm):
            continue
        prev = before.get(name)
        if prev is not None and hint is not None and prev[0] == hint[0] and prev[1] != hint[1]:
            continue  # written to in place since the last save: it goes into a new file
        candidates.append(i)
    if not candidates:
        return {}

    def digest(i: int) -> str:
        return tensor_digest(items[i][1], algorithm)

    n = max(1, min(threads, len(candidates)))
    if n == 1:
        digests = [digest(i) for i in candidates]
    else:
        with ThreadPoolExecutor(n, thread_name_prefix="ckptfs-reuse") as pool:
            digests = list(pool.map(digest, candidates))
    out: dict[int, Stored] = {}
    for i, hexd in zip(candidates, digests, strict=True):
        name, t = items[i][0], items[i][1]
        if by_content:
            found = index.by_key.get((algorithm, hexd, t.numel() * t.element_size(),
                                      dtype_code(t.dtype), tuple(t.shape)))
        else:
            own = index.by_name[name]
            found = own if own.chunk.digest == hexd else None
        if found is not None and (storage is None or stored_chunk_intact(
                storage, found, memory, header=not by_content)):
            out[i] = found
    return out


def find_reuse(plan: StatePlan, index: ReuseIndex, memory: ReuseMemory, algorithm: str,
               threads: int, storage: Storage | None = None) -> dict[int, Stored]:
    """The plan's tensors to reference (index -> stored copy): `decide_reuse` by content, the
    hints those the plan took of the caller's tensors."""
    items = [(plan.names[i], t, plan.versions[i] if plan.versions else None)
             for i, t in enumerate(plan.tensors)]
    return decide_reuse(items, index, memory, memory.versions, algorithm=algorithm,
                        threads=threads, storage=storage, by_content=True)


K = TypeVar("K")


def references(reused: Iterable[tuple[K, Stored]]) -> tuple[list[Reference], dict[K, Reference]]:
    """One reference per stored file the reused tensors live in, for both layouts (a v3 save's
    tensors, the items every rank of a v4 save reported): its header chunk and the chunks
    used, sorted, named in the order of the files (``(step, attempt, path)``); and the
    reference each tensor (by its key ``K``) is read through.  The copies of one file must
    agree on its size and header (ranks of a sharded save report them): else
    `CorruptCheckpointError`."""
    by_file: dict[tuple[int, str, str], list[tuple[K, Stored]]] = {}
    for key, st in reused:
        by_file.setdefault(st.location, []).append((key, st))
    refs: list[Reference] = []
    through: dict[K, Reference] = {}
    for k, ((step, attempt, source), members) in enumerate(sorted(
            by_file.items(), key=lambda kv: kv[0])):
        first = members[0][1]
        if any(st.header != first.header or st.size != first.size for _, st in members):
            raise CorruptCheckpointError(f"{source} of step {step}: the ranks report it with "
                                         "different headers or sizes")
        chunks = {(st.chunk.offset, st.chunk.length): st.chunk for _, st in members}
        chunks.pop((first.header.offset, first.header.length), None)
        ref = Reference(reference_name(k), step, attempt, source, first.size, first.algorithm,
                        (first.header, *(chunks[c] for c in sorted(chunks))))
        refs.append(ref)
        for key, _ in members:
            through[key] = ref
    return refs, through


def references_for(reused: Mapping[int, Stored]) -> tuple[list[Reference], dict[int, TensorSlot]]:
    """`references` of a v3 save's reused tensors, and each tensor's slot there."""
    refs, through = references(sorted(reused.items(), key=lambda kv: kv[0]))
    return refs, {i: TensorSlot(through[i].path, st.name, st.dtype, st.shape)
                  for i, st in reused.items()}


def reuse_index(storage: Storage, memory: ReuseMemory, algorithm: str, *, sharded: bool,
                indexer: Indexer = index_of) -> ReuseIndex | None:
    """The index the reuse stage of an incremental save decides over, for both layouts: none
    under a non-cryptographic digest (warned once per store); else the index this process
    remembers of its last save of the layout (``sharded``: this rank's items), or, at the
    first save of a process (and not in the retry after a protector went away, for a sharded
    save), the run's newest committed checkpoint's (`latest_index` with ``indexer``)."""
    if not ALGORITHMS[algorithm].cryptographic:
        if not memory.warned:
            log.warning("%s: incremental saves reuse stored bytes only under a cryptographic "
                        "digest; with %r every byte is written", storage.url, algorithm)
            memory.warned = True
        return None
    with memory.lock:
        index, resume = (memory.rank_index, memory.rank_resume) if sharded \
            else (memory.index, True)
    if index is None and resume:
        index = latest_index(storage, indexer)
    return index


def save_incremental(storage: Storage, step: int, plan: StatePlan, meta: Mapping[str, Any],
                     opts: SaveOptions) -> CheckpointInfo:
    """Write and commit ``plan`` as the format v3 checkpoint of ``step``, referencing what an
    earlier checkpoint already holds (module docstring; ``opts.reuse``: the store's memory).
    If the checkpoint it references is deleted before it commits, it is written again in full
    (`write_again_if_gone`: one retry, logged)."""
    memory = opts.reuse
    if memory is None:
        raise ValueError("save_incremental: the options hold no reuse memory")

    def save(reuse: bool) -> CheckpointInfo:
        assert memory is not None
        index = reuse_index(storage, memory, opts.algorithm, sharded=False) if reuse else None
        return _save(storage, step, plan, meta, opts, memory, index)

    def forget() -> None:
        with memory.lock:
            memory.index = None

    return write_again_if_gone(f"{storage.url}: step {step}", save, forget)


def write_plan(storage: Storage, step: int, plan: StatePlan, meta: Mapping[str, Any],
               opts: SaveOptions, *, gate: FileGate | None = None) -> CheckpointInfo:
    """Commit a planned single-process save: format v3 when the store is incremental
    (``opts.reuse``), else format v1.  ``store.save`` and the async saver's thread both write
    through this.  ``gate``: around each of ``plan.files``' writes (format v1 only: an async
    save streamed through its staging budget, `ckptfs.protocol.staging.Stream`)."""
    if opts.reuse is None:  # checked when prepared (`ckptfs.protocol.prepare`): not again
        return save_plan(storage, step, plan, meta, opts, gate=gate, checked=True)
    if gate is not None:
        raise ValueError("write_plan: a gate needs the plan's own files (format v1); an "
                         "incremental save lays them out again")
    return save_incremental(storage, step, plan, meta, opts)


@dataclass(frozen=True)
class Decided:
    """An incremental save's reuse, decided before its bytes are copied (`decide_now`):
    ``plan`` laid out over the tensors it writes (the others ``external``, in the files of
    ``references``), ``protector`` the checkpoint it references (None: it references
    nothing), ``reused`` each referenced tensor's stored copy (by the plan's index)."""

    plan: StatePlan
    references: tuple[Reference, ...]
    protector: tuple[int, str] | None
    reused: dict[int, Stored]


def decide_now(storage: Storage, plan: StatePlan, opts: SaveOptions) -> Decided:
    """The reuse stage of an incremental save run now, over the caller's tensors (an async
    save streamed through its staging budget decides before it returns, so that only the
    tensors it writes are staged): the same decision as `save_incremental`'s."""
    memory = opts.reuse
    if memory is None:
        raise ValueError("decide_now: the options hold no reuse memory")
    index = reuse_index(storage, memory, opts.algorithm, sharded=False)
    reused = find_reuse(plan, index, memory, opts.algorithm, opts.workers, storage) \
        if index is not None else {}
    refs, external = references_for(reused)
    laid = relayout(plan, external) if reused or plan.external else plan
    return Decided(laid, tuple(refs), index.protector if refs and index is not None else None,
                   reused)


def write_decided(storage: Storage, step: int, plan: StatePlan, decided: Decided,
                  meta: Mapping[str, Any], opts: SaveOptions, *, gate: FileGate | None = None
                  ) -> CheckpointInfo:
    """Commit ``plan`` (``decided.plan``, or it laid out again over the same tensors: an async
    save's files fitted to its budget) with ``decided``'s references, each of ``plan.files``
    written inside ``gate``.  Not written again in full if the checkpoint it references is
    deleted before the marker (`ProtectorGoneError`, the reuse memory forgotten so that the
    next save indexes the run again): the tensors it references were not copied, and the
    caller may have changed them since."""
    memory = opts.reuse
    assert memory is not None
    try:
        info = save_plan(storage, step, plan, meta, opts,
                         feats=frozenset({CHUNKED, REFERENCES}),
                         references=decided.references,
                         protectors=[decided.protector] if decided.protector else (),
                         gate=gate)
    except ProtectorGoneError as exc:
        with memory.lock:
            memory.index = None
        raise ProtectorGoneError(
            f"{exc}; this save referenced tensors it did not copy (save_async streamed through "
            "its staging budget), so it was not written again in full: save the step again "
            "(the next save references only what is committed then)") from exc
    _remember(memory, plan, info, decided.reused)
    if decided.references:
        log.info("step %d at %s: %d of %d bytes written, the rest referenced from %d files",
                 step, storage.url, info.bytes_written, info.bytes, len(decided.references))
    return info


def _save(storage: Storage, step: int, plan: StatePlan, meta: Mapping[str, Any],
          opts: SaveOptions, memory: ReuseMemory, index: ReuseIndex | None) -> CheckpointInfo:
    reused = find_reuse(plan, index, memory, opts.algorithm, opts.workers, storage) \
        if index is not None else {}
    refs, external = references_for(reused)
    plan = relayout(plan, external) if reused or plan.external else plan
    info = save_plan(storage, step, plan, meta, opts, feats=frozenset({CHUNKED, REFERENCES}),
                     references=refs, protectors=[index.protector] if refs and index else ())
    _remember(memory, plan, info, reused)
    if refs:
        log.info("step %d at %s: %d of %d bytes written, the rest referenced from %d files",
                 step, storage.url, info.bytes_written, info.bytes, len(refs))
    return info


def _remember(memory: ReuseMemory, plan: StatePlan, info: CheckpointInfo,
              reused: Mapping[int, Stored]) -> None:
    """The index of the checkpoint just committed, from what was written (no reads)."""
    index = ReuseIndex((info.step, info.attempt))
    m = info.manifest
    written: list[tuple[str, int, int]] = []  # chunks this save wrote: known good
    for tf in plan.tensor_files:
        entry = m.chunked(tf.path)
        for i, (name, dtype, shape), chunk in zip(tf.members, tf.entries, entry.chunks[1:],
                                                  strict=True):
            st = Stored(info.step, info.attempt, tf.path, entry.size, entry.algorithm,
                        entry.chunks[0], chunk, name, dtype, shape)
            index.add(plan.names[i], st)
            written.append(st.chunk_id)
    for i, st in reused.items():
        index.add(plan.names[i], st)
    with memory.lock:
        memory.checked.update(written)
        memory.index = index
        if plan.versions:
            memory.versions = dict(zip(plan.names, plan.versions, strict=True))


__all__ = [
    "Decided",
    "Indexer",
    "Item",
    "ProtectorGoneError",
    "ReuseIndex",
    "ReuseMemory",
    "decide_now",
    "decide_reuse",
    "find_reuse",
    "index_of",
    "latest_index",
    "references",
    "references_for",
    "reuse_index",
    "save_incremental",
    "write_decided",
    "write_plan",
]
