"""``ckptfs prune``, ``ckptfs gc`` and ``ckptfs best`` with and without ``--json`` (local and
memory)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
import torch

import ckptfs
from ckptfs.cli.core import main
from ckptfs.format.layout import StepPaths, new_attempt_name
from ckptfs.testing.backend import Backend


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def fill(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open(), best=ckptfs.Best("loss", "min", keep=1))
    for step, loss in ((10, 3.0), (20, 1.0), (30, 2.0), (40, 2.5), (50, 2.2)):
        mgr.save(step, model=torch.nn.Linear(2, 2), metrics={"loss": loss})


def test_prune_dry_run_then_real(backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    fill(backend)
    rc, out = run(capsys, "prune", backend.url, "--keep-last", "2", "--dry-run", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["dry_run"] and doc["delete"] == [10, 30] and doc["deleted"] == []
    assert doc["keep"]["20"] == ["best"]
    assert backend.open().steps() == [10, 20, 30, 40, 50]
    rc, out = run(capsys, "prune", backend.url, "--keep-last", "2")
    assert rc == 0 and "deleted 2 checkpoint(s): [10, 30]" in out
    assert backend.open().steps() == [20, 40, 50]


def test_prune_keep_every_and_protected_from_resume(backend: Backend,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    fill(backend)
    mgr = ckptfs.CheckpointManager(backend.open())
    mgr.restore_latest(model=torch.nn.Linear(2, 2))  # resumed from 50
    mgr.save(60, model=torch.nn.Linear(2, 2))
    rc, out = run(capsys, "prune", backend.url, "--keep-every", "40", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["deleted"] == [10, 30]
    assert doc["keep"]["50"] == ["protected"] and doc["keep"]["40"] == ["every-40"]
    rc, out = run(capsys, "prune", backend.url)
    assert rc == 2 and "--keep-last" in out


def test_gc(backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    backend.open().save(1, {"x": torch.ones(2)})
    old = StepPaths(2).attempt_dir(new_attempt_name(datetime.now(timezone.utc)
                                                    - timedelta(hours=2)))
    backend.raw_write(f"{old}/state.msgpack", b"x" * 64)
    rc, out = run(capsys, "gc", backend.url, "--older-than", "1h", "--dry-run", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["bytes_found"] == 64 and doc["bytes_freed"] == 0
    assert [i["path"] for i in doc["items"] if i["kind"] == "attempt"] == [old]
    rc, out = run(capsys, "gc", backend.url, "--older-than", "3h")
    assert rc == 0 and "removed 0 item(s)" in out
    rc, out = run(capsys, "gc", backend.url, "--older-than", "1h")
    assert rc == 0 and "removed" in out and "64 bytes" in out
    assert not backend.raw_exists(f"{old}/state.msgpack")
    rc = main(["gc", backend.url, "--older-than", "later"])
    err = capsys.readouterr().err
    assert rc == 2 and "bad duration" in err and "--older-than" in err


def test_best(backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run(capsys, "best", backend.url)
    assert rc == 1 and "no best record" in out
    fill(backend)
    rc, out = run(capsys, "best", backend.url, "--json")
    doc = json.loads(out)["best"]
    assert rc == 0 and doc["metric"] == "loss" and doc["high_water"] == 1.0
    assert doc["pool"] == [{"step": 20, "value": 1.0, "committed": True}]
    rc, out = run(capsys, "best", backend.url)
    assert "loss (min, keep 1): high-water 1.0" in out and "step 20: 1.0" in out
