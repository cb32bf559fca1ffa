"""``ckptfs ls LOCAL --remote REMOTE`` and ``ckptfs replicate LOCAL REMOTE`` (docs/cli.md,
docs/tiers.md): a two-tier job that died with two checkpoints not replicated, finished from the
command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.cli.core import main
from ckptfs.format.layout import StepPaths
from ckptfs.protocol.copy import copy_step


def state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(256, 64)}, "step": step}


@pytest.fixture
def died(tmp_path: Path) -> tuple[Path, Path]:
    """A job that died: 3 committed steps locally (and step 4 half-written), 1 at the
    remote."""
    local, remote = tmp_path / "nvme" / "run", tmp_path / "bucket" / "run"
    store = ckptfs.open(str(local))
    for s in (1, 2, 3):
        store.save(s, state(s))
    (local / StepPaths(4).attempt_dir("attempt-dead")).mkdir(parents=True)  # no marker
    copy_step(store.storage, ckptfs.open(str(remote)).storage, 1)
    return local, remote


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ls_both_tiers(died: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    local, remote = died
    code, out, _ = run(["ls", str(local), "--remote", str(remote), "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    where = {c["step"]: c["where"] for c in doc["checkpoints"]}
    assert where == {1: "both", 2: "local", 3: "local", 4: "none"}
    one = doc["checkpoints"][0]
    assert one["local"]["bytes"] == one["remote"]["bytes"] > 256 * 64 * 4
    assert doc["checkpoints"][1]["remote"] is None
    assert doc["checkpoints"][3]["local"]["committed"] is False
    assert doc["stored_bytes"]["remote"] >= one["remote"]["bytes"]
    code, out, _ = run(["ls", str(local), "--remote", str(remote)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["1", "both"] and lines[1].split()[:2] == ["2", "local"]
    assert "remote: -" in lines[1] and "local: incomplete" in lines[3]


def test_replicate_finishes_a_dead_jobs_work(died: tuple[Path, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    local, remote = died
    code, out, _ = run(["replicate", str(local), str(remote), "--dry-run", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["replicate"] == [2, 3] and doc["already"] == [1] and doc["bytes"] > 0
    assert ckptfs.open(str(remote)).steps() == [1]  # a dry run copies nothing

    code, out, err = run(["replicate", str(local), str(remote), "--threads", "3",
                          "--bytes-per-s", "1G"], capsys)
    assert code == 0, err
    assert "replicating 2 checkpoint(s)" in err and "[2, 3]; already there: [1]" in err
    assert "step 2: replicated" in err and "2/2 steps" in err
    assert out.startswith("OK: 2 checkpoint(s) replicated")
    plain = ckptfs.open(str(remote))
    assert plain.steps() == [1, 2, 3]
    for s in (1, 2, 3):
        assert plain.verify(s).ok
        got = plain.load(s)
        assert torch.equal(got["model"]["w"], state(s)["model"]["w"]) and got["step"] == s
    code, out, _ = run(["ls", str(local), "--remote", str(remote), "--json"], capsys)
    assert [c["where"] for c in json.loads(out)["checkpoints"]] == ["both"] * 3 + ["none"]
    # nothing left: exit 0 at once
    code, out, _ = run(["replicate", str(local), str(remote), "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["replicate"] == [] and doc["already"] == [1, 2, 3]


def test_replicate_reports_a_step_that_cannot_be_replicated(
        died: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    local, remote = died
    ckptfs.open(str(remote)).save(3, {"other": torch.ones(2)})  # another step 3 at the remote
    code, out, err = run(["replicate", str(local), str(remote), "--json"], capsys)
    doc = json.loads(out)
    assert code == 1 and not doc["ok"]
    # Never counted as replicated by its marker: queued, and the copy refuses to overwrite it.
    assert doc["replicate"] == [2, 3]
    assert "step 3" in doc["error"] and "different content" in doc["error"]
    assert "never overwritten" in err
    assert {r["step"]: r["state"] for r in doc["steps"]} == {2: "replicated", 3: "failed"}
    remote_store = ckptfs.open(str(remote))
    assert remote_store.steps() == [1, 2, 3] and remote_store.verify(2).ok
    assert "other" in remote_store.load(3)  # never overwritten


def test_replicate_dry_run_says_a_step_differs(died: tuple[Path, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Another checkpoint of step 3 at the remote: the dry run does not list it as already
    there; it says it differs and that replicate would fail it (exit 1, as replicate)."""
    local, remote = died
    ckptfs.open(str(remote)).save(3, {"other": torch.ones(2)})
    code, out, _ = run(["replicate", str(local), str(remote), "--dry-run", "--json"], capsys)
    doc = json.loads(out)
    assert code == 1, doc
    assert doc["replicate"] == [2] and doc["already"] == [1] and doc["differs"] == [3], doc
    code, out, _ = run(["replicate", str(local), str(remote), "--dry-run"], capsys)
    assert code == 1 and "[3] differ" in out and "failed" in out and "[2]" in out, out
    assert "already there (same content): [1]" in out, out
    assert "other" in ckptfs.open(str(remote)).load(3)  # a dry run changes nothing


def test_replicate_times_out_during_an_outage(died: tuple[Path, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    local, _ = died
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"a file where the remote's directory should be")
    code, out, err = run(["replicate", str(local), str(blocker / "run"), "--timeout", "1.5",
                          "--json"], capsys)
    doc = json.loads(out)
    assert code == 1 and not doc["ok"]
    assert "--timeout 1.5 s" in doc["error"] and "run 'ckptfs replicate' again" in doc["error"]
    assert "ckptfs: error:" in err
    assert [r["state"] for r in doc["steps"]] != ["replicated"] * 3


@pytest.mark.parametrize("bad", [["--bytes-per-s", "fast"], ["--bytes-per-s", "-1"],
                                 ["--threads", "0"], ["--timeout", "0"]])
def test_replicate_bad_options(died: tuple[Path, Path], bad: list[str],
                               capsys: pytest.CaptureFixture[str]) -> None:
    local, remote = died
    code, _, err = run(["replicate", str(local), str(remote), *bad], capsys)
    assert code == 2 and bad[0] in err


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry-run"])
def test_replicate_to_itself_refused(died: tuple[Path, Path], dry_run: list[str],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The same run root spelled another way (or one inside the other): exit 2 with the
    reason, no traceback, nothing written."""
    local, _ = died
    before = sorted(p.relative_to(local) for p in local.rglob("*"))
    for remote in (f"file://{local}/", f"{local}/mirror"):
        code, _, err = run(["replicate", str(local), remote, *dry_run], capsys)
        assert code == 2 and "same run root" in err and "Traceback" not in err, err
    assert sorted(p.relative_to(local) for p in local.rglob("*")) == before


def test_ls_remote_same_root_refused(died: tuple[Path, Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``ls LOCAL --remote REMOTE`` with the same root spelled twice (every step would show as
    ``both``) or with a protocol alias (``local://``): exit 2, TierOverlapError, no rows."""
    local, _ = died
    for remote in (f"file://{local}/", f"local://{local}", f"{local}/../{local.name}"):
        code, out, err = run(["ls", str(local), "--remote", remote], capsys)
        assert code == 2 and "same run root" in err and "both" not in out, (remote, out, err)
    code, out, _ = run(["ls", str(local), "--remote", f"file://{local}", "--json"], capsys)
    assert code == 2 and json.loads(out)["error"] == "TierOverlapError"
