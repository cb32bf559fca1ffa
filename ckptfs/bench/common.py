"""What every benchmark shares: sizes, timing with peak RSS, the machine description and
the transformer-shaped states that are saved and loaded.

This VM hands memory that sat free for a few seconds back to the host, and the next first touch
is 6-9x slower; every timed run is preceded by touching and freeing a few GiB (`timed`),
or the figures would swing with idle time.  Peak resident memory is the kernel's high-water mark
reset right before the timed call (``/proc/self/clear_refs``)."""

from __future__ import annotations

import gc
import importlib
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfs.errors import CkptfsError

KiB, MiB, GiB = 1024, 1024**2, 1024**3
#: The directory that holds the ``ckptfs`` package (a checkout, or site-packages): what the
#: benchmarks' child processes import from.  Never written to: outputs go where the user says
#: (``ckptfs bench ... --out DIR``, default the current directory).
REPO = Path(__file__).resolve().parents[2]
RESULT_TAG = "@@ckptfs-bench@@ "
QUESTIONS = ("hash", "save", "interleaved", "s3", "latest", "fresh", "incremental", "fixed")
BENCH_EXTRA = 'pip install "ckptfs[bench]"'


class BenchDependencyError(CkptfsError, ImportError):
    """A benchmark needs a package a plain install does not have."""


def need(module: str, purpose: str) -> Any:
    """``import module``, or a `BenchDependencyError` naming the extra that provides it (a
    plain install runs ``ckptfs --help`` and every other verb without these)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BenchDependencyError(
            f"{purpose} needs the {module.split('.')[0]} package, which is not installed: "
            f"{BENCH_EXTRA}") from exc


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


def rss_mark() -> int | None:
    """Reset the kernel's peak-RSS mark (``/proc/self/clear_refs``) and return the RSS now,
    in KiB; None where ``/proc`` offers neither.  `peak_extra_rss` of it after a call is the
    call's peak memory above what the process held before it."""
    base = _status_kib("VmRSS")
    return base if base is not None and _reset_peak_rss() else None


def peak_extra_rss(mark: int | None) -> int | None:
    """Bytes of the peak RSS since `rss_mark` returned ``mark``, above the RSS it saw."""
    if mark is None:
        return None
    peak = _status_kib("VmHWM")
    return None if peak is None else max(0, peak - mark) * KiB


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


def fs_type(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, timeout=10)
        fields = out.stdout.strip().splitlines()[-1].split()
        return f"{fields[1]} on {fields[0]}"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


# ----------------------------------------------------------------------------------------------
# A realistic state: a decoder-only transformer's parameters and its AdamW state


def fill_random(tensors: Sequence[Any], seed: int) -> None:
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
    fill_random(big, seed)
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

