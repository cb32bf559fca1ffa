"""Crash points of a sharded save.

- The crash sweep of :mod:`ckptfs.testing.reliability.sharded` (2 simulated ranks driving the
  DCP StorageWriter in DCP's call order) on local disk and memory, plus a check that the sweep
  can fail: with garbage collection disabled it must report the crashed attempts left behind.
- A real 2-rank gloo job where rank 1 SIGKILLs itself right after its data file is written
  (before the coordinator's commit): the survivor gets a typed ckptfs error within a bounded
  time that names rank 1, no marker is written, the previous latest stays intact, and GC
  collects the attempt."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import RankFailure, run_ranks, save_sharded
from test_sharded import build_state, to_plain

import ckptfs
from ckptfs.format.layout import StepPaths
from ckptfs.lifecycle import gc
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal
from ckptfs.testing.reliability import sharded as sharded_sweep
from ckptfs.testing.reliability.sharded import sweep_sharded_save_crashes


@pytest.mark.parametrize("backend_name", ["local", "memory"])
def test_sharded_save_crash_sweep(backend_name: str, request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    sweep = sweep_sharded_save_crashes(backend)
    assert sweep.violations == []
    n = sweep.counters["calls_per_sharded_save"]
    # Every call of the job, once after its last call, and every call of rank 1 alone.
    assert sweep.tried == n + 1 + sweep.counters["calls_of_rank1"]
    assert sweep.counters["files_per_sharded_save"] == 3  # two rank files + dcp.msgpack
    assert sweep.counters["gc_items"] > 0


def test_sharded_sweep_reports_a_leftover_attempt(memory_backend: Backend,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep is not vacuous: if nothing collects the crashed attempts, it says so."""
    real = gc.collect

    def no_op(storage: Any, **kwargs: Any) -> Any:
        return real(storage, **{**kwargs, "dry_run": True})

    monkeypatch.setattr(gc, "collect", no_op)
    sweep = sweep_sharded_save_crashes(memory_backend)
    assert any("gc left the crashed attempt's files" in v for v in sweep.violations)
    assert sharded_sweep.WORLD == 2


# ----------------------------------------------------------------------------------------------
# A real job: rank 1 is SIGKILLed after writing its data file


class KillAfterDataFile:
    """Rank 1's storage: the process kills itself (SIGKILL, no cleanup) as soon as its data
    file is written, before it reports its write results to the coordinator."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @contextmanager
    def open_write(self, path: str) -> Iterator[Any]:
        with self._inner.open_write(path) as f:
            yield f
        if "/rank-" in path:
            os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def job_kill(rank: int, world: int, url: str, report: str) -> Any:
    state, _ = build_state(world)
    plain = to_plain(state)
    store = ckptfs.open(url)
    store.save(1, state)
    if rank == 1:
        store.storage = KillAfterDataFile(store.storage)  # type: ignore[assignment]
    t0 = time.monotonic()
    try:
        store.save(2, state)
        outcome: Any = None
    except BaseException as exc:  # what the survivor sees, whatever it is
        outcome = (type(exc).__name__, isinstance(exc, ckptfs.CkptfsError), str(exc)[:2000])
    if rank == 0:
        torch.save(plain, report + ".plain.pt")
        with open(report, "w") as f:
            json.dump({"outcome": outcome, "seconds": time.monotonic() - t0}, f)
    return None


def test_rank_killed_mid_save(local_backend: Backend, tmp_path: Path) -> None:
    report = tmp_path / "rank0.json"
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        # pg_timeout bounds the launcher's own barrier after the job (the dead peer is gone).
        run_ranks(job_kill, 2, local_backend.url, str(report), timeout=180, pg_timeout=30)
    elapsed = time.monotonic() - t0
    errors = info.value.errors
    assert "exited with code -9" in errors[1]  # rank 1 died by SIGKILL, as planned
    assert "killed after the timeout" not in errors.get(0, "")  # the survivor was not hung
    got = json.loads(report.read_text())
    print(f"survivor after {got['seconds']:.2f} s: {got['outcome']}; job {elapsed:.1f} s")
    name, typed, text = got["outcome"]
    # The survivor gets a typed ckptfs error, well before the collective timeout.
    assert typed and name == "ShardedSaveError", got
    assert "step 2" in text and "Nothing was committed" in text, text
    # ... which names the dead rank (its liveness key is missing), and only that rank.
    assert "rank(s) [1] did not finish their part" in text, text
    assert got["seconds"] < 60, got
    assert elapsed < 180
    # No marker; rank 1's file was written (the kill came after it); the latest is step 1.
    assert not local_backend.raw_exists(StepPaths(2).marker)
    files = local_backend.raw_files(StepPaths(2).dir)
    assert any("rank-00001/data-0.safetensors" in f for f in files), files
    store = local_backend.open()
    assert store.latest().step == 1  # type: ignore[union-attr]
    assert store.verify(1).ok
    assert_state_equal(store.load(1), torch.load(str(report) + ".plain.pt", weights_only=False))
    # GC collects the attempt; then the step is free for the next save.
    later = datetime.now(timezone.utc) + timedelta(days=1)
    gcr = gc.collect(store.storage, older_than=timedelta(0), now=later, multipart=False)
    assert any(i.removed and "step-" in i.path for i in gcr.items), gcr.as_dict()
    assert local_backend.raw_files(StepPaths(2).dir) == {}
    assert save_sharded(store.storage, 2, {"w": torch.ones(3)}).step == 2

