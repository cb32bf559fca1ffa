"""The demo: a child process SIGKILLed mid-save, resumed in another, bit-identical to an
uninterrupted run (local disk and S3 on moto)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptfs.cli.demo import main
from ckptfs.testing.backend import Backend


def check_output(out: str, kill_at: int) -> None:
    assert f"step {kill_at}: data files and manifest written" in out and "SIGKILL" in out
    assert "killed by signal 9" in out
    assert f"step {kill_at} is incomplete" in out
    assert "parameters at step 119: identical" in out
    assert "DIFFERENT" not in out
    assert out.rstrip().splitlines()[-1].startswith("OK: the resumed run is bit-identical")


def test_demo_local(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    root = str(tmp_path / "demo-run")
    rc = main(["--root", root, "--steps", "120", "--save-every", "20"])
    out = capsys.readouterr().out
    assert rc == 0, out
    check_output(out, kill_at=80)
    assert "losses of the resumed run, steps 61..119: 59/59 identical" in out


def test_demo_s3(s3_backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    opts = [f"-o{k}={v}" for k, v in s3_backend.options.items()]
    old = {k: os.environ.get(k) for k in s3_backend.env}
    os.environ.update(s3_backend.env)
    try:
        rc = main(["--root", s3_backend.url, *opts, "--steps", "120", "--save-every", "20"])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = capsys.readouterr().out
    assert rc == 0, out
    check_output(out, kill_at=80)
    assert "(s3)" in out


def test_demo_module_entry_point(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.run([sys.executable, "-m", "ckptfs.cli.demo", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and "--root" in proc.stdout and "--steps" in proc.stdout
