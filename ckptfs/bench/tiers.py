"""Two tiers: what a second, remote tier costs a training job.

Side by side in one run, on this machine, with a moto S3 server (a subprocess on the same
cores) as the remote tier:

- **blocking**: the time ``save`` blocks on a tiered store (local disk + S3) against a
  local-only store, the two alternating round by round, the disk settled before each timed
  save.  Measured twice: a save alone with the replicator idle (what the tiered store itself
  adds: enqueueing), and a save right after another, whose replication runs meanwhile (what a
  job saving faster than it replicates sees; copying pauses while the job saves) against a
  local-only save right after another;
- **replication**: the time from ``save`` returning to the step being committed at the remote,
  against ``ckptfs cp`` (`copy_step`, what the replicator runs) of
  the same checkpoint alone to an empty prefix, alternating;
- **loop**: a small training loop (an MLP with AdamW, a fixed batch) saving every ``every``
  steps, run with no checkpoint, with a local-only store and with two tiers: the loop's
  throughput, each step's time (the plot), and the replication lag (committed locally, not yet
  at the remote) seen at every save.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptfs.bench.common import MiB, fmt_size, fs_type, machine_info, warm_memory

DEFAULT_SIZE = 256 * MiB
FULL_SIZE = 1024 * MiB


def _state(nbytes: int, tensors: int = 8, seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    n = nbytes // tensors // 4
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(tensors)}


def _advance(state: dict[str, Any]) -> None:
    for t in state.values():
        t.mul_(0.999).add_(1e-3)


def _remote(srv: Any, prefix: str) -> Any:
    import ckptfs

    return ckptfs.open(srv.url(prefix), **srv.storage_options)


def _settle(nbytes: int, seconds: float) -> None:
    """Before a timed save: the page cache's dirty data written out and a pause (this VM's disk
    absorbs a burst and then slows down: the second of two back-to-back 1 GiB durable saves
    took up to 2x the first whatever wrote them), then memory touched (``warm_memory``)."""
    os.sync()
    time.sleep(seconds)
    warm_memory(nbytes)


def _copy_alone(tiered: Any, dst: Any, step: int) -> float:
    """``ckptfs cp`` (`copy_step`, what the replicator runs) of ``step`` alone."""
    from ckptfs.protocol.copy import copy_step

    t0 = time.perf_counter()
    copy_step(tiered.local.storage, dst.storage, step, durable=dst.durable, threads=dst.threads)
    return time.perf_counter() - t0


def bench_blocking(nbytes: int, rounds: int, srv: Any, work: Path, *, settle_s: float = 1.0,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Local-only vs tiered save (replicator idle; and, after another save, while that one
    replicates), and replication vs cp.  Each round alternates which store goes first."""
    import ckptfs

    state = _state(nbytes)
    local_only = ckptfs.open(str(work / "local-only"))
    tiered = ckptfs.tiered(str(work / "tier-local"), _remote(srv, "tiered"))
    cp_dst = _remote(srv, "cp")
    rows: list[dict[str, Any]] = []
    step = 0

    def save(store: Any) -> float:
        nonlocal step
        step += 1
        _advance(state)
        t0 = time.perf_counter()
        store.save(step, state)
        return time.perf_counter() - t0

    try:
        # Warm-up (imports, the S3 client, first-touch pages): not timed.
        save(local_only)
        save(tiered)
        tiered.wait_replicated()
        for r in range(1, rounds + 1):
            row: dict[str, Any] = {"round": r}
            first, second = ("local", "tiered") if r % 2 else ("tiered", "local")
            # The pair of saves alone, next to each other, the replicator held off until both
            # returned (so neither is measured against the other's background work).
            tiered.replicator.hold()
            try:
                for name in (first, second):
                    _settle(nbytes, settle_s)
                    if name == "local":
                        row["local_s"] = save(local_only)
                    else:
                        row["tiered_idle_s"] = save(tiered)
                        replicate = step
                # ckptfs cp of the same checkpoint alone, before or after (alternating) its
                # replication: the server's state drifts over a round.
                cp_first = r % 2 == 0
                if cp_first:
                    row["cp_s"] = _copy_alone(tiered, cp_dst, replicate)
            finally:
                tiered.replicator.release()
            t1 = time.perf_counter()
            tiered.wait_replicated()
            row["replication_s"] = time.perf_counter() - t1
            if not cp_first:
                row["cp_s"] = _copy_alone(tiered, cp_dst, replicate)
            # A save right after another: local-only, and tiered while the other replicates.
            for name in (first, second):
                _settle(nbytes, settle_s)
                if name == "local":
                    save(local_only)
                    row["local_b2b_s"] = save(local_only)
                else:
                    save(tiered)  # its replication starts now
                    busy = step
                    row["tiered_busy_s"] = save(tiered)
                    row["busy_overlapped"] = tiered.replication().state(busy) != "replicated"
                    tiered.wait_replicated()
            for st in (local_only, tiered):
                for s in st.steps()[:-1]:
                    st.delete(s)
            srv.reset()  # moto keeps every byte in memory
            rows.append({k: round(v, 4) if type(v) is float else v for k, v in row.items()})
            log(f"  round {r}: local {row['local_s']:.3f} s, tiered {row['tiered_idle_s']:.3f} s;"
                f" after another save: local {row['local_b2b_s']:.3f} s, tiered while it "
                f"replicates {row['tiered_busy_s']:.3f} s; replication "
                f"{row['replication_s']:.2f} s vs cp {row['cp_s']:.2f} s")
    finally:
        tiered.close()

    def med(key: str) -> float:
        return round(float(statistics.median(r[key] for r in rows)), 4)

    m = {k: med(k) for k in ("local_s", "tiered_idle_s", "local_b2b_s", "tiered_busy_s",
                             "replication_s", "cp_s")}
    per_round = {
        "blocking_idle": round(statistics.median(r["tiered_idle_s"] / r["local_s"]
                                                 for r in rows), 4),
        "blocking_busy": round(statistics.median(r["tiered_busy_s"] / r["local_b2b_s"]
                                                 for r in rows), 4),
        "replication_vs_cp": round(statistics.median(r["cp_s"] / r["replication_s"]
                                                     for r in rows), 4),
    }
    return {
        "state_bytes": nbytes, "rounds": rows, "median": m,
        "ratios_per_round_median": per_round,
        "ratios": {
            "blocking_idle": round(m["tiered_idle_s"] / m["local_s"], 4),
            "blocking_busy": round(m["tiered_busy_s"] / m["local_b2b_s"], 4),
            "replication_vs_cp": round(m["cp_s"] / m["replication_s"], 4),
        },
        "throughput_MiBps": {"replication": round(nbytes / MiB / m["replication_s"], 1),
                             "cp": round(nbytes / MiB / m["cp_s"], 1)},
    }


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc (0 where unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def bench_overhead(nbytes: int, rounds: int, work: Path,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """What a tiered save adds to a local-only one, without the disk's noise: both stores on
    tmpfs (``/dev/shm`` where there is one), ``durable=False``, the two saves of each round next
    to each other (alternating which goes first) with the replicator held off until both
    returned; the remote is a directory there too (replication is not what is timed)."""
    import ckptfs

    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="ckptfs-bench-tiers-", dir=shm if shm.is_dir() else work))
    state = _state(nbytes)
    local_only = ckptfs.open(str(root / "local-only"), durable=False)
    tiered = ckptfs.tiered(ckptfs.open(str(root / "tier-local"), durable=False),
                           ckptfs.open(str(root / "remote"), durable=False))
    rows: list[dict[str, Any]] = []
    step = 0
    try:
        for r in range(rounds + 1):  # round 0: warm-up, not kept
            row: dict[str, Any] = {"round": r}
            tiered.replicator.hold()
            try:
                for name in (("local", "tiered") if r % 2 else ("tiered", "local")):
                    step += 1
                    _advance(state)
                    warm_memory(nbytes)
                    t0 = time.perf_counter()
                    (local_only if name == "local" else tiered).save(step, state)
                    row[f"{name}_s"] = time.perf_counter() - t0
            finally:
                tiered.replicator.release()
            tiered.wait_replicated()
            for st in (local_only, tiered):
                for s in st.steps()[:-1]:
                    st.delete(s)
            if r:
                rows.append({k: round(v, 5) if type(v) is float else v for k, v in row.items()})
    finally:
        tiered.close()
        shutil.rmtree(root, ignore_errors=True)
    local = statistics.median(x["local_s"] for x in rows)
    tier = statistics.median(x["tiered_s"] for x in rows)
    out = {"state_bytes": nbytes, "where": fs_type(str(root.parent)), "rounds": rows,
           "median": {"local_s": round(local, 5), "tiered_s": round(tier, 5)},
           "ratio": round(tier / local, 4),
           "ratio_per_round_median": round(statistics.median(
               x["tiered_s"] / x["local_s"] for x in rows), 4)}
    log(f"  overhead on {out['where']}: local {local:.4f} s, tiered {tier:.4f} s "
        f"({out['ratio']:.3f}x; per round {out['ratio_per_round_median']:.3f}x)")
    return out


class _Loop:
    """An MLP with AdamW on a fixed batch: ``params`` floats of parameters (the checkpoint is
    about 3x that: weights and AdamW's two moments)."""

    def __init__(self, params: int, seed: int = 0) -> None:
        import torch

        torch.manual_seed(seed)
        width = 1024
        layers = max(1, params // (width * width))
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(64, width)

    def step(self) -> None:
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def bench_loop(params: int, steps: int, every: int, srv: Any, work: Path,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    import ckptfs
    from ckptfs.bench.common import state_bytes

    out: dict[str, Any] = {"steps": steps, "every": every, "variants": {}}
    for variant in ("none", "local", "two tiers"):
        loop = _Loop(params)
        for _ in range(2):  # AdamW's state exists after the first step
            loop.step()
        out["checkpoint_bytes"] = state_bytes(loop.state())
        store: Any = None
        if variant == "local":
            store = ckptfs.open(str(work / "loop-local"))
        elif variant == "two tiers":
            store = ckptfs.tiered(str(work / "loop-tiered"), _remote(srv, "loop"))
        times: list[float] = []
        lags: list[dict[str, Any]] = []
        save_s: list[float] = []
        cpu0, server0 = time.process_time(), _cpu_s(srv.pid)
        t_start = time.perf_counter()
        try:
            for i in range(1, steps + 1):
                t0 = time.perf_counter()
                loop.step()
                if store is not None and i % every == 0:
                    if variant == "two tiers":
                        st = store.replication()
                        lags.append({"step": i, "lag_steps": st.lag_steps,
                                     "lag_bytes": st.lag_bytes})
                    t1 = time.perf_counter()
                    store.save(i, loop.state())
                    save_s.append(time.perf_counter() - t1)
                    for s in store.steps()[:-2]:  # keep_last=2 (unreplicated ones are held)
                        if variant == "local" or s not in store.replication().steps or \
                                store.replication().state(s) == "replicated":
                            store.delete(s)
                times.append(time.perf_counter() - t0)
            total = time.perf_counter() - t_start
            cpu = time.process_time() - cpu0
            server_cpu = _cpu_s(srv.pid) - server0
            tail_s = 0.0
            if variant == "two tiers":
                t0 = time.perf_counter()
                store.wait_replicated()
                tail_s = time.perf_counter() - t0
        finally:
            if store is not None:
                store.close()
        if variant == "two tiers":
            srv.reset()
        v = {"steps_per_s": round(steps / total, 3), "total_s": round(total, 3),
             "cpu_s": round(cpu, 3), "server_cpu_s": round(server_cpu, 3),
             "step_s": [round(t, 4) for t in times],
             "save_s_median": round(statistics.median(save_s), 4) if save_s else None}
        if variant == "two tiers":
            steady = lags[len(lags) // 2:]
            v.update({"lags": lags, "max_lag_steady": max(x["lag_steps"] for x in steady),
                      "wait_at_end_s": round(tail_s, 3)})
        out["variants"][variant] = v
        log(f"  loop {variant}: {v['steps_per_s']:.2f} steps/s"
            + (f", save {v['save_s_median']:.3f} s" if save_s else "")
            + (f", lag at saves (steady) <= {v['max_lag_steady']}" if variant == "two tiers"
               else ""))
    base = out["variants"]["none"]["steps_per_s"]
    out["ratios"] = {k: round(v["steps_per_s"] / base, 4) for k, v in out["variants"].items()}
    return out


def bench_tiers(*, full: bool = False, size: int | None = None, rounds: int = 3,
                loop_params: int | None = None, loop_steps: int = 120, every: int = 20,
                workdir: str | None = None, log: Callable[[str], None] = print
                ) -> dict[str, Any]:
    from ckptfs.testing.servers import moto_server

    nbytes = size or (FULL_SIZE if full else DEFAULT_SIZE)
    params = loop_params or (32 if full else 16) * MiB // 4
    work = Path(tempfile.mkdtemp(prefix="ckptfs-bench-tiers-", dir=workdir))
    local_fs = fs_type(str(work))
    try:
        with moto_server() as srv:
            log(f"tiers: {fmt_size(nbytes)} state, local tier on {local_fs} ({work}), "
                "remote: moto S3 on this machine")
            overhead = bench_overhead(nbytes // 4, 4 * rounds + 1, work, log)
            blocking = bench_blocking(nbytes, rounds, srv, work, settle_s=2.0 if full else 0.2,
                                      log=log)
            srv.reset()
            loop = bench_loop(params, loop_steps, every, srv, work, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"full_sizes": full, "machine": machine_info(), "local_fs": local_fs,
            "server": "moto (python -m moto.server, subprocess on the same 2 cores)",
            "overhead": overhead, "blocking": blocking, "loop": loop}
