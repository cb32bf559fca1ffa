"""The incremental question (``incremental``): what an incremental save (format v3,
``ckptfs.open(url, incremental=True)``) writes and costs, next to a full ckptfs save and to
DCP's ``dcp.save`` of the same state.

Cases (each in one process, its variants side by side and interleaved round by round: every
round changes the state in place, untimed, then times each variant once, the order rotating
from round to round so none is always first):

- **lora**: a frozen base (fp32 matrices) plus LoRA adapters (``lora_A`` r x cols and ``lora_B``
  rows x r per matrix, about 1% of the base) modified in place every step;
- **rl**: actor, critic, reference policy and reward model of equal sizes; the actor and the
  critic change every step, the reference and the reward model are frozen;
- **finetune**: every tensor changes every step (``add_`` in place): the incremental save
  against a plain (format v1) ckptfs save of the same state;
- **retention**: ``saves`` saves of the LoRA run through ``CheckpointManager(keep_last=5)``: the
  bytes on disk at the end (the run directory walked) against one full state + the bytes the
  retained checkpoints wrote + the metadata.  Deleting an older step is only safe with the
  reference-aware delete (``ckptfs.protocol.references``); without it the case is not run and
  is marked pending (``force=True`` runs it anyway and reports which checkpoints still verify);
- **s3**: the LoRA run saved to a moto S3 server: HTTP requests (by operation) and bytes
  uploaded per save, incremental against full;
- **fresh**: what a resumed job sees: a new process imports ckptfs and makes its first
  incremental save into a run that holds a committed checkpoint of the same base, against a
  full save in a new process (medians of the rounds; variants interleaved).

Local saves are durable (fsync of files and directories, ckptfs's default; DCP's
``FileSystemWriter`` default ``sync_files=True``).  Before each timed save a few GiB are touched
and freed (`ckptfs.bench.common.timed`, as the other save benchmarks: this VM returns idle
memory to its host).  Every variant keeps its run (a job's saves accumulate; DCP writes one
directory per step): the incremental variant must (it references its earlier checkpoints), and
clearing the others' directories would hand them the page cache of the deleted files to reuse,
while the incremental one grows its run into fresh memory (a first run set up that way measured
the fine-tuning save, which writes the same bytes as v1, at 2.6x v1's time).
Round 0 is each variant's first save in the process (an incremental save with nothing to
reference writes everything); the compared figures are medians over the later rounds (the
steady state).  *bytes written* is ``info.bytes_written`` (the checkpoint's own files: the
tensor files and ``state.msgpack``; the manifest and marker aside) for ckptfs, and the size of
the directory written for DCP.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptfs.bench.common import GiB, MiB, Timing, fill_random, fmt_size, fs_type, timed

#: The issue's sizes (``--full``) and the defaults (a few minutes on 2 shared cores).
FULL_SIZES = {"base": GiB, "tensors": 32, "retention_base": GiB, "s3_base": GiB}
DEFAULT_SIZES = {"base": 256 * MiB, "tensors": 32, "retention_base": 128 * MiB,
                 "s3_base": 64 * MiB}
KEEP_LAST = 5
ADAPTER_FRACTION = 0.01

#: The targets of incremental saves: (key, text, goal); a value at or below the goal meets it.
TARGETS = {
    "lora_bytes": ("LoRA-like: bytes written per save <= 1.2% of a full save", 0.012),
    "lora_time": ("LoRA-like: steady-state save time <= 0.35x a full durable save", 0.35),
    "rl_bytes": ("RL-like: bytes written per save <= 52% of a full save", 0.52),
    "finetune_time": ("full fine-tuning: save time <= 1.05x today's (v1) save", 1.05),
    "finetune_bytes": ("full fine-tuning: bytes written equal to a v1 save (within the state "
                       "document)", 0.0),
    "retention_bytes": (f"{KEEP_LAST} retained of 100 LoRA saves: stored bytes <= one full "
                        "state + the retained checkpoints' changed bytes + metadata", 1.0),
}


def gc_available() -> bool:
    """Whether this tree has the reference-aware delete: without it,
    deleting an older step of an incremental run deletes bytes later checkpoints reference."""
    return importlib.util.find_spec("ckptfs.protocol.references") is not None


# ----------------------------------------------------------------------------------------------
# States: (state, the tensors that change every step)


@dataclass
class Case:
    name: str
    description: str
    state: dict[str, Any]
    changing: list[Any]
    step: int = 0

    def advance(self) -> None:
        """One training step: every changing tensor modified in place (its ``_version``
        moves, as an optimizer step's does)."""
        import torch

        self.step += 1
        with torch.no_grad():
            for t in self.changing:
                t.add_(1e-3)
        self.state["trainer"]["step"] = self.step

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.state))

    @property
    def changing_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.changing)


def _tensors(state: Any) -> Iterator[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, Mapping):
        for v in state.values():
            yield from _tensors(v)


def _matrix(nbytes: int) -> tuple[int, int]:
    """A fp32 matrix shape of ``nbytes``: rows the power of two at or below its square root."""
    n = max(1, nbytes // 4)
    rows = 1 << (math.isqrt(n).bit_length() - 1)
    return rows, max(1, n // rows)


def _fill(tensors: Sequence[Any], seed: int) -> None:
    """Random contents, distinct per tensor (``fill_random`` tiles one block: shift it)."""
    fill_random(tensors, seed)
    for i, t in enumerate(tensors):
        t.add_(float(i))


def lora_case(base_bytes: int, tensors: int = 32, seed: int = 0) -> Case:
    import torch

    rows, cols = _matrix(base_bytes // tensors)
    r = max(1, round(ADAPTER_FRACTION * rows * cols / (rows + cols)))
    base = {f"layers.{i}.weight": torch.empty(rows, cols) for i in range(tensors)}
    adapters: dict[str, Any] = {}
    for i in range(tensors):
        adapters[f"layers.{i}.lora_A"] = torch.empty(r, cols)
        adapters[f"layers.{i}.lora_B"] = torch.empty(rows, r)
    _fill([*base.values(), *adapters.values()], seed)
    state = {"model": {**base, **adapters}, "trainer": {"step": 0}}
    return Case("lora", f"frozen base {fmt_size(rows * cols * 4 * tensors)} ({tensors} x "
                f"{rows}x{cols} fp32) + LoRA adapters of rank {r} (A {r}x{cols}, B {rows}x{r} "
                "per matrix), modified in place every step", state, list(adapters.values()))


def rl_case(total_bytes: int, tensors_per_model: int = 8, seed: int = 1) -> Case:
    import torch

    rows, cols = _matrix(total_bytes // 4 // tensors_per_model)
    models = {m: {f"layers.{i}.weight": torch.empty(rows, cols)
                  for i in range(tensors_per_model)}
              for m in ("actor", "critic", "reference", "reward")}
    _fill([t for m in models.values() for t in m.values()], seed)
    state: dict[str, Any] = {**models, "trainer": {"step": 0}}
    changing = [*models["actor"].values(), *models["critic"].values()]
    return Case("rl", f"actor, critic, reference, reward: {fmt_size(total_bytes // 4)} each "
                f"({tensors_per_model} x {rows}x{cols} fp32); actor and critic change every "
                "step", state, changing)


def finetune_case(total_bytes: int, tensors: int = 32, seed: int = 2) -> Case:
    import torch

    rows, cols = _matrix(total_bytes // tensors)
    model = {f"layers.{i}.weight": torch.empty(rows, cols) for i in range(tensors)}
    _fill(list(model.values()), seed)
    return Case("finetune", f"{tensors} x {rows}x{cols} fp32, every tensor changed in place "
                "(add_) every step", {"model": model, "trainer": {"step": 0}},
                list(model.values()))


# ----------------------------------------------------------------------------------------------
# The variants of a local case


@dataclass
class Saver:
    """One way of saving: ``save(step)`` returns what it wrote; ``before`` runs untimed."""

    name: str
    save: Callable[[int], dict[str, int]]
    before: Callable[[], None] = lambda: None
    series: list[dict[str, Any]] = field(default_factory=list)
    timing: Timing = field(default_factory=Timing)


def _clear(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)


def tree_bytes(root: Path) -> int:
    """Every byte of every file under ``root`` (what the run holds on disk)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def _written(info: Any) -> dict[str, int]:
    from ckptfs.format.layout import STATE_NAME

    doc = next((f.size for f in info.manifest.files if f.path == STATE_NAME), 0)
    return {"bytes_written": int(info.bytes_written), "bytes": int(info.bytes),
            "state_doc": int(doc)}


def ckptfs_saver(name: str, root: Path, state: Mapping[str, Any], *,
                 incremental: bool) -> Saver:
    import ckptfs

    _clear(root)
    store = ckptfs.open(str(root), incremental=incremental)

    def save(step: int) -> dict[str, int]:
        return _written(store.save(step, state))

    return Saver(name, save)


def _dcp() -> Any:
    """torch.distributed.checkpoint, untyped (its stubs do not export what it exports)."""
    import warnings

    warnings.filterwarnings("ignore")
    return importlib.import_module("torch.distributed.checkpoint")


def dcp_saver(root: Path, state: Mapping[str, Any]) -> Saver:
    _clear(root)

    def save(step: int) -> dict[str, int]:
        dcp = _dcp()
        d = root / f"step-{step}"
        dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
        n = tree_bytes(d)
        return {"bytes_written": n, "bytes": n}

    return Saver("DCP FileSystemWriter (default, fsync)", save)


def run_case(case: Case, savers: Sequence[Saver], rounds: int, *, warm: int,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """``rounds`` rounds: the state advanced one step, then every saver timed once."""
    for r in range(rounds):
        if r:
            case.advance()
        order = [*savers[r % len(savers):], *savers[:r % len(savers)]]
        for s in order:
            s.before()
            out = timed(lambda s=s: s.save(case.step), s.timing,  # type: ignore[misc]
                        warm=warm)
            s.series.append({"round": r, "time_s": round(s.timing.times[-1], 4),
                             "cpu_s": round(s.timing.cpu[-1], 4), **out})
        log(f"  {case.name} round {r}: " + ", ".join(
            f"{s.name} {s.series[-1]['time_s']:.3f} s {fmt_size(s.series[-1]['bytes_written'])}"
            for s in savers))
    variants: dict[str, Any] = {}
    for s in savers:
        steady = s.series[1:] or s.series
        variants[s.name] = {
            "series": s.series,
            "first_s": s.series[0]["time_s"],
            "median_s": round(statistics.median(x["time_s"] for x in steady), 4),
            "cpu_s": round(statistics.median(x["cpu_s"] for x in steady), 4),
            "bytes_written": int(statistics.median(x["bytes_written"] for x in steady)),
            "bytes": int(statistics.median(x["bytes"] for x in steady)),
        }
    return {"case": case.name, "description": case.description, "state_bytes": case.nbytes,
            "changing_bytes": case.changing_bytes,
            "changing_fraction": round(case.changing_bytes / case.nbytes, 5),
            "tensors": sum(1 for _ in _tensors(case.state)), "rounds": rounds,
            "variants": variants}


INCR, FULL, V1, DCP = ("ckptfs incremental", "ckptfs full (durable)", "ckptfs v1 (durable)",
                       "DCP FileSystemWriter (default, fsync)")


def _target(key: str, value: float, detail: str, *, goal: float | None = None,
            met: bool | None = None) -> dict[str, Any]:
    text, default_goal = TARGETS[key]
    g = default_goal if goal is None else goal
    return {"key": key, "target": text, "value": round(value, 4), "goal": g,
            "met": value <= g if met is None else met, "detail": detail}


def _ratios(res: dict[str, Any], ours: str, ref: str) -> dict[str, float]:
    a, b = res["variants"][ours], res["variants"][ref]
    return {"bytes": round(a["bytes_written"] / b["bytes_written"], 5),
            "time": round(a["median_s"] / b["median_s"], 4)}


def bench_local(base: int, tensors: int, rounds: int, workdir: Path,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """The three local cases (lora, rl, finetune), each with its targets."""
    out: dict[str, Any] = {}
    makers: list[Callable[[], Case]] = [lambda: lora_case(base, tensors),
                                        lambda: rl_case(base),
                                        lambda: finetune_case(base, tensors)]
    for make in makers:
        case = make()
        w = workdir / case.name
        ref = V1 if case.name == "finetune" else FULL
        savers = [ckptfs_saver(INCR, w / "incr", case.state, incremental=True),
                  ckptfs_saver(ref, w / "full", case.state, incremental=False),
                  dcp_saver(w / "dcp", case.state)]
        warm = case.nbytes + min(case.nbytes, GiB)
        try:
            res = run_case(case, savers, rounds, warm=warm, log=log)
        finally:
            shutil.rmtree(w, ignore_errors=True)
        res["ratios"] = {f"incremental/{'v1' if ref == V1 else 'full'}": _ratios(res, INCR, ref),
                         "incremental/dcp": _ratios(res, INCR, DCP),
                         f"{'v1' if ref == V1 else 'full'}/dcp": _ratios(res, ref, DCP)}
        i, f = res["variants"][INCR], res["variants"][ref]
        detail = (f"{fmt_size(i['bytes_written'])} / {fmt_size(f['bytes_written'])}; "
                  f"{i['median_s']:.3f} s / {f['median_s']:.3f} s")
        rb, rt = i["bytes_written"] / f["bytes_written"], i["median_s"] / f["median_s"]
        if case.name == "lora":
            res["targets"] = [_target("lora_bytes", rb, detail), _target("lora_time", rt, detail)]
        elif case.name == "rl":
            res["targets"] = [_target("rl_bytes", rb, detail)]
        else:
            doc = max(x.get("state_doc", 0) for x in f["series"])
            diff = abs(i["bytes_written"] - f["bytes_written"])
            res["targets"] = [_target("finetune_time", rt, detail),
                              _target("finetune_bytes", diff, f"abs(incremental - v1) = {diff} B "
                                      f"(state document {doc} B)", goal=doc)]
        out[case.name] = res
        del case, savers
    return out


# ----------------------------------------------------------------------------------------------
# Retention: 100 saves with CheckpointManager(keep_last=5)


def bench_retention(base: int, tensors: int, saves: int, workdir: Path, *, force: bool = False,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """``saves`` saves of the LoRA run through ``CheckpointManager(keep_last=5)``; the stored
    bytes at the end against one full state + the retained checkpoints' own bytes +
    metadata.  Without the reference-aware delete this is not run (marked pending) unless
    ``force``: then it reports which retained checkpoints still verify."""
    have_gc = gc_available()
    out: dict[str, Any] = {"saves": saves, "keep_last": KEEP_LAST, "base_bytes": base,
                           "gc_merged": have_gc}
    if not have_gc and not force:
        out["status"] = "pending gc merge"
        out["reason"] = ("the reference-aware delete (ckptfs.protocol.references, helper "
                         "h-incr-gc) is not in this tree: keep_last would delete the base that "
                         "every later checkpoint references; rerun after the merge")
        log(f"  retention: {out['status']}")
        return out
    import torch

    import ckptfs
    from ckptfs.errors import CkptfsError
    from ckptfs.format.layout import STATE_NAME

    case = lora_case(base, tensors, seed=3)
    holder = torch.nn.Module()
    for name, t in case.state["model"].items():
        holder.register_buffer(name.replace(".", "_"), t)
    root = workdir / "retention"
    _clear(root)
    store = ckptfs.open(str(root), incremental=True)
    mgr = ckptfs.CheckpointManager(store, keep_last=KEEP_LAST)
    series: list[dict[str, Any]] = []
    first_bytes = 0
    try:
        for step in range(1, saves + 1):
            case.advance()
            t0 = time.perf_counter()
            res = mgr.save(step, model=holder)
            dt = time.perf_counter() - t0
            info = res.info
            assert info is not None
            if step == 1:
                first_bytes = int(info.bytes)
            series.append({"step": step, "time_s": round(dt, 4),
                           "bytes_written": int(info.bytes_written), "bytes": int(info.bytes),
                           "errors": res.errors})
        retained = store.steps()
        own = {s: int(store.info(s).bytes_written) for s in retained}
        data, meta = _stored(root, STATE_NAME)
        after_gc: int | None = None
        if have_gc:  # attempts kept whole for their references ("retired"), once unreferenced
            mgr.gc(older_than=timedelta(0))
            after_gc = sum(_stored(root, STATE_NAME))
        verified: dict[str, str] = {}
        for s in retained:
            try:
                store.verify(s)
                verified[str(s)] = "ok"
            except CkptfsError as exc:
                verified[str(s)] = f"{type(exc).__name__}: {str(exc)[:160]}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    stored = data + meta
    bound = first_bytes + sum(own.values()) + meta
    steady = series[1:]
    out.update({
        "status": "measured" if have_gc else "forced without the gc merge: not valid",
        "description": case.description, "state_bytes": case.nbytes,
        "changing_bytes": case.changing_bytes, "retained": retained,
        "retained_own_bytes": {str(k): v for k, v in own.items()},
        "first_save_bytes": first_bytes, "stored_bytes": stored, "stored_data_bytes": data,
        "metadata_bytes": meta, "bound_bytes": bound,
        "stored_after_gc_bytes": after_gc,
        "stored_over_one_full_state": round(stored / first_bytes, 4),
        "without_incremental_bytes": first_bytes * len(retained),
        "median_save_s": round(statistics.median(x["time_s"] for x in steady), 4)
        if steady else None,
        "median_bytes_written": int(statistics.median(x["bytes_written"] for x in steady))
        if steady else None,
        "verified": verified, "series": series,
    })
    out["targets"] = [_target(
        "retention_bytes", stored / bound,
        f"stored {stored:,} B vs bound {bound:,} B (one full state {first_bytes:,} + retained "
        f"own {sum(own.values()):,} + metadata {meta:,}); after `gc --older-than 0`: "
        f"{after_gc if after_gc is None else f'{after_gc:,} B'}; every retained checkpoint "
        f"verifies: {all(v == 'ok' for v in verified.values())}",
        met=stored <= bound and all(v == "ok" for v in verified.values()))]
    log(f"  retention: stored {fmt_size(stored)} vs bound {fmt_size(bound)}, "
        f"retained {retained}, verified {verified}")
    return out


def _stored(root: Path, state_name: str) -> tuple[int, int]:
    """(data, metadata) bytes on disk under ``root``: tensor files and state documents, and
    everything else (manifests, markers, the manager's records)."""
    data = meta = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            n = os.lstat(os.path.join(dirpath, f)).st_size
            if f.endswith(".safetensors") or f == state_name:
                data += n
            else:
                meta += n
    return data, meta


# ----------------------------------------------------------------------------------------------
# S3 (moto): requests and bytes uploaded per save


@contextmanager
def count_requests(fs: Any) -> Iterator[dict[str, Any]]:
    """The HTTP requests an s3fs filesystem sends, by operation, and the request body bytes
    (what is uploaded), from botocore's ``before-call`` events."""
    out: dict[str, Any] = {"requests": {}, "uploaded": 0}

    def handler(**kwargs: Any) -> None:
        name = getattr(kwargs.get("model"), "name", "?")
        out["requests"][name] = out["requests"].get(name, 0) + 1
        body = (kwargs.get("params") or {}).get("body")
        if isinstance(body, (bytes, bytearray, memoryview)):
            out["uploaded"] += len(body)
        elif body is not None and callable(getattr(body, "seek", None)):
            pos = body.tell()
            out["uploaded"] += body.seek(0, 2) - pos
            body.seek(pos)

    fs.connect()
    events = fs.s3.meta.events
    events.register("before-call.s3", handler)
    try:
        yield out
    finally:
        events.unregister("before-call.s3", handler)


def bench_s3_incremental(base: int, tensors: int, rounds: int,
                         log: Callable[[str], None] = print) -> dict[str, Any]:
    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.storage.fsspec import FsspecStorage
    from ckptfs.storage.retry import RetryingStorage
    from ckptfs.testing.servers import moto_server

    case = lora_case(base, tensors, seed=4)
    series: dict[str, list[dict[str, Any]]] = {INCR: [], FULL: []}
    with moto_server() as srv:
        stores = {}
        for name, prefix, incr in ((INCR, "incr", True), (FULL, "full", False)):
            adapter = FsspecStorage(srv.url(prefix), **srv.storage_options)
            store = CheckpointStore(RetryingStorage(adapter), incremental=incr)
            store.steps()  # the client is set up before the timed saves (as a job does)
            stores[name] = (store, adapter)
        for r in range(rounds):
            if r:
                case.advance()
            names = list(series) if r % 2 == 0 else list(series)[::-1]
            for name in names:
                store, adapter = stores[name]
                with count_requests(adapter.fs) as c:
                    t0 = time.perf_counter()
                    info = store.save(case.step, case.state)
                    dt = time.perf_counter() - t0
                series[name].append({"round": r, "time_s": round(dt, 4),
                                     "requests": dict(c["requests"]),
                                     "requests_total": sum(c["requests"].values()),
                                     "uploaded_bytes": int(c["uploaded"]), **_written(info)})
            log(f"  s3 round {r}: " + ", ".join(
                f"{n} {s[-1]['time_s']:.2f} s, {s[-1]['requests_total']} requests, "
                f"{fmt_size(s[-1]['uploaded_bytes'])} up" for n, s in series.items()))
    variants: dict[str, Any] = {}
    for name, ser in series.items():
        steady = ser[1:] or ser
        variants[name] = {
            "series": ser,
            "median_s": round(statistics.median(x["time_s"] for x in steady), 4),
            "requests_total": int(statistics.median(x["requests_total"] for x in steady)),
            "requests": steady[-1]["requests"],
            "uploaded_bytes": int(statistics.median(x["uploaded_bytes"] for x in steady)),
            "bytes_written": int(statistics.median(x["bytes_written"] for x in steady)),
        }
    i, f = variants[INCR], variants[FULL]
    return {"description": case.description, "state_bytes": case.nbytes, "rounds": rounds,
            "server": "moto (python -m moto.server, subprocess on the same cores)",
            "variants": variants,
            "ratios": {"uploaded": round(i["uploaded_bytes"] / f["uploaded_bytes"], 5),
                       "requests": round(i["requests_total"] / f["requests_total"], 4),
                       "time": round(i["median_s"] / f["median_s"], 4)}}


# ----------------------------------------------------------------------------------------------
# A fresh process (a resumed job): import + first incremental save into an existing run

#: Public API only, and nothing of ckptfs imported before the timer.  The state is built the
#: same way in every process (seeded), so the prepared run holds the same frozen base.
FRESH_CHILD = r'''
import json, math, sys, time
spec = json.loads(sys.argv[1])
import torch
torch.manual_seed(0)
n = spec["base"] // spec["tensors"] // 4
rows = 1 << (math.isqrt(n).bit_length() - 1)
cols = n // rows
r = max(1, round(0.01 * rows * cols / (rows + cols)))
model, adapters = {}, []
for i in range(spec["tensors"]):
    model[f"layers.{i}.weight"] = torch.empty(rows, cols).uniform_()
for i in range(spec["tensors"]):
    for name, shape in (("lora_A", (r, cols)), ("lora_B", (rows, r))):
        t = torch.empty(shape).uniform_()
        model[f"layers.{i}.{name}"] = t
        adapters.append(t)
state = {"model": model, "trainer": {"step": 1}}

def advance(step):
    with torch.no_grad():
        for t in adapters:
            t.add_(1e-3)
    state["trainer"]["step"] = step

if spec["op"] == "prepare":
    import ckptfs
    ckptfs.open(spec["dir"], incremental=True).save(1, state)
    print("RESULT {}")
    sys.exit(0)
x = torch.empty(spec["warm"], dtype=torch.uint8); x.fill_(1); del x
advance(2)
t0 = time.perf_counter()
import ckptfs
store = ckptfs.open(spec["dir"], incremental=spec["op"] == "incremental")
t1 = time.perf_counter()
info = store.save(2, state)
t2 = time.perf_counter()
steady, steady_bytes = [], []
for step in range(3, 3 + spec["steady"]):
    advance(step)
    a = time.perf_counter()
    steady_bytes.append(store.save(step, state).bytes_written)
    steady.append(time.perf_counter() - a)
print("RESULT " + json.dumps({"import": t1 - t0, "first": t2 - t1, "fresh": t2 - t0,
                              "steady": steady, "first_bytes_written": info.bytes_written,
                              "steady_bytes_written": steady_bytes}))
'''


def _fresh_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", FRESH_CHILD, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"fresh {spec['op']} child failed ({proc.returncode}): "
                       f"{proc.stderr[-2000:]}")


def bench_fresh_incremental(base: int, tensors: int, rounds: int, workdir: Path, *,
                            steady: int = 2, log: Callable[[str], None] = print
                            ) -> dict[str, Any]:
    """Import + first save in a new process: incremental into a run that holds a committed
    checkpoint of the same base (what a resumed job sees), against a full save."""
    runs: dict[str, list[dict[str, Any]]] = {"incremental": [], "full": []}
    incr_dir, full_dir = workdir / "fresh-incr", workdir / "fresh-full"
    common = {"base": base, "tensors": tensors, "steady": steady,
              "warm": base + min(base, GiB)}
    _clear(incr_dir)
    try:
        _fresh_child({**common, "op": "prepare", "dir": str(incr_dir)})
        for r in range(rounds):
            for op in (("incremental", "full") if r % 2 == 0 else ("full", "incremental")):
                d = incr_dir if op == "incremental" else full_dir
                if op == "full":
                    _clear(full_dir)
                runs[op].append(_fresh_child({**common, "op": op, "dir": str(d)}))
                for p in (d / "checkpoints").iterdir():
                    if op == "full" or p.name != "step-000000000001":
                        shutil.rmtree(p, ignore_errors=True)
                x = runs[op][-1]
                log(f"  fresh round {r} {op}: fresh {x['fresh']:.3f} s (import "
                    f"{x['import']:.3f}), first save {fmt_size(x['first_bytes_written'])}, "
                    f"steady {statistics.median(x['steady'] or [0]):.3f} s")
    finally:
        shutil.rmtree(incr_dir, ignore_errors=True)
        shutil.rmtree(full_dir, ignore_errors=True)
    summary = {op: {"fresh_s": round(statistics.median(x["fresh"] for x in rs), 4),
                    "import_s": round(statistics.median(x["import"] for x in rs), 4),
                    "first_save_s": round(statistics.median(x["first"] for x in rs), 4),
                    "steady_s": round(statistics.median(s for x in rs for s in x["steady"]), 4)
                    if steady else None,
                    "first_bytes_written": int(rs[-1]["first_bytes_written"]),
                    "steady_bytes_written": int(statistics.median(
                        b for x in rs for b in x["steady_bytes_written"])) if steady else None}
               for op, rs in runs.items()}
    return {"base_bytes": base, "tensors": tensors, "rounds": rounds, "steady_saves": steady,
            "runs": runs, "summary": summary,
            "ratios": {"fresh incremental/full": round(
                summary["incremental"]["fresh_s"] / summary["full"]["fresh_s"], 4)}}


# ----------------------------------------------------------------------------------------------
# The whole question


def bench_incremental(*, full: bool = False, base: int | None = None, tensors: int | None = None,
                      rounds: int = 6, retention_base: int | None = None,
                      retention_saves: int = 100, s3_base: int | None = None,
                      s3_rounds: int = 3, fresh_rounds: int = 2, force_retention: bool = False,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every case of the module docstring; ``full``: the issue's sizes (1 GiB)."""
    sizes = FULL_SIZES if full else DEFAULT_SIZES
    base = base or sizes["base"]
    tensors = tensors or sizes["tensors"]
    retention_base = retention_base or sizes["retention_base"]
    s3_base = s3_base or sizes["s3_base"]
    workdir = Path(tempfile.mkdtemp(prefix="ckptfs-incr-bench-"))
    out: dict[str, Any] = {
        "question": "incremental", "full_sizes": full, "base_bytes": base, "tensors": tensors,
        "workdir_fs": fs_type(str(workdir)), "gc_merged": gc_available(),
        "load_before": [round(x, 2) for x in os.getloadavg()]}
    t0 = time.perf_counter()
    try:
        out["cases"] = bench_local(base, tensors, rounds, workdir, log=log)
        out["retention"] = bench_retention(retention_base, tensors, retention_saves, workdir,
                                           force=force_retention, log=log)
        out["s3"] = bench_s3_incremental(s3_base, tensors, s3_rounds, log=log)
        out["fresh"] = bench_fresh_incremental(base, tensors, fresh_rounds, workdir, log=log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["targets"] = [t for c in out["cases"].values() for t in c.get("targets", [])]
    out["targets"] += out["retention"].get("targets", [])
    out["duration_s"] = round(time.perf_counter() - t0, 1)
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    for t in out["targets"]:
        log(f"  target {t['target']}: {t['value']} (goal {t['goal']}): "
            f"{'met' if t['met'] else 'NOT met'} ({t['detail']})")
    return out
