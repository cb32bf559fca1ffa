"""The collective save's rounds, driven by ckptfs over its own group.

Design decision: **ckptfs drives DCP's planner and its own storage writer itself**, in the
order DCP's ``dcp.save`` calls them (torch 2.13, ``state_dict_saver._save_state_dict``), over
`ckptfs.protocol.group` instead of DCP's object collectives:

1. every rank: ``set_up_planner``, ``set_up_storage_writer``, ``create_local_plan``,
   ``prepare_local_plan``; its plan (`plan_docs.local_plan_doc`) goes to the coordinator
   alone (`Group.gather_at_coordinator`);
2. the coordinator: the global plan, made in columns from every rank's table
   (`SavePlanner.create_global_table`, `ckptfs.protocol.global_plan`: what DCP's
   ``create_global_plan`` makes, without an object per write item), and the writer's
   ``prepare_global_plan`` over it (`ShardedWriter.prepare_table`); each rank receives its
   own part only (`plan_docs.part_doc`: which of its items it writes, the attempt), by
   `Group.scatter_from_coordinator`;
3. every rank: ``finish_plan`` and ``write_data``; its write results go to the coordinator
   alone;
4. the coordinator: the writer's ``finish`` (the commit, `ShardedWriter.finish_table`); every
   rank receives the outcome: the committed checkpoint (its manifest and marker,
   `CheckpointInfo.to_doc`), or every rank's failure.

What DCP sends instead: the plans pickled both ways, and at the end the whole global metadata
(every chunk of every rank: 22.8 MB per rank at 4,096 simulated ranks, docs/benchmarks.md)
pickled to every rank.  Here nothing is pickled and a rank receives its own part and the
outcome, not the whole plan.

A round in which some rank failed ends on every rank with DCP's ``CheckpointException``
(every failing rank's error: its own object on that rank, the one `group.carried` rebuilds
elsewhere), so ``ckptfs.protocol.sharded.failure`` maps it exactly as it maps DCP's; a
collective that itself fails (a peer died) raises the process group's error, as DCP's would.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, ClassVar

from torch.distributed.checkpoint.planner import SavePlan

from ckptfs.errors import ShardedSaveError
from ckptfs.protocol.gcpause import paused_collector
from ckptfs.protocol.global_plan import GlobalPlan
from ckptfs.protocol.group import Group
from ckptfs.protocol.plan_docs import (
    doc_layout,
    items_left_out,
    local_plan_doc,
    local_table_of,
    part_doc,
    part_of,
    results_doc,
    results_of,
)
from ckptfs.protocol.plan_table import LocalTable
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.protocol.rounds import Rounds, failures_doc, failures_in
from ckptfs.protocol.sharded_io import ShardedWriter
from ckptfs.protocol.sharded_plan import SavePlanner

__all__ = ["RESEND", "SaveRounds", "drive_save"]

log = logging.getLogger("ckptfs")


class SaveRounds(Rounds):
    """One rank's side of a collective save, round by round (module docstring): each method
    takes what this rank received and returns the document it sends, never raising (a
    failure is sent, and kept as `own` to raise on this rank itself).  `drive_save` runs the
    rounds over a group; the crash sweeps and ``ckptfs bench scale`` run the same methods for
    ranks simulated in one process."""

    error_class: ClassVar[type[ShardedSaveError]] = ShardedSaveError

    def __init__(self, state_dict: dict[str, Any], writer: ShardedWriter,
                 planner: SavePlanner, rank: int) -> None:
        super().__init__(rank)
        self.state_dict, self.writer, self.planner = state_dict, writer, planner
        self.local: SavePlan | None = None
        self.global_plan: GlobalPlan | None = None
        self.layout: str | None = None  # the layout digest of this rank's plan

    # -- round 1 -----------------------------------------------------------------------------
    def plan(self) -> dict[str, Any]:
        """Every rank: its local plan's document."""
        try:
            self.planner.set_up_planner(state_dict=self.state_dict,
                                        storage_meta=self.writer.storage_meta(),
                                        is_coordinator=self.rank == 0)
            self.writer.set_up_storage_writer(self.rank == 0, rank=self.rank,
                                              use_collectives=True)
            self.local = self.writer.prepare_local_plan(self.planner.create_local_plan())
            with _CACHE.lock:
                known = _CACHE.sent.get(self.rank)
            doc = local_plan_doc(self.local, known=known)
            self.layout = doc["layout"]
            return {"plan": doc}
        except BaseException as exc:  # every rank must learn of it, as with DCP
            return self.failed(exc)

    def plan_in_full(self) -> dict[str, Any]:
        """Every rank, when the coordinator asked for every item (it did not have a plan this
        rank left its items out of): its local plan's document, items included."""
        if self.local is None:  # pragma: no cover - a failed rank's plan ended the save
            return self.failed(AssertionError("no local plan"))
        return {"plan": local_plan_doc(self.local)}

    def plan_globally(self, docs: list[Any]) -> list[Any]:
        """The coordinator: every rank's part of the global plan, from every rank's plan (the
        cyclic collector paused: one write item per shard, gcpause's docstring)."""
        with paused_collector():
            return self._plan_globally(docs)

    def _plan_globally(self, docs: list[Any]) -> list[Any]:
        failures = failures_in(docs)
        if not failures:
            try:
                with _CACHE.lock:
                    known = dict(_CACHE.tables)
                if any(items_left_out(d["plan"]) and (known.get(r) is None or known[r].layout
                                                      != doc_layout(d["plan"]))
                       for r, d in enumerate(docs)):
                    return [RESEND] * len(docs)  # a plan left out that this process lacks
                seen: dict[str, Any] = {}
                tables = [local_table_of(d["plan"], seen, known.get(r))
                          for r, d in enumerate(docs)]
                with _CACHE.lock:
                    _CACHE.tables = dict(enumerate(tables))
                plan = self.global_plan = self.planner.create_global_table(tables)
                attempt = self.writer.prepare_table(plan, tables)
                return [{"part": part_doc(plan, r, attempt)} for r in range(len(tables))]
            except BaseException as exc:
                failures = {self.rank: self.failed(exc)["error"]}
        return [failures_doc(failures)] * len(docs)

    # -- round 2 -----------------------------------------------------------------------------
    def write(self, got: Any) -> dict[str, Any]:
        """Every rank, given its part: its write results' document (the data written)."""
        self.raise_failures("plan", got)
        assert self.local is not None
        try:
            central = self.planner.finish_plan(part_of(got["part"], self.local))
            fut = self.writer.write_data(central, self.planner)
            fut.wait()
            return {"results": results_doc(fut.value())}
        except BaseException as exc:
            return self.failed(exc)

    def commit(self, docs: list[Any]) -> dict[str, Any]:
        """The coordinator: the outcome, once it has every rank's write results (the cyclic
        collector paused: one report per item)."""
        with paused_collector():
            return self._commit(docs)

    def _commit(self, docs: list[Any]) -> dict[str, Any]:
        failures = failures_in(docs)
        if not failures:
            try:
                results = [results_of(d["results"], r) for r, d in enumerate(docs)]
                if self.global_plan is None:  # pragma: no cover - the plan round made it
                    raise AssertionError("the commit round before the plan round")
                self.writer.finish_table(self.global_plan, results)
                del results
                info = self.writer.info
                return {"info": info.to_doc() if isinstance(info, CheckpointInfo) else None}
            except BaseException as exc:
                failures = {self.rank: self.failed(exc)["error"]}
        else:  # a rank's write failed: every write has ended, nothing will commit
            try:
                self.writer.abandon()
            except Exception as exc:  # the failures matter, not the clean-up's
                log.warning("discarding the failed attempt of step %d: %s", self.writer.step,
                            exc)
        return failures_doc(failures)

    def result(self, outcome: Any) -> CheckpointInfo | None:
        """Every rank, given the outcome: the committed checkpoint (None where the writer is
        not ckptfs's), or `CheckpointException` naming every failing rank."""
        self.raise_failures("write", outcome)
        if self.layout is not None:  # the coordinator has this plan: the next save leaves it out
            with _CACHE.lock:
                _CACHE.sent[self.rank] = self.layout
        if self.rank == 0:
            info = self.writer.info
            return info if isinstance(info, CheckpointInfo) else None
        return None if outcome.get("info") is None else CheckpointInfo.from_doc(outcome["info"])


#: The coordinator's answer to a plan round in which a rank left its items out of a plan this
#: process does not have: every rank sends its plan again, items included.
RESEND: dict[str, Any] = {"resend": True}


@dataclasses.dataclass
class _PlanMemory:
    """What this process remembers of the last plan round, so that a save whose local plan
    keeps its layout (every save of a training run but the first) sends no items: as a rank,
    the layout digest of the plan it sent whose save committed (``sent``, by rank); as the
    coordinator, every rank's decoded table of the last round (``tables``, by rank), from
    which a document without items takes them, its layout digest checked."""

    sent: dict[int, str] = dataclasses.field(default_factory=dict)
    tables: dict[int, LocalTable] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_CACHE = _PlanMemory()


def drive_save(state_dict: dict[str, Any], writer: ShardedWriter, planner: SavePlanner,
               group: Group) -> CheckpointInfo | None:
    """One collective save of ``state_dict`` (every rank of ``group`` calls it) by ckptfs's
    writer and planner: the committed checkpoint on every rank, or `CheckpointException`
    naming every failing rank."""
    rounds = SaveRounds(state_dict, writer, planner, group.rank)
    with paused_collector():  # the coordinator decodes every rank's documents
        docs = group.gather_at_coordinator(rounds.plan())
        parts = None if docs is None else rounds.plan_globally(docs)
        del docs
        got = group.scatter_from_coordinator(parts)
        if got == RESEND:  # the coordinator lacks a plan some rank left its items out of
            docs = group.gather_at_coordinator(rounds.plan_in_full())
            parts = None if docs is None else rounds.plan_globally(docs)
            del docs
            got = group.scatter_from_coordinator(parts)
        del parts
    docs = group.gather_at_coordinator(rounds.write(got))
    with paused_collector():
        outcome = None if docs is None else rounds.commit(docs)
        del docs
        outcome = group.broadcast(outcome)
        return rounds.result(outcome)
