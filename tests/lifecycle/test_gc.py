"""Garbage collection: uncommitted attempts by age, temporary leftovers, orphaned multipart
uploads (moto), dry-run and the report (local and memory, S3 for multipart)."""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager
from datetime import datetime, timedelta, timezone
from typing import BinaryIO, cast

import pytest
import torch

import ckptfs
from ckptfs.format.layout import StepPaths, new_attempt_name, tmp_attempt_name
from ckptfs.lifecycle.gc import collect, parse_duration
from ckptfs.storage.base import (
    EmptyDirRemoval,
    Entry,
    ModifiedTimes,
    MultipartUploads,
    Storage,
    supports,
)
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
    fs = s3_like.raw_fs  # the backdoor: uploads planted and checked beside ckptfs
    bucket, key, _ = fs.split_path(s3_like.raw_root)
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


def test_multipart_is_a_capability_not_a_url(memory_backend: Backend,
                                             s3_backend: Backend) -> None:
    """GC asks the storage interface (``supports(storage, MultipartUploads)``), and the adapter
    decides from what its filesystem object can do: s3fs can list and abort uploads, the
    memory filesystem cannot."""
    store = memory_backend.open()
    report = collect(store.storage, older_than=timedelta(0))
    assert not supports(store.storage, MultipartUploads)
    assert not hasattr(memory_backend.raw_fs, "list_multipart_uploads")
    assert report.items == []
    assert supports(s3_backend.open().storage, MultipartUploads)


def test_upload_aborted_by_another_process_is_a_note(s3_backend: Backend) -> None:
    """An upload that is gone when GC aborts it (another gc aborted it, or it completed):
    ``NoSuchUpload`` is noted, not reported as a failure."""
    store = s3_backend.open()
    fs = s3_backend.raw_fs
    bucket, key, _ = fs.split_path(s3_backend.raw_root)
    mine = f"{key}/checkpoints/step-000000000001/{ago(3)}/tensors-00000.safetensors"
    up = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=mine)
    storage = cast(MultipartUploads, store.storage)
    pending = [u for u in storage.list_uploads("") if u.upload_id == up["UploadId"]]
    assert [u.path for u in pending] == [mine[len(key) + 1:]]
    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=mine, UploadId=up["UploadId"])
    assert storage.abort_upload(pending[0]) is False


class _OnlyTheProtocol:
    """A user's storage wrapper that implements exactly :class:`Storage` and nothing else."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.capabilities = inner.capabilities

    def read_bytes(self, path: str) -> bytes:
        return self.inner.read_bytes(path)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self.inner.open_read(path)

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self.inner.open_write(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self.inner.write_bytes(path, data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.inner.create_exclusive(path, data)

    def list_dir(self, path: str) -> list[Entry]:
        return self.inner.list_dir(path)

    def list_tree(self, path: str) -> list[Entry]:
        return self.inner.list_tree(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def delete_tree(self, path: str) -> None:
        self.inner.delete_tree(path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)

    def rename_dir(self, src: str, dst: str) -> None:
        self.inner.rename_dir(src, dst)

    def sync_dir(self, path: str) -> None:
        self.inner.sync_dir(path)


def test_gc_over_a_storage_without_the_optional_capabilities(local_backend: Backend) -> None:
    """Over a storage with only the :class:`Storage` members, GC still removes old attempts
    (their age is in their name), and leaves alone what it needs a capability for: a
    temporary file of unknown age, and the empty step directory (it says why)."""
    storage = _OnlyTheProtocol(local_backend.open().storage)
    assert not any(supports(storage, c) for c in (ModifiedTimes, EmptyDirRemoval))
    old = plant(local_backend, 12, ago(2))
    marker_tmp = f"{StepPaths(13).dir}/.tmp-0123456789abcdef0123456789abcdef"
    local_backend.raw_write(marker_tmp, b"c" * 7)
    stale = time.time() - 7200
    os.utime(f"{local_backend.raw_root}/{marker_tmp}", (stale, stale))
    report = collect(storage, older_than=HOUR)
    assert [(i.kind, i.path) for i in report.items if i.removed] == [("attempt", old)]
    step = [i for i in report.items if i.kind == "empty-step"]
    assert len(step) == 1 and not step[0].removed and "cannot remove" in str(step[0].note)
    assert any("unknown age" in s for s in report.skipped)
    assert local_backend.raw_exists(marker_tmp)


# -- references into an attempt that may not be referenced: readers and deletes agree ----------


def _as_v1(backend: Backend, store: ckptfs.CheckpointStore, step: int) -> str:
    """Rewrite committed ``step`` (format v3) as a format v1 attempt holding the same files:
    a v1 manifest (whole-file digests) and a marker binding it, by hand.  Returns its path."""
    from ckptfs.format.hashing import digest_bytes
    from ckptfs.format.manifest import MARKER_DIGEST_ALGORITHM, FileEntry, Manifest, Marker

    info = store.info(step)
    algo = info.manifest.hash_algorithm
    entries = tuple(FileEntry(e.path, e.size, digest_bytes(algo, backend.raw_read(
        f"{info.path}/{e.path}"))) for e in info.manifest.files)
    v1 = Manifest(step, info.attempt, entries, info.manifest.created, algo, {})
    data = v1.to_bytes()
    paths = StepPaths(step)
    backend.raw_write(paths.manifest(info.attempt), data)
    marker = Marker(step, info.attempt, digest_bytes(MARKER_DIGEST_ALGORITHM, data), len(data),
                    v1.created, {})
    backend.raw_write(paths.marker, marker.to_bytes())
    assert store.info(step).manifest.format_version == 1
    return info.path


def _frozen(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"base": torch.randn(32, 32, generator=g), "head": torch.full((4,), float(step))}


@pytest.mark.parametrize("target", ["v1", "no-manifest"])
def test_reference_into_an_attempt_that_is_not_shared(backend: Backend, target: str) -> None:
    """A v3 checkpoint whose reference points into a format v1 attempt (or an attempt with no
    MANIFEST.json): a delete or gc frees such an attempt without a reference scan, so a reader
    refuses the reference: load, verify (quick and full) and a delete of that attempt agree
    (the reference is refused; the bytes are then freed, never half-protected)."""
    from ckptfs.errors import CorruptCheckpointError

    store = backend.open(incremental=True)
    store.save(1, _frozen(1))
    info2 = store.save(2, _frozen(2))
    assert info2.manifest.references and info2.manifest.references[0].step == 1  # type: ignore[attr-defined]
    first = _as_v1(backend, store, 1)
    if target == "no-manifest":  # an uncommitted attempt without a manifest
        backend.raw_delete(f"{first}/MANIFEST.json")
        backend.raw_delete(StepPaths(1).marker)
    fresh = backend.open()
    why = "in an attempt whose files may not be referenced"
    with pytest.raises(CorruptCheckpointError, match=why):
        fresh.load(2)
    for quick in (True, False):
        with pytest.raises(CorruptCheckpointError, match=why):
            fresh.verify(2, quick=quick)
    with pytest.raises(CorruptCheckpointError, match=why):
        fresh.load(allow_rollback=False)
    # what the delete side does with such an attempt: frees it, without a scan
    if target == "v1":
        fresh.delete(1)
    else:
        report = collect(fresh.storage, older_than=timedelta(0))
        assert first in [i.path for i in report.items if i.kind == "attempt"]
        assert report.retired == []
    assert not backend.raw_exists(f"{first}/MANIFEST.json")
    with pytest.raises(CorruptCheckpointError):  # refused before as after: no change of answer
        fresh.load(2)


def test_reference_into_a_shared_attempt_still_protected(backend: Backend) -> None:
    """The same layout with the attempt left format v3: loads, and a delete keeps the
    referenced file (retired), which gc keeps too; the rule only refuses what deletes free."""
    store = backend.open(incremental=True)
    store.save(1, _frozen(1))
    store.save(2, _frozen(2))
    first = store.info(1).path
    store.delete(1)
    report = collect(store.storage, older_than=timedelta(0))
    assert [i.path for i in report.retired] == [first]
    got = backend.open().load(2)
    assert all(torch.equal(got[k], v) for k, v in _frozen(2).items())
    backend.open().verify(2)


def test_reference_into_an_attempt_whose_manifest_does_not_decode(backend: Backend) -> None:
    """The third row of the rule: an attempt whose MANIFEST.json does not decode may be a v3
    one, so gc keeps what a committed checkpoint references there (retired), while a reader
    refuses the reference (it cannot tell the file is the attempt's): never a load of bytes a
    delete does not protect, never a delete of bytes a checkpoint may need."""
    from ckptfs.errors import CorruptCheckpointError

    store = backend.open(incremental=True)
    store.save(1, _frozen(1))
    store.save(2, _frozen(2))
    first = store.info(1).path
    backend.raw_write(f"{first}/MANIFEST.json", b"{not json")
    backend.raw_delete(StepPaths(1).marker)
    with pytest.raises(CorruptCheckpointError, match="does not decode"):
        backend.open().load(2)
    report = collect(store.storage, older_than=timedelta(0))
    assert [i.path for i in report.retired] == [first]
    assert backend.raw_exists(f"{first}/MANIFEST.json")
