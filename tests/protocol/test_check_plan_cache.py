"""The placeholder check of a single-process save (`check_plan`: the manifest it will commit,
checked by every reader limit before a byte is written) runs once per layout in a process: a
run saves the same files at every step.  A layout it refused is checked again each time, a new
layout (other files, sizes, metadata, step width) is checked, and the commit checks every
manifest it commits all the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.errors import UnsupportedValueError
from ckptfs.protocol import commit


def _state(n: int = 4) -> dict[str, Any]:
    return {"model": {f"w{i}": torch.full((8, 8), float(i)) for i in range(n)}, "step": 1}


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each manifest check: "plan" (before writing) or "commit"."""
    monkeypatch.setattr(commit, "_PASSED", {})
    seen: list[str] = []
    real = commit.check_manifest

    def spy(manifest: Any, writer: Any) -> bytes:
        seen.append("commit" if manifest.files[0].digest != commit.placeholder_digest(
            manifest.hash_algorithm) else "plan")
        return real(manifest, writer)

    monkeypatch.setattr(commit, "check_manifest", spy)
    return seen


def test_a_layout_is_checked_once_and_every_commit_is_checked(tmp_path: Any,
                                                              checks: list[str]) -> None:
    store = ckptfs.open(str(tmp_path))
    store.save(1, _state())
    assert checks == ["plan", "commit"]
    checks.clear()
    store.save(2, _state())  # the same layout
    assert checks == ["commit"]
    checks.clear()
    store.save(3, _state(), metadata={"loss": 1.5})  # other metadata
    assert checks == ["plan", "commit"]
    checks.clear()
    store.save(4, _state(5))  # other files
    assert checks == ["plan", "commit"]
    checks.clear()
    store.save(10, _state())  # a wider step number
    assert checks == ["plan", "commit"]


def test_a_refused_layout_is_refused_every_time_before_writing(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, checks: list[str]) -> None:
    real = commit.check_committable

    def refuse(manifest: Any, data: bytes, *, where: str) -> None:
        if manifest.metadata.get("bad"):
            raise UnsupportedValueError(f"{where}: refused (test)")
        real(manifest, data, where=where)

    monkeypatch.setattr(commit, "check_committable", refuse)
    store = ckptfs.open(str(tmp_path))
    for step in (1, 2):
        with pytest.raises(UnsupportedValueError, match="refused"):
            store.save_async(step, _state(), metadata={"bad": True})  # the call itself
        assert checks == ["plan"]
        checks.clear()
    assert not (tmp_path / "checkpoints").exists() or not any(
        (tmp_path / "checkpoints").rglob("*.safetensors"))
    store.close()


def test_the_commit_checks_a_layout_checked_before(tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   checks: list[str]) -> None:
    store = ckptfs.open(str(tmp_path))
    store.save(1, _state())

    def refuse(manifest: Any, data: bytes, *, where: str) -> None:
        raise UnsupportedValueError(f"{where}: refused at commit (test)")

    monkeypatch.setattr(commit, "check_committable", refuse)
    with pytest.raises(UnsupportedValueError, match="refused at commit"):
        store.save(2, _state())
    monkeypatch.undo()
    assert store.latest() is not None and store.latest().step == 1  # type: ignore[union-attr]
    assert store.verify(1).ok
