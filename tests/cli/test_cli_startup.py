"""``ckptfs --version``, ``ckptfs --help`` and the verbs' ``--help`` import neither torch nor the
storage libraries (they took 2 s), and ``import ckptfs`` still gives every public name.
Each check runs in a fresh interpreter, where ``sys.modules`` says what was imported."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

import ckptfs
from ckptfs.cli import core

#: Verbs whose --help still imports torch, each with the reason (none: every verb imports
#: torch and the protocol when it runs).
HEAVY_HELP: dict[str, str] = {}

PROBE = """
import contextlib, io, json, sys
from ckptfs.cli.core import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "fsspec", "s3fs", "gcsfs", "adlfs", "numpy")
               if m in sys.modules)
print(json.dumps({"code": code, "out": out.getvalue(), "heavy": heavy}))
"""


def run_fresh(*argv: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                          timeout=120, check=True)
    doc: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return doc


def all_verbs() -> list[str]:
    parser = core.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


def test_version_and_help_import_no_heavy_module() -> None:
    doc = run_fresh("--version")
    assert doc == {"code": 0, "out": f"ckptfs {ckptfs.__version__}\n", "heavy": []}
    doc = run_fresh("--help")
    assert doc["code"] == 0 and doc["heavy"] == [], doc
    out = str(doc["out"])
    for verb in all_verbs():  # every verb listed with its line, no plug-in imported
        assert f"    {verb} " in out or f"    {verb}\n" in out, verb


@pytest.mark.parametrize("verb", [v for v in all_verbs() if v not in HEAVY_HELP])
def test_a_verbs_help_imports_no_heavy_module(verb: str) -> None:
    doc = run_fresh(verb, "--help")
    assert doc["code"] == 0, doc
    assert f"usage: ckptfs {verb}" in str(doc["out"])
    assert "torch" not in doc["heavy"], (verb, doc["heavy"])


def test_the_listed_help_is_the_verbs_own() -> None:
    """`core.VERB_HELP` (what ``ckptfs --help`` shows without importing a plug-in) is the text
    each plug-in gives its verb, for every plug-in verb."""
    parser = core.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    own = {a.dest: a.help for a in sub._choices_actions}
    plugin_verbs = [v for _, verbs, _ in core._PLUGINS for v in verbs]
    assert sorted(core.VERB_HELP) == sorted(plugin_verbs)
    for verb in plugin_verbs:
        assert core.VERB_HELP[verb] == own[verb], verb


def test_a_verb_runs_with_its_plugin_loaded(tmp_path: object,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Only the verb's own plug-in is imported when it runs; options and errors are the
    verb's own (a stub never answers for a real verb)."""
    assert core.main(["gc", str(tmp_path), "--older-than", "1h", "--dry-run"]) == 0
    assert "would remove 0 item(s)" in capsys.readouterr().out
    assert core.main(["gc", str(tmp_path), "--older-than", "0s"]) == 2
    assert "is zero" in capsys.readouterr().err
    assert core.main(["-v", "best", str(tmp_path)]) == 1  # an option before the verb


def test_import_ckptfs_gives_every_public_name_lazily() -> None:
    script = """
import sys, ckptfs
assert "torch" not in sys.modules, "import ckptfs imported torch"
missing = [n for n in ckptfs.__all__ if not hasattr(ckptfs, n)]
from ckptfs import open, CheckpointManager, tiered
assert open is ckptfs.open and "torch" in sys.modules
assert set(ckptfs.__all__) <= set(dir(ckptfs))
try:
    ckptfs.no_such_name
except AttributeError as exc:
    assert "no_such_name" in str(exc)
else:
    raise AssertionError("no AttributeError")
print(missing)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
