"""Garbage collection: uncommitted attempts by age, temporary leftovers, orphaned multipart
uploads (moto), dry-run and the report (local and memory, S3 for multipart)."""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone

import pytest
import torch

import ckptfs
from ckptfs.format.layout import StepPaths, new_attempt_name, tmp_attempt_name
from ckptfs.lifecycle.gc import collect, parse_duration
from ckptfs.testing.backend import Backend

HOUR = timedelta(hours=1)


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def ago(hours: float) -> str:
    return new_attempt_name(datetime.now(timezone.utc) - timedelta(hours=hours))


def plant(backend: Backend, step: int, attempt: str, size: int = 50) -> str:
    d = StepPaths(step).attempt_dir(attempt)
    backend.raw_write(f"{d}/state.msgpack", b"s" * size)
    backend.raw_write(f"{d}/tensors-00000.safetensors", b"t" * size)
    return d


def test_old_attempts_removed_young_and_committed_kept(backend: Backend) -> None:
    store = backend.open()
    info = store.save(5, {"x": torch.ones(8)})
    loser = plant(backend, 5, ago(2))  # lost a race long ago, in a committed step
    crashed = plant(backend, 7, ago(5), size=100)  # a crash before the commit
    running = plant(backend, 9, ago(0.1))  # a writer still running
    report = collect(store.storage, older_than=HOUR)
    removed = sorted(i.path for i in report.items if i.removed and i.kind == "attempt")
    assert removed == sorted([loser, crashed])
    assert report.bytes_freed == 100 + 200
    assert running in report.kept_young
    assert backend.raw_exists(f"{running}/state.msgpack")
    assert store.steps() == [5] and store.info(5).attempt == info.attempt
    store.verify(5)
    assert 7 not in backend.open().all_steps() or backend.raw_files(StepPaths(7).dir) == {}


def test_dry_run_reports_without_removing(backend: Backend) -> None:
    store = backend.open()
    old = plant(backend, 3, ago(3))
    report = collect(store.storage, older_than=HOUR, dry_run=True)
    assert [i.path for i in report.items if i.kind == "attempt"] == [old]
    assert report.bytes_found == 100 and report.bytes_freed == 0
    assert not any(i.removed for i in report.items)
    assert backend.raw_exists(f"{old}/state.msgpack")
    assert report.as_dict()["dry_run"] is True


def test_unparseable_marker_step_left_alone(backend: Backend) -> None:
    store = backend.open()
    old = plant(backend, 4, ago(3))
    backend.raw_write(StepPaths(4).marker, b"{not json")
    report = collect(store.storage, older_than=HOUR)
    assert report.items == [] and any("marker does not parse" in s for s in report.skipped)
    assert backend.raw_exists(f"{old}/state.msgpack")


def test_foreign_names_never_deleted(backend: Backend) -> None:
    store = backend.open()
    backend.raw_write(f"{StepPaths(6).dir}/notes.txt", b"mine")
    collect(store.storage, older_than=timedelta(0))
    assert backend.raw_read(f"{StepPaths(6).dir}/notes.txt") == b"mine"


def test_artifact_attempts_collected(backend: Backend) -> None:
    store = backend.open()
    mgr = ckptfs.CheckpointManager(store)
    mgr.artifacts.save("ref", {"w": torch.ones(2)}, descriptor={"v": 1})
    d = f"artifacts/ref/{StepPaths(0).attempt_dir(ago(2))}"
    backend.raw_write(f"{d}/state.msgpack", b"z" * 10)
    report = collect(store.storage, older_than=HOUR)
    assert [i.path for i in report.items if i.removed] == [d]
    assert mgr.artifacts.load("ref")["w"].sum() == 2


def test_local_tmp_leftovers(local_backend: Backend) -> None:
    store = local_backend.open()
    old_tmp = f"{StepPaths(8).dir}/{tmp_attempt_name(ago(2))}"
    young_tmp = f"{StepPaths(8).dir}/{tmp_attempt_name(ago(0))}"
    local_backend.raw_write(f"{old_tmp}/state.msgpack", b"a" * 30)
    local_backend.raw_write(f"{young_tmp}/state.msgpack", b"b" * 30)
    marker_tmp = f"{StepPaths(8).dir}/.tmp-0123456789abcdef0123456789abcdef"
    local_backend.raw_write(marker_tmp, b"c" * 7)
    old = time.time() - 7200
    os.utime(f"{local_backend.raw_root}/{marker_tmp}", (old, old))
    report = collect(store.storage, older_than=HOUR)
    kinds = sorted((i.kind, i.path) for i in report.items if i.removed)
    assert kinds == [("tmp", old_tmp), ("tmp-file", marker_tmp)]
    assert report.bytes_freed == 37
    assert local_backend.raw_exists(f"{young_tmp}/state.msgpack")


def test_local_empty_step_dir_removed(local_backend: Backend) -> None:
    store = local_backend.open()
    plant(local_backend, 11, ago(2))
    report = collect(store.storage, older_than=HOUR)
    assert [i.kind for i in report.items if i.removed] == ["attempt", "empty-step"]
    assert not os.path.exists(f"{local_backend.raw_root}/{StepPaths(11).dir}")
    assert store.all_steps() == []


def test_parse_duration() -> None:
    assert parse_duration("1h") == HOUR
    assert parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration("45") == timedelta(seconds=45)
    assert parse_duration("2d") == timedelta(days=2)
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration("soon")


@pytest.fixture(params=["s3", "ministack"])
def s3_like(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def test_s3_orphaned_multipart_uploads(s3_like: Backend) -> None:
    store = s3_like.open()
    fs = store.storage.fs  # type: ignore[attr-defined]
    bucket, key, _ = fs.split_path(store.storage.root)  # type: ignore[attr-defined]
    mine = f"{key}/checkpoints/step-000000000001/{ago(0)}/tensors-00000.safetensors"
    up = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=mine)
    fs.call_s3("upload_part", Bucket=bucket, Key=mine, UploadId=up["UploadId"], PartNumber=1,
               Body=b"p" * (5 * 1024 * 1024))
    other = fs.call_s3("create_multipart_upload", Bucket=bucket, Key="elsewhere/object")
    young = collect(store.storage, older_than=HOUR)
    assert not any(i.kind == "multipart" for i in young.items)
    assert any(k.startswith("multipart:") for k in young.kept_young)
    later = datetime.now(timezone.utc) + 2 * HOUR
    dry = collect(store.storage, older_than=HOUR, now=later, dry_run=True)
    mp = [i for i in dry.items if i.kind == "multipart"]
    assert len(mp) == 1 and mp[0].bytes == 5 * 1024 * 1024 and not mp[0].removed
    report = collect(store.storage, older_than=HOUR, now=later)
    mp = [i for i in report.items if i.kind == "multipart"]
    assert len(mp) == 1 and mp[0].removed and report.bytes_freed >= 5 * 1024 * 1024
    left = {u["UploadId"] for u in fs.list_multipart_uploads(bucket)}
    assert up["UploadId"] not in left and other["UploadId"] in left


def test_multipart_is_a_capability_not_a_url(memory_backend: Backend) -> None:
    store = memory_backend.open()
    report = collect(store.storage, older_than=timedelta(0))
    assert not hasattr(store.storage.fs, "list_multipart_uploads")  # type: ignore[attr-defined]
    assert report.items == []
