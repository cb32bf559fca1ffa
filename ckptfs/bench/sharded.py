"""Sharded checkpoints (format v2) against DCP's FileSystemWriter/Reader, in one run:

1. **save**: W gloo ranks (processes on this machine) hold an FSDP2 MLP (``fully_shard``) and
   its AdamW state, obtained with ``get_state_dict``; each timed save is a durable
   ``ckptfs.open(dir).save(step, sd)`` (every byte hashed, files and directories fsynced, one
   marker) or a ``dcp.save(sd, storage_writer=FileSystemWriter(dir))`` (its default: fsync,
   one file per rank), alternating rep by rep.  The time is rank 0's, from a barrier before
   the save to the save's return (which is after the coordinator's commit on every rank);
2. **load 2 -> 1**: the last checkpoints of the W=2 save loaded in *one* process into full
   plain tensors: ``store.load(step)`` (every chunk verified) against DCP's own full load
   (``_load_state_dict`` with ``_EmptyStateDictLoadPlanner``, as ``dcp_to_torch_save`` does),
   alternating; the two results are compared bit for bit;
3. **world sizes**: the save at 1, 2 and 4 ranks (a smaller state);
4. **cost at scale**: tiny models saved by 2, 4 and 8 ranks, counting every storage call of
   each rank and measuring ``dcp.msgpack``, ``MANIFEST.json`` and DCP's pickled ``.metadata``,
   to extrapolate to 1,000 ranks.

``python -m benchmarks.sharded --size 1GiB`` runs it; the JSON goes to
``benchmarks/results/sharded.json`` and the plot to ``docs/img/sharded_save_load.png``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

from ckptfs.bench.common import (
    DOCS_DIR,
    RESULTS_DIR,
    MiB,
    flat_tensors,
    fmt_size,
    fs_type,
    machine_info,
    parse_size,
    warm_memory,
)
from ckptfs.bench.latest import CountingStorage

RANK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor", "ckptfs", "ckptfs.protocol.sharded"]
WARM = 256 * MiB


# ----------------------------------------------------------------------------------------------
# Launching W gloo ranks (forked from a server that imported torch once)


def _child(fn: Callable[..., Any], rank: int, world: int, rdv: str, out: str,
           spec: dict[str, Any]) -> None:
    os.environ.update(RANK_ENV)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: Any = None
    error = None
    try:
        dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=600))
        try:
            result = fn(rank, world, spec)
        finally:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        error = traceback.format_exc()
    with open(f"{out}/rank-{rank}.json", "w") as f:
        json.dump({"result": result, "error": error}, f)


def launch(fn: Callable[..., Any], world: int, spec: dict[str, Any], *,
           timeout: float = 900.0) -> list[Any]:
    """``fn(rank, world, spec)`` on ``world`` gloo ranks; JSON results in rank order.  A job
    still running after ``timeout`` is killed, process by process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="ckptfs-bench-") as tmp:
        procs = [ctx.Process(target=_child, args=(fn, r, world, f"{tmp}/rdv", tmp, spec),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        results: list[Any] = []
        errors: list[str] = []
        for r in range(world):
            path = Path(tmp) / f"rank-{r}.json"
            if not path.exists():
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            doc = json.loads(path.read_text())
            if doc["error"]:
                errors.append(f"rank {r}:\n{doc['error']}")
            results.append(doc["result"])
        if errors:
            raise RuntimeError("benchmark job failed:\n" + "\n".join(errors))
        return results


# ----------------------------------------------------------------------------------------------
# The state: an FSDP2 MLP and its AdamW state


def mlp_width(total_bytes: int, layers: int) -> int:
    """Width ``d`` of ``layers`` Linear(d, d) layers whose fp32 parameters plus AdamW's two
    moments come to about ``total_bytes``."""
    d = int((total_bytes / (12 * layers)) ** 0.5)
    return max(8, d)


def fsdp_state(world: int, total_bytes: int, layers: int, seed: int = 0) -> dict[str, Any]:
    """This rank's sharded ``{"model", "optimizer"}`` (DTensors) after one AdamW step."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    d = mlp_width(total_bytes, layers)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            cast(Any, p).to_local().uniform_(-0.01, 0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = p.detach().clone()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


def local_bytes(state: Any) -> int:
    """Bytes of this rank's shards (DTensors count their local part)."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes
               for t in flat_tensors(state).values())


# ----------------------------------------------------------------------------------------------
# Jobs (module level: pickled by name into the ranks)


def job_save(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Alternating timed saves (ckptfs durable, DCP FileSystemWriter); keeps the last of each."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import ckptfs

    state = fsdp_state(world, spec["bytes"], spec["layers"])
    mine = torch.tensor([local_bytes(state)], dtype=torch.int64)
    dist.all_reduce(mine)
    root = Path(spec["root"])
    times: dict[str, list[float]] = {"ckptfs": [], "dcp": []}
    for rep in range(spec["reps"]):
        for name in ("ckptfs", "dcp"):
            last = rep == spec["reps"] - 1
            where = root / f"{name}-{rep}"
            warm_memory(WARM)
            dist.barrier()
            t0 = time.perf_counter()
            if name == "ckptfs":
                ckptfs.open(str(where)).save(1000, state)
            else:
                dcp_save(state, storage_writer=FileSystemWriter(str(where)))
            times[name].append(time.perf_counter() - t0)
            dist.barrier()
            if rank == 0 and not last:
                shutil.rmtree(where)
    return {"times": times, "total_bytes": int(mine.item()),
            "width": mlp_width(spec["bytes"], spec["layers"])}


def job_meta(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """A small model saved once by ckptfs (storage calls counted) and once by DCP."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import ckptfs

    state = fsdp_state(world, spec["bytes"], spec["layers"])
    store = ckptfs.open(spec["root"] + "/ckptfs")
    counting = CountingStorage(store.storage)
    store.storage = counting
    info = store.save(1, state)
    dcp_save(state, storage_writer=FileSystemWriter(spec["root"] + "/dcp"))
    out: dict[str, Any] = {"calls": counting.calls}
    if rank == 0:
        adir = Path(spec["root"]) / "ckptfs" / "checkpoints" / info.dir_name / info.attempt
        out["dcp_msgpack"] = (adir / "dcp.msgpack").stat().st_size
        out["manifest"] = (adir / "MANIFEST.json").stat().st_size
        out["dcp_pickle_metadata"] = (Path(spec["root"]) / "dcp" / ".metadata").stat().st_size
        out["tensors"] = len(flat_tensors(state))
        out["files"] = len(info.manifest.files)
    return out


# ----------------------------------------------------------------------------------------------
# In the parent


def bench_load(root: Path, reps: int) -> dict[str, Any]:
    """2 -> 1: the W=2 checkpoints loaded whole in this process, alternating; bit-compared."""
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    import ckptfs
    from ckptfs.torch_compat import EmptyStateDictLoadPlanner as _EmptyStateDictLoadPlanner
    from ckptfs.torch_compat import load_state_dict as _load_state_dict

    ck = next(root.glob("ckptfs-*"))
    dc = next(root.glob("dcp-*"))

    def load_ckptfs() -> Any:
        return ckptfs.open(str(ck)).load(1000)

    def load_dcp() -> Any:
        sd: dict[str, Any] = {}
        _load_state_dict(sd, storage_reader=FileSystemReader(str(dc)),
                         planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
                         no_dist=True)
        return sd

    times: dict[str, list[float]] = {"ckptfs": [], "dcp": []}
    loaded: dict[str, Any] = {}
    for _ in range(reps):
        for name, fn in (("ckptfs", load_ckptfs), ("dcp", load_dcp)):
            loaded.pop(name, None)
            warm_memory(4 * WARM)
            t0 = time.perf_counter()
            loaded[name] = fn()
            times[name].append(time.perf_counter() - t0)
    a, b = flat_tensors(loaded["ckptfs"]), flat_tensors(loaded["dcp"])
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {"times": times, "bit_identical": same, "tensors": len(a),
            "bytes": sum(t.nbytes for t in a.values())}


def _median(xs: Sequence[float]) -> float:
    return round(statistics.median(xs), 4)


def summarize(times: Mapping[str, list[float]]) -> dict[str, Any]:
    c, d = _median(times["ckptfs"]), _median(times["dcp"])
    return {"ckptfs_s": c, "dcp_s": d, "speedup": round(d / c, 3),
            "times_s": {k: [round(x, 4) for x in v] for k, v in times.items()}}


def run(size: int, reps: int, worlds: Sequence[int], world_size: int,
        meta_worlds: Sequence[int], layers: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": machine_info(), "fs": fs_type(root),
                           "layers": layers}
    base = Path(root)

    def fresh(name: str) -> Path:
        p = base / name
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
        return p

    where = fresh("w2")
    r = launch(job_save, 2, {"bytes": size, "layers": layers, "reps": reps, "root": str(where)})
    out["save_w2"] = {**summarize(r[0]["times"]), "bytes": r[0]["total_bytes"],
                      "width": r[0]["width"]}
    print(f"save W=2 {fmt_size(r[0]['total_bytes'])}: {out['save_w2']}", flush=True)
    out["load_2_to_1"] = {**summarize((ld := bench_load(where, reps))["times"]),
                          **{k: v for k, v in ld.items() if k != "times"}}
    print(f"load 2->1: {out['load_2_to_1']}", flush=True)
    shutil.rmtree(where)
    out["worlds"] = {}
    for w in worlds:
        where = fresh(f"w{w}")
        r = launch(job_save, w, {"bytes": world_size, "layers": layers, "reps": reps,
                                 "root": str(where)})
        out["worlds"][str(w)] = {**summarize(r[0]["times"]), "bytes": r[0]["total_bytes"]}
        print(f"save W={w}: {out['worlds'][str(w)]}", flush=True)
        shutil.rmtree(where)
    out["meta"] = {}
    for w in meta_worlds:
        where = fresh(f"m{w}")
        r = launch(job_meta, w, {"bytes": 4 * MiB, "layers": 16, "root": str(where)})
        out["meta"][str(w)] = {**r[0], "calls_other_ranks": r[1]["calls"]}
        print(f"meta W={w}: {out['meta'][str(w)]}", flush=True)
        shutil.rmtree(where)
    return out


def plot(doc: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    s, ld = doc["save_w2"], doc["load_2_to_1"]
    labels = [f"save W=2\n{fmt_size(s['bytes'])}", f"load 2->1\n{fmt_size(ld['bytes'])}"]
    xs = range(len(labels))
    ax1.bar([x - 0.2 for x in xs], [s["ckptfs_s"], ld["ckptfs_s"]], 0.4,
            label="ckptfs (hash + verify)")
    ax1.bar([x + 0.2 for x in xs], [s["dcp_s"], ld["dcp_s"]], 0.4, label="DCP FileSystem")
    ax1.set_xticks(list(xs), labels)
    ax1.set_ylabel("seconds (median)")
    ax1.legend()
    ws = sorted(doc["worlds"], key=int)
    ax2.plot([int(w) for w in ws], [doc["worlds"][w]["ckptfs_s"] for w in ws], "o-",
             label="ckptfs")
    ax2.plot([int(w) for w in ws], [doc["worlds"][w]["dcp_s"] for w in ws], "s-", label="DCP")
    if ws:
        ax2.set_title(f"durable save, {fmt_size(doc['worlds'][ws[0]]['bytes'])} total")
    ax2.set_xlabel("ranks (2 cores)")
    ax2.set_ylabel("seconds (median)")
    ax2.set_xticks([int(w) for w in ws])
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__)
    p.add_argument("--size", default="1GiB", help="total state of the W=2 save/load")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--world-size", default="256MiB", help="total state of the world table")
    p.add_argument("--meta-worlds", default="2,4,8")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--root", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--json", default=str(RESULTS_DIR / "sharded.json"))
    p.add_argument("--plot", default=str(DOCS_DIR / "img" / "sharded_save_load.png"))
    a = p.parse_args(argv)
    scratch = a.root or tempfile.mkdtemp(prefix="ckptfs-sharded-bench-")
    try:
        doc = run(parse_size(a.size), a.reps, [int(w) for w in a.worlds.split(",") if w],
                  parse_size(a.world_size), [int(w) for w in a.meta_worlds.split(",") if w],
                  a.layers, scratch)
    finally:
        if a.root is None:
            shutil.rmtree(scratch, ignore_errors=True)
    doc["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    if a.plot:
        plot(doc, Path(a.plot))
    print(json.dumps({k: doc[k] for k in ("save_w2", "load_2_to_1")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
