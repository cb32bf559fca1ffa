"""The local copy of a sharded step on node-local storage: spread over the nodes (docs/tiers.md
"Sharded").

A two-tier store opened on every rank of a job has each node's own disk as its local tier.  A
sharded save there leaves each step's local copy spread over the nodes: the coordinator's
node holds the marker, the manifest, ``dcp.msgpack`` and its rank file; each other node its
own rank file, in the same attempt directory.  This module is what reads, checks and removes
such a copy; which copy a load uses is the one walk's decision
(`ckptfs.protocol.resolve.walk_tiers` over the group: the coordinator lists both tiers and
decides, the stand-in rule included), and `load_node_copy` is every rank's part of it, the
walk's ``use`` for a local candidate.

Loading the local copy of a step (`load_node_copy`, every rank, over the group):

1. the coordinator reads ``dcp.msgpack`` (every chunk's digest checked) and looks for the
   remote tier's committed copy of the same step (the same content) and broadcasts both;
2. every rank gives its node's files their committed path (`settle_node_attempt`), lists on
   its own node the files of the checkpoint (its own rank files, and for format v4 the files
   its references name) and the ranks gather what each node holds with its declared size;
3. DCP's load runs with a `NodeReader`: in its read step each rank gathers the stored chunks
   it needs that its node does not hold; each is served by the lowest rank whose node holds
   the file (read and checked against its digest there, sent through the group: meant for the
   small items stored once, such as the optimizer's step counters), else read from the remote
   copy (a replaced node), else the local copy cannot serve the load:
   `LocalCopyUnavailable` on every rank, which the walk takes as "this copy cannot be
   used" (a lost node's files are not corruption): the remote copy stands in if it is the same
   checkpoint, else the walk goes on to the next older step (logged).

Every failure is raised on every rank: the facts and the holdings travel with the errors met
while gathering them (`describe`/`carried`), and DCP gathers the errors of its own steps.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ckptfs.errors import (
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    ShardedLoadError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptfs.format.content import same_content
from ckptfs.format.incremental import references_of
from ckptfs.format.layout import StepPaths
from ckptfs.format.manifest import Manifest
from ckptfs.format.sharded import METADATA_NAME, ChunkedFileEntry
from ckptfs.format.versions import has_rank_metadata
from ckptfs.protocol.chunks import entry_location, read_chunks
from ckptfs.protocol.copy import own_files, settle_node_attempt
from ckptfs.protocol.copy_io import committed_at
from ckptfs.protocol.formats import VerifyReport
from ckptfs.protocol.group import Group, carried, decode_bytes, describe, encode_bytes
from ckptfs.protocol.listing import list_attempt, problems
from ckptfs.protocol.rank_metadata import expand_over, own_rank_files
from ckptfs.protocol.resolve import CheckpointInfo, list_step_dirs
from ckptfs.protocol.sharded import load_into
from ckptfs.protocol.sharded_read import ShardedReader
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")

Key = tuple[str, int, int]


class LocalCopyUnavailable(CheckpointNotFoundError):
    """The local copy of a sharded step cannot serve a load: a file some rank needs is on no
    node (a lost node's) and the remote tier holds no copy of the step."""


def _locations(info: CheckpointInfo) -> dict[str, int]:
    """Every file of ``info`` (from the run root) with its declared size: its own files and,
    for format v4, the files its references name."""
    out = {f"{info.path}/{e.path}": e.size for e in info.manifest.files}
    for ref in references_of(info.manifest):
        out[ref.location] = ref.size
    return out


def node_holdings(storage: Storage, info: CheckpointInfo) -> set[str]:
    """The files of ``info`` this node holds with their declared size (one listing per attempt
    directory involved; links are never counted)."""
    wanted = _locations(info)
    found: dict[str, int] = {}
    for d in sorted({loc.rsplit("/", 1)[0].split("/rank-")[0] for loc in wanted}):
        try:
            found.update({e.name: e.size for e in storage.list_tree(d) if not e.is_link})
        except FileNotFoundError:
            continue
    held = {loc for loc, size in wanted.items() if found.get(loc) == size}
    resized = [loc for loc, size in wanted.items() if loc in found and found[loc] != size]
    if resized:
        log.warning("%s: %s differ in size from the manifest of step %d: read from another "
                    "copy", storage.url, ", ".join(resized), info.step)
    return held


def _key(doc: Any) -> Key:
    path, offset, length = doc
    return str(path), int(offset), int(length)


class NodeReader(ShardedReader):
    """The reader of a rank loading the local copy of a sharded step: each file from its own
    node when it holds it, else a peer's node (through the group), else the remote copy
    (module docstring)."""

    reads_any_layout = False  # a node copy is of a sharded checkpoint

    #: Each file is read where it lies (this node, a peer's, the remote copy): never shared
    #: out as a cooperative load's chunks.
    cooperative = False

    def __init__(self, local: Storage, info: CheckpointInfo, document: bytes,
                 holdings: list[set[str]], remote: Storage, remote_info: CheckpointInfo | None,
                 group: Group, *, verify: bool = True, threads: int | None = None) -> None:
        super().__init__(local, info.step, verify=verify, threads=threads)
        self.info = info
        self.listing_checked = True  # each node listed its own files (node_holdings)
        self.remote = remote
        self.remote_info = remote_info
        self.group = group
        self.holdings = holdings
        self.me = group.rank
        self._document = document
        self._peer: dict[str, dict[int, bytes]] = {}

    def _manifest(self) -> Manifest:
        return self.resolve().manifest

    def _loc(self, path: str) -> str:
        return entry_location(self.resolve(), self._manifest().chunked(path))

    def read_run(self, entry: ChunkedFileEntry, start: int, length: int) -> memoryview:
        info = self.resolve()
        loc = entry_location(info, entry)
        if entry.path == METADATA_NAME and loc not in self.holdings[self.me]:
            return memoryview(self._document)[start:start + length]  # checked by the sender
        if loc in self.holdings[self.me]:
            return read_chunks(self.storage, info, entry, start, length, verify=self.verify)
        served = self._peer.get(loc)
        if served is not None and start in served:
            out, pos = bytearray(), start
            while pos < start + length:  # a run of adjacent chunks, each sent by its holder
                piece = served.get(pos, b"")
                if not piece:
                    break
                out += piece
                pos += len(piece)
            if len(out) == length:
                return memoryview(bytes(out))
        if self.remote_info is not None:
            rentry = entry  # format v5: rank files are not in its manifest (same content)
            if not has_rank_metadata(self.remote_info.manifest):
                rentry = self.remote_info.manifest.chunked(entry.path)  # v4: its references
            return read_chunks(self.remote, self.remote_info, rentry, start, length,
                               verify=self.verify)
        raise LocalCopyUnavailable(f"{info.url}: {entry.path} is on no node and not at "
                                   f"{self.remote.url}")

    def _needed(self, plan: LoadPlan) -> list[Key]:
        """The stored chunks this rank's items read that its node does not hold (and each rank
        file's header chunk)."""
        doc = self.load_document()
        manifest = self._manifest()
        storage_data = doc.metadata.storage_data or {}
        keys: set[Key] = set()
        for req in plan.items:
            loc = storage_data.get(req.storage_index)
            if loc is not None:
                keys.add((loc.path, loc.offset, loc.length))
        for path in {k[0] for k in keys}:
            keys.add((path, 0, manifest.chunked(path).chunks[0].length))
        return sorted(k for k in keys if self._loc(k[0]) not in self.holdings[self.me])

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Every rank reaches both gathers (an error is carried, raised after them), so a rank
        # failing here never leaves the others waiting.
        info = self.resolve()
        error: dict[str, Any] | None = None
        needs: list[Key] = []
        try:
            needs = self._needed(plan)
        except Exception as exc:
            error = describe(exc)
        wanted = [([_key(k) for k in keys], e) for keys, e in
                  self.group.all_gather([[list(k) for k in needs], error])]
        missing: list[str] = []
        serve: list[tuple[int, Key]] = []
        for r, (keys, _) in enumerate(wanted):
            for key in keys:
                loc = self._loc(key[0])
                holder = next((h for h, held in enumerate(self.holdings) if loc in held), None)
                if holder is None:
                    if self.remote_info is None:
                        missing.append(f"rank {r}: {key[0]}")
                elif holder == self.me:
                    serve.append((r, key))
        sent: dict[tuple[int, Key], bytes] = {}
        mine: dict[str, Any] | None = None
        if not missing and not any(e for _, e in wanted):
            try:
                manifest = self._manifest()
                for r, key in serve:
                    sent[(r, key)] = bytes(read_chunks(self.storage, info,
                                                       manifest.chunked(key[0]), key[1], key[2],
                                                       verify=self.verify))
            except Exception as exc:
                mine, sent = describe(exc), {}
        served = [({(int(r), _key(k)): decode_bytes(data) for r, k, data in got}, e)
                  for got, e in self.group.all_gather(
                      [[[r, list(k), encode_bytes(data)] for (r, k), data in sent.items()],
                       mine])]
        for _, e in wanted:
            if e is not None:
                raise carried(e, ShardedLoadError)
        if missing:
            raise LocalCopyUnavailable(
                f"the local copy of step {info.step} cannot serve this load: no node holds "
                f"what {'; '.join(sorted(set(missing))[:8])} need(s), and the remote tier "
                f"{self.remote.url} holds no copy of the step")
        for _, e in served:
            if e is not None:
                raise carried(e, ShardedLoadError)
        for got, _ in served:
            for (r, (path, off, _length)), data in got.items():
                if r == self.me:
                    slot = self._peer.setdefault(self._loc(path), {})
                    if len(data) >= len(slot.get(off, b"")):  # a 0-byte chunk shares offsets
                        slot[off] = data
        return super().read_data(plan, planner)


def _facts(local: Storage, remote: Storage, info: CheckpointInfo) -> list[Any]:
    """The coordinator's part of loading the local copy ``info``: the verified
    ``dcp.msgpack`` bytes and the remote's copy of the step when it holds the same content;
    on a failure, the error."""
    try:
        manifest = info.manifest
        doc = b""  # format v5: every rank's documents, gathered (`expand_over`)
        if not has_rank_metadata(manifest):
            entry = manifest.chunked(METADATA_NAME)
            doc = bytes(read_chunks(local, info, entry, 0, entry.size, verify=True))
        there = None
        try:
            there = committed_at(remote, info.step)
        except (CkptfsError, StorageError) as exc:
            log.warning("step %d: the remote copy cannot be read (%s): files are read from the "
                        "nodes only", info.step, exc)
        if there is not None and not same_content(there.manifest, manifest):
            there = None
        return ["ok", encode_bytes(doc), None if there is None else there.to_doc()]
    except Exception as exc:
        return ["error", describe(exc)]


def load_node_copy(local: Storage, remote: Storage, info: CheckpointInfo, into: dict[str, Any],
                   group: Group, *, verify: bool = True, threads: int | None = None,
                   durable: bool = True) -> dict[str, Any]:
    """Fill ``into`` (every rank of ``group``) from ``info``, the local copy of a sharded step
    spread over the nodes (module docstring); the walk's ``use`` for a local candidate.
    `LocalCopyUnavailable` (every rank) if a file some rank needs is on no node and the
    remote holds no copy of the step."""
    facts = group.broadcast(_facts(local, remote, info) if group.coordinator else None)
    if facts[0] == "error":
        raise carried(facts[1], ShardedLoadError)
    doc = decode_bytes(facts[1])
    there = None if facts[2] is None else CheckpointInfo.from_doc(facts[2])
    error: dict[str, Any] | None = None
    held: set[str] = set()
    try:
        settle_node_attempt(local, info.step, info.attempt, durable=durable)
    except Exception as exc:
        error = describe(exc)
    if has_rank_metadata(info.manifest):  # format v5: every rank's files, from every node
        info = expand_over(local, info, group, group.ranks[group.rank],
                           remote=None if there is None else (remote, there),
                           missing=LocalCopyUnavailable)  # a lost node: not corruption
    if error is None:
        try:
            held = node_holdings(local, info)
        except Exception as exc:
            error = describe(exc)
    gathered = group.all_gather([sorted(held), error])
    for _, e in gathered:
        if e is not None:
            raise carried(e, ShardedLoadError)
    reader = NodeReader(local, info, doc, [set(h) for h, _ in gathered], remote, there, group,
                        verify=verify, threads=threads)
    try:
        return load_into(local, info.step, into, verify=verify, threads=threads, reader=reader)
    except LocalCopyUnavailable as exc:
        log.warning("step %d cannot be loaded from its local copy (a lost node's files, and the "
                    "remote tier holds no copy of it): %s", info.step, exc)
        raise


def verify_node_copy(storage: Storage, info: CheckpointInfo, rank: int,
                     coordinator: bool) -> VerifyReport:
    """The quick verify of this node's part of the local copy ``info`` of a sharded step: the
    listing checks (links, missing, resized) of the files this node holds, its rank files (and
    on the coordinator's node ``dcp.msgpack``, besides the marker and manifest the read
    checked; format v5: its index document, decoded, and the rank file it describes, the
    coordinator's node also the spec and the table's blocks); the other nodes' files are not
    visible from here.  This is what retention asks
    of the newest step before it deletes older local copies (their remote copies stay the
    fallbacks)."""
    mine = own_files(info.manifest, rank, coordinator)
    if has_rank_metadata(info.manifest):  # format v5: its own index says what it holds
        extra = own_rank_files(storage, info, rank)
        info = dataclasses.replace(info, manifest=dataclasses.replace(
            info.manifest, files=(*info.manifest.files, *extra)))
        mine += extra
    found = problems(info, list_attempt(storage, info), files=mine)
    report = VerifyReport(info.step, info.attempt, info.url, "quick")
    report.problems = [p.text for p in found]
    report.unsafe = [p.text for p in found if p.kind == "link"]
    report.files = len(mine)
    report.bytes = sum(e.size for e in mine)
    if found:
        cls = UnsafeCheckpointError if report.unsafe else CorruptCheckpointError
        raise cls(f"step {info.step} at {info.url} fails quick verification on this node: "
                  + "; ".join(report.problems), step=info.step, path=info.path)
    return report


def remove_node_files(storage: Storage, deleted: Iterable[int]) -> None:
    """On a node other than the coordinator's, remove this node's files of the steps the
    coordinator's prune deleted (the coordinator deleted its own, marker first); a step
    committed on this node is left alone."""
    listed = list_step_dirs(storage)
    for step in deleted:
        for name in listed.get(step, []):
            paths = StepPaths(step, name)
            if storage.exists(paths.marker):
                continue
            try:
                storage.delete_tree(paths.dir)
            except StorageError as exc:
                log.warning("prune: could not remove this node's files of step %d at %s: %s",
                            step, storage.url, exc)


__all__ = ["LocalCopyUnavailable", "NodeReader", "load_node_copy",
           "node_holdings", "remove_node_files", "verify_node_copy"]
