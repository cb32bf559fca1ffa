"""Benchmarks: what full content hashing and the commit protocol cost, next to what people use.

One module answers four questions (``ckptfs bench hash|save|s3|latest``, or ``all``; the scripts
in ``benchmarks/`` call the same functions) and renders them (``ckptfs bench report``) into
``docs/benchmarks.md`` with plots in ``docs/img/``:

* **hash**: throughput of every algorithm, ckptfs's hasher against the raw library, per chunk;
* **save** (local disk): save and load of transformer-shaped states (parameters + AdamW
  ``exp_avg``/``exp_avg_sq``) with ckptfs (every algorithm, durable and fast) against
  ``torch.save``/``torch.load``, ``safetensors`` and DCP;
* **s3**: the same against a moto S3 server, next to raw s3fs ``pipe``/``cat`` of the same bytes;
* **latest**: storage requests and time to resolve the latest checkpoint among 10 to 10,000.

Why it is built this way:

* every comparison is a ratio of two medians measured side by side in one run, because this
  machine is shared and noisy: absolute figures drift between runs, ratios much less;
* each variant runs in a fresh subprocess, and its peak resident memory is taken from the
  kernel's high-water mark reset right before the timed call (``/proc/self/clear_refs``), so the
  extra memory of one library is not inherited by the next;
* this VM hands memory that sat free for a few seconds back to the host, and the next first touch
  is 6-9x slower; every timed run is preceded by touching and freeing a few GiB, or the figures
  would swing with idle time.  Loads read from the page cache (warm), as the issue's figures do.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

KiB, MiB, GiB = 1024, 1024**2, 1024**3
REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
DOCS_DIR = REPO / "docs"
RESULT_TAG = "@@ckptfs-bench@@ "
QUESTIONS = ("hash", "save", "interleaved", "s3", "latest")


# ----------------------------------------------------------------------------------------------
# Measuring


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"256MiB"``, ``"64KiB"`` or a plain byte count."""
    t = text.strip()
    for suffix, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("G", GiB), ("M", MiB),
                         ("K", KiB)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def fmt_size(n: int) -> str:
    for unit, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    for unit, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= mult:
            return f"{n / mult:.2f} {unit}"
    return f"{n} B"


def warm_memory(nbytes: int) -> None:
    """Touch and free ``nbytes``: this VM returns memory that sat free for a few seconds to the
    host, and the next first touch is several times slower.  Freed right away (munmap), the pages
    stay with the guest for the timed run that follows."""
    import torch

    if nbytes > 0:
        x = torch.empty(nbytes, dtype=torch.uint8)
        x.fill_(1)
        del x


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass
class Timing:
    times: list[float] = field(default_factory=list)
    extra_rss: list[int] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def as_dict(self, nbytes: int) -> dict[str, Any]:
        med = statistics.median(self.times)
        out: dict[str, Any] = {"times_s": [round(t, 4) for t in self.times],
                               "median_s": round(med, 4),
                               "gb_per_s": round(nbytes / med / 1e9, 3) if med > 0 else None}
        if self.cpu:
            out["cpu_s"] = round(statistics.median(self.cpu), 4)
        if self.extra_rss:
            out["peak_extra_rss_mib"] = round(statistics.median(self.extra_rss) / MiB, 1)
            out["peak_extra_rss_max_mib"] = round(max(self.extra_rss) / MiB, 1)
        return out


def timed(fn: Callable[[], Any], timing: Timing, *, warm: int) -> Any:
    """Run ``fn`` once, timed, after warming memory; record wall time and the peak RSS above
    the RSS just before the call.  Returns what ``fn`` returned (kept alive until measured)."""
    gc.collect()
    warm_memory(warm)
    base = _status_kib("VmRSS")
    have_peak = _reset_peak_rss()
    c0 = time.process_time()
    t0 = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - t0
    timing.cpu.append(time.process_time() - c0)
    peak = _status_kib("VmHWM") if have_peak else None
    timing.times.append(elapsed)
    if base is not None and peak is not None:
        timing.extra_rss.append(max(0, peak - base) * KiB)
    return out


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * KiB
    except OSError:
        pass
    versions: dict[str, str] = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("safetensors", "fsspec", "s3fs", "moto", "blake3", "xxhash", "crc32c"):
        try:
            m = __import__(mod)
            versions[mod] = str(getattr(m, "__version__", getattr(m, "VERSION", "?")))
        except ImportError:
            pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "system": f"{platform.system()} {platform.release()}",
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "versions": versions}


def _fs_type(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, timeout=10)
        fields = out.stdout.strip().splitlines()[-1].split()
        return f"{fields[1]} on {fields[0]}"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


# ----------------------------------------------------------------------------------------------
# A realistic state: a decoder-only transformer's parameters and its AdamW state


def _fill(tensors: Sequence[Any], seed: int) -> None:
    """Pseudo-random contents at memcpy speed: one random block tiled over every tensor (the
    bytes only need to be incompressible and different per tensor, not statistically good)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(4 * MiB // 4 + 17, generator=gen)
    for i, t in enumerate(tensors):
        flat = t.view(-1)
        n = flat.numel()
        pos = 0
        shift = (i * 7919) % 17
        while pos < n:
            m = min(n - pos, block.numel() - shift)
            flat[pos:pos + m].copy_(block[shift:shift + m])
            pos += m


def transformer_state(total_bytes: int, seed: int = 0) -> dict[str, Any]:
    """A GPT-style model's ``state_dict`` plus an AdamW ``state_dict`` (fp32 ``exp_avg`` and
    ``exp_avg_sq`` per parameter), about ``total_bytes`` in all: what a training job saves."""
    import torch

    target = max(total_bytes // 12, 4096)  # params + exp_avg + exp_avg_sq, fp32
    d = 16
    while 12 * (2 * d) ** 2 * 6 <= target:
        d *= 2
    layers = 4
    ctx = 2048 if d >= 512 else 64
    per_layer = 12 * d * d + 13 * d
    vocab = max(16, (target - layers * per_layer - ctx * d - 2 * d) // d)
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, d), "wpe.weight": (ctx, d)}
    for i in range(layers):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (3 * d, d), p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (4 * d, d), p + "mlp.c_fc.bias": (4 * d,),
            p + "mlp.c_proj.weight": (d, 4 * d), p + "mlp.c_proj.bias": (d,),
        })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    model = {name: torch.empty(shape) for name, shape in shapes.items()}
    opt_state = {name: {"step": torch.tensor(1000.0), "exp_avg": torch.empty(shape),
                        "exp_avg_sq": torch.empty(shape)} for name, shape in shapes.items()}
    big = list(model.values())
    for s in opt_state.values():
        big += [s["exp_avg"], s["exp_avg_sq"]]
    _fill(big, seed)
    return {
        "model": model,
        "optimizer": {"state": opt_state, "param_groups": [{
            "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
            "amsgrad": False, "params": list(shapes)}]},
        "step": 1000,
    }


def state_bytes(state: Any) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def flat_tensors(state: Any, prefix: str = "") -> dict[str, Any]:
    """The tensors of a nested state under dotted names (what a safetensors user saves)."""
    import torch

    out: dict[str, Any] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, Mapping):
        for k, v in state.items():
            out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(flat_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


# ----------------------------------------------------------------------------------------------
# Variants: one thing timed, with its untimed set-up and clean-up


@dataclass
class Ctx:
    state: dict[str, Any]
    nbytes: int
    workdir: Path
    s3: dict[str, Any] | None = None  # {"endpoint", "bucket", "options"}
    keep: Any = None
    client: Any = None

    def s3_fs(self) -> Any:
        import fsspec

        assert self.s3 is not None
        return fsspec.filesystem("s3", **self.s3["options"])

    def s3_url(self, name: str) -> str:
        assert self.s3 is not None
        return f"s3://{self.s3['bucket']}/{name}"


@dataclass
class Variant:
    name: str
    op: str  # "save" or "load"
    family: str  # "ckptfs", "baseline", "raw"
    run: Callable[[Ctx, int], Any]
    setup: Callable[[Ctx], None] | None = None
    before: Callable[[Ctx, int], None] | None = None
    note: str = ""


def _clear_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)


def _ckptfs_save(algo: str, durable: bool) -> Variant:
    def before(ctx: Ctx, rep: int) -> None:
        _clear_dir(ctx.workdir / "ck")

    def run(ctx: Ctx, rep: int) -> Any:
        import ckptfs

        return ckptfs.open(str(ctx.workdir / "ck"), algorithm=algo, durable=durable).save(
            rep, ctx.state)

    mode = "durable" if durable else "fast"
    return Variant(f"ckptfs {algo} {mode}", "save", "ckptfs", run, before=before,
                   note="fsync of files and directories" if durable else "no fsync")


def _ckptfs_load(algo: str, verify: bool) -> Variant:
    def setup(ctx: Ctx) -> None:
        import ckptfs

        _clear_dir(ctx.workdir / "ck")
        ckptfs.open(str(ctx.workdir / "ck"), algorithm=algo, durable=False).save(1, ctx.state)

    def run(ctx: Ctx, rep: int) -> Any:
        import ckptfs

        return ckptfs.open(str(ctx.workdir / "ck"), algorithm=algo).load(verify=verify)

    name = f"ckptfs {algo} verify" if verify else "ckptfs no verify"
    return Variant(name, "load", "ckptfs", run, setup=setup,
                   note="every byte hashed while read" if verify else "sizes checked only")


def _raw_write(durable: bool) -> Variant:
    """A plain Python loop writing each tensor's memory into one file: the floor for any
    format that streams tensor bytes."""

    def before(ctx: Ctx, rep: int) -> None:
        _clear_dir(ctx.workdir / "raw")

    def run(ctx: Ctx, rep: int) -> None:
        from .serialize import tensor_memoryview

        with open(ctx.workdir / "raw" / "state.bin", "wb") as f:
            for t in flat_tensors(ctx.state).values():
                f.write(tensor_memoryview(t.contiguous()))
            if durable:
                f.flush()
                os.fsync(f.fileno())

    return Variant(f"raw write loop{' + fsync' if durable else ''}", "save", "raw", run,
                   before=before, note="f.write(memoryview) per tensor, no format, no hash")


def _torch_save() -> Variant:
    def before(ctx: Ctx, rep: int) -> None:
        _clear_dir(ctx.workdir / "ts")

    def run(ctx: Ctx, rep: int) -> None:
        import torch

        torch.save(ctx.state, ctx.workdir / "ts" / "state.pt")

    return Variant("torch.save", "save", "baseline", run, before=before,
                   note="pickle + zip, no fsync, no hash")


def _torch_load() -> Variant:
    def setup(ctx: Ctx) -> None:
        import torch

        _clear_dir(ctx.workdir / "ts")
        torch.save(ctx.state, ctx.workdir / "ts" / "state.pt")

    def run(ctx: Ctx, rep: int) -> Any:
        import torch

        return torch.load(ctx.workdir / "ts" / "state.pt", weights_only=True)

    return Variant("torch.load", "load", "baseline", run, setup=setup,
                   note="weights_only=True, no integrity check")


def _st_save() -> Variant:
    def before(ctx: Ctx, rep: int) -> None:
        _clear_dir(ctx.workdir / "st")

    def run(ctx: Ctx, rep: int) -> None:
        from safetensors.torch import save_file

        save_file(flat_tensors(ctx.state), str(ctx.workdir / "st" / "state.safetensors"))

    return Variant("safetensors.save_file", "save", "baseline", run, before=before,
                   note="tensors only (no optimizer hyper-parameters), no fsync, no hash")


def _st_load(materialize: bool) -> Variant:
    def setup(ctx: Ctx) -> None:
        from safetensors.torch import save_file

        _clear_dir(ctx.workdir / "st")
        save_file(flat_tensors(ctx.state), str(ctx.workdir / "st" / "state.safetensors"))

    def run(ctx: Ctx, rep: int) -> Any:
        from safetensors.torch import load_file

        out = load_file(str(ctx.workdir / "st" / "state.safetensors"))
        if materialize:
            out = {k: v.clone() for k, v in out.items()}
        return out

    if materialize:
        return Variant("safetensors.load_file + clone", "load", "baseline", run, setup=setup,
                       note="tensors only, no integrity check; clone() reads every byte, as "
                       "copying into a model would")
    return Variant("safetensors.load_file (lazy)", "load", "baseline", run, setup=setup,
                   note="memory-mapped: bytes are read on first use, not timed here")


def _dcp() -> Any:
    """torch.distributed.checkpoint, untyped (its stubs do not export what it exports)."""
    import importlib
    import warnings

    warnings.filterwarnings("ignore")
    return importlib.import_module("torch.distributed.checkpoint")


def _dcp_writer(kind: str, path: str, sync: bool | None) -> Any:
    dcp = _dcp()

    kw: dict[str, Any] = {} if sync is None else {"sync_files": sync}
    if kind == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path, **kw)
    return dcp.FileSystemWriter(path, **kw)


def _dcp_save(kind: str, sync: bool | None) -> Variant:
    def before(ctx: Ctx, rep: int) -> None:
        _clear_dir(ctx.workdir / "dcp")

    def run(ctx: Ctx, rep: int) -> None:
        dcp = _dcp()

        dcp.save(ctx.state, storage_writer=_dcp_writer(kind, str(ctx.workdir / "dcp"), sync),
                 no_dist=True)

    label = "FsspecWriter" if kind == "fsspec" else "FileSystemWriter"
    suffix = " (default, fsync)" if sync is None else (" sync_files=False" if not sync else "")
    return Variant(f"DCP {label}{suffix}", "save", "baseline", run, before=before,
                   note="torch.save per item, .metadata pickled; no content hash")


def _dcp_load(kind: str) -> Variant:
    def setup(ctx: Ctx) -> None:
        dcp = _dcp()

        _clear_dir(ctx.workdir / "dcp")
        dcp.save(ctx.state, storage_writer=_dcp_writer("fs", str(ctx.workdir / "dcp"), False),
                 no_dist=True)
        ctx.keep = _empty_like(ctx.state)

    def run(ctx: Ctx, rep: int) -> Any:
        dcp = _dcp()

        if kind == "fsspec":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            reader: Any = FsspecReader(str(ctx.workdir / "dcp"))
        else:
            reader = dcp.FileSystemReader(str(ctx.workdir / "dcp"))
        dcp.load(ctx.keep, storage_reader=reader, no_dist=True)
        return ctx.keep

    label = "FsspecReader" if kind == "fsspec" else "FileSystemReader"
    return Variant(f"DCP load ({label})", "load", "baseline", run, setup=setup,
                   note="in place into preallocated tensors (allocation not timed)")


def _empty_like(state: Any) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, Mapping):
        return {k: _empty_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_empty_like(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_empty_like(v) for v in state)
    return state


# -- S3 (moto) ---------------------------------------------------------------------------------


def _s3_clear(ctx: Ctx, prefix: str) -> None:
    fs = ctx.s3_fs()
    with suppress(FileNotFoundError):
        fs.rm(ctx.s3_url(prefix), recursive=True)


def _planned_bytes(ctx: Ctx) -> dict[str, bytes]:
    """The exact files ckptfs writes for this state, materialized (untimed) for raw uploads."""
    from .serialize import plan_state

    plan = plan_state(ctx.state)
    return {pf.path: b"".join(bytes(c) for c in pf.chunks()) for pf in plan.files}


def _s3_store(ctx: Ctx, algo: str) -> Any:
    """A store opened once (untimed), as a training job does; the first listing loads the S3
    client, so one-time client set-up is not counted as part of a save or load."""
    import ckptfs

    assert ctx.s3 is not None
    store = ckptfs.open(ctx.s3_url("ck"), algorithm=algo, **ctx.s3["options"])
    store.steps()
    return store


def _s3_raw_fs(ctx: Ctx) -> Any:
    fs = ctx.s3_fs()
    assert ctx.s3 is not None
    fs.ls(ctx.s3["bucket"])
    return fs


def _s3_ckptfs_save(algo: str) -> Variant:
    def setup(ctx: Ctx) -> None:
        ctx.client = _s3_store(ctx, algo)

    def before(ctx: Ctx, rep: int) -> None:
        _s3_clear(ctx, "ck")

    def run(ctx: Ctx, rep: int) -> Any:
        return ctx.client.save(rep, ctx.state)

    return Variant(f"ckptfs {algo} -> S3", "save", "ckptfs", run, setup=setup, before=before,
                   note="streamed multipart uploads (16 MiB parts), files in parallel, hashed "
                   "while uploading")


def _s3_pipe() -> Variant:
    def setup(ctx: Ctx) -> None:
        ctx.keep = _planned_bytes(ctx)
        ctx.client = _s3_raw_fs(ctx)

    def before(ctx: Ctx, rep: int) -> None:
        _s3_clear(ctx, "raw")

    def run(ctx: Ctx, rep: int) -> None:
        ctx.client.pipe({ctx.s3_url(f"raw/{name}"): data for name, data in ctx.keep.items()})

    return Variant("s3fs pipe (same bytes)", "save", "raw", run, setup=setup, before=before,
                   note="fs.pipe of ckptfs's files already in memory (not counted): "
                   "concurrent 50 MiB parts, no hash, no protocol")


def _s3_ckptfs_load(algo: str) -> Variant:
    def setup(ctx: Ctx) -> None:
        _s3_clear(ctx, "ck")
        ctx.client = _s3_store(ctx, algo)
        ctx.client.save(1, ctx.state)

    def run(ctx: Ctx, rep: int) -> Any:
        return ctx.client.load()

    return Variant(f"ckptfs {algo} verify <- S3", "load", "ckptfs", run, setup=setup,
                   note="files in parallel, hashed while read")


def _s3_cat() -> Variant:
    def setup(ctx: Ctx) -> None:
        _s3_clear(ctx, "raw")
        ctx.client = _s3_raw_fs(ctx)
        files = _planned_bytes(ctx)
        ctx.client.pipe({ctx.s3_url(f"raw/{name}"): data for name, data in files.items()})
        ctx.keep = sorted(files)

    def run(ctx: Ctx, rep: int) -> Any:
        return ctx.client.cat([ctx.s3_url(f"raw/{name}") for name in ctx.keep])

    return Variant("s3fs cat (same bytes)", "load", "raw", run, setup=setup,
                   note="fs.cat of the same files: concurrent ranged GETs, no parsing, no hash")


def variants(question: str, default_algo: str, algorithms: Sequence[str], *,
             full: bool = True) -> list[Variant]:
    """The variants of one question.  ``full=False`` is the reduced set used for big states."""
    if question == "s3":
        return [_s3_ckptfs_save(default_algo), _s3_pipe(), _s3_ckptfs_load(default_algo),
                _s3_cat()]
    algos = list(algorithms) if full else [default_algo]
    out: list[Variant] = []
    for a in algos:
        out += [_ckptfs_save(a, True), _ckptfs_save(a, False)]
    out += [_raw_write(False), _raw_write(True)] if full else []
    out += [_torch_save(), _st_save(), _dcp_save("fs", None)]
    out += [_dcp_save("fs", False), _dcp_save("fsspec", None)] if full else []
    out += [_ckptfs_load(a, True) for a in algos]
    out += [_ckptfs_load(default_algo, False)] if full else []
    out += [_torch_load()] + ([_st_load(False), _st_load(True)] if full else [])
    out += [_dcp_load("fs")] + ([_dcp_load("fsspec")] if full else [])
    return out


def run_variant(v: Variant, ctx: Ctx, reps: int, warm: int) -> dict[str, Any]:
    if v.setup is not None:
        v.setup(ctx)
    if v.op == "load":
        ctx.state = {}  # only the setup needed it; free it so big loads fit in memory
    timing = Timing()
    for rep in range(reps):
        if v.before is not None:
            v.before(ctx, rep)
        out = timed(lambda rep=rep: v.run(ctx, rep), timing, warm=warm)  # type: ignore[misc]
        del out
    ctx.keep = ctx.client = None
    return {"variant": v.name, "op": v.op, "family": v.family, "note": v.note,
            "bytes": ctx.nbytes, **timing.as_dict(ctx.nbytes)}


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one variant (in a fresh process when called through ``python -m ckptfs.bench``)."""
    import warnings

    warnings.filterwarnings("ignore")
    state = transformer_state(spec["size"], seed=spec.get("seed", 0))
    ctx = Ctx(state, state_bytes(state), Path(spec["workdir"]), spec.get("s3"))
    del state  # the context owns it (a load variant drops it after its setup)
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    vs = {v.name: v for v in variants(spec["question"], spec["default_algo"],
                                       spec["algorithms"], full=True)}
    v = vs[spec["variant"]]
    try:
        return run_variant(v, ctx, spec["reps"], spec["warm"])
    finally:
        shutil.rmtree(ctx.workdir, ignore_errors=True)


def _run_isolated(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "ckptfs.bench", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return dict(json.loads(line[len(RESULT_TAG):]))
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"variant": spec["variant"], "error": f"exit {proc.returncode}: {tail}"}


# ----------------------------------------------------------------------------------------------
# Questions


def bench_save(sizes: Sequence[int], *, reps: int = 3, question: str = "save",
               s3: dict[str, Any] | None = None, isolate: bool = True,
               full_up_to: int = 2 * GiB, workdir: str | None = None,
               only: Sequence[str] | None = None, log: Callable[[str], None] = print,
               between: Callable[[], None] | None = None) -> dict[str, Any]:
    """Save and load of transformer states on local disk (``question="save"``) or S3."""
    from .hashing import DEFAULT_ALGORITHM, available_algorithms

    algos = available_algorithms()
    base = Path(workdir or tempfile.mkdtemp(prefix="ckptfs-bench-"))
    results: list[dict[str, Any]] = []
    info = {"workdir": str(base), "workdir_fs": _fs_type(str(base)),
            "load_before": [round(x, 2) for x in os.getloadavg()]}
    for size in sizes:
        warm = size + min(size, GiB)
        vs = variants(question, DEFAULT_ALGORITHM, algos, full=size <= full_up_to)
        if only:
            vs = [v for v in vs if any(o in v.name for o in only)]
        state = None if isolate else transformer_state(size)
        for v in vs:
            if between is not None:
                between()
            spec = {"question": question, "size": size, "variant": v.name, "reps": reps,
                    "warm": warm, "workdir": str(base / "w"), "s3": s3,
                    "default_algo": DEFAULT_ALGORITHM, "algorithms": algos}
            t0 = time.perf_counter()
            if isolate:
                r = _run_isolated(spec, timeout=900)
            else:
                assert state is not None
                ctx = Ctx(state, state_bytes(state), base / "w", s3)
                ctx.workdir.mkdir(parents=True, exist_ok=True)
                r = run_variant(v, ctx, reps, warm)
            r["size"] = size
            results.append(r)
            log(f"  {question}/{v.op} {fmt_size(size)} {v.name}: "
                + (f"{r['median_s']:.3f} s, {r['gb_per_s']} GB/s, +{r.get('peak_extra_rss_mib')}"
                   f" MiB" if "median_s" in r else f"ERROR {r['error'][-300:]}")
                + f"  [{time.perf_counter() - t0:.0f} s]")
    shutil.rmtree(base, ignore_errors=True)
    info["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return {"question": question, "reps": reps, "default_algorithm": DEFAULT_ALGORITHM,
            "sizes": list(sizes), "results": results, **info}


def bench_interleaved(sizes: Sequence[int], *, reps: int = 5,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """The save targets again, with the variants interleaved run by run in one process.

    The main save benchmark runs each variant's repetitions back to back in its own process,
    minutes apart from the next variant; on a shared machine the load drifts in between and a
    ratio of two medians can swing by 2x.  Here every repetition times each variant once, in
    turn, so both sides of a ratio see the same conditions (peak RSS is not measured here)."""
    from .hashing import DEFAULT_ALGORITHM

    d = DEFAULT_ALGORITHM
    rows: list[dict[str, Any]] = []
    load_before = [round(x, 2) for x in os.getloadavg()]
    for size in sizes:
        state = transformer_state(size)
        ctx = Ctx(state, state_bytes(state), Path(tempfile.mkdtemp(prefix="ckptfs-bench-")))
        del state
        vs = [_ckptfs_save(d, True), _dcp_save("fs", None), _ckptfs_save(d, False), _st_save()]
        timings = {v.name: Timing() for v in vs}
        try:
            for rep in range(reps):
                for v in vs:
                    assert v.before is not None
                    v.before(ctx, rep)
                    timed(partial(v.run, ctx, rep), timings[v.name],
                          warm=size + min(size, GiB))
        finally:
            shutil.rmtree(ctx.workdir, ignore_errors=True)
        for v in vs:
            r = {"variant": v.name, "op": "save", "family": v.family, "size": size,
                 "bytes": ctx.nbytes, **timings[v.name].as_dict(ctx.nbytes)}
            rows.append(r)
            log(f"  interleaved {fmt_size(size)} {v.name}: {r['median_s']:.3f} s "
                f"{r['times_s']}")
        del ctx
        gc.collect()
    return {"question": "interleaved", "reps": reps, "default_algorithm": d,
            "sizes": list(sizes), "results": rows, "load_before": load_before,
            "load_after": [round(x, 2) for x in os.getloadavg()]}


def bench_s3(sizes: Sequence[int], *, reps: int = 3, isolate: bool = True,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    from .testing.servers import moto_server

    with moto_server() as srv:
        s3 = {"endpoint": srv.endpoint, "bucket": srv.bucket,
              "options": dict(srv.storage_options)}
        out = bench_save(sizes, reps=reps, question="s3", s3=s3, isolate=isolate, log=log,
                         between=srv.reset)  # moto keeps objects in memory: start empty
    out["server"] = "moto (python -m moto.server, subprocess on the same 2 cores)"
    return out


def bench_hash(nbytes: int = GiB, *, chunk_sizes: Sequence[int] = (64 * KiB, MiB, 8 * MiB,
                                                                      16 * MiB),
               reps: int = 3, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Throughput of every algorithm: ckptfs's hasher fed chunk by chunk, the raw library fed
    the same chunks, the raw library one-shot over the whole buffer, and the command-line tools
    where installed (they include process start and read the file from the page cache)."""
    import torch

    from .hashing import ALGORITHMS, new_hasher
    from .serialize import tensor_memoryview

    data = torch.empty(nbytes, dtype=torch.uint8)
    _fill([data], 1)
    mv = tensor_memoryview(data)
    raw = _raw_hashers()
    rows: list[dict[str, Any]] = []

    def measure(fn: Callable[[], Any]) -> float:
        ts = []
        for _ in range(reps):  # no memory is first-touched while hashing: no warm-up needed
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def interleaved(fns: Mapping[str, Callable[[], Any]]) -> dict[str, float]:
        ts: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(reps):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                ts[k].append(time.perf_counter() - t0)
        return {k: statistics.median(v) for k, v in ts.items()}

    def chunked(make: Callable[[], Any], chunk: int) -> Callable[[], Any]:
        def go() -> Any:
            h = make()
            for off in range(0, nbytes, chunk):
                h.update(mv[off:off + chunk])
            return h.hexdigest()
        return go

    for name in ALGORITHMS:
        try:
            new_hasher(name)
        except ImportError as exc:
            rows.append({"algorithm": name, "error": str(exc)})
            continue
        make_raw, one_shot = raw[name]
        # Interleaved: every rep times each way once, so drift (other work on this shared
        # machine) hits them alike and the ratios stay meaningful.
        fns: dict[str, Callable[[], Any]] = {"one": partial(one_shot, mv)}
        for chunk in chunk_sizes:
            fns[f"ck{chunk}"] = chunked(partial(new_hasher, name), chunk)
            fns[f"raw{chunk}"] = chunked(make_raw, chunk)
        t = interleaved(fns)
        row: dict[str, Any] = {"algorithm": name,
                               "cryptographic": ALGORITHMS[name].cryptographic,
                               "raw_one_shot_gbps": round(nbytes / t["one"] / 1e9, 3),
                               "chunks": []}
        for chunk in chunk_sizes:
            t_ck, t_raw = t[f"ck{chunk}"], t[f"raw{chunk}"]
            row["chunks"].append({"chunk": chunk,
                                  "ckptfs_gbps": round(nbytes / t_ck / 1e9, 3),
                                  "raw_chunked_gbps": round(nbytes / t_raw / 1e9, 3),
                                  "ckptfs_vs_one_shot": round(t["one"] / t_ck, 3),
                                  "ckptfs_vs_raw_chunked": round(t_raw / t_ck, 3)})
        rows.append(row)
        log(f"  hash {name}: one-shot {row['raw_one_shot_gbps']} GB/s; ckptfs "
            + ", ".join(f"{fmt_size(c['chunk'])} {c['ckptfs_gbps']}" for c in row["chunks"]))
    extras: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    try:
        import blake3

        t_mt = measure(lambda: blake3.blake3(mv, max_threads=blake3.blake3.AUTO).digest())
        extras.append({"what": "blake3 one-shot, max_threads=AUTO (its own threads)",
                       "gbps": round(nbytes / t_mt / 1e9, 3)})
    except ImportError:
        pass
    with tempfile.TemporaryDirectory(prefix="ckptfs-hash-") as tmp:
        path = os.path.join(tmp, "data.bin")
        with open(path, "wb") as f:
            f.write(mv)
        for tool in ("sha256sum", "b3sum", "xxh128sum"):
            exe = shutil.which(tool)
            if exe is None:
                tools.append({"tool": tool, "installed": False})
                continue
            t_tool = measure(partial(subprocess.run, [exe, path], check=True,
                                     capture_output=True))
            tools.append({"tool": tool, "installed": True,
                          "gbps": round(nbytes / t_tool / 1e9, 3)})
    return {"question": "hash", "bytes": nbytes, "reps": reps, "rows": rows, "extras": extras,
            "tools": tools, "load_before": None}


def _raw_hashers() -> dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]:
    """Each library used directly, as a user of it would."""
    import hashlib

    out: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
        "sha256": (hashlib.sha256, lambda b: hashlib.sha256(b).hexdigest())}
    try:
        import blake3

        out["blake3"] = (blake3.blake3, lambda b: blake3.blake3(b).hexdigest())
    except ImportError:
        pass
    try:
        import xxhash

        out["xxh3-128"] = (xxhash.xxh3_128, lambda b: xxhash.xxh3_128(b).hexdigest())
    except ImportError:
        pass
    try:
        import crc32c

        class _RawCrc:
            def __init__(self) -> None:
                self.v = 0

            def update(self, b: Any) -> None:
                self.v = crc32c.crc32c(b, self.v)

            def hexdigest(self) -> str:
                return f"{self.v:08x}"

        out["crc32c"] = (_RawCrc, lambda b: f"{crc32c.crc32c(b):08x}")
    except ImportError:
        pass
    return out


# -- latest ------------------------------------------------------------------------------------


class CountingStorage:
    """A :class:`~ckptfs.storage.base.Storage` proxy counting every call by operation."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.url = inner.url
        self.capabilities = inner.capabilities
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)

        return counted

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@contextmanager
def count_http(fs: Any) -> Iterator[dict[str, int]]:
    """Count the HTTP requests an s3fs filesystem makes, by operation (botocore events)."""
    counts: dict[str, int] = {}

    def handler(**kwargs: Any) -> None:
        model = kwargs.get("model")
        name = getattr(model, "name", "?")
        counts[name] = counts.get(name, 0) + 1

    fs.connect()
    events = fs.s3.meta.events
    events.register("before-call.s3", handler)
    try:
        yield counts
    finally:
        events.unregister("before-call.s3", handler)


def _populate(storage: Any, count: int, write: Callable[[dict[str, bytes]], None]) -> None:
    """``count - 1`` committed checkpoints made of real protocol files (state, manifest,
    marker), written directly with the raw filesystem, then one real save on top."""
    from datetime import datetime, timezone

    from .commit import save_checkpoint
    from .hashing import DEFAULT_ALGORITHM, digest_bytes
    from .layout import MANIFEST_NAME, StepPaths, new_attempt_name
    from .manifest import FileEntry, Manifest, Marker
    from .serialize import plan_state

    plan = plan_state({"step": 0})
    files = {pf.path: b"".join(bytes(c) for c in pf.chunks()) for pf in plan.files}
    entries = tuple(FileEntry(p, len(b), digest_bytes(DEFAULT_ALGORITHM, b))
                    for p, b in files.items())
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    batch: dict[str, bytes] = {}
    for step in range(count - 1):
        attempt = new_attempt_name()
        paths = StepPaths(step)
        manifest = Manifest(step, attempt, entries, created, DEFAULT_ALGORITHM,
                            {"tensor_count": 0})
        mbytes = manifest.to_bytes()
        marker = Marker(step, attempt, digest_bytes(DEFAULT_ALGORITHM, mbytes), len(mbytes),
                        created, {"host": "bench", "pid": 0})
        d = paths.attempt_dir(attempt)
        for p, b in files.items():
            batch[f"{d}/{p}"] = b
        batch[f"{d}/{MANIFEST_NAME}"] = mbytes
        batch[paths.marker] = marker.to_bytes()
        if len(batch) >= 3000:
            write(batch)
            batch = {}
    if batch:
        write(batch)
    save_checkpoint(storage, count - 1, {"step": count - 1}, durable=False)


def bench_latest(counts: Sequence[int] = (10, 100, 1000, 10000), *, reps: int = 5,
                 s3_max: int = 1000, backends: Sequence[str] = ("local", "s3"),
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Cost of resolving ``latest`` as the number of committed checkpoints grows."""
    from .resolve import resolve_latest
    from .storage.fsspec import FsspecStorage

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ckptfs-latest-") as tmp, \
            _maybe_moto("s3" in backends) as srv:
        for backend in backends:
            for n in counts:
                if backend == "s3" and n > s3_max:
                    continue
                if backend == "local":
                    root = Path(tmp) / f"run{n}"
                    storage = FsspecStorage(str(root))

                    write = partial(_write_local, root)
                else:
                    assert srv is not None
                    srv.reset()
                    url = srv.url(f"run{n}")
                    storage = FsspecStorage(url, **srv.storage_options)
                    write = partial(_write_remote, srv.filesystem(), url)
                t0 = time.perf_counter()
                _populate(storage, n, write)
                populate_s = time.perf_counter() - t0
                times: list[float] = []
                calls: dict[str, int] = {}
                http: dict[str, int] = {}
                for _ in range(reps):
                    counting = CountingStorage(storage)
                    if backend == "s3":
                        with count_http(storage.fs) as http_counts:
                            t0 = time.perf_counter()
                            info = resolve_latest(counting)
                            times.append(time.perf_counter() - t0)
                        http = dict(http_counts)
                    else:
                        t0 = time.perf_counter()
                        info = resolve_latest(counting)
                        times.append(time.perf_counter() - t0)
                    calls = dict(counting.calls)
                    assert info is not None and info.step == n - 1
                row: dict[str, Any] = {"backend": backend, "checkpoints": n, "median_s": round(
                    statistics.median(times), 5), "storage_calls": calls,
                    "storage_calls_total": sum(calls.values()),
                    "http_requests": http or None,
                    "http_requests_total": sum(http.values()) if http else None,
                    "populate_s": round(populate_s, 1)}
                rows.append(row)
                log(f"  latest {backend} {n}: {row['median_s'] * 1000:.1f} ms, "
                    f"{row['storage_calls_total']} storage calls {calls}"
                    + (f", {row['http_requests_total']} HTTP {http}" if http else ""))
                if backend == "local":
                    shutil.rmtree(Path(tmp) / f"run{n}", ignore_errors=True)
    return {"question": "latest", "reps": reps, "rows": rows}


def _write_local(root: Path, batch: dict[str, bytes]) -> None:
    for rel, data in batch.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def _write_remote(fs: Any, url: str, batch: dict[str, bytes]) -> None:
    fs.pipe({f"{url}/{k}": v for k, v in batch.items()})


@contextmanager
def _maybe_moto(want: bool) -> Iterator[Any]:
    if not want:
        yield None
        return
    from .testing.servers import moto_server

    with moto_server() as srv:
        yield srv


# ----------------------------------------------------------------------------------------------
# Report


TARGETS = [
    ("durable save, default hash >= 1.6x DCP FileSystemWriter default", 1.6),
    ("fast save with hash >= 0.85x safetensors.save_file", 0.85),
    ("load with full verify >= 1.0x DCP load", 1.0),
    ("load with full verify >= 0.8x torch.load", 0.8),
    ("hasher within 5% of the raw library (16 MiB chunks)", 0.95),
    ("save to moto >= 0.9x raw s3fs pipe of the same bytes", 0.9),
]


def _find(results: Sequence[Mapping[str, Any]], size: int, name: str) -> float | None:
    for r in results:
        if r.get("size") == size and r.get("variant") == name and "median_s" in r:
            return float(r["median_s"])
    return None


def target_rows(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each target as measured: the ratio (higher is better for ckptfs) and whether it is met."""
    rows: list[dict[str, Any]] = []
    save = data.get("save")
    if save:
        d = save["default_algorithm"]
        for size in save["sizes"]:
            res = save["results"]
            pairs = [
                (TARGETS[0], "DCP FileSystemWriter (default, fsync)", f"ckptfs {d} durable"),
                (TARGETS[1], "safetensors.save_file", f"ckptfs {d} fast"),
                (TARGETS[2], "DCP load (FileSystemReader)", f"ckptfs {d} verify"),
                (TARGETS[3], "torch.load", f"ckptfs {d} verify"),
            ]
            for (label, goal), ref, ours in pairs:
                a, b = _find(res, size, ref), _find(res, size, ours)
                if a and b:
                    rows.append({"target": label, "size": size, "goal": goal,
                                 "ratio": round(a / b, 2), "met": a / b >= goal,
                                 "detail": f"{ref} {a:.3f} s / {ours} {b:.3f} s"})
    inter = data.get("interleaved")
    if inter:
        d = inter["default_algorithm"]
        for size in inter["sizes"]:
            for (label, goal), ref, ours in [
                    (TARGETS[0], "DCP FileSystemWriter (default, fsync)", f"ckptfs {d} durable"),
                    (TARGETS[1], "safetensors.save_file", f"ckptfs {d} fast")]:
                a, b = _find(inter["results"], size, ref), _find(inter["results"], size, ours)
                if a and b:
                    rows.append({"target": label + " (interleaved runs)", "size": size,
                                 "goal": goal, "ratio": round(a / b, 2), "met": a / b >= goal,
                                 "detail": f"{ref} {a:.3f} s / {ours} {b:.3f} s"})
    for key in ("save", "s3"):
        block = data.get(key)
        if not block:
            continue
        for r in block["results"]:
            if (r.get("family") == "ckptfs" and r.get("op") == "save"
                    and r.get("peak_extra_rss_max_mib") is not None):
                bound = 64 + 0.05 * r["bytes"] / MiB
                peak = r["peak_extra_rss_max_mib"]
                rows.append({"target": "save: peak extra memory <= 64 MiB + 5% of the state",
                             "size": r["size"], "goal": round(bound), "ratio": peak,
                             "met": peak <= bound,
                             "detail": f"{r['variant']}: worst of {len(r['times_s'])} runs "
                             f"{peak} MiB (bound {bound:.0f} MiB)"})
    hashing = data.get("hash")
    if hashing:
        for row in hashing["rows"]:
            for c in row.get("chunks", []):
                if c["chunk"] == 16 * MiB:
                    r = c["ckptfs_vs_one_shot"]
                    rows.append({"target": TARGETS[4][0], "size": None, "goal": 0.95,
                                 "ratio": r, "met": r >= 0.95,
                                 "detail": f"{row['algorithm']}: {c['ckptfs_gbps']} GB/s vs "
                                 f"one-shot {row['raw_one_shot_gbps']} GB/s (vs the library fed "
                                 f"the same chunks: {c['ckptfs_vs_raw_chunked']})"})
    s3 = data.get("s3")
    if s3:
        d = s3["default_algorithm"]
        for size in s3["sizes"]:
            a = _find(s3["results"], size, "s3fs pipe (same bytes)")
            b = _find(s3["results"], size, f"ckptfs {d} -> S3")
            if a and b:
                rows.append({"target": TARGETS[5][0], "size": size, "goal": 0.9,
                             "ratio": round(a / b, 2), "met": a / b >= 0.9,
                             "detail": f"pipe {a:.2f} s / ckptfs {b:.2f} s"})
    latest = data.get("latest")
    if latest:
        for row in latest["rows"]:
            if row["checkpoints"] == 1000:
                n = row["http_requests_total"] or row["storage_calls_total"]
                rows.append({"target": "latest at 1,000 checkpoints in <= 3 storage requests",
                             "size": None, "goal": 3, "ratio": n, "met": n <= 3,
                             "detail": f"{row['backend']}: {row['storage_calls_total']} storage "
                             f"calls {row['storage_calls']}"
                             + (f", {n} HTTP requests {row['http_requests']}"
                                if row["http_requests"] else "")})
    return rows


def load_results(results_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for q in (*QUESTIONS, "machine"):
        p = results_dir / f"{q}.json"
        if p.exists():
            data[q] = json.loads(p.read_text())
    return data


def write_report(results_dir: Path = RESULTS_DIR, docs_dir: Path = DOCS_DIR, *,
                 md_name: str = "benchmarks.md") -> Path:
    """Render the JSON results into Markdown tables and PNG plots."""
    data = load_results(results_dir)
    img = docs_dir / "img"
    img.mkdir(parents=True, exist_ok=True)
    plots = _plots(data, img)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks.run_all` (or `ckptfs bench all`) from the JSON in "
        "`benchmarks/results/`; do not edit by hand. Every ratio compares two medians measured "
        "side by side in the same run; each save/load variant ran in a fresh subprocess, its "
        "peak extra RSS is the kernel's high-water mark above the RSS just before the timed "
        "call (the state itself excluded). Before each timed call a few GiB were touched and "
        "freed (this VM returns idle free memory to the host and the next first touch is "
        "6-9x slower). Loads read from the page cache.",
        "",
    ]
    m = data.get("machine")
    if m:
        v = ", ".join(f"{k} {val}" for k, val in m["versions"].items())
        lines += ["## Machine", "",
                  f"- CPU: {m['cpu']}, {m['cores']} cores; memory "
                  f"{(m['memory_bytes'] or 0) / GiB:.1f} GiB; {m['system']}",
                  f"- Date: {m['date_utc']}; load average at start {m['load_average']}"
                  + (f", at end {m.get('load_average_end')}" if m.get("load_average_end")
                     else ""),
                  f"- Versions: {v}"]
        if m.get("concurrent_note"):
            lines.append(f"- **{m['concurrent_note']}**")
        lines.append("")
    trows = target_rows(data)
    if trows:
        lines += ["## Targets", "", "| target | state | ratio | goal | met | measured |",
                  "|---|---|---:|---:|:---:|---|"]
        for r in trows:
            lines.append(f"| {r['target']} | {fmt_size(r['size']) if r['size'] else ''} | "
                         f"{r['ratio']} | {r['goal']} | {'yes' if r['met'] else '**no**'} | "
                         f"{r['detail']} |")
        lines.append("")
    lines += _hash_section(data.get("hash"), plots)
    lines += _save_section(data.get("save"), plots, "Save and load on local disk", "save")
    lines += _interleaved_section(data.get("interleaved"))
    lines += _save_section(data.get("s3"), plots, "Save and load on S3 (moto)", "s3")
    lines += _latest_section(data.get("latest"), plots)
    notes = REPO / "benchmarks" / "NOTES.md"
    if notes.exists():
        lines += ["", notes.read_text().strip(), ""]
    out = docs_dir / md_name
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out


def _hash_section(h: Mapping[str, Any] | None, plots: Mapping[str, str]) -> list[str]:
    if not h:
        return []
    chunks = [c["chunk"] for c in h["rows"][0].get("chunks", [])] if h["rows"] else []
    lines = ["## Hashing throughput", "",
             f"{fmt_size(h['bytes'])} in memory, one thread, median of {h['reps']}. GB/s = 1e9 "
             "bytes/s. *ckptfs* is `ckptfs.hashing.new_hasher(algo)` fed chunk by chunk (as "
             "the saver and the verifier do); *ratio* is ckptfs at that chunk size over the raw "
             "library hashing the whole buffer in one call.", "",
             "| algorithm | crypto | raw one-shot | "
             + " | ".join(f"ckptfs {fmt_size(c)} (ratio)" for c in chunks) + " |",
             "|---|:---:|---:|" + "---:|" * len(chunks)]
    for r in h["rows"]:
        if "error" in r:
            lines.append(f"| {r['algorithm']} | | {r['error']} |" + " |" * len(chunks))
            continue
        cells = [f"{c['ckptfs_gbps']} ({c['ckptfs_vs_one_shot']})" for c in r["chunks"]]
        lines.append(f"| {r['algorithm']} | {'yes' if r['cryptographic'] else 'no'} | "
                     f"{r['raw_one_shot_gbps']} | " + " | ".join(cells) + " |")
    lines.append("")
    for e in h.get("extras", []):
        lines.append(f"- {e['what']}: {e['gbps']} GB/s")
    for t in h.get("tools", []):
        lines.append(f"- `{t['tool']}`: " + (f"{t['gbps']} GB/s (file in page cache, process "
                                              "start included)" if t["installed"]
                                              else "not installed"))
    if "hash" in plots:
        lines += ["", f"![hashing throughput]({plots['hash']})"]
    return [*lines, ""]


def _save_section(s: Mapping[str, Any] | None, plots: Mapping[str, str], title: str,
                  key: str) -> list[str]:
    if not s:
        return []
    lines = [f"## {title}", "",
             f"Median of {s['reps']} runs per variant; default algorithm "
             f"`{s['default_algorithm']}`; GB/s = state bytes / time / 1e9; *CPU s* is the "
             "process's CPU time (all threads) during the call: on 2 shared cores, a variant "
             "using more CPU than another loses to it when other work runs. "
             + (f"Files on {s.get('workdir_fs')}. " if key == "save" else "")
             + f"Load average before {s.get('load_before')}, after {s.get('load_after')}.", ""]
    for size in s["sizes"]:
        res = [r for r in s["results"] if r.get("size") == size]
        for op in ("save", "load"):
            rows = [r for r in res if r.get("op") == op or ("error" in r and op == "save")]
            if not rows:
                continue
            ok = [r for r in rows if "median_s" in r]
            fastest = min((r["median_s"] for r in ok), default=None)
            lines += [f"### {op.capitalize()}, {fmt_size(size)} state", "",
                      "| variant | median s | GB/s | vs fastest | CPU s | peak extra RSS MiB "
                      "| note |",
                      "|---|---:|---:|---:|---:|---:|---|"]
            for r in sorted(ok, key=lambda r: r["median_s"]):
                rel = f"{fastest / r['median_s']:.2f}" if fastest else ""
                lines.append(f"| {r['variant']} | {r['median_s']:.3f} | {r['gb_per_s']} | "
                             f"{rel} | {r.get('cpu_s', '')} | {r.get('peak_extra_rss_mib', '')} "
                             f"| {r.get('note', '')} |")
            for r in rows:
                if "error" in r:
                    lines.append(f"| {r['variant']} | failed | | | | | "
                                 f"{r['error'][-200:].replace('|', '/').splitlines()[-1]} |")
            lines.append("")
            pk = f"{key}-{op}-{size}"
            if pk in plots:
                lines += [f"![{op} {fmt_size(size)}]({plots[pk]})", ""]
    return lines


def _interleaved_section(it: Mapping[str, Any] | None) -> list[str]:
    if not it:
        return []
    lines = ["## Save targets, variants interleaved", "",
             "The table above runs each variant's repetitions back to back in its own process, "
             "minutes apart from the next variant; on this shared machine the load drifts in "
             "between. Here one process times every variant once per round, in turn "
             f"({it['reps']} rounds), so both sides of each ratio saw the same conditions. Load "
             f"average before {it.get('load_before')}, after {it.get('load_after')}.", "",
             "| state | variant | median s | GB/s | CPU s | runs (s) |",
             "|---|---|---:|---:|---:|---|"]
    for r in it["results"]:
        lines.append(f"| {fmt_size(r['size'])} | {r['variant']} | {r['median_s']:.3f} | "
                     f"{r['gb_per_s']} | {r.get('cpu_s', '')} | "
                     f"{', '.join(f'{t:.2f}' for t in r['times_s'])} |")
    return [*lines, ""]


def _latest_section(lt: Mapping[str, Any] | None, plots: Mapping[str, str]) -> list[str]:
    if not lt:
        return []
    lines = ["## Resolving `latest`", "",
             "Committed checkpoints made of real protocol files (state, `MANIFEST.json`, "
             "`COMPLETE`), written directly with the raw filesystem, the newest by a real save. "
             "*Storage calls* are calls to ckptfs's `Storage` interface; *HTTP* are the S3 "
             f"requests s3fs sent (botocore events). Median of {lt['reps']} resolutions.", "",
             "| backend | checkpoints | median ms | storage calls | HTTP requests |",
             "|---|---:|---:|---|---|"]
    for r in lt["rows"]:
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["storage_calls"].items()))
        http = (", ".join(f"{k} {v}" for k, v in sorted(r["http_requests"].items()))
                if r["http_requests"] else "")
        lines.append(f"| {r['backend']} | {r['checkpoints']:,} | {r['median_s'] * 1000:.1f} | "
                     f"{r['storage_calls_total']} ({calls}) | "
                     + (f"{r['http_requests_total']} ({http})" if http else "n/a") + " |")
    if "latest" in plots:
        lines += ["", f"![latest]({plots['latest']})"]
    return [*lines, ""]


def _plots(data: Mapping[str, Any], img: Path) -> dict[str, str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dev dependency
        return {}
    out: dict[str, str] = {}
    h = data.get("hash")
    if h and h["rows"]:
        rows = [r for r in h["rows"] if "chunks" in r]
        fig, ax = plt.subplots(figsize=(8, 4))
        chunks = [c["chunk"] for c in rows[0]["chunks"]]
        width = 0.8 / (len(chunks) + 1)
        for j, c in enumerate(chunks):
            ax.bar([i + j * width for i in range(len(rows))],
                   [r["chunks"][j]["ckptfs_gbps"] for r in rows], width,
                   label=f"ckptfs, {fmt_size(c)} chunks")
        ax.bar([i + len(chunks) * width for i in range(len(rows))],
               [r["raw_one_shot_gbps"] for r in rows], width, label="raw library, one shot",
               color="grey")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))],
                      [r["algorithm"] for r in rows])
        ax.set_ylabel("GB/s (one thread)")
        ax.set_title("Hashing throughput")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / "hash_throughput.png", dpi=110)
        plt.close(fig)
        out["hash"] = "img/hash_throughput.png"
    for key in ("save", "s3"):
        s = data.get(key)
        if not s:
            continue
        for size in s["sizes"]:
            for op in ("save", "load"):
                rows = sorted([r for r in s["results"] if r.get("size") == size
                               and r.get("op") == op and "median_s" in r],
                              key=lambda r: -r["median_s"])
                if not rows:
                    continue
                fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
                colors = {"ckptfs": "tab:blue", "baseline": "tab:orange", "raw": "tab:grey"}
                ax.barh([r["variant"] for r in rows], [r["median_s"] for r in rows],
                        color=[colors.get(r["family"], "tab:grey") for r in rows])
                for i, r in enumerate(rows):
                    ax.text(r["median_s"], i, f" {r['gb_per_s']} GB/s", va="center", fontsize=7)
                ax.set_xlabel("seconds (median, lower is better)")
                where = "local disk" if key == "save" else "moto S3"
                ax.set_title(f"{op.capitalize()} of a {fmt_size(size)} state, {where}")
                ax.tick_params(axis="y", labelsize=7)
                ax.set_xlim(0, max(r["median_s"] for r in rows) * 1.3)
                fig.tight_layout()
                name = f"{key}_{op}_{size // MiB}MiB.png"
                fig.savefig(img / name, dpi=110)
                plt.close(fig)
                out[f"{key}-{op}-{size}"] = f"img/{name}"
    lt = data.get("latest")
    if lt and lt["rows"]:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
        for backend in sorted({r["backend"] for r in lt["rows"]}):
            rs = [r for r in lt["rows"] if r["backend"] == backend]
            xs = [r["checkpoints"] for r in rs]
            a1.plot(xs, [r["median_s"] * 1000 for r in rs], marker="o", label=backend)
            a2.plot(xs, [r["storage_calls_total"] for r in rs], marker="o",
                    label=f"{backend}: storage calls")
            if any(r["http_requests_total"] for r in rs):
                a2.plot(xs, [r["http_requests_total"] for r in rs], marker="s", linestyle="--",
                        label=f"{backend}: HTTP requests")
        for a in (a1, a2):
            a.set_xscale("log")
            a.set_xlabel("committed checkpoints")
            a.legend(fontsize=8)
        a1.set_ylabel("ms (median)")
        a1.set_yscale("log")
        a2.set_ylabel("requests")
        top = max(max(r["storage_calls_total"], r["http_requests_total"] or 0)
                  for r in lt["rows"])
        a2.set_ylim(0, top + 2)
        a1.set_title("Time to resolve latest")
        a2.set_title("Requests to resolve latest")
        fig.tight_layout()
        fig.savefig(img / "latest.png", dpi=110)
        plt.close(fig)
        out["latest"] = "img/latest.png"
    return out


# ----------------------------------------------------------------------------------------------
# Command line


def _save_json(results_dir: Path, name: str, payload: Mapping[str, Any]) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    p = results_dir / f"{name}.json"
    p.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return p


def _sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def run_question(q: str, args: argparse.Namespace) -> dict[str, Any]:
    isolate = not getattr(args, "in_process", False)
    if q == "hash":
        return bench_hash(parse_size(args.hash_size), reps=args.reps)
    if q == "save":
        return bench_save(_sizes(args.sizes), reps=args.reps, isolate=isolate,
                          full_up_to=parse_size(args.full_up_to))
    if q == "interleaved":
        return bench_interleaved(_sizes(args.sizes), reps=args.interleaved_reps)
    if q == "s3":
        return bench_s3(_sizes(args.s3_sizes), reps=args.s3_reps or args.reps, isolate=isolate)
    if q == "latest":
        return bench_latest([int(c) for c in args.counts.split(",")], reps=max(args.reps, 3),
                            s3_max=args.s3_max)
    raise ValueError(q)


def cmd_bench(args: argparse.Namespace) -> int:
    results = Path(args.results)
    what = args.bench_command
    if what == "report":
        print(write_report(results, Path(args.docs)))
        return 0
    questions = QUESTIONS if what == "all" else (what,)
    machine = machine_info()
    t0 = time.perf_counter()
    for q in questions:
        print(f"[{time.strftime('%H:%M:%S')}] {q} ...", flush=True)
        _save_json(results, q, run_question(q, args))
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    machine["duration_s"] = round(time.perf_counter() - t0, 1)
    if args.note:
        machine["concurrent_note"] = args.note
    if what == "all" or not (results / "machine.json").exists():
        _save_json(results, "machine", machine)
    if what == "all" or args.report:
        print(write_report(results, Path(args.docs)))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=3, help="timed runs per variant (median)")
    p.add_argument("--sizes", default="1GiB,4GiB", help="local save/load state sizes")
    p.add_argument("--full-up-to", default="2GiB",
                   help="run every variant up to this size; above it, only the default "
                   "algorithm and the main baselines (time: the full set takes ~5 min per GiB)")
    p.add_argument("--interleaved-reps", type=int, default=3,
                   help="rounds of the interleaved save-target check (each times every variant)")
    p.add_argument("--s3-sizes", default="1GiB", help="state sizes for the moto benchmark")
    p.add_argument("--s3-reps", type=int, default=2,
                   help="timed runs per moto variant (default: --reps); one 1 GiB run takes "
                   "10-30 s there")
    p.add_argument("--hash-size", default="512MiB", help="buffer size for hashing throughput")
    p.add_argument("--counts", default="10,100,1000,10000", help="checkpoint counts (latest)")
    p.add_argument("--s3-max", type=int, default=1000,
                   help="largest checkpoint count populated on moto (it takes ~3 PUTs each)")
    p.add_argument("--in-process", action="store_true",
                   help="run variants in this process (smoke tests; RSS then less meaningful)")
    p.add_argument("--results", default=str(RESULTS_DIR), help="where the JSON goes")
    p.add_argument("--docs", default=str(DOCS_DIR), help="where benchmarks.md and img/ go")
    p.add_argument("--report", action="store_true", help="regenerate the report afterwards")
    p.add_argument("--note", default="", help="a remark stored with the machine description "
                   "(e.g. that other work was running)")


def add_subcommands(subparsers: Any) -> None:
    """``ckptfs bench {hash,save,s3,latest,all,report}``."""
    p = subparsers.add_parser("bench", help="run the benchmarks (see docs/benchmarks.md)")
    sub = p.add_subparsers(dest="bench_command", required=True)
    helps = {"hash": "hashing throughput of every algorithm",
             "save": "save/load on local disk against torch.save, safetensors and DCP",
             "interleaved": "the save targets with the variants interleaved run by run",
             "s3": "save/load on a moto S3 server against raw s3fs",
             "latest": "cost of resolving latest vs number of checkpoints",
             "all": "everything, then the report",
             "report": "regenerate docs/benchmarks.md and docs/img/ from the JSON"}
    for name, text in helps.items():
        q = sub.add_parser(name, help=text)
        add_arguments(q)
        q.set_defaults(func=cmd_bench)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckptfs-bench")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))


def _worker_main(argv: Sequence[str]) -> int:
    spec = json.loads(argv[0])
    result = _worker(spec)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        sys.exit(_worker_main(sys.argv[1:]))
    sys.exit(main())
