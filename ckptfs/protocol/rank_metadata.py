"""Format v5 (``rank-metadata``, docs/protocol.md §9.7), the I/O half: what a sharded save
writes instead of ``dcp.msgpack``, and what a loading rank reads of it.

Save (`PerRankSave`: ``metadata_layout="per-rank"``, or ``"auto"`` from 64 ranks,
`ckptfs.format.features.metadata_layout_for`): the coordinator checks the v5 manifest it will
commit (O(ranks)) and takes which rank stores each chunk from the global plan; every rank
writes its rank file as in v2 and then its own index document, and reports one row (sizes and
digests) instead of one result per item; the coordinator writes the tensor spec and the table
blocks (O(tensors) + O(ranks)) and commits the small manifest.

Load (`read_partial`): the manifest, the spec, the blocks holding the rows of the ranks whose
chunks overlap the regions the rank loads, and those ranks' index documents, each checked
against its digest before it is decoded; then a listing of those ranks' directories, before
any data byte is read.  The result is a view of the checkpoint (`CheckpointInfo` whose
manifest also holds the needed rank files with their chunk lists) and DCP's ``Metadata``
over exactly what this load needs.  `expand`: the same over every rank (a full load, a
verify).
"""

from __future__ import annotations

import dataclasses
import math
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from ckptfs.errors import (
    CorruptCheckpointError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format.entries import Chunk, ChunkedFileEntry, RankTable, chunk_list_digest, make_entry
from ckptfs.format.features import CHUNKED, METADATA_LAYOUTS, RANK_METADATA, SHARDED
from ckptfs.format.hashing import digest_bytes
from ckptfs.format.layout import CHECKPOINTS_DIR, rank_file_name
from ckptfs.format.limits import MAX_METADATA_BYTES, MAX_RANK_INDEX_BYTES
from ckptfs.format.manifest import Manifest, check_document_size
from ckptfs.format.rank_metadata import (
    DEFAULT_ROWS_PER_BLOCK,
    PER_RANK,
    SPEC_NAME,
    Cell,
    IndexItem,
    RankIndex,
    RankRow,
    Regions,
    Spec,
    TensorSpec,
    block_count,
    block_name,
    build_document,
    decode_block,
    decode_index,
    decode_own_index,
    decode_spec,
    encode_block,
    encode_index,
    encode_spec,
    index_name,
    layout_of,
    needed_cells,
    row_bytes,
)
from ckptfs.format.serialize import dtype_code
from ckptfs.format.sharded_metadata import DcpDocument
from ckptfs.format.versions import has_rank_metadata
from ckptfs.protocol.chunks import StoredChunks, check_chunk, read_chunks
from ckptfs.protocol.commit import Attempt, now_text, placeholder_digest
from ckptfs.protocol.group import Group, carried, decode_bytes, describe, encode_bytes
from ckptfs.protocol.listing import check_written
from ckptfs.protocol.resolve import CheckpointInfo, storage_url
from ckptfs.storage.base import LocalFiles, Storage, supports
from ckptfs.storage.local_files import open_regular, read_at

if TYPE_CHECKING:
    from ckptfs.protocol.global_plan import GlobalPlan
    from ckptfs.protocol.options import SaveOptions

#: The features of a per-rank save's manifest (format v5).
PER_RANK_FEATURES = frozenset({SHARDED, CHUNKED, RANK_METADATA})
Read = Callable[[ChunkedFileEntry, int, int], memoryview]


def layout_of_columns(size: tuple[int, ...], offsets: torch.Tensor, sizes: torch.Tensor,
                      ranks: torch.Tensor
                      ) -> tuple[tuple[int, ...] | None, tuple[int, int] | None,
                                 tuple[Cell, ...] | None, tuple[Cell, ...]]:
    """`layout_of` of a tensor's chunks given as columns (offsets and sizes m x d, their
    ranks), the same answer: a grid is recognised with tensor operations, without a `Cell` per
    chunk; the chunks without elements (and an explicit layout) are listed as `layout_of`
    lists them."""

    def cells(sel: torch.Tensor | None = None) -> list[Cell]:
        o, z, r = (offsets, sizes, ranks) if sel is None else \
            (offsets[sel], sizes[sel], ranks[sel])
        return [Cell(tuple(a), tuple(b), c)
                for a, b, c in zip(o.tolist(), z.tolist(), r.tolist(), strict=True)]

    n = len(ranks)
    if n <= 1 or not size or offsets.shape[1] != len(size) or 0 in size:
        return layout_of(size, cells())
    empty = (sizes == 0).any(dim=1)
    full = ~empty
    fo, fs, fr = offsets[full], sizes[full], ranks[full]
    if len(fr) == 0 or bool((fo < 0).any()):
        return layout_of(size, cells())
    zero = torch.nonzero((fo == 0).all(dim=1)).flatten()
    if len(zero) == 0:
        return layout_of(size, cells())
    grid = fs[int(zero[0])]
    dims = torch.tensor(size, dtype=torch.int64)
    counts = (dims + grid - 1) // grid
    total = math.prod(counts.tolist())
    if total != len(fr) or bool((fo % grid).any()) or \
            not bool((fs == torch.minimum(grid, dims - fo)).all()) or \
            bool((fo // grid >= counts).any()):
        return layout_of(size, cells())
    strides = torch.ones(len(size), dtype=torch.int64)
    for k in range(len(size) - 2, -1, -1):
        strides[k] = strides[k + 1] * counts[k + 1]
    linear = (fo // grid * strides).sum(dim=1)
    if int(torch.bincount(linear, minlength=total).max()) != 1:
        return layout_of(size, cells())
    by_index = torch.empty(total, dtype=torch.int64)
    by_index[linear] = fr
    base = int(by_index[0])
    stride = int(by_index[1]) - base if total > 1 else 0
    if (stride <= 0 and total > 1) or bool((by_index != base + torch.arange(total) * stride)
                                           .any()):
        return layout_of(size, cells())
    listed = tuple(sorted(cells(empty), key=lambda c: c.offsets)) if bool(empty.any()) else ()
    return tuple(grid.tolist()), (base, stride), None, listed


@dataclass(frozen=True)
class RankReport:
    """What a rank reports to the coordinator of a per-rank save (its one ``WriteResult``):
    its table row and how many items its file holds."""

    row: RankRow
    items: int


# ----------------------------------------------------------------------------------------------
# Save


class PerRankSave:
    """The v5 half of a sharded save (`ckptfs.protocol.sharded_io.ShardedWriter` with
    ``metadata_layout="per-rank"``)."""

    def __init__(self, storage: Storage, step: int, opts: SaveOptions,
                 metadata: Mapping[str, Any], tree: Any,
                 rows_per_block: int = DEFAULT_ROWS_PER_BLOCK) -> None:
        self.storage, self.step = storage, step
        self.algorithm, self.durable = opts.algorithm, opts.durable
        #: Each rank writes to its own node's storage (a two-tier store's local tier): the
        #: coordinator sees only its own files, each rank checked its own before reporting.
        self.node_local = opts.node_local
        self.metadata, self.tree, self.rows_per_block = dict(metadata), tree, rows_per_block

    # -- the coordinator, before any rank writes -------------------------------------------
    def placeholder(self, attempt: str, world: int) -> Manifest:
        """The manifest this save will commit (placeholder digests, the spec counted as
        empty), for `Attempt.check`: O(ranks), whatever the items."""
        return self.manifest(attempt, world, [RankRow.empty(r, self.algorithm)
                                              for r in range(world)],
                             {SPEC_NAME: b"", **self._blocks([], world, empty=True)},
                             placeholder=True)

    def _blocks(self, rows: list[RankRow], world: int, *, empty: bool = False
                ) -> dict[str, bytes]:
        out = {}
        for b in range(block_count(world, self.rows_per_block)):
            lo, hi = b * self.rows_per_block, min(world, (b + 1) * self.rows_per_block)
            part = [RankRow.empty(r, self.algorithm) for r in range(lo, hi)] if empty \
                else rows[lo:hi]
            out[block_name(b)] = encode_block(part, self.algorithm)
        return out

    def manifest(self, attempt: str, world: int, rows: list[RankRow],
                 docs: Mapping[str, Any], *, placeholder: bool = False,
                 tensor_count: int = 0) -> Manifest:
        hexd = placeholder_digest(self.algorithm).split(":", 1)[1]
        entries = []
        for path, doc in docs.items():
            if placeholder:
                data = doc
                entries.append(make_entry(path, len(data), self.algorithm,
                                          [Chunk(0, len(data), hexd)], None))
            else:
                entries.append(make_entry(path, doc.size, self.algorithm,
                                          [Chunk(0, doc.size, doc.digest)], None,
                                          store_checksums=doc.store_checksums))
        table = RankTable(self.rows_per_block, sum(r.has_file for r in rows),
                          sum(r.file_size + r.index_size for r in rows))
        return Manifest(self.step, attempt, tuple(entries), now_text(), self.algorithm,
                        {"tensor_count": tensor_count, **self.metadata}, PER_RANK_FEATURES,
                        world_size=world, rank_table=table)

    # -- every rank, after writing its file --------------------------------------------------
    def write_index(self, attempt: str, rank: int, items: list[Any], results: list[Any]
                    ) -> list[Any]:
        """Write this rank's index document from its write results (`ItemReport` s) and
        return its one report, as DCP's write result."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.storage import WriteResult

        if not results:
            return []
        by_index = {it.index: it for it in items}
        header: Chunk | None = None
        size = 0
        out: list[IndexItem] = []
        for wr in results:
            rep = wr.storage_data
            if getattr(rep, "source", None) is not None:  # pragma: no cover - refused earlier
                raise UnsupportedValueError("a per-rank save references nothing")
            if rep.header is not None:
                header, size = rep.header, rep.file_size
            it = by_index[wr.index]
            shape: tuple[int, ...]
            if it.tensor_data is None:
                code, shape = "U8", (rep.length,)
            else:
                code = dtype_code(it.tensor_data.properties.dtype)
                shape = tuple(int(s) for s in it.tensor_data.chunk.sizes)
            offsets = None if wr.index.offset is None else tuple(int(o) for o in wr.index.offset)
            out.append(IndexItem(wr.index.fqn, offsets, code, shape, rep.offset, rep.length,
                                 rep.digest))
        if header is None:  # pragma: no cover - the first item carries it
            raise CorruptCheckpointError(f"rank {rank}: no header chunk reported")
        out.sort(key=lambda i: i.offset)
        index = RankIndex(rank, size, self.algorithm, header, tuple(out))
        blob = encode_index(index)
        check_document_size(blob, MAX_RANK_INDEX_BYTES, f"the index of rank {rank}")
        att = Attempt.join(self.storage, self.step, attempt, algorithm=self.algorithm,
                           durable=self.durable)
        written = att.write_document(index_name(rank), blob)
        att.sync_file_dir(index_name(rank))  # its file's entry and its own: durable
        # This rank's own listing: its index is there with its size before it reports it (on
        # a node-local disk nobody else can see it; `_write_file` checked the rank file).
        check_written(self.storage, att.write_dir, [(index_name(rank), written.size, rank)],
                      step=self.step, who=f"rank {rank} sees",
                      under=index_name(rank).rsplit("/", 1)[0])
        row = RankRow(rank, True, size, chunk_list_digest(self.algorithm, index.chunks),
                      written.size, f"{self.algorithm}:{written.digest}")
        return [WriteResult(MetadataIndex(f"ckptfs-rank-{rank}"), 0,
                            RankReport(row, len(out)))]

    @staticmethod
    def spec_part(plan: GlobalPlan) -> tuple[list[int], dict[str, int], dict[str, TensorSpec]]:
        """What the spec says of the global plan: items per rank, each value's rank, each
        tensor's layout (a grid with its owners, or chunks), from the plan's columns: O(ranks
        + tensors) for the grids sharding makes.  Kept with the plan (the same for every save
        of its layout)."""
        part = plan.memo.get("spec")
        if part is None:
            tensors: dict[str, TensorSpec] = {}
            for fqn in plan.order:
                t = plan.tensors.get(fqn)
                if t is None:
                    continue
                p = t.props
                fmt = {torch.channels_last: "channels_last",
                       torch.preserve_format: "preserve_format"}.get(p.memory_format,
                                                                     "contiguous_format")
                grid, owners, chunks, empty = layout_of_columns(t.size, t.offsets, t.sizes,
                                                                t.ranks)
                tensors[fqn] = TensorSpec(str(p.dtype).removeprefix("torch."), t.size,
                                          bool(p.requires_grad), fmt, bool(p.pin_memory), grid,
                                          owners, chunks, empty)
            part = plan.memo["spec"] = (plan.items_per_rank(), dict(plan.values), tensors)
        return part

    # -- the coordinator, once every rank reported -------------------------------------------
    def finish(self, att: Attempt, plan: GlobalPlan, results: list[list[Any]],
               checkpoint_id: str, *, tree: Any = None, own_rank: int = 0) -> CheckpointInfo:
        """Write the spec of the global plan ``plan`` and the table blocks, check every file
        is there, commit.
        ``tree``: the state's skeleton merged over every rank (the planner's, once it saw
        every rank's plan; else the one given at construction).  ``own_rank``: the
        coordinator's rank (on node-local storage, the rank whose files it sees).  The spec
        is decoded by the reader's rules before it is written: one a reader would refuse is
        never committed."""

        world = len(results)
        rows = [RankRow.empty(r, self.algorithm) for r in range(world)]
        counts = [0] * world
        for rank, rank_results in enumerate(results):
            for wr in rank_results:
                rep = wr.storage_data
                if not isinstance(rep, RankReport) or rep.row.rank != rank:
                    raise UnsupportedValueError("a rank reported a write result ckptfs did not "
                                                "produce")
                rows[rank], counts[rank] = rep.row, rep.items
        owned, values, tensors = self.spec_part(plan)
        if owned != counts:
            bad = next(r for r in range(world) if owned[r] != counts[r])
            raise CorruptCheckpointError(f"rank {bad} wrote {counts[bad]} items, its plan "
                                         f"has {owned[bad]}")
        planner = None if plan.planner_data is None else \
            {k: tuple(v) for k, v in plan.planner_data.items()}
        spec = Spec(world, tensors, values, planner,
                    {"checkpoint_id": checkpoint_id, "save_id": att.name, "modules": []},
                    plan.metadata_version, self.tree if tree is None else tree, {})
        blob = encode_spec(spec)
        check_document_size(blob, MAX_METADATA_BYTES, SPEC_NAME)
        try:  # O(tensors): the spec a reader decodes, by its rules
            decode_spec(blob, world, where=SPEC_NAME)
        except CorruptCheckpointError as exc:
            raise UnsupportedValueError(f"{att.write_dir}: this checkpoint would not be "
                                        f"readable, so it is not committed: {exc}") from exc
        docs = {SPEC_NAME: att.write_document(SPEC_NAME, blob)}
        for path, data in self._blocks(rows, world).items():
            docs[path] = att.write_document(path, data)
        # On shared storage every rank's files, as the coordinator sees them (a rank writing
        # to storage the coordinator does not share is caught); on node-local storage its
        # own (each rank listed its own before reporting).
        own = [r for r in rows if r.has_file and (not self.node_local or r.rank == own_rank)]
        files: list[tuple[str, int, int | None]] = [
            (rank_file_name(r.rank), r.file_size, r.rank) for r in own]
        files += [(index_name(r.rank), r.index_size, r.rank) for r in own]
        check_written(self.storage, att.write_dir, files, step=self.step,
                      who="the coordinator sees", hint="" if self.node_local else
                      "; every rank must write to storage the coordinator shares (not a "
                      "node-local disk)")
        manifest = self.manifest(att.name, world, rows, docs, tensor_count=len(tensors))
        return att.commit(manifest, world_size=world)


def per_rank_save(storage: Storage, step: int, opts: SaveOptions,
                  metadata: Mapping[str, Any], tree: Any, layout: str | None
                  ) -> PerRankSave | None:
    """The v5 half of a sharded save for ``metadata_layout=layout`` as the save decided it
    (`metadata_layout_for`; None: format v2/v4), on shared or node-local storage alike.  Not
    yet with an incremental store (references: a feature set no format version names)."""
    if layout is None:
        return None
    if layout != PER_RANK:  # pragma: no cover - the store checked the name
        raise UnsupportedValueError(f"metadata_layout {layout!r:.40}: one of "
                                    f"{', '.join(map(repr, METADATA_LAYOUTS))}")
    if opts.incremental:
        raise UnsupportedValueError(
            f"metadata_layout={PER_RANK!r} is not supported yet with incremental=True")
    return PerRankSave(storage, step, opts, metadata, tree)


# ----------------------------------------------------------------------------------------------
# Load

#: Decoded documents of a view, kept with its manifest (a full load plans over what `expand`
#: decoded without reading it twice).
_DOCUMENTS: dict[int, DcpDocument] = {}


def _bounded(storage: Storage, info: CheckpointInfo, entry: ChunkedFileEntry, limit: int,
             read: Read | None) -> memoryview:
    where = storage_url(storage, f"{info.path}/{entry.path}")
    if entry.size > limit:
        raise UnsafeCheckpointError(f"{where}: declared size {entry.size} B exceeds {limit} B",
                                    step=info.step)
    return read(entry, 0, entry.size) if read is not None else \
        read_chunks(storage, info, entry, 0, entry.size)


def read_spec(storage: Storage, info: CheckpointInfo, read: Read | None = None) -> Spec:
    m = info.manifest
    data = _bounded(storage, info, m.chunked(SPEC_NAME), MAX_METADATA_BYTES, read)
    return decode_spec(data, m.world_size, where=storage_url(storage,
                                                             f"{info.path}/{SPEC_NAME}"))


def read_rows(storage: Storage, info: CheckpointInfo, ranks: set[int],
              read: Read | None = None) -> dict[int, RankRow]:
    """The table rows of ``ranks``: only the blocks holding them are read."""
    m = info.manifest
    assert m.rank_table is not None
    per = m.rank_table.rows_per_block
    out: dict[int, RankRow] = {}
    for b in sorted({r // per for r in ranks}):
        entry = m.chunked(block_name(b))
        first = b * per
        count = min(per, m.world_size - first)
        data = _bounded(storage, info, entry, count * row_bytes(m.hash_algorithm), read)
        rows = decode_block(data, m.hash_algorithm, first, count,
                            where=storage_url(storage, f"{info.path}/{entry.path}"))
        out.update((r.rank, r) for r in rows if r.rank in ranks)
    return out


def read_index(storage: Storage, info: CheckpointInfo, row: RankRow,
               read: Read | None = None) -> RankIndex:
    """Rank ``row.rank``'s index document, checked against its row (size, digest) before it
    is decoded; a rank the spec places items in must have a file."""
    where = storage_url(storage, f"{info.path}/{index_name(row.rank)}")
    if not row.has_file:
        block = block_name(row.rank // info.manifest.rank_table.rows_per_block) \
            if info.manifest.rank_table is not None else "the table"
        raise CorruptCheckpointError(f"{where}: the spec places items in the file of rank "
                                     f"{row.rank}, whose row in {block} has none",
                                     step=info.step)
    entry = make_entry(index_name(row.rank), row.index_size, row.index_digest.split(":")[0],
                       [Chunk(0, row.index_size, row.index_digest.split(":", 1)[1])],
                       row.rank)
    data = _bounded(storage, info, entry, MAX_RANK_INDEX_BYTES, read)
    return decode_index(data, row, where=where)


def _view(info: CheckpointInfo, rows: Mapping[int, RankRow],
          indexes: Mapping[int, RankIndex]) -> CheckpointInfo:
    m = info.manifest
    extra: list[ChunkedFileEntry] = []
    for rank, index in sorted(indexes.items()):
        row = rows[rank]
        algo, hexd = row.index_digest.split(":", 1)
        extra.append(make_entry(index_name(rank), row.index_size, algo,
                                [Chunk(0, row.index_size, hexd)], rank))
        entry = make_entry(index.file, index.size, index.algorithm, index.chunks, rank)
        assert entry.digest == row.file_digest  # decode_index checked it
        extra.append(entry)
    own = tuple(e for e in m.files if not isinstance(e, ChunkedFileEntry) or e.rank is None)
    return dataclasses.replace(info, manifest=dataclasses.replace(m, files=own + tuple(extra)))


def read_partial(storage: Storage, info: CheckpointInfo, regions: Regions | None, *,
                 read: Read | None = None, full: bool = False
                 ) -> tuple[CheckpointInfo, DcpDocument]:
    """What a rank loading ``regions`` (None: everything) needs of the v5 checkpoint
    ``info``: the view and the document (module docstring).  Typed errors only."""
    where = storage_url(storage, info.path)
    spec = read_spec(storage, info, read)
    cells, values = needed_cells(spec, None if full else regions)
    needed = {c.rank for cs in cells.values() for c in cs} | set(values.values())
    ranks = set(range(info.manifest.world_size)) if full else needed
    rows = read_rows(storage, info, ranks, read)
    if full:  # every rank with a file, and those the spec places items in (refused if none)
        ranks = {r for r, row in rows.items() if row.has_file} | needed
    indexes = {r: read_index(storage, info, rows[r], read) for r in sorted(ranks)}
    doc = build_document(spec, indexes, cells, values, where=where, full=full)
    view = _view(info, rows, indexes)
    _DOCUMENTS[id(view.manifest)] = doc
    weakref.finalize(view.manifest, _DOCUMENTS.pop, id(view.manifest), None)
    return view, doc


def expand(storage: Storage, info: CheckpointInfo) -> CheckpointInfo:
    """``info`` with every rank file and index document in its manifest (read, checked), for
    a full load, a verify, a check: every row, every index, each agreeing exactly with the
    spec.  ``info`` itself if it is not of format v5 or is expanded already."""
    if not has_rank_metadata(info.manifest) or id(info.manifest) in _DOCUMENTS:
        return info
    return read_partial(storage, info, None, full=True)[0]


def _read_own_index(storage: Storage, info: CheckpointInfo, rank: int) -> bytes | None:
    """The bytes of rank ``rank``'s index document as this node holds them, before any
    listing: at most one byte past `MAX_RANK_INDEX_BYTES` (the caller bounds it), None when
    it is not there.  On local disk a link is refused (`UnsafeCheckpointError`) and so is
    anything but a regular file (a FIFO would block the read): `open_regular`."""
    path = f"{info.path}/{index_name(rank)}"
    if not supports(storage, LocalFiles):
        try:
            with storage.open_read(path) as f:
                return bytes(f.read(MAX_RANK_INDEX_BYTES + 1))
        except FileNotFoundError:
            return None
    where = storage_url(storage, path)
    try:
        fd = open_regular(cast(LocalFiles, storage).local_path(path), where, path,
                          follow=False, step=info.step)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(f"{where}: cannot read: {exc}") from exc
    try:
        return read_at(fd, 0, min(os.fstat(fd).st_size, MAX_RANK_INDEX_BYTES) + 1)
    except OSError as exc:
        raise StorageError(f"{where}: cannot read: {exc}") from exc
    finally:
        os.close(fd)


def own_rank_files(storage: Storage, info: CheckpointInfo, rank: int
                   ) -> list[ChunkedFileEntry]:
    """Format v5 on the node of ``rank`` (which does not hold the table: the coordinator's
    node does): its index document (read, bounded, decoded by the index's rules) and the rank
    file it describes, as entries to list (`ckptfs.protocol.listing.problems`); none for a
    rank without a file.  The digests are checked where the table is read (a load, a copy)."""
    path = f"{info.path}/{index_name(rank)}"
    where = storage_url(storage, path)
    data = _read_own_index(storage, info, rank)
    if data is None:
        return []
    if len(data) > MAX_RANK_INDEX_BYTES:
        raise UnsafeCheckpointError(f"{where}: larger than {MAX_RANK_INDEX_BYTES} B",
                                    step=info.step, path=path)
    index = decode_own_index(data, rank, where=where)
    hexd = digest_bytes(index.algorithm, data).split(":", 1)[1]
    return [make_entry(index_name(rank), len(data), index.algorithm, [Chunk(0, len(data), hexd)],
                       rank),
            make_entry(index.file, index.size, index.algorithm, index.chunks, rank)]


def is_expanded(info: CheckpointInfo) -> bool:
    """Whether ``info`` is a view `read_partial` made (its rank files in its manifest)."""
    return id(info.manifest) in _DOCUMENTS


def expand_over(storage: Storage, info: CheckpointInfo, group: Group, rank: int, *,
                remote: tuple[Storage, CheckpointInfo] | None = None,
                missing: Callable[[str], Exception] | None = None) -> CheckpointInfo:
    """`expand` on every rank of ``group`` when the checkpoint's files are spread over the
    ranks' nodes (a two-tier store's local copy, docs/tiers.md "Sharded"): the coordinator
    reads the manifest's own documents (the spec, the table's blocks: its node's), each rank
    its own index document (``rank``: its global rank, the one its files are named by; an
    index missing there is looked for on every node in a second round), and the group
    gathers them; every rank then decodes the same bytes by `read_partial`'s rules
    (each index checked against its row before it is decoded) into the same view.  Each
    rank receives every rank's index: what a node copy's load and replica need (every rank's
    files by their rank), O(items) as ``dcp.msgpack`` is for format v2.  ``remote``: another
    copy of the same checkpoint (a two-tier store's remote copy, the same content), from
    which a document on no node (a lost node's) is read; else such a document is
    ``missing(message)`` (default `CorruptCheckpointError`).  An error is raised on every rank
    (the gather carries it), the coordinator's first."""
    if not has_rank_metadata(info.manifest) or id(info.manifest) in _DOCUMENTS:
        return info
    def gather(ranks: list[int], own_docs: bool) -> dict[str, bytes]:
        """Every rank's documents: the indexes of ``ranks`` its node holds, and with
        ``own_docs`` on the coordinator the manifest's own documents."""
        mine: dict[str, str] = {}
        error: dict[str, Any] | None = None
        try:
            if own_docs and group.coordinator:
                for entry in info.manifest.files:
                    if isinstance(entry, ChunkedFileEntry) and entry.rank is None:
                        doc = _bounded(storage, info, entry, MAX_METADATA_BYTES, None)
                        mine[entry.path] = encode_bytes(doc)
            for r in ranks:  # the row's size and digest decide; absent: the rows decide
                data = _read_own_index(storage, info, r)
                if data is not None:
                    mine[index_name(r)] = encode_bytes(data)
        except Exception as exc:
            error = describe(exc)
        gathered = group.all_gather([mine, error])
        for _, err in gathered:
            if err is not None:
                raise carried(err, CorruptCheckpointError)
        return {p: decode_bytes(d) for docs, _ in gathered for p, d in docs.items()}

    held = gather([rank], True)

    def read(entry: ChunkedFileEntry, start: int, length: int) -> memoryview:
        """The verified bytes of a whole document (its one chunk checked here)."""
        src = StoredChunks.of_entry(info, entry)
        where = storage_url(storage, src.location)
        data = held.get(entry.path)
        if data is None and remote is not None:
            return read_chunks(remote[0], remote[1], entry, start, length)
        if data is None:
            text = (f"{where}: on no rank's node (a lost node, or a rank of the save that is "
                    "not in this group)")
            raise src.corrupt(text) if missing is None else missing(text)
        if len(data) != entry.size:
            raise src.corrupt(f"{where}: {len(data)} B, the checkpoint declares {entry.size} B")
        view = memoryview(data)
        for chunk in entry.chunks:
            check_chunk(storage, src, chunk, view[chunk.offset:chunk.offset + chunk.length])
        return view[start:start + length]

    # An index not on its own rank's node (a job started again with its ranks on other
    # nodes): every node looks for the missing ones, found by the rows every rank decodes
    # alike (the same bytes), so every rank takes this second round or none does.
    rows = read_rows(storage, info, set(range(info.manifest.world_size)), read)
    absent = [r for r, row in sorted(rows.items())
              if row.has_file and index_name(r) not in held]
    if absent:
        held.update(gather(absent, False))
    return read_partial(storage, info, None, read=read, full=True)[0]


def document_of(storage: Storage, info: CheckpointInfo, read: Read | None = None
                ) -> DcpDocument:
    """The document of a v5 view made by `read_partial` / `expand` (else every rank's)."""
    doc = _DOCUMENTS.get(id(info.manifest))
    if doc is None:
        doc = read_partial(storage, info, None, read=read, full=True)[1]
    return doc


def check_rank_files(storage: Storage, view: CheckpointInfo) -> None:
    """The listing check of the rank files a view holds (§5), before any byte of them is
    read: each rank directory listed once, every file there with its size, none a link."""
    if storage.capabilities.real_directories:
        for parent, name in ((CHECKPOINTS_DIR, view.paths.dir_name),
                             (view.paths.dir, view.attempt)):
            for e in storage.list_dir(parent):
                if e.basename == name and e.is_link:
                    raise UnsafeCheckpointError(
                        f"{storage_url(storage, f'{parent}/{name}')} is a symbolic link; a "
                        "checkpoint may not contain links. Refusing to read it",
                        step=view.step, path=f"{parent}/{name}")
    prefix = view.path + "/"
    by_dir: dict[str, list[ChunkedFileEntry]] = {}
    for fe in view.manifest.files:
        if isinstance(fe, ChunkedFileEntry) and fe.rank is not None:
            by_dir.setdefault(fe.path.rsplit("/", 1)[0], []).append(fe)
    for d, entries in sorted(by_dir.items()):
        found = {}
        for e in storage.list_tree(prefix + d):
            if e.is_link:
                raise UnsafeCheckpointError(
                    f"{storage_url(storage, e.name)} is a symbolic link; a checkpoint may not "
                    "contain links (they can point outside it). Refusing to read it",
                    step=view.step, path=e.name)
            found[e.name.removeprefix(prefix)] = e.size
        for entry in entries:
            size = found.get(entry.path)
            if size != entry.size:
                what = "listed in the manifest but missing" if size is None else \
                    f"size differs from the manifest (declared {entry.size} B, found {size} B)"
                raise CorruptCheckpointError(f"{storage_url(storage, prefix + entry.path)}: "
                                             f"{what}", step=view.step,
                                             path=prefix + entry.path)


__all__ = [
    "PER_RANK",
    "PER_RANK_FEATURES",
    "PerRankSave",
    "RankReport",
    "Regions",
    "check_rank_files",
    "document_of",
    "expand",
    "expand_over",
    "is_expanded",
    "own_rank_files",
    "per_rank_save",
    "read_partial",
]
