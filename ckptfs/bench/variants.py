"""Variants: one thing timed (a ckptfs save or load, or a baseline's), with its untimed set-up
and clean-up, and the runner that measures one variant in a fresh process
(``python -m ckptfs.bench.cli SPEC``) so the memory of one library is not inherited by the
next."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptfs.bench.common import (
    REPO,
    RESULT_TAG,
    Timing,
    flat_tensors,
    state_bytes,
    timed,
    transformer_state,
)


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
        from ckptfs.format.serialize import tensor_memoryview

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
        from ckptfs.torch_compat import FsspecWriter

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
            from ckptfs.torch_compat import FsspecReader

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
    from ckptfs.format.serialize import plan_state

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


def save_target_variants(algo: str) -> list[Variant]:
    """The save variants the targets compare (run interleaved by ``bench_interleaved``)."""
    return [_ckptfs_save(algo, True), _dcp_save("fs", None), _ckptfs_save(algo, False),
            _st_save()]


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


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one variant (in a fresh process when called through ``python -m ckptfs.bench.cli``)."""
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


def run_isolated(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "ckptfs.bench.cli", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return dict(json.loads(line[len(RESULT_TAG):]))
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"variant": spec["variant"], "error": f"exit {proc.returncode}: {tail}"}

