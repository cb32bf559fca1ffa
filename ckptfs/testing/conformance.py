"""The conformance suite every backend passes: base test classes, one per concern.

A backend's test module provides one fixture, ``backend``, returning a fresh
`Backend` per test, and subclasses these classes::

    class TestS3Commit(S3Fixtures, CommitConformance): ...

A known gap of an emulator is marked at that backend's subclass (override the test and mark it
``xfail`` with the reason), never by skipping the backend.  Users can run the suite against
their own bucket the same way.

Storage wrappers have their own check (the end of this module): `check_wrapper` for one
wrapper over one storage, `WrapperConformance` / `LocalWrapperConformance` as
test classes (fixtures ``backend`` and ``case``), and `shipped_wrappers`, the wrappers
ckptfs ships, typed so that mypy checks each is a `Storage`.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, cast

import pytest
import torch

from ckptfs.cli.demo import PauseBeforeCommit
from ckptfs.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidStepError,
    StorageError,
    StorageNotFoundError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format.layout import MANIFEST_NAME, MARKER_NAME, MAX_STEP, StepPaths, step_dir_name
from ckptfs.format.manifest import Manifest, Marker
from ckptfs.protocol.copy import copy_step
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.base import (
    OPTIONAL_CAPABILITIES,
    BatchedSync,
    EmptyDirRemoval,
    LocalFiles,
    ModifiedTimes,
    MultipartUploads,
    RangedRead,
    Retrying,
    ServerChecksums,
    Storage,
    read_range,
    retry_call,
    supports,
)
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.storage.retry import RetryingStorage
from ckptfs.storage.sub import SubStorage
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage
from ckptfs.testing.lifecycle import CrashingStorage


def small_state(seed: int = 0, step: int = 0) -> dict[str, Any]:
    """A small but realistic state: a model, an optimizer after a step, trainer scalars."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8, generator=g)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "trainer": {"step": step, "seed": seed, "loss": 0.5 + seed}}


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_state_equal(a: Any, b: Any, path: str = "") -> None:
    """Structural, bit-exact equality (tensors by dtype, shape and bytes; NaN == NaN)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(_raw_bytes(a), _raw_bytes(b)), path
        return
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (path, a, b)
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, (path, a, b)


def race(writers: int, target: Callable[[int], object]) -> tuple[
        list[int], list[BaseException], list[BaseException]]:
    """Run ``target(i)`` on ``writers`` threads released together by a barrier; return
    (winners, CheckpointExistsError losers, any other error)."""
    wins: list[int] = []
    lost: list[BaseException] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(writers)

    def run(i: int) -> None:
        barrier.wait()
        try:
            target(i)
            wins.append(i)
        except CheckpointExistsError as exc:
            lost.append(exc)
        except BaseException as exc:  # pragma: no cover - reported by the caller's assertion
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wins, lost, errors


def committed_attempt(backend: Backend, step: int) -> str:
    marker = json.loads(backend.raw_read(StepPaths(step).marker))
    return str(marker["attempt"])


class _StreamOnly:
    """A storage seen without ``read_range``: `read_range` streams through it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def read_range_fallback(self, path: str, start: int, length: int) -> bytes:
        return read_range(self, path, start, length)  # type: ignore[arg-type]

    def open_read(self, path: str) -> Any:
        return self._inner.open_read(path)


class StorageConformance:
    """The storage primitives the protocol relies on, through ckptfs's adapter."""

    def test_write_read_list(self, backend: Backend) -> None:
        st = backend.open().storage
        st.write_bytes("a/b/one.bin", b"1" * 10)
        with st.open_write("a/two.bin") as f:
            f.write(b"2" * 5)
            f.write(memoryview(b"3" * 5))
        assert st.read_bytes("a/b/one.bin") == b"1" * 10
        names = {e.name: e.size for e in st.list_tree("a")}
        assert names == {"a/b/one.bin": 10, "a/two.bin": 10}
        top = {e.basename: e.is_dir for e in st.list_dir("a")}
        assert top == {"b": True, "two.bin": False}
        assert backend.raw_read("a/two.bin") == b"2" * 5 + b"3" * 5

    def test_read_range(self, backend: Backend) -> None:
        """Ranged reads (sharded loads read only the chunks a rank needs): exact bytes, short
        at the end, typed when missing; the fallback over ``open_read`` agrees."""
        st = backend.open().storage
        data = bytes(range(256)) * 40
        st.write_bytes("r/data.bin", data)
        for start, length in [(0, 1), (1000, 2345), (len(data) - 7, 7), (17, 0)]:
            assert read_range(st, "r/data.bin", start, length) == data[start:start + length]
            assert _StreamOnly(st).read_range_fallback("r/data.bin", start, length) == \
                data[start:start + length]
        assert read_range(st, "r/data.bin", len(data) - 3, 10) == data[-3:]
        with pytest.raises(FileNotFoundError):
            read_range(st, "r/missing.bin", 0, 4)

    def test_missing_is_typed(self, backend: Backend) -> None:
        st = backend.open().storage
        with pytest.raises(StorageNotFoundError) as ei:
            st.read_bytes("nope/x")
        assert backend.url in str(ei.value)
        assert st.list_dir("nope") == []
        assert st.list_tree("nope") == []
        assert not st.exists("nope/x")
        st.delete("nope/x")
        st.delete_tree("nope")

    def test_create_exclusive(self, backend: Backend) -> None:
        st = backend.open().storage
        st.create_exclusive("m/COMPLETE", b"first")
        with pytest.raises(CheckpointExistsError):
            st.create_exclusive("m/COMPLETE", b"second")
        assert backend.raw_read("m/COMPLETE") == b"first"

    def test_create_exclusive_race(self, backend: Backend) -> None:
        st = backend.open().storage
        wins, _, errors = race(8, lambda i: st.create_exclusive("race/COMPLETE",
                                                                f"writer-{i}".encode()))
        assert not errors, errors
        assert len(wins) == 1, wins
        assert backend.raw_read("race/COMPLETE") == f"writer-{wins[0]}".encode()

    def test_create_exclusive_refuses_empty_data(self, backend: Backend) -> None:
        """An empty create-only write is an unconditional overwrite on s3fs (``touch``): the
        adapter refuses it on every backend, before any request, so it cannot creep in."""
        st = backend.open().storage
        st.create_exclusive("e/COMPLETE", b"kept")
        with pytest.raises(ValueError):
            st.create_exclusive("e/COMPLETE", b"")
        assert backend.raw_read("e/COMPLETE") == b"kept"

    def test_aborted_write_leaves_nothing(self, backend: Backend) -> None:
        st = backend.open().storage
        with pytest.raises(RuntimeError), st.open_write("ab/file.bin") as f:
            f.write(b"x" * 1024)
            raise RuntimeError("writer killed")
        if not st.capabilities.real_directories:
            assert not backend.raw_exists("ab/file.bin")

    def test_listing_sees_other_client_at_once(self, backend: Backend) -> None:
        st = backend.open().storage
        assert st.list_tree("vis") == []
        backend.raw_write("vis/x.bin", b"abc")
        assert [e.name for e in st.list_tree("vis")] == ["vis/x.bin"]
        assert [e.basename for e in st.list_dir("vis")] == ["x.bin"]
        backend.raw_delete("vis/x.bin")
        assert st.list_tree("vis") == []


class CommitConformance:
    """Save/load round trip and the commit protocol's on-storage effects."""

    def test_roundtrip(self, backend: Backend) -> None:
        store = backend.open()
        state = small_state(1, step=10)
        info = store.save(10, state)
        assert info.step == 10
        assert store.steps() == [10]
        assert_state_equal(backend.open().load(), state)
        assert_state_equal(backend.open().load(10), state)
        assert backend.open().verify(10).ok
        assert backend.open().verify(10, quick=True).ok

    def test_layout_and_marker_bind_manifest(self, backend: Backend) -> None:
        store = backend.open()
        store.save(7, small_state())
        paths = StepPaths(7)
        files = backend.raw_files("checkpoints")
        assert f"{paths.dir}/{MARKER_NAME}" in files
        marker = Marker.from_bytes(backend.raw_read(paths.marker))
        mbytes = backend.raw_read(paths.manifest(marker.attempt))
        marker.check_manifest(mbytes, where="test")
        manifest = Manifest.from_bytes(mbytes)
        for entry in manifest.files:
            assert files[f"{paths.attempt_dir(marker.attempt)}/{entry.path}"] == entry.size
        assert not any(".tmp-" in name for name in files)
        assert files[f"{paths.dir}/{MARKER_NAME}"] > 0

    def test_committed_step_is_never_overwritten(self, backend: Backend) -> None:
        store = backend.open()
        store.save(3, small_state(1))
        before = backend.raw_files("checkpoints")
        with pytest.raises(CheckpointExistsError) as ei:
            store.save(3, small_state(2))
        assert "step 3" in str(ei.value)
        assert backend.raw_files("checkpoints") == before
        assert_state_equal(store.load(3), small_state(1))

    def test_crashed_attempt_then_next_save(self, backend: Backend) -> None:
        store = backend.open()
        store.save(1, small_state(1))
        # A writer that died after writing data but before the marker.
        paths = StepPaths(2)
        backend.raw_write(f"{paths.dir}/a-20200101T000000Z-deadbeefdeadbeef/state.msgpack",
                          b"partial")
        assert store.latest().step == 1  # type: ignore[union-attr]
        assert store.steps() == [1]
        info = store.save(2, small_state(2))
        assert info.attempt != "a-20200101T000000Z-deadbeefdeadbeef"
        assert_state_equal(backend.open().load(), small_state(2))

    def test_unsupported_value_writes_nothing(self, backend: Backend) -> None:
        store = backend.open()
        with pytest.raises(UnsupportedValueError) as ei:
            store.save(1, {"trainer": {"cb": lambda: 0}})
        assert "trainer/cb" in str(ei.value)
        assert backend.raw_files("checkpoints") == {}

    @pytest.mark.parametrize("bad", [-1, 1.5, "10", True, None])
    def test_bad_step(self, backend: Backend, bad: Any) -> None:
        with pytest.raises(InvalidStepError):
            backend.open().save(bad, small_state())

    def test_load_missing_lists_existing(self, backend: Backend) -> None:
        store = backend.open()
        store.save(5, small_state())
        with pytest.raises(CheckpointNotFoundError) as ei:
            store.load(6)
        assert "5" in str(ei.value)

    def test_delete_removes_marker_first(self, backend: Backend) -> None:
        store = backend.open()
        store.save(1, small_state(1))
        store.save(2, small_state(2))
        store.delete(2)
        assert store.steps() == [1]
        assert store.latest().step == 1  # type: ignore[union-attr]
        assert not any(k.startswith(StepPaths(2).dir) for k in backend.raw_files("checkpoints"))


class LatestConformance:
    """Resolution of "latest" by listing."""

    def test_empty(self, backend: Backend) -> None:
        store = backend.open()
        assert store.latest() is None
        assert store.steps() == []
        with pytest.raises(CheckpointNotFoundError):
            store.load()

    def test_integer_order_not_string(self, backend: Backend) -> None:
        store = backend.open()
        for step in (9, 10, 100, 2):
            store.save(step, small_state(step))
        assert store.steps() == [2, 9, 10, 100]
        assert backend.open().latest().step == 100  # type: ignore[union-attr]
        # A longer-than-padded name still orders by value.
        store.save(10**12 - 1, small_state(0))
        assert backend.open().latest().step == 10**12 - 1  # type: ignore[union-attr]

    def test_unparseable_names_ignored(self, backend: Backend) -> None:
        store = backend.open()
        store.save(4, small_state())
        backend.raw_write("checkpoints/step-latest/COMPLETE", b"{}")
        backend.raw_write("checkpoints/notes.txt", b"hello")
        backend.raw_write("checkpoints/step-12/COMPLETE", b"{}")
        assert backend.open().latest().step == 4  # type: ignore[union-attr]
        assert backend.open().steps() == [4]

    def test_incomplete_newest_skipped(self, backend: Backend) -> None:
        store = backend.open()
        store.save(1, small_state(1))
        backend.raw_write(f"{StepPaths(5).dir}/a-20200101T000000Z-0123456789abcdef/"
                          f"{MANIFEST_NAME}", b"{}")
        assert backend.open().latest().step == 1  # type: ignore[union-attr]
        assert_state_equal(backend.open().load(), small_state(1))

    def test_corrupt_newest_raises_unless_rollback(self, backend: Backend) -> None:
        store = backend.open()
        store.save(1, small_state(1))
        store.save(2, small_state(2))
        attempt = committed_attempt(backend, 2)
        mpath = StepPaths(2).manifest(attempt)
        backend.raw_write(mpath, backend.raw_read(mpath).replace(b'"step": 2', b'"step": 3'))
        with pytest.raises(CorruptCheckpointError) as ei:
            backend.open().latest()
        assert "step 2" in str(ei.value)
        with pytest.raises(CorruptCheckpointError):
            backend.open().load()
        assert backend.open().latest(allow_rollback=True).step == 1  # type: ignore[union-attr]
        assert_state_equal(backend.open().load(allow_rollback=True), small_state(1))

    def test_corrupt_data_detected_on_load(self, backend: Backend) -> None:
        store = backend.open()
        store.save(1, small_state(1))
        store.save(2, small_state(2))
        attempt = committed_attempt(backend, 2)
        path = StepPaths(2).file(attempt, "tensors-00000.safetensors")
        data = bytearray(backend.raw_read(path))
        data[-1] ^= 0x01
        backend.raw_write(path, bytes(data))
        with pytest.raises(CorruptCheckpointError) as ei:
            backend.open().load()
        assert "tensors-00000.safetensors" in str(ei.value)
        assert backend.open().verify(2, quick=True).ok  # same size: only full verify sees it
        with pytest.raises(CorruptCheckpointError):
            backend.open().verify(2)
        assert_state_equal(backend.open().load(allow_rollback=True), small_state(1))

    def test_second_client_sees_commit_at_once(self, backend: Backend) -> None:
        reader = backend.open()
        assert reader.latest() is None
        writer = backend.open()
        writer.save(1, small_state(1))
        assert reader.latest().step == 1  # type: ignore[union-attr]
        writer.save(2, small_state(2))
        assert reader.steps() == [1, 2]
        writer.delete(2)
        assert reader.latest().step == 1  # type: ignore[union-attr]

    def test_step_dir_names(self, backend: Backend) -> None:
        backend.open().save(1000, small_state())
        assert f"checkpoints/{step_dir_name(1000)}/{MARKER_NAME}" in backend.raw_files()


class RaceConformance:
    """Writers racing on the same step (a zombie job and its replacement)."""

    writers = 8

    def test_threads_same_step_one_winner(self, backend: Backend) -> None:
        stores = [backend.open() for _ in range(self.writers)]
        wins, lost, errors = race(self.writers,
                                  lambda i: stores[i].save(50, small_state(i, step=50)))
        assert not errors, errors
        assert len(wins) == 1, f"winners: {wins}"
        assert len(lost) == self.writers - 1
        reader = backend.open()
        assert reader.steps() == [50]
        assert reader.verify(50).ok
        assert_state_equal(reader.load(50), small_state(wins[0], step=50))
        # Losers removed their attempts: only the winner's remains.
        attempts = {k.split("/")[2] for k in backend.raw_files(StepPaths(50).dir)
                    if k.count("/") >= 3}
        assert attempts == {committed_attempt(backend, 50)}


# -- storage wrappers ------------------------------------------------------------------------------
#
# A wrapper (retries, a sub-root, fault injection, request counting, yours) must offer exactly
# the optional capabilities of the storage it wraps, each one working through it, and keep
# every safety check.  `check_wrapper` checks one wrapper over one storage;
# `WrapperConformance` runs it, and a save/load/verify, on a backend; the link checks
# run on local disk (`LocalWrapperConformance`), where links exist.


@dataclass(frozen=True)
class WrapperCase:
    """A storage wrapper to check: how to build it around a storage, and which optional
    capabilities it adds to those of the storage it wraps."""

    name: str
    make: Callable[[Storage], Storage]
    adds: tuple[type, ...] = ()


def shipped_wrappers() -> list[WrapperCase]:
    """Every storage wrapper ckptfs ships (the benchmarks' request counter aside: the test
    suite adds it).  Also the static check: each ``make`` is typed to return a
    `Storage`, so mypy verifies that every wrapper satisfies the
    protocol."""
    return [
        WrapperCase("RetryingStorage",
                    lambda s: RetryingStorage(s, base_delay=0.001, max_delay=0.004),
                    adds=(Retrying,)),
        WrapperCase("SubStorage", lambda s: SubStorage(s, "sub/root")),
        WrapperCase("FaultyStorage", lambda s: FaultyStorage(s)),
        WrapperCase("CrashingStorage",
                    lambda s: CrashingStorage(s, "create_exclusive", "never-matches")),
        WrapperCase("PauseBeforeCommit", lambda s: PauseBeforeCommit(s, MAX_STEP)),
    ]


def _forwards_by_getattr(obj: object) -> bool:
    return any("__getattr__" in vars(cls) for cls in type(obj).__mro__ if cls is not object)


def _inner_prefix(inner: Storage, wrapper: Storage, probe: str) -> str:
    """Where path ``p`` of ``wrapper`` lives in ``inner``: found by writing ``probe`` through
    the wrapper and listing the inner storage (a wrapper need not say how it maps paths)."""
    wrapper.write_bytes(probe, b"probe")
    found = [e.name for e in inner.list_tree("") if e.name.endswith(probe)]
    assert len(found) == 1, f"{probe} written through {wrapper!r} appears as {found} inside"
    return found[0][:-len(probe)]


def check_wrapper(inner: Storage, wrapper: Storage, *, adds: tuple[type, ...] = ()) -> None:
    """Assert that ``wrapper`` (built around ``inner``) satisfies `Storage` without
    ``__getattr__`` forwarding, carries the same capabilities data (the write-memory budget's
    ``stream_buffer_bytes`` included), offers every optional capability ``inner`` offers and
    no other (``adds`` aside), and that each offered capability works through it.  Writes
    and removes a scratch directory through the wrapper."""
    assert isinstance(wrapper, Storage), f"{wrapper!r} lacks members of Storage"
    assert not _forwards_by_getattr(wrapper), (
        f"{type(wrapper).__name__} forwards with __getattr__: delegate each member explicitly "
        "(subclass ckptfs.storage.base.StorageWrapper)")
    assert wrapper.capabilities == inner.capabilities, (wrapper.capabilities, inner.capabilities)
    for cap in OPTIONAL_CAPABILITIES:
        want = supports(inner, cap) or cap in adds
        assert supports(wrapper, cap) == want, (
            f"{type(wrapper).__name__} {'drops' if want else 'claims'} {cap.__name__} "
            f"(the storage it wraps {'offers' if supports(inner, cap) else 'lacks'} it)")
    scratch = f"wrapper-conformance-{uuid.uuid4().hex[:12]}"
    prefix = _inner_prefix(inner, wrapper, f"{scratch}/probe.bin")
    try:
        for cap in OPTIONAL_CAPABILITIES:
            if supports(wrapper, cap):
                _USES[cap](inner, wrapper, scratch, prefix)
    finally:
        wrapper.delete_tree(scratch)


def _use_ranged_read(inner: Storage, wrapper: Storage, scratch: str, prefix: str) -> None:
    data = bytes(range(256)) * 8
    wrapper.write_bytes(f"{scratch}/ranged.bin", data)
    ranged = cast(RangedRead, wrapper)
    assert ranged.read_range(f"{scratch}/ranged.bin", 100, 300) == data[100:400]
    assert ranged.read_range(f"{scratch}/ranged.bin", len(data) - 4, 10) == data[-4:]
    assert read_range(wrapper, f"{scratch}/ranged.bin", 7, 9) == data[7:16]


def _use_local_files(inner: Storage, wrapper: Storage, scratch: str, prefix: str) -> None:
    wrapper.write_bytes(f"{scratch}/local.bin", b"on local disk")
    path = cast(LocalFiles, wrapper).local_path(f"{scratch}/local.bin")
    with open(path, "rb") as f:
        assert f.read() == b"on local disk", path


def _use_retrying(inner: Storage, wrapper: Storage, scratch: str, prefix: str) -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise StorageError("injected transient failure (connection reset)")
        return "done"

    assert cast(Retrying, wrapper).retry_call("write", f"{scratch}/x", flaky) == "done"
    assert retry_call(wrapper, "write", f"{scratch}/x", lambda: "once") == "once"
    assert len(calls) == 2


def _use_modified_times(inner: Storage, wrapper: Storage, scratch: str, prefix: str) -> None:
    wrapper.write_bytes(f"{scratch}/aged.bin", b"x")
    times = cast(ModifiedTimes, wrapper)
    when = times.modified(f"{scratch}/aged.bin")
    assert when is not None and when.tzinfo is not None, when
    assert abs(datetime.now(timezone.utc) - when) < timedelta(days=1), when
    assert times.modified(f"{scratch}/missing.bin") is None


def _use_empty_dir_removal(inner: Storage, wrapper: Storage, scratch: str, prefix: str) -> None:
    dirs = cast(EmptyDirRemoval, wrapper)
    wrapper.makedirs(f"{scratch}/empty")
    wrapper.write_bytes(f"{scratch}/full/file.bin", b"x")
    assert dirs.remove_empty_dir(f"{scratch}/full") is False
    assert dirs.remove_empty_dir(f"{scratch}/empty") is True
    assert [e.basename for e in wrapper.list_dir(scratch) if e.is_dir] == ["full"]
    with pytest.raises(FileNotFoundError):
        dirs.remove_empty_dir(f"{scratch}/empty")


def _use_multipart_uploads(inner: Storage, wrapper: Storage, scratch: str, prefix: str) -> None:
    """An upload left open in the inner storage is listed through the wrapper under the
    wrapper's path, with its size, and aborted through it; a second abort says it is gone."""
    uploads = cast(MultipartUploads, wrapper)
    path = f"{scratch}/big.bin"
    part = 1 << 20
    total = max(inner.capabilities.stream_buffer_bytes, 16 * part) + part
    with pytest.raises(_Abandon), inner.open_write(prefix + path) as f:
        for _ in range(total // part):  # at least one part goes up: the upload is under way
            f.write(b"u" * part)
        pending = [u for u in uploads.list_uploads(scratch) if u.path == path]
        assert len(pending) == 1 and pending[0].size > 0, uploads.list_uploads(scratch)
        assert uploads.abort_upload(pending[0]) is True
        assert [u for u in uploads.list_uploads(scratch) if u.path == path] == []
        raise _Abandon
    assert uploads.abort_upload(pending[0]) is False
    assert not wrapper.exists(path)


class _Abandon(Exception):
    """Ends the streaming write of `_use_multipart_uploads` (its upload is aborted)."""


def _use_server_checksums(inner: Storage, wrapper: Storage, scratch: str, prefix: str) -> None:
    """The store's checksum of an object written through the wrapper, read through it and
    through the inner storage alike, equals the one computed over the bytes (where the store
    keeps one: an emulator may keep none, which the verifier reports as not available)."""
    from ckptfs.format.hashing import new_store_hasher

    data = b"checksummed by the store " * 100
    wrapper.write_bytes(f"{scratch}/sum.bin", data)
    sums = cast(ServerChecksums, wrapper)
    algorithms = sums.checksum_algorithms()
    assert algorithms == cast(ServerChecksums, inner).checksum_algorithms()
    stored = sums.server_checksum(f"{scratch}/sum.bin")
    assert stored == cast(ServerChecksums, inner).server_checksum(f"{prefix}{scratch}/sum.bin")
    if stored is not None:
        h = new_store_hasher(stored.algorithm)
        h.update(data)
        assert stored.hexdigest == h.hexdigest(), (stored, h.hexdigest())


def _use_batched_sync(inner: Storage, wrapper: Storage, scratch: str, prefix: str) -> None:
    """Files written through the wrapper and their directories are synced through it in one
    step; a file that is not there is a typed error naming it, the others still synced."""
    syncs = cast(BatchedSync, wrapper)
    with wrapper.open_write(f"{scratch}/sync/a.bin") as f:
        f.write(b"a")
    with wrapper.open_write(f"{scratch}/sync/b.bin") as f:
        f.write(b"b")
    syncs.sync_paths([f"{scratch}/sync/a.bin", f"{scratch}/sync/b.bin"],
                     [f"{scratch}/sync", scratch])
    with pytest.raises((StorageError, FileNotFoundError), match=r"missing\.bin"):
        syncs.sync_paths([f"{scratch}/sync/a.bin", f"{scratch}/sync/missing.bin"], [])
    assert wrapper.read_bytes(f"{scratch}/sync/b.bin") == b"b"


_USES: dict[type, Callable[[Storage, Storage, str, str], None]] = {
    RangedRead: _use_ranged_read,
    LocalFiles: _use_local_files,
    Retrying: _use_retrying,
    ModifiedTimes: _use_modified_times,
    EmptyDirRemoval: _use_empty_dir_removal,
    MultipartUploads: _use_multipart_uploads,
    ServerChecksums: _use_server_checksums,
    BatchedSync: _use_batched_sync,
}


def link_checkpoint(backend: Backend, store: CheckpointStore, step: int, what: str) -> None:
    """Save ``step`` and replace one of its parts by a symbolic link to a copy outside the
    checkpoint (local disk): ``"file"`` (a data file), ``"attempt"`` (the attempt directory)
    or ``"step"`` (the step directory)."""
    info = store.save(step, small_state(step))
    probe = f"link-probe-{uuid.uuid4().hex[:12]}"
    prefix = _inner_prefix(backend.open().storage, store.storage, probe)
    store.storage.delete(probe)
    root = backend.raw_root
    target = {"file": f"{info.path}/{info.manifest.files[0].path}", "attempt": info.path,
              "step": info.paths.dir}[what]
    here = os.path.join(root, *f"{prefix}{target}".split("/"))
    outside = os.path.join(os.path.dirname(root), f"outside-{uuid.uuid4().hex[:8]}")
    os.replace(here, outside)
    os.symlink(outside, here)


class WrapperConformance:
    """A storage wrapper on one backend.  Subclass with a ``backend`` fixture and a ``case``
    fixture returning the `WrapperCase` of the wrapper under test."""

    def test_offers_what_it_wraps(self, backend: Backend, case: WrapperCase) -> None:
        raw = FsspecStorage(backend.url, **backend.options)
        check_wrapper(raw, case.make(raw), adds=case.adds)
        retrying = backend.open().storage  # what ckptfs.open gives: retries over the adapter
        check_wrapper(retrying, case.make(retrying), adds=case.adds)

    def test_save_load_verify_through_it(self, backend: Backend, case: WrapperCase) -> None:
        store = CheckpointStore(case.make(backend.open().storage))
        state = small_state(3, step=3)
        store.save(3, state)
        assert_state_equal(store.load(3), state)
        assert store.verify(3).ok and store.latest() is not None


class LocalWrapperConformance(WrapperConformance):
    """The link refusals, through the wrapper, on local disk (the only backend with links):
    a symbolic link as a file, as the attempt directory or as the step directory is refused
    by load (`UnsafeCheckpointError`), verify (quick and full) and
    copy (``ckptfs cp``)."""

    @pytest.mark.parametrize("what", ["file", "attempt", "step"])
    def test_links_refused_through_it(self, backend: Backend, case: WrapperCase,
                                      what: str) -> None:
        store = CheckpointStore(case.make(backend.open().storage))
        link_checkpoint(backend, store, 1, what)
        with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
            store.load(1)
        for quick in (True, False):
            with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
                store.verify(1, quick=quick)
        dst = FsspecStorage(f"memory://{uuid.uuid4().hex}")
        with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
            copy_step(store.storage, dst, 1)
        assert dst.list_tree("") == []
