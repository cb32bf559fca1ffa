"""Incremental saves racing deletes and garbage collection, in separate processes:
a saver keeps saving a LoRA-like state (a frozen base referenced from the previous
checkpoint, a changing adapter) while a pruner deletes every checkpoint but the newest (the one
whose bytes the next save references) and a collector runs with a short grace.  Afterwards every
committed checkpoint loads bit-exact and verifies, and after the last deletes and a final
collection nothing is left but the bytes the remaining checkpoint needs (no leak).

The saver's lease (0.5 s) is shorter than the collector's grace (2 s): the protocol's condition
(docs/protocol.md §9.5).  Workers are plain ``python -c`` subprocesses sharing only the storage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ckptfs.lifecycle.gc import collect
from ckptfs.testing.backend import Backend

_COMMON = r"""
import json, os, sys, time
import torch
import ckptfs

def state(step):
    g = torch.Generator().manual_seed(1234)
    base = {f"base{i}": torch.randn(64, 64, generator=g) for i in range(6)}
    adapter = torch.full((8, 8), float(step))
    return {"model": {**base, "adapter": adapter}, "step": step}
"""

_SAVER = _COMMON + r"""
url, options, first, last, stop = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5]
store = ckptfs.open(url, incremental=True, lease_s=0.5, **options)
s = state(first)
out = []
for step in range(first, last + 1):
    s["model"]["adapter"].fill_(float(step))   # in place: the base keeps its version
    s["step"] = step
    try:
        info = store.save(step, s)
        out.append([step, info.bytes_written, info.bytes])
    except Exception as exc:
        out.append([step, f"{type(exc).__name__}: {exc}"])
open(stop, "w").close()
print(json.dumps(out), flush=True)
"""

_PRUNER = r"""
import json, sys, os, time
import ckptfs
url, options, stop = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
store = ckptfs.open(url, **options)
deleted, errors = 0, []
while not os.path.exists(stop):
    try:
        steps = store.steps()
        for step in steps[:-1]:
            store.delete(step)
            deleted += 1
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    time.sleep(0.01)
print(json.dumps({"deleted": deleted, "errors": errors[:5]}), flush=True)
"""

_COLLECTOR = r"""
import json, sys, os, time
from datetime import timedelta
import ckptfs
from ckptfs.lifecycle.gc import collect
url, options, stop = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
store = ckptfs.open(url, **options)
runs, removed, errors = 0, 0, []
while not os.path.exists(stop):
    try:
        report = collect(store.storage, older_than=timedelta(seconds=2))
        runs += 1
        removed += sum(1 for i in report.items if i.removed)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    time.sleep(0.05)
print(json.dumps({"runs": runs, "removed": removed, "errors": errors[:5]}), flush=True)
"""


def _expected(step: int) -> dict[str, object]:
    ns: dict[str, object] = {}
    exec(_COMMON, ns)  # the workers' own state function
    return ns["state"](step)  # type: ignore[operator, no-any-return]


def _stored_files(backend: Backend) -> dict[str, int]:
    store = backend.open()
    return {e.name: e.size for e in store.storage.list_tree("checkpoints")
            if "/a-" in e.name}


@pytest.mark.parametrize("backend_name", ["local", "s3", "gcs", "azure"])
def test_saves_racing_prunes_and_gc_never_commit_a_missing_byte(
        backend_name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    env = {**os.environ, **backend.env}
    opts = json.dumps(dict(backend.options))
    first, last = 1, 24 if backend_name == "local" else 12
    stop = tmp_path / "stop"
    procs = [
        subprocess.Popen([sys.executable, "-c", _SAVER, backend.url, opts, str(first), str(last),
                          str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env),
        subprocess.Popen([sys.executable, "-c", _PRUNER, backend.url, opts, str(stop)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
        subprocess.Popen([sys.executable, "-c", _COLLECTOR, backend.url, opts, str(stop)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        stop.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
    saves, pruner, collector = outs
    failed = [s for s in saves if isinstance(s[1], str)]
    assert not failed, failed
    assert not pruner["errors"], pruner
    assert not collector["errors"], collector
    reused = [s for s in saves if s[1] < s[2]]
    assert reused, f"no save referenced stored bytes: {saves}"

    store = backend.open()
    steps = store.steps()
    assert steps and steps[-1] == last
    for step in steps:  # every committed checkpoint: every byte there and as committed
        report = store.verify(step)
        assert report.ok, report.problems
        got = store.load(step)
        want = _expected(step)
        for k, v in want["model"].items():  # type: ignore[union-attr]
            assert torch.equal(got["model"][k], v), (step, k)

    # No leak: delete all but the newest, collect everything old enough, and what is left is
    # exactly the newest checkpoint's files and the files it references.
    for step in steps[:-1]:
        store.delete(step)
    time.sleep(2.2)
    collect(store.storage, older_than=timedelta(seconds=2))
    info = store.info(last)
    m = info.manifest
    assert m.format_version == 3
    needed = {f"{info.path}/{f.path}" for f in m.files} | {f"{info.path}/MANIFEST.json"}
    needed |= {r.location for r in m.references}
    # a retired attempt keeps its referenced files and its manifest, nothing else (§9.5)
    needed |= {f"{r.attempt_dir}/MANIFEST.json" for r in m.references}
    left = set(_stored_files(backend))
    assert left == needed, (sorted(left - needed), sorted(needed - left))
    assert store.verify(last).ok
