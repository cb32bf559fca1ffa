"""Reading format v2: the DCP ``StorageReader`` (ranged reads, each chunk verified before the
planner sees it) and the full verification of a sharded checkpoint.

A rank reads exactly the stored chunks its read items overlap: one ranged read per run of
adjacent chunks (at most :data:`~ckptfs.protocol.sharded_io.MAX_RANGE` bytes), each chunk
hashed and compared with the manifest before any of its bytes are copied into a tensor or
decoded.  A chunk a rank needs only part of is still read whole: its digest covers all of it.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptfs.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format.hashing import digest_bytes
from ckptfs.format.layout import StepPaths, check_step
from ckptfs.format.limits import MAX_METADATA_BYTES
from ckptfs.format.sharded import (
    METADATA_NAME,
    Chunk,
    ChunkedFileEntry,
    DcpDocument,
    ItemLocation,
    ShardedManifest,
    decode_metadata,
    element_size,
    tensor_code,
)
from ckptfs.protocol.commit import default_threads
from ckptfs.protocol.resolve import CheckpointInfo, read_committed, resolve_latest, storage_url
from ckptfs.protocol.sharded_io import MAX_RANGE, check_checkpoint_id
from ckptfs.storage.base import Storage, read_range


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def sharded_manifest(info: CheckpointInfo) -> ShardedManifest:
    """``info``'s manifest if it is format v2, else :class:`CheckpointNotFoundError`."""
    if not isinstance(info.manifest, ShardedManifest):
        raise CheckpointNotFoundError(
            f"step {info.step} at {info.url} is a single-process (format v1) checkpoint, not a "
            f"sharded one; load it with ckptfs.open(url).load({info.step})")
    return info.manifest


def read_chunks(storage: Storage, info: CheckpointInfo, entry: ChunkedFileEntry, start: int,
                length: int, *, verify: bool = True) -> memoryview:
    """``length`` bytes at ``start`` of ``entry`` (a run of whole chunks), every chunk of it
    checked against its digest.  :class:`CorruptCheckpointError` names the file and the rank
    reading it."""
    path = f"{info.path}/{entry.path}"
    where = storage_url(storage, path)
    try:
        data = read_range(storage, path, start, length)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: listed in the manifest but missing (read by "
                                     f"rank {_rank()})", step=info.step, path=path) from None
    if len(data) != length:
        raise CorruptCheckpointError(
            f"{where}: {len(data)} B at offset {start}, the manifest declares {length} B: the "
            f"file is shorter than committed (read by rank {_rank()})", step=info.step, path=path)
    view = memoryview(data)
    if verify:
        pos = start
        while pos < start + length:
            chunk = _chunk_starting(entry, pos)
            piece = view[pos - start:pos - start + chunk.length]
            actual = digest_bytes(entry.algorithm, piece).split(":", 1)[1]
            if actual != chunk.digest:
                raise CorruptCheckpointError(
                    f"{where}: bytes {chunk.offset}..{chunk.offset + chunk.length} differ from "
                    f"their digest in the manifest (expected {chunk.digest}, got {actual}; read "
                    f"by rank {_rank()}): the file was modified or corrupted after commit",
                    step=info.step, path=path)
            pos += chunk.length
            if chunk.length == 0:
                break
    return view


def _chunk_starting(entry: ChunkedFileEntry, offset: int) -> Chunk:
    lo, hi = 0, len(entry.chunks)
    while lo < hi:
        mid = (lo + hi) // 2
        if entry.chunks[mid].offset < offset:
            lo = mid + 1
        else:
            hi = mid
    # Zero-length chunks share their offset with the next one: take the longest.
    while lo + 1 < len(entry.chunks) and entry.chunks[lo].length == 0 and \
            entry.chunks[lo + 1].offset == offset:
        lo += 1
    if lo >= len(entry.chunks) or entry.chunks[lo].offset != offset:
        raise CorruptCheckpointError(f"{entry.path}: no chunk starts at {offset}")
    return entry.chunks[lo]


def read_document(storage: Storage, info: CheckpointInfo, *, verify: bool = True
                  ) -> DcpDocument:
    """Read, verify and decode ``dcp.msgpack``, and check that every stored item is exactly one
    chunk of a file in the manifest."""
    manifest = sharded_manifest(info)
    try:
        entry = manifest.chunked(METADATA_NAME)
    except KeyError:
        raise CorruptCheckpointError(f"{info.url}: manifest lists no {METADATA_NAME}",
                                     step=info.step) from None
    where = storage_url(storage, f"{info.path}/{METADATA_NAME}")
    if entry.size > MAX_METADATA_BYTES:
        raise UnsafeCheckpointError(f"{where}: declared size {entry.size} B exceeds "
                                    f"{MAX_METADATA_BYTES} B", step=info.step)
    doc = decode_metadata(read_chunks(storage, info, entry, 0, entry.size, verify=verify),
                          where=where)
    files = {e.path: e for e in manifest.files if isinstance(e, ChunkedFileEntry)}
    for index, loc in (doc.metadata.storage_data or {}).items():
        e = files.get(loc.path)
        if e is None or e.chunk_at(loc.offset, loc.length) is None:
            raise CorruptCheckpointError(
                f"{where}: item {index.fqn!r} is stored at {loc.path}@{loc.offset}+{loc.length}, "
                "which is not a chunk of a file in the manifest", step=info.step)
    return doc


class ShardedReader(StorageReader):
    """A DCP ``StorageReader`` for the committed step ``step`` of a ckptfs run (the newest
    committed one if ``None``, resolved by each rank and checked equal by the coordinator)."""

    def __init__(self, storage: Storage, step: int | None = None, *, verify: bool = True,
                 threads: int | None = None, allow_rollback: bool = False) -> None:
        super().__init__()
        self.storage = storage
        self.step = None if step is None else check_step(step)
        self.verify = verify
        self.threads = threads or default_threads()
        self.allow_rollback = allow_rollback
        self.info: CheckpointInfo | None = None
        self.document: DcpDocument | None = None
        self._deferred: BaseException | None = None
        self._shapes: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = {}

    @property
    def checkpoint_id(self) -> str:
        if self.step is None:
            return self.storage.url
        return storage_url(self.storage, StepPaths(self.step).dir)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        check_checkpoint_id(self.checkpoint_id, checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def resolve(self) -> CheckpointInfo:
        """The committed checkpoint this reader reads (resolved once)."""
        if self.info is None:
            if self.step is None:
                info = resolve_latest(self.storage, allow_rollback=self.allow_rollback)
                if info is None:
                    raise CheckpointNotFoundError(
                        f"no committed checkpoint at {self.storage.url}")
            else:
                info = read_committed(self.storage, self.step)
            sharded_manifest(info)
            self.info = info
        return self.info

    def defer(self, error: BaseException) -> None:
        """Report ``error`` through DCP's planning step instead of ``read_metadata`` (DCP turns
        a ``read_metadata`` failure into an ``AssertionError``): ``read_metadata`` returns empty
        metadata, and the ckptfs load planner raises ``error``, which DCP gathers."""
        self._deferred = error

    # No **kwargs: DCP would then retry with rank= and fall back to per-rank metadata.
    def read_metadata(self) -> Metadata:
        if self._deferred is not None:
            return Metadata(state_dict_metadata={})
        info = self.resolve()
        doc = read_document(self.storage, info, verify=self.verify)
        self.document = doc
        md = doc.metadata
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = f"{info.step}:{info.attempt}"
        self._shapes = {}
        for fqn, sm in md.state_dict_metadata.items():
            if isinstance(sm, TensorStorageMetadata):
                for c in sm.chunks:
                    self._shapes[(fqn, tuple(c.offsets))] = (sm.properties.dtype,
                                                             tuple(c.sizes))
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self._deferred is not None:
            return
        if self.document is None or self.document.metadata is not metadata:
            # The caller passed metadata read elsewhere: resolve it ourselves.
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._deferred is not None:
            raise self._deferred
        info = self.resolve()
        return dataclasses.replace(plan, storage_data=(info.step, info.attempt))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        seen = {p.storage_data for p in plans}
        if len(seen) > 1:
            raise CheckpointNotFoundError(
                f"the ranks resolved different checkpoints at {self.storage.url} "
                f"({sorted(seen)}): a newer step was committed while they resolved 'latest'; "
                "load again, or pass the step explicitly")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        info = self.resolve()
        md = self.document.metadata if self.document else None
        if md is None:  # pragma: no cover - DCP always calls read_metadata first
            raise CorruptCheckpointError("read_data() before read_metadata()")
        if any(r.type == LoadItemType.BYTE_IO for r in plan.items):
            fn = getattr(type(planner), "load_bytes", None)
            if fn in (DefaultLoadPlanner.load_bytes, LoadPlanner.load_bytes):
                raise UnsupportedValueError(
                    f"the load planner {type(planner).__name__} would unpickle stored values "
                    "(torch.load(weights_only=False)); ckptfs never unpickles: pass "
                    "planner=ckptfs.dcp.LoadPlanner()")
        groups: dict[tuple[str, int, int], list[ReadItem]] = {}
        storage_data: dict[MetadataIndex, ItemLocation] = md.storage_data or {}
        for req in plan.items:
            loc = storage_data.get(req.storage_index)
            if loc is None:
                raise CorruptCheckpointError(
                    f"{info.url}: no stored location for item {req.storage_index.fqn!r}",
                    step=info.step)
            groups.setdefault((loc.path, loc.offset, loc.length), []).append(req)
        manifest = sharded_manifest(info)
        for views in self._fetch(manifest, sorted(groups)):
            for key, view in views:
                self._apply(planner, groups[key], view, info)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _fetch(self, manifest: ShardedManifest, keys: list[tuple[str, int, int]]
               ) -> Iterator[list[tuple[tuple[str, int, int], memoryview]]]:
        """Coalesce adjacent chunks into ranged reads, run them on a pool (at most ``threads``
        in flight beyond the one being applied), yield each verified run's chunk views."""
        runs: list[list[tuple[str, int, int]]] = []
        for key in keys:
            last = runs[-1][-1] if runs else None
            if (last is not None and last[0] == key[0] and last[1] + last[2] == key[1]
                    and key[1] + key[2] - runs[-1][0][1] <= MAX_RANGE):
                runs[-1].append(key)
            else:
                runs.append([key])
        info = self.resolve()

        def fetch(run: list[tuple[str, int, int]]) -> list[tuple[tuple[str, int, int],
                                                                  memoryview]]:
            path, start = run[0][0], run[0][1]
            length = run[-1][1] + run[-1][2] - start
            entry = manifest.chunked(path)
            view = read_chunks(self.storage, info, entry, start, length, verify=self.verify)
            return [(k, view[k[1] - start:k[1] - start + k[2]]) for k in run]

        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckptfs-read") as pool:
            window: collections.deque[CFuture[Any]] = collections.deque()
            todo = iter(runs)
            for run in todo:
                window.append(pool.submit(fetch, run))
                if len(window) > self.threads:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()

    def _apply(self, planner: LoadPlanner, reqs: list[ReadItem], view: memoryview,
               info: CheckpointInfo) -> None:
        for req in reqs:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(view)))
                continue
            key = (req.storage_index.fqn, tuple(req.storage_index.offset or ()))
            found = self._shapes.get(key)
            if found is None:
                raise CorruptCheckpointError(
                    f"{info.url}: no stored chunk of {key[0]!r} at offsets {list(key[1])}",
                    step=info.step)
            dtype, shape = found
            n = 1
            for s in shape:
                n *= s
            if n * element_size(tensor_code(dtype, key[0])) != len(view):
                raise CorruptCheckpointError(
                    f"{info.url}: item {key[0]!r} is {len(view)} B, its shape {list(shape)} "
                    f"{dtype} needs {n * element_size(tensor_code(dtype, key[0]))} B",
                    step=info.step)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffer: only read
                stored = (torch.frombuffer(view, dtype=dtype) if len(view)
                          else torch.empty(0, dtype=dtype)).reshape(shape)
            src = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise CorruptCheckpointError(
                    f"{info.url}: item {key[0]!r}: stored slice {list(src.size())} does not fit "
                    f"the target {list(target.size())}", step=info.step)
            target.copy_(src)
            planner.commit_tensor(req, target)
