"""verify(remote=True): compare each file with the object store's own whole-object checksum
from metadata requests alone (docs/remote-verify.md)."""

from __future__ import annotations

import json
import uuid
import zlib

import numpy as np
import pytest
from paths import V1, V3, WritePath, params

import ckptfs
from ckptfs.bench.latest import count_http
from ckptfs.cli.core import EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK, main
from ckptfs.errors import StorageError
from ckptfs.format.layout import StepPaths
from ckptfs.format.manifest import Manifest
from ckptfs.protocol.copy import copy_step
from ckptfs.protocol.store import CheckpointStore
from ckptfs.protocol.tiers import TieredStore
from ckptfs.storage.base import ServerChecksums, Storage, StorageWrapper, StoredChecksum, supports
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.storage.retry import RetryingStorage
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import TransientStorageError
from ckptfs.testing.reliability.common import SWEEP_SHARD_BYTES


class ComputedChecksums(StorageWrapper):
    """``memory://`` as an object store that keeps a CRC32 of every object, computed from the
    bytes it holds (as S3 does when it checks a client's checksum): the write paths' plumbing
    tested without a storage server.  ``lie``: how many answers come back wrong first (a store
    that kept other bytes than were sent)."""

    def __init__(self, inner: Storage, lie: int = 0, fail: int = 0) -> None:
        super().__init__(inner)
        self.lie = lie
        self.fail = fail
        self.asked = 0

    def offers(self, capability: type) -> bool:
        return capability is ServerChecksums or super().offers(capability)

    def checksum_algorithms(self) -> tuple[str, ...]:
        return ("crc32",)

    def server_checksum(self, path: str) -> StoredChecksum | None:
        self.asked += 1
        if self.fail > 0:
            self.fail -= 1
            raise TransientStorageError(f"injected: HEAD {path}")
        crc = zlib.crc32(self.inner.read_bytes(path))
        if self.lie > 0:
            self.lie -= 1
            crc ^= 1
        return StoredChecksum("crc32", f"{crc:08x}")


def _computed(lie: int = 0) -> ComputedChecksums:
    return ComputedChecksums(FsspecStorage(f"memory://rv-{uuid.uuid4().hex[:12]}"), lie)


def _store_on(storage: Storage) -> CheckpointStore:
    return CheckpointStore(storage, threads=1, shard_bytes=SWEEP_SHARD_BYTES)


def _save_twice(path: WritePath, store: CheckpointStore) -> int:
    """Two saves through ``path`` (the second of an incremental path has references)."""
    for step in (1, 2):
        path.save(store, step, path.state(step))
    return 2


WRITERS = ["v1", "v2", "async", "cp", "cp-v2", "v3"]


@pytest.mark.parametrize("path", params(WRITERS))
def test_every_writer_records_the_store_checksums(path: WritePath) -> None:
    """Every write path (v1, the collective v2 save, async, ``ckptfs cp`` of v1 and v2, the
    incremental v3 save) records each file's store checksum in its manifest, and a remote
    verify then matches every file."""
    storage = _computed()
    store = _store_on(storage)
    step = _save_twice(path, store)
    info = store.info(step)
    assert info.manifest.files
    for f in info.manifest.files:
        crc = zlib.crc32(storage.read_bytes(f"{info.path}/{f.path}"))
        assert dict(f.store_checksums) == {"crc32": f"{crc:08x}"}, f.path
    report = store.verify(step, remote=True)
    assert report.complete, report.as_dict()
    assert report.count("match") == len(info.manifest.files)


def test_copy_of_an_incremental_checkpoint_records_the_destination_checksums() -> None:
    """``ckptfs cp`` of a v3 checkpoint with references (materialized at the destination) and
    of one whose destination already holds its tensors (referenced there): every file the
    copy wrote carries the destination's checksum."""
    src = _store_on(FsspecStorage(f"memory://rv-src-{uuid.uuid4().hex[:12]}"))
    _save_twice(V3, src)
    assert src.info(2).manifest.references  # type: ignore[attr-defined]
    dst = _store_on(_computed())
    for step in (2, 1):  # step 2 first: materialized; then step 1
        res = copy_step(src.storage, dst.storage, step, threads=1, check_stored=True)
        assert res.status == "copied"
        assert res.server_verified == res.files and res.server_unverified == 0
        report = dst.verify(step, remote=True)
        assert report.complete, report.as_dict()


def test_copy_with_check_stored_refuses_other_stored_bytes() -> None:
    """``check_stored``: a store whose checksum differs from what was sent (it kept other
    bytes) fails the copy with a StorageError before the marker: nothing is committed.
    Without the capability every file is ``not available``, and the copy commits."""
    src = _store_on(FsspecStorage(f"memory://rv-src-{uuid.uuid4().hex[:12]}"))
    V1.save(src, 1, V1.state(1))
    lying = _computed(lie=1)
    with pytest.raises(StorageError, match="other bytes than were written"):
        copy_step(src.storage, lying, 1, threads=1, check_stored=True)
    assert not lying.exists(StepPaths(1).marker)
    assert [e.name for e in lying.list_tree("checkpoints")] == []
    res = copy_step(src.storage, lying, 1, threads=1, check_stored=True)
    assert (res.status, res.server_verified) == ("copied", res.files)
    plain = FsspecStorage(f"memory://rv-{uuid.uuid4().hex[:12]}")
    res = copy_step(lying, plain, 1, threads=1, check_stored=True)
    assert (res.server_verified, res.server_unverified) == (0, res.files)
    # The source's checksums describe the source's store: the copy records the destination's.
    assert all(f.store_checksums for f in _store_on(lying).info(1).manifest.files)
    assert not any(f.store_checksums for f in _store_on(plain).info(1).manifest.files)
    assert main(["cp", src.url, f"memory://rv-{uuid.uuid4().hex[:12]}", "--verify-remote",
                 "--quiet"]) == EXIT_OK


def test_replication_checks_the_remote_stored_checksums_before_commit(tmp_path: object) -> None:
    """The replicator copies with ``check_stored``: a remote that kept other bytes means no
    commit and a retry; the step's status says how many files the remote's own checksums
    verified."""
    remote = _computed(lie=1)
    local = CheckpointStore(FsspecStorage(f"memory://rv-local-{uuid.uuid4().hex[:12]}"),
                            threads=1, shard_bytes=SWEEP_SHARD_BYTES)
    store = TieredStore(local, _store_on(remote), retry_base_s=0.01)
    try:
        info = store.save(1, V1.state(1))
        status = store.wait_replicated(timeout=60)
    finally:
        store.close()
    st = status.steps[1]
    assert st.state == "replicated" and st.attempts == 2, st
    assert (st.server_verified, st.server_unverified) == (len(info.manifest.files), 0)
    assert _store_on(remote).verify(1, remote=True).complete


def test_the_retry_layer_retries_server_checksum() -> None:
    """``server_checksum`` is a read: the retrying wrapper repeats it on a transient error."""
    flaky = ComputedChecksums(FsspecStorage(f"memory://rv-{uuid.uuid4().hex[:12]}"), fail=2)
    r = RetryingStorage(flaky, attempts=3, base_delay=0, max_delay=0)
    r.write_bytes("a", b"abc")
    assert r.server_checksum("a") == StoredChecksum("crc32", f"{zlib.crc32(b'abc'):08x}")
    assert (flaky.asked, r.retries) == (3, 2)


@pytest.mark.parametrize("path", params(["v2", "cp", "v3"]))
def test_s3_writers_record_checksums_that_match(path: WritePath, s3_backend: Backend) -> None:
    """The same on moto S3, through the real adapter (files below the part size)."""
    store = _open(s3_backend)
    step = _save_twice(path, store)
    report = store.verify(step, remote=True)
    assert report.complete, report.as_dict()


def _state() -> dict[str, object]:
    # Several small tensors: each shard below the 8 MiB part size goes up in one PutObject.
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal(200_000).astype(np.float32),
            "b": rng.standard_normal(1000).astype(np.float32), "step": 3}


def _open(backend: Backend) -> ckptfs.CheckpointStore:
    return ckptfs.open(backend.url, **backend.options)


def test_s3_fresh_save_verifies_remotely_without_reading_data(s3_backend: Backend) -> None:
    store = _open(s3_backend)
    info = store.save(3, _state())
    assert all(dict(f.store_checksums).keys() == {"crc32"} for f in info.manifest.files)
    # Older readers ignore the key: it is an ordinary optional key of each file entry.
    raw = json.loads(store.storage.read_bytes(f"{info.path}/MANIFEST.json"))
    assert all(set(f["store_checksums"]) == {"crc32"} for f in raw["files"])
    with count_http(_fsspec(store).fs) as calls:
        report = store.verify(3, remote=True)
    assert report.ok and report.complete, report.as_dict()
    assert report.count("match") == len(info.manifest.files)
    # Metadata only: the marker and manifest the resolver reads, one listing, one HEAD per
    # file; not one GetObject of a data file.
    assert calls.get("HeadObject", 0) == len(info.manifest.files)
    data_gets = calls.get("GetObject", 0)
    assert data_gets <= 2, calls  # COMPLETE and MANIFEST.json only
    assert report.requests == 1 + len(info.manifest.files)


def test_s3_object_overwritten_behind_ckptfs_is_a_mismatch(s3_backend: Backend) -> None:
    store = _open(s3_backend)
    info = store.save(3, _state())
    victim = info.manifest.files[0]
    path = f"{info.path}/{victim.path}"
    data = bytearray(store.storage.read_bytes(path))
    data[len(data) // 2] ^= 0xFF  # same size: a listing cannot see it
    store.storage.write_bytes(path, bytes(data))
    with pytest.raises(ckptfs.RemoteChecksumMismatchError) as exc:
        store.verify(3, remote=True)
    assert victim.path in str(exc.value)
    assert exc.value.report.count("mismatch") == 1  # type: ignore[attr-defined]
    assert main(["verify", s3_backend.url, "--remote", "--json", *_cli_opts(s3_backend)]) \
        == EXIT_FAILED


def test_s3_multipart_object_has_a_full_object_crc32(s3_backend: Backend) -> None:
    """A file above the 8 MiB part size goes up as a multi-part upload that asks S3 for a
    full-object CRC32 (``S3FullObjectCrc32``): it matches, and an overwrite behind ckptfs's
    back with the same size is a mismatch."""
    store = _open(s3_backend)
    big = np.arange(5 * 2**20, dtype=np.float32)  # 20 MiB: three parts
    info = store.save(1, {"big": big})
    with count_http(_fsspec(store).fs) as calls:
        report = store.verify(1, remote=True)
    assert report.complete, report.as_dict()
    assert calls.get("GetObject", 0) <= 2 and calls.get("HeadObject", 0) == len(info.manifest.files)
    entry = max(info.manifest.files, key=lambda f: f.size)
    assert entry.size > 16 * 2**20
    head = _fsspec(store).fs.call_s3("head_object", Bucket=s3_backend.url.split("/")[2],
                                     Key=f"{_fsspec(store).full(info.path)}/{entry.path}"
                                     .split("/", 1)[1], ChecksumMode="ENABLED")
    assert head["ChecksumType"] == "FULL_OBJECT", head
    path = f"{info.path}/{entry.path}"
    data = bytearray(store.storage.read_bytes(path))
    data[-1] ^= 1
    store.storage.write_bytes(path, bytes(data))
    with pytest.raises(ckptfs.RemoteChecksumMismatchError, match=entry.path):
        store.verify(1, remote=True)


def test_s3_multipart_without_full_object_checksums_is_not_available(s3_backend: Backend
                                                                     ) -> None:
    """``full_object_checksums=False`` (for S3-compatible servers that refuse them): a
    multi-part object has no comparable checksum: ``not available``, never a pass."""
    opts = {**s3_backend.options, "full_object_checksums": False}
    store = ckptfs.open(s3_backend.url, **opts)
    store.save(1, {"big": np.arange(3 * 2**20, dtype=np.float32)})  # 12 MiB: two parts
    report = store.verify(1, remote=True)
    assert report.ok and not report.complete
    assert report.count("not available") >= 1
    assert main(["verify", s3_backend.url, "--remote", "-o", "full_object_checksums=false",
                 *_cli_opts(s3_backend)]) == EXIT_INCOMPLETE


@pytest.mark.xfail(strict=True, raises=ckptfs.StorageError,
                   reason="ministack refuses a correct FULL_OBJECT CRC32 on "
                   "CompleteMultipartUpload ('The CRC32 you specified did not match the "
                   "calculated checksum'); a user of such a server opens it with "
                   "full_object_checksums=False (no other ministack test writes a multi-part "
                   "object)")
def test_ministack_full_object_crc32(ministack_backend: Backend) -> None:
    store = ckptfs.open(ministack_backend.url, retries=0, **ministack_backend.options)
    store.save(1, {"big": np.arange(3 * 2**20, dtype=np.float32)})
    assert store.verify(1, remote=True).complete


def test_gcs_fresh_save_and_overwrite(gcs_backend: Backend) -> None:
    store = _open(gcs_backend)
    big = np.arange(3 * 2**20, dtype=np.float32)  # resumable upload: crc32c kept as well
    info = store.save(2, {**_state(), "big": big})
    report = store.verify(2, remote=True)
    assert report.complete, report.as_dict()
    assert {f.detail.split()[0] for f in report.files} == {"crc32c"}
    path = f"{info.path}/{info.manifest.files[-1].path}"
    data = bytearray(store.storage.read_bytes(path))
    data[0] ^= 1
    store.storage.write_bytes(path, bytes(data))
    with pytest.raises(ckptfs.RemoteChecksumMismatchError):
        store.verify(2, remote=True)


@pytest.mark.parametrize("name", ["local", "memory", "azure"])
def test_backends_without_server_checksums_report_not_available(
        name: str, request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{name}_backend")
    store = _open(backend)
    assert not supports(store.storage, ServerChecksums)
    info = store.save(1, _state())
    assert all(not f.store_checksums for f in info.manifest.files)
    report = store.verify(1, remote=True)
    assert report.ok and not report.complete
    assert report.count("not available") == len(info.manifest.files)
    assert report.count("match") == 0


def test_old_manifest_without_key_reads_and_reports_not_available(s3_backend: Backend) -> None:
    """A manifest written before the key existed is byte-for-byte the old format; the key
    decodes round-trip and a malformed value is a corrupt manifest."""
    store = _open(s3_backend)
    info = store.save(1, _state())
    doc = json.loads(info.manifest.to_bytes())
    for f in doc["files"]:
        f.pop("store_checksums")
    old = Manifest.from_bytes(json.dumps(doc).encode())
    assert all(not f.store_checksums for f in old.files)
    assert Manifest.from_bytes(info.manifest.to_bytes()) == info.manifest
    doc["files"][0]["store_checksums"] = {"crc32": "xyz"}
    with pytest.raises(ckptfs.CorruptCheckpointError):
        Manifest.from_bytes(json.dumps(doc).encode())
    doc["files"][0]["store_checksums"] = {"sha-9000": "whatever"}  # a newer writer's: ignored
    assert not Manifest.from_bytes(json.dumps(doc).encode()).files[0].store_checksums


def _fsspec(store: ckptfs.CheckpointStore) -> FsspecStorage:
    s = store.storage
    while not isinstance(s, FsspecStorage):
        assert isinstance(s, StorageWrapper)
        s = s.inner
    return s


def _cli_opts(backend: Backend) -> list[str]:
    out = []
    for key, value in backend.options.items():
        out += ["-o", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return out


def test_exit_codes_are_distinct() -> None:
    assert len({EXIT_OK, EXIT_FAILED, EXIT_INCOMPLETE}) == 3


@pytest.mark.parametrize("name", ["memory", "s3"])
def test_remote_verify_reports_a_stray_object_as_full_verify_does(
        name: str, request: pytest.FixtureRequest) -> None:
    """An object in the attempt the manifest does not list: a full verify reports it, and so
    does ``verify --remote`` (the same listing checks), as a mismatch; the CLI exits 1."""
    backend: Backend = request.getfixturevalue(f"{name}_backend")
    store = _open(backend)
    info = store.save(1, _state())
    assert store.verify(1, remote=True).ok
    store.storage.write_bytes(f"{info.path}/notes.txt", b"hello")
    with pytest.raises(ckptfs.CorruptCheckpointError, match=r"notes\.txt: not in the manifest"):
        store.verify(1)
    with pytest.raises(ckptfs.RemoteChecksumMismatchError,
                       match=r"notes\.txt: not in the manifest \(stray file\)") as ei:
        store.verify(1, remote=True)
    report = ei.value.report  # type: ignore[attr-defined]
    assert [f.path for f in report.files if f.status == "mismatch"] == ["notes.txt"]
    if not backend.options:  # the CLI opens the URL alone
        assert main(["verify", backend.url, "--remote", "--step", "1"]) == EXIT_FAILED
