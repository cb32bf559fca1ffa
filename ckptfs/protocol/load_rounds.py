"""The collective load's rounds, driven by ckptfs over its own group (as the save's are:
`ckptfs.protocol.save_rounds`).

Design decision: **ckptfs drives DCP's load planner and its own storage reader itself**, in the
order DCP's ``dcp.load`` calls them (torch 2.13, ``state_dict_loader._load_state_dict``), over
`ckptfs.protocol.group` instead of DCP's object collectives:

1. every rank: ``read_metadata``, ``set_up_planner``, ``set_up_storage_reader``,
   ``create_local_plan``, ``prepare_local_plan``, and the stored chunks its items read
   (`ShardedReader.needs`: every target's dtype checked there, before a byte is read); a small
   document goes to the coordinator alone (`Group.gather_at_coordinator`): the attempt it
   resolved and those chunks (`keys_doc`, as JSON text inside it);
2. the coordinator: every rank resolved the same attempt and its listing is checked once
   (`ShardedReader.check_agreed`: what the reader's ``prepare_global_plan`` checks under DCP),
   and, where ranks share chunks (replicas), who reads each once and sends it to the others
   (`shared_reads`, `plan_group_reads`): ranks sending the same chunks (the replicas of a
   shard) are planned as one group, each distinct list parsed once; each rank receives its
   own part only (`Group.scatter_from_coordinator`, one document per group, encoded once): the
   transfers of the chunks it needs, round by round (nothing, where no chunk is shared);
3. every rank: ``finish_plan`` and ``read_data`` (its reads, verified, and the exchanges of the
   shared chunks); its outcome goes to the coordinator;
4. the coordinator: the outcome to every rank (every failing rank's error).

What DCP's own load sends instead: every rank's load plan (one object per read item) pickled
to the coordinator and back, the cyclic garbage collector running; and ckptfs's reader, called
by DCP, sends every rank's needs to every rank (`ShardedReader._share`, kept for a plain
``dcp.load`` through ``ckptfs.dcp.Reader``).  Here nothing is pickled, the collector is paused
while the coordinator decodes, and a rank receives its own part.  The default load planner's
global step changes nothing (DCP's ``DefaultLoadPlanner.create_global_plan`` returns the plans
as they are), so no plan crosses at all.

A round in which some rank failed ends on every rank with DCP's ``CheckpointException`` (every
failing rank's error: its own object on that rank, the one `group.carried` rebuilds elsewhere),
so ``ckptfs.protocol.sharded.failure`` maps it exactly as it maps DCP's, and the walk of a
rolling-back load takes the same decision on every rank.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ckptfs.errors import ShardedLoadError
from ckptfs.protocol.balance import Key, ReadPlan, Transfer
from ckptfs.protocol.gcpause import paused_collector
from ckptfs.protocol.group import Group
from ckptfs.protocol.rounds import Rounds, failures_doc, failures_in
from ckptfs.protocol.sharded_read import ShardedReader, keys_doc, sharded_manifest, shared_reads

__all__ = ["LoadRounds", "drive_load", "part_of", "parts_of"]


class LoadRounds(Rounds):
    """One rank's side of a collective load, round by round (module docstring): each method
    takes what this rank received and returns the document it sends, never raising (a
    failure is sent, and kept as `own` to raise on this rank itself).  `drive_load` runs the
    rounds over a group; ``ckptfs bench scale`` runs the coordinator's for ranks simulated in
    one process."""

    error_class: ClassVar[type[ShardedLoadError]] = ShardedLoadError

    def __init__(self, state_dict: dict[str, Any], reader: ShardedReader,
                 planner: LoadPlanner, rank: int, *, cooperative: bool = False) -> None:
        super().__init__(rank)
        self.state_dict, self.reader, self.planner = state_dict, reader, planner
        #: Whether this rank can exchange chunks with the others (a gloo group of more than
        #: one rank, and a reader that reads through it): the coordinator plans sharing only
        #: when every rank can.
        self.cooperative = cooperative
        self.local: LoadPlan | None = None
        self.keys: list[Key] = []

    # -- round 1 -----------------------------------------------------------------------------
    def plan(self) -> dict[str, Any]:
        """Every rank: what it resolved and the chunks it needs."""
        try:
            reader, planner = self.reader, self.planner
            metadata = reader.read_metadata()
            planner.set_up_planner(self.state_dict, metadata, self.rank == 0)
            reader.set_up_storage_reader(metadata, self.rank == 0)
            self.local = reader.prepare_local_plan(planner.create_local_plan())
            self.keys = reader.needs(self.local, planner)
            step, attempt = self.local.storage_data
            # The chunks as JSON text inside the document: the coordinator parses each
            # distinct list once (the replicas of a shard send the same one).
            return {"plan": {"resolved": [step, attempt], "needs": encode_text(
                keys_doc(self.keys)), "share": self.cooperative}}
        except BaseException as exc:  # every rank must learn of it, as with DCP
            return self.failed(exc)

    def plan_globally(self, docs: list[Any], ranks: list[int]) -> list[Any]:
        """The coordinator: each rank's part (``ranks``: the group's global ranks, to name one
        in an error), from every rank's document (the cyclic collector paused).  Ranks that
        need the same chunks receive the same part (one object: encoded once)."""
        with paused_collector():
            failures = failures_in(docs)
            if not failures:
                try:
                    plans = [d["plan"] for d in docs]
                    self.reader.check_agreed({tuple(p["resolved"]) for p in plans})
                    if not (all(p.get("share") for p in plans) and len(plans) > 1):
                        return [{"part": {}}] * len(plans)
                    by_needs: dict[str, list[int]] = {}
                    for r, p in enumerate(plans):
                        if not isinstance(p.get("needs"), str):
                            raise ShardedLoadError(f"rank {ranks[r]} sent a malformed list "
                                                   "of the chunks it needs")
                        by_needs.setdefault(p["needs"], []).append(r)
                    groups = [(members, decode_text(text, ranks[members[0]]))
                              for text, members in by_needs.items()]
                    shared = shared_reads(groups, sharded_manifest(self.reader.resolve()),
                                          ranks)
                    return parts_of(shared, groups, len(plans))
                except BaseException as exc:
                    failures = {self.rank: self.failed(exc)["error"]}
            return [failures_doc(failures)] * len(docs)

    # -- round 2 -----------------------------------------------------------------------------
    def read(self, got: Any, world_size: int) -> dict[str, Any]:
        """Every rank, given its part: its reads (and exchanges); its outcome."""
        self.raise_failures("plan", got)
        assert self.local is not None
        try:
            self.reader.decided = (part_of(got["part"], self.rank, world_size, self.keys),)
            central = self.planner.finish_plan(self.local)
            self.reader.read_data(central, self.planner).wait()
            return {"read": True}
        except BaseException as exc:
            return self.failed(exc)

    def outcome(self, docs: list[Any]) -> dict[str, Any]:
        """The coordinator: every rank's failure, or none."""
        failures = failures_in(docs)
        return failures_doc(failures) if failures else {}

    def result(self, outcome: Any) -> None:
        """Every rank, given the outcome: `CheckpointException` naming every failing rank."""
        self.raise_failures("read", outcome)


def encode_text(doc: Any) -> str:
    """``doc`` as compact JSON text (a document inside a document)."""
    return json.dumps(doc, separators=(",", ":"))


def decode_text(text: str, rank: int) -> Any:
    """`encode_text`'s inverse; `ShardedLoadError` naming ``rank`` for text that is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        raise ShardedLoadError(f"rank {rank} sent a malformed list of the chunks it "
                               "needs") from None


def parts_of(shared: ReadPlan | None, groups: list[tuple[list[int], Any]], world: int
             ) -> list[Any]:
    """Each rank's part of the cooperative plan ``shared`` (``{}``: no chunk is shared): for
    each group of ranks needing the same chunks (``groups``: their ranks and `keys_doc`), one
    document, the same object for every rank of the group (and for every group whose part is
    the same: the ranks that only receive the same chunks): per round, the transfers of the
    chunks they need (``[path, offset, length, reader, needers]``: ``needers`` an index into
    ``sets``, the rank sets the part names, where a member reads the chunk and sends it to
    them; -1 where the members receive it from ``reader``).  Made of one fragment per
    distinct list of chunks of a file, as the plan was (`needs_by_file`)."""
    if shared is None:
        return [{"part": {}}] * world
    where: dict[Key, tuple[int, Transfer]] = {}
    for i, transfers in enumerate(shared.rounds):
        for t in transfers:
            where[t.key] = (i, t)
    planned = {k[0] for k in where}
    fragments: dict[tuple[str, tuple[int, ...]], tuple[list[tuple[int, Transfer]], set[int]]] = {}
    out: list[Any] = [None] * world
    same: dict[tuple[int, ...], dict[str, Any]] = {}  # receivers' parts, by their fragments
    for members, keys in groups:
        frags: list[tuple[list[tuple[int, Transfer]], set[int]]] = []
        for path, flat in keys.items():
            if path not in planned:  # a file only these ranks need: no transfer
                continue
            sig = (path, tuple(flat))
            frag = fragments.get(sig)
            if frag is None:
                hits = [where[k] for k in zip([path] * (len(flat) // 2), flat[::2],
                                               flat[1::2], strict=True) if k in where]
                frag = fragments[sig] = (hits, {t.reader for _, t in hits})
            if frag[0]:
                frags.append(frag)
        readers = set(members)
        if not any(readers & f[1] for f in frags):  # the members only receive
            ids = tuple(id(f) for f in frags)
            part = same.get(ids)
            if part is None:
                part = same[ids] = _part(frags, readers, len(shared.rounds))
        else:
            part = _part(frags, readers, len(shared.rounds))
        for r in members:
            out[r] = part
    return out


def _part(frags: list[tuple[list[tuple[int, Transfer]], set[int]]], readers: set[int],
          rounds_count: int) -> dict[str, Any]:
    """One part of `parts_of`: its fragments' transfers by round; a reader among ``readers``
    (the members) sends to every needer (the set named once per part, by the tuple's identity:
    hashing thousands of ranks per chunk would cost more)."""
    sets: dict[int, tuple[int, tuple[int, ...]]] = {}
    rounds: list[list[list[Any]]] = [[] for _ in range(rounds_count)]
    for hits, _ in frags:
        for i, t in hits:
            who = -1
            if t.reader in readers:
                held = sets.get(id(t.needers))
                if held is None:
                    held = sets[id(t.needers)] = (len(sets), t.needers)
                who = held[0]
            rounds[i].append([t.key[0], t.key[1], t.key[2], t.reader, who])
    return {"part": {"sets": [list(s) for _, s in sets.values()], "rounds": rounds}}


def part_of(doc: dict[str, Any], rank: int, world_size: int, keys: list[Key]
            ) -> ReadPlan | None:
    """The `ReadPlan` of this rank's part (`parts_of`), as `ShardedReader._read_shared` runs
    it: the rounds' transfers of the chunks it needs (it reads some and sends each to its
    needers; it receives the others, each named with itself as its only needer),
    and ``alone[rank]``: every chunk of ``keys`` (what it needs) no transfer brings; None: no
    chunk is shared."""
    if "rounds" not in doc:
        return None
    sets = [tuple(s) for s in doc["sets"]]
    rounds: list[list[Transfer]] = []
    moved: set[Key] = set()
    for transfers in doc["rounds"]:
        mine: list[Transfer] = []
        for path, off, length, reader, who in transfers:
            key = (path, off, length)
            if reader == rank:  # it reads the chunk and sends it to every other needer
                mine.append(Transfer(reader, key, sets[who]))
            else:  # it receives the chunk from its reader
                mine.append(Transfer(reader, key, (rank,)))
            moved.add(key)
        mine.sort(key=lambda t: t.key)
        rounds.append(mine)
    alone: list[list[Key]] = [[] for _ in range(world_size)]
    alone[rank] = [k for k in keys if k not in moved]
    return ReadPlan(rounds, alone, [])


def drive_load(state_dict: dict[str, Any], reader: ShardedReader, planner: LoadPlanner,
               group: Group, *, cooperative: bool = False) -> None:
    """One collective load into ``state_dict`` (DCP's flat view of the target; every rank of
    ``group`` calls it) by ckptfs's reader and DCP's load planner: filled in place on every
    rank, or `CheckpointException` naming every failing rank.  As ``dcp.load``: the top-level
    keys in sorted order, each replaced by the value the planner left for it."""
    keys = sorted(state_dict)
    flat = {k: state_dict[k] for k in keys}
    rounds = LoadRounds(flat, reader, planner, group.rank, cooperative=cooperative)
    with paused_collector():  # the coordinator decodes every rank's documents
        docs = group.gather_at_coordinator(rounds.plan())
        parts = None if docs is None else rounds.plan_globally(docs, group.ranks)
        del docs
        got = group.scatter_from_coordinator(parts)
        del parts
    docs = group.gather_at_coordinator(rounds.read(got, group.world_size))
    outcome = group.broadcast(None if docs is None else rounds.outcome(docs))
    rounds.result(outcome)
    for k in keys:
        state_dict[k] = flat[k]
