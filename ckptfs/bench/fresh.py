"""The fresh-process question (``fresh``): what a short job, an evaluation or a resumed job sees.

Each measurement is one new Python process that imports torch, builds the state (untimed), then
times **the import of the checkpoint library and its first call** (a durable save, or a load),
and, for the steady state, the median of the next saves in the same process.  Variants run
interleaved, round by round, so a noisy machine hits them alike:

- ``ckptfs``: this tree (``ckptfs.open(dir).save``/``load``);
- ``dcp``: ``torch.distributed.checkpoint`` with ``FileSystemWriter`` (``sync_files=True``)
  and ``FileSystemReader`` (loading into a preallocated state, as DCP needs);
- ``torch``: ``torch.save`` + fsync, ``torch.load``;
- ``baseline``: ckptfs from another checkout (``--baseline PATH``: a worktree of the commit to
  compare with), through the same public API, so a regression is seen the day it lands.

The child code is a script of its own using only the public API, so it runs unchanged against
an older checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ckptfs.bench.common import GiB, fmt_size

CHILD = r'''
import json, os, sys, time
spec = json.loads(sys.argv[1])
import torch
torch.manual_seed(0)
n = spec["tensors"]
per = spec["size"] // n // 4
state = {"model": {f"layer{i}.weight": torch.empty(per).uniform_() for i in range(n)},
         "trainer": {"step": 1, "lr": 1e-4}}
d = spec["dir"]
lib, op = spec["lib"], spec["op"]

def fsync_tree(root):
    for dp, _, fs in os.walk(root):
        for f in fs:
            fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            os.fsync(fd); os.close(fd)

def save(i):
    if lib in ("ckptfs", "baseline"):
        store.save(i, state)
    elif lib == "dcp":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{d}/dcp-{i}", sync_files=True))
    else:
        os.makedirs(d, exist_ok=True)
        p = f"{d}/torch-{i}.pt"
        with open(p, "wb") as f:
            torch.save(state, f); f.flush(); os.fsync(f.fileno())

def load(i):
    if lib in ("ckptfs", "baseline"):
        return store.load(i)
    if lib == "dcp":
        dcp.load(template, storage_reader=dcp.FileSystemReader(f"{d}/dcp-{i}"))
        return template
    return torch.load(f"{d}/torch-{i}.pt", weights_only=True)

out = {}
if op == "load":
    template = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
                "trainer": {"step": 0, "lr": 0.0}}
    del state
t0 = time.perf_counter()
if lib in ("ckptfs", "baseline"):
    import ckptfs
    store = ckptfs.open(d)
elif lib == "dcp":
    import torch.distributed.checkpoint as dcp
t1 = time.perf_counter()
if op == "save":
    save(1)
    t2 = time.perf_counter()
    steady = []
    for i in range(2, 2 + spec["steady"]):
        a = time.perf_counter(); save(i); steady.append(time.perf_counter() - a)
    out = {"import": t1 - t0, "first": t2 - t1, "fresh": t2 - t0, "steady": steady}
else:
    got = load(1)
    t2 = time.perf_counter()
    assert got["model"]["layer0.weight"].numel() > 0
    out = {"import": t1 - t0, "first": t2 - t1, "fresh": t2 - t0, "steady": []}
print("RESULT " + json.dumps(out))
'''


def _prepare_load(lib: str, d: str, size: int, tensors: int, env: dict[str, str]) -> None:
    """Write the checkpoint a load variant reads (step 1), as the child's ``save(1)`` writes it,
    just before that variant runs.  In this process (this tree's ckptfs, DCP and torch: a
    process of its own would cost one more torch import per round and library, for no
    difference in what the load reads), except ``baseline``: another checkout's ckptfs writes
    its own checkpoint, in a process of its own."""
    if lib == "baseline":
        _child(lib, "save", d, size, tensors, 0, env)
        return
    import torch

    per = size // tensors // 4
    with torch.random.fork_rng(devices=[]):  # this process's random state left as it was
        torch.manual_seed(0)
        state = {"model": {f"layer{i}.weight": torch.empty(per).uniform_()
                           for i in range(tensors)},
                 "trainer": {"step": 1, "lr": 1e-4}}
    if lib == "ckptfs":
        import ckptfs

        ckptfs.open(d).save(1, state)
    elif lib == "dcp":
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            save(state, storage_writer=FileSystemWriter(f"{d}/dcp-1", sync_files=True))
    else:
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/torch-1.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


def _child(lib: str, op: str, d: str, size: int, tensors: int, steady: int,
           env: dict[str, str]) -> dict[str, Any]:
    spec = {"lib": lib, "op": op, "dir": d, "size": size, "tensors": tensors, "steady": steady}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"{lib} {op} child failed ({proc.returncode}): {proc.stderr[-2000:]}")


def _env(path: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
    return env


def bench_fresh(size: int = GiB, *, rounds: int = 3, steady: int = 2, tensors: int = 64,
                baseline: str | None = None, libs: Sequence[str] = ("ckptfs", "dcp", "torch"),
                workdir: str | None = None, log: Callable[[str], None] = print
                ) -> dict[str, Any]:
    """Fresh-process save and load, variants interleaved round by round (module docstring)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    envs = {lib: _env(here) for lib in libs}
    if baseline is not None:
        envs["baseline"] = _env(os.path.abspath(baseline))
    base = workdir or tempfile.mkdtemp(prefix="ckptfs-fresh-")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        lib: {"save": [], "load": []} for lib in envs}
    try:
        for r in range(rounds):
            for lib, env in envs.items():
                d = os.path.join(base, f"{lib}-{r}")
                res = _child(lib, "save", d, size, tensors, steady, env)
                runs[lib]["save"].append(res)
                shutil.rmtree(d, ignore_errors=True)
                _prepare_load(lib, d, size, tensors, env)
                runs[lib]["load"].append(_child(lib, "load", d, size, tensors, 0, env))
                shutil.rmtree(d, ignore_errors=True)
                log(f"round {r + 1}/{rounds} {lib}: save fresh "
                    f"{runs[lib]['save'][-1]['fresh']:.3f} s (import "
                    f"{runs[lib]['save'][-1]['import']:.3f} s), steady "
                    f"{statistics.median(runs[lib]['save'][-1]['steady'] or [0]):.3f} s; load "
                    f"fresh {runs[lib]['load'][-1]['fresh']:.3f} s")
    finally:
        if workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    summary: dict[str, dict[str, float]] = {}
    for lib, ops in runs.items():
        summary[lib] = {
            "save_fresh": statistics.median(x["fresh"] for x in ops["save"]),
            "save_import": statistics.median(x["import"] for x in ops["save"]),
            "save_first": statistics.median(x["first"] for x in ops["save"]),
            "save_steady": statistics.median(s for x in ops["save"] for s in x["steady"])
            if steady else float("nan"),
            "load_fresh": statistics.median(x["fresh"] for x in ops["load"]),
        }
    ratios = {}
    if "ckptfs" in summary:
        for other in summary:
            if other == "ckptfs":
                continue
            for k in ("save_fresh", "save_steady", "load_fresh"):
                ratios[f"{other}/ckptfs {k}"] = summary[other][k] / summary["ckptfs"][k]
    log(f"fresh process, {fmt_size(size)} in {tensors} tensors, medians of {rounds} rounds "
        "(ratio > 1: ckptfs is faster):")
    for lib, s in summary.items():
        log(f"  {lib:9s} save fresh {s['save_fresh']:.3f} s (import {s['save_import']:.3f}, "
            f"first {s['save_first']:.3f}), steady {s['save_steady']:.3f} s, load fresh "
            f"{s['load_fresh']:.3f} s")
    for k, v in ratios.items():
        log(f"  {k}: {v:.2f}x")
    return {"size": size, "tensors": tensors, "rounds": rounds, "runs": runs,
            "summary": summary, "ratios": ratios, "baseline": baseline}
