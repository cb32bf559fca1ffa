"""docs/protocol.md is normative: its by-hand checker (plain json/msgpack/hashlib/safetensors,
no ckptfs) must accept what ckptfs writes and reject what ckptfs would reject."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.format.layout import StepPaths

SPEC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def checker_source() -> str:
    text = SPEC.read_text()
    m = re.search(r"<!-- by-hand-checker -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/protocol.md lost its by-hand checker"
    return m.group(1)


def run_checker(tmp_path: Path, root: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "check_by_hand.py"
    script.write_text(checker_source())
    return subprocess.run([sys.executable, str(script), str(root)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("algorithm", ["sha256", "blake3", "xxh3-128", "crc32c"])
def test_by_hand_checker_accepts_ckptfs_output(tmp_path: Path, algorithm: str) -> None:
    root = tmp_path / "run"
    store = ckptfs.open(str(root), algorithm=algorithm)
    model = torch.nn.Linear(3, 2)
    store.save(10, {"model": model.state_dict(), "trainer": {"step": 10}})
    store.save(20, {"model": model.state_dict(), "b": torch.ones(2, dtype=torch.bfloat16),
                    "trainer": {"step": 20, 0: (1, 2)}})
    # An incomplete newer attempt is skipped by the checker as by ckptfs.
    (root / "checkpoints" / "step-000000000030" / "a-20260101T000000Z-0000000000000000").mkdir(
        parents=True)
    done = run_checker(tmp_path, root)
    assert done.returncode == 0, done.stderr
    assert "step 20: committed, 2 files verified, 3 tensors" in done.stdout


def test_by_hand_checker_rejects_tampering(tmp_path: Path) -> None:
    root = tmp_path / "run"
    info = ckptfs.open(str(root)).save(5, {"w": torch.arange(10.0)})
    path = root / StepPaths(5).file(info.attempt, "tensors-00000.safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    done = run_checker(tmp_path, root)
    assert done.returncode != 0 and "tensors-00000.safetensors" in done.stderr


def test_marker_fields_match_spec(tmp_path: Path) -> None:
    info = ckptfs.open(str(tmp_path)).save(7, {"x": torch.zeros(1)})
    marker = json.loads((tmp_path / StepPaths(7).marker).read_bytes())
    assert set(marker) == {"schema", "format_version", "step", "attempt", "manifest",
                           "manifest_digest", "manifest_size", "created", "writer"}
    assert marker["attempt"] == info.attempt and marker["step"] == 7
    assert marker["manifest_digest"].startswith("sha256:")  # whatever the files use
    manifest = json.loads((tmp_path / StepPaths(7).manifest(info.attempt)).read_bytes())
    assert set(manifest) == {"schema", "format_version", "step", "attempt", "created",
                             "hash_algorithm", "files", "metadata"}
    assert all(set(f) == {"path", "size", "digest", "algorithm"} for f in manifest["files"])
