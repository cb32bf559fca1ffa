"""What a new user of the ``ckptfs`` command hits first (docs/cli.md): an empty or mistyped
location, a mistyped verb or flag, what ``verify`` says of an incremental step, ``cp --all``
over a run with one unreadable step, and a verb whose optional dependency is missing."""

from __future__ import annotations

import json

import pytest
import torch

from ckptfs.cli.core import main
from ckptfs.format.layout import StepPaths
from ckptfs.testing.backend import Backend


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# -- cp --all ----------------------------------------------------------------------------------


def test_cp_all_copies_the_other_steps_past_an_unreadable_one(
        local_backend: Backend, memory_backend: Backend,
        capsys: pytest.CaptureFixture[str]) -> None:
    src = local_backend.open()
    for s in (1, 2, 3):
        src.save(s, {"w": torch.full((4,), float(s))})
    bad = StepPaths(2).manifest(src.info(2).attempt)
    local_backend.raw_write(bad, b'{"not": "a manifest"')  # the marker's digest no longer binds
    code, out, err = run(["cp", local_backend.url, memory_backend.url, "--all"], capsys)
    assert code == 1
    assert memory_backend.open().steps() == [1, 3]
    assert "step 1: copied" in out and "step 3: copied" in out
    assert "step 2: failed (CorruptCheckpointError)" in out
    assert "FAILED: 1 of 3 step(s) not copied: 2" in out
    assert "step 2:" in err and "Traceback" not in err
    code, out, _ = run(["cp", local_backend.url, memory_backend.sibling().url, "--all",
                        "--json"], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["failed"] == [2]
    assert [r["status"] for r in doc["steps"]] == ["copied", "failed", "copied"]
    assert doc["steps"][1]["error"] == "CorruptCheckpointError"


def test_cp_single_unreadable_step_is_exit_1(local_backend: Backend, memory_backend: Backend,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    src = local_backend.open()
    src.save(1, {"w": torch.ones(2)})
    local_backend.raw_write(StepPaths(1).manifest(src.info(1).attempt), b"{}")
    code, _, err = run(["cp", local_backend.url, memory_backend.url, "--step", "1"], capsys)
    assert code == 1 and "Traceback" not in err
    assert memory_backend.open().steps() == []

