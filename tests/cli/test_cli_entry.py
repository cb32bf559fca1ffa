"""The command's entry points: ``ckptfs --version`` and ``python -m ckptfs``."""

from __future__ import annotations

import subprocess
import sys

import ckptfs


def test_version_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "ckptfs.cli", "--version"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"ckptfs {ckptfs.__version__}"


def test_python_dash_m_ckptfs_runs_the_command() -> None:
    out = subprocess.run([sys.executable, "-m", "ckptfs", "--help"],
                         capture_output=True, text=True, check=True)
    assert "usage: ckptfs" in out.stdout
    for verb in ("ls", "verify", "cp", "inspect"):
        assert verb in out.stdout
