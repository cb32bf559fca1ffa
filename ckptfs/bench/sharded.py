"""Sharded checkpoints (format v2) against DCP's FileSystemWriter/Reader.

**Every measurement is a fresh job**: new Python processes (one per rank, gloo over loopback,
``torch.distributed`` initialized as ``torchrun`` would), which import torch, build the state
(untimed), then time the checkpoint library's import and its calls.  Variants run interleaved,
round by round (ckptfs, DCP, ckptfs, DCP, ...), so a shared machine's load hits them alike.
The rank code is a script of its own using only ckptfs's public API, so ``--baseline PATH``
(another checkout, e.g. the previous commit) runs it unchanged, next to this tree.

1. **save, W=2**: each rank holds an FSDP2 MLP (``fully_shard``) and its AdamW state, from
   ``get_state_dict`` (which imports DCP in every variant, as it does for an FSDP2 user).  A
   save is ``ckptfs.open(dir).save(step, sd)`` (durable: every byte hashed once, files and
   directories fsynced, one marker) or ``dcp.save(sd, storage_writer=FileSystemWriter(dir))``
   (its default: fsync of each file, one file per rank).  Times are rank 0's, from a barrier
   to the save's return (after the coordinator's commit, on every rank): ``first`` is the
   process's first save (its one-time costs included: ckptfs's gloo group, lazy imports),
   ``steady`` the median of the next ones; ``import`` is ``import ckptfs`` + ``open`` (DCP:
   nothing left to import).  Before each save a rank writes and deletes a scratch file of its
   share of the state + 25% (``--no-prewarm``: not): this VM hands memory that sat free
   back to its host, and the page cache a save fills would otherwise be first-touched from
   there, about 1.5-2 s per 512 MiB here for every variant alike, which buries the difference
   between them under the VM's cost;
2. **load 2 -> 1**: the W=2 checkpoint of each variant loaded whole, in a fresh single process,
   into plain full-size tensors: ``store.load(step)`` (every chunk verified against its digest)
   against DCP's own full load (``_load_state_dict`` with ``_EmptyStateDictLoadPlanner``, as
   ``dcp_to_torch_save`` does).  torch.distributed.checkpoint is imported before the timer in
   both (a DCP user has imported it); ``import ckptfs`` is timed apart.  The checkpoint is
   read once before each load (so both read from the page cache, whichever was saved first).
   The results are compared bit for bit (a digest of every tensor);
3. **tiny**: 4 tensors of 256 KiB sharded over 2 ranks, several saves per job: the fixed cost
   of a collective save (what dominates frequent checkpoints of small models);
4. **world sizes**: the save at 1, 2 and 4 ranks (a smaller state);
5. **in-place load, W=2**: how an FSDP2 job resumes.  One job saves its ``{"model",
   "optimizer"}`` state with ckptfs and with DCP's FileSystemWriter; then, round by round, one
   job per library (its own processes: one library's freed buffers never serve the other's
   allocations) builds the same state and loads the checkpoint back into it
   ``--inplace-loads`` times: ``store.load(step, into=state)`` (every byte verified against its
   digest) or ``dcp.load(state, storage_reader=FileSystemReader(dir))``.  Times are rank 0's,
   from a barrier to a barrier after the load: ``first`` (a job resuming) and ``steady`` (the
   next loads); every target is zeroed before each load and compared bit for bit with the
   saved state after it.  ``--inplace-size`` (default 64 MiB; 1 GiB for the recorded figures,
   0 to skip);
6. **cost at scale**: tiny models saved by 2, 4 and 8 ranks, counting every storage call of
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
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptfs.bench.common import (
    MiB,
    flat_tensors,
    fmt_size,
    fs_type,
    machine_info,
    parse_size,
    peak_extra_rss,
    rss_mark,
)
from ckptfs.bench.latest import CountingStorage

RANK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
WARM = 256 * MiB
#: The variant that is this tree; ``dcp`` is DCP; ``baseline`` is ckptfs from ``--baseline``.
CKPTFS, DCP, BASELINE = "ckptfs", "dcp", "baseline"

# ----------------------------------------------------------------------------------------------
# One process of a job (a rank of a save, or the single process of a load).  Public ckptfs API
# only; DCP's full load is reached through torch_compat of *this* tree (the dcp variant always
# runs this tree).

CHILD = r'''
import hashlib, json, os, sys, time
spec = json.loads(sys.argv[1])
rank = int(sys.argv[2])
import torch
torch.set_num_threads(1)
import torch.distributed as dist
from datetime import timedelta
lib, root = spec["lib"], spec["root"]
WARM = spec["warm"]

def warm(n):
    if n > 0:
        x = torch.empty(n, dtype=torch.uint8); x.fill_(1); del x

def warm_page_cache(n):
    """Write and delete a scratch file of n bytes: its page cache, freed by the unlink, is what
    the timed save then fills (this VM's free memory, returned to the host, costs several times
    more at first touch: about 1.5-2 s per 512 MiB here, the same for every variant)."""
    if n <= 0:
        return
    block = bytearray(16 << 20)
    where = os.path.dirname(root.rstrip("/"))
    os.makedirs(where, exist_ok=True)
    path = f"{where}/.warm-{os.getpid()}"
    with open(path, "wb") as f:
        for _ in range(0, n, len(block)):
            f.write(block)
    os.unlink(path)

def fsdp_state(world, total_bytes, layers, seed=0):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    d = max(8, int((total_bytes / (12 * layers)) ** 0.5))
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-0.01, 0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = p.detach().clone()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}, d

def tiny_state(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    return {"model": {f"w{i}": distribute_tensor(torch.randn(256, 256), mesh, [Shard(0)])
                      for i in range(4)}}, 256

def flat(state, prefix=""):
    out = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(flat(v, f"{prefix}.{i}" if prefix else str(i)))
    return out

def local_bytes(state):
    from torch.distributed.tensor import DTensor
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes
               for t in flat(state).values())

out = {}
if spec["op"] == "save":
    world = spec["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=spec["timeout"]))
    if spec["state"] == "tiny":
        state, width = tiny_state(world)
    else:
        state, width = fsdp_state(world, spec["bytes"], spec["layers"])
    own = local_bytes(state)
    mine = torch.tensor([own], dtype=torch.int64)
    dist.all_reduce(mine)
    dist.barrier()
    t0 = time.perf_counter()
    if lib == "dcp":
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
        def save(i):
            dcp_save(state, storage_writer=FileSystemWriter(f"{root}/dcp-{i}"))
    else:
        import ckptfs
        out["ckptfs"] = os.path.dirname(os.path.dirname(ckptfs.__file__))
        store = ckptfs.open(root)
        def save(i):
            store.save(1000 + i, state)
    t_import = time.perf_counter() - t0
    times = []
    for i in range(spec["saves"]):
        if spec.get("prewarm", True):
            warm_page_cache(own + own // 4 + (16 << 20))
        warm(WARM)
        dist.barrier()
        t = time.perf_counter()
        save(i)
        times.append(time.perf_counter() - t)
    dist.barrier()
    out.update({"import": t_import, "times": times, "total_bytes": int(mine.item()),
                "width": width, "step": 1000 + spec["saves"] - 1,
                "dcp_dir": f"{root}/dcp-{spec['saves'] - 1}"})
    # Reported before the process group's teardown, which now and then aborts on this machine
    # ("terminate called without an active exception", DCP and ckptfs jobs alike); then the
    # process ends without it.
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)
else:
    import torch.distributed.checkpoint
    from torch.distributed.checkpoint import FileSystemReader
    if lib == "dcp":
        from ckptfs.torch_compat import EmptyStateDictLoadPlanner, load_state_dict
    warm(WARM + spec["bytes"])  # the tensors the load allocates come from memory just touched
    t0 = time.perf_counter()
    if lib == "dcp":
        t1 = time.perf_counter()
        sd = {}
        load_state_dict(sd, storage_reader=FileSystemReader(spec["dcp_dir"]),
                        planner=EmptyStateDictLoadPlanner(), no_dist=True)
    else:
        import ckptfs
        out["ckptfs"] = os.path.dirname(os.path.dirname(ckptfs.__file__))
        store = ckptfs.open(root)
        t1 = time.perf_counter()
        sd = store.load(spec["step"])
    t2 = time.perf_counter()
    tensors = flat(sd)
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k]
        h.update(f"{k} {t.dtype} {list(t.shape)}\n".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    out.update({"import": t1 - t0, "load": t2 - t1, "digest": h.hexdigest(),
                "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors.values())})
print("RESULT " + json.dumps(out), flush=True)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(spec: Mapping[str, Any], env: Mapping[str, str], *, ranks: int = 1,
            timeout: float = 1800.0) -> dict[str, Any]:
    """One fresh job of ``ranks`` processes running `CHILD`; rank 0's result.  A job still
    running after ``timeout`` is killed, process by process."""
    full = {"port": _free_port(), "timeout": int(timeout), "warm": WARM, **spec}
    # Run from a directory holding no ckptfs: ``python -c`` puts the working directory first
    # on sys.path, which would shadow the variant's checkout given by PYTHONPATH.
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(full), str(r)],
                              env={**env, **RANK_ENV}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
             for r in range(ranks)]
    outs: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    errs = "\n".join(f"rank {r} (exit {p.returncode}): {outs[r][1][-3000:]}"
                     for r, p in enumerate(procs) if r < len(outs) and p.returncode != 0)
    for line in outs[0][0].splitlines():
        # Rank 0 reports after the job's last barrier, so every rank finished its part; a
        # rank failing after that does not void the figures: it is logged.
        if line.startswith("RESULT "):
            if errs:
                print(f"  (ignored: a rank failed after the job's last barrier: {errs[-300:]})",
                      flush=True)
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"benchmark job {spec.get('op')} {spec.get('lib')} failed:\n{errs}")


def _env(path: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def variant_envs(baseline: str | None) -> dict[str, dict[str, str]]:
    """The environment of each variant: this tree for ckptfs and DCP, ``baseline``'s checkout
    first on the path for ``baseline``."""
    here = str(Path(__file__).resolve().parents[2])
    envs = {CKPTFS: _env(here), DCP: _env(here)}
    if baseline is not None:
        envs[BASELINE] = _env(os.path.abspath(baseline))
    return envs


def _median(xs: Sequence[float]) -> float:
    return round(statistics.median(xs), 4)


def summarize(runs: Mapping[str, list[float]], *, field: str = "s",
              ratios: bool = True) -> dict[str, Any]:
    """Medians per variant and the speed-up of ckptfs over each other one (``other/ckptfs``:
    above 1, ckptfs is faster)."""
    out: dict[str, Any] = {f"{lib}_{field}": _median(xs) for lib, xs in runs.items() if xs}
    c = out.get(f"{CKPTFS}_{field}")
    if c and ratios:
        for lib in runs:
            if lib != CKPTFS and out.get(f"{lib}_{field}"):
                key = "speedup" if lib == DCP else f"speedup_vs_{lib}"
                out[key] = round(out[f"{lib}_{field}"] / c, 3)
    out["times_s"] = {lib: [round(x, 4) for x in xs] for lib, xs in runs.items()}
    return out


def bench_saves(envs: Mapping[str, Mapping[str, str]], *, world: int, state: str, size: int,
                layers: int, saves: int, rounds: int, root: Path, keep: bool = False,
                prewarm: bool = True, log: Callable[[str], None] = print
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Save jobs of ``world`` ranks, variants interleaved round by round: the summary (first
    save, steady state, import) and, with ``keep``, where each variant's last checkpoint is."""
    first: dict[str, list[float]] = {lib: [] for lib in envs}
    steady: dict[str, list[float]] = {lib: [] for lib in envs}
    imports: dict[str, list[float]] = {lib: [] for lib in envs}
    kept: dict[str, Any] = {}
    facts: dict[str, Any] = {}
    checkouts: dict[str, str | None] = {}
    for r in range(rounds):
        for lib, env in envs.items():
            where = root / f"{lib}-w{world}-{r}"
            shutil.rmtree(where, ignore_errors=True)
            res = run_job({"op": "save", "lib": lib, "root": str(where), "world": world,
                           "state": state, "bytes": size, "layers": layers, "saves": saves,
                           "prewarm": prewarm},
                          env, ranks=world)
            first[lib].append(res["times"][0])
            if len(res["times"]) > 1:
                steady[lib].append(statistics.median(res["times"][1:]))
            imports[lib].append(res["import"])
            facts = {"bytes": res["total_bytes"], "width": res["width"]}
            checkouts[lib] = res.get("ckptfs")
            log(f"  W={world} {state} round {r + 1}/{rounds} {lib}: first "
                f"{res['times'][0]:.3f} s, then {[round(t, 3) for t in res['times'][1:]]} "
                f"(import {res['import']:.3f} s; load average {os.getloadavg()[0]:.1f})")
            if keep and r == rounds - 1:
                kept[lib] = {"root": str(where), "step": res["step"], "dcp_dir": res["dcp_dir"],
                             "bytes": res["total_bytes"]}
            else:
                shutil.rmtree(where, ignore_errors=True)
    out = {**summarize(first), **facts, "saves_per_job": saves, "rounds": rounds,
           "page_cache_prewarmed": prewarm, "checkouts": checkouts,
           "steady": summarize(steady) if saves > 1 else None,
           "import": summarize(imports, ratios=False)}
    return out, kept


def cache_files(root: str) -> None:
    """Read every file under ``root`` once, so that the load after it reads from the page cache
    whichever variant saved first: this VM pages out page-cache pages unused for about a
    minute (DAMON ``pageout``), which would otherwise favour the variant saved last."""
    buf = bytearray(64 * MiB)
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def bench_load(envs: Mapping[str, Mapping[str, str]], kept: Mapping[str, Any], *, rounds: int,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """2 -> 1: each variant's checkpoint loaded whole in a fresh process, interleaved; the
    results compared bit for bit."""
    times: dict[str, list[float]] = {lib: [] for lib in envs}
    imports: dict[str, list[float]] = {lib: [] for lib in envs}
    digests: dict[str, set[str]] = {lib: set() for lib in envs}
    facts: dict[str, Any] = {}
    for r in range(rounds):
        for lib, env in envs.items():
            cache_files(kept[lib]["root"])
            res = run_job({"op": "load", "lib": lib, **kept[lib]}, env)
            times[lib].append(res["load"])
            imports[lib].append(res["import"])
            digests[lib].add(res["digest"])
            facts = {"tensors": res["tensors"], "bytes": res["bytes"]}
            log(f"  load 2->1 round {r + 1}/{rounds} {lib}: {res['load']:.3f} s (import "
                f"{res['import']:.3f} s; load average {os.getloadavg()[0]:.1f})")
    same = len(set().union(*digests.values())) == 1
    return {**summarize(times), **facts, "bit_identical": same, "rounds": rounds,
            "import": summarize(imports, ratios=False)}


# ----------------------------------------------------------------------------------------------
# The cost figures (storage calls counted per rank): forked ranks, not timed.


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
    """``fn(rank, world, spec)`` on ``world`` gloo ranks (spawned); JSON results in rank
    order.  A job still running after ``timeout`` is killed, process by process."""
    ctx = mp.get_context("spawn")
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


def fsdp_state(world: int, total_bytes: int, layers: int, seed: int = 0) -> dict[str, Any]:
    """This rank's sharded ``{"model", "optimizer"}`` (DTensors) after one AdamW step."""
    from typing import cast

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    d = max(8, int((total_bytes / (12 * layers)) ** 0.5))
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
        adir = Path(spec["root"]) / "ckptfs" / info.path
        out["dcp_msgpack"] = (adir / "dcp.msgpack").stat().st_size
        out["manifest"] = (adir / "MANIFEST.json").stat().st_size
        out["dcp_pickle_metadata"] = (Path(spec["root"]) / "dcp" / ".metadata").stat().st_size
        out["tensors"] = len(flat_tensors(state))
        out["files"] = len(info.manifest.files)
    return out


def job_inplace(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The in-place load (section 5), one job: ``spec["lib"]`` is ``save`` (both checkpoints
    of the state), ``ckptfs`` or ``dcp`` (``spec["loads"]`` loads into the state, zeroed
    before each, bit-exact after each)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import ckptfs

    state = fsdp_state(world, spec["bytes"], spec["layers"])
    local = {k: (v.to_local() if hasattr(v, "to_local") else v)
             for k, v in flat_tensors(state).items()}
    store = ckptfs.open(spec["root"] + "/ckptfs")
    if spec["lib"] == "save":
        store.save(1, state)
        dcp_save(state, storage_writer=FileSystemWriter(spec["root"] + "/dcp"))
        return {}
    saved = {k: v.clone() for k, v in local.items()}
    times: list[float] = []
    mark = rss_mark()  # the loads' own memory: the state and its copy are held already
    for _ in range(spec["loads"]):
        for v in local.values():
            v.zero_()
        dist.barrier()
        t0 = time.perf_counter()
        if spec["lib"] == CKPTFS:
            store.load(1, into=state)
        else:
            dcp_load(state, storage_reader=FileSystemReader(spec["root"] + "/dcp"))
        dist.barrier()
        times.append(time.perf_counter() - t0)
        bad = [k for k, v in local.items() if not torch.equal(v, saved[k])]
        if bad:
            raise AssertionError(f"{spec['lib']}: {len(bad)} tensors differ after an in-place "
                                 f"load, e.g. {bad[0]}")
    return {"times": times, "peak_extra_rss": peak_extra_rss(mark)}


def bench_inplace(size: int, rounds: int, loads: int, layers: int, root: Path
                  ) -> dict[str, Any]:
    """Section 5: both checkpoints saved by one 2-rank job, then ``rounds`` rounds of one job
    per library (ckptfs, DCP; each its own processes, so neither inherits the other's heap),
    each loading ``loads`` times: ``first`` is each job's first load (a job resuming),
    ``steady`` the median of the others."""
    where = root / "inplace"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    spec: dict[str, Any] = {"bytes": size, "layers": layers, "root": str(where),
                            "loads": loads}
    first: dict[str, list[float]] = {CKPTFS: [], DCP: []}
    steady: dict[str, list[float]] = {CKPTFS: [], DCP: []}
    rss: dict[str, list[int]] = {CKPTFS: [], DCP: []}
    try:
        launch(job_inplace, 2, {**spec, "lib": "save"})
        for i in range(rounds):
            for lib in (CKPTFS, DCP) if i % 2 == 0 else (DCP, CKPTFS):
                ranks = launch(job_inplace, 2, {**spec, "lib": lib})
                t = ranks[0]["times"]
                peaks = [r["peak_extra_rss"] for r in ranks if r.get("peak_extra_rss") is not None]
                if peaks:
                    rss[lib].append(max(peaks))
                first[lib].append(t[0])
                if len(t) > 1:
                    steady[lib].append(statistics.median(t[1:]))
    finally:
        shutil.rmtree(where, ignore_errors=True)
    out = summarize(first)
    if loads > 1:
        out["steady"] = summarize(steady)
    out.update(bytes=size, world=2, rounds=rounds, loads=loads, bit_exact=True)
    # The loads' peak memory above what the rank held before them (the larger rank's), median
    # over the jobs.
    out["peak_extra_rss_mib"] = {lib: round(statistics.median(v) / MiB, 1)
                                 for lib, v in rss.items() if v}
    return out


# ----------------------------------------------------------------------------------------------
# The whole run


def run(size: int, rounds: int, worlds: Sequence[int], world_size: int,
        meta_worlds: Sequence[int], layers: int, root: str, *, saves: int = 2,
        tiny_rounds: int = 5, tiny_saves: int = 6, baseline: str | None = None,
        prewarm: bool = True, inplace_size: int = 0, inplace_loads: int = 3,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    envs = variant_envs(baseline)
    out: dict[str, Any] = {"machine": machine_info(), "fs": fs_type(root), "layers": layers,
                           "variants": list(envs), "baseline": baseline,
                           "method": "fresh jobs, variants interleaved round by round"}
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)

    def section(name: str, fn: Callable[[], Any]) -> Any:
        la0 = os.getloadavg()[0]
        result = fn()
        if isinstance(result, dict):
            result["load_average"] = [round(la0, 2), round(os.getloadavg()[0], 2)]
        log(f"{name}: {json.dumps({k: v for k, v in result.items() if k != 'times_s'})}")
        return result

    if tiny_rounds:
        out["tiny"] = section("tiny W=2", lambda: bench_saves(
            envs, world=2, state="tiny", size=0, layers=0, saves=tiny_saves,
            rounds=tiny_rounds, root=base, prewarm=prewarm, log=log)[0])
    if size:
        kept: dict[str, Any] = {}

        def save_w2() -> dict[str, Any]:
            res, k = bench_saves(envs, world=2, state="fsdp", size=size, layers=layers,
                                 saves=saves, rounds=rounds, root=base, keep=True,
                                 prewarm=prewarm, log=log)
            kept.update(k)
            return res

        out["save_w2"] = section("save W=2", save_w2)
        try:
            out["load_2_to_1"] = section("load 2->1", lambda: bench_load(envs, kept,
                                                                         rounds=rounds, log=log))
        finally:
            for k in kept.values():
                shutil.rmtree(k["root"], ignore_errors=True)
    if inplace_size:
        out["inplace_w2"] = section("in-place load W=2", lambda: bench_inplace(
            inplace_size, rounds, inplace_loads, layers, base))
    out["worlds"] = {}
    for w in worlds:

        def save_w(w: int = w) -> dict[str, Any]:
            return bench_saves(envs, world=w, state="fsdp", size=world_size, layers=layers,
                               saves=saves, rounds=rounds, root=base, prewarm=prewarm,
                               log=log)[0]

        out["worlds"][str(w)] = section(f"save W={w}", save_w)
    out["meta"] = {}
    for w in meta_worlds:
        where = base / f"m{w}"
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        r = launch(job_meta, w, {"bytes": 4 * MiB, "layers": 16, "root": str(where)})
        out["meta"][str(w)] = {**r[0], "calls_other_ranks": r[1]["calls"]}
        log(f"meta W={w}: {out['meta'][str(w)]}")
        shutil.rmtree(where)
    return out


def plot(doc: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    s, ld = doc["save_w2"], doc["load_2_to_1"]
    st = s.get("steady") or {}
    bars = [(f"save W=2\n{fmt_size(s['bytes'])}, first", s["ckptfs_s"], s["dcp_s"])]
    if st:
        bars.append((f"save W=2\n{fmt_size(s['bytes'])}, steady", st["ckptfs_s"], st["dcp_s"]))
    bars.append((f"load 2->1\n{fmt_size(ld['bytes'])}", ld["ckptfs_s"], ld["dcp_s"]))
    xs = range(len(bars))
    ax1.bar([x - 0.2 for x in xs], [b[1] for b in bars], 0.4, label="ckptfs (hash + verify)")
    ax1.bar([x + 0.2 for x in xs], [b[2] for b in bars], 0.4, label="DCP FileSystem")
    ax1.set_xticks(list(xs), [b[0] for b in bars])
    ax1.set_ylabel("seconds (median, fresh jobs)")
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
    p = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1GiB", help="total state of the W=2 save/load (0: skip)")
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds (fresh jobs) per "
                   "variant")
    p.add_argument("--saves", type=int, default=2, help="saves per job: the first, then the "
                   "steady state")
    p.add_argument("--tiny-rounds", type=int, default=5, help="rounds of the tiny save (0: skip)")
    p.add_argument("--tiny-saves", type=int, default=6, help="saves per tiny job")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--world-size", default="256MiB", help="total state of the world table")
    p.add_argument("--meta-worlds", default="2,4,8")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--no-prewarm", action="store_true", help="do not cycle the page cache "
                   "through a scratch file before each save (see the module docstring)")
    p.add_argument("--baseline", default=None, help="another ckptfs checkout, measured as a "
                   "third variant (before/after)")
    p.add_argument("--inplace-size", default="64MiB", help="total state of the in-place "
                   "load W=2 (section 5; 1GiB for the recorded figures; 0: skip)")
    p.add_argument("--inplace-loads", type=int, default=3, help="in-place loads per job "
                   "(one job per library and round: --reps rounds)")
    p.add_argument("--root", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--json", default=str(Path("results") / "sharded.json"),
                   help="where the JSON goes (default: results/sharded.json under the current "
                   "directory)")
    p.add_argument("--plot", default=str(Path("img") / "sharded_save_load.png"),
                   help="where the plot goes (default: img/sharded_save_load.png under the "
                   "current directory)")
    a = p.parse_args(argv)
    scratch = a.root or tempfile.mkdtemp(prefix="ckptfs-sharded-bench-")
    try:
        doc = run(parse_size(a.size), a.reps, [int(w) for w in a.worlds.split(",") if w],
                  parse_size(a.world_size), [int(w) for w in a.meta_worlds.split(",") if w],
                  a.layers, scratch, saves=a.saves, tiny_rounds=a.tiny_rounds,
                  tiny_saves=a.tiny_saves, baseline=a.baseline, prewarm=not a.no_prewarm,
                  inplace_size=parse_size(a.inplace_size), inplace_loads=a.inplace_loads)
    finally:
        if a.root is None:
            shutil.rmtree(scratch, ignore_errors=True)
    doc["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    if a.plot and "save_w2" in doc and "load_2_to_1" in doc:
        plot(doc, Path(a.plot))
    print(json.dumps({k: doc[k] for k in ("tiny", "save_w2", "load_2_to_1", "inplace_w2")
                      if k in doc},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
