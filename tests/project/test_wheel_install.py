"""A plain install, as a user gets it: the wheel built from this tree and torch in a clean
virtualenv, with only the wheel's declared dependencies (no test extras: no numpy, no
safetensors).  Every verb's ``--help`` and a save / ls / verify / inspect / cp / export tour run
there, through the installed ``ckptfs`` command.

torch is not installed again (it is large): the clean venv sees this interpreter's torch and
the packages torch itself requires through a ``.pth`` file naming a directory of links to just
those (nothing else of this venv, numpy included, is visible).  The wheel is installed with pip
as a user would, which brings its other dependencies (fsspec, msgpack, blake3, tqdm) from the
configured index or the pip cache.  The venv is built once per test session.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

import ckptfs

ROOT = Path(__file__).resolve().parents[2]
#: What the wheel is built from (a copy: a stale build/ of the tree never leaks into it).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "ckptfs")


def _requirement_closure(name: str) -> dict[str, md.Distribution]:
    """``name``'s installed distribution and those it requires (markers evaluated here, no
    extras), recursively."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, md.Distribution] = {}
    todo = [name]
    while todo:
        key = canonicalize_name(todo.pop())
        if key in seen:
            continue
        dist = md.distribution(key)
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _link_torch(into: Path) -> None:
    """Links to torch and what it requires (their packages and ``.dist-info``), nothing else."""
    into.mkdir()
    for dist in _requirement_closure("torch").values():
        base = Path(str(dist.locate_file("")))
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")
                and not f.parts[0].endswith(".pth")}
        for top in tops:
            if (base / top).exists() and not (into / top).exists():
                (into / top).symlink_to(base / top)


class Venv:
    def __init__(self, root: Path, wheel: Path) -> None:
        self.root, self.wheel = root, wheel
        self.python = root / "bin" / "python"
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
        self.env["PATH"] = f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        self.cwd = root.parent / "work"
        self.cwd.mkdir(exist_ok=True)

    def run(self, argv: Sequence[str], *, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(list(argv), cwd=self.cwd, env=self.env, capture_output=True,
                             text=True, timeout=timeout)
        assert "Traceback" not in out.stderr, (argv, out.stderr)
        if check:
            assert out.returncode == 0, (argv, out.returncode, out.stdout, out.stderr)
        return out

    def ckptfs(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run([str(self.root / "bin" / "ckptfs"), *args], check=check)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    work = tmp_path_factory.mktemp("plain-install")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(work / "dist")], check=True, timeout=300, cwd=work)
    (wheel,) = (work / "dist").glob("ckptfs-*.whl")
    root = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    (site,) = root.glob("lib/python*/site-packages")
    _link_torch(work / "torch-only")
    (site / "torch-only.pth").write_text(f"{work / 'torch-only'}\n")
    installed = subprocess.run([*pip, "--python", str(root / "bin" / "python"), "install", "-q",
                                str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    check = subprocess.run([*pip, "--python", str(root / "bin" / "python"), "check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    return Venv(root, wheel)


def test_the_venv_is_a_plain_install(venv: Venv) -> None:
    """The environment the other tests rely on: no numpy, no extras, ckptfs from the wheel."""
    out = venv.run([str(venv.python), "-c", """
import importlib.util, json, ckptfs, torch
print(json.dumps({"ckptfs": ckptfs.__file__, "torch": torch.__version__,
                  "absent": [m for m in ("numpy", "safetensors", "s3fs", "pytest")
                             if importlib.util.find_spec(m) is None]}))
"""])
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["absent"] == ["numpy", "safetensors", "s3fs", "pytest"]
    assert doc["ckptfs"].startswith(str(venv.root)), doc  # the wheel's copy, not this tree
    assert venv.wheel.name.startswith(f"ckptfs-{ckptfs.__version__}-")


def test_every_verb_shows_its_help(venv: Venv) -> None:
    out = venv.ckptfs("--help")
    assert "usage: ckptfs" in out.stdout
    # Every verb's and bench sub-verb's --help, in one process (each one imports torch).
    script = """
import argparse, contextlib, io, json
from ckptfs.cli.core import build_parser, main

def verbs(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from verbs(sub, (*prefix, name))

result = {}
for verb in verbs(build_parser()):
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        code = main([*verb, "--help"])
    result[" ".join(verb)] = [code, text.getvalue()]
print(json.dumps(result))
"""
    result = json.loads(venv.run([str(venv.python), "-c", script]).stdout.splitlines()[-1])
    top = {"ls", "latest", "verify", "inspect", "cp", "export", "replicate", "prune", "gc",
           "best", "doctor", "bench"}
    assert top <= set(result), sorted(result)
    assert any(v.startswith("bench ") for v in result)  # bench's own sub-verbs
    for verb, (code, text) in result.items():
        assert code == 0, (verb, text)
        assert f"usage: ckptfs {verb}" in text, (verb, text)
        assert "not available" not in text, (verb, text)  # no verb lacks a dependency
        if verb in top - {"bench", "cp"}:
            assert "--json" in text and "-o KEY=VALUE" in text, verb  # as docs/cli.md says
    assert venv.ckptfs("bench", "--help").stdout.startswith("usage: ckptfs bench")


def test_version_and_python_dash_m(venv: Venv) -> None:
    assert venv.ckptfs("--version").stdout.strip() == f"ckptfs {ckptfs.__version__}"
    out = venv.run([str(venv.python), "-m", "ckptfs", "--help"])
    assert "usage: ckptfs" in out.stdout


def test_a_first_tour(venv: Venv) -> None:
    run = venv.cwd / "run"
    venv.run([str(venv.python), "-c", f"""
import ckptfs, torch
store = ckptfs.open({str(run)!r})
for step in (1, 2):
    store.save(step, {{"model": {{"w": torch.full((8, 4), float(step))}}, "step": step}})
print(store.steps())
"""])
    out = venv.ckptfs("ls", str(run))
    assert "1  committed" in out.stdout and "2  committed" in out.stdout
    out = venv.ckptfs("verify", str(run))
    assert out.stdout.startswith("OK: step 2 (full:")
    out = venv.ckptfs("inspect", str(run))
    assert "w: F32 [8, 4]" in out.stdout and "step: 2" in out.stdout
    assert json.loads(venv.ckptfs("latest", str(run), "--json").stdout)["latest"]["step"] == 2
    out = venv.ckptfs("cp", str(run), str(venv.cwd / "copy"), "--all")
    assert "step 1: copied" in out.stdout and "step 2: copied" in out.stdout
    venv.ckptfs("export", str(run), str(venv.cwd / "model.safetensors"), "--key", "model")
    assert (venv.cwd / "model.safetensors").stat().st_size > 8 * 4 * 4
    missing = venv.ckptfs("ls", str(venv.cwd / "nothing"), check=False)
    assert missing.returncode == 1 and "nothing at" in missing.stdout


def test_the_wheel_carries_its_license_and_urls(venv: Venv) -> None:
    import zipfile

    with zipfile.ZipFile(venv.wheel) as whl:
        names = whl.namelist()
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        license_text = whl.read(next(n for n in names if n.endswith("/licenses/LICENSE")))
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
    assert license_text.decode().lstrip().startswith("Apache License")
    for url in ("Homepage", "Documentation", "Changelog", "Issues"):
        assert f"Project-URL: {url}, " in meta
    assert f"Version: {ckptfs.__version__}\n" in meta  # one source: ckptfs.__version__
