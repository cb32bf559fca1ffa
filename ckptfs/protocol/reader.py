"""Reading committed format v1 checkpoints: load with streaming verification, and verify.
The format table (`ckptfs.protocol.formats`) dispatches here for version 1.

Every byte is hashed as it is read, in the same pass that fills the buffer the tensors will view
(no second read); sizes come from the manifest, are bounded, and are checked before anything is
allocated; a mismatch raises `CorruptCheckpointError` naming the file before any state is
returned.  Nothing is unpickled: the tree is msgpack, the tensors safetensors.
"""

from __future__ import annotations

import logging
import mmap as _mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from ckptfs.errors import (
    CorruptCheckpointError,
    ExtensionTypeError,
    LoadOptionError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptfs.format.extensions import unregistered_as_dict
from ckptfs.format.hashing import (
    HASH_INLINE_BYTES,
    BackgroundHasher,
    Hasher,
    PieceHasher,
    format_digest,
    new_hasher,
    read_chunk_size,
)
from ckptfs.format.incremental import Reference
from ckptfs.format.layout import STATE_NAME
from ckptfs.format.limits import MAX_HEADER_BYTES, MAX_STATE_DOC_BYTES
from ckptfs.format.manifest import FileEntry
from ckptfs.format.serialize import (
    CODE_DTYPES,
    HeaderEntry,
    TensorSlot,
    build_tree,
    decode_state_doc,
    dtype_code,
    parse_safetensors_header,
    tensor_memoryview,
    tensors_from_buffer,
)
from ckptfs.format.sharded import Chunk, ChunkedFileEntry, chunk_list_digest
from ckptfs.format.versions import SHARDED, features
from ckptfs.protocol import spans as span_reads
from ckptfs.protocol.chunks import (
    StoredChunks,
    check_chunk,
    check_streamed,
    open_no_follow,
    read_chunk,
    read_run,
)
from ckptfs.protocol.listing import check_listing, check_references, problems
from ckptfs.protocol.load_options import (
    KeyPath,
    TensorMap,
    prune_tagged,
    selection,
    tensor_refs,
)
from ckptfs.protocol.resolve import CheckpointInfo, storage_url
from ckptfs.protocol.spans import SpanReads, cut, windows_of
from ckptfs.storage.base import LocalFiles, Storage, read_range, supports

log = logging.getLogger("ckptfs")

__all__ = ["VerifyReport", "check_mmap_storage", "check_single_process", "load_single_process",
           "map_file_verified", "read_file_verified", "read_header", "read_tensors_verified",
           "verify_single_process"]
T = TypeVar("T")


@dataclass
class VerifyReport:
    step: int
    attempt: str
    url: str
    mode: str  # "full" or "quick"
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    #: The problems that make the checkpoint unsafe to read (a symbolic link), as opposed to
    #: corrupt: verify raises `UnsafeCheckpointError` for them, as load does.
    unsafe: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "attempt": self.attempt, "url": self.url, "mode": self.mode,
                "files": self.files, "bytes": self.bytes, "ok": self.ok,
                "problems": list(self.problems), "unsafe": list(self.unsafe)}


class _NullHasher:
    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


_NULL_HASHER: Hasher = _NullHasher()


class ChunkListHasher:
    """Hashes a chunked file (formats v2, v3) as it streams, each chunk on its own; its
    `hexdigest` is the digest of the chunk list (§8.1), what the manifest records."""

    def __init__(self, entry: ChunkedFileEntry) -> None:
        self.entry = entry
        self.pieces = PieceHasher(entry.algorithm, [c.length for c in entry.chunks])

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self.pieces.update(data)

    def hexdigest(self) -> str:
        got = [Chunk(c.offset, c.length, d)
               for c, d in zip(self.entry.chunks, self.pieces.digests(), strict=False)]
        return chunk_list_digest(self.entry.algorithm, got).split(":", 1)[1]


def file_hasher(entry: FileEntry) -> Hasher:
    """What a file's manifest digest is taken over: its bytes (v1), or its chunk list."""
    if isinstance(entry, ChunkedFileEntry):
        return ChunkListHasher(entry)
    return new_hasher(entry.algorithm)


def read_file_verified(storage: Storage, info: CheckpointInfo, entry: FileEntry, *,
                       verify: bool = True) -> memoryview:
    """Read one manifest file into a buffer of exactly its declared size, hashing as it is read.

    The buffer is allocated uninitialized (``bytearray(n)`` would zero-fill it first: one more
    pass over the whole state, about 20% of a load) and is only returned once every byte of it
    has been read and checked.  The returned view keeps its memory alive.

    Raises `CorruptCheckpointError` (naming the file) if the file is shorter or longer
    than declared or, with ``verify``, its digest differs.  The caller checked the listing
    first (`check_listing`: links, sizes)."""
    path = f"{info.path}/{entry.path}"
    where = storage_url(storage, path)
    view = tensor_memoryview(torch.empty(entry.size, dtype=torch.uint8))
    hasher = file_hasher(entry) if verify else None
    pos = 0
    try:
        # The chunk just read is hashed on a helper thread while the next one is read.
        with BackgroundHasher(hasher or _NULL_HASHER, max_lead=max(entry.size, 1),
                              background=verify and entry.size > HASH_INLINE_BYTES) as bg, \
                storage.open_read(path) as raw:
            f = cast(Any, raw)  # BinaryIO stubs lack readinto
            step = read_chunk_size(entry.size)
            while pos < entry.size:
                n = f.readinto(view[pos:pos + step])
                if not n:
                    break
                if hasher is not None:
                    bg.feed(view[pos:pos + n])
                pos += n
            extra = f.read(1) if pos == entry.size else b""
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: listed in the manifest but missing",
                                     step=info.step, path=path) from None
    if pos != entry.size or extra:
        raise CorruptCheckpointError(
            f"{where}: size differs from the manifest (declared {entry.size} B, found "
            f"{'more' if extra else pos})", step=info.step, path=path)
    if hasher is not None:
        check_file_digest(info, entry, hasher.hexdigest(), where=where)
    return view


#: Pieces of tensor data smaller than this go to the hasher's thread together, up to this many
#: bytes at a time (a model has many small tensors: biases, norms; one hand-over each would cost
#: more than their hashing).
HASH_BATCH_BYTES = 1024 * 1024


class _Views:
    """Consecutive small pieces of a file, handed to the hasher's thread as one item."""

    __slots__ = ("nbytes", "views")

    def __init__(self) -> None:
        self.views: list[memoryview] = []
        self.nbytes = 0

    def __len__(self) -> int:
        return self.nbytes


class _InOrder:
    """A hasher that also takes `_Views` (their pieces, in order)."""

    def __init__(self, inner: Hasher) -> None:
        self.inner = inner

    def update(self, data: bytes | bytearray | memoryview | _Views, /) -> None:
        if isinstance(data, _Views):
            for view in data.views:
                self.inner.update(view)
        else:
            self.inner.update(data)

    def hexdigest(self) -> str:
        return self.inner.hexdigest()


def read_tensors_verified(storage: Storage, info: CheckpointInfo, entry: FileEntry, *,
                          verify: bool = True, window: int = 1,
                          into: dict[str, torch.Tensor] | None = None
                          ) -> dict[str, torch.Tensor]:
    """Read one safetensors file of the checkpoint straight into its tensors, hashing every byte
    as it is read (the one pass over the file), and return them once the whole file is read and
    its digest checked.

    Each tensor gets memory of its own (``torch.empty`` of its dtype and shape, filled by
    ``readinto`` in file order), as ``torch.load`` allocates a storage per tensor: the allocator
    serves them from memory an earlier load freed, where one buffer of the file's size (a tensor
    file is up to 512 MiB) is mapped afresh by every load and each of its pages faulted in.
    Measured here, a verified 64 MiB load in a warm process: 35 ms into one buffer, 12 ms into
    the tensors.  The header is read, bounded and parsed first (`parse_safetensors_header`);
    a header that does not parse is reported after the digest check, so a file changed after
    commit is reported as such, as `read_file_verified` reports it.  Raises as it does.

    ``window``: on local disk, tensor data of more than two spans is read in spans, this many
    at once, hashed in file order as they arrive (`ckptfs.protocol.spans`); 1: in one stream.
    ``into``: tensors to read into, by name, allocated by the caller (each used where the
    header gives its name the same dtype and shape; the others are allocated here).  A load
    allocates them on its own thread (`preallocate`): memory a thread of a pool allocates
    comes from another malloc arena, which gives freed memory back to the system, so every
    load would fault its pages in again (measured: a verified 64 MiB load 29 ms, 42 MiB of
    new pages; allocated by the caller, 23 ms and 20 MiB, as ``torch.load``)."""
    path = f"{info.path}/{entry.path}"
    where = storage_url(storage, path)
    hasher = file_hasher(entry) if verify else None
    size = entry.size
    got: dict[str, torch.Tensor] = {}
    entries: dict[str, HeaderEntry] | None = None
    bad: CorruptCheckpointError | UnsafeCheckpointError | None = None
    pos = 0
    try:
        with BackgroundHasher(_InOrder(hasher) if hasher is not None else _NULL_HASHER,
                              max_lead=max(size, 1),
                              background=verify and size > HASH_INLINE_BYTES) as bg, \
                storage.open_read(path) as raw:
            f = cast(Any, raw)  # BinaryIO stubs lack readinto
            step = read_chunk_size(size)
            batch = _Views()

            def flush() -> None:
                nonlocal batch
                if batch.nbytes:
                    bg.feed(cast(Any, batch))
                    batch = _Views()

            def read(piece: memoryview) -> None:
                """``piece`` was read: hashed (in order) and counted."""
                nonlocal pos
                n = len(piece)
                if hasher is not None:
                    if n < HASH_BATCH_BYTES:
                        batch.views.append(piece)
                        batch.nbytes += n
                        if batch.nbytes >= HASH_BATCH_BYTES:
                            flush()
                    else:
                        flush()
                        bg.feed(piece)
                pos += n

            def fill(view: memoryview) -> bool:
                """Read ``view`` full (hashed); False if the file ended first."""
                done = 0
                while done < len(view):
                    n = f.readinto(view[done:done + step])
                    if not n:
                        return False
                    read(view[done:done + n])
                    done += n
                return True

            head = memoryview(bytearray(min(size, 8)))
            if fill(head) and size >= 8:
                hlen = int.from_bytes(head, "little")
                text = memoryview(bytearray(min(hlen, MAX_HEADER_BYTES, size - 8)))
                if fill(text):
                    try:
                        _, entries = parse_safetensors_header(
                            cast(Any, _HeaderOnly(bytes(head) + bytes(text), size)),
                            where=where)
                    except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
                        bad = exc
            else:
                bad = CorruptCheckpointError(f"{where}: {size} bytes is too short for "
                                             "safetensors", step=info.step, path=path)
            spans = None
            if entries is not None:
                for name, e in sorted(entries.items(), key=lambda item: item[1].begin):
                    t = None if into is None else into.get(name)
                    if t is None or t.dtype != CODE_DTYPES[e.dtype] or \
                            tuple(t.shape) != tuple(e.shape):
                        t = torch.empty(e.shape, dtype=CODE_DTYPES[e.dtype])
                    got[name] = t
                views = [tensor_memoryview(t) for t in got.values() if t.numel()]
                span = span_reads.SPAN_BYTES
                if window > 1 and size - pos > 2 * span and supports(storage, LocalFiles):
                    spans = cut(views, pos, span)
                else:
                    all(fill(v) for v in views)  # stops where the file ends
            elif pos < size:  # not a tensor file we can read: its digest is still checked
                fill(tensor_memoryview(torch.empty(size - pos, dtype=torch.uint8)))
            if spans is not None:
                extra = _read_spans(storage, info, path, spans, window, read, size)
            else:
                extra = f.read(1) if pos == size else b""
            flush()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: listed in the manifest but missing",
                                     step=info.step, path=path) from None
    if pos != size or extra:
        raise CorruptCheckpointError(
            f"{where}: size differs from the manifest (declared {size} B, found "
            f"{'more' if extra else pos})", step=info.step, path=path)
    if hasher is not None:
        check_file_digest(info, entry, hasher.hexdigest(), where=where)
    if bad is not None or entries is None:
        raise bad or CorruptCheckpointError(f"{where}: not a safetensors file",
                                            step=info.step, path=path)
    return {name: got[name] for name in entries}


def _read_spans(storage: Storage, info: CheckpointInfo, path: str,
                spans: list[tuple[int, list[memoryview]]], window: int,
                read: Callable[[memoryview], None], size: int) -> bytes:
    """The tensor data of a local file in ``spans`` (`ckptfs.protocol.spans.cut`), read by
    the pool ``window`` at a time and each handed to ``read`` (hashed, counted) in file order;
    a byte past ``size`` if the file holds more (b"": the sizes agree, or it ended early)."""
    local = cast(LocalFiles, storage).local_path(path)
    with SpanReads(local, spans, window, where=storage_url(storage, path), step=info.step,
                   path=path) as reads:
        for k in range(len(spans)):
            if not reads.wait(k):
                return b""
            for view in spans[k][1]:
                read(view)
        return b"x" if reads.extra_byte(size) else b""


def preallocate(slots: list[TensorSlot], by_path: dict[str, FileEntry]
                ) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of ``slots`` (the state document's), allocated on this thread, by file and
    name, for `read_tensors_verified` ``into=``; a file whose slots' bytes exceed its size in
    the manifest gets none (its header decides, and is checked, before anything is
    allocated for it)."""
    by_file: dict[str, dict[str, TensorSlot]] = {}
    for s in slots:
        by_file.setdefault(s.file, {})[s.name] = s
    out: dict[str, dict[str, torch.Tensor]] = {}
    for file, mine in by_file.items():
        entry = by_path.get(file)
        if entry is None:
            continue
        need = 0
        for s in mine.values():
            n = CODE_DTYPES[s.dtype].itemsize
            for d in s.shape:
                n *= d
            need += n
        if need > entry.size:
            continue
        try:
            out[file] = {name: torch.empty(s.shape, dtype=CODE_DTYPES[s.dtype])
                         for name, s in mine.items()}
        except (RuntimeError, OverflowError, TypeError, ValueError):  # a dimension torch
            continue  # cannot hold (with another of size 0): the header decides, checked first
    return out


def _parallel(fn: Callable[[Any], T], items: list[Any], threads: int) -> list[T]:
    if threads <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="ckptfs-io") as pool:
        return list(pool.map(fn, items))


def map_file_verified(storage: Storage, info: CheckpointInfo, entry: FileEntry, *,
                      verify: bool = True) -> memoryview:
    """Memory-map one manifest file of a local-disk checkpoint (copy-on-write: writing to a
    tensor never changes the file) and, with ``verify``, hash every byte of the mapping and
    compare with the manifest before returning.  The mapping lives as long as a view of it.
    ``O_NOFOLLOW``: a file replaced by a link after the listing is refused too."""
    path = f"{info.path}/{entry.path}"
    where = storage_url(storage, path)
    if not supports(storage, LocalFiles):
        raise LoadOptionError(f"{where}: this storage has no local files to map")
    local = cast(LocalFiles, storage).local_path(path)
    fd = open_no_follow(local, where, step=info.step, path=path,
                        missing=lambda: CorruptCheckpointError(
                            f"{where}: listed in the manifest but missing", step=info.step,
                            path=path))
    try:
        size = os.fstat(fd).st_size
        if size != entry.size:
            raise CorruptCheckpointError(
                f"{where}: size differs from the manifest (declared {entry.size} B, found "
                f"{size} B)", step=info.step, path=path)
        if size == 0:
            return memoryview(b"")
        try:
            mapping = _mmap.mmap(fd, size, access=_mmap.ACCESS_COPY)
        except OSError as exc:
            raise StorageError(f"{where}: cannot memory-map: {exc}") from exc
    finally:
        os.close(fd)
    view = memoryview(mapping)
    if verify:
        hasher = file_hasher(entry)
        step = read_chunk_size(size)
        for pos in range(0, size, step):
            hasher.update(view[pos:pos + step])
        check_file_digest(info, entry, hasher.hexdigest(), where=where)
    return view


def check_file_digest(info: CheckpointInfo, entry: FileEntry, hexdigest: str, *,
                      where: str) -> None:
    """`CorruptCheckpointError` unless ``hexdigest`` (of the whole file ``entry``, read
    whole) is the digest the manifest records for it."""
    actual = format_digest(entry.algorithm, hexdigest)
    if actual != entry.digest:
        raise CorruptCheckpointError(
            f"{where}: content digest differs from the manifest (expected {entry.digest}, "
            f"got {actual}): the file was modified or corrupted after commit",
            step=info.step, path=f"{info.path}/{entry.path}")


def check_mmap_storage(storage: Storage, info: CheckpointInfo) -> None:
    """``mmap=True`` needs local files (`LocalFiles`) and a single-process format (v1, v3:
    not ``"sharded"``); else `LoadOptionError`, before any I/O."""
    if not supports(storage, LocalFiles):
        raise LoadOptionError(
            f"{info.url}: mmap=True maps files of a local-disk checkpoint; this store is "
            f"{storage.capabilities.protocol}://. Load without mmap (or copy the checkpoint to "
            "local disk first: ckptfs cp)")
    if SHARDED in features(info.manifest):
        raise LoadOptionError(
            f"{info.url}: mmap=True is supported for format v1 checkpoints; this one is "
            f"format v{info.manifest.format_version} (docs/sharded.md): load it without mmap")


def _state_entry(storage: Storage, info: CheckpointInfo, by_path: dict[str, FileEntry]
                 ) -> tuple[FileEntry, str]:
    """``state.msgpack``'s manifest entry (and its URL), its declared size within the reader's
    limit: a load and the no-data check refuse a missing or oversized document alike."""
    where = storage_url(storage, f"{info.path}/{STATE_NAME}")
    entry = by_path.get(STATE_NAME)
    if entry is None:
        raise CorruptCheckpointError(f"{info.url}: manifest lists no {STATE_NAME}",
                                     step=info.step)
    if entry.size > MAX_STATE_DOC_BYTES:
        raise UnsafeCheckpointError(f"{where}: declared size {entry.size} exceeds "
                                    f"{MAX_STATE_DOC_BYTES} B", step=info.step)
    return entry, where


def load_single_process(storage: Storage, info: CheckpointInfo, *, verify: bool = True,
            mapper: TensorMap | None = None, threads: int = 4,
            keys: list[KeyPath] | None = None, mmap: bool = False) -> dict[Any, Any]:
    """Load a committed format v1 checkpoint (docs/loading.md); the options are checked by
    `ckptfs.protocol.formats.load_checkpoint`.

    ``keys``: read and verify only ``state.msgpack`` and the tensor files holding the selected
    tensors.  ``mmap``: tensors view copy-on-write mappings of the files."""
    paths = keys
    manifest = info.manifest
    by_path = {e.path: e for e in manifest.files}
    state_entry, where = _state_entry(storage, info, by_path)
    listing = check_listing(storage, info, [state_entry])
    doc = read_file_verified(storage, info, state_entry, verify=verify)
    tree, slots = decode_state_doc(bytes(doc), where=where)
    del doc

    if paths is None:
        wanted = list(range(len(slots)))
    else:
        tree = prune_tagged(tree, selection(paths),
                            lambda k: build_tree(k, [], where=where), info.url)
        wanted = sorted(i for i in tensor_refs(tree, set()) if 0 <= i < len(slots))
    refs = references_of(info)
    needed = sorted({slots[i].file for i in wanted})
    missing = [n for n in needed if n not in by_path and n not in refs]
    if missing:
        raise CorruptCheckpointError(f"{info.url}: state references files not in the manifest: "
                                     f"{missing}", step=info.step)
    local = [n for n in needed if n in by_path]
    # The files this load reads: present with their declared sizes (from the same listing),
    # those it references in other attempts too.
    for p in problems(info, listing, [by_path[n] for n in local]):
        if p.kind != "stray":
            raise p.error(storage, info)
    used_refs = [refs[n] for n in needed if n in refs]
    check_references(storage, info, used_refs)

    windows = dict(zip(local, windows_of([by_path[n].size for n in local], threads),
                       strict=True))
    into = {} if mmap else preallocate([slots[i] for i in wanted], by_path)

    def load_file(entry: FileEntry) -> dict[str, torch.Tensor]:
        if not mmap:
            return read_tensors_verified(storage, info, entry, verify=verify,
                                         window=windows[entry.path], into=into.get(entry.path))
        buf = map_file_verified(storage, info, entry, verify=verify)
        return tensors_from_buffer(buf, where=storage_url(storage, f"{info.path}/{entry.path}"))

    loaded = dict(zip(local, _parallel(load_file, [by_path[n] for n in local], threads),
                      strict=True))
    if used_refs:
        names: dict[str, set[str]] = {}
        for i in wanted:
            if slots[i].file in refs:
                names.setdefault(slots[i].file, set()).add(slots[i].name)
        got = _parallel(lambda r: load_reference(storage, info, r, names[r.path], verify=verify),
                        used_refs, threads)
        loaded.update({r.path: t for r, t in zip(used_refs, got, strict=True)})
    unselected = torch.empty(0)  # never reached: the pruned tree does not reference it
    tensors: list[torch.Tensor] = [unselected] * len(slots)
    taken: set[tuple[str, str]] = set()
    for i in wanted:
        slot = slots[i]
        t = loaded[slot.file].get(slot.name)
        if t is None or tuple(t.shape) != slot.shape or dtype_code(t.dtype) != slot.dtype:
            raise CorruptCheckpointError(
                f"{info.url}/{slot.file}: tensor {slot.name!r} is missing or differs from the "
                "state document", step=info.step)
        if (slot.file, slot.name) in taken:
            # Each slot is its own tensor (one tensor at save: §2.4); another slot naming the
            # same stored bytes (an incremental save stores equal bytes once, §9.4) gets a
            # copy, never the same object or memory.
            t = t.clone()
        taken.add((slot.file, slot.name))
        tensors[i] = mapper(t) if mapper is not None else t
    state = build_tree(tree, tensors, where=where)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where}: the state root is not a dict", step=info.step)
    return state


def references_of(info: CheckpointInfo) -> dict[str, Reference]:
    """The references of a checkpoint by the name its state document uses (none without the
    ``"references"`` feature)."""
    return {r.path: r for r in info.manifest.references}


def _parsed_header(storage: Storage, info: CheckpointInfo, src: StoredChunks, head: Chunk, *,
                   verify: bool, whose: str) -> tuple[int, dict[str, HeaderEntry]]:
    """The safetensors header of the chunked file ``src``: its header chunk ``head`` read and
    checked against its digest (``verify``) by the chunk reader, its length prefix against the
    chunk, and parsed with the bounds of §2.4.  ``whose``: how the errors name the chunk ("its
    header chunk", "the header chunk step N references")."""
    where = storage_url(storage, src.location)
    if head.length < 8 or head.length - 8 > MAX_HEADER_BYTES:
        raise UnsafeCheckpointError(f"{where}: {whose} ({head.length} B) is not a safetensors "
                                    "header", step=info.step, path=src.location)
    data = read_chunk(storage, src, head, verify=verify)
    if int.from_bytes(data[:8], "little") + 8 != head.length:
        raise CorruptCheckpointError(f"{where}: its header length differs from {whose}",
                                     step=info.step, path=src.location)
    return parse_safetensors_header(cast(Any, _HeaderOnly(data, src.size)), where=where)


def local_header(storage: Storage, info: CheckpointInfo, entry: ChunkedFileEntry
                 ) -> tuple[int, dict[str, HeaderEntry]]:
    """The safetensors header of a chunked file of the checkpoint (format v3), its header chunk
    checked against its digest (`_parsed_header`)."""
    head = entry.chunks[0] if entry.chunks else Chunk(0, 0, "")
    return _parsed_header(storage, info, StoredChunks.of_entry(info, entry, by_rank=False), head,
                          verify=True, whose="its header chunk")


def reference_header(storage: Storage, info: CheckpointInfo, ref: Reference, *,
                     verify: bool = True) -> tuple[int, dict[str, HeaderEntry]]:
    """The safetensors header of a referenced file, its header chunk checked against the
    digest in this checkpoint's manifest (`_parsed_header`, against the referenced
    file's size)."""
    return _parsed_header(storage, info, StoredChunks.of_reference(info, ref), ref.chunks[0],
                          verify=verify,
                          whose=f"the header chunk step {info.step} references as {ref.path}")


def reference_chunks(storage: Storage, info: CheckpointInfo, ref: Reference,
                     names: set[str] | None, *, verify: bool = True
                     ) -> dict[str, tuple[HeaderEntry, Chunk]]:
    """Each tensor ``names`` (default: every tensor the reference binds a chunk of) with the
    chunk the reference binds for its bytes: `CorruptCheckpointError` for a name the
    header lacks or whose bytes are not exactly one chunk of the reference."""
    start, entries = reference_header(storage, info, ref, verify=verify)
    out: dict[str, tuple[HeaderEntry, Chunk]] = {}
    wanted = names if names is not None else set(entries)
    for name in sorted(wanted):
        e = entries.get(name)
        chunk = None if e is None else ref.chunk_at(start + e.begin, e.end - e.begin)
        if e is None or chunk is None:
            if names is None:
                continue  # not a tensor this checkpoint uses
            raise CorruptCheckpointError(
                f"{storage_url(storage, ref.location)}: tensor {name!r}, which step "
                f"{info.step} reads there ({ref.path}), is not in the file's header or its "
                "bytes are not a chunk the reference binds", step=info.step, path=ref.location)
        out[name] = (e, chunk)
    return out


def load_reference(storage: Storage, info: CheckpointInfo, ref: Reference, names: set[str],
                   *, verify: bool = True) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of a referenced file: its header chunk and each tensor's chunk
    read (adjacent chunks in one ranged read) and checked against the digests in this
    checkpoint's manifest before a tensor is made of them."""
    located = reference_chunks(storage, info, ref, names, verify=verify)
    order = sorted(located.items(), key=lambda kv: kv[1][1].offset)
    groups: list[list[tuple[str, tuple[HeaderEntry, Chunk]]]] = []
    for item in order:  # adjacent chunks read together, up to _COALESCE bytes at a time
        c = item[1][1]
        if groups:
            head, last = groups[-1][0][1][1], groups[-1][-1][1][1]
            if last.offset + last.length == c.offset \
                    and c.offset + c.length - head.offset <= _COALESCE:
                groups[-1].append(item)
                continue
        groups.append([item])
    src = StoredChunks.of_reference(info, ref)
    out: dict[str, torch.Tensor] = {}
    for group in groups:
        first, last = group[0][1][1], group[-1][1][1]
        length = last.offset + last.length - first.offset
        buf = bytearray(read_run(storage, src, first.offset, length, verify=False)) if length \
            else bytearray()
        for name, (e, chunk) in group:
            lo = chunk.offset - first.offset
            if verify:
                check_chunk(storage, src, chunk, memoryview(buf)[lo:lo + chunk.length])
            dtype = CODE_DTYPES[e.dtype]
            if chunk.length == 0:
                out[name] = torch.empty(e.shape, dtype=dtype)
            else:
                out[name] = torch.frombuffer(buf, dtype=torch.uint8, count=chunk.length,
                                             offset=lo).view(dtype).reshape(e.shape)
    return out


_COALESCE = 64 << 20


def verify_reference(storage: Storage, info: CheckpointInfo, ref: Reference) -> None:
    """Every chunk a reference binds read and checked (its header chunk and each tensor's,
    in reads of at most 64 MiB)."""
    reference_header(storage, info, ref, verify=True)
    src = StoredChunks.of_reference(info, ref)
    for chunk in ref.chunks[1:]:
        check_streamed(storage, src, chunk, bound=_COALESCE)


class _HeaderOnly:
    """The first bytes of a safetensors file posing as the whole file (its size known from the
    manifest), so `parse_safetensors_header` checks the header without the data."""

    def __init__(self, head: bytes | memoryview, size: int) -> None:
        self.head, self.size = head, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, item: slice) -> bytes | memoryview:
        if item.stop is not None and item.stop > len(self.head):
            raise IndexError("beyond the header")  # pragma: no cover - bounded by the parser
        return self.head[item]


def read_header(storage: Storage, info: CheckpointInfo, entry: FileEntry
                ) -> dict[str, HeaderEntry]:
    """The entries of one safetensors file of the checkpoint, from two ranged reads (length,
    then header), checked exactly as a load checks them (bounds, tiling of the data region,
    against the size in the manifest); the tensor data is not read."""
    full = f"{info.path}/{entry.path}"
    where = storage_url(storage, full)
    try:
        first = read_range(storage, full, 0, 8) if entry.size >= 8 else b""
        if len(first) < 8:
            raise CorruptCheckpointError(f"{where}: {entry.size} bytes is too short for "
                                         "safetensors", step=info.step, path=full)
        hlen = int.from_bytes(first, "little")
        if hlen > min(MAX_HEADER_BYTES, entry.size - 8):
            raise UnsafeCheckpointError(
                f"{where}: safetensors header length {hlen} exceeds the file ({entry.size} B) "
                f"or the {MAX_HEADER_BYTES}-byte limit", step=info.step, path=full)
        head = first + read_range(storage, full, 8, hlen)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: listed in the manifest but missing",
                                     step=info.step, path=full) from None
    if len(head) != 8 + hlen:
        raise CorruptCheckpointError(f"{where}: size differs from the manifest (shorter than "
                                     "its header)", step=info.step, path=full)
    _, entries = parse_safetensors_header(cast(Any, _HeaderOnly(head, entry.size)),
                                          where=where)
    return entries


def _placeholder(slot: TensorSlot) -> torch.Tensor:
    """A tensor of the slot's dtype and shape holding one element (broadcast)."""
    one = torch.zeros((1,) * len(slot.shape), dtype=CODE_DTYPES[slot.dtype])
    return one.expand(slot.shape)


@dataclass(frozen=True)
class CheckedSingleProcess:
    """What `check_single_process` decoded: the tagged tree and the tensor slots (``ckptfs inspect``
    renders them without reading anything again), and the state with a placeholder (of the
    stored dtype and shape, one element broadcast) for every tensor."""

    tree: Any
    slots: list[TensorSlot]
    state: dict[Any, Any] | None = None


def check_single_process(storage: Storage, info: CheckpointInfo) -> CheckedSingleProcess:
    """Refuse, with the error `load_single_process` would raise, a format v1 checkpoint a load would
    refuse, without reading tensor data: the listing, ``state.msgpack`` (read, digest checked,
    decoded, its tree rebuilt over placeholders), and the header of every tensor file the state
    references (its entries must be those of the state document).  Values of types not
    registered in this process are checked as plain dicts (``ckptfs cp`` does not know the
    program's classes).  Used by ``ckptfs cp`` before it copies anything."""
    manifest = info.manifest
    by_path = {e.path: e for e in manifest.files}
    state_entry, where = _state_entry(storage, info, by_path)
    check_listing(storage, info)
    doc = read_file_verified(storage, info, state_entry, verify=True)
    tree, slots = decode_state_doc(bytes(doc), where=where)
    del doc
    refs = references_of(info)
    missing = sorted({s.file for s in slots if s.file not in by_path and s.file not in refs})
    if missing:
        raise CorruptCheckpointError(f"{info.url}: state references files not in the manifest: "
                                     f"{missing}", step=info.step)
    headers: dict[str, dict[str, HeaderEntry]] = {}
    for ref in refs.values():  # header chunk verified; each tensor used exactly one bound chunk
        used = {s.name for s in slots if s.file == ref.path}
        headers[ref.path] = {n: e for n, (e, _) in
                             reference_chunks(storage, info, ref, used).items()}
    for slot in slots:
        if slot.file not in headers:
            headers[slot.file] = read_header(storage, info, by_path[slot.file])
        h = headers[slot.file].get(slot.name)
        if h is None or h.shape != slot.shape or h.dtype != slot.dtype:
            raise CorruptCheckpointError(
                f"{info.url}/{slot.file}: tensor {slot.name!r} is missing or differs from the "
                "state document", step=info.step)
    with unregistered_as_dict():
        state = build_tree(tree, [_placeholder(s) for s in slots], where=where)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where}: the state root is not a dict", step=info.step)
    return CheckedSingleProcess(tree, slots, state)


def verify_single_process(storage: Storage, info: CheckpointInfo, report: VerifyReport, *,
              threads: int = 4) -> None:
    """Full verification of a format v1 checkpoint, after the shared listing checks: every
    file the listing did not already condemn is re-read and re-hashed; then, when every byte
    is as committed, the documents are checked as a load checks them (`check_single_process`:
    ``state.msgpack`` decoded and its tree rebuilt, every referenced tensor file's header
    checked; extension type names are not looked up), so that verify never passes what a load
    refuses (a pickle in ``state.msgpack`` with a valid digest, a hostile header)."""

    def check(entry: FileEntry) -> str | None:
        try:
            read_file_verified(storage, info, entry, verify=True)
        except CorruptCheckpointError as exc:
            return f"{entry.path}: {exc}"
        return None

    def check_ref(ref: Reference) -> str | None:
        try:
            verify_reference(storage, info, ref)
        except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
            return f"{ref.path}: {exc}"
        return None

    already = {p.split(":", 1)[0] for p in report.problems}
    todo = [e for e in info.manifest.files if e.path not in already]
    refs = [r for r in references_of(info).values() if r.path not in already]
    found = [problem for problem in _parallel(check, todo, threads) if problem]
    found += [problem for problem in _parallel(check_ref, refs, threads) if problem]
    report.problems += found
    if not found and len(todo) == len(info.manifest.files) \
            and len(refs) == len(references_of(info)):  # every byte is as committed
        try:
            check_single_process(storage, info)
        except (CorruptCheckpointError, ExtensionTypeError) as exc:
            report.problems.append(str(exc))
