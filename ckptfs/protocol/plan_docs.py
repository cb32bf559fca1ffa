"""What the ranks of a collective save send each other, as JSON documents (`ckptfs.protocol.group`).

Design decision: **DCP's objects cross ranks by what they hold, never pickled.**  A collective
save (`ckptfs.protocol.save_rounds`) sends four kinds of message, and each has a document
here, made by one function and read back by its inverse:

* a rank's **local save plan**, to the coordinator (`local_plan_doc` / `local_plan_of`): every
  write item (name, offset, kind; a tensor's chunk, properties and size), the properties listed
  once and named by position, the step the rank saves, and ckptfs's planner data (the
  flattening map, the rank's state skeleton as msgpack, its layout digest);
* each rank's **part of the global plan**, from the coordinator (`part_doc` / `part_of`): the
  attempt, the rank's index, and which of its own local items it writes with their index
  hints: ckptfs's global planner only selects and hints items (`sharded_plan.global_save_plan`),
  so a rank rebuilds its part from its own plan; an item the coordinator changed otherwise is a
  `ValueError`;
* a rank's **write results**, to the coordinator (`results_doc` / `results_of`): per item its
  `ItemReport`, or a per-rank save's one `RankReport` (format v5);
* the **outcome**, to every rank: the committed checkpoint (`CheckpointInfo.to_doc`: its
  manifest and marker as stored) or the failures.

Every reader refuses a document of the wrong shape with `ValueError` naming what is wrong (the
round that received it fails on every rank): a message is data, as a checkpoint is.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import msgpack
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from ckptfs.format.entries import Chunk
from ckptfs.protocol.group import decode_bytes, encode_bytes
from ckptfs.protocol.sharded_io import AttemptPlan, ItemReport
from ckptfs.protocol.sharded_plan import PlanMappings

__all__ = ["items_left_out", "local_plan_doc", "local_plan_of", "part_doc", "part_of",
           "results_doc", "results_of"]

_KINDS = {WriteItemType.TENSOR: "tensor", WriteItemType.SHARD: "shard",
          WriteItemType.BYTE_IO: "bytes"}
_KIND_OF = {v: k for k, v in _KINDS.items()}
_TORCH_NAME = re.compile(r"torch\.[A-Za-z0-9_]{1,64}")


def _torch_name(value: Any) -> str:
    return str(value)  # "torch.float32", "torch.strided", "torch.contiguous_format"


def _torch_attr(name: Any, kind: type, what: str) -> Any:
    if not isinstance(name, str) or not _TORCH_NAME.fullmatch(name):
        raise ValueError(f"{what}: {name!r:.80} is not a torch name")
    value = getattr(torch, name[len("torch."):], None)
    if not isinstance(value, kind):
        raise ValueError(f"{what}: {name!r:.80} is not a {kind.__name__}")
    return value


def _properties_doc(p: TensorProperties) -> list[Any]:
    return [_torch_name(p.dtype), _torch_name(p.layout), bool(p.requires_grad),
            _torch_name(p.memory_format), bool(p.pin_memory)]


def _properties_of(raw: Any) -> TensorProperties:
    if not isinstance(raw, list) or len(raw) != 5:
        raise ValueError(f"tensor properties: 5 fields wanted, got {raw!r:.80}")
    dtype = _torch_attr(raw[0], torch.dtype, "dtype")
    layout = _torch_attr(raw[1], torch.layout, "layout")
    memory_format = _torch_attr(raw[3], torch.memory_format, "memory format")
    if type(raw[2]) is not bool or type(raw[4]) is not bool:
        raise ValueError("tensor properties: requires_grad and pin_memory are bools")
    return TensorProperties(dtype=dtype, layout=layout, requires_grad=raw[2],
                            memory_format=memory_format, pin_memory=raw[4])


# ----------------------------------------------------------------------------------------------
# A rank's local plan


def local_plan_doc(plan: SavePlan, *, items_known: bool = False) -> dict[str, Any]:
    """``plan`` (a rank's local save plan, after the writer's ``prepare_local_plan``).
    ``items_known``: its items are those of the plan this rank sent last, which the coordinator
    has (the same layout digest): they are left out (``"items": None``), the rest is sent."""
    props: list[list[Any]] = []
    seen: dict[Any, int] = {}
    items: list[list[Any]] = []
    for item in plan.items if not items_known else ():
        idx = item.index
        offset = None if idx.offset is None else list(idx.offset)
        td = item.tensor_data
        if td is None:
            nbytes = None if item.bytes_io_data is None else int(item.bytes_io_data.nbytes)
            items.append([idx.fqn, offset, idx.index, _KINDS[item.type], nbytes])
            continue
        p = td.properties
        key = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        k = seen.get(key)
        if k is None:
            k = seen[key] = len(props)
            props.append(_properties_doc(p))
        items.append([idx.fqn, offset, idx.index, _KINDS[item.type], k,
                      list(td.chunk.offsets), list(td.chunk.sizes), list(td.size)])
    doc: dict[str, Any] = {"items": None if items_known else items, "properties": props,
                           "step": plan.storage_data, "usable": bool(plan.usable)}
    pd = plan.planner_data
    if isinstance(pd, dict):
        # The flattening map and the skeleton as one msgpack blob: the same on every rank of
        # an SPMD job, so the coordinator decodes it once (`local_plan_of`'s ``seen``).
        tree = getattr(pd, "tree", None)
        blob = msgpack.packb([[[fqn, list(path)] for fqn, path in pd.items()], tree],
                             use_bin_type=True)
        doc["planner"] = {"layout": getattr(pd, "layout", None), "data": encode_bytes(blob)}
    elif pd is not None:
        raise TypeError(f"planner data of type {type(pd).__name__}: ckptfs's planner sends a "
                        "dict")
    return doc


def _size(raw: Any, what: str) -> torch.Size:
    try:
        return torch.Size(raw)  # ints only: anything else is a TypeError
    except TypeError as exc:
        raise ValueError(f"{what}: a list of ints wanted, got {raw!r:.80}") from exc


#: DCP's write item dataclasses hold their fields in their instance dicts (torch 2.13): a
#: tensor item is then built with its fields set as such, about 3 times faster than through
#: the frozen dataclasses' ``__init__`` (a coordinator at 4,096 ranks builds 200,000).
_PLAIN = all(tuple(f.name for f in dataclasses.fields(cls)) == names for cls, names in (
    (WriteItem, ("index", "type", "bytes_io_data", "tensor_data")),
    (MetadataIndex, ("fqn", "offset", "index")),
    (TensorWriteData, ("chunk", "properties", "size")),
    (ChunkStorageMetadata, ("offsets", "sizes")))) and all(
    "__slots__" not in vars(cls)
    for cls in (WriteItem, MetadataIndex, TensorWriteData, ChunkStorageMetadata))


def _item_of(raw: Any, props: list[TensorProperties]) -> WriteItem:
    if not isinstance(raw, list) or len(raw) not in (5, 8) or not isinstance(raw[0], str):
        raise ValueError(f"a write item: {raw!r:.80}")
    fqn, offset, hint, kind = raw[0], raw[1], raw[2], _KIND_OF.get(raw[3])
    if kind is None:
        raise ValueError(f"write item {fqn!r:.80}: kind {raw[3]!r:.20}")
    if hint is not None and type(hint) is not int:
        raise ValueError(f"write item {fqn!r:.80}: index hint {hint!r:.20}")
    if len(raw) == 5:
        if kind != WriteItemType.BYTE_IO:
            raise ValueError(f"write item {fqn!r:.80}: a tensor without its chunk")
        nbytes = raw[4]
        if nbytes is not None and type(nbytes) is not int:
            raise ValueError(f"write item {fqn!r:.80}: nbytes {nbytes!r:.20}")
        index = MetadataIndex(fqn, None if offset is None else _size(offset, fqn), hint)
        return WriteItem(index=index, type=kind, bytes_io_data=None if nbytes is None
                         else BytesIOWriteData(nbytes=nbytes))
    k = raw[4]
    if kind == WriteItemType.BYTE_IO or type(k) is not int or not 0 <= k < len(props):
        raise ValueError(f"write item {fqn!r:.80}: properties {k!r:.20}")
    offsets = _size(raw[5], fqn)
    at = None if offset is None else offsets if offset == raw[5] else _size(offset, fqn)
    sizes, size = _size(raw[6], fqn), _size(raw[7], fqn)
    if not _PLAIN:  # pragma: no cover - another torch's dataclasses
        return WriteItem(index=MetadataIndex(fqn, at, hint), type=kind,
                         tensor_data=TensorWriteData(
                             chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                             properties=props[k], size=size))
    new = object.__new__
    index = new(MetadataIndex)
    index.__dict__.update(fqn=fqn, offset=at, index=hint)
    chunk = new(ChunkStorageMetadata)
    chunk.__dict__.update(offsets=offsets, sizes=sizes)
    td = new(TensorWriteData)
    td.__dict__.update(chunk=chunk, properties=props[k], size=size)
    item = new(WriteItem)
    item.__dict__.update(index=index, type=kind, bytes_io_data=None, tensor_data=td)
    return item


def _planner_data(text: str) -> tuple[dict[str, tuple[str | int, ...]], Any]:
    """(the flattening map, the skeleton) of a local plan's planner blob."""
    try:
        raw = msgpack.unpackb(decode_bytes(text), raw=False, use_list=True,
                              strict_map_key=True)
    except Exception as exc:  # not base64, not msgpack
        raise ValueError(f"a local save plan's planner data: {exc}") from exc
    if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], list)):
        raise ValueError("a local save plan's planner data: [mappings, tree] wanted")
    mappings: dict[str, tuple[str | int, ...]] = {}
    for pair in raw[0]:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], list)
                and all(type(k) in (str, int) for k in pair[1])):
            raise ValueError(f"a flattening map entry: {pair!r:.80}")
        mappings[pair[0]] = tuple(pair[1])
    return mappings, raw[1]


def items_left_out(doc: Any) -> bool:
    """Whether a local plan's document left its items out (`local_plan_doc`'s
    ``items_known``)."""
    return isinstance(doc, dict) and doc.get("items", ()) is None


def local_plan_of(doc: Any, seen: dict[str, Any] | None = None,
                  known: SavePlan | None = None) -> SavePlan:
    """The local save plan `local_plan_doc` described.  ``seen``: the planner data already
    decoded by the blob it came as (one dict for every rank's plan of one save).  ``known``:
    the plan this rank sent last, whose items a document that left them out has (its layout
    digest must be this one's)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("properties"), list) or \
            not (isinstance(doc.get("items"), list) or items_left_out(doc)):
        raise ValueError("a local save plan: a document with items and properties wanted")
    if items_left_out(doc):
        layout = (doc.get("planner") or {}).get("layout")
        if known is None or layout is None or \
                getattr(known.planner_data, "layout", None) != layout:
            raise ValueError("a local save plan without its items, and no earlier plan of its "
                             "layout")
        items = known.items
    else:
        props = [_properties_of(p) for p in doc["properties"]]
        items = [_item_of(raw, props) for raw in doc["items"]]
    planner = doc.get("planner")
    planner_data: PlanMappings | None = None
    if planner is not None:
        if not isinstance(planner, dict) or not isinstance(planner.get("data"), str):
            raise ValueError("a local save plan's planner data: its mappings wanted")
        layout = planner.get("layout")
        if layout is not None and not isinstance(layout, str):
            raise ValueError("a local save plan's layout digest: a string wanted")
        decoded = seen.get(planner["data"]) if seen is not None else None
        if decoded is None:
            decoded = _planner_data(planner["data"])
            if seen is not None:
                seen[planner["data"]] = decoded
        planner_data = PlanMappings(decoded[0])
        planner_data.tree, planner_data.layout = decoded[1], layout
    step = doc.get("step")
    if type(step) is not int:
        raise ValueError(f"a local save plan's step: {step!r:.40}")
    return SavePlan(items, storage_data=step, planner_data=planner_data,
                    usable=bool(doc.get("usable", True)))


# ----------------------------------------------------------------------------------------------
# A rank's part of the global plan


def part_doc(local: SavePlan, part: SavePlan) -> dict[str, Any]:
    """Rank ``i``'s part ``part`` of the global plan (its ``storage_data`` the `AttemptPlan`)
    as the positions, in its local plan ``local``, of the items it writes, with their index
    hints.  The part's items must be the local plan's, in order, but for their index hints."""
    ap = part.storage_data
    if not isinstance(ap, AttemptPlan):
        raise ValueError("a global plan part without its attempt")
    keep: list[list[Any]] = []
    pos, n = 0, len(local.items)
    for item in part.items:
        idx = item.index
        while pos < n and not (local.items[pos].index.fqn == idx.fqn
                               and local.items[pos].index.offset == idx.offset):
            pos += 1
        if pos == n or local.items[pos].type != item.type:
            raise ValueError(f"rank {ap.rank}: the global plan's item {idx.fqn!r:.80} is not "
                             "one of its local plan's items, in order")
        keep.append([pos, idx.index])
        pos += 1
    return {"attempt": ap.attempt, "rank": ap.rank, "items": keep}


def part_of(doc: Any, local: SavePlan) -> SavePlan:
    """This rank's part of the global plan from `part_doc` and its own local plan."""
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list) or \
            not isinstance(doc.get("attempt"), str) or type(doc.get("rank")) is not int:
        raise ValueError("a global plan part: attempt, rank and items wanted")
    items = []
    last = -1
    for pair in doc["items"]:
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int
                and last < pair[0] < len(local.items)
                and (pair[1] is None or type(pair[1]) is int)):
            raise ValueError(f"a global plan part's item: {pair!r:.80}")
        last = pair[0]
        item = local.items[pair[0]]
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
    "index", "size_in_bytes", "storage_data") and "__slots__" not in vars(WriteResult)


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
        if not (_PLAIN and _PLAIN_REPORT):  # pragma: no cover - another torch
            out.append(WriteResult(index=MetadataIndex(raw[0], offset, raw[2]),
                                   size_in_bytes=raw[3], storage_data=report))
            continue
        index = new(MetadataIndex)
        index.__dict__.update(fqn=raw[0], offset=offset, index=raw[2])
        wr = new(WriteResult)
        wr.__dict__.update(index=index, size_in_bytes=raw[3], storage_data=report)
        out.append(wr)
    return out
