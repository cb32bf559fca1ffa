"""Writers and readers in separate processes (a zombie job and its replacement are never threads
of one process): 8 processes save the same step at once and exactly one commit wins; a store
kept open in another process sees a new commit at once (no listing cache hides it).

Workers are plain ``python -c`` subprocesses with the backend's URL and storage options (JSON),
started together and released by a file barrier, so they share nothing but the storage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckptfs.format.layout import StepPaths
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal, committed_attempt, small_state

WRITERS = 8

_SAVER = r"""
import json, os, sys, time
from ckptfs.errors import CheckpointExistsError
import ckptfs
from ckptfs.testing.conformance import small_state
url, options, seed, step, ready, go = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5], sys.argv[6]
store = ckptfs.open(url, **options)
state = small_state(seed, step=step)
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
try:
    info = store.save(step, state)
    out = {"seed": seed, "result": "won", "attempt": info.attempt}
except CheckpointExistsError as exc:
    out = {"seed": seed, "result": "lost", "message": str(exc)}
except BaseException as exc:
    out = {"seed": seed, "result": "error", "message": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out), flush=True)
"""

_READER = r"""
import json, sys
import ckptfs
url, options = sys.argv[1], json.loads(sys.argv[2])
store = ckptfs.open(url, **options)
before = {"latest": None if store.latest() is None else store.latest().step,
          "steps": store.steps()}
print(json.dumps({"ready": True, **before}), flush=True)
sys.stdin.readline()  # the other process has committed
after = store.latest()
print(json.dumps({"latest": None if after is None else after.step, "steps": store.steps()}),
      flush=True)
"""


def _env(backend: Backend) -> dict[str, str]:
    return {**os.environ, **backend.env}


def _options(backend: Backend) -> str:
    return json.dumps(dict(backend.options))


def _race(backend: Backend, tmp_path: Path, step: int) -> list[dict[str, Any]]:
    ready = [tmp_path / f"ready-{i}" for i in range(WRITERS)]
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SAVER, backend.url, _options(backend), str(i), str(step),
             str(ready[i]), str(go)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(backend))
        for i in range(WRITERS)
    ]
    try:
        deadline = time.monotonic() + 240
        while not all(r.exists() for r in ready):
            dead = [p for p in procs if p.poll() is not None]
            assert not dead, dead[0].communicate()[1][-3000:]
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.02)
        go.touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.fixture(params=["local", "s3"])
def race_backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def test_processes_same_step_one_winner(race_backend: Backend, tmp_path: Path) -> None:
    backend = race_backend
    results = _race(backend, tmp_path, step=70)
    errors = [r for r in results if r["result"] == "error"]
    assert not errors, errors
    winners = [r for r in results if r["result"] == "won"]
    assert len(winners) == 1, results
    losers = [r for r in results if r["result"] == "lost"]
    assert len(losers) == WRITERS - 1
    assert all("step 70" in r["message"] for r in losers)
    reader = backend.open()
    assert reader.steps() == [70]
    assert reader.verify(70).ok
    winner = winners[0]
    assert committed_attempt(backend, 70) == winner["attempt"]
    assert_state_equal(reader.load(70), small_state(winner["seed"], step=70))
    # Every file under the step belongs to the winner's attempt (losers removed theirs).
    files = backend.raw_files(StepPaths(70).dir)
    attempts = {k.split("/")[2] for k in files if k.count("/") >= 3}
    assert attempts == {winner["attempt"]}, sorted(files)


@pytest.fixture(params=["local", "s3", "gcs", "azure"])
def reader_backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def test_open_store_in_other_process_sees_commit_at_once(reader_backend: Backend) -> None:
    """A store opened (and used: listings made) in another process before a commit sees the
    commit on its next call, with no reopen and no wait."""
    backend = reader_backend
    proc = subprocess.Popen([sys.executable, "-c", _READER, backend.url, _options(backend)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(backend))
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = json.loads(proc.stdout.readline() or "{}")
        assert first.get("ready"), proc.stderr.read() if proc.stderr else ""
        assert first["latest"] is None and first["steps"] == []
        writer = backend.open()
        writer.save(5, small_state(5))
        writer.save(6, small_state(6))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        after = json.loads(proc.stdout.readline() or "{}")
        assert after == {"latest": 6, "steps": [5, 6]}, after
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
