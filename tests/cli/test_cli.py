"""The core CLI subcommands: ls, latest, verify (each with --json, non-zero exit on failure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.cli.core import main
from ckptfs.format.layout import StepPaths


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    store = ckptfs.open(str(tmp_path / "run"))
    store.save(9, {"w": torch.ones(3)})
    store.save(10, {"w": torch.zeros(3), "trainer": {"step": 10}})
    (tmp_path / "run" / StepPaths(11).dir / "a-20200101T000000Z-0000000011111111").mkdir(
        parents=True)
    return tmp_path / "run"


def test_ls(run_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(run_root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["checkpoints"]
    assert [{k: r[k] for k in ("step", "committed")} for r in rows] == [
        {"step": 9, "committed": True}, {"step": 10, "committed": True},
        {"step": 11, "committed": False}]
    store = ckptfs.open(str(run_root))
    for row in rows[:2]:  # format v1: nothing shared, deleting frees all of its files
        size = store.info(row["step"]).total_bytes
        assert row["bytes"] == row["bytes_written"] == row["exclusive_bytes"] == size
    assert doc["stored_bytes"] == sum(
        p.stat().st_size for s in (9, 10) for p in (run_root / StepPaths(s).dir).rglob("*")
        if p.is_file() and p.name != "COMPLETE")
    assert main(["ls", str(run_root)]) == 0
    out = capsys.readouterr().out
    assert "incomplete" in out and "committed" in out


def test_latest(run_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["latest", str(run_root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["latest"]["step"] == 10
    assert doc["latest"]["hash_algorithm"] == ckptfs.DEFAULT_ALGORITHM


def test_latest_empty_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["latest", str(tmp_path / "empty")]) == 1
    assert "no committed checkpoint" in capsys.readouterr().out


def test_verify_ok_and_corrupt(run_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(run_root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    info = ckptfs.open(str(run_root)).info(9)
    target = run_root / StepPaths(9).file(info.attempt, "tensors-00000.safetensors")
    data = bytearray(target.read_bytes())
    data[-2] ^= 0x40
    target.write_bytes(bytes(data))
    assert main(["verify", str(run_root), "--step", "9", "--quick"]) == 0  # sizes unchanged
    capsys.readouterr()
    assert main(["verify", str(run_root), "--step", "9", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and "tensors-00000.safetensors" in doc["problems"][0]
    (run_root / StepPaths(9).attempt_dir(info.attempt) / "stray.bin").write_bytes(b"x")
    assert main(["verify", str(run_root), "--step", "9", "--quick"]) == 1
    assert "stray" in capsys.readouterr().out


def test_verify_missing_step(run_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(run_root), "--step", "11", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"] == "CheckpointNotFoundError" and "9, 10" in doc["message"]


def test_bad_url_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "nosuch://x"]) == 2
    assert "unknown protocol" in capsys.readouterr().err


def test_console_script_entry_point(run_root: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "ckptfs.cli.core", "latest", str(run_root)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "step 10" in done.stdout
