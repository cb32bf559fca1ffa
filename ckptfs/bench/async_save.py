"""Benchmark of asynchronous saves (docs/async.md), side by side in one run:

1. **blocking time** of ``store.save_async`` against the synchronous durable ``store.save`` of the
   same state (goal at most 0.2x) and against a plain ``clone()`` of the state (goal at most
   1.5x), on local disk;
2. a **toy training loop** (an MLP with Adam) with a checkpoint every N steps: no checkpoint,
   synchronous ``store.save``, ``store.save_async`` and ``torch.distributed.checkpoint``'s
   ``async_save`` (thread mode, ``FileSystemWriter``): total wall time and time blocked;
3. **S3 (moto)**: the blocking time of ``save_async`` against the upload time of the same state.

Standalone (it shares nothing with the other benchmark modules)::

    python -m ckptfs.bench.async_save --quick                       # 64 MiB, a short loop
    python -m ckptfs.bench.async_save --size-mib 1024 --out a.json --plot docs/img/async_save.png

Medians of ``--repeats`` runs, interleaved so that a load spike hits every variant alike.  This
VM hands memory that sat free back to the host and the next first touch is several times slower;
a plain ``clone()`` pays that on every call, so memory is touched and freed right before each
timed clone (the clone's best case); ``save_async`` reuses its staging buffers and never does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MIB = 1024 * 1024


def make_state(nbytes: int, tensors: int = 8) -> dict[str, Any]:
    """A model + optimizer shaped state of ``nbytes`` fp32 tensor bytes."""
    per = max(1, nbytes // tensors // 4)
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.rand(per, generator=g) for i in range(tensors)},
            "trainer": {"step": 0, "lr": 1e-4}}


def clone_state(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    return value


def warm(nbytes: int) -> None:
    """Touch and free ``nbytes`` so that the next allocation does not pay first-touch costs."""
    if nbytes > 0:
        torch.ones(nbytes // 4)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def load_note() -> dict[str, Any]:
    la = os.getloadavg()
    mem = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    mem[k] = int(v.split()[0]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return {"loadavg": [round(x, 2) for x in la], "cpus": os.cpu_count(),
            "mem_total": mem.get("MemTotal"), "mem_available": mem.get("MemAvailable"),
            "torch": torch.__version__, "python": platform.python_version()}


# -- 1. blocking time on local disk ----------------------------------------------------------------


def bench_blocking(root: str, nbytes: int, repeats: int) -> dict[str, Any]:
    import ckptfs

    # The state, the staging pool (or a clone) and slack: never push a shared machine into
    # the OOM killer, which would pick the largest process, maybe not this one.
    need = 3 * nbytes + 512 * MIB
    avail = load_note()["mem_available"]
    if avail is not None and avail < need:
        return {"size_bytes": nbytes, "skipped": f"only {avail // MIB} MiB available, "
                f"{need // MIB} MiB needed"}
    state = make_state(nbytes)
    store = ckptfs.open(root)  # durable (fsync), the default
    step = 0
    sync_s: list[float] = []
    clone_s: list[float] = []
    block_s: list[float] = []
    total_s: list[float] = []
    # First async save: the staging pool is allocated (first touch of every page).
    t0 = time.perf_counter()
    fut = store.save_async(step, state)
    first_block = time.perf_counter() - t0
    fut.result()
    store.delete(step)
    for _ in range(repeats):
        step += 1
        t0 = time.perf_counter()
        fut = store.save_async(step, state)
        block_s.append(time.perf_counter() - t0)
        fut.result()
        total_s.append(time.perf_counter() - t0)
        store.delete(step)
        step += 1
        t0 = time.perf_counter()
        store.save(step, state)
        sync_s.append(time.perf_counter() - t0)
        store.delete(step)
        warm(nbytes)
        t0 = time.perf_counter()
        copy = clone_state(state)
        clone_s.append(time.perf_counter() - t0)
        del copy
    store.close()
    out: dict[str, Any] = {"size_bytes": nbytes, "repeats": repeats,
                           "sync_save_s": median(sync_s), "clone_s": median(clone_s),
                           "save_async_block_s": median(block_s),
                           "save_async_first_block_s": first_block,
                           "save_async_total_s": median(total_s),
                           "runs": {"sync": sync_s, "clone": clone_s, "block": block_s,
                                    "total": total_s}}
    out["ratio_vs_sync"] = out["save_async_block_s"] / out["sync_save_s"]
    out["ratio_vs_clone"] = out["save_async_block_s"] / out["clone_s"]
    return out


# -- 2. a toy training loop ------------------------------------------------------------------------


MODES = ("none", "sync", "ckptfs_async", "dcp_async")


def training_loop(root: str, mode: str, *, steps: int, every: int, width: int, depth: int,
                  batch: int, step_ms: int = 0) -> dict[str, Any]:
    """``step_ms`` > 0: each step is that long a wait (an accelerator computing; the CPU is
    free for the background save) plus an in-place change of every parameter; 0: each step
    is a real forward/backward/Adam step on the CPU (competes with the save for the cores)."""
    import ckptfs

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width)

    def cpu_step() -> None:
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    cpu_step()  # the optimizer state exists from here on
    store = ckptfs.open(f"{root}/{mode}")
    pending: Any = None
    blocked: list[float] = []
    t_start = time.perf_counter()
    for step in range(1, steps + 1):
        if step_ms > 0:
            time.sleep(step_ms / 1000)
            with torch.no_grad():
                for p in model.parameters():
                    p.view(-1)[0] += 1.0
        else:
            cpu_step()
        if mode == "none" or step % every:
            continue
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        t0 = time.perf_counter()
        if mode == "sync":
            store.save(step, state)
        elif mode == "ckptfs_async":
            store.save_async(step, state)
        else:
            from torch.distributed.checkpoint.state_dict_saver import async_save
            if pending is not None:
                pending.result()  # one in flight, as save_async's default
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pending = async_save(state, checkpoint_id=f"{root}/{mode}/step-{step}")
        blocked.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    waits = store.async_stats.waits
    if mode == "ckptfs_async":
        store.close()
    elif pending is not None:
        pending.result()
    flush = time.perf_counter() - t0
    total = time.perf_counter() - t_start
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    return {"mode": mode, "total_s": total, "blocked_s": sum(blocked), "flush_s": flush,
            "checkpoints": len(blocked), "blocked_each_s": blocked,
            "backpressure_waits": waits, "state_bytes_approx": state_bytes}


def bench_loop(root: str, repeats: int, **kw: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(repeats):
        order = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            runs[mode].append(training_loop(f"{root}/r{r}", mode, **kw))
    summary = {m: {"total_s": median([x["total_s"] for x in rs]),
                   "blocked_s": median([x["blocked_s"] for x in rs]),
                   "flush_s": median([x["flush_s"] for x in rs])} for m, rs in runs.items()}
    return {"config": {**kw, "repeats": repeats},
            "state_bytes_approx": runs["sync"][0]["state_bytes_approx"],
            "summary": summary, "runs": runs}


# -- 3. S3 (moto) ----------------------------------------------------------------------------------


def bench_s3(nbytes: int, repeats: int) -> dict[str, Any]:
    import ckptfs
    from ckptfs.testing.servers import SERVERS, available

    why = available("moto")
    if why is not None:
        return {"skipped": f"moto unavailable: {why}"}
    state = make_state(nbytes)
    block_s: list[float] = []
    total_s: list[float] = []
    sync_s: list[float] = []
    with SERVERS["moto"]() as srv:
        store = ckptfs.open(srv.url("async-bench"), **srv.storage_options)
        store.save_async(0, state).result()  # the staging pool exists from here on
        store.delete(0)
        for r in range(repeats):
            t0 = time.perf_counter()
            fut = store.save_async(2 * r + 1, state)
            block_s.append(time.perf_counter() - t0)
            fut.result()
            total_s.append(time.perf_counter() - t0)
            store.delete(2 * r + 1)
            t0 = time.perf_counter()
            store.save(2 * r + 2, state)
            sync_s.append(time.perf_counter() - t0)
            store.delete(2 * r + 2)
            srv.reset()  # moto keeps every byte in memory
        store.close()
    return {"size_bytes": nbytes, "repeats": repeats, "save_async_block_s": median(block_s),
            "save_async_total_s": median(total_s), "sync_save_s": median(sync_s),
            "runs": {"block": block_s, "total": total_s, "sync": sync_s}}


# -- report --------------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> str:
    lines = [f"machine: {res['machine']}"]
    for b in res["blocking"]:
        if "skipped" in b:
            lines.append(f"local {b['size_bytes'] // MIB} MiB: skipped: {b['skipped']}")
            continue
        lines.append(
            f"local {b['size_bytes'] // MIB} MiB: sync save {b['sync_save_s']:.3f} s, clone "
            f"{b['clone_s']:.3f} s, save_async blocks {b['save_async_block_s']:.3f} s (first "
            f"{b['save_async_first_block_s']:.3f} s, committed after "
            f"{b['save_async_total_s']:.3f} s): {b['ratio_vs_sync']:.3f}x sync (goal <= 0.2), "
            f"{b['ratio_vs_clone']:.2f}x clone (goal <= 1.5)")
    loop = res.get("loop")
    if loop:
        lines.append(f"training loop {loop['config']}, state ~"
                     f"{loop['state_bytes_approx'] // MIB} MiB:")
        for m, s in loop["summary"].items():
            lines.append(f"  {m:13s} total {s['total_s']:.2f} s, blocked {s['blocked_s']:.2f} s, "
                         f"final flush {s['flush_s']:.2f} s")
    s3 = res.get("s3")
    if s3 and "skipped" not in s3:
        lines.append(f"s3 (moto) {s3['size_bytes'] // MIB} MiB: save_async blocks "
                     f"{s3['save_async_block_s']:.3f} s, committed after "
                     f"{s3['save_async_total_s']:.3f} s; sync save {s3['sync_save_s']:.3f} s")
    elif s3:
        lines.append(f"s3: {s3['skipped']}")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    rows = [(f"local {b['size_bytes'] // MIB} MiB", b) for b in res["blocking"]
            if "skipped" not in b]
    if res.get("s3") and "skipped" not in res["s3"]:
        rows.append((f"S3/moto {res['s3']['size_bytes'] // MIB} MiB", res["s3"]))
    labels = [r[0] for r in rows]
    width = 0.25
    for i, (key, name) in enumerate([("sync_save_s", "sync durable save"),
                                     ("clone_s", "clone()"),
                                     ("save_async_block_s", "save_async (blocking)")]):
        vals = [r[1].get(key, float("nan")) for r in rows]
        ax.bar([j + (i - 1) * width for j in range(len(rows))], vals, width, label=name)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("seconds the caller is blocked (median)")
    ax.set_title("Blocking time per checkpoint")
    ax.legend()
    ax = axes[1]
    loop = res.get("loop")
    if loop:
        modes = list(loop["summary"])
        blocked = [loop["summary"][m]["blocked_s"] for m in modes]
        total = [loop["summary"][m]["total_s"] for m in modes]
        ax.bar(modes, total, label="total loop time")
        ax.bar(modes, blocked, label="of which blocked by checkpoints")
        ax.set_ylabel("seconds (median)")
        cfg = loop["config"]
        kind = (f"{cfg['step_ms']} ms accelerator-like steps" if cfg.get("step_ms")
                else "CPU steps")
        ax.set_title(f"Toy loop: {cfg['steps']} {kind}, checkpoint every {cfg['every']}",
                     fontsize=10)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(*, sizes_mib: list[int], repeats: int, loop: dict[str, int] | None, s3_mib: int,
        root: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": load_note(), "blocking": []}
    with tempfile.TemporaryDirectory(prefix="ckptfs-async-bench-", dir=root) as tmp:
        for mib in sizes_mib:
            log(f"blocking time at {mib} MiB ...")
            res["blocking"].append(bench_blocking(f"{tmp}/blk{mib}", mib * MIB, repeats))
        if loop:
            log(f"training loop {loop} ...")
            res["loop"] = bench_loop(f"{tmp}/loop", max(1, repeats // 2), **loop)
    if s3_mib:
        log(f"s3 (moto) at {s3_mib} MiB ...")
        res["s3"] = bench_s3(s3_mib * MIB, repeats)
    res["machine_after"] = load_note()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptfs.bench.async_save", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats, a short loop")
    p.add_argument("--size-mib", type=int, action="append",
                   help="state size for the blocking comparison (repeatable; default 64 and 1024)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--s3-mib", type=int, default=64, help="0 skips the S3 part")
    p.add_argument("--no-loop", action="store_true")
    p.add_argument("--loop-steps", type=int, default=40)
    p.add_argument("--loop-every", type=int, default=10)
    p.add_argument("--loop-width", type=int, default=1024)
    p.add_argument("--loop-depth", type=int, default=16)
    p.add_argument("--loop-step-ms", type=int, default=200,
                   help="a step is this long a wait (an accelerator's compute); 0: a real "
                   "forward/backward/Adam step on the CPU")
    p.add_argument("--root", help="directory for the local checkpoints (default: $TMPDIR)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG plot here")
    a = p.parse_args(argv)
    sizes = a.size_mib or ([64] if a.quick else [64, 1024])
    repeats = 3 if a.quick else a.repeats
    loop = None if a.no_loop else {
        "steps": 20 if a.quick else a.loop_steps, "every": 5 if a.quick else a.loop_every,
        "width": 512 if a.quick else a.loop_width, "depth": 8 if a.quick else a.loop_depth,
        "batch": 64, "step_ms": a.loop_step_ms}
    res = run(sizes_mib=sizes, repeats=repeats, loop=loop, s3_mib=a.s3_mib, root=a.root)
    print(report(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    if a.plot:
        plot(res, a.plot)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
