"""Empty step directories: a failed save on local disk leaves none, and ``gc``
collects one that an earlier crashed save left, once it is older than the grace, never the
directory a writer is using right now."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ckptfs.cli.core import main
from ckptfs.format.layout import StepPaths, new_attempt_name
from ckptfs.lifecycle.gc import collect
from ckptfs.protocol.commit import Attempt
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.testing.backend import Backend

HOUR = timedelta(hours=1)


def fail_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(self: Attempt, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Attempt, "write_files", full_disk)


def step_dir(backend: Backend, step: int) -> Path:
    return Path(backend.raw_root) / StepPaths(step).dir


def age_dir(path: Path, hours: float) -> None:
    stale = time.time() - hours * 3600
    os.utime(path, (stale, stale))


def test_a_failed_save_leaves_no_step_directory(
        local_backend: Backend, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    store = local_backend.open()
    store.save(1, {"w": torch.ones(4)})
    with monkeypatch.context() as m:
        fail_writes(m)
        with pytest.raises(OSError, match="No space left"):
            store.save(2, {"w": torch.ones(4)})
    assert not step_dir(local_backend, 2).exists()
    assert store.all_steps() == [1] and store.steps() == [1]
    assert main(["ls", local_backend.url]) == 0
    assert "incomplete" not in capsys.readouterr().out
    store.save(2, {"w": torch.zeros(4)})  # the step can be saved afterwards
    assert store.steps() == [1, 2]


def test_a_failed_save_keeps_another_writers_attempt_of_the_step(
        local_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The failed writer's ``rmdir`` of the step directory never takes what another writer of
    the same step has in it."""
    store = local_backend.open()
    other = f"{StepPaths(3).attempt_dir(new_attempt_name())}/state.msgpack"
    local_backend.raw_write(other, b"being written")
    fail_writes(monkeypatch)
    with pytest.raises(OSError):
        store.save(3, {"w": torch.ones(4)})
    assert local_backend.raw_read(other) == b"being written"
    assert [p.name for p in step_dir(local_backend, 3).iterdir()] == [other.split("/")[-2]]


def test_gc_collects_an_old_empty_step_directory(local_backend: Backend) -> None:
    store = local_backend.open()
    store.save(1, {"w": torch.ones(4)})
    crashed, running = step_dir(local_backend, 5), step_dir(local_backend, 6)
    crashed.mkdir()
    running.mkdir()  # a writer made it a moment ago and is about to make its attempt
    age_dir(crashed, 3)
    dry = collect(store.storage, older_than=HOUR, dry_run=True)
    assert [(i.kind, i.path, i.removed) for i in dry.items] == [
        ("empty-step", StepPaths(5).dir, False)]
    assert crashed.exists()
    report = collect(store.storage, older_than=HOUR)
    assert [(i.kind, i.path, i.removed) for i in report.items] == [
        ("empty-step", StepPaths(5).dir, True)]
    age = report.items[0].age_s
    assert age is not None and 3 * 3600 - 60 < age < 3 * 3600 + 600
    assert StepPaths(6).dir in report.kept_young
    assert not crashed.exists() and running.exists()
    assert store.all_steps() == [1, 6] and store.steps() == [1]
    store.verify(1)


def test_gc_never_removes_what_a_writer_put_in_an_old_empty_step(
        local_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listed as empty and old, but a writer starts its attempt in it between gc's listing
    and its removal: the non-recursive ``rmdir`` fails, gc says why, the attempt survives."""
    store = local_backend.open()
    d = step_dir(local_backend, 7)
    d.mkdir(parents=True)
    age_dir(d, 3)
    attempt = f"{StepPaths(7).attempt_dir(new_attempt_name())}/state.msgpack"
    rmdir = FsspecStorage.remove_empty_dir

    def writer_first(self: FsspecStorage, path: str) -> bool:
        local_backend.raw_write(attempt, b"x")  # the writer wins the race
        return rmdir(self, path)

    monkeypatch.setattr(FsspecStorage, "remove_empty_dir", writer_first)
    report = collect(store.storage, older_than=HOUR)
    (item,) = [i for i in report.items if i.kind == "empty-step"]
    assert not item.removed and item.error is None
    assert "not empty any more" in str(item.note)
    assert local_backend.raw_read(attempt) == b"x"


def test_cli_gc_removes_the_empty_step_and_ls_no_longer_lists_it(
        local_backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    store = local_backend.open()
    store.save(1, {"w": torch.ones(4)})
    d = step_dir(local_backend, 9)
    d.mkdir()
    age_dir(d, 2)
    assert main(["ls", local_backend.url]) == 0
    assert "9  incomplete" in capsys.readouterr().out
    assert main(["gc", local_backend.url, "--older-than", "1h"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 item(s)" in out and "empty-step" in out and StepPaths(9).dir in out
    assert main(["ls", local_backend.url]) == 0
    assert "incomplete" not in capsys.readouterr().out
