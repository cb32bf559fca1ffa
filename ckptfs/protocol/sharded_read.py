"""Reading format v2: the DCP ``StorageReader`` (ranged reads, each chunk verified before the
planner sees it) and the full verification of a sharded checkpoint.

A rank reads exactly the stored chunks its read items overlap: one ranged read per run of
adjacent chunks (at most `MAX_RANGE` bytes), each chunk
hashed and compared with the manifest before any of its bytes are copied into a tensor or
decoded (`ckptfs.protocol.chunks`, the verified chunk reader).  A chunk a rank needs only
part of is still read whole: its digest covers all of it.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptfs.errors import (
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    InvalidStepError,
    ShardedLoadError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format.layout import StepPaths, check_step
from ckptfs.format.limits import MAX_METADATA_BYTES
from ckptfs.format.manifest import Manifest
from ckptfs.format.serialize import CODE_DTYPES, tensor_memoryview
from ckptfs.format.sharded import (
    METADATA_NAME,
    Chunk,
    ChunkedFileEntry,
)
from ckptfs.format.sharded_metadata import (
    DcpDocument,
    ItemLocation,
    StoredItem,
    check_locations,
    check_rank_header,
    decode_metadata,
    items_by_file,
)
from ckptfs.format.versions import has_rank_metadata, is_sharded
from ckptfs.protocol.balance import ReadPlan, plan_group_reads
from ckptfs.protocol.chunks import (
    StoredChunks,
    check_chunk,
    entry_location,
    read_chunks,
    read_chunks_into,
)
from ckptfs.protocol.group import Group, describe
from ckptfs.protocol.listing import check_listing
from ckptfs.protocol.load_options import dtype_mismatch
from ckptfs.protocol.options import default_threads
from ckptfs.protocol.resolve import CheckpointInfo, read_committed, resolve_latest, storage_url
from ckptfs.storage.base import Storage
from ckptfs.torch_compat import narrow_tensor_by_index

if TYPE_CHECKING:
    from ckptfs.format.rank_metadata import Regions

Key = tuple[str, int, int]  # (path, offset, length): one stored chunk

#: Largest ranged read: adjacent chunks a rank needs are fetched together up to this size.
MAX_RANGE = 64 * 1024 * 1024

log = logging.getLogger("ckptfs")


def sharded_manifest(info: CheckpointInfo) -> Manifest:
    """``info``'s manifest if it is of a sharded format (v2, v4), else
    `CheckpointNotFoundError`."""
    if not is_sharded(info.manifest):
        raise CheckpointNotFoundError(
            f"step {info.step} at {info.url} is a single-process (format "
            f"v{info.manifest.format_version}) checkpoint, not a "
            f"sharded one; load it with ckptfs.open(url).load({info.step})")
    return info.manifest


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a flat uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _stored_chunk(info: CheckpointInfo, entry: ChunkedFileEntry, key: Key) -> Chunk:
    chunk = entry.chunk_at(key[1], key[2])
    if chunk is None:  # pragma: no cover - check_locations: every item is one chunk
        raise CorruptCheckpointError(f"{info.url}: {entry.path} has no chunk of {key[2]} B at "
                                     f"{key[1]}", step=info.step)
    return chunk


def read_document(storage: Storage, info: CheckpointInfo, *, verify: bool = True,
                  read: Callable[[ChunkedFileEntry, int, int], memoryview] | None = None
                  ) -> DcpDocument:
    """Read, verify and decode ``dcp.msgpack`` (every rule of
    `ckptfs.format.sharded_metadata`: chunks cover each tensor exactly once, ...) and
    check that every stored item is exactly one chunk of a rank file in the manifest.
    ``read``: how its verified bytes are read (`ShardedReader.read_run`).  Format v5
    (``rank-metadata``): the document of its view, or of every rank (`document_of`)."""
    manifest = sharded_manifest(info)
    if has_rank_metadata(manifest):
        from ckptfs.protocol.rank_metadata import document_of  # format v5 only
        return document_of(storage, info, read)
    try:
        entry = manifest.chunked(METADATA_NAME)
    except KeyError:  # pragma: no cover - the manifest decoder requires it
        raise CorruptCheckpointError(f"{info.url}: manifest lists no {METADATA_NAME}",
                                     step=info.step) from None
    where = storage_url(storage, f"{info.path}/{METADATA_NAME}")
    if entry.size > MAX_METADATA_BYTES:
        raise UnsafeCheckpointError(f"{where}: declared size {entry.size} B exceeds "
                                    f"{MAX_METADATA_BYTES} B", step=info.step)
    data = read(entry, 0, entry.size) if read is not None else \
        read_chunks(storage, info, entry, 0, entry.size, verify=verify)
    doc = decode_metadata(data, where=where)
    check_locations(doc, manifest, where=where)
    return doc


#: A cooperative load's exchange round: at most this many bytes read plus received per rank.
ROUND_BYTES = 4 * MAX_RANGE
#: Chunks several ranks need are read by each of them when sharing would spare at most this
#: many bytes, a small part of the load (`plan_group_reads`): the exchange rounds cost more.
NEGLIGIBLE_SHARED = 4 * 1024 * 1024


class ShardedReader(StorageReader):
    """A DCP ``StorageReader`` for the committed step ``step`` of a ckptfs run (the newest
    committed one if ``None``, resolved by each rank and checked equal by the coordinator).

    How DCP drives it (``torch.distributed.checkpoint.load``), and what each step checks:

    1. every rank: ``read_metadata`` resolves the step and reads ``dcp.msgpack`` (its chunk
       digest, every rule of `ckptfs.format.sharded_metadata`, every item a chunk of a
       rank file).  It never raises: a ckptfs error is kept and raised by
       ``set_up_storage_reader``, inside DCP's planning step, so DCP gathers it from every
       rank (a ``read_metadata`` failure would become DCP's "metadata is None", with a
       traceback printed, and lose its class);
    2. every rank: ``prepare_local_plan`` (the step and attempt this rank resolved);
    3. the coordinator: ``prepare_global_plan`` checks that every rank resolved the same
       attempt, and lists it once (`check_listing`: links
       refused, every file present with its declared size) before any rank reads a data byte:
       a manifest declaring more than the storage holds is corrupt, never requested;
    4. every rank: ``read_data`` reads the chunks its items need (adjacent ones coalesced, one
       ranged read each, at most `MAX_RANGE`), plus the header chunk of each rank file it
       touches, checks every chunk's digest, then the header against ``dcp.msgpack``, and only
       then copies bytes into a tensor (same dtype only: never converted, every target's dtype
       checked before a byte is read) or decodes a value.  A chunk that is exactly a target's
       contiguous region (an FSDP shard loaded into the same sharding; every chunk of a full
       load) is read straight into it by the reading thread and checked there (`_direct`,
       `_fetch`); a load that fails zeroes those targets, so none is left holding bytes that
       were not verified.
    """

    #: Whether chunks several ranks need are read once and sent to the others (with `peers`);
    #: a reader whose own reads are already placed elsewhere (a node copy's) says False.
    cooperative = True
    #: Whether a collective load through this reader takes a checkpoint of the files layout
    #: (format v1, v3) too (`ckptfs.protocol.files_into`): a reader of one storage does; a
    #: reader placing its reads on tiers of its own refuses it as not sharded.
    reads_any_layout = True

    def __init__(self, storage: Storage, step: int | None = None, *, verify: bool = True,
                 threads: int | None = None, allow_rollback: bool = False,
                 regions: Regions | None = None) -> None:
        super().__init__()
        self.storage = storage
        self.step = None if step is None else check_step(step)
        self.verify = verify
        self.threads = threads or default_threads()
        self.allow_rollback = allow_rollback
        #: What this rank's load wants (names -> boxes, `ckptfs.protocol.rank_metadata`):
        #: of a format v5 checkpoint it reads only the metadata of the ranks holding those
        #: (None: everything).
        self.regions = regions
        self.info: CheckpointInfo | None = None
        self.document: DcpDocument | None = None
        #: Set once the attempt's listing was checked (by the coordinator, or by the caller).
        self.listing_checked = False
        self._deferred: BaseException | None = None
        self._shapes: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = {}
        self._by_file: dict[str, list[StoredItem]] = {}
        self._headers_ok: set[str] = set()
        #: The ranks loading together (set by the collective load), through which chunks
        #: several of them need are read once and shared (`cooperative`); None: read alone.
        self.peers: Group | None = None
        #: Bytes of data chunks this reader read from storage, and received from its peers.
        self.bytes_read = 0
        self.bytes_received = 0
        #: Told the number of each exchange of a cooperative load as this rank reaches it
        #: (the collective load's `Liveness.progress`: a survivor names who did not).
        self.on_progress: Callable[[int], None] | None = None
        self._marks = 0
        #: Chunks a peer sent whose bytes were not the stored ones (read from storage here).
        self.refused_from_peers: list[tuple[Key, int]] = []
        #: Set by the load rounds (`ckptfs.protocol.load_rounds`) for the next `read_data`:
        #: this rank's part of the cooperative plan the coordinator made (in a 1-tuple; None
        #: inside: no chunk is shared), instead of every rank's needs gathered everywhere.
        self.decided: tuple[ReadPlan | None] | None = None
        self._prepared: tuple[LoadPlan, dict[Key, list[ReadItem]], set[Key],
                              dict[Key, tuple[ReadItem, torch.Tensor]]] | None = None

    def _progress(self) -> None:
        self._marks += 1
        if self.on_progress is not None:
            self.on_progress(self._marks)

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
        """The committed checkpoint this reader reads (resolved once), of a sharded format."""
        info = self.resolve_any()
        sharded_manifest(info)
        return info

    def resolve_any(self) -> CheckpointInfo:
        """The committed checkpoint this reader's step names (the latest for None), whatever
        its format (a collective load of the files layout takes another strategy:
        `ckptfs.protocol.files_into`)."""
        if self.info is None:
            if self.step is None:
                info = resolve_latest(self.storage, allow_rollback=self.allow_rollback)
                if info is None:
                    raise CheckpointNotFoundError(
                        f"no committed checkpoint at {self.storage.url}")
            else:
                info = read_committed(self.storage, self.step)
            self.info = info
        return self.info

    def read_run(self, entry: ChunkedFileEntry, start: int, length: int) -> memoryview:
        """The bytes of a run of whole chunks of ``entry``, each checked against its digest
        (with `verify`).  The one place this reader reads data (the full load's direct
        reads aside): a subclass may take them elsewhere (a two-tier store's reader takes each
        file from the rank's own node, a peer or the remote copy: docs/tiers.md)."""
        return read_chunks(self.storage, self.resolve(), entry, start, length,
                           verify=self.verify)

    def defer(self, error: BaseException) -> None:
        """Report ``error`` through DCP's planning step (``set_up_storage_reader``), where DCP
        gathers it from every rank, instead of from ``read_metadata``."""
        self._deferred = error

    def load_document(self) -> DcpDocument:
        """Read and check ``dcp.msgpack`` (once); raises the typed ckptfs error."""
        if self.document is None:
            info = self.resolve()
            if has_rank_metadata(info.manifest) and not self.listing_checked:
                # Format v5: the spec, the rows and the index documents of the ranks holding
                # what this rank loads, then those ranks' files listed: the view is this
                # reader's checkpoint from now on (its manifest holds those rank files).
                from ckptfs.protocol.rank_metadata import check_rank_files, read_partial
                info, doc = read_partial(self.storage, info, self.regions, read=self.read_run)
                check_rank_files(self.storage, info)
                self.info, self.listing_checked = info, True
            else:
                doc = read_document(self.storage, info, verify=self.verify,
                                    read=self.read_run)
            md = doc.metadata
            if md.storage_meta is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = f"{info.step}:{info.attempt}"
            self._shapes = {(i.fqn, i.offsets): (CODE_DTYPES[i.code], i.shape)
                            for i in doc.items if i.offsets is not None}
            self._by_file = items_by_file(doc)
            self.document = doc
        return self.document

    # No **kwargs: DCP would then retry with rank= and fall back to per-rank metadata.
    def read_metadata(self) -> Metadata:
        if self._deferred is None:
            try:
                return self.load_document().metadata
            except CkptfsError as exc:  # raised on every rank by set_up_storage_reader
                self._deferred = exc
        return Metadata(state_dict_metadata={})

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self._deferred is not None:
            raise self._deferred
        if self.document is None or self.document.metadata is not metadata:
            # The caller passed metadata read elsewhere: resolve it ourselves.
            self.document = None
            self.load_document()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._deferred is not None:  # pragma: no cover - set_up_storage_reader raised it
            raise self._deferred
        info = self.resolve()
        return dataclasses.replace(plan, storage_data=(info.step, info.attempt))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        self.check_agreed({p.storage_data for p in plans})
        return plans

    def check_agreed(self, resolved: set[Any]) -> None:
        """The coordinator, before any rank reads a data byte: every rank resolved the same
        attempt (``resolved``: the (step, attempt) each rank resolved), and that attempt's
        listing is checked once (`check_listing`)."""
        if len(resolved) > 1:
            raise CheckpointNotFoundError(
                f"the ranks resolved different checkpoints at {self.storage.url} "
                f"({sorted(resolved)}): a newer step was committed while they resolved "
                "'latest'; load again, or pass the step explicitly")
        if not self.listing_checked:
            check_listing(self.storage, self.resolve())
            self.listing_checked = True

    def needs(self, plan: LoadPlan, planner: LoadPlanner) -> list[Key]:
        """The stored chunks ``plan``'s items read (and the header chunks to check), sorted;
        kept for `read_data` of the same plan.  Every target's dtype is checked here, before
        any byte is read (a refused load leaves the targets untouched)."""
        info = self.resolve()
        doc = self.load_document()
        groups, headers = self._wanted(plan, planner, info, doc)
        direct = self._direct(planner, groups, info)
        self._prepared = (plan, groups, headers, direct)
        return sorted(set(groups) | headers)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        info = self.resolve()
        peers = self.peers if self.cooperative else None
        decided = self.decided
        self.decided = None
        prepared = self._prepared
        self._prepared = None
        if prepared is not None and prepared[0] is plan:  # `needs` made it (the load rounds)
            _, groups, headers, direct = prepared
        else:
            doc = self.load_document()
            try:
                groups, headers = self._wanted(plan, planner, info, doc)
                # Every target's dtype checked before any byte is read (a refused load leaves
                # the targets untouched), and the chunks read straight into their target
                # (`_direct`).
                direct = self._direct(planner, groups, info)
            except Exception as exc:
                if peers is not None and decided is None:  # the peers wait for its needs
                    peers.all_gather({"error": describe(exc)})
                raise
        manifest = sharded_manifest(info)
        keys = sorted(set(groups) | headers)
        if decided is not None:  # the load rounds planned the sharing on the coordinator
            shared = decided[0] if peers is not None else None
        else:  # DCP drives the load (ckptfs.dcp.Reader): every rank plans it alike
            shared = self._share(peers, manifest, keys) if peers is not None else None
        dests = {k: t for k, (_, t) in direct.items()}
        try:
            if shared is not None:
                assert peers is not None
                self._read_shared(peers, shared, planner, manifest, keys, groups, headers,
                                  direct, dests)
            else:
                for views in self._fetch(manifest, keys, dests):
                    for key, view in views:
                        self._use(planner, manifest, groups, headers, key, view,
                                  direct.get(key) if key in dests else None)
        except BaseException:
            # The chunks read straight into a target (`_direct`) are checked there: a failed
            # load (a digest, a read, a header that disagrees with dcp.msgpack) leaves none
            # of them holding bytes that were not all verified and used.  Every read in flight
            # has ended: the reading pool is joined as the error leaves `_fetch`.
            for t in dests.values():
                _flat_bytes(t).zero_()
            raise
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _wanted(self, plan: LoadPlan, planner: LoadPlanner, info: CheckpointInfo,
                doc: DcpDocument) -> tuple[dict[Key, list[ReadItem]], set[Key]]:
        """The plan's read items by the stored chunk each reads, and the header chunk of every
        rank file read from that is not checked yet (usually adjacent to its first item, so
        fetched in the same request): checked against dcp.msgpack before any item of it is
        used (keys are sorted, so a file's header comes first)."""
        if any(r.type == LoadItemType.BYTE_IO for r in plan.items):
            fn = getattr(type(planner), "load_bytes", None)
            if fn in (DefaultLoadPlanner.load_bytes, LoadPlanner.load_bytes):
                raise UnsupportedValueError(
                    f"the load planner {type(planner).__name__} would unpickle stored values "
                    "(torch.load(weights_only=False)); ckptfs never unpickles: pass "
                    "planner=ckptfs.dcp.LoadPlanner()")
        groups: dict[Key, list[ReadItem]] = {}
        storage_data: dict[MetadataIndex, ItemLocation] = doc.metadata.storage_data or {}
        for req in plan.items:
            loc = storage_data.get(req.storage_index)
            if loc is None:
                raise CorruptCheckpointError(
                    f"{info.url}: no stored location for item {req.storage_index.fqn!r}",
                    step=info.step)
            groups.setdefault((loc.path, loc.offset, loc.length), []).append(req)
        manifest = sharded_manifest(info)
        headers = {(p, 0, manifest.chunked(p).chunks[0].length)
                   for p in {k[0] for k in groups} - self._headers_ok}
        return groups, headers

    def _use(self, planner: LoadPlanner, manifest: Manifest, groups: dict[Key, list[ReadItem]],
             headers: set[Key], key: Key, view: memoryview,
             placed: tuple[ReadItem, torch.Tensor] | None = None) -> None:
        """Use the verified chunk ``key``: a header is checked against dcp.msgpack, an item's
        bytes copied into its tensor or decoded.  ``placed``: the chunk was read straight into
        this item's target (``view`` is the target's memory), and verified there."""
        info = self.resolve()
        if placed is not None:
            planner.commit_tensor(*placed)
        elif key in headers:
            entry = manifest.chunked(key[0])
            check_rank_header(view, entry, self._by_file.get(key[0], []),
                              where=storage_url(self.storage, entry_location(info, entry)))
            self._headers_ok.add(key[0])
        else:
            self._apply(planner, groups[key], view, info)

    # -- a cooperative load: each chunk read once, by one of the ranks needing it -------------

    def _share(self, peers: Group, manifest: Manifest, keys: list[Key]) -> ReadPlan | None:
        """Every rank's needs (one exchange of documents), and the plan sharing the chunks
        several ranks need (`plan_group_reads`), or None: no chunk is shared, or a rank failed
        before it could say what it needs (it raises its own error; the others read alone)."""
        self._progress()
        docs = peers.all_gather({"keys": keys_doc(keys)})
        if any("error" in d for d in docs):
            return None
        return shared_reads([([r], d["keys"]) for r, d in enumerate(docs)], manifest,
                            peers.ranks)

    def _read_shared(self, peers: Group, shared: ReadPlan, planner: LoadPlanner,
                     manifest: Manifest, keys: list[Key], groups: dict[Key, list[ReadItem]],
                     headers: set[Key], direct: dict[Key, tuple[ReadItem, torch.Tensor]],
                     dests: dict[Key, torch.Tensor]) -> None:
        """Run ``shared`` (every rank, the same rounds): in each, read this rank's chunks
        (verified), then exchange them, each received chunk verified again before it is used.
        Every rank reaches every exchange: each step's outcome is exchanged (`_settle`), and
        once a rank failed, the rounds stop on every rank: it raises its error, and every other
        rank reads what it still needs itself.  So the ranks that fail are the ones that need
        the bad bytes, each with its own typed error naming the file, as without
        cooperation (a chunk corrupted on storage fails every rank needing it; a read that
        failed on one rank only, or a peer that sent other bytes, fails no other rank)."""
        me = peers.rank
        done: set[Key] = set()

        def use(key: Key, view: memoryview, read_here: bool = True) -> None:
            # A chunk read here with a destination is in its target already; one received
            # from a peer is copied there.
            placed = direct.get(key) if read_here and key in dests else None
            self._use(planner, manifest, groups, headers, key, view, placed)
            done.add(key)

        stopped = False
        for transfers in shared.rounds:
            mine: dict[Key, memoryview] = {}
            error: Exception | None = None
            try:
                for views in self._fetch(manifest, [t.key for t in transfers
                                                    if t.reader == me], dests):
                    for key, view in views:
                        mine[key] = view
                        use(key, view)
            except Exception as exc:
                error = exc
            self._progress()
            if self._settle(peers, error):
                stopped = True
                break
            send: list[list[memoryview]] = [[] for _ in range(peers.world_size)]
            expect: list[list[Key]] = [[] for _ in range(peers.world_size)]
            for t in transfers:
                if t.reader == me:
                    for r in t.needers:
                        if r != me:
                            send[r].append(mine[t.key])
                elif me in t.needers:
                    expect[t.reader].append(t.key)
            self._progress()
            got = peers.exchange_bytes(send, [sum(k[2] for k in ks) for ks in expect])
            try:
                again: list[Key] = []
                for src, ks in enumerate(expect):
                    pos = 0
                    for key in ks:
                        view = got[src][pos:pos + key[2]]
                        pos += key[2]
                        if not self._received_ok(manifest, key, view, peers.ranks[src]):
                            again.append(key)
                            continue
                        self.bytes_received += key[2]
                        use(key, view, read_here=False)
                for views in self._fetch(manifest, again, dests):  # the stored bytes, verified
                    for key, view in views:
                        use(key, view)
            except Exception as exc:
                error = exc
            self._progress()
            if self._settle(peers, error):
                stopped = True
                break
        rest = [k for k in keys if k not in done] if stopped else shared.alone[me]
        for views in self._fetch(manifest, rest, dests):
            for key, view in views:
                use(key, view)

    def _received_ok(self, manifest: Manifest, key: Key, view: memoryview, src: int) -> bool:
        """Whether a chunk another rank sent matches its digest (with `verify`), checked like
        one read here: a faulty peer cannot hand this rank bytes the manifest does not bind.
        Bytes that do not match are the peer's fault (its memory, or the network), not the
        stored file's: logged naming the peer, and this rank reads the chunk from storage
        itself (a stored chunk that is corrupt too fails that read, naming the file)."""
        if not self.verify:
            return True
        info = self.resolve()
        entry = manifest.chunked(key[0])
        try:
            check_chunk(self.storage, StoredChunks.of_entry(info, entry),
                        _stored_chunk(info, entry, key), view)
        except CorruptCheckpointError:
            log.warning("ckptfs: %d B at %d of %s sent by rank %d do not match their digest in "
                        "the manifest: that rank's memory or the network altered them (the "
                        "stored file is not at fault); read from storage here instead",
                        key[2], key[1], storage_url(self.storage, entry_location(info, entry)),
                        src)
            self.refused_from_peers.append((key, src))
            return False
        return True

    @staticmethod
    def _settle(peers: Group, error: Exception | None) -> bool:
        """Every rank's outcome of a step (one exchange of documents): ``error`` is raised
        here once every rank knows of it; else whether another rank failed."""
        docs = peers.all_gather(None if error is None else describe(error))
        if error is not None:
            raise error
        return any(d is not None for d in docs)

    def _direct(self, planner: LoadPlanner, groups: dict[Key, list[ReadItem]],
                info: CheckpointInfo) -> dict[Key, tuple[ReadItem, torch.Tensor]]:
        """Check every tensor item's target dtype (`dtype_mismatch` before anything is read),
        and return the stored chunks placed into their target by the reading threads
        (`_fetch`): a tensor chunk read whole by one item into a contiguous CPU region of the
        stored dtype and shape (an FSDP shard loaded into the same sharding: no buffer
        allocated per read, no copy on the loading thread).  Anything else (a slice of a
        chunk, a resharded load) takes the copying path.  Only when this reader reads from its
        own storage (a subclass placing its reads elsewhere, `read_run`, reads into
        buffers)."""
        into_targets = type(self).read_run is ShardedReader.read_run
        out: dict[Key, tuple[ReadItem, torch.Tensor]] = {}
        for key, reqs in groups.items():
            for req in reqs:
                if req.type != LoadItemType.TENSOR:
                    continue
                found = self._shapes.get((req.storage_index.fqn,
                                          tuple(req.storage_index.offset or ())))
                if found is None:
                    continue  # `_apply` names the missing chunk
                target = planner.resolve_tensor(req).detach()
                if target.dtype != found[0]:
                    raise dtype_mismatch(req.dest_index.fqn, found[0], target.dtype, info.url)
                if (into_targets and len(reqs) == 1 and not any(req.storage_offsets)
                        and tuple(req.lengths) == found[1]
                        and tuple(target.shape) == found[1]
                        and target.device.type == "cpu" and target.is_contiguous()
                        and target.numel() * target.element_size() == key[2]):
                    out[key] = (req, target)
        return out

    def _fetch(self, manifest: Manifest, keys: list[Key],
               dests: dict[Key, torch.Tensor]) -> Iterator[list[tuple[Key, memoryview]]]:
        """Coalesce adjacent chunks into ranged reads, run them on a pool (at most ``threads``
        in flight beyond the one being applied), yield each verified run's chunk views.  A
        chunk with a target in ``dests`` (`_direct`: a full load's own tensors, or the
        caller's tensors of ``load(into=)`` whose region is exactly that chunk) is read
        straight into the target's memory and verified there: one pass over the bytes, no
        buffer and no second copy (a failed load zeroes those targets: `read_data`).  The
        other chunks of a run are read into buffers of their own."""
        runs: list[list[Key]] = []
        for key in keys:
            last = runs[-1][-1] if runs else None
            if (last is not None and last[0] == key[0] and last[1] + last[2] == key[1]
                    and key[1] + key[2] - runs[-1][0][1] <= MAX_RANGE):
                runs[-1].append(key)
            else:
                runs.append([key])
        info = self.resolve()

        def fetch(run: list[Key]) -> list[tuple[Key, memoryview]]:
            path, start = run[0][0], run[0][1]
            entry = manifest.chunked(path)
            if any(k in dests for k in run):
                into = [_flat_bytes(dests[k]) if k in dests
                        else torch.empty(k[2], dtype=torch.uint8) for k in run]
                bufs = [(_stored_chunk(info, entry, k), tensor_memoryview(b))
                        for k, b in zip(run, into, strict=True)]
                read_chunks_into(self.storage, info, entry, start, bufs, verify=self.verify)
                return [(k, tensor_memoryview(dests[k]) if k in dests else v)
                        for k, (_, v) in zip(run, bufs, strict=True)]
            length = run[-1][1] + run[-1][2] - start
            view = self.read_run(entry, start, length)
            return [(k, view[k[1] - start:k[1] - start + k[2]]) for k in run]

        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckptfs-read") as pool:
            window: collections.deque[CFuture[Any]] = collections.deque()
            todo = iter(runs)
            for run in todo:
                window.append(pool.submit(fetch, run))
                if len(window) > self.threads:
                    yield self._count(window.popleft().result())
            while window:
                yield self._count(window.popleft().result())

    def _count(self, views: list[tuple[Key, memoryview]]) -> list[tuple[Key, memoryview]]:
        self.bytes_read += sum(k[2] for k, _ in views)
        return views

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
            target = planner.resolve_tensor(req).detach()
            if target.dtype != dtype:
                raise dtype_mismatch(req.dest_index.fqn, dtype, target.dtype, info.url)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffer: only read
                stored = (torch.frombuffer(view, dtype=dtype) if len(view)
                          else torch.empty(0, dtype=dtype)).reshape(shape)
            src = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
            if target.size() != src.size():
                raise CorruptCheckpointError(
                    f"{info.url}: item {key[0]!r}: stored slice {list(src.size())} does not fit "
                    f"the target {list(target.size())}", step=info.step)
            target.copy_(src)
            planner.commit_tensor(req, target)


def check_checkpoint_id(expected: str, checkpoint_id: str | os.PathLike[str] | None) -> None:
    """DCP passes ``checkpoint_id`` to ``reset``; ckptfs names checkpoints by URL and step."""
    if checkpoint_id is not None and str(checkpoint_id) != expected:
        raise InvalidStepError(
            f"checkpoint_id {str(checkpoint_id)!r} is not used by ckptfs: the run URL and the "
            "step are given to ckptfs.dcp.Writer(url, step) / Reader(url, step)")


def keys_doc(keys: list[Key]) -> dict[str, list[int]]:
    """The chunks a rank needs, as it sends them: by path, its offsets and lengths flat."""
    mine: dict[str, list[int]] = {}
    for path, off, length in keys:
        mine.setdefault(path, []).extend((off, length))
    return mine


def shared_reads(groups: list[tuple[list[int], Any]], manifest: Manifest, ranks: list[int]
                 ) -> ReadPlan | None:
    """The cooperative plan (`plan_group_reads`) for every rank's needs, or None: no chunk is
    shared.  ``groups``: (group ranks, their `keys_doc`), each rank in one group (ranks with
    the same needs may share a group); ``ranks``: the global ranks, to name one.  The work
    grows with the distinct lists of chunks of a file (`needs_by_file`), not with every
    rank's.  Each key of a file several ranks need is checked to be a chunk of ``manifest``
    (`ShardedLoadError` naming the rank): the plan is made of those only (a rank reads the
    files only it needs after the rounds, from its own view)."""
    by_file, alone_bytes = needs_by_file(groups, manifest, ranks)
    needs = [(sorted(members), [(path, off, length) for off, length in
                                zip(flat[::2], flat[1::2], strict=True)])
             for (path, flat), members in by_file.items()]
    return plan_group_reads(needs, len(ranks), max_piece=MAX_RANGE, round_bytes=ROUND_BYTES,
                            negligible=NEGLIGIBLE_SHARED, alone_bytes=alone_bytes)


def needs_by_file(groups: list[tuple[list[int], Any]], manifest: Manifest, ranks: list[int]
                  ) -> tuple[dict[tuple[str, tuple[int, ...]], list[int]], list[int]]:
    """The ranks needing each distinct list of chunks of a file that several ranks need
    (``(path, (offset, length, ...))`` -> ranks), each list checked once; and per rank, the
    bytes it needs of files no other rank needs a chunk of (`shared_reads`)."""
    # A file only one rank needs chunks of (its own rank file, in an FSDP load) is read by
    # that rank alone after the rounds: only its bytes are counted (`plan_group_reads`).
    touching: dict[str, int] = {}
    for members, d in groups:
        if isinstance(d, dict):
            for path in d:
                touching[path] = touching.get(path, 0) + len(members)
    alone_bytes = [0] * len(ranks)
    chunks: dict[str, set[tuple[int, int]]] = {}  # each path's chunks (offset, length)
    by_file: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    # Format v5: each rank's view holds only the rank files it needs, so no rank can check
    # another's keys alike (the plan must be the same everywhere).  Unchecked keys are
    # harmless: a rank reads or receives only keys it needs itself (from its own view),
    # and checks every received chunk against its own manifest.
    partial = has_rank_metadata(manifest)
    for members, d in groups:
        who = ranks[members[0]]
        if not isinstance(d, dict):
            raise ShardedLoadError(f"rank {who} sent a malformed list of the chunks it needs")
        for path, flat in d.items():
            if not isinstance(flat, list) or len(flat) % 2:
                raise ShardedLoadError(f"rank {who} sent a malformed list "
                                       "of the chunks it needs")
            if touching[path] == 1:  # only counted: a wrong count misplaces no byte
                alone_bytes[members[0]] += sum(v for v in flat[1::2] if type(v) is int)
                continue
            if not set(map(type, flat)) <= {int}:
                raise ShardedLoadError(f"rank {who} sent a malformed list "
                                       "of the chunks it needs")
            sig = (path, tuple(flat))
            held = by_file.get(sig)
            if held is not None:
                held.extend(members)
                continue
            if not partial:
                if path not in chunks:
                    try:
                        chunks[path] = {(c.offset, c.length)
                                        for c in manifest.chunked(path).chunks}
                    except KeyError:
                        chunks[path] = set()
                bad = set(zip(flat[::2], flat[1::2], strict=True)) - chunks[path]
                if bad:
                    off, length = min(bad)
                    raise ShardedLoadError(
                        f"rank {who} needs {length} B at {off} of {path}, "
                        "which is no chunk of the checkpoint's manifest")
            by_file[sig] = list(members)
    return by_file, alone_bytes
