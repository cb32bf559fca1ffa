"""Demo: a training run killed in the middle of a save resumes exactly where it left off.

Run it with ``python -m ckptfs.cli.demo`` (local directory ``./demo-run``, wiped at start) or
against any store: ``python -m ckptfs.cli.demo --root s3://bucket/demo -o endpoint_url=http://...``.

What it does, on CPU with deterministic ops (about 10-20 s):

1. trains a small classifier (with dropout, a shuffling sampler, noise from torch, Python and
   NumPy RNGs: every generator matters) for ``--steps`` steps in this process, without
   interruption: the *reference*;
2. starts the same training in a child process with a `CheckpointManager`
   saving every ``--save-every`` steps, and kills it with SIGKILL while it saves step
   ``--kill-at`` (the child reports when its data files are written and the commit marker is
   not yet created; the parent kills it right there);
3. shows what the store holds: the killed step is incomplete, "latest" is the previous one;
4. resumes in a new child process from the latest committed checkpoint (model, optimizer,
   scheduler, sampler, trainer counters and RNG states restored) and trains to the end;
5. compares, bit for bit, every loss and the final parameters with the reference, and shows
   that skipping the RNG restore would have changed the run;
6. collects the killed save's leftover attempt with the garbage collector.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from datetime import timedelta
from typing import Any

import torch

from ckptfs.cli.core import parse_options
from ckptfs.lifecycle import rng as rng_mod
from ckptfs.lifecycle.gc import collect
from ckptfs.lifecycle.manager import CheckpointManager
from ckptfs.lifecycle.retention import Best
from ckptfs.protocol.store import CheckpointStore
from ckptfs.protocol.store import open as open_store
from ckptfs.storage.base import Storage, StorageWrapper

DATA_SEED = 1234
RUN_SEED = 7


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None
    return numpy


class ShuffleSampler:
    """A DataLoader-like sampler: a fresh permutation each epoch from torch's global RNG, so a
    resumed run reproduces the data order only if the RNG and the sampler state are restored."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size = n, batch_size
        self.epoch = 0
        self.pos = 0
        self.perm = torch.randperm(n)

    def next_batch(self) -> torch.Tensor:
        if self.pos + self.batch_size > self.n:
            self.epoch += 1
            self.pos = 0
            self.perm = torch.randperm(self.n)
        idx = self.perm[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "perm": self.perm.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.perm = state["perm"].clone()


class ToyTask:
    """A small model, its data, optimizer, scheduler and sampler; ``step()`` trains one step
    and returns the loss.  Every construction from the same seed is identical."""

    def __init__(self, seed: int = RUN_SEED) -> None:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        rng_mod.seed_all(seed)
        g = torch.Generator().manual_seed(DATA_SEED)
        self.x = torch.randn(512, 16, generator=g)
        teacher = torch.randn(16, 4, generator=g)
        self.y = (self.x @ teacher).argmax(dim=1)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                         torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=100, gamma=0.5)
        self.sampler = ShuffleSampler(len(self.x), 32)

    def step(self) -> float:
        self.model.train()
        idx = self.sampler.next_batch()
        x = self.x[idx] + 0.05 * torch.randn(len(idx), 16)  # torch RNG
        if random.random() < 0.5:  # Python RNG: random horizontal "flip" of the features
            x = x.flip(1)
        np = _numpy()
        if np is not None:  # NumPy RNG: a per-step scale
            x = x * float(np.random.uniform(0.9, 1.1))
        loss = torch.nn.functional.cross_entropy(self.model(x), self.y[idx])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.sched.step()
        return float(loss.item())

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def train(task: ToyTask, mgr: CheckpointManager | None, start: int, total: int,
          save_every: int, emit: Any = None, final_save: bool = True) -> dict[int, float]:
    """Train steps ``start..total-1``; save every ``save_every`` steps and (``final_save``) at
    the last step."""
    losses: dict[int, float] = {}
    for step in range(start, total):
        loss = task.step()
        losses[step] = loss
        if mgr is not None:
            mgr.trainer.record_update(applied=math.isfinite(loss))
        if emit is not None:
            emit(step, loss)
        if mgr is not None and (mgr.should_save(step) or (final_save and step == total - 1)):
            mgr.save(step, model=task.model, optimizer=task.opt, scheduler=task.sched,
                     stateful={"sampler": task.sampler}, metrics={"train/loss": loss},
                     epoch=task.sampler.epoch)
    return losses


def make_manager(store: CheckpointStore, save_every: int) -> CheckpointManager:
    return CheckpointManager(store, save_every=save_every, keep_last=3,
                             best=Best(metric="train/loss", mode="min", keep=1),
                             run_seed=RUN_SEED)


class PauseBeforeCommit(StorageWrapper):
    """Wraps a store's storage: when the commit marker of step ``step`` is about to be created
    (every data file and the manifest are written), say so on stdout and wait to be killed."""

    def __init__(self, inner: Storage, step: int) -> None:
        super().__init__(inner)
        self._target = f"step-{step:012d}/COMPLETE"

    def create_exclusive(self, path: str, data: bytes) -> None:
        if path.endswith(self._target):
            print(f"PAUSED {path}", flush=True)
            time.sleep(120)
        super().create_exclusive(path, data)


# -- child processes ------------------------------------------------------------------------


def _child(args: argparse.Namespace) -> int:
    store = open_store(args.root, **parse_options(args.option))
    if args.kill_at is not None:
        store.storage = PauseBeforeCommit(store.storage, args.kill_at)
    task = ToyTask()
    mgr = make_manager(store, args.save_every)
    start = mgr.restore_latest(model=task.model, optimizer=task.opt, scheduler=task.sched,
                               stateful={"sampler": task.sampler})
    outcome = mgr.last_rng_outcome.action if mgr.last_rng_outcome else None
    print(f"START {start} {json.dumps(outcome)}", flush=True)

    def emit(step: int, loss: float) -> None:
        print(f"LOSS {step} {loss.hex()}", flush=True)

    train(task, mgr, start, args.steps, args.save_every, emit)
    print("DONE", flush=True)
    return 0


def _spawn(args: argparse.Namespace, extra: Sequence[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "ckptfs.cli.demo", "--child", "--root", args.root,
           "--steps", str(args.steps), "--save-every", str(args.save_every), *extra]
    for o in args.option:
        cmd += ["-o", o]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONHASHSEED": "0"})


def _read_losses(proc: subprocess.Popen[str], on_pause: Any = None) -> tuple[dict[int, float],
                                                                             int | None]:
    losses: dict[int, float] = {}
    start = None
    assert proc.stdout is not None
    for line in proc.stdout:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "LOSS":
            losses[int(parts[1])] = float.fromhex(parts[2])
        elif parts[0] == "START":
            start = int(parts[1])
        elif parts[0] == "PAUSED" and on_pause is not None:
            on_pause(parts[1])
    return losses, start


# -- the demo -------------------------------------------------------------------------------


def _wipe(store: CheckpointStore) -> None:
    for top in ("checkpoints", "lifecycle", "artifacts"):
        store.storage.delete_tree(top)


def _curve(losses: Mapping[int, float], total: int, width: int = 60) -> list[str]:
    steps = list(range(0, total, max(1, total // width)))
    vals = [losses[s] for s in steps if s in losses]
    if not vals:
        return []
    lo, hi = min(vals), max(vals)
    blocks = " ▁▂▃▄▅▆▇█"
    line = "".join(blocks[1 + int((v - lo) / (hi - lo + 1e-12) * 7.999)] for v in vals)
    return [f"  loss {hi:.3f} .. {lo:.3f}: {line}"]


def run_demo(args: argparse.Namespace) -> int:
    total, every, kill_at = args.steps, args.save_every, args.kill_at
    if not (0 < kill_at < total - 1 and kill_at % every == 0 and kill_at > every):
        raise SystemExit(f"ckptfs demo: --kill-at must be a save step after the first save "
                         f"(a multiple of {every} in ({every}, {total - 1}))")
    store = open_store(args.root, **parse_options(args.option))
    if not store.capabilities.shared:
        raise SystemExit(f"ckptfs demo: {store.url} is private to this process, but the demo "
                         "trains in child processes; use a directory or an object store URL")
    _wipe(store)
    print(f"ckptfs demo: run root {store.url} ({store.capabilities.protocol}), {total} steps, "
          f"save every {every}, keep_last=3, best train/loss")
    t0 = time.perf_counter()

    ref = ToyTask()
    ref_losses = train(ref, None, 0, total, every)
    ref_params = ref.params()
    print(f"[1] reference: {total} uninterrupted steps in this process, final loss "
          f"{ref_losses[total - 1]:.6f}")

    proc = _spawn(args, ["--kill-at", str(kill_at)])
    print(f"[2] training in a child process (pid {proc.pid}); it will be killed while saving "
          f"step {kill_at}")
    killed: list[str] = []

    def on_pause(path: str) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        killed.append(path)
        print(f"    step {kill_at}: data files and manifest written, commit marker not yet "
              f"created -> SIGKILL pid {proc.pid}")

    first_losses, _ = _read_losses(proc, on_pause)
    rc = proc.wait()
    if not killed:
        err = proc.stderr.read() if proc.stderr else ""
        print(f"ckptfs demo: the child exited (rc {rc}) before it could be killed:\n{err}",
              file=sys.stderr)
        return 1
    print(f"    child exited with {rc} (killed by signal {-rc if rc < 0 else '?'}) after "
          f"computing steps 0..{max(first_losses)}")

    store = open_store(args.root, **parse_options(args.option))
    committed = store.steps()
    latest = store.latest()
    assert latest is not None
    print(f"[3] after the kill: committed steps {committed}; step {kill_at} "
          f"{'is incomplete (attempt without marker)' if kill_at in store.all_steps() else '?'}"
          f"; latest = {latest.step}")

    proc = _spawn(args, [])
    resumed_losses, start = _read_losses(proc)
    rc = proc.wait()
    if rc != 0 or start is None:
        err = proc.stderr.read() if proc.stderr else ""
        print(f"ckptfs demo: the resumed run failed (rc {rc}):\n{err}", file=sys.stderr)
        return 1
    print(f"[4] resumed in a new process (pid {proc.pid}) from step {start - 1}: model, "
          f"optimizer, scheduler, sampler, counters and RNG restored; trained steps "
          f"{start}..{total - 1}")

    def same(a: Mapping[int, float], steps: range) -> int:
        return sum(1 for s in steps if a.get(s) is not None and
                   a[s].hex() == ref_losses[s].hex())

    first_range = range(0, max(first_losses) + 1)
    res_range = range(start, total)
    n1, n2 = same(first_losses, first_range), same(resumed_losses, res_range)
    redo = range(start, max(first_losses) + 1)
    n3 = sum(1 for s in redo if resumed_losses.get(s, math.nan).hex() == first_losses[s].hex())
    final_store = open_store(args.root, **parse_options(args.option))
    final = final_store.load()
    params_equal = all(torch.equal(final["model"][k], v) for k, v in ref_params.items())
    max_diff = max(float((final["model"][k] - v).abs().max()) for k, v in ref_params.items())
    print("[5] bit-for-bit comparison with the reference run:")
    print(f"    losses of the killed run, steps 0..{first_range[-1]}: {n1}/{len(first_range)} "
          "identical")
    print(f"    losses of the resumed run, steps {start}..{total - 1}: {n2}/{len(res_range)} "
          "identical")
    print(f"    steps {start}..{redo[-1]} computed twice (before the kill, after the resume): "
          f"{n3}/{len(redo)} identical")
    print(f"    parameters at step {total - 1}: {'identical' if params_equal else 'DIFFERENT'} "
          f"({len(ref_params)} tensors, max abs difference {max_diff})")

    # Control: the same resume without restoring the RNG diverges.
    ctl = ToyTask()
    cmgr = make_manager(open_store(args.root, **parse_options(args.option)), every)
    cstart = cmgr.restore(latest.step, model=ctl.model, optimizer=ctl.opt,
                          scheduler=ctl.sched, stateful={"sampler": ctl.sampler},
                          discard_uncommitted=False)
    rng_mod.seed_all(12345)
    ctl_losses = train(ctl, None, cstart, min(total, cstart + 20), every)
    diverged = [s for s, v in ctl_losses.items() if v.hex() != ref_losses[s].hex()]
    print(f"    control: resuming step {latest.step} without its RNG state: "
          f"{len(diverged)}/{len(ctl_losses)} of the next losses differ"
          + (f" (first at step {diverged[0]})" if diverged else ""))

    report = collect(final_store.storage, older_than=timedelta(0))
    removed = [i for i in report.items if i.removed]
    print(f"[6] gc (grace 0 s: no writer is running now): removed {len(removed)} item(s), "
          f"{report.bytes_freed} bytes: " + (", ".join(i.path for i in removed) or "nothing"))
    print(f"    retained checkpoints: {final_store.steps()} (keep_last=3 + best); "
          f"best train/loss: {make_manager(final_store, every).best()}")
    merged = {**first_losses, **resumed_losses}
    for line in _curve(merged, total):
        print(line)
    ok = (n1 == len(first_range) and n2 == len(res_range) and n3 == len(redo) and params_equal
          and bool(diverged))
    print(f"{'OK' if ok else 'FAILED'}: the resumed run is bit-identical to the uninterrupted "
          f"one ({time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ckptfs.cli.demo",
                                description=__doc__.split("\n")[0])
    p.add_argument("--root", default="./demo-run",
                   help="run root URL (wiped at start; default ./demo-run)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="storage option for fsspec (repeatable), e.g. -o endpoint_url=...")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--save-every", type=int, default=50, help="save every N steps")
    p.add_argument("--kill-at", type=int, default=None,
                   help="the save step during which the child is killed (default: the third "
                   "save from the end)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return _child(args)
    if args.kill_at is None:
        saves = [s for s in range(args.save_every, args.steps - 1, args.save_every)]
        args.kill_at = saves[-2] if len(saves) >= 3 else (saves[-1] if saves else 0)
    with suppress(KeyboardInterrupt):
        return run_demo(args)
    return 130


if __name__ == "__main__":
    sys.exit(main())
