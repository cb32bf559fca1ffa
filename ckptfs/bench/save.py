"""The save/load questions: local disk (``save``), the same save targets with the variants
interleaved run by run (``interleaved``), and a moto S3 server (``s3``)."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from ckptfs.bench.common import (
    GiB,
    Timing,
    fmt_size,
    fs_type,
    state_bytes,
    timed,
    transformer_state,
)
from ckptfs.bench.variants import (
    Ctx,
    run_isolated,
    run_variant,
    save_target_variants,
    variants,
)


def bench_save(sizes: Sequence[int], *, reps: int = 3, question: str = "save",
               s3: dict[str, Any] | None = None, isolate: bool = True,
               full_up_to: int = 2 * GiB, workdir: str | None = None,
               only: Sequence[str] | None = None, log: Callable[[str], None] = print,
               between: Callable[[], None] | None = None) -> dict[str, Any]:
    """Save and load of transformer states on local disk (``question="save"``) or S3."""
    from ckptfs.format.hashing import DEFAULT_ALGORITHM, available_algorithms

    algos = available_algorithms()
    base = Path(workdir or tempfile.mkdtemp(prefix="ckptfs-bench-"))
    results: list[dict[str, Any]] = []
    info = {"workdir": str(base), "workdir_fs": fs_type(str(base)),
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
                r = run_isolated(spec, timeout=900)
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
    from ckptfs.format.hashing import DEFAULT_ALGORITHM

    d = DEFAULT_ALGORITHM
    rows: list[dict[str, Any]] = []
    load_before = [round(x, 2) for x in os.getloadavg()]
    for size in sizes:
        state = transformer_state(size)
        ctx = Ctx(state, state_bytes(state), Path(tempfile.mkdtemp(prefix="ckptfs-bench-")))
        del state
        vs = save_target_variants(d)
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
    from ckptfs.testing.servers import moto_server

    with moto_server() as srv:
        s3 = {"endpoint": srv.endpoint, "bucket": srv.bucket,
              "options": dict(srv.storage_options)}
        out = bench_save(sizes, reps=reps, question="s3", s3=s3, isolate=isolate, log=log,
                         between=srv.reset)  # moto keeps objects in memory: start empty
    out["server"] = "moto (python -m moto.server, subprocess on the same 2 cores)"
    return out

