"""``ckptfs bench scale``'s collective load round at W simulated ranks: what a job waits for
between "every rank has read the metadata" and "every rank starts reading data".

Each rank loads what it saved (its local save plan, `ckptfs.bench.scale.local_plans`) from the
format v2 checkpoint the simulated save committed.  Its needs are what DCP's load planner makes
of that target: every stored chunk its chunks overlap (`rank_needs`; exactly DCP's overlap rule,
over ``dcp.msgpack``'s chunks), plus the header chunk of every rank file it reads.  Then:

* **ckptfs** (`ckptfs.protocol.load_rounds`): every rank's round-1 document (what it resolved,
  its chunks: `keys_doc`) encoded as it sends it; the coordinator decodes them all, runs the
  real ``LoadRounds.plan_globally`` (the agreed attempt, the listing checked once, the shared
  reads planned, every key checked against the manifest) and encodes each rank's part; a rank
  decodes its own part.  A job waits for: one rank's encoding, the coordinator's side, the
  largest part's decoding (the transport itself is not simulated: the bytes are given);
* **before** (DCP's ``dcp.load`` driving ckptfs's reader, as ckptfs loaded until this round):
  every rank's ``LoadPlan`` (one ``ReadItem`` per overlap, as DCP's planner makes them) pickled
  to the coordinator and unpickled there, DCP's global step (``create_global_plan``, the
  reader's ``prepare_global_plan``), every plan pickled back and one unpickled, the collector
  running as DCP leaves it; then the needs exchange every rank ran (`ShardedReader._share`):
  every rank receiving every rank's chunks and planning the shared reads itself.
"""

from __future__ import annotations

import bisect
import gc
import json
import pickle
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["load_round", "rank_needs"]

Key = tuple[str, int, int]


def _overlaps(a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int],
              b_size: Sequence[int]) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in
               zip(a_off, a_size, b_off, b_size, strict=True))


def rank_needs(doc: Any, manifest: Any, plans: Sequence[Any]
               ) -> tuple[list[list[Key]], list[list[tuple[Any, ...]]]]:
    """Per rank of ``plans`` (local save plans: what each rank holds and loads back), the stored
    chunks its load reads (sorted keys, headers included) and its read items as DCP's planner
    makes them: (fqn, destination offsets, stored offsets, lengths), lengths None for a
    value."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    storage_data = doc.metadata.storage_data
    exact: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], Key]] = {}
    by_fqn: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], Key]]] = {}
    values: dict[str, Key] = {}
    for fqn, md in doc.metadata.state_dict_metadata.items():
        chunks = getattr(md, "chunks", None)
        if chunks is None:
            continue
        for c in chunks:
            offs = tuple(int(o) for o in c.offsets)
            sizes = tuple(int(s) for s in c.sizes)
            loc = storage_data[MetadataIndex(fqn, c.offsets)]
            key = (loc.path, loc.offset, loc.length)
            exact[(fqn, offs)] = (sizes, key)
            by_fqn.setdefault(fqn, []).append((offs, sizes, key))
    for idx, loc in storage_data.items():
        if idx.offset is None:
            values[idx.fqn] = (loc.path, loc.offset, loc.length)
    for lst in by_fqn.values():
        lst.sort()
    starts = {fqn: [c[0][0] if c[0] else 0 for c in lst] for fqn, lst in by_fqn.items()}
    headers: dict[str, Key] = {}
    needs: list[list[Key]] = []
    items: list[list[tuple[Any, ...]]] = []
    for plan in plans:
        keys: set[Key] = set()
        reads: list[tuple[Any, ...]] = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.tensor_data is None:
                keys.add(values[fqn])
                reads.append((fqn, None, None, None))
                continue
            q_off = tuple(int(o) for o in item.tensor_data.chunk.offsets)
            q_size = tuple(int(s) for s in item.tensor_data.chunk.sizes)
            hit = exact.get((fqn, q_off))
            if hit is not None and hit[0] == q_size:
                keys.add(hit[1])
                reads.append((fqn, q_off, q_off, q_size))
                continue
            lst = by_fqn[fqn]
            end = bisect.bisect_left(starts[fqn], (q_off[0] + q_size[0]) if q_off else 1)
            for offs, sizes, key in lst[:end]:
                if _overlaps(q_off, q_size, offs, sizes):
                    keys.add(key)
                    lo = tuple(max(a, b) for a, b in zip(q_off, offs, strict=True))
                    hi = tuple(min(a + x, b + y) for a, x, b, y in
                               zip(q_off, q_size, offs, sizes, strict=True))
                    reads.append((fqn, lo, offs, tuple(h - lo_ for h, lo_ in
                                                       zip(hi, lo, strict=True))))
        for path in {k[0] for k in keys}:
            if path not in headers:
                headers[path] = (path, 0, manifest.chunked(path).chunks[0].length)
            keys.add(headers[path])
        needs.append(sorted(keys))
        items.append(reads)
    return needs, items


def _load_plan(reads: list[tuple[Any, ...]], resolved: tuple[int, str]) -> Any:
    """The ``LoadPlan`` DCP's planner makes of one rank's read items (fresh objects, as DCP's:
    the pickled sizes are the real ones)."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    out = []
    for fqn, dest, stored, lengths in reads:
        if lengths is None:
            out.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                                dest_offsets=torch.Size([0]), storage_index=MetadataIndex(fqn),
                                storage_offsets=torch.Size([0]), lengths=torch.Size([0])))
            continue
        dest_off = torch.Size(dest)
        out.append(ReadItem(
            type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, dest_off),
            dest_offsets=torch.Size([d - s for d, s in zip(dest, stored, strict=True)]),
            storage_index=MetadataIndex(fqn, torch.Size(stored)),
            storage_offsets=torch.Size([d - s for d, s in zip(dest, stored, strict=True)]),
            lengths=torch.Size(lengths)))
    return LoadPlan(out, storage_data=resolved)


def load_round(root: str, step: int, plans: Sequence[Any], *, dcp: bool = True
               ) -> dict[str, Any]:
    """The collective load round at ``len(plans)`` simulated ranks on the committed step
    ``step`` under ``root`` (module docstring): seconds and bytes of ckptfs's rounds and of
    the round before them (``dcp``: also DCP's pickled load-plan round, the slowest part of
    this simulation)."""
    import ckptfs
    from ckptfs.protocol.gcpause import paused_collector
    from ckptfs.protocol.group import decode, encode, encode_each
    from ckptfs.protocol.load_rounds import LoadRounds, encode_text
    from ckptfs.protocol.sharded_read import (
        ShardedReader,
        keys_doc,
        sharded_manifest,
        shared_reads,
    )

    world = len(plans)
    store = ckptfs.open(root)
    reader = ShardedReader(store.storage, step, threads=store.threads)
    info = reader.resolve()
    doc = reader.load_document()
    manifest = sharded_manifest(info)
    needs, reads = rank_needs(doc, manifest, plans)
    resolved = (info.step, info.attempt)
    out: dict[str, Any] = {"world": world, "keys": sum(map(len, needs)),
                           "shared_keys": 0}
    # ckptfs: one rank's document, the coordinator's side, the parts.
    docs = [{"plan": {"resolved": list(resolved), "needs": encode_text(keys_doc(k)),
                      "share": True}} for k in needs]
    t0 = time.perf_counter()
    blobs = [encode(d) for d in docs]
    encode_rank_s = (time.perf_counter() - t0) / world
    del docs
    gc.collect()
    coordinator = ShardedReader(store.storage, step, threads=store.threads)
    coordinator.resolve()
    rounds = LoadRounds({}, coordinator, None, 0, cooperative=True)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    with paused_collector():  # as `drive_load` receives them
        got = [decode(b) for b in blobs]
    t_decode = time.perf_counter() - t0
    t0 = time.perf_counter()
    parts = rounds.plan_globally(got, list(range(world)))
    t_plan = time.perf_counter() - t0
    if "failures" in parts[0]:
        raise RuntimeError(f"the simulated load round failed: {parts[0]['failures']}")
    t0 = time.perf_counter()
    with paused_collector():  # as `Group.scatter_from_coordinator`: one object encoded once
        sent = encode_each(parts)
    t_encode = time.perf_counter() - t0
    largest = max(sent, key=len)
    t0 = time.perf_counter()
    decode(largest)
    t_part = time.perf_counter() - t0
    out["shared_keys"] = len({tuple(t[:3]) for p in {id(p): p for p in parts}.values()
                              for r in p["part"].get("rounds", []) for t in r})
    out["ckptfs"] = {
        "rank_encode_s": encode_rank_s, "coordinator_decode_s": t_decode,
        "coordinator_plan_s": t_plan, "coordinator_encode_s": t_encode,
        "part_decode_s": t_part,
        "round_s": encode_rank_s + t_decode + t_plan + t_encode + t_part,
        "gathered_bytes": sum(map(len, blobs)), "sent_per_rank_bytes": max(map(len, blobs)),
        "received_per_rank_bytes": len(largest),
        "shared": any(p["part"] for p in parts)}
    del got, parts, sent
    # Before: every rank received every rank's needs and planned the shared reads itself.
    gc.collect()
    t0 = time.perf_counter()
    every = [json.loads(decode(b)["plan"]["needs"]) for b in blobs]
    shared_reads([([r], k) for r, k in enumerate(every)], manifest, list(range(world)))
    t_needs = time.perf_counter() - t0
    before: dict[str, Any] = {"needs_exchange_s": t_needs,
                              "needs_received_per_rank_bytes": sum(map(len, blobs))}
    del every, blobs
    if dcp:
        plans_ = [_load_plan(r, resolved) for r in reads]
        gc.collect()
        t0 = time.perf_counter()
        up = [pickle.dumps(p) for p in plans_]
        rank_pickle_s = (time.perf_counter() - t0) / world
        del plans_
        t0 = time.perf_counter()
        recv = [pickle.loads(b) for b in up]
        t_unpickle = time.perf_counter() - t0
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        t0 = time.perf_counter()
        recv = DefaultLoadPlanner().create_global_plan(recv)
        recv = coordinator.prepare_global_plan(recv)
        t_global = time.perf_counter() - t0
        t0 = time.perf_counter()
        down = [pickle.dumps(p) for p in recv]
        t_pickle = time.perf_counter() - t0
        t0 = time.perf_counter()
        pickle.loads(max(down, key=len))
        t_own = time.perf_counter() - t0
        before.update({
            "rank_pickle_s": rank_pickle_s, "coordinator_unpickle_s": t_unpickle,
            "global_step_s": t_global, "coordinator_pickle_s": t_pickle,
            "plan_unpickle_s": t_own,
            "plan_round_s": rank_pickle_s + t_unpickle + t_global + t_pickle + t_own,
            "plans_bytes": sum(map(len, up)) + sum(map(len, down))})
        before["round_s"] = before["plan_round_s"] + t_needs
        del recv, up, down
    out["before"] = before
    return out


def load_round_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per mesh: ckptfs's collective load round (what every rank waits for) against the round
    before it (DCP's pickled load plans, then every rank's needs everywhere)."""
    lines: list[str] = []
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        lines += [f"**{mesh}**, the collective load's plan round (seconds a job waits; KiB "
                  "a rank receives)", "",
                  "| W | ckptfs round s | of it, coordinator plan s | before: DCP plan round s "
                  "| before: needs exchange s | ckptfs KiB / before KiB received per rank |",
                  "|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["mesh"] == mesh and "load_round" in r):
            lr = r["load_round"]
            c, b = lr["ckptfs"], lr["before"]
            plan_round = b.get("plan_round_s")
            lines.append(
                f"| {r['world']:,} | {c['round_s']:.3f} | {c['coordinator_plan_s']:.3f} | "
                + (f"{plan_round:.3f}" if plan_round is not None else "-")
                + f" | {b['needs_exchange_s']:.3f} | {c['received_per_rank_bytes'] / 1024:,.1f}"
                f" / {b['needs_received_per_rank_bytes'] / 1024:,.1f} |")
        lines.append("")
    return "\n".join(lines)
