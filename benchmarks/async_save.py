"""How long does a checkpoint block training with ``store.save_async``, against the synchronous
durable save, a plain ``clone()``, and ``torch.distributed.checkpoint.async_save``?  And how
much host memory does its staging take, with and without a staging budget?

Usage: ``python -m benchmarks.async_save [options]`` (same as
``python -m ckptfs.bench.async_save [options]``; see ``--help``, and docs/async.md).

``python -m benchmarks.async_save budget [--size-mib N] [--repeats R] [--layout files|ranks]
[--root DIR] [--out F]``: the staging budget (docs/async.md section 5), side by side in one run:
``save_async`` of an N MiB state (fp32 tensors of N/64 MiB each, on local disk, durable; with
``--layout ranks`` a store of ``layout="ranks"``: the collective save in a world of one, format
v2, its rank's items streamed into one rank file per group) with no budget and with
``staging_bytes`` N/4 and N/16, each in a fresh process (so that nothing another variant
allocated is reused), reporting that process's peak extra host memory during the save (RSS
sampled every 2 ms by a thread, and the ``ru_maxrss`` high-water mark, both against the RSS
once the state exists and a small warm-up save ran), the time the call blocked, the time until
the checkpoint was committed (for the process's first save, which allocates the staging
buffers, and for a second one, which reuses them), and the staging pool's own peak.  Variants
are interleaved over the repeats (medians reported; peak memory: the largest of the repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
#: What the peak may exceed the budget by: the write path's buffers (about 1 MiB on local
#: disk), state.msgpack, the hasher's and the writer threads' working memory, allocator
#: slack.  Stated, and checked by the run.
OVERHEAD = 64 * MIB


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child(size_mib: int, budget: int | None, root: str, layout: str = "files"
          ) -> dict[str, Any]:
    """One variant, in this (fresh) process."""
    import torch

    import ckptfs

    n = 64
    per = size_mib * MIB // n // 4
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layer{i}.weight": torch.rand(per, generator=g) for i in range(n)},
             "trainer": {"step": 0}}
    store = ckptfs.open(root, layout=layout)
    # warm-up: imports, thread pools, hashers (not the state's staging)
    store.save_async(0, {"w": torch.ones(1024)}, staging_bytes=budget).result()
    store.delete(0)
    base = _rss()
    high0 = _maxrss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    fut = store.save_async(1, state, staging_bytes=budget)
    blocked = time.perf_counter() - t0
    info = fut.result()
    total = time.perf_counter() - t0
    # a second save: the staging buffers (or the slab) are reused, as in a training run
    with torch.no_grad():
        for t in state["model"].values():
            t.add_(1.0)
    t0 = time.perf_counter()
    fut = store.save_async(2, state, staging_bytes=budget)
    blocked2 = time.perf_counter() - t0
    fut.result()
    total2 = time.perf_counter() - t0
    stop.set()
    sampler.join()
    stats = store.async_stats
    out = {"budget": budget, "size_bytes": info.bytes, "blocked_s": blocked, "commit_s": total,
           "blocked2_s": blocked2, "commit2_s": total2,
           "peak_extra_rss": max(peak[0], _rss()) - base,
           "maxrss_delta": max(0, _maxrss() - max(high0, base)),
           "staging_peak_bytes": stats.staging_peak_bytes,
           "staging_peak_live_bytes": stats.staging_peak_live_bytes,
           "streamed": stats.streamed, "files": len(info.manifest.files)}
    store.close()
    return out


def run_budget(size_mib: int, repeats: int, root: str | None, layout: str = "files"
               ) -> dict[str, Any]:
    budgets: list[int | None] = [None, size_mib * MIB // 4, size_mib * MIB // 16]
    runs: dict[str, list[dict[str, Any]]] = {str(b): [] for b in budgets}
    with tempfile.TemporaryDirectory(prefix="ckptfs-budget-bench-", dir=root) as tmp:
        for r in range(repeats):
            order = budgets if r % 2 == 0 else list(reversed(budgets))
            for k, b in enumerate(order):
                where = f"{tmp}/r{r}-{k}"
                cmd = [sys.executable, "-m", "benchmarks.async_save", "_child", str(size_mib),
                       "none" if b is None else str(b), where, layout]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                     cwd=Path(__file__).resolve().parents[1])
                runs[str(b)].append(json.loads(res.stdout.strip().splitlines()[-1]))
    summary = []
    for b in budgets:
        rs = runs[str(b)]
        summary.append({
            "budget": b, "size_bytes": rs[0]["size_bytes"],
            "blocked_s": statistics.median(x["blocked_s"] for x in rs),
            "commit_s": statistics.median(x["commit_s"] for x in rs),
            "blocked2_s": statistics.median(x["blocked2_s"] for x in rs),
            "commit2_s": statistics.median(x["commit2_s"] for x in rs),
            "peak_extra_rss": max(x["peak_extra_rss"] for x in rs),
            "maxrss_delta": max(x["maxrss_delta"] for x in rs),
            "staging_peak_bytes": max(x["staging_peak_bytes"] for x in rs),
            "staging_peak_live_bytes": max(x["staging_peak_live_bytes"] for x in rs),
            "files": rs[0]["files"],
            "bound": None if b is None else b + OVERHEAD,
            "within_bound": None if b is None else max(
                max(x["peak_extra_rss"], x["maxrss_delta"]) for x in rs) <= b + OVERHEAD})
    return {"size_mib": size_mib, "repeats": repeats, "overhead_bytes": OVERHEAD,
            "layout": layout,
            "loadavg": os.getloadavg(), "summary": summary, "runs": runs}


def report(res: dict[str, Any]) -> str:
    lines = [f"save_async of {res['size_mib']} MiB on local disk (durable, layout "
             f"{res.get('layout', 'files')!r}), "
             f"{res['repeats']} run(s) per variant, each in a fresh process; load average "
             f"{', '.join(f'{x:.2f}' for x in res['loadavg'])}",
             "first save in the process (buffers allocated), then a second one (reused):",
             f"{'staging_bytes':>14} {'peak RSS +':>11} {'maxrss +':>9} {'pool peak':>10} "
             f"{'blocked':>8} {'commit':>8} {'blocked 2':>10} {'commit 2':>9} {'files':>6}  "
             f"bound (budget + {res['overhead_bytes'] // MIB} MiB)"]
    for s in res["summary"]:
        b = "none" if s["budget"] is None else f"{s['budget'] // MIB} MiB"
        bound = "" if s["bound"] is None else \
            f"{s['bound'] // MIB} MiB: {'met' if s['within_bound'] else 'MISSED'}"
        lines.append(f"{b:>14} {s['peak_extra_rss'] / MIB:>7.0f} MiB "
                     f"{s['maxrss_delta'] / MIB:>5.0f} MiB "
                     f"{s['staging_peak_bytes'] / MIB:>6.0f} MiB {s['blocked_s']:>7.3f}s "
                     f"{s['commit_s']:>7.3f}s {s['blocked2_s']:>9.3f}s "
                     f"{s['commit2_s']:>8.3f}s {s['files']:>6}  {bound}")
    return "\n".join(lines)


def main_budget(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.async_save budget",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layout", choices=("files", "ranks"), default="files",
                   help="the store's layout (ranks: the collective save, format v2)")
    p.add_argument("--root", help="directory for the checkpoints (default: $TMPDIR)")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    res = run_budget(a.size_mib, a.repeats, a.root, a.layout)
    print(report(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0 if all(s["within_bound"] in (None, True) for s in res["summary"]) else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["_child"]:
        size, budget, root = argv[1:4]
        layout = argv[4] if len(argv) > 4 else "files"
        print(json.dumps(child(int(size), None if budget == "none" else int(budget), root,
                               layout)))
        return 0
    if argv[:1] == ["budget"]:
        return main_budget(argv[1:])
    from ckptfs.bench.async_save import main as bench_main
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
