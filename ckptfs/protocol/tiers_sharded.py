"""Loading a sharded checkpoint across the two tiers of a store whose local tier is each node's
own disk (docs/tiers.md "Sharded").

Design decision: **every decision is the coordinator's or is computed from gathered facts, so
every rank loads the same step from the same copy.**  The coordinator lists both tiers and
broadcasts the candidates (newest step first; for each, the local copy first, then the remote
copy); every rank then tries them in that order, and a failure of any rank fails the attempt on
every rank (DCP gathers the errors of its steps; ckptfs's own steps gather theirs), so they all
move on together.  Never one rank on step N and another on N-1.

The local copy of a step is spread over the nodes: the coordinator's node holds the marker, the
manifest, ``dcp.msgpack`` and its rank file; each other node its own rank file.  A load of it:

1. the coordinator reads the marker, the manifest and ``dcp.msgpack`` (every chunk's digest
   checked) and broadcasts them, with the remote tier's committed copy of the same step if it
   holds one (same content);
2. every rank lists, on its own node, the files of the checkpoint (its own rank files, and for
   format v4 the files its references name) and the ranks gather what each node holds with its
   declared size;
3. DCP's load runs with a `NodeReader`: in its read step each rank gathers the stored
   chunks it needs that its node does not hold; each is served by the lowest rank whose node
   holds the file (read and checked against its digest there, sent through the process group:
   meant for the small items stored once, such as the optimizer's step counters), else read
   from the remote copy (a replaced node), else the local copy cannot serve the load:
   `LocalCopyUnavailable` on every rank.

What happens when a copy fails (`load_across_tiers`): a local copy that is corrupt or
unavailable falls back to the remote copy of the same step (logged) only if that copy is the
same checkpoint (`ckptfs.protocol.resolve.stand_in`, decided by the coordinator: another
run's step of that number is `TierMismatchError` on every rank, skipped with
``allow_rollback``); a step whose local copy
is *unavailable* (files of a lost node) and that the remote does not hold is skipped for the
newest step that can be read (logged: a node's loss, not corruption); a step that is corrupt in
every tier that holds it raises `CorruptCheckpointError`, unless
``allow_rollback``.  A `FormatVersionError` is raised, never skipped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ckptfs.errors import (
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    FormatVersionError,
    ShardedLoadError,
    StorageError,
    TierMismatchError,
)
from ckptfs.format.content import same_content
from ckptfs.format.incremental import references_of
from ckptfs.format.sharded import METADATA_NAME, ChunkedFileEntry
from ckptfs.format.versions import is_sharded
from ckptfs.protocol.copy import committed_at
from ckptfs.protocol.group import RankGroup, decode_bytes, describe, encode_bytes
from ckptfs.protocol.replication_sharded import (
    info_doc,
    info_of,
    rebuild_error,
    settle_node_attempt,
)
from ckptfs.protocol.resolve import CheckpointInfo, committed_steps, read_committed, stand_in
from ckptfs.protocol.sharded import collective_group, load_into
from ckptfs.protocol.sharded_read import ShardedReader, entry_location, read_chunks
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")

Key = tuple[str, int, int]


class LocalCopyUnavailable(CheckpointNotFoundError):
    """The local copy of a sharded step cannot serve a load: a file some rank needs is on no
    node (a lost node's) and the remote tier holds no copy of the step."""


def _bcast(doc: Any, group: Any) -> Any:
    """Group rank 0's ``doc`` on every rank (the group's JSON messages)."""
    return RankGroup(group).broadcast(doc)


def _gather(doc: Any, group: Any) -> list[Any]:
    """Every rank's ``doc``, in group-rank order (the group's JSON messages)."""
    return RankGroup(group).all_gather(doc)


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


class NodeReader(ShardedReader):
    """The reader of a rank loading the local copy of a sharded step: each file from its own
    node when it holds it, else a peer's node (through the process group), else the remote
    copy (module docstring)."""

    def __init__(self, local: Storage, info: CheckpointInfo, document: bytes,
                 holdings: list[set[str]], remote: Storage, remote_info: CheckpointInfo | None,
                 group: Any, *, verify: bool = True, threads: int | None = None) -> None:
        super().__init__(local, info.step, verify=verify, threads=threads)
        self.info = info
        self.listing_checked = True  # each node listed its own files (node_holdings)
        self.remote = remote
        self.remote_info = remote_info
        self.group = group
        self.holdings = holdings
        self.me = dist.get_rank(group)
        self._document = document
        self._peer: dict[str, dict[int, bytes]] = {}

    def _loc(self, path: str) -> str:
        return entry_location(self.resolve(), self.resolve().manifest.chunked(path))

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
            rentry = self.remote_info.manifest.chunked(entry.path)
            return read_chunks(self.remote, self.remote_info, rentry, start, length,
                               verify=self.verify)
        raise LocalCopyUnavailable(f"{info.url}: {entry.path} is on no node and not at "
                                   f"{self.remote.url}")

    def _needed(self, plan: LoadPlan) -> list[Key]:
        """The stored chunks this rank's items read that its node does not hold (and each rank
        file's header chunk)."""
        doc = self.load_document()
        manifest = self.resolve().manifest
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
                  _gather([[list(k) for k in needs], error], self.group)]
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
                manifest = info.manifest
                for r, key in serve:
                    sent[(r, key)] = bytes(read_chunks(self.storage, info,
                                                       manifest.chunked(key[0]), key[1], key[2],
                                                       verify=self.verify))
            except Exception as exc:
                mine, sent = describe(exc), {}
        served = [({(int(r), _key(k)): decode_bytes(data) for r, k, data in got}, e)
                  for got, e in _gather([[[r, list(k), encode_bytes(data)]
                                          for (r, k), data in sent.items()], mine],
                                         self.group)]
        for _, e in wanted:
            if e is not None:
                raise rebuild_error(e)
        if missing:
            raise LocalCopyUnavailable(
                f"the local copy of step {info.step} cannot serve this load: no node holds "
                f"what {'; '.join(sorted(set(missing))[:8])} need(s), and the remote tier "
                f"{self.remote.url} holds no copy of the step")
        for _, e in served:
            if e is not None:
                raise rebuild_error(e)
        for got, _ in served:
            for (r, (path, off, _length)), data in got.items():
                if r == self.me:
                    slot = self._peer.setdefault(self._loc(path), {})
                    if len(data) >= len(slot.get(off, b"")):  # a 0-byte chunk shares offsets
                        slot[off] = data
        return super().read_data(plan, planner)


def _candidates(local: Storage, remote: Storage, step: int | None
                ) -> list[tuple[int, list[str]]]:
    """(step, tiers holding it committed: "local" first) newest first; a tier that cannot be
    listed is left out (logged)."""
    listed: dict[str, set[int]] = {}
    for name, storage in (("local", local), ("remote", remote)):
        try:
            listed[name] = set(committed_steps(storage))
        except StorageError as exc:
            log.warning("the %s tier %s cannot be listed (%s): resolving from the other tier "
                        "only", name, storage.url, exc)
    if not listed:
        raise StorageError(f"neither tier can be listed ({local.url}, {remote.url})")
    steps = sorted(set().union(*listed.values()), reverse=True)
    if step is not None:
        steps = [s for s in steps if s == step]
    return [(s, [n for n in ("local", "remote") if s in listed.get(n, set())]) for s in steps]


def _key(doc: Any) -> Key:
    path, offset, length = doc
    return str(path), int(offset), int(length)


def _local_facts(local: Storage, remote: Storage, step: int, verify: bool) -> Any:
    """The coordinator's part of loading the local copy of ``step``: its info, the verified
    ``dcp.msgpack`` bytes, the remote's copy of the step when it holds the same content; on a
    failure, the error and the info if the manifest was read."""
    info: CheckpointInfo | None = None
    try:
        info = read_committed(local, step)
        manifest = info.manifest
        if not is_sharded(manifest):
            raise CheckpointNotFoundError(f"step {step} at {info.url} is not a sharded "
                                          "checkpoint")
        entry = manifest.chunked(METADATA_NAME)
        doc = bytes(read_chunks(local, info, entry, 0, entry.size, verify=True))
        there = None
        try:
            there = committed_at(remote, step)
        except (CkptfsError, StorageError) as exc:
            log.warning("step %d: the remote copy cannot be read (%s): files are read from the "
                        "nodes only", step, exc)
        if there is not None and not same_content(there.manifest, manifest):
            there = None
        return ["ok", info_doc(info), encode_bytes(doc),
                None if there is None else info_doc(there)]
    except Exception as exc:
        return ["error", describe(exc), None if info is None else info_doc(info)]


def load_across_tiers(local: Storage, remote: Storage, step: int | None, into: dict[str, Any],
                      *, verify: bool = True, threads: int | None = None,
                      allow_rollback: bool = False, durable: bool = True) -> dict[str, Any]:
    """Fill ``into`` (every rank) from the newest step committed in either tier (or ``step``),
    from the local copy spread over the nodes when it serves, else the remote copy (module
    docstring)."""
    group = collective_group(None, what="a sharded load across tiers", default=ShardedLoadError)
    coordinator = dist.get_rank(group) == 0
    plan = _bcast(_candidates(local, remote, step) if coordinator else None, group)
    if not plan:
        raise CheckpointNotFoundError(
            f"no committed checkpoint to load at {local.url} or {remote.url}"
            if step is None else f"step {step} is committed in neither tier ({local.url}, "
            f"{remote.url})")
    newest = True
    for s, tiers in plan:
        problems: list[tuple[str, Exception]] = []
        #: The local copy when it failed: its info, None if its manifest could not be read.
        failed: list[CheckpointInfo | None] = []
        for i, tier in enumerate(tiers):
            try:
                if tier == "local":
                    _load_local(local, remote, s, into, group, coordinator, verify=verify,
                                threads=threads, durable=durable, failed=failed)
                else:
                    if failed:
                        _check_stand_in(local, remote, s, failed[0], group, coordinator)
                    load_into(remote, s, into, verify=verify, threads=threads)
                if problems:
                    log.warning("using the %s copy of step %d at %s (the same checkpoint as "
                                "the failing %s copy)", tier, s, remote.url, problems[0][0])
                return into
            except FormatVersionError:
                raise
            except (CorruptCheckpointError, CheckpointNotFoundError, StorageError,
                    ShardedLoadError) as exc:
                problems.append((tier, exc))
                rest = tiers[i + 1:]
                log.warning("the %s copy of step %d fails (%s: %s)%s", tier, s,
                            type(exc).__name__, exc,
                            f"; trying the {rest[0]} copy" if rest else "")
        if step is not None or not problems:
            if problems:
                _raise_for(s, problems, newest=False)
            continue
        if all(isinstance(e, LocalCopyUnavailable) for _, e in problems):
            log.warning("step %d cannot be loaded: its local copy lacks files of a lost node "
                        "and the remote tier does not hold it; loading the newest step that "
                        "can be read instead", s)
            continue
        if newest and not allow_rollback:
            _raise_for(s, problems, newest=True)
        log.warning("allow_rollback: skipping step %d, no copy of it can be used: %s", s,
                    "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in problems))
        newest = False
    raise CheckpointNotFoundError(f"no committed checkpoint can be loaded from {local.url} or "
                                  f"{remote.url}")


def _check_stand_in(local: Storage, remote: Storage, step: int, failed: CheckpointInfo | None,
                    group: Any, coordinator: bool) -> None:
    """The coordinator decides whether the remote copy of ``step`` may stand in for the failing
    local copy (``failed``: its info, None if its manifest could not be read): the one rule of
    every two-tier read (`stand_in`); every rank raises the same `TierMismatchError`
    if not.  A remote copy that cannot be read here is left to the load, which reports it."""
    verdict: dict[str, Any] | None = None
    if coordinator:
        try:
            there = read_committed(remote, step)
        except Exception:
            there = None
        if there is not None:
            try:
                stand_in(step, ("remote", remote), there, [(("local", local), failed)])
            except TierMismatchError as exc:
                verdict = describe(exc)
    verdict = _bcast(verdict, group)
    if verdict is not None:
        raise rebuild_error(verdict)


def _raise_for(step: int, problems: list[tuple[str, Exception]], *, newest: bool) -> None:
    what = f"the newest checkpoint, step {step}," if newest else f"step {step}"
    if any(isinstance(e, TierMismatchError) for _, e in problems):
        raise TierMismatchError(
            f"{what} no copy can be used: "
            + "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in problems)
            + (". Inspect the local copy with 'ckptfs verify', delete it if it is damaged, or "
               "pass allow_rollback=True to use the previous committed checkpoint"
               if newest else ""), step=step)
    raise CorruptCheckpointError(
        f"{what} fails in every tier that holds it: "
        + "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in problems)
        + (". Refusing to fall back silently: pass allow_rollback=True to use the previous "
           "committed checkpoint" if newest else ""), step=step)


def _load_local(local: Storage, remote: Storage, step: int, into: dict[str, Any], group: Any,
                coordinator: bool, *, verify: bool, threads: int | None, durable: bool,
                failed: list[CheckpointInfo | None]) -> None:
    """Load the local copy of ``step``, spread over the nodes; when it fails, ``failed`` gets
    its info (None if its marker or manifest is damaged), which the remote copy must match to
    stand in for it (`_check_stand_in`)."""
    facts = _bcast(_local_facts(local, remote, step, verify) if coordinator else None, group)
    if facts[0] == "error":
        exc = rebuild_error(facts[1])
        if facts[2] is not None or isinstance(exc, CorruptCheckpointError):
            failed.append(None if facts[2] is None else info_of(facts[2]))  # None: unreadable
        raise exc
    info, doc = info_of(facts[1]), decode_bytes(facts[2])
    there = None if facts[3] is None else info_of(facts[3])
    try:
        _load_node_copy(local, remote, info, doc, there, into, group, verify=verify,
                        threads=threads, durable=durable)
    except BaseException:
        failed.append(info)
        raise


def _load_node_copy(local: Storage, remote: Storage, info: CheckpointInfo, doc: bytes,
                    there: CheckpointInfo | None, into: dict[str, Any], group: Any, *,
                    verify: bool, threads: int | None, durable: bool) -> None:
    step = info.step
    error: dict[str, Any] | None = None
    held: set[str] = set()
    try:
        settle_node_attempt(local, step, info.attempt, durable=durable)
        held = node_holdings(local, info)
    except Exception as exc:
        error = describe(exc)
    gathered = _gather([sorted(held), error], group)
    for _, e in gathered:
        if e is not None:
            raise rebuild_error(e)
    reader = NodeReader(local, info, doc, [set(h) for h, _ in gathered], remote, there, group,
                        verify=verify, threads=threads)
    load_into(local, step, into, verify=verify, threads=threads, reader=reader)
