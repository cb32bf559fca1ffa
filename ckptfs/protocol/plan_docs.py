"""What the ranks of a collective save send each other, as JSON documents (`ckptfs.protocol.group`).

Design decision: **DCP's objects cross ranks by what they hold, never pickled.**  A collective
save (`ckptfs.protocol.save_rounds`) sends four kinds of message, and each has a document
here, made by one function and read back by its inverse:

* a rank's **local save plan**, to the coordinator (`local_plan_doc` / `local_table_of`): its
  table (`ckptfs.protocol.plan_table`): the skeleton (every write item's name, kind, properties,
  size: the same text on every rank of an SPMD job, decoded once) and the numbers (the chunks'
  offsets and sizes, int64), the step the rank saves, and ckptfs's planner data (the
  flattening map, the rank's state skeleton as msgpack, its layout digest);
* each rank's **part of the global plan**, from the coordinator (`part_doc` / `part_of`): the
  attempt, the rank's index, and which of its own local items it writes with their index
  hints: the global plan only selects and hints items (`global_plan.global_plan`), so a rank
  rebuilds its part from its own plan;
* a rank's **write results**, to the coordinator (`results_doc` / `results_of`): per item its
  `ItemReport`, or a per-rank save's one `RankReport` (format v5);
* the **outcome**, to every rank: the committed checkpoint (`CheckpointInfo.to_doc`: its
  manifest and marker as stored) or the failures.

Every reader refuses a document of the wrong shape with `ValueError` naming what is wrong (the
round that received it fails on every rank): a message is data, as a checkpoint is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ckptfs.format.entries import Chunk
from ckptfs.protocol.global_plan import GlobalPlan, piece_of
from ckptfs.protocol.plan_table import (
    LocalTable,
    PlanMappings,
    Skeleton,
    decode_numbers,
    decode_planner_data,
    decode_skeleton,
    encode_numbers,
    layout_of,
)
from ckptfs.protocol.sharded_io import AttemptPlan, ItemReport

__all__ = ["doc_layout", "items_left_out", "local_plan_doc", "local_plan_of", "local_table_of",
           "part_doc", "part_of", "results_doc", "results_of"]

# ----------------------------------------------------------------------------------------------
# A rank's local plan


def local_plan_doc(plan: SavePlan, *, known: str | None = None) -> dict[str, Any]:
    """``plan`` (a rank's local save plan, after the writer's ``prepare_local_plan``) as its
    table (`LocalTable.of_plan`): the skeleton's, numbers' and planner data's documents, the
    plan's ``layout`` digest (`plan_table.layout_of`), the step and DCP's ``usable``.
    ``known``: the layout of the plan this rank sent last, which the coordinator has: a plan
    of that layout is sent without its skeleton, numbers and planner data (all None)."""
    table = LocalTable.of_plan(plan)
    left_out = table.layout == known
    return {"skeleton": None if left_out else table.skeleton.blob,
            "numbers": None if left_out else table.texts[0],
            "planner": None if left_out else table.texts[1],
            "layout": table.layout, "step": plan.storage_data, "usable": bool(plan.usable),
            "replicas": None if table.replicas is None or not bool(table.replicas.any())
            else encode_numbers(table.replicas)}


def items_left_out(doc: Any) -> bool:
    """Whether a local plan's document left its items out (`local_plan_doc`'s ``known``)."""
    return isinstance(doc, dict) and "skeleton" in doc and doc["skeleton"] is None


def doc_layout(doc: Any) -> Any:
    """The layout digest a local plan's document names (None: none)."""
    return doc.get("layout") if isinstance(doc, dict) else None


def local_table_of(doc: Any, seen: dict[Any, Any] | None = None,
                   known: LocalTable | None = None) -> LocalTable:
    """The table `local_plan_doc` described.  ``seen``: the documents already decoded and
    digested, by their text (one dict for every rank's plan of one save: an SPMD job's ranks
    send one skeleton and one planner data).  ``known``: the table of the plan this rank sent
    last, whose items a document that left them out has (its layout digest must be this
    one's).  A document whose layout digest is not that of its content is refused."""
    if not isinstance(doc, dict) or "skeleton" not in doc or "numbers" not in doc:
        raise ValueError("a local save plan: a document with a skeleton and numbers wanted")
    seen = {} if seen is None else seen
    layout = doc_layout(doc)
    if layout is not None and not isinstance(layout, str):
        raise ValueError("a local save plan's layout digest: a string wanted")
    step = doc.get("step")
    if type(step) is not int:
        raise ValueError(f"a local save plan's step: {step!r:.40}")
    usable = bool(doc.get("usable", True))
    if items_left_out(doc):
        if known is None or layout is None or known.layout != layout:
            raise ValueError("a local save plan without its items, and no earlier plan of its "
                             "layout")
        return dataclasses.replace(known, step=step, usable=usable,
                                   replicas=_replicas_of(doc, len(known.skeleton.rows)))
    blob, numbers_text, planner_text = doc["skeleton"], doc["numbers"], doc.get("planner")
    found = seen.get(("skeleton", blob)) if isinstance(blob, str) else None
    skeleton = found if isinstance(found, Skeleton) else decode_skeleton(blob)
    seen[("skeleton", blob)] = skeleton
    numbers = decode_numbers(numbers_text, skeleton.width)
    planner_data: PlanMappings | None = None
    if planner_text is not None:
        if not isinstance(planner_text, str):
            raise ValueError("a local save plan's planner data: its mappings wanted")
        planner_data = seen.get(("planner", planner_text))
        if planner_data is None:
            planner_data = seen[("planner", planner_text)] = decode_planner_data(planner_text)
    digests = seen.setdefault("digests", {})
    actual = layout_of(blob, numbers_text, planner_text, digests)
    if layout is not None and layout != actual:
        raise ValueError("a local save plan's layout digest is not that of its items")
    return LocalTable(skeleton, numbers, step, usable, planner_data, (numbers_text, planner_text),
                      actual, replicas=_replicas_of(doc, len(skeleton.rows)))


def _replicas_of(doc: dict[str, Any], items: int) -> torch.Tensor | None:
    """The replicas' digests a local plan's document carries (one int64 per item), or None."""
    text = doc.get("replicas")
    return None if text is None else decode_numbers(text, items)


def local_plan_of(doc: Any) -> SavePlan:
    """The local save plan `local_plan_doc` described (DCP's objects: a test's view; the
    coordinator plans over tables)."""
    table = local_table_of(doc)
    return SavePlan(table.write_items(), storage_data=table.step,
                    planner_data=table.planner_data, usable=table.usable)


# ----------------------------------------------------------------------------------------------
# A rank's part of the global plan


def part_doc(plan: GlobalPlan, rank: int, attempt: str) -> dict[str, Any]:
    """Rank ``rank``'s part of the global plan ``plan``: the positions, in its local plan, of
    the items it writes, with their index hints (``[position, hint]``; an item it writes in
    part, a replicated tensor split between its holders: ``[position, hint, first row,
    rows]``), and the attempt."""
    pos, hints, pieces = plan.part(rank)
    return {"attempt": attempt, "rank": rank,
            "items": [[p, h] if piece is None else [p, h, *piece]
                      for p, h, piece in zip(pos, hints, pieces, strict=True)]}


def part_of(doc: Any, local: SavePlan) -> SavePlan:
    """This rank's part of the global plan from `part_doc` and its own local plan."""
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list) or \
            not isinstance(doc.get("attempt"), str) or type(doc.get("rank")) is not int:
        raise ValueError("a global plan part: attempt, rank and items wanted")
    items = []
    last = -1
    for pair in doc["items"]:
        if not (isinstance(pair, list) and len(pair) in (2, 4)
                and all(type(x) is int for x in pair[:1] + pair[2:])
                and last < pair[0] < len(local.items)
                and (pair[1] is None or type(pair[1]) is int)):
            raise ValueError(f"a global plan part's item: {pair!r:.80}")
        last = pair[0]
        item = local.items[pair[0]]
        if len(pair) == 4:  # a piece of it
            try:
                item = piece_of(item, pair[2], pair[3])
            except ValueError as exc:
                raise ValueError(f"a global plan part's item: {exc}") from None
        if pair[1] != item.index.index:
            item = dataclasses.replace(item, index=dataclasses.replace(item.index,
                                                                       index=pair[1]))
        items.append(item)
    return dataclasses.replace(local, items=items,
                               storage_data=AttemptPlan(doc["attempt"], doc["rank"]))


# ----------------------------------------------------------------------------------------------
# A rank's write results


def _chunk_doc(c: Chunk | None) -> list[Any] | None:
    return None if c is None else [c.offset, c.length, c.digest]


def _chunk_of(raw: Any) -> Chunk | None:
    if raw is None:
        return None
    if not (isinstance(raw, list) and len(raw) == 3 and type(raw[0]) is int
            and type(raw[1]) is int and isinstance(raw[2], str)):
        raise ValueError(f"a chunk: {raw!r:.80}")
    return Chunk(raw[0], raw[1], raw[2])


def results_doc(results: list[WriteResult]) -> list[list[Any]]:
    """A rank's write results: per item its name, offset, size and report."""
    out = []
    for wr in results:
        idx, rep = wr.index, wr.storage_data
        offset = None if idx.offset is None else list(idx.offset)
        if isinstance(rep, ItemReport):
            report: list[Any] = [
                "item", rep.path, rep.offset, rep.length, rep.digest, rep.rank, rep.file_size,
                _chunk_doc(rep.header), None if rep.source is None else list(rep.source),
                None if rep.protector is None else list(rep.protector),
                [list(p) for p in rep.store_checksums]]
        else:
            from ckptfs.protocol.rank_metadata import RankReport  # format v5 only

            if not isinstance(rep, RankReport):
                raise TypeError(f"a write result of type {type(rep).__name__}: ckptfs's writer "
                                "reports ItemReport or RankReport")
            report = ["rank", dataclasses.asdict(rep.row), rep.items]
        out.append([idx.fqn, offset, idx.index, int(wr.size_in_bytes), report])
    return out


def _report_of(raw: Any, what: Callable[[], str]) -> Any:
    if isinstance(raw, list) and len(raw) == 11 and raw[0] == "item":
        _, path, offset, length, digest, rank, file_size, header, source, protector, sums = raw
        if not (type(path) is str and type(digest) is str and type(offset) is int
                and type(length) is int and type(rank) is int and type(file_size) is int):
            raise ValueError(f"{what()}: an item report {raw!r:.80}")
        if source is not None:
            if not (isinstance(source, list) and len(source) == 3 and type(source[0]) is int
                    and all(isinstance(s, str) for s in source[1:])):
                raise ValueError(f"{what()}: a reused item's source {source!r:.80}")
            source = (source[0], source[1], source[2])
        if protector is not None:
            if not (isinstance(protector, list) and len(protector) == 2
                    and type(protector[0]) is int and isinstance(protector[1], str)):
                raise ValueError(f"{what()}: a protector {protector!r:.80}")
            protector = (protector[0], protector[1])
        if type(sums) is not list or (sums and not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p)
                for p in sums)):
            raise ValueError(f"{what()}: store checksums {sums!r:.80}")
        fields = {"path": path, "offset": offset, "length": length, "digest": digest,
                  "rank": rank, "file_size": file_size, "header": _chunk_of(header),
                  "source": source, "protector": protector,
                  "store_checksums": tuple((a, b) for a, b in sums) if sums else ()}
        if not _PLAIN_REPORT:  # pragma: no cover - ItemReport changed without this
            return ItemReport(**fields)
        report = object.__new__(ItemReport)
        report.__dict__.update(fields)
        return report
    if isinstance(raw, list) and len(raw) == 3 and raw[0] == "rank" and \
            isinstance(raw[1], dict) and type(raw[2]) is int:
        from ckptfs.format.rank_metadata import RankRow
        from ckptfs.protocol.rank_metadata import RankReport  # format v5 only

        row = raw[1]
        kinds = {"rank": int, "has_file": bool, "file_size": int, "file_digest": str,
                 "index_size": int, "index_digest": str}
        if set(row) != set(kinds) or any(type(row[k]) is not t for k, t in kinds.items()):
            raise ValueError(f"{what()}: a rank row {row!r:.120}")
        return RankReport(RankRow(**row), raw[2])
    raise ValueError(f"{what()}: a write report {raw!r:.80}")


#: `ItemReport` and DCP's ``WriteResult`` hold their fields in their instance dicts: built with
#: their fields set as such (a coordinator at 4,096 ranks reads 200,000 reports).
_PLAIN_REPORT = tuple(f.name for f in dataclasses.fields(ItemReport)) == (
    "path", "offset", "length", "digest", "rank", "file_size", "header", "source", "protector",
    "store_checksums") and "__slots__" not in vars(ItemReport) and tuple(
    f.name for f in dataclasses.fields(WriteResult)) == (
    "index", "size_in_bytes", "storage_data") and "__slots__" not in vars(WriteResult) and \
    tuple(f.name for f in dataclasses.fields(MetadataIndex)) == ("fqn", "offset", "index") \
    and "__slots__" not in vars(MetadataIndex)


def results_of(doc: Any, rank: int) -> list[WriteResult]:
    """Rank ``rank``'s write results from `results_doc`."""
    if not isinstance(doc, list):
        raise ValueError(f"rank {rank}'s write results: a list wanted")
    out = []
    new = object.__new__
    for raw in doc:
        if not (isinstance(raw, list) and len(raw) == 5 and isinstance(raw[0], str)
                and (raw[2] is None or type(raw[2]) is int) and type(raw[3]) is int):
            raise ValueError(f"rank {rank}'s write result: {raw!r:.80}")

        def what(fqn: str = raw[0]) -> str:
            return f"rank {rank}'s write result {fqn!r:.80}"

        report = _report_of(raw[4], what)
        try:
            offset = None if raw[1] is None else torch.Size(raw[1])
        except TypeError as exc:
            raise ValueError(f"{what()}: a list of ints wanted, got {raw[1]!r:.80}") from exc
        if not _PLAIN_REPORT:  # pragma: no cover - another torch
            out.append(WriteResult(index=MetadataIndex(raw[0], offset, raw[2]),
                                   size_in_bytes=raw[3], storage_data=report))
            continue
        index = new(MetadataIndex)
        index.__dict__.update(fqn=raw[0], offset=offset, index=raw[2])
        wr = new(WriteResult)
        wr.__dict__.update(index=index, size_in_bytes=raw[3], storage_data=report)
        out.append(wr)
    return out
