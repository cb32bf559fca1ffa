"""The torch versions ckptfs supports (``ckptfs/torch_versions.py``, docs/installation.md):
the floor pyproject.toml declares is the oldest version the tests run on, single-process
checkpoints work there without the sharded machinery, and below the sharded floor that
machinery is refused with a typed error.  Runs on every tested torch (the torch matrix,
``scripts/run-torch-matrix.sh``, runs it on each)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.errors import CkptfsError
from ckptfs.torch_versions import (
    SHARDED_TORCH_FLOOR,
    TORCH_FLOOR,
    floor_text,
    sharded_supported,
    torch_version,
)

ROOT = Path(__file__).resolve().parents[2]


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _matrix() -> dict[str, list[str]]:
    """The torch matrix's versions: {"all": the default versions, "sharded": those that run
    the sharded test list}."""
    script = (ROOT / "scripts" / "run-torch-matrix.sh").read_text()
    m = re.search(r"^DEFAULT_VERSIONS=\(([^)]*)\)$", script, re.M)
    assert m is not None, "scripts/run-torch-matrix.sh: no DEFAULT_VERSIONS=(...)"
    versions = m.group(1).split()
    return {"all": versions,
            "sharded": [v for v in versions if torch_version(v) >= SHARDED_TORCH_FLOOR]}


def test_declared_floor_is_the_tested_floor() -> None:
    """pyproject's floor is the oldest version CI runs (the matrix's, which .ci/run calls);
    the sharded floor is the oldest version that runs the sharded tests; the docs' table and
    the README list them."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={floor_text(TORCH_FLOOR)},<3"' in pyproject
    matrix = _matrix()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    m = re.search(r"^TORCH_VERSION=\$\{CKPTFS_TORCH_VERSION:-([0-9.]+)\}$", setup, re.M)
    assert m is not None, "scripts/setup.sh: no default TORCH_VERSION"
    tested = sorted({*matrix["all"], m.group(1)}, key=_key)
    assert torch_version(tested[0]) == TORCH_FLOOR, (tested, TORCH_FLOOR)
    assert torch_version(min(matrix["sharded"], key=_key)) == SHARDED_TORCH_FLOOR
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/run-torch-matrix.sh" in ci and "scripts/run-tests.sh" in ci
    table = [line for line in (ROOT / "docs" / "installation.md").read_text().splitlines()
             if line.startswith("| ")]
    for version in tested:
        assert any(line.startswith(f"| {version}") for line in table), (version, table)
    assert any(line.startswith(f"| {floor_text(TORCH_FLOOR)}.") and "floor" in line
               for line in table), table
    assert any(line.startswith(f"| {floor_text(SHARDED_TORCH_FLOOR)}.") and "sharded floor"
               in line for line in table), table
    readme = (ROOT / "README.md").read_text()
    assert f">= {floor_text(TORCH_FLOOR)}" in readme
    assert f">= {floor_text(SHARDED_TORCH_FLOOR)}" in readme
    assert torch_version("2.10.0") > torch_version("2.9.1")  # compared as numbers


_SINGLE = r"""
import sys
import torch
import ckptfs
from ckptfs.protocol.copy import copy_step

def sharded_modules():
    return sorted(m for m in sys.modules
                  if m == "ckptfs.torch_compat" or m.startswith("torch.distributed.checkpoint"))

root = sys.argv[1]
store = ckptfs.open(root + "/run")
state = {"w": torch.arange(6.0).reshape(2, 3), "step": 1, "opt": {"lr": 0.1}}
store.save(1, state)
store.save_async(2, {**state, "step": 2}).result()
assert store.load(2)["step"] == 2 and torch.equal(store.load(1)["w"], state["w"])
assert store.verify(2).ok
inc = ckptfs.open(root + "/inc", incremental=True)
inc.save(1, state)
inc.save(2, state)
assert torch.equal(inc.load(2)["w"], state["w"])
dst = ckptfs.open(root + "/copy")
copy_step(store.storage, dst.storage, 2)
assert dst.load(2)["step"] == 2
mgr = ckptfs.CheckpointManager(root + "/managed")
mgr.save(5)
assert ckptfs.CheckpointManager(root + "/managed").restore_latest() == 6  # the next step
tiers = ckptfs.tiered(root + "/local", root + "/remote")
tiers.save(3, state)
tiers.wait_replicated(3)
print(sharded_modules())  # none of the above needs them, on any torch
# load(into=): on torch >= 2.9 the collective load's entry (DCP imported), below it a world
# of one without them.
into = {"w": torch.zeros(2, 3), "step": 0, "opt": {"lr": 0.0}}
store.load(into=into)
assert torch.equal(into["w"], state["w"]) and into["step"] == 2, into
into = {"w": torch.zeros(2, 3), "step": 0, "opt": {"lr": 0.0}}
inc.load(2, into=into)
assert torch.equal(into["w"], state["w"])
into = {"w": torch.zeros(2, 3), "step": 0, "opt": {"lr": 0.0}}
tiers.load(into=into)
tiers.close()
assert torch.equal(into["w"], state["w"])
print(sharded_modules())
"""


def test_single_process_checkpoints_need_no_sharded_machinery(tmp_path: Path) -> None:
    """Save, async save, load, verify, cp, the manager and a two-tier store in one process
    (v1 and v3): none imports ``ckptfs.torch_compat`` or DCP, so each works on every torch
    from the floor (2.6) up.  ``load(into=)`` of them works on every torch too: below the
    sharded floor without that machinery."""
    out = subprocess.run([sys.executable, "-c", _SINGLE, str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = out.stdout.strip().splitlines()[-2:]
    assert before == "[]", before
    if not sharded_supported():
        assert after == "[]", after


def test_sharded_machinery_needs_its_floor(tmp_path: Path) -> None:
    """Below the sharded floor (2.9) the sharded machinery is refused with
    `TorchCompatError` (an ImportError and a CkptfsError) naming the floor and this torch:
    importing it, ``ckptfs.dcp``, a save with ``layout="ranks"``.  From the floor up it
    imports and saves."""
    store = ckptfs.open(str(tmp_path / "run"), layout="ranks")
    state = {"w": torch.arange(4.0)}
    if sharded_supported():
        torch_compat = importlib.import_module("ckptfs.torch_compat")
        assert torch_compat.MIN_TORCH == SHARDED_TORCH_FLOOR
        assert store.save(1, state).manifest.format_version == 2
        assert torch.equal(store.load(1)["w"], state["w"])
        return
    want = (rf"need torch >= {re.escape(floor_text(SHARDED_TORCH_FLOOR))}"
            rf".*{re.escape(str(torch.__version__))}")
    with pytest.raises(ImportError, match=want) as info:
        importlib.import_module("ckptfs.torch_compat")
    assert type(info.value).__name__ == "TorchCompatError"
    assert isinstance(info.value, CkptfsError)
    with pytest.raises(ImportError, match=want):
        importlib.import_module("ckptfs.dcp")
    with pytest.raises(CkptfsError, match=want):
        store.save(1, state)
    assert store.steps() == []  # nothing committed, nothing left behind
