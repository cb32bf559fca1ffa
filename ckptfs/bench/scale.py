"""``ckptfs bench scale``: where the fixed cost of a sharded save and load goes at 8 to 4,096
ranks, simulated in one process, beside DCP's own planners on the same plans.

Nothing here is a model of ckptfs: the simulator builds the local save plans every rank would
send (DCP's ``SavePlan``/``WriteItem``/``ChunkStorageMetadata`` objects, exactly as DCP's
``create_local_plan`` makes them for a DTensor state, without a process group) and runs
ckptfs's and DCP's **real** coordinator and reader code on them:

* **ckptfs save (the coordinator)**: the coordinator's two rounds of ckptfs's collective save
  (`ckptfs.protocol.save_rounds.SaveRounds`: ``plan_globally`` on every rank's plan document,
  ``commit`` on every rank's write results), in which ``create_global_plan`` of
  ``ckptfs.dcp.SavePlanner``
  (`SavePlanner`), ``prepare_global_plan`` of ``ckptfs.dcp.Writer`` (`ShardedWriter`: the
  attempt, every reader limit checked on the placeholder manifest) and its ``finish`` (the
  reported chunks checked, ``dcp.msgpack`` encoded and
  written, the listing, ``MANIFEST.json`` and the marker), on a real local store
  (``/dev/shm`` where there is one).  The ranks' ``write_data`` is not run: its write results
  are made as the writer makes them (items ordered by element size, offsets from
  `plan_header`, one header chunk per file), and each rank file is created sparse, with its
  size, so the coordinator's listing finds it;
* **DCP save**: ``DefaultSavePlanner.create_global_plan`` and ``FileSystemWriter``'s
  ``prepare_global_plan`` and ``finish`` (its pickled ``.metadata``) on the same local plans;
* **what crosses between ranks**: ckptfs's JSON documents (each rank's plan and write results
  gathered on the coordinator, each rank's own part of the global plan scattered back, the
  outcome, the committed `CheckpointInfo`, to every rank) and the time the coordinator spends
  encoding and decoding them; DCP's pickled plans both ways and the whole global metadata its
  ``dcp.save`` broadcasts to every rank at the end; **all in**: the coordinator's work plus
  its side of every message (decoding what it gathers, encoding what it sends, one rank's
  decoding of the outcome): what every rank of the job waits for, bar the transport;
* **the collective load's plan round** (`ckptfs.bench.scale_load`): ckptfs's rounds against
  DCP's pickled load plans and the every-rank needs exchange they replace;
* **each loading rank**: ckptfs's ``Reader`` resolving the step (marker and manifest read and
  decoded) and ``load_document`` (``dcp.msgpack`` read, digest checked, decoded and bound to the
  manifest), against DCP's ``FileSystemReader.read_metadata`` (its ``.metadata`` unpickled).
  The local load planning that follows (0.05-0.24 s at 1,024 ranks) needs DTensors, so a
  process group: not simulated.

The state is a Llama-3-70B-shaped slice (dim 8192, 64 heads of 128 with 8 KV heads, FFN 28672,
vocabulary 128256): the embeddings, ``--layers`` decoder layers, the final norm and the output
projection, each parameter with AdamW's ``exp_avg`` and ``exp_avg_sq`` (DTensors) and its
``step`` (a plain 0-dim tensor, the same on every rank), and the 12 values of AdamW's
``param_groups`` plus a training step: with one layer, 48 tensors (36 DTensors) and 13 values,
laid out as ``{"model": ..., "optim": get_optimizer_state_dict(...)}``.  The meshes:

* ``fsdp``: FSDP2, ``Shard(0)`` over all W ranks (uneven shards as ``torch.chunk`` cuts them);
* ``hsdp``: ``(Replicate(), Shard(0))`` on a ``(W / S, S)`` mesh, ``S = --hsdp-shard`` (8): each
  shard group holds the whole state, the replicas' copies are deduplicated by the planners;
* ``tp``: tensor parallel over all W ranks as torchtitan lays out Llama: ``wq``/``wk``/``wv``/
  ``w1``/``w3``/embeddings/output ``Shard(0)``, ``wo``/``w2`` ``Shard(1)``, norms ``Replicate()``.

``--real 2,4`` runs the same shapes (shrunk by ``--shrink``, 64: a few MB) as real gloo jobs
(ckptfs's collective save, `drive_save`, through its writer and planner, spawned ranks), and
checks the simulator against
them: ``dcp.msgpack`` equal to the byte (once the attempt name and the root, which differ by
construction, are put equal), the manifest's files and chunks equal, and the coordinator's time
within 2x.

``--json PATH`` writes the results; the growth in W (the log-log slope of a least-squares fit)
of each figure is printed under the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import math
import os
import pickle
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ckptfs
from ckptfs.bench.scale_load import load_round, load_round_table
from ckptfs.bench.scale_report import growth, load_table, plot, table
from ckptfs.protocol.sharded import SavePlanner
from ckptfs.protocol.sharded_io import ShardedWriter
from ckptfs.protocol.sharded_read import ShardedReader

#: The worlds of a default run and of ``--quick``.
DEFAULT_WORLDS = (8, 64, 256, 1024, 4096)
QUICK_WORLDS = (8, 64, 256)
MESHES = ("fsdp", "hsdp", "tp")
#: Llama-3-70B: model dim, KV projection rows (8 heads x 128), FFN hidden dim, vocabulary.
LLAMA3_70B = {"dim": 8192, "kv": 1024, "ffn": 28672, "vocab": 128256}
#: AdamW's ``param_groups[0]`` (torch 2.13 defaults) but ``params``, which holds the names.
ADAMW_GROUP: dict[str, Any] = {
    "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
    "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
    "fused": None, "decoupled_weight_decay": True}
#: The simulated save's step.
STEP = 1


@dataclass(frozen=True)
class Spec:
    """The simulated state and mesh: ``shrink`` divides every dimension (the real gloo check
    uses the 70B shapes shrunk to a few MB)."""

    mesh: str = "fsdp"
    layers: int = 1
    shrink: int = 1
    hsdp_shard: int = 8
    durable: bool = True

    def __post_init__(self) -> None:
        if self.mesh not in MESHES:
            raise ValueError(f"unknown mesh {self.mesh!r}: one of {', '.join(MESHES)}")
        if self.layers < 1 or self.shrink < 1 or self.hsdp_shard < 1:
            raise ValueError("layers, shrink and hsdp_shard must be >= 1")


@dataclass(frozen=True)
class Leaf:
    """One leaf of the flattened state, in DCP's flattening order: ``kind`` is ``dtensor``
    (sharded per ``tp_dim`` on a TP mesh), ``tensor`` (a plain 0-dim float32, on every rank) or
    ``value`` (``value``, a non-tensor)."""

    fqn: str
    path: tuple[str | int, ...]
    kind: str
    shape: tuple[int, ...] = ()
    tp_dim: int | None = 0
    value: Any = None


def param_shapes(spec: Spec) -> list[tuple[str, tuple[int, ...], int | None]]:
    """``(name, shape, dim sharded by TP or None)`` of every parameter, in module order."""
    d, kv, ffn, vocab = (max(1, LLAMA3_70B[k] // spec.shrink) for k in ("dim", "kv", "ffn",
                                                                         "vocab"))
    out: list[tuple[str, tuple[int, ...], int | None]] = [("tok_embeddings.weight", (vocab, d), 0)]
    for i in range(spec.layers):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (d, d), 0), (p + "attention.wk.weight", (kv, d), 0),
                (p + "attention.wv.weight", (kv, d), 0), (p + "attention.wo.weight", (d, d), 1),
                (p + "feed_forward.w1.weight", (ffn, d), 0),
                (p + "feed_forward.w2.weight", (d, ffn), 1),
                (p + "feed_forward.w3.weight", (ffn, d), 0),
                (p + "attention_norm.weight", (d,), None), (p + "ffn_norm.weight", (d,), None)]
    out += [("norm.weight", (d,), None), ("output.weight", (vocab, d), 0)]
    return out


def leaves(spec: Spec) -> list[Leaf]:
    """The flattened state ``{"model": ..., "optim": ..., "train_step": ...}`` as DCP's
    ``flatten_state_dict`` orders it (depth first, dict order; a list of plain values is one
    value)."""
    params = param_shapes(spec)
    out = [Leaf(f"model.{n}", ("model", n), "dtensor", s, t) for n, s, t in params]
    for n, s, t in params:
        out.append(Leaf(f"optim.state.{n}.step", ("optim", "state", n, "step"), "tensor"))
        out += [Leaf(f"optim.state.{n}.{k}", ("optim", "state", n, k), "dtensor", s, t)
                for k in ("exp_avg", "exp_avg_sq")]
    group = {**ADAMW_GROUP, "params": [n for n, _, _ in params]}
    out += [Leaf(f"optim.param_groups.0.{k}", ("optim", "param_groups", 0, k), "value",
                 value=v) for k, v in group.items()]
    out.append(Leaf("train_step", ("train_step",), "value", value=1000))
    return out


def placement(spec: Spec, leaf: Leaf, world: int, rank: int) -> tuple[int | None, int, int]:
    """How ``leaf`` is cut on ``rank``: (sharded dim or None, shards, this rank's shard)."""
    if spec.mesh == "fsdp":
        return 0, world, rank
    if spec.mesh == "hsdp":
        s = min(spec.hsdp_shard, world)
        if world % s:
            raise ValueError(f"hsdp: {world} ranks are not a multiple of the shard group {s}")
        return 0, s, rank % s
    return leaf.tp_dim, world, rank


def local_chunk(shape: tuple[int, ...], dim: int | None, shards: int, index: int
                ) -> tuple[list[int], list[int]]:
    """(offsets, sizes) of shard ``index`` of ``shards`` along ``dim`` (DTensor's own rule,
    ``Shard.local_shard_size_and_offset``: ``torch.chunk``'s cut, an empty shard at the end)."""
    from ckptfs.torch_compat import shard_size_and_offset

    offsets, sizes = [0] * len(shape), list(shape)
    if dim is not None:
        sizes[dim], offsets[dim] = shard_size_and_offset(shape[dim], shards, index)
    return offsets, sizes


def local_plan(spec: Spec, state: list[Leaf], world: int, rank: int,
               mappings: dict[str, tuple[str | int, ...]]) -> Any:
    """The ``SavePlan`` DCP's ``create_local_plan`` makes on ``rank`` for this state (fresh
    objects per item, as DCP's, so pickled sizes are the real ones)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    def props() -> TensorProperties:
        return TensorProperties(dtype=torch.float32, layout=torch.strided, requires_grad=False,
                                memory_format=torch.contiguous_format, pin_memory=False)

    items = []
    for leaf in state:
        if leaf.kind == "value":
            items.append(WriteItem(index=MetadataIndex(leaf.fqn), type=WriteItemType.BYTE_IO))
            continue
        if leaf.kind == "tensor":
            offs = torch.Size([0] * len(leaf.shape))
            items.append(WriteItem(
                index=MetadataIndex(leaf.fqn, offs), type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offs, sizes=torch.Size(leaf.shape)),
                    properties=props(), size=torch.Size(leaf.shape))))
            continue
        dim, shards, index = placement(spec, leaf, world, rank)
        o, s = local_chunk(leaf.shape, dim, shards, index)
        offs, sizes = torch.Size(o), torch.Size(s)
        items.append(WriteItem(
            index=MetadataIndex(leaf.fqn, offs), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offs, sizes=sizes),
                                        properties=props(), size=torch.Size(leaf.shape))))
    from ckptfs.protocol.plan_table import PlanMappings

    return SavePlan(items, planner_data=PlanMappings(mappings))


def local_plans(spec: Spec, world: int) -> list[Any]:
    state = leaves(spec)
    mappings = {leaf.fqn: leaf.path for leaf in state}
    return [local_plan(spec, state, world, r, mappings) for r in range(world)]


# ----------------------------------------------------------------------------------------------
# What every rank's write_data would report (ckptfs), without writing the data


def planned_item(item: Any, value_bytes: int) -> Any:
    """The rank-file entry ckptfs's writer plans for a write item (the writer's own rule)."""
    from torch.distributed.checkpoint.planner import WriteItemType

    from ckptfs.format.sharded import PlannedItem, element_size, item_name, tensor_code

    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return PlannedItem(item_name(item.index.fqn, None), "U8", (value_bytes,), value_bytes)
    td = item.tensor_data
    code = tensor_code(td.properties.dtype, item.index.fqn)
    shape = tuple(int(s) for s in td.chunk.sizes)
    return PlannedItem(item_name(item.index.fqn, td.chunk.offsets), code, shape,
                       math.prod(shape) * element_size(code))


def encoded_values(state: list[Leaf]) -> dict[str, bytes]:
    """Each value as ckptfs's planner encodes it (tagged msgpack)."""
    from ckptfs.format.sharded import encode_value

    return {leaf.fqn: encode_value(leaf.value, key=leaf.fqn, path=leaf.path)
            for leaf in state if leaf.kind == "value"}


def ckptfs_write_results(plans: list[Any], values: Mapping[str, bytes], algorithm: str,
                         store_checksums: tuple[tuple[str, str], ...] = ()
                         ) -> tuple[list[list[Any]], list[tuple[str, int]]]:
    """The write results each rank of the global plan ``plans`` would send the coordinator
    (placeholder digests of the right length), and each rank file (path, size)."""
    from torch.distributed.checkpoint.storage import WriteResult

    from ckptfs.format.sharded import Chunk, element_size, plan_header, rank_file_name
    from ckptfs.protocol.commit import placeholder_digest
    from ckptfs.protocol.sharded_io import ItemReport

    hexd = placeholder_digest(algorithm).split(":", 1)[1]
    results: list[list[Any]] = []
    files: list[tuple[str, int]] = []
    for rank, plan in enumerate(plans):
        own = [(item, planned_item(item, len(values.get(item.index.fqn, b""))))
               for item in plan.items]
        own.sort(key=lambda p: -element_size(p[1].dtype))
        if not own:
            results.append([])
            continue
        header, offsets = plan_header([p for _, p in own], rank)
        relpath = rank_file_name(rank)
        size = offsets[-1] + own[-1][1].nbytes
        head = Chunk(0, len(header), hexd)
        out = []
        for i, ((item, pi), off) in enumerate(zip(own, offsets, strict=True)):
            first = i == 0
            out.append(WriteResult(item.index, pi.nbytes, ItemReport(
                relpath, off, pi.nbytes, hexd, rank, size if first else -1,
                head if first else None, store_checksums=store_checksums if first else ())))
        results.append(out)
        files.append((relpath, size))
    return results, files


def dcp_write_results(plans: list[Any], values: Mapping[str, int]) -> list[list[Any]]:
    """The write results of DCP's ``FileSystemWriter`` (one ``__R_0.distcp`` per rank, values
    first; a tensor's length is its bytes plus ``torch.save``'s ~1 KB of framing)."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from ckptfs.torch_compat import lookup

    storage_info = lookup("torch.distributed.checkpoint.filesystem", "_StorageInfo")
    results = []
    for rank, plan in enumerate(plans):
        out, pos, name = [], 0, f"__{rank}_0.distcp"
        ordered = sorted(plan.items, key=lambda it: it.type != WriteItemType.BYTE_IO)
        for item in ordered:
            if item.type == WriteItemType.BYTE_IO:
                n = values[item.index.fqn]
            else:
                td = item.tensor_data
                n = math.prod(td.chunk.sizes) * td.properties.dtype.itemsize + 1088
            out.append(WriteResult(item.index, n, storage_info(name, pos, n)))
            pos += n
        results.append(out)
    return results


# ----------------------------------------------------------------------------------------------
# One world size


def dcp_writer(root: str, durable: bool) -> ShardedWriter:
    """What ``ckptfs.dcp.Writer(root, STEP, durable=durable)`` is."""
    store = ckptfs.open(root, durable=durable)
    return ShardedWriter(store.storage, STEP,
                         store.options.but(durable=durable, metadata_layout=None))


def dcp_reader(root: str) -> ShardedReader:
    """What ``ckptfs.dcp.Reader(root, STEP)`` is."""
    store = ckptfs.open(root)
    return ShardedReader(store.storage, STEP, threads=store.threads)


def _timed(fn: Callable[..., Any], *args: Any, collect: bool = False) -> tuple[Any, float]:
    """``fn(*args)`` and its seconds; ``collect``: a full garbage collection first, so the timed
    call starts without the previous step's garbage (it costs ~0.3 s with torch loaded)."""
    if collect:
        gc.collect()
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def _pickled(plans: Sequence[Any]) -> tuple[int, float]:
    """Bytes of ``plans`` pickled one by one (DCP's gather/scatter), and the time to pickle
    and unpickle them all (what the coordinator does with its side of the collective)."""
    t0 = time.perf_counter()
    blobs = [pickle.dumps(p) for p in plans]
    for b in blobs:
        pickle.loads(b)
    return sum(map(len, blobs)), time.perf_counter() - t0


def _median_time(fn: Callable[[], Any], reps: int) -> tuple[Any, float]:
    times, out = [], None
    for _ in range(reps):
        out, t = _timed(fn)
        times.append(t)
    return out, statistics.median(times)


def sparse_files(write_dir: Path, files: Sequence[tuple[str, int]]) -> None:
    """Each rank file, with its size and no data (the coordinator only lists them)."""
    for relpath, size in files:
        p = write_dir / relpath
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            f.truncate(size)


class _Timer:
    """Seconds spent in ``obj.method`` (wrapped on the instance) while it is installed."""

    def __init__(self, obj: Any, method: str) -> None:
        self.seconds = 0.0
        inner = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(obj, method, timed)


def _sent(docs: Sequence[Any]) -> tuple[list[Any], int, float]:
    """What the coordinator does with its side of the JSON messages ``docs`` (encoded by their
    ranks): (the documents as received, their bytes, the seconds to decode them all)."""
    from ckptfs.protocol.gcpause import paused_collector
    from ckptfs.protocol.group import decode, encode

    blobs = [encode(d) for d in docs]
    t0 = time.perf_counter()
    with paused_collector():  # as `drive_save` receives them
        got = [decode(b) for b in blobs]
    return got, sum(map(len, blobs)), time.perf_counter() - t0


def _encoded(docs: Sequence[Any]) -> tuple[list[Any], int, float]:
    """The coordinator's side of messages it sends: (the documents as each rank receives them,
    their bytes, the seconds to encode them all)."""
    from ckptfs.protocol.gcpause import paused_collector
    from ckptfs.protocol.group import decode, encode

    t0 = time.perf_counter()
    with paused_collector():  # as `drive_save` sends them
        blobs = [encode(d) for d in docs]
    dt = time.perf_counter() - t0
    return [decode(b) for b in blobs], sum(map(len, blobs)), dt


def writer_balance(plans: Sequence[Any]) -> float:
    """The bytes the busiest rank writes over the mean, of a global save plan."""
    loads = [sum(math.prod(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize
                 for i in p.items if i.tensor_data is not None) for p in plans]
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean else 1.0


def coordinated_save(spec: Spec, root: str, step: int, local_plans: list[Any],
                     values: Mapping[str, bytes], *, per_rank: bool = False,
                     collect: bool = True) -> dict[str, Any]:
    """One simulated collective save of step ``step`` under ``root``: the coordinator's two
    rounds (`SaveRounds.plan_globally`, `SaveRounds.commit`, each timed) on the documents of
    every rank's ``local_plans`` (their items left out after the first save, `STEP`, as a
    layout already planned sends them), each rank's part and write results made as the writer
    makes them (``per_rank``: format v5, each rank's index document written by the writer's
    own ``write_index``), the messages through their JSON.  The seconds and bytes of each
    part, the writer and the rank files."""
    from ckptfs.protocol.commit import Attempt
    from ckptfs.protocol.group import decode, encode
    from ckptfs.protocol.plan_docs import local_plan_doc, part_of, results_doc
    from ckptfs.protocol.plan_table import LocalTable
    from ckptfs.protocol.resolve import CheckpointInfo
    from ckptfs.protocol.save_rounds import SaveRounds
    from ckptfs.protocol.sharded_io import AttemptPlan

    store = ckptfs.open(root, durable=spec.durable)
    writer = ShardedWriter(store.storage, step, store.options.but(
        durable=spec.durable, metadata_layout="per-rank" if per_rank else None))
    planner = SavePlanner(gather_small=per_rank)  # as a per-rank save's planner
    planner.set_up_planner({}, writer.storage_meta(), True)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    rounds = SaveRounds({}, writer, planner, 0)
    t_create = _Timer(planner, "create_global_table")
    t_prep = _Timer(writer, "prepare_table")
    plans = [writer.prepare_local_plan(p) for p in local_plans]
    # After the first save each rank knows its layout was sent: its items are left out.
    docs, gather_b, gather_s = _sent([{"plan": local_plan_doc(
        p, known=None if step == STEP else LocalTable.of_plan(p).layout)} for p in plans])
    parts, t_plan = _timed(rounds.plan_globally, docs, collect=collect)
    del docs
    if "failures" in parts[0]:
        raise rounds.own or AssertionError(parts[0])
    parts, scatter_b, scatter_s = _encoded(parts)
    gplans = [part_of(d["part"], lp) for d, lp in zip(parts, plans, strict=True)]
    del parts, plans
    balance = writer_balance(gplans)
    attempt = gplans[0].storage_data
    assert isinstance(attempt, AttemptPlan)
    att = Attempt.join(writer.storage, step, attempt.attempt, algorithm=writer.algorithm)
    checksums = () if per_rank else tuple((a, "0" * 8) for a in att.store_checksums)
    results, files = ckptfs_write_results(gplans, values, writer.algorithm, checksums)
    sparse_files(Path(root) / att.write_dir, files)
    t_index = 0.0
    if writer.per_rank is not None:
        pr = writer.per_rank

        def write_indexes(gplans: list[Any], results: list[list[Any]]) -> list[list[Any]]:
            return [pr.write_index(attempt.attempt, r, p.items, res)
                    for r, (p, res) in enumerate(zip(gplans, results, strict=True))]

        results, t_index = _timed(write_indexes, gplans, results, collect=collect)
    del gplans
    docs, results_b, results_s = _sent([{"results": results_doc(r)} for r in results])
    del results
    outcome, t_finish = _timed(rounds.commit, docs, collect=collect)
    del docs
    if "failures" in outcome:
        raise rounds.own or AssertionError(outcome)
    blob, t_dumps = _timed(encode, outcome)
    _, t_outcome = _timed(lambda: CheckpointInfo.from_doc(decode(blob)["info"]))
    return {"writer": writer, "files": files, "plan_s": t_plan, "create_s": t_create.seconds,
            "prepare_s": t_prep.seconds, "finish_s": t_finish, "index_s": t_index,
            "messages_bytes": gather_b + scatter_b + results_b,
            "messages_s": gather_s + scatter_s + results_s + t_dumps,
            "outcome_bytes": len(blob), "outcome_s": t_outcome, "writers_balance": balance}


def simulate_ckptfs(spec: Spec, world: int, root: str, *, plans: list[Any] | None = None,
                    reps: int = 1, collect: bool = True) -> dict[str, Any]:
    """ckptfs's coordinator, the messages and one loading rank, on ``world`` simulated ranks,
    committing step `STEP` under ``root`` (a local directory): the coordinator's side of
    ckptfs's collective save (`ckptfs.protocol.save_rounds.SaveRounds`: ``plan_globally`` on
    every rank's plan document, ``commit`` on every rank's write results), each rank's part and
    the outcome as their JSON.  ``collect``: a full garbage collection before each timed step
    (see `_timed`)."""
    from ckptfs.format.layout import MANIFEST_NAME, StepPaths
    from ckptfs.format.sharded import METADATA_NAME

    state = leaves(spec)
    values = encoded_values(state)
    raw = plans if plans is not None else local_plans(spec, world)

    def save(step: int) -> dict[str, Any]:
        r = coordinated_save(spec, root, step, raw, values, collect=collect)
        return {"info": r["writer"].info, "coordinator_s": r["plan_s"] + r["finish_s"],
                # what the job waits for at the coordinator, its messages included
                "coordinator_all_in_s": r["plan_s"] + r["finish_s"] + r["messages_s"]
                + r["outcome_s"],
                "create_global_plan_s": r["create_s"], "prepare_global_plan_s": r["prepare_s"],
                "plan_messages_s": r["plan_s"] - r["create_s"] - r["prepare_s"],
                "finish_s": r["finish_s"], "plans_bytes": r["messages_bytes"],
                "plans_pickle_s": r["messages_s"], "broadcast_bytes": r["outcome_bytes"],
                "broadcast_unpickle_s": r["outcome_s"], "writers_balance": r["writers_balance"]}

    first = save(STEP)
    # The next save of the same layout: its ranks send no items (the coordinator has them),
    # its global plan and placeholder check are the last ones.
    again = save(STEP + 1)
    raw = []
    info = first.pop("info")
    assert info is not None
    adir = Path(root) / info.path
    sizes = {"dcp_msgpack": (adir / METADATA_NAME).stat().st_size,
             "manifest": (adir / MANIFEST_NAME).stat().st_size,
             "marker": (Path(root) / StepPaths(STEP).marker).stat().st_size}

    def load() -> tuple[float, float]:
        reader = dcp_reader(root)
        _, t_resolve = _timed(reader.resolve, collect=collect)
        _, t_doc = _timed(reader.load_document)
        return t_resolve + t_doc, t_doc

    loads = [load() for _ in range(reps)]
    t_resolve = statistics.median(t - d for t, d in loads)
    t_doc = statistics.median(d for _, d in loads)
    return {
        **first, "coordinator_again_s": again["coordinator_s"],
        "coordinator_all_in_again_s": again["coordinator_all_in_s"],
        "plans_again_bytes": again["plans_bytes"],
        "create_global_plan_again_s": again["create_global_plan_s"],
        "prepare_global_plan_again_s": again["prepare_global_plan_s"],
        "finish_again_s": again["finish_s"],
        "metadata_bytes": sizes["dcp_msgpack"] + sizes["manifest"], **{
            f"{k}_bytes": v for k, v in sizes.items()},
        "read_per_rank_bytes": sum(sizes.values()),
        "load_resolve_s": t_resolve, "load_document_s": t_doc,
        "load_per_rank_s": t_resolve + t_doc,
        "attempt": info.attempt, "path": info.path,
    }


def regions_of_plan(plan: Any) -> dict[str, Any]:
    """What a rank loads into the state it saved (``plan``: its local save plan): each
    DTensor's local chunk, each plain tensor whole, each value (None): the regions
    `ShardedReader` reads the metadata of (format v5)."""
    out: dict[str, Any] = {}
    for item in plan.items:
        if item.tensor_data is None:
            out[item.index.fqn] = None
        else:
            c = item.tensor_data.chunk
            out.setdefault(item.index.fqn, []).append(
                (tuple(int(o) for o in c.offsets), tuple(int(x) for x in c.sizes)))
    return out


def simulate_v5(spec: Spec, world: int, root: str, *, plans: list[Any] | None = None,
                reps: int = 1, collect: bool = True) -> dict[str, Any]:
    """Format v5 (``metadata_layout="per-rank"``, docs/protocol.md §9.7) on the same plans: the
    coordinator (the same three calls as `simulate_ckptfs`; each rank's ``write_data`` is
    replaced by its write results and its index document, written by the writer's own
    ``write_index``), then the loading ranks 0 and W - 1, each loading what it saved: marker,
    manifest, spec, the table blocks and the index documents of the ranks holding its regions
    (read, checked, decoded), and those ranks' directories listed.  Per loading rank: the
    bytes read and decoded (all of them are decoded) and the seconds; the larger of the two
    ranks is reported."""
    from ckptfs.format.layout import MANIFEST_NAME, StepPaths
    from ckptfs.format.rank_metadata import block_name

    state = leaves(spec)
    values = encoded_values(state)
    raw = plans if plans is not None else local_plans(spec, world)
    regions = {r: regions_of_plan(raw[r]) for r in sorted({0, world - 1})}

    def save(step: int) -> dict[str, Any]:
        r = coordinated_save(spec, root, step, raw, values, per_rank=True, collect=collect)
        # prepare_global_plan_s here: the writer's and the messages' part of the plan round
        return {"writer": r["writer"], "files": r["files"], "create_global_plan_s": r["create_s"],
                "prepare_global_plan_s": r["plan_s"] - r["create_s"],
                "finish_s": r["finish_s"], "rank_index_s": r["index_s"],
                "coordinator_s": r["plan_s"] + r["finish_s"],
                "coordinator_all_in_s": r["plan_s"] + r["finish_s"] + r["messages_s"]
                + r["outcome_s"]}

    first = save(STEP)
    again = save(STEP + 1)  # the next save of the same layout: no items sent, the plan cached
    raw = []
    writer, files = first.pop("writer"), first.pop("files")
    t_plan, t_prepare, t_finish = (first["create_global_plan_s"],
                                   first["prepare_global_plan_s"], first["finish_s"])
    t_index = first["rank_index_s"]
    info = writer.info
    assert info is not None
    adir = Path(root) / info.path
    marker = (Path(root) / StepPaths(STEP).marker).stat().st_size
    manifest = (adir / MANIFEST_NAME).stat().st_size
    listed = sum(e.size for e in info.manifest.files)
    per = info.manifest.rank_table.rows_per_block

    def load(rank: int) -> tuple[float, int]:
        reader = ShardedReader(ckptfs.open(root).storage, STEP, regions=regions[rank])
        _, t_resolve = _timed(reader.resolve, collect=collect)
        _, t_doc = _timed(reader.load_document)
        view = reader.resolve().manifest
        ranks = {e.rank for e in view.files if e.rank is not None}  # type: ignore[attr-defined]
        indexes = sum(e.size for e in view.files if e.path.endswith("index.msgpack"))
        blocks = sum(view.chunked(block_name(b)).size for b in {r // per for r in ranks})
        spec_bytes = view.chunked("dcp-spec.msgpack").size
        return t_resolve + t_doc, marker + manifest + spec_bytes + blocks + indexes

    loads = {r: [load(r) for _ in range(reps)] for r in regions}
    t_load = max(statistics.median(t for t, _ in ls) for ls in loads.values())
    read = max(ls[0][1] for ls in loads.values())
    return {
        "coordinator_s": t_plan + t_prepare + t_finish, "create_global_plan_s": t_plan,
        "prepare_global_plan_s": t_prepare, "finish_s": t_finish, "rank_index_s": t_index,
        "coordinator_again_s": again["coordinator_s"],
        "coordinator_all_in_s": first["coordinator_all_in_s"],
        "coordinator_all_in_again_s": again["coordinator_all_in_s"],
        "metadata_bytes": listed + manifest + info.manifest.rank_table.rank_bytes
        - sum(size for _, size in files),
        "manifest_bytes": manifest, "marker_bytes": marker,
        "read_per_rank_bytes": read, "decoded_per_rank_bytes": read,
        "load_per_rank_s": t_load, "attempt": info.attempt, "path": info.path,
    }


def simulate_dcp(spec: Spec, world: int, root: str, *, reps: int = 1,
                 collect: bool = True) -> dict[str, Any]:
    """DCP's ``DefaultSavePlanner`` and ``FileSystemWriter`` coordinator on the same plans, its
    pickled ``.metadata``, and one loading rank's ``read_metadata``."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    state = leaves(spec)
    sizes = {}
    for leaf in state:
        if leaf.kind == "value":
            buf = io.BytesIO()
            torch.save(leaf.value, buf)
            sizes[leaf.fqn] = buf.tell()
    plans = [dataclasses.replace(p, planner_data=dict(p.planner_data))  # DCP's plain map
             for p in local_plans(spec, world)]
    planner = DefaultSavePlanner()
    planner.set_up_planner({}, None, True)
    writer = FileSystemWriter(root)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    writer.prepare_local_plan(plans[0])
    gather_b, gather_s = _pickled(plans)
    (gplans, metadata), t_plan = _timed(planner.create_global_plan, plans,
                                        collect=collect)
    gplans, t_prepare = _timed(writer.prepare_global_plan, gplans)
    balance = writer_balance(gplans)
    scatter_b, scatter_s = _pickled(gplans)
    results = dcp_write_results(gplans, sizes)
    del plans, gplans
    _, t_finish = _timed(writer.finish, metadata, results, collect=collect)
    del results
    blob, t_dumps = _timed(pickle.dumps, metadata, collect=collect)
    _, t_bcast = _timed(pickle.loads, blob)
    del metadata
    md_bytes = (Path(root) / ".metadata").stat().st_size
    if collect:
        gc.collect()
    _, t_load = _median_time(lambda: FileSystemReader(root).read_metadata(), reps)
    return {
        "coordinator_s": t_plan + t_prepare + t_finish, "create_global_plan_s": t_plan,
        "coordinator_all_in_s": t_plan + t_prepare + t_finish + gather_s + scatter_s + t_dumps
        + t_bcast,
        "prepare_global_plan_s": t_prepare, "finish_s": t_finish,
        "plans_bytes": gather_b + scatter_b, "plans_pickle_s": gather_s + scatter_s + t_dumps,
        "broadcast_bytes": len(blob), "broadcast_unpickle_s": t_bcast,
        "metadata_bytes": md_bytes, "read_per_rank_bytes": md_bytes, "load_per_rank_s": t_load,
        "writers_balance": balance,
    }


def scratch_root() -> str:
    """Where simulated checkpoints go: memory-backed ``/dev/shm`` where there is one (the
    coordinator's fsyncs and listings are then storage-cheap, as they are locally)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


def simulate(spec: Spec, world: int, *, reps: int | None = None,
             collect: bool = True) -> dict[str, Any]:
    """One row of the table: ckptfs and DCP at ``world`` simulated ranks (loads timed
    ``reps`` times, the median; default 3 up to 256 ranks, else 1)."""
    reps = reps if reps is not None else (3 if world <= 256 else 1)
    tmp = tempfile.mkdtemp(prefix="ckptfs-scale-", dir=scratch_root())
    try:
        plans = local_plans(spec, world)
        counts = {"items_per_rank": len(plans[0].items),
                  "tensors": sum(1 for leaf in leaves(spec) if leaf.kind != "value"),
                  "values": sum(1 for leaf in leaves(spec) if leaf.kind == "value")}
        ours = simulate_ckptfs(spec, world, f"{tmp}/ckptfs", plans=plans, reps=reps,
                               collect=collect)
        load = load_round(f"{tmp}/ckptfs", STEP, plans)  # the collective load's plan round
        del plans
        v5 = simulate_v5(spec, world, f"{tmp}/v5", reps=reps, collect=collect)
        theirs = simulate_dcp(spec, world, f"{tmp}/dcp", reps=reps, collect=collect)
        return {"world": world, "mesh": spec.mesh, "layers": spec.layers, **counts,
                "ckptfs": ours, "v5": v5, "dcp": theirs, "load_round": load}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Real gloo jobs of the same shapes: the check of the simulator


def real_rank(rank: int, world: int, spec_doc: dict[str, Any]) -> dict[str, Any]:
    """One rank of a real gloo job: the simulator's state as DTensors (zeros) on the spec's
    mesh, saved by ckptfs's collective save (`drive_save`, as ``store.save`` runs it) through
    its writer and planner; the coordinator's time in the two rounds the simulator times
    (``plan_globally``, ``commit``) and in the three functions inside them."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ckptfs.protocol.group import group_of
    from ckptfs.protocol.save_rounds import SaveRounds, drive_save

    spec = Spec(**spec_doc["spec"])
    timings: dict[str, float] = {}

    def timing(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        timings[name] = time.perf_counter() - t0
        return out

    class Planner(SavePlanner):
        def create_global_table(self, tables: list[Any]) -> Any:
            return timing("create_global_plan_s", lambda: super(Planner, self)
                          .create_global_table(tables))

    class Writer(ShardedWriter):
        def prepare_table(self, plan: Any, tables: list[Any]) -> Any:
            return timing("prepare_global_plan_s", lambda: super(Writer, self)
                          .prepare_table(plan, tables))

        def finish_table(self, plan: Any, results: list[list[Any]]) -> None:
            timing("finish_s", lambda: super(Writer, self).finish_table(plan, results))

    if spec.mesh == "hsdp":
        s = min(spec.hsdp_shard, world)
        mesh = init_device_mesh("cpu", (world // s, s), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))

    def dtensor(leaf: Leaf) -> Any:
        dim, shards, index = placement(spec, leaf, world, rank)
        _, sizes = local_chunk(leaf.shape, dim, shards, index)
        if spec.mesh == "hsdp":
            places: list[Any] = [Replicate(), Shard(0)]
        else:
            places = [Replicate() if dim is None else Shard(dim)]
        stride = [math.prod(leaf.shape[i + 1:]) for i in range(len(leaf.shape))]
        return DTensor.from_local(torch.zeros(sizes), mesh, places, run_check=False,
                                  shape=torch.Size(leaf.shape), stride=tuple(stride))

    state: dict[str, Any] = {}
    for leaf in leaves(spec):
        node = state
        for key in leaf.path[:-1]:
            if isinstance(key, int):  # param_groups: a list of one dict
                node = node.setdefault("__list__", {})
            node = node.setdefault(str(key), {})
        node[str(leaf.path[-1])] = leaf.value if leaf.kind == "value" else (
            torch.zeros(()) if leaf.kind == "tensor" else dtensor(leaf))
    groups = state["optim"].pop("param_groups")
    state["optim"]["param_groups"] = [groups["__list__"]["0"]]
    store = ckptfs.open(spec_doc["root"], durable=spec.durable)
    writer = Writer(store.storage, STEP,
                    store.options.but(durable=spec.durable, metadata_layout=None))
    rounds: dict[str, float] = {}
    plan_round, commit_round = SaveRounds.plan_globally, SaveRounds.commit

    def timed_plan(self: SaveRounds, docs: list[Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return plan_round(self, docs)
        finally:
            rounds["plan"] = time.perf_counter() - t0

    def timed_commit(self: SaveRounds, docs: list[Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return commit_round(self, docs)
        finally:
            rounds["commit"] = time.perf_counter() - t0

    SaveRounds.plan_globally, SaveRounds.commit = timed_plan, timed_commit  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:  # ckptfs's collective save, as store.save drives it, without the skeleton
        drive_save(state, writer, Planner(), group_of(None))
    finally:
        SaveRounds.plan_globally, SaveRounds.commit = plan_round, commit_round  # type: ignore[method-assign]
    total = time.perf_counter() - t0
    if rank != 0:
        return {}
    assert writer.info is not None
    return {**timings, "coordinator_s": rounds["plan"] + rounds["commit"], "save_s": total,
            "attempt": writer.info.attempt, "path": writer.info.path}


def manifest_layout(data: bytes) -> list[Any]:
    """The files of a ``MANIFEST.json`` with their sizes and chunks (offset, length): what
    the simulator must reproduce (digests, times and the writer's identity differ)."""
    doc = json.loads(data)
    out = []
    for f in doc["files"]:
        chunks = [[c[0], c[1]] if isinstance(c, list) else [c["offset"], c["length"]]
                  for c in f.get("chunks", [])]
        out.append([f["path"], f["size"], chunks])
    return sorted(out)


def real_check(spec: Spec, world: int, *, timeout: float = 600.0) -> dict[str, Any]:
    """A real ``world``-rank gloo save of ``spec``'s shapes, and the simulator on the same
    shapes: ``dcp.msgpack`` equal to the byte (the attempt name and root put equal), the
    manifests' files and chunks equal, the coordinator's times side by side."""
    from ckptfs.bench.sharded import launch
    from ckptfs.format.layout import MANIFEST_NAME
    from ckptfs.format.sharded import METADATA_NAME

    tmp = tempfile.mkdtemp(prefix="ckptfs-scale-real-", dir=scratch_root())
    try:
        real_root, sim_root = f"{tmp}/real", f"{tmp}/simu"  # the same length
        out = launch(real_rank, world, {"spec": dataclasses.asdict(spec), "root": real_root},
                     timeout=timeout)[0]
        sim = simulate_ckptfs(spec, world, sim_root)
        real_md = (Path(real_root) / out["path"] / METADATA_NAME).read_bytes()
        sim_md = (Path(sim_root) / sim["path"] / METADATA_NAME).read_bytes()
        real_mf = (Path(real_root) / out["path"] / MANIFEST_NAME).read_bytes()
        sim_mf = (Path(sim_root) / sim["path"] / MANIFEST_NAME).read_bytes()
        same = real_md.replace(out["attempt"].encode(), sim["attempt"].encode()).replace(
            real_root.encode(), sim_root.encode()) == sim_md
        ratio = sim["coordinator_s"] / out["coordinator_s"] if out["coordinator_s"] else None
        return {"world": world, "mesh": spec.mesh, "layers": spec.layers,
                "shrink": spec.shrink,
                "real": {"dcp_msgpack_bytes": len(real_md), "manifest_bytes": len(real_mf),
                         **{k: v for k, v in out.items() if k.endswith("_s")}},
                "sim": {"dcp_msgpack_bytes": len(sim_md), "manifest_bytes": len(sim_mf),
                        **{k: v for k, v in sim.items() if k in (
                            "coordinator_s", "create_global_plan_s", "prepare_global_plan_s",
                            "finish_s")}},
                "dcp_msgpack_equal": same,
                "manifest_layout_equal": manifest_layout(real_mf) == manifest_layout(sim_mf),
                "coordinator_ratio": ratio,
                "coordinator_within_2x": ratio is not None and 0.5 <= ratio <= 2.0}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def real_table(checks: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| mesh | W | dcp.msgpack B real / sim | equal | MANIFEST B real / sim | "
             "files+chunks equal | coordinator s real / sim | sim/real |",
             "|---|---|---|---|---|---|---|---|"]
    for c in checks:
        r, s = c["real"], c["sim"]
        ratio = c["coordinator_ratio"]
        lines.append(f"| {c['mesh']} | {c['world']} | {r['dcp_msgpack_bytes']} / "
                     f"{s['dcp_msgpack_bytes']} | {'yes' if c['dcp_msgpack_equal'] else 'NO'} | "
                     f"{r['manifest_bytes']} / {s['manifest_bytes']} | "
                     f"{'yes' if c['manifest_layout_equal'] else 'NO'} | "
                     f"{r['coordinator_s']:.4f} / {s['coordinator_s']:.4f} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The command


def run_scale(worlds: Sequence[int], meshes: Sequence[str], *, layers: int = 1,
              hsdp_shard: int = 8, durable: bool = True, shrink: int = 1,
              reps: int | None = None, collect: bool = True,
              progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """`simulate` at each of ``worlds`` for each of ``meshes``, after one untimed warm-up
    (the first save of a process pays for lazy imports)."""
    simulate(Spec(layers=layers, shrink=64), 2, reps=1, collect=False)
    rows = []
    for mesh in meshes:
        spec = Spec(mesh=mesh, layers=layers, hsdp_shard=hsdp_shard, durable=durable,
                    shrink=shrink)
        for w in worlds:
            if progress is not None:
                progress(f"{mesh} W={w}")
            rows.append(simulate(spec, w, reps=reps, collect=collect))
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main_scale(args: argparse.Namespace) -> int:
    """``ckptfs bench scale``: the table (and ``--real`` checks), JSON to ``--json``."""
    from ckptfs.bench.common import machine_info

    worlds = _ints(args.scale_worlds) if args.scale_worlds else (
        QUICK_WORLDS if args.scale_quick else DEFAULT_WORLDS)
    meshes = [m for m in args.scale_mesh.split(",") if m] if args.scale_mesh != "all" \
        else list(MESHES)

    def progress(what: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {what} ...", flush=True)

    doc: dict[str, Any] = {"command": "ckptfs bench scale", "date": time.strftime(
        "%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
        "worlds": list(worlds), "meshes": meshes, "layers": args.scale_layers}
    checks = []
    if args.scale_real:
        for mesh in meshes:
            for w in _ints(args.scale_real):
                # HSDP's shard group at most half the ranks: the replicas are there too.
                spec = Spec(mesh=mesh, layers=args.scale_layers, shrink=args.scale_shrink,
                            hsdp_shard=max(1, min(args.scale_hsdp_shard, w // 2)))
                progress(f"real gloo {mesh} W={w}")
                checks.append(real_check(spec, w))
        print(real_table(checks), flush=True)
        doc["real"] = checks
    if not args.scale_real or args.scale_worlds or args.scale_quick:
        rows = run_scale(worlds, meshes, layers=args.scale_layers,
                         hsdp_shard=args.scale_hsdp_shard, progress=progress)
        print(table(rows), flush=True)
        print(load_table(rows), flush=True)
        print(load_round_table(rows), flush=True)
        doc["rows"] = rows
        doc["growth"] = growth(rows)
    if args.scale_json:
        Path(args.scale_json).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    if args.scale_plot and doc.get("rows"):
        plot(doc["rows"], args.scale_plot)
    failed = [c for c in checks if not (c["dcp_msgpack_equal"] and c["manifest_layout_equal"])]
    return 1 if failed else 0
