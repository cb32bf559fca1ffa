"""The fixed-costs question (``ckptfs bench fixed``): what every save and load costs a user on
top of the bytes.

Four comparisons, each answered side by side in one run, the variants interleaved round by round
(a noisy, shared machine hits them alike; each ratio is taken pair by pair within a round, and
the median of those is the figure, printed with the range of the per-round ratios and the ratio
of the medians beside it):

1. **tiny**: a tiny state's save in a warm process (a few small tensors and a trainer dict:
   what is left is the cost of the call itself): ``store.save`` (durable, the default) against
   DCP's ``torch.distributed.checkpoint.save`` (``FileSystemWriter``, ``sync_files=True``, its
   default) and ``torch.save`` + ``fsync``.  The durability differs and the output says so:
   ckptfs fsyncs every file, ``MANIFEST.json``, the attempt's directory, the step's,
   ``checkpoints/`` and the run root, and the marker (docs/protocol.md); DCP fsyncs its data
   files and ``.metadata`` but no directory (a power cut can lose the rename that publishes
   it), so a third variant adds those two directory fsyncs to DCP's save (the same durability
   as a ckptfs save); ``torch.save`` here fsyncs its one file.  The same pair without durability
   (``durable=False``: ckptfs still fsyncs the marker, as the protocol requires; DCP
   ``sync_files=False``) is measured beside it.  Then the same state loaded back: ``store.load``
   (verified) against ``torch.load(weights_only=True)`` and DCP's ``load`` in place.
2. **load**: a verified 64 MiB load (a GPT-shaped model and its AdamW state,
   `transformer_state`): ``store.load`` (every byte hashed, the default) against
   ``torch.load(weights_only=True)`` and DCP's ``load`` into tensors allocated beforehand
   (allocation not timed, which favours DCP).
3. **fresh**: a verified 1 GiB load in a fresh process: each measurement is a new Python
   process that imports torch (untimed), then times the import of the library and its first
   load, as a resumed job or an evaluation sees it (bytecode cached, as users have it: one
   untimed warm-up child of each first).  ``ckptfs`` against ``torch.load`` and DCP's ``load``
   (into a state allocated before the timer, ``torch.distributed.checkpoint``'s import timed),
   in turn.
4. **inplace**: the in-place sharded load at 2 gloo ranks, how an FSDP2 job resumes:
   ``store.load(step, into=state)`` against ``dcp.load(state, ...)``, one job per library
   and round (`ckptfs.bench.sharded.bench_inplace`, section 5 of ``benchmarks/sharded.py``):
   the ratio of each round's first loads (a job resuming), and of the later loads (steady).

Peak memory: for the in-process variants (tiny, load) the kernel's high-water mark above the
RSS right before each call (``/proc/self/clear_refs``); for a fresh process, above its RSS
after ``import torch``; for the in-place load, above each rank's RSS before its loads (the state
held already), the larger rank's.

Ratios read "other time / ckptfs time": above 1, ckptfs is faster.  The targets:
tiny save >= 1.0x DCP, verified 64 MiB load >= 0.8x ``torch.load``, fresh-process verified
1 GiB load >= 1.0x ``torch.load``, in-place sharded load >= 1.3x ``dcp.load``.

``ckptfs bench fixed [--parts tiny,load,fresh,inplace] [--quick] [sizes and rounds]`` writes
``results/fixed.json`` (``--report``: and the "Fixed costs" section of ``benchmarks.md``);
``python -m benchmarks.fixed_costs [same options] [--json PATH]`` prints the same and writes
only ``--json``.  The default run takes two to three minutes on 2 cores; ``--quick`` runs every
part at tiny sizes in seconds (a smoke test: its figures mean nothing).  Another checkout is
measured with ``PYTHONPATH=<checkout>`` (its child processes import the same checkout).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptfs.bench.common import MiB, fmt_size, parse_size, peak_extra_rss, rss_mark

PARTS = ("tiny", "load", "fresh", "inplace")
#: The targets (other / ckptfs, at least), by the label of the comparison they judge.
TARGETS = {"tiny save: dcp/ckptfs": 1.0, "warm load: torch.load/ckptfs": 0.8,
           "fresh load: torch.load/ckptfs": 1.0, "in-place load: dcp/ckptfs": 1.3}
#: How each target reads in the report.
TARGET_TEXT = {"tiny save: dcp/ckptfs": "tiny-state save >= 1.0x DCP save",
               "warm load: torch.load/ckptfs": "verified {size} load >= 0.8x torch.load",
               "fresh load: torch.load/ckptfs":
                   "fresh-process verified {size} load >= 1.0x torch.load",
               "in-place load: dcp/ckptfs": "in-place sharded load ({size}, 2 ranks) >= 1.3x "
                                            "dcp.load"}
#: Sizes and rounds: the default run, and ``--quick`` (every code path, in seconds).
DEFAULTS = {"tiny_rounds": 40, "load_size": 64 * MiB, "load_rounds": 15, "fresh_size": 1 << 30,
            "fresh_rounds": 3, "inplace_size": 1 << 30, "inplace_rounds": 3, "inplace_loads": 3}
QUICK = {"tiny_rounds": 3, "load_size": 1 * MiB, "load_rounds": 2, "fresh_size": 1 * MiB,
         "fresh_rounds": 1, "inplace_size": 2 * MiB, "inplace_rounds": 1, "inplace_loads": 2}
#: Decoder layers of the in-place load's FSDP2 model (as ``benchmarks/sharded.py``).
INPLACE_LAYERS = 8
DURABILITY = ("durability: ckptfs fsyncs its 2 files, MANIFEST.json and 4 directories at once, "
              "then the marker and its directory (9 fsyncs in 3 waits); DCP (sync_files=True) "
              "its file and .metadata (2), no directory: a power cut can lose its rename; '+ its "
              "2 directory fsyncs' adds them")

FRESH_CHILD = r'''
import json, sys, time
spec = json.loads(sys.argv[1])
import torch

def kib(field):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None

if spec["lib"] == "dcp":
    state = {"model": {f"layer{i}.weight": torch.empty(spec["per"])
                       for i in range(spec["tensors"])}, "trainer": {"step": 0, "lr": 0.0}}
base = kib("VmRSS")
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    base = None
t0 = time.perf_counter()
if spec["lib"] == "ckptfs":
    import ckptfs
    state = ckptfs.open(spec["dir"]).load(1)
elif spec["lib"] == "dcp":
    import warnings
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    dcp.load(state, storage_reader=dcp.FileSystemReader(spec["dir"]))
else:
    state = torch.load(spec["path"], weights_only=True)
t1 = time.perf_counter()
peak = kib("VmHWM")
assert sum(t.numel() for t in state["model"].values()) * 4 >= spec["size"] * 0.99
rss = None if base is None or peak is None else max(0, peak - base) * 1024
print("RESULT " + json.dumps({"s": t1 - t0, "rss": rss}))
'''


def _dcp() -> Any:
    warnings.filterwarnings("ignore")  # "assuming the intent is to save in a single process"
    import torch.distributed.checkpoint as dcp

    return dcp


def tiny_state() -> dict[str, Any]:
    """A few small tensors (64 KiB) and a trainer dict."""
    import torch

    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(4)},
            "trainer": {"step": 1, "epoch": 0, "lr": 1e-4, "loss": 0.42}}


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing), so that no timed call starts on pages an earlier call freed (`interleave`)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def interleave(variants: Mapping[str, Callable[[int], Any]], rounds: int, warmup: int = 2,
               rss: dict[str, list[int]] | None = None) -> dict[str, list[float]]:
    """Each variant once per round, in turn (``warmup`` untimed rounds first); the seconds of
    every timed call by variant, and in ``rss`` (if given) the peak memory of each timed call
    above the RSS before it (the mark is taken outside the timer).  What a call returns is
    released before the next variant runs.

    Before each call, a garbage collection and an ``os.sync()`` (both untimed), so that none
    falls inside the timer on one side only: without the sync, what a variant left unsynced
    (DCP's renames and directory entries, a save without fsyncs) is written by the next
    variant's first fsync, and a durable save pays for the others' writes.  The objects alive
    when the rounds start (torch's and the libraries', ~170,000) are frozen first
    (`gc.freeze`): a full collection over them took 0.13 s here, 50 s of the tiny part's 55 s,
    and no call frees any of them.

    And the C heap trimmed (`trim_heap`, untimed): what one variant freed is given back to the
    system instead of being the next variant's ready memory.  Without it the variant run
    right after ckptfs's load reused the 52 MiB of pages ckptfs's result had just freed,
    while ckptfs (after DCP's in-place load, which frees little) faulted its own in: alone in
    a loop, ckptfs and ``torch.load`` each faulted the whole state in every time and took the
    same 37 ms, interleaved ``torch.load`` took 15 ms right after ckptfs.  A resumed job loads
    into fresh memory, as every variant now does."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    i = 0
    gc.collect()
    gc.freeze()
    try:
        for r in range(warmup + rounds):
            for name, fn in variants.items():
                i += 1
                gc.collect()
                if hasattr(os, "sync"):
                    os.sync()
                trim_heap()
                mark = rss_mark() if rss is not None else None
                t0 = time.perf_counter()
                out = fn(i)
                elapsed = time.perf_counter() - t0
                peak = peak_extra_rss(mark)
                del out
                if r >= warmup:
                    times[name].append(elapsed)
                    if rss is not None and peak is not None:
                        rss.setdefault(name, []).append(peak)
    finally:
        gc.unfreeze()
    return times


def summary(times: Mapping[str, Sequence[float]], pairs: Sequence[tuple[str, str, str]],
            rss: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """Medians (ms) and, for each ``(label, other, ckptfs)``, the median of the per-round
    ratios ``other / ckptfs`` (what the targets are judged on), their range, and the ratio of
    the medians (printed beside it: with few rounds, one slow round of either side moves the
    first); with ``rss``, each variant's median peak extra memory (MiB)."""
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    per_round = {label: [a / b for a, b in zip(times[o], times[c], strict=True)]
                 for label, o, c in pairs}
    out: dict[str, Any] = {
        "median_ms": medians,
        "ratios": {label: statistics.median(v) for label, v in per_round.items()},
        "ratio_ranges": {label: [min(v), max(v)] for label, v in per_round.items()},
        "ratios_of_medians": {label: medians[o] / medians[c] for label, o, c in pairs},
        "pairs": {label: [o, c] for label, o, c in pairs},
        # The order to show them in (a JSON file written with sorted keys loses the dicts').
        "labels": [label for label, _, _ in pairs], "variants": list(times),
        "times_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()},
        "rounds": min((len(v) for v in times.values()), default=0)}
    if rss:
        out["peak_extra_rss_mib"] = {k: round(statistics.median(v) / MiB, 2)
                                     for k, v in rss.items() if v}
    return out


def merge(a: dict[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two `summary` results of one part as one (their variants and labels are distinct)."""
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            a[k].update(v)
        elif k in ("labels", "variants"):
            a[k] = [*a.get(k, []), *v]
        elif k == "rounds":
            a[k] = min(a.get(k, v), v)
        else:
            a[k] = v
    return a


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def empty_like(x: Any) -> Any:
    """A state of the same structure with every tensor ``torch.empty_like`` (what DCP loads
    into)."""
    import torch

    if isinstance(x, torch.Tensor):
        return torch.empty_like(x)
    if isinstance(x, dict):
        return {k: empty_like(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(empty_like(v) for v in x)
    return x


def bench_tiny(base: str, rounds: int) -> dict[str, Any]:
    """Part 1: the tiny state's save (six variants), then its load (three)."""
    import torch

    import ckptfs

    dcp = _dcp()
    state = tiny_state()
    durable = ckptfs.open(f"{base}/ckptfs")
    fast = ckptfs.open(f"{base}/ckptfs-fast", durable=False)

    def torch_save(i: int) -> None:
        with open(f"{base}/torch-{i}.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def dcp_durable(i: int) -> None:
        """DCP's save, then the two directory fsyncs that make it survive a power cut as a
        ckptfs save does: its directory (the files' entries, the rename of ``.metadata``) and
        the parent (the directory's own entry)."""
        dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{base}/dcpd-{i}",
                                                            sync_files=True))
        _fsync_dir(f"{base}/dcpd-{i}")
        _fsync_dir(base)

    variants: dict[str, Callable[[int], Any]] = {
        "ckptfs save (durable)": lambda i: durable.save(i, state),
        "DCP save + its 2 directory fsyncs": dcp_durable,
        "DCP save (sync_files=True)": lambda i: dcp.save(
            state, storage_writer=dcp.FileSystemWriter(f"{base}/dcp-{i}", sync_files=True)),
        "torch.save + fsync": torch_save,
        "ckptfs save (durable=False)": lambda i: fast.save(i, state),
        "DCP save (sync_files=False)": lambda i: dcp.save(
            state, storage_writer=dcp.FileSystemWriter(f"{base}/dcpf-{i}", sync_files=False)),
    }
    rss: dict[str, list[int]] = {}
    out = summary(interleave(variants, rounds, rss=rss), [
        ("tiny save: dcp/ckptfs", "DCP save (sync_files=True)", "ckptfs save (durable)"),
        ("tiny save, same durability: dcp+dir fsyncs/ckptfs",
         "DCP save + its 2 directory fsyncs", "ckptfs save (durable)"),
        ("tiny save: torch.save/ckptfs", "torch.save + fsync", "ckptfs save (durable)"),
        ("tiny save, no fsync of data: dcp/ckptfs", "DCP save (sync_files=False)",
         "ckptfs save (durable=False)"),
    ], rss)
    # The load: each library's own checkpoint of the state (ckptfs's durable one).
    durable.save(0, state)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{base}/dcp-load"))
    torch.save(state, f"{base}/load.pt")
    template = empty_like(state)
    loads: dict[str, Callable[[int], Any]] = {
        "ckptfs load (verified), tiny": lambda i: durable.load(0),
        "torch.load, tiny": lambda i: torch.load(f"{base}/load.pt", weights_only=True),
        "DCP load (in place), tiny": lambda i: dcp.load(
            template, storage_reader=dcp.FileSystemReader(f"{base}/dcp-load")),
    }
    rss = {}
    return merge(out, summary(interleave(loads, rounds, rss=rss), [
        ("tiny load: torch.load/ckptfs", "torch.load, tiny", "ckptfs load (verified), tiny"),
        ("tiny load: dcp/ckptfs", "DCP load (in place), tiny", "ckptfs load (verified), tiny"),
    ], rss))


def bench_load(base: str, size: int, rounds: int) -> dict[str, Any]:
    """Part 2: the verified load of a ``size`` transformer state, warm process."""
    import torch

    import ckptfs
    from ckptfs.bench.common import transformer_state

    dcp = _dcp()
    state = transformer_state(size)
    store = ckptfs.open(f"{base}/ckptfs")
    store.save(1, state)
    torch.save(state, f"{base}/state.pt")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{base}/dcp"))
    template = empty_like(state)
    del state
    variants: dict[str, Callable[[int], Any]] = {
        "ckptfs load (verified)": lambda i: store.load(1),
        "torch.load": lambda i: torch.load(f"{base}/state.pt", weights_only=True),
        "DCP load (in place)": lambda i: dcp.load(
            template, storage_reader=dcp.FileSystemReader(f"{base}/dcp")),
    }
    rss: dict[str, list[int]] = {}
    out = summary(interleave(variants, rounds, rss=rss), [
        ("warm load: torch.load/ckptfs", "torch.load", "ckptfs load (verified)"),
        ("warm load: dcp/ckptfs", "DCP load (in place)", "ckptfs load (verified)"),
    ], rss)
    out["size"] = size
    return out


def _fresh_child(spec: Mapping[str, Any], env: Mapping[str, str]) -> tuple[float, int | None]:
    # From a directory holding no ckptfs: ``python -c`` puts the working directory first on
    # sys.path, which would shadow the checkout given by PYTHONPATH.
    proc = subprocess.run([sys.executable, "-c", FRESH_CHILD, json.dumps(spec)], env=dict(env),
                          capture_output=True, text=True, timeout=900, check=False,
                          cwd=tempfile.gettempdir())
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            doc = json.loads(line[7:])
            return float(doc["s"]), doc.get("rss")
    raise RuntimeError(f"{spec['lib']} child failed ({proc.returncode}): {proc.stderr[-2000:]}")


def bench_fresh(base: str, size: int, rounds: int, tensors: int = 64) -> dict[str, Any]:
    """Part 3: fresh processes, ckptfs, torch.load and DCP in turn (module docstring).  The
    state: ``tensors`` equal fp32 tensors, as ``ckptfs bench fresh`` has it."""
    import torch

    import ckptfs

    dcp = _dcp()
    per = max(1, size // tensors // 4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state = {"model": {f"layer{i}.weight": torch.empty(per).uniform_()
                           for i in range(tensors)}, "trainer": {"step": 1, "lr": 1e-4}}
    ckptfs.open(f"{base}/ckptfs").save(1, state)
    torch.save(state, f"{base}/state.pt")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{base}/dcp"))
    del state
    here = os.path.dirname(os.path.dirname(os.path.abspath(ckptfs.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    common = {"size": per * tensors * 4, "per": per, "tensors": tensors}
    specs = {"ckptfs": {"lib": "ckptfs", "dir": f"{base}/ckptfs", **common},
             "torch.load": {"lib": "torch", "path": f"{base}/state.pt", **common},
             "DCP load": {"lib": "dcp", "dir": f"{base}/dcp", **common}}
    times: dict[str, list[float]] = {k: [] for k in specs}
    rss: dict[str, list[int]] = {k: [] for k in specs}
    for r in range(rounds + 1):  # round 0: bytecode compiled and cached, untimed
        for name, spec in specs.items():
            t, peak = _fresh_child(spec, env)
            if r:
                times[name].append(t)
                if peak is not None:
                    rss[name].append(peak)
    out = summary(times, [("fresh load: torch.load/ckptfs", "torch.load", "ckptfs"),
                          ("fresh load: dcp/ckptfs", "DCP load", "ckptfs")], rss)
    out["size"] = per * tensors * 4
    return out


def bench_inplace_part(base: str, size: int, rounds: int, loads: int,
                       layers: int = INPLACE_LAYERS) -> dict[str, Any]:
    """Part 4: `ckptfs.bench.sharded.bench_inplace` (2 gloo ranks, one job per library and
    round), its times as this question's comparisons: the first load of each job, and the
    median of its later loads."""
    from ckptfs.bench.sharded import CKPTFS, DCP, bench_inplace

    raw = bench_inplace(size, rounds, loads, layers, Path(base))
    ours, theirs = "ckptfs load(into=)", "dcp.load"
    times = {f"{ours}, first": raw["times_s"][CKPTFS], f"{theirs}, first": raw["times_s"][DCP]}
    pairs = [("in-place load: dcp/ckptfs", f"{theirs}, first", f"{ours}, first")]
    if raw.get("steady"):
        times[f"{ours}, steady"] = raw["steady"]["times_s"][CKPTFS]
        times[f"{theirs}, steady"] = raw["steady"]["times_s"][DCP]
        pairs.append(("in-place load, steady: dcp/ckptfs", f"{theirs}, steady",
                      f"{ours}, steady"))
    out = summary(times, pairs)
    peaks = raw.get("peak_extra_rss_mib") or {}
    if peaks:
        out["peak_extra_rss_mib"] = {f"{ours}, first": peaks.get(CKPTFS),
                                     f"{theirs}, first": peaks.get(DCP)}
    out.update(size=size, world=raw["world"], loads=loads, layers=layers,
               bit_exact=raw["bit_exact"])
    return out


def settings(quick: bool = False, **given: Any) -> dict[str, int]:
    """The sizes and rounds of a run: ``given`` where set (not None, not 0), else ``--quick``'s
    or the defaults."""
    base = QUICK if quick else DEFAULTS
    return {k: int(given[k]) if given.get(k) else v for k, v in base.items()}


def bench_fixed(parts: Sequence[str] = PARTS, *, quick: bool = False,
                workdir: str | None = None, log: Callable[[str], None] = print,
                **sizes: Any) -> dict[str, Any]:
    """Run ``parts`` (of `PARTS`, in that order) with `settings` ``(quick, **sizes)``; the
    results, with ``targets`` (`target_rows`) and what ran where."""
    from ckptfs.bench.common import machine_info

    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    cfg = settings(quick, **sizes)
    base = tempfile.mkdtemp(prefix="ckptfs-fixed-", dir=workdir)
    results: dict[str, Any] = {"settings": cfg, "quick": quick,
                               "parts": [p for p in PARTS if p in parts]}
    steps: dict[str, Callable[[str], dict[str, Any]]] = {
        "tiny": lambda d: bench_tiny(d, cfg["tiny_rounds"]),
        "load": lambda d: bench_load(d, cfg["load_size"], cfg["load_rounds"]),
        "fresh": lambda d: bench_fresh(d, cfg["fresh_size"], cfg["fresh_rounds"]),
        "inplace": lambda d: bench_inplace_part(d, cfg["inplace_size"], cfg["inplace_rounds"],
                                                cfg["inplace_loads"]),
    }
    try:
        for part in results["parts"]:
            where = os.path.join(base, part)
            os.makedirs(where)
            la0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            log(f"[{time.strftime('%H:%M:%S')}] fixed costs: {part} ...")
            results[part] = steps[part](where)
            results[part]["seconds"] = round(time.perf_counter() - t0, 1)
            results[part]["load_average"] = [round(la0, 2), round(os.getloadavg()[0], 2)]
            shutil.rmtree(where, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    import ckptfs

    results["ckptfs"] = os.path.dirname(os.path.abspath(ckptfs.__file__))
    results["machine"] = machine_info()
    results["targets"] = target_rows(results)
    print_report(results, log)
    return results


def target_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each target whose part ran: its ratio (median of the per-round ratios), the range of
    those, the ratio of the medians, the goal and whether the ratio meets it."""
    rows = []
    for label, goal in TARGETS.items():
        part = next((results[p] for p in PARTS if isinstance(results.get(p), Mapping)
                     and label in results[p].get("ratios", {})), None)
        if part is None:
            continue
        ratio = float(part["ratios"][label])
        size = f"{fmt_size(part['size'])}" if "size" in part else ""
        rows.append({"label": label, "target": TARGET_TEXT[label].format(size=size),
                     "goal": goal, "ratio": round(ratio, 3),
                     "range": [round(x, 3) for x in part["ratio_ranges"][label]],
                     "ratio_of_medians": round(float(part["ratios_of_medians"][label]), 3),
                     "rounds": part.get("rounds"), "met": ratio >= goal})
    return rows


PART_TITLES = {"tiny": "tiny state (64 KiB), warm process: save, then load",
               "load": "verified load, warm process",
               "fresh": "verified load, fresh process (import + first load)",
               "inplace": "in-place sharded load, 2 gloo ranks (one job per library and round)"}


def print_report(results: Mapping[str, Any], log: Callable[[str], None] = print) -> None:
    """The results as text: per part, each variant's median (and peak extra memory), each
    ratio with its range and, for a target, met or missed."""
    log(f"fixed costs of ckptfs at {results.get('ckptfs', '?')} (ratio = other / ckptfs, median "
        "of the per-round ratios; > 1: ckptfs is faster)")
    for part, title in PART_TITLES.items():
        if part not in results:
            continue
        r = results[part]
        size = f" ({fmt_size(r['size'])})" if "size" in r else ""
        n = r.get("rounds")
        log(f"{title}{size}, {n} round{'' if n == 1 else 's'}:")
        rss = r.get("peak_extra_rss_mib") or {}
        for name in r.get("variants") or r["median_ms"]:
            ms = r["median_ms"][name]
            peak = f"  peak extra RSS {rss[name]:.1f} MiB" if rss.get(name) is not None else ""
            log(f"  {name:34s} {ms:9.2f} ms{peak}")
        for label in r.get("labels") or r["ratios"]:
            ratio = r["ratios"][label]
            target = TARGETS.get(label)
            verdict = "" if target is None else \
                f"  (target >= {target:.1f}x: {'met' if ratio >= target else 'missed'})"
            lo, hi = r["ratio_ranges"][label]
            log(f"  ratio {label}: {ratio:.2f}x (of the medians: "
                f"{r['ratios_of_medians'][label]:.2f}x; per round {lo:.2f}-{hi:.2f}x){verdict}")
        if part == "tiny":
            log("  " + DURABILITY)


def run_args(args: argparse.Namespace) -> dict[str, Any]:
    """`bench_fixed` with the options of ``ckptfs bench fixed`` (``fixed_*`` in ``args``)."""
    parts = args.fixed_parts  # a list (``--parts``), or the default's text (``bench all``)
    if isinstance(parts, str):
        parts = [p.strip() for p in parts.split(",") if p.strip()]
    if args.fixed_skip_fresh:
        parts = [p for p in parts if p != "fresh"]
    sizes = {k: getattr(args, f"fixed_{k}") for k in DEFAULTS}
    for k in ("load_size", "fresh_size", "inplace_size"):
        sizes[k] = parse_size(sizes[k]) if sizes[k] else None
    return bench_fixed(parts, quick=args.fixed_quick, workdir=args.fixed_workdir or None,
                       **sizes)
