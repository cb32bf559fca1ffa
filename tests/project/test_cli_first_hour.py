"""What a new user of the ``ckptfs`` command hits first (docs/cli.md): an empty or mistyped
location, a mistyped verb or flag, what ``verify`` says of an incremental step, ``cp --all``
over a run with one unreadable step, and a verb whose optional dependency is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.cli import core
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



# -- ls of nothing, and a bucket without a scheme ------------------------------------------------


def test_ls_of_a_path_where_nothing_is(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["ls", str(tmp_path / "no" / "such")], capsys)
    assert code == 1 and "nothing at" in out and "no such directory" in out
    assert "did you mean" not in out  # an absolute path is never taken for a bucket
    code, out, _ = run(["ls", str(tmp_path / "no"), "--json"], capsys)
    assert code == 1 and json.loads(out)["exists"] is False
    (tmp_path / "empty").mkdir()
    code, out, _ = run(["ls", str(tmp_path / "empty")], capsys)
    assert code == 0 and "no checkpoints at" in out  # there, and empty: not a failure
    code, out, _ = run(["ls", "memory://nothing-here/at-all"], capsys)
    assert code == 1 and "nothing at memory://nothing-here/at-all" in out


def test_a_bucket_path_without_a_scheme_says_what_was_meant(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["ls", "mybucket/runs/x"], capsys)
    assert code == 1 and "nothing at mybucket/runs/x" in out
    assert "did you mean s3://mybucket/runs/x" in out
    code, out, _ = run(["ls", "mybucket/runs/x", "--json"], capsys)
    assert "s3://mybucket/runs/x" in json.loads(out)["hint"]
    for argv in (["verify", "mybucket/runs/x"], ["inspect", "mybucket/runs/x"],
                 ["export", "mybucket/runs/x", "out.pt"], ["cp", "mybucket/runs/x", "there"],
                 ["latest", "mybucket/runs/x"]):
        code, out, err = run(argv, capsys)
        assert code == 1 and "did you mean s3://mybucket/runs/x" in out + err, (argv, err)
    (tmp_path / "mybucket").mkdir()  # a local directory of that name: it is a local path
    code, out, _ = run(["ls", "mybucket/runs/x"], capsys)
    assert code == 1 and "nothing at" in out and "did you mean" not in out


# -- mistyped verbs and options ----------------------------------------------------------------


def test_a_mistyped_verb_or_option_suggests_close_matches(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["lss", str(tmp_path)], capsys)
    assert code == 2 and "did you mean 'ls'" in err
    code, _, err = run(["ls", str(tmp_path), "--jsn"], capsys)
    assert code == 2 and "usage: ckptfs ls" in err  # the verb's usage, not the top level's
    assert "unrecognized arguments: --jsn (did you mean --json?)" in err
    code, _, err = run(["verify", str(tmp_path), "--quik"], capsys)
    assert code == 2 and "did you mean --quick?" in err
    code, _, err = run(["bench", "hsh"], capsys)
    assert code == 2 and "did you mean 'hash'" in err
    code, _, err = run(["bench", "hash", "--hash-sise", "1"], capsys)
    assert code == 2 and "usage: ckptfs bench hash" in err and "--hash-size?" in err
    code, _, err = run(["ls", str(tmp_path), "--zzzzzz"], capsys)
    assert code == 2 and "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


# -- references: verify, verify --remote, inspect --------------------------------------------


@pytest.fixture
def incremental_run(tmp_path: Path) -> tuple[Path, int]:
    store = ckptfs.open(str(tmp_path / "run"), incremental=True)
    big = torch.randn(128, 128)
    store.save(1, {"big": big, "small": torch.zeros(4)})
    store.save(2, {"big": big, "small": torch.ones(4)})
    refs = store.info(2).manifest.references
    assert len(refs) == 1 and refs[0].step == 1
    return tmp_path / "run", sum(c.length for c in refs[0].chunks)


def test_verify_of_an_incremental_step_reports_the_referenced_bytes(
        incremental_run: tuple[Path, int], capsys: pytest.CaptureFixture[str]) -> None:
    root, ref_bytes = incremental_run
    own = ckptfs.open(str(root)).info(2).manifest.total_bytes
    code, out, _ = run(["verify", str(root)], capsys)
    assert code == 0
    assert (f"its own 2 files, {own} bytes; 1 referenced file(s) of earlier checkpoints, "
            f"{ref_bytes} bytes used of them, re-read and re-hashed") in out
    code, out, _ = run(["verify", str(root), "--quick"], capsys)
    assert code == 0 and "present with their sizes" in out
    code, out, _ = run(["verify", str(root), "--json"], capsys)
    doc = json.loads(out)
    assert (doc["files"], doc["bytes"]) == (2, own)
    assert (doc["referenced_files"], doc["referenced_bytes"]) == (1, ref_bytes)
    code, out, _ = run(["verify", str(root), "--step", "1"], capsys)
    assert code == 0 and "referenced" not in out  # a full checkpoint references nothing


def test_verify_remote_and_inspect_say_how_they_treat_references(
        incremental_run: tuple[Path, int], capsys: pytest.CaptureFixture[str]) -> None:
    root, ref_bytes = incremental_run
    code, out, _ = run(["verify", str(root), "--remote"], capsys)
    assert code == 3  # local disk keeps no whole-object checksum
    assert ("1 referenced file(s) of earlier checkpoints not checked here: run verify "
            "--remote --step N for step(s) 1") in out
    code, out, _ = run(["verify", str(root), "--remote", "--json"], capsys)
    assert json.loads(out)["referenced_steps"] == [1]
    code, out, _ = run(["inspect", str(root)], capsys)
    assert code == 0
    assert "references: 1 file(s) of earlier checkpoints, checked like its own" in out
    assert f"step 1 tensors-00000.safetensors  {ref_bytes} B used" in out
    code, out, _ = run(["inspect", str(root), "--json"], capsys)
    (ref,) = json.loads(out)["references"]
    assert (ref["step"], ref["bytes"]) == (1, ref_bytes)


# -- a verb whose optional dependency is not installed ------------------------------------------


def test_a_plugin_whose_dependency_is_missing_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "needs_extra_plugin.py").write_text("import ckptfs_test_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(core, "_PLUGINS",
                        (*core._PLUGINS, ("needs_extra_plugin", ("fancy",), "bench")))
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "fancy" in out  # listed; --help imports no plug-in (not torch)
    code, out, _ = run(["ls", str(tmp_path)], capsys)
    assert code == 0  # every other verb works
    code, _, err = run(["fancy", "--some", "args"], capsys)
    assert code == 2
    assert ('ckptfs fancy: it needs ckptfs_test_absent_dependency, which is not installed: '
            'pip install "ckptfs[bench]"') in err
    code, out, _ = run(["fancy", "--help"], capsys)
    assert code == 0 and 'pip install "ckptfs[bench]"' in out
    # ckptfs's own module missing is a packaging bug: never turned into a placeholder verb
    monkeypatch.setattr(core, "_PLUGINS", (("ckptfs.cli.no_such_module", ("x",), None),))
    with pytest.raises(ModuleNotFoundError):
        core.build_parser()
