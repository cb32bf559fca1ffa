"""DCP storage layer of format v2: a ``StorageWriter`` and a ``StorageReader`` that write and
read sharded checkpoints with ckptfs's commit protocol and digests.

How DCP drives the writer (torch.distributed.checkpoint, ``use_collectives=True``):

1. every rank: ``set_up_storage_writer``, ``prepare_local_plan`` (tensor dtypes and layouts are
   checked here, before anything is written);
2. the coordinator: ``prepare_global_plan`` fails fast if the step is committed, picks **one**
   attempt name, checks every reader limit on the manifest it will commit (built from the
   plans, placeholder digests: a checkpoint whose manifest a reader would refuse, e.g. over
   64 MiB of chunk lists, fails here, before any rank writes) and sends the attempt to every
   rank in ``SavePlan.storage_data``;
3. every rank: ``write_data`` writes its own ``rank-NNNNN/data-0.safetensors`` into that
   attempt, hashing each write item's bytes once, on a helper thread, while they are written;
   the ``WriteResult``s carry each item's (file, offset, length, digest) and the file's header
   chunk to the coordinator;
4. the coordinator: ``finish`` checks that the reported chunks tile every file and that every
   file is there with its size (one listing), writes ``dcp.msgpack``, and commits the attempt
   (`commit`: ``MANIFEST.json`` checked by the rules of the reader's
   own decoder, then ``COMPLETE`` created exclusively, once).  Any rank failing before that
   means no marker.

Every file goes through the one commit object, `Attempt`: the
coordinator opens it in ``prepare_global_plan``, every rank joins it in ``write_data`` and
streams its file through it (each item's bytes hashed once, as one piece), and the coordinator
commits it.

The reader resolves the step through the marker and manifest (``latest`` if none is given),
reads ``dcp.msgpack``, and for each DCP read item reads exactly the byte range of the stored
chunk (one ranged GET, adjacent chunks coalesced) and checks the chunk's digest before the
planner sees a byte.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptfs.errors import (
    CorruptCheckpointError,
    InvalidStepError,
    UnsupportedValueError,
)
from ckptfs.format.features import metadata_layout_for
from ckptfs.format.incremental import (
    Reference,
    references_of,
)
from ckptfs.format.layout import CHECKPOINTS_DIR, StepPaths, check_step, step_dir_name
from ckptfs.format.manifest import Manifest
from ckptfs.format.serialize import cpu_contiguous, tensor_memoryview, version_of
from ckptfs.format.sharded import (
    METADATA_NAME,
    Chunk,
    ChunkedFileEntry,
    PlannedItem,
    decode_value,
    element_size,
    item_name,
    make_entry,
    plan_header,
    rank_file_name,
    tensor_code,
)
from ckptfs.format.sharded_metadata import DcpDocument, ItemLocation, encode_metadata
from ckptfs.format.versions import CHUNKED, REFERENCES, SHARDED, features
from ckptfs.protocol.commit import Attempt, Lease, now_text, placeholder_digest
from ckptfs.protocol.gcpause import paused_collector
from ckptfs.protocol.incremental import (
    Item,
    ReuseIndex,
    Stored,
    decide_reuse,
    references,
    reuse_index,
)
from ckptfs.protocol.listing import check_written
from ckptfs.protocol.options import SaveOptions
from ckptfs.protocol.resolve import CheckpointInfo, storage_url
from ckptfs.protocol.sharded_read import check_checkpoint_id, read_document, sharded_manifest
from ckptfs.storage.base import Storage

if TYPE_CHECKING:
    from ckptfs.protocol.global_plan import GlobalPlan
    from ckptfs.protocol.plan_table import LocalTable
    from ckptfs.protocol.rank_metadata import PerRankSave

log = logging.getLogger("ckptfs")
#: The features of a sharded save's manifest (format v2; a save with a reuse memory adds
#: ``"references"``: format v4).  Every sharded file is chunked.
SHARDED_FEATURES = frozenset({SHARDED, CHUNKED})


@dataclass(frozen=True)
class AttemptPlan:
    """What the coordinator sends every rank in ``SavePlan.storage_data``: the attempt every
    rank writes into (`join`) and the rank's index."""

    attempt: str
    rank: int


@dataclass(frozen=True)
class ItemReport:
    """``WriteResult.storage_data``: where an item went and the digest of its bytes; the first
    item of a file also carries the file's size and header chunk."""

    path: str            # relative to the attempt directory
    offset: int
    length: int
    digest: str          # hex, the writer's algorithm
    rank: int
    file_size: int = -1  # -1: not the first item of its file
    header: Chunk | None = None
    #: A reused item (format v4): the file holding it (step, attempt, path in that attempt),
    #: whose size and header chunk are ``file_size`` and ``header``; ``offset``, ``length`` and
    #: ``digest`` are its chunk there; ``protector`` the committed checkpoint it was taken from.
    source: tuple[int, str, str] | None = None
    protector: tuple[int, str] | None = None
    #: The first item of a file this rank wrote: the store's whole-object checksums of the
    #: file, computed while writing it (``WrittenFile.store_checksums``).
    store_checksums: tuple[tuple[str, str], ...] = ()




@dataclass(frozen=True)
class FileStream:
    """A collective save streamed through an async save's staging budget (docs/async.md
    section 5): the tensors of the view are staged in ``count`` consecutive groups
    (`ckptfs.protocol.staging.fit_groups`), ``group_of`` maps each view name to its group,
    and ``gate(k)`` is the stream's gate around the write of group ``k``
    (`ckptfs.protocol.staging.Stream.gate`: it waits until the group is staged and gives its
    region back once written).  The rank writes one rank file per group it holds items of
    (``data-0``, ``data-1``, ...: format v2 allows several, §8.3), its values in the last."""

    group_of: Mapping[str, int]
    count: int
    gate: Callable[[int], Any]


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class ShardedWriter(StorageWriter):
    """A DCP ``StorageWriter`` committing one step of a ckptfs run with format v2.

    Every rank constructs one for the same ``storage`` and ``step``.  ``metadata`` (plain JSON)
    goes into the manifest; ``tree`` (set by ``store.save``) is the state's skeleton.  After a
    successful save, `info` holds the committed `CheckpointInfo` on every rank."""

    def __init__(self, storage: Storage, step: int, opts: SaveOptions, *,
                 metadata: Mapping[str, Any] | None = None, tree: Any = None,
                 world: int | None = None) -> None:
        super().__init__()
        self.storage = storage
        self.step = check_step(step)
        self.opts = opts
        self.algorithm = opts.algorithm
        self.durable = opts.durable
        self.threads = opts.workers
        self.metadata = dict(metadata or {})
        self.tree = tree
        self.is_coordinator = False
        self.rank = 0
        self.info: CheckpointInfo | None = None
        self._paths = StepPaths(self.step)
        self._attempt: Attempt | None = None  # the coordinator's open attempt
        self._global: GlobalPlan | None = None  # the coordinator's global plan (its rounds)
        #: Incremental (format v4): this rank reuses the unchanged items of its previous save
        #: in this process (``memory.rank_index``); the index of this save, installed by
        #: `remember` once it committed.
        self.memory = opts.reuse
        self.lease_s = opts.lease_s
        #: Each rank writes to its own node's storage (the local tier of a two-tier store,
        #: docs/tiers.md): the coordinator checks only its own files, each rank its own.
        self.node_local = opts.node_local
        self._lease: Lease | None = None
        self._pending: tuple[ReuseIndex, dict[str, tuple[int, int]],
                             set[tuple[str, int, int]]] | None = None
        #: The reuse hint of a resolved tensor (``version_of``); an async save, whose tensors
        #: are staged copies, gives the caller's tensors' hints taken at its snapshot.
        self.hint: Callable[[torch.Tensor], tuple[int, int]] = version_of
        #: Set by an async save streamed through its staging budget (`FileStream`; format
        #: v2 only: `can_stream`).
        self.stream: FileStream | None = None
        #: Format v5, the metadata split per rank (docs/protocol.md §9.7), for
        #: ``metadata_layout="per-rank"`` or ``"auto"`` from 64 ranks (``world``: the save's
        #: ranks; default the world's) where the store allows it; else None: one
        #: ``dcp.msgpack`` (v2, v4).
        self.per_rank: PerRankSave | None = None
        metadata_layout = metadata_layout_for(
            opts.metadata_layout, _world_size() if world is None else world,
            incremental=opts.incremental)
        if metadata_layout is not None:  # imported for format v5 only
            from ckptfs.protocol.rank_metadata import per_rank_save
            self.per_rank = per_rank_save(self.storage, self.step, opts, self.metadata, tree,
                                          metadata_layout)

    @property
    def can_stream(self) -> bool:
        """Whether this save can be streamed through a staging budget (`FileStream`): format
        v2.  An incremental save (v4) reads every tensor to decide its reuse before it
        writes; a per-rank save (v5) writes one rank file per rank, which its index names."""
        return self.memory is None and self.per_rank is None

    @property
    def checkpoint_id(self) -> str:
        return storage_url(self.storage, self._paths.dir)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        check_checkpoint_id(self.checkpoint_id, checkpoint_id)
        self.info = None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        self.info = None
        self._attempt = None
        if not kwargs.get("use_collectives", True) and _world_size() > 1:
            raise UnsupportedValueError(
                f"{self.checkpoint_id}: use_collectives=False writes per-rank metadata with no "
                "global view and no single commit; ckptfs needs the collectives (the default)")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen implicitly from a bare checkpoint_id

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.tensor_data is not None:
                props = item.tensor_data.properties
                if props.layout != torch.strided:
                    raise UnsupportedValueError(
                        f"tensor {item.index.fqn!r} has layout {props.layout}; convert it with "
                        ".to_dense()")
                tensor_code(props.dtype, item.index.fqn)
        return dataclasses.replace(plan, storage_data=self.step)

    def _check_same_step(self, steps: list[Any]) -> None:
        if set(steps) != {self.step}:
            raise InvalidStepError(
                f"the ranks are saving different steps ({sorted(map(str, set(steps)))}) at "
                f"{self.storage.url}: every rank must save the same step")

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's hook (a plain ``dcp.save``): the attempt, opened and checked (`_open`), to
        every rank in its plan's ``storage_data``."""
        if self.per_rank is not None:
            raise UnsupportedValueError("a per-rank save is driven by ckptfs's rounds "
                                        "(store.save), not by dcp.save")
        with paused_collector():  # one placeholder chunk per item: gcpause's docstring
            name = self._open([p.storage_data for p in plans], None,
                              lambda attempt: self._placeholder_manifest(attempt, plans))
        return [dataclasses.replace(p, storage_data=AttemptPlan(name, i))
                for i, p in enumerate(plans)]

    def prepare_table(self, plan: GlobalPlan, tables: list[LocalTable]) -> str:
        """ckptfs's rounds (`ckptfs.protocol.save_rounds`): ``prepare_global_plan`` over the
        global plan made in columns; the attempt's name.  A per-rank save's placeholder is
        O(ranks); format v2's lists every chunk, so it is built of DCP's save plans.  The
        verdicts of the placeholder's check are kept with the plan (kept for its layout by
        the planner, `sharded_plan._PLAN_CACHE`): a save of a layout and writer already
        checked skips building and checking it again (4,096 ranks: about 0.9 s)."""
        self._global = plan
        per_rank = self.per_rank
        with paused_collector():
            return self._open(
                [t.step for t in tables], plan.memo.setdefault("checked", set()),
                (lambda attempt: self._placeholder_manifest(attempt, plan.save_plans(tables)))
                if per_rank is None else
                (lambda attempt: per_rank.placeholder(attempt, len(tables))))

    def _open(self, steps: list[Any], checked: set[Any] | None,
              placeholder: Callable[[str], Manifest]) -> str:
        """Every rank saves this step; the attempt opened (fails fast if the step is
        committed); the manifest this save will commit (``placeholder(attempt)``) checked by
        every reader limit, unless ``checked`` (the verdicts known for this layout) holds
        this writer's `_checked_key`."""
        self._check_same_step(steps)
        att = Attempt.open(self.storage, self.step, algorithm=self.algorithm,
                           durable=self.durable)
        key = self._checked_key()
        with att:  # a refused manifest discards the (empty) attempt
            if checked is None or key not in checked:
                att.check(placeholder(att.name), world_size=len(steps))
                if checked is not None:
                    checked.add(key)
        self._attempt = att
        self._lease = Lease(self.lease_s)
        return att.name

    def _checked_key(self) -> Any:
        """What the verdict of the placeholder manifest's check depends on besides the layout
        of the ranks' plans: the algorithm, the metadata, the width of the step number,
        whether items are reused and the metadata layout."""
        return (self.algorithm, json.dumps(self.metadata, sort_keys=True), len(str(self.step)),
                self.memory is not None, self.per_rank is not None)

    def _placeholder_manifest(self, attempt: str, plans: list[SavePlan]) -> Manifest:
        """The manifest this save will commit, from the global plan: every rank file with its
        header and one chunk per item (values counted as empty: their size is known only to
        their rank), placeholder digests of the right length."""
        hexd = placeholder_digest(self.algorithm).split(":", 1)[1]
        entries = []
        for rank, plan in enumerate(plans):
            if not plan.items:
                continue
            planned = [_planned(item, 0) for item in plan.items]
            header, offsets = plan_header(planned, rank)
            chunks = [Chunk(0, len(header), hexd)] + [
                Chunk(off, p.nbytes, hexd) for p, off in zip(planned, offsets, strict=True)]
            size = offsets[-1] + planned[-1].nbytes
            entries.append(make_entry(rank_file_name(rank), size, self.algorithm, chunks, rank))
        entries.append(make_entry(METADATA_NAME, 0, self.algorithm, [Chunk(0, 0, hexd)], None))
        return Manifest(self.step, attempt, tuple(entries), now_text(), self.algorithm,
                        {"tensor_count": 0, **self.metadata}, SHARDED_FEATURES,
                        world_size=len(plans))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        ap = plan.storage_data
        if not isinstance(ap, AttemptPlan):
            raise UnsupportedValueError(
                "the save plan carries no ckptfs attempt: prepare_global_plan did not run "
                "(use_collectives=False is not supported)")
        results = self._write_rank(ap, plan.items, planner) \
            if plan.items or self.stream is not None else []
        if self.per_rank is not None:  # format v5: this rank's index, one report
            results = self.per_rank.write_index(ap.attempt, ap.rank, plan.items, results)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_rank(self, ap: AttemptPlan, items: list[WriteItem],
                    planner: SavePlanner) -> list[WriteResult]:
        values: dict[int, bytes] = {}
        tensors: dict[int, torch.Tensor] = {}
        planned: list[tuple[WriteItem, PlannedItem]] = []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else b""
                try:
                    decode_value(raw, where=f"key {item.index.fqn!r}")
                except CorruptCheckpointError:
                    raise UnsupportedValueError(
                        f"the save planner {type(planner).__name__} encoded key "
                        f"{item.index.fqn!r} with torch.save/pickle; ckptfs stores values "
                        "without pickle: pass planner=ckptfs.dcp.SavePlanner()") from None
                values[id(item)] = raw
                planned.append((item, _planned(item, len(raw))))
            else:
                planned.append((item, _planned(item, 0)))
                if self.memory is not None:  # resolved once, for the reuse hint and write
                    tensors[id(item)] = self._resolve(item, planner)
        reused, protector = self._find_reuse(planned, tensors) if self.memory is not None \
            else ({}, None)
        own = [p for p in planned if id(p[0]) not in reused]
        # Largest elements first: every tensor's offset is aligned to its element size.
        own.sort(key=lambda p: -element_size(p[1].dtype))
        results: list[WriteResult] = []
        written: dict[str, Stored] = {}
        if self.stream is not None:
            results, written = self._write_streamed(ap, own, values, tensors, planner,
                                                    self.stream)
        elif own:
            results, written = self._write_file(ap, own, values, tensors, planner)
        # The chunks this rank wrote (and their files' header chunks): known good from now on.
        fresh = {c for st in written.values() for c in (
            st.chunk_id, (st.path, st.header.offset, st.header.length))}
        for item, pi in planned:
            st = reused.get(id(item))
            if st is None:
                continue
            assert protector is not None
            report = ItemReport(f"{CHECKPOINTS_DIR}/{step_dir_name(st.step)}/{st.attempt}/"
                                f"{st.source}", st.chunk.offset, st.chunk.length,
                                st.chunk.digest, ap.rank, st.size, st.header,
                                (st.step, st.attempt, st.source), protector)
            results.append(WriteResult(item.index, pi.nbytes, report))
            written[pi.name] = st
        if self.memory is not None:
            new_index = ReuseIndex((self.step, ap.attempt))
            for name, st in written.items():
                new_index.add(name, st)
            self._pending = (new_index, {p.name: self.hint(tensors[id(i)])
                                         for i, p in planned if id(i) in tensors}, fresh)
        return results

    def _resolve(self, item: WriteItem, planner: SavePlanner) -> torch.Tensor:
        t = planner.resolve_data(item)
        if not isinstance(t, torch.Tensor):
            raise UnsupportedValueError(f"{item.index.fqn!r}: the planner resolved a tensor "
                                        f"item to {type(t).__name__}")
        return t

    def _find_reuse(self, planned: list[tuple[WriteItem, PlannedItem]],
                    tensors: dict[int, torch.Tensor]
                    ) -> tuple[dict[int, Stored], tuple[int, str] | None]:
        """The items of this rank to reference (``id(item)`` -> where their bytes are) and
        the checkpoint they are taken from (the protector): the
        one reuse decision of every incremental save (`decide_reuse`), by name, over the index
        of this rank's previous save in this process or, at the first save of a new job, of
        the run's newest committed checkpoint (`sharded_index_of`, every stored chunk read
        and checked before its first reuse)."""
        memory = self.memory
        if memory is None:
            return {}, None
        index = reuse_index(self.storage, memory, self.algorithm, sharded=True,
                            indexer=sharded_index_of)
        if index is None:
            return {}, None
        with memory.lock:
            before = memory.rank_versions
        ids: list[int] = []
        items: list[Item] = []
        for item, pi in planned:
            t = tensors.get(id(item))
            if t is None or pi.nbytes == 0 or tuple(t.shape) != pi.shape:
                continue
            ids.append(id(item))
            items.append((pi.name, t, self.hint(t)))
        chosen = decide_reuse(items, index, memory, before, algorithm=self.algorithm,
                              threads=self.threads, storage=self.storage, by_content=False)
        return {ids[i]: st for i, st in chosen.items()}, index.protector

    def _write_streamed(self, ap: AttemptPlan, own: list[tuple[WriteItem, PlannedItem]],
                        values: dict[int, bytes], tensors: dict[int, torch.Tensor],
                        planner: SavePlanner, stream: FileStream
                        ) -> tuple[list[WriteResult], dict[str, Stored]]:
        """This rank's items in one rank file per staged group (`FileStream`), each written
        inside the stream's gate of its group, every group's gate passed in order (a group
        this rank writes nothing of gives its region back at once)."""
        last = stream.count - 1
        parts: list[list[tuple[WriteItem, PlannedItem]]] = [[] for _ in range(stream.count)]
        for p in own:
            fqn = p[0].index.fqn
            k = last if id(p[0]) in values else stream.group_of.get(fqn)
            if k is None:  # never guessed: another group's bytes may be in its place
                raise UnsupportedValueError(
                    f"{fqn!r}: a streamed save found no staged group for this tensor; save "
                    "without staging_bytes and report this")
            parts[k].append(p)
        results: list[WriteResult] = []
        written: dict[str, Stored] = {}
        files = 0
        for k, part in enumerate(parts):
            with stream.gate(k):
                if part:
                    r, w = self._write_file(ap, part, values, tensors, planner, index=files)
                    files += 1
                    results += r
                    written.update(w)
        return results, written

    def _write_file(self, ap: AttemptPlan, planned: list[tuple[WriteItem, PlannedItem]],
                    values: dict[int, bytes], tensors: dict[int, torch.Tensor],
                    planner: SavePlanner, index: int = 0
                    ) -> tuple[list[WriteResult], dict[str, Stored]]:
        """Write this rank's file ``index`` (``rank-R/data-<index>``) of ``planned`` items
        into the attempt; the write results and, per item name, where its bytes now are."""
        header, offsets = plan_header([p for _, p in planned], ap.rank)
        relpath = rank_file_name(ap.rank, index)
        att = Attempt.join(self.storage, self.step, ap.attempt, algorithm=self.algorithm,
                           durable=self.durable)

        def chunks() -> Any:
            for (item, pi), _ in zip(planned, offsets, strict=True):
                if id(item) in values:
                    yield memoryview(values[id(item)])
                    continue
                t = tensors.get(id(item))
                ct = cpu_contiguous(t if t is not None else self._resolve(item, planner))
                if tuple(ct.shape) != pi.shape or tensor_code(ct.dtype, pi.name) != pi.dtype:
                    raise UnsupportedValueError(
                        f"{item.index.fqn!r}: planned {pi.dtype}{list(pi.shape)}, the planner "
                        f"resolved {ct.dtype}{list(ct.shape)}")
                yield tensor_memoryview(ct)

        def pieces() -> Any:
            yield memoryview(header)
            yield from chunks()

        size = offsets[-1] + planned[-1][1].nbytes if planned else len(header)
        written = att.write_file(relpath, size, pieces,
                                 pieces=[len(header), *(p.nbytes for _, p in planned)])
        if self.per_rank is None:  # format v5: once its index document is written too
            att.sync_file_dir(relpath)
        # This rank's own listing: its file is there with its size before it reports it (the
        # check holds on shared storage and on a node-local disk alike).
        check_written(self.storage, att.write_dir, [(relpath, size, ap.rank)],
                      step=self.step, who=f"rank {ap.rank} sees",
                      under=relpath.rsplit("/", 1)[0])
        digests = list(written.pieces)
        head = Chunk(0, len(header), digests[0])
        results = []
        stored: dict[str, Stored] = {}
        for i, ((item, pi), off) in enumerate(zip(planned, offsets, strict=True)):
            first = i == 0
            report = ItemReport(relpath, off, pi.nbytes, digests[i + 1], ap.rank,
                                size if first else -1, head if first else None,
                                store_checksums=written.store_checksums if first else ())
            results.append(WriteResult(item.index, pi.nbytes, report))
            if id(item) in tensors:
                stored[pi.name] = Stored(self.step, ap.attempt, relpath, size, self.algorithm,
                                         head, Chunk(off, pi.nbytes, digests[i + 1]), pi.name,
                                         pi.dtype, pi.shape)
        return results, stored

    def remember(self, info: CheckpointInfo) -> None:
        """After the save committed as ``info`` (every rank): this rank's items at this save
        become the reuse index of its next incremental save in this process."""
        pending, self._pending = self._pending, None
        if self.memory is None or pending is None or pending[0].protector != (info.step,
                                                                                info.attempt):
            return
        with self.memory.lock:
            self.memory.rank_index, self.memory.rank_versions = pending[0], pending[1]
            self.memory.checked.update(pending[2])

    def forget(self) -> None:
        """Reuse nothing at the next save (the previous one's references are no longer safe):
        the retry after the protector went away writes every byte, reading no index."""
        self._pending = None
        if self.memory is not None:
            with self.memory.lock:
                self.memory.rank_index, self.memory.rank_versions = None, {}
                self.memory.rank_resume = False

    def abandon(self) -> None:
        """The coordinator, once every rank's write ended and one failed: the attempt it
        opened is discarded (what the ranks wrote into it on storage the coordinator shares;
        on node-local storage, its own node's), as one process's failed save discards its
        own.  No marker was or will be created for it."""
        if self._attempt is not None:
            self._attempt.abandon()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's hook (a plain ``dcp.save``): the commit (`_commit`) of ``metadata``."""
        self._commit(metadata, results)
        metadata._ckptfs_info = self.info  # type: ignore[attr-defined]  # broadcast by DCP

    def finish_table(self, plan: GlobalPlan, results: list[list[WriteResult]]) -> None:
        """ckptfs's rounds: the commit of the global plan ``plan`` (format v2: its DCP
        ``Metadata``, every chunk; a per-rank save: its spec's layouts, O(tensors))."""
        self._global = plan
        self._commit(None, results)

    def _commit(self, metadata: Metadata | None, results: list[list[WriteResult]]) -> None:
        att = self._attempt
        if att is None:
            raise UnsupportedValueError("finish() before prepare_global_plan()")
        # One location and chunk per reported item: the collector paused (gcpause).
        with att, paused_collector():  # any failure before the marker discards the attempt
            if self.per_rank is not None:
                if self._global is None:
                    raise UnsupportedValueError("a per-rank save is driven by ckptfs's rounds")
                self.info = self.per_rank.finish(att, self._global, results,
                                                 self.checkpoint_id, tree=self.tree,
                                                 own_rank=self.rank)
            else:
                if metadata is None:
                    if self._global is None:  # pragma: no cover - finish_table sets it
                        raise UnsupportedValueError("finish() without a global plan")
                    metadata = self._global.metadata()
                self.info = self._finish(att, metadata, results)

    def _finish(self, att: Attempt, metadata: Metadata,
                results: list[list[WriteResult]]) -> CheckpointInfo:
        attempt = att.name
        storage_data: dict[MetadataIndex, ItemLocation] = {}
        per_file: dict[str, list[ItemReport]] = {}
        reused: list[tuple[MetadataIndex, ItemReport]] = []
        for rank_results in results:
            for wr in rank_results:
                rep = wr.storage_data
                if not isinstance(rep, ItemReport):
                    raise UnsupportedValueError("a rank reported a write result ckptfs did not "
                                                "produce")
                if rep.source is not None:
                    reused.append((wr.index, rep))
                    continue
                storage_data[wr.index] = ItemLocation(rep.path, rep.offset, rep.length)
                per_file.setdefault(rep.path, []).append(rep)
        if reused and self.memory is None:
            raise UnsupportedValueError("a rank reused stored bytes in a non-incremental save")
        refs, protectors = _references(reused, storage_data, self.algorithm)
        entries: list[ChunkedFileEntry] = []
        for path, reps in sorted(per_file.items()):
            first = [r for r in reps if r.header is not None]
            if len(first) != 1 or first[0].header is None:
                raise CorruptCheckpointError(f"{path}: no single header report")
            items = sorted((Chunk(r.offset, r.length, r.digest) for r in reps),
                           key=lambda c: (c.offset, c.length))
            chunks = [first[0].header, *items]
            entries.append(make_entry(path, first[0].file_size, self.algorithm, chunks,
                                      first[0].rank, store_checksums=first[0].store_checksums))
        metadata.storage_data = storage_data
        metadata.storage_meta = StorageMeta(checkpoint_id=self.checkpoint_id, save_id=attempt)
        blob = encode_metadata(DcpDocument(metadata, self.tree))
        doc = att.write_document(METADATA_NAME, blob)
        entries.append(make_entry(METADATA_NAME, doc.size, self.algorithm,
                                  [Chunk(0, doc.size, doc.digest)], None,
                                  store_checksums=doc.store_checksums))
        self._check_files(att.write_dir, [e for e in entries if not self.node_local
                                          or e.rank in (None, self.rank)])
        world = len(results)
        meta = {"tensor_count": sum(isinstance(v, TensorStorageMetadata)
                                    for v in metadata.state_dict_metadata.values()),
                **self.metadata}
        # v4 (references) for a save with a reuse memory, v2 otherwise.
        feats = SHARDED_FEATURES | ({REFERENCES} if self.memory is not None else set())
        manifest = Manifest(self.step, attempt, tuple(entries), now_text(), self.algorithm,
                            meta, feats, world_size=world, references=tuple(refs))

        # Before the marker (docs/protocol.md §9.4): every checkpoint a rank took references
        # from is still committed, and the save is within its lease (the commit's fence).
        info = att.commit(manifest, protectors=protectors if refs else (), lease=self._lease,
                          world_size=world, node_files=[
            e.path for e in entries if e.rank in (None, self.rank)] if self.node_local else None)
        if refs:
            log.info("committed sharded step %d at %s (%d ranks, %d files): %d of %d bytes "
                     "written, the rest referenced from %d files", self.step, self.storage.url,
                     world, len(entries), info.bytes_written, info.bytes, len(refs))
        else:
            log.info("committed sharded step %d at %s (%d ranks, %d files)", self.step,
                     self.storage.url, world, len(entries))
        return info

    def _check_files(self, write_dir: str, entries: list[ChunkedFileEntry]) -> None:
        """Every file of ``entries`` is visible to the coordinator with its size.  On shared
        storage that is every rank's file: it catches ranks writing to storage the coordinator
        does not share.  On node-local storage (`node_local`) only the coordinator's
        own files: each rank checked its own before reporting (`_write_file`)."""
        check_written(self.storage, write_dir, [(e.path, e.size, e.rank) for e in entries],
                      step=self.step,
                      who="the coordinator sees",
                      hint="" if self.node_local else "; every rank must write to storage the "
                      "coordinator shares (not a node-local disk)")


def sharded_index_of(storage: Storage, info: CheckpointInfo) -> ReuseIndex | None:
    """The reuse index of a committed sharded incremental checkpoint (format v4; others hold
    no item a v4 save may reference): every stored tensor item of its ``dcp.msgpack`` (read and
    checked as a load reads it) by item name, at the file that physically holds its bytes (a
    rank file of the checkpoint, or the source of one of its references), with that file's
    header chunk.  No rank file is read here: a save checks each chunk (and its file's header
    chunk) before it first reuses it (`stored_chunk_intact`)."""
    m = info.manifest
    if not {SHARDED, REFERENCES} <= features(m):
        return None
    manifest = sharded_manifest(info)
    refs = {r.path: r for r in references_of(m)}
    doc = read_document(storage, info)
    index = ReuseIndex((info.step, info.attempt))
    for item in doc.items:
        if item.offsets is None:
            continue  # a value document: never reused
        entry = manifest.chunked(item.path)
        chunk = entry.chunk_at(item.offset, item.length)
        if chunk is None or not entry.chunks:  # pragma: no cover - check_locations
            continue
        ref = refs.get(item.path)
        step, attempt, source = (info.step, info.attempt, item.path) if ref is None \
            else (ref.step, ref.attempt, ref.source)
        index.add(item.name, Stored(step, attempt, source, entry.size, entry.algorithm,
                                    entry.chunks[0], chunk, item.name, item.code, item.shape))
    return index


def _references(reused: list[tuple[MetadataIndex, ItemReport]],
                storage_data: dict[MetadataIndex, ItemLocation], algorithm: str
                ) -> tuple[list[Reference], set[tuple[int, str]]]:
    """The ranks' reused items as `references` (one per stored file, the same construction
    as a v3 save's), each item's location under its reference's name (``storage_data``, at
    its offset in that file), and the checkpoints the ranks took them from."""
    stored: list[tuple[MetadataIndex, Stored]] = []
    protectors: set[tuple[int, str]] = set()
    for index, rep in reused:
        assert rep.source is not None
        if rep.protector is None:
            raise UnsupportedValueError(f"{index.fqn!r}: a reused item names no protector")
        protectors.add(rep.protector)
        step, attempt, source = rep.source
        if rep.header is None:
            raise CorruptCheckpointError(f"{source} of step {step}: the ranks report it with "
                                         "different headers or sizes")
        stored.append((index, Stored(step, attempt, source, rep.file_size, algorithm,
                                     rep.header, Chunk(rep.offset, rep.length, rep.digest),
                                     index.fqn, "", ())))
    refs, through = references(stored)
    for index, st in stored:
        storage_data[index] = ItemLocation(through[index].path, st.chunk.offset,
                                           st.chunk.length)
    return refs, protectors


def _planned(item: WriteItem, value_bytes: int) -> PlannedItem:
    """The rank-file entry of a write item (a value's size, ``value_bytes``, is known only once
    its rank encoded it)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return PlannedItem(item_name(item.index.fqn, None), "U8", (value_bytes,), value_bytes)
    td = item.tensor_data
    code = tensor_code(td.properties.dtype, item.index.fqn)
    shape = tuple(map(int, td.chunk.sizes))
    return PlannedItem(item_name(item.index.fqn, td.chunk.offsets), code, shape,
                       math.prod(shape) * element_size(code))
