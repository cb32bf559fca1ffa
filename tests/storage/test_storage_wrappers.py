"""Storage wrappers: every shipped wrapper offers exactly what the storage it
wraps offers, and each capability works through it (local, memory, S3); a user's wrapper that
implements exactly the :class:`Storage` protocol keeps the symbolic-link refusals; the
sub-storage keeps retries, the write-memory budget, ranged reads and mmap."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, BinaryIO

import pytest
import torch

from ckptfs.bench.latest import CountingStorage
from ckptfs.lifecycle.artifacts import RunArtifacts
from ckptfs.protocol.commit import write_streams
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.base import (
    OPTIONAL_CAPABILITIES,
    Entry,
    LocalFiles,
    ModifiedTimes,
    MultipartUploads,
    RangedRead,
    Retrying,
    Storage,
    StorageWrapper,
    read_range,
    supports,
)
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.storage.retry import RetryingStorage
from ckptfs.storage.sub import SubStorage
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import (
    LocalWrapperConformance,
    WrapperCase,
    WrapperConformance,
    assert_state_equal,
    check_wrapper,
    link_checkpoint,
    shipped_wrappers,
    small_state,
)
from ckptfs.testing.faults import FaultyStorage, TransientStorageError

MiB = 1 << 20

CASES = [*shipped_wrappers(), WrapperCase("CountingStorage", CountingStorage)]


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def case(request: pytest.FixtureRequest) -> WrapperCase:
    return request.param  # type: ignore[no-any-return]


class TestLocalWrappers(LocalWrapperConformance):
    @pytest.fixture
    def backend(self, local_backend: Backend) -> Backend:
        return local_backend


class TestMemoryWrappers(WrapperConformance):
    @pytest.fixture
    def backend(self, memory_backend: Backend) -> Backend:
        return memory_backend


class TestS3Wrappers(WrapperConformance):
    @pytest.fixture
    def backend(self, s3_backend: Backend) -> Backend:
        return s3_backend


def test_every_optional_capability_is_exercised(local_backend: Backend,
                                                s3_backend: Backend) -> None:
    """Between local disk and S3, the adapter offers every optional capability, so the
    conformance runs above use each of them through every wrapper."""
    offered = set()
    for backend in (local_backend, s3_backend):
        raw = FsspecStorage(backend.url, **backend.options)
        offered |= {c for c in OPTIONAL_CAPABILITIES if supports(raw, c)}
        offered |= {c for c in OPTIONAL_CAPABILITIES if supports(backend.open().storage, c)}
    assert offered == set(OPTIONAL_CAPABILITIES)


# -- a user's wrapper with exactly the Storage members -------------------------------------------


class ExactlyStorage:
    """A user's wrapper: a plain class delegating exactly the members of :class:`Storage`,
    nothing else (no optional capability, no ``offers``)."""

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


class TestExactlyTheProtocol(LocalWrapperConformance):
    """The link refusals (load, verify, copy) through a wrapper that has only the Storage
    members: they read the listing, so no optional member is needed to keep them."""

    @pytest.fixture
    def backend(self, local_backend: Backend) -> Backend:
        return local_backend

    @pytest.fixture
    def case(self) -> WrapperCase:
        return WrapperCase("ExactlyStorage", ExactlyStorage)

    def test_offers_what_it_wraps(self, backend: Backend, case: WrapperCase) -> None:
        """It drops every optional capability (it declares none): the conformance check says
        so, naming the first one."""
        raw = FsspecStorage(backend.url)
        wrapper = case.make(raw)
        assert not any(supports(wrapper, c) for c in OPTIONAL_CAPABILITIES)
        with pytest.raises(AssertionError, match="ExactlyStorage drops RangedRead"):
            check_wrapper(raw, wrapper)


def test_link_refusal_needs_no_probe(local_backend: Backend) -> None:
    """The refusal comes from the listing a storage must give (``Entry.is_link``): the same
    wrapper with a listing that hides links (and lists the size of what they point to) would
    load the linked file, so the checks above can fail."""

    class HidesLinks(ExactlyStorage):
        def list_tree(self, path: str) -> list[Entry]:
            return [Entry(e.name, len(self.read_bytes(e.name)) if e.is_link else e.size,
                          e.is_dir) for e in self.inner.list_tree(path)]

    store = CheckpointStore(HidesLinks(local_backend.open().storage))
    link_checkpoint(local_backend, store, 1, "file")
    assert_state_equal(store.load(1), small_state(1))


class _Forwarding:
    def __init__(self, inner: Storage) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_check_wrapper_refuses_getattr_forwarding(local_backend: Backend) -> None:
    raw = FsspecStorage(local_backend.url)
    with pytest.raises(AssertionError, match="forwards with __getattr__"):
        check_wrapper(raw, _Forwarding(raw))  # type: ignore[arg-type]


def test_no_shipped_wrapper_forwards_with_getattr() -> None:
    for cls in (StorageWrapper, RetryingStorage, SubStorage, FaultyStorage, CountingStorage):
        assert all("__getattr__" not in vars(c) for c in cls.__mro__), cls


# -- the sub-storage (artifacts, the Lightning integration) keeps its parent's capabilities ----


def test_sub_storage_keeps_retries_of_streamed_writes(memory_backend: Backend) -> None:
    """A transient failure in the middle of a streamed write through an artifact's
    sub-storage: the commit replays the whole file under the parent's retries (``Retrying``
    through the sub-storage); the artifact is saved and loads back.  Without the capability
    the failure would end the save."""
    failed: list[str] = []

    def one_transient_write(op: str, path: str) -> None:
        if op == "write" and "tensors-" in path and not failed:
            failed.append(path)
            raise TransientStorageError(f"write {path}: injected (connection reset)")

    raw = FsspecStorage(memory_backend.url)
    faulty = FaultyStorage(raw, hook=one_transient_write)
    retrying = RetryingStorage(faulty, attempts=3, base_delay=0, max_delay=0)
    assert supports(SubStorage(retrying, "artifacts/ref"), Retrying)
    state = small_state(2)
    _, created = RunArtifacts(CheckpointStore(retrying)).save("ref", state, descriptor={"v": 1})
    assert created and len(failed) == 1 and retrying.retries == 1
    opened = [c.path for c in faulty.calls if c.op == "open_write"]
    assert opened.count(failed[0]) == 2  # the whole file, streamed again
    assert_state_equal(RunArtifacts(CheckpointStore(raw)).load("ref"), state)


class _StreamMeter(StorageWrapper):
    """Counts the streaming writes open at once."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.lock = threading.Lock()
        self.open = self.peak = 0

    @contextmanager
    def _metered(self, path: str) -> Iterator[BinaryIO]:
        with self.lock:
            self.open += 1
            self.peak = max(self.peak, self.open)
        try:
            with self.inner.open_write(path) as f:
                yield f
        finally:
            with self.lock:
                self.open -= 1

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self._metered(path)


def test_sub_storage_keeps_the_write_budget(s3_backend: Backend) -> None:
    """S3 streams hold part buffers (``stream_buffer_bytes``, capability data): through a
    sub-storage a save opens no more streams at once than on its parent (2, not 4)."""
    meter = _StreamMeter(s3_backend.open().storage)
    sub = SubStorage(meter, "artifacts/ref")
    assert sub.capabilities.stream_buffer_bytes == meter.capabilities.stream_buffer_bytes > 0
    assert write_streams(sub, 4, 4) == write_streams(meter, 4, 4) == 2
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randint(0, 255, (3 * MiB,), dtype=torch.uint8, generator=g)
             for i in range(4)}
    store = CheckpointStore(sub, threads=4, shard_bytes=3 * MiB + 1)
    info = store.save(1, state)
    assert len([f for f in info.manifest.files if f.size >= 3 * MiB]) == 4
    assert 1 <= meter.peak <= 2, meter.peak
    assert_state_equal(store.load(1), state)


def test_sub_storage_reads_ranges_of_its_parent(s3_backend: Backend) -> None:
    """A ranged read through a sub-storage is one ranged read of the parent, not a stream."""
    counting = CountingStorage(s3_backend.open().storage)
    sub = SubStorage(counting, "artifacts/ref")
    assert supports(sub, RangedRead)
    data = bytes(range(256)) * 64
    sub.write_bytes("x/data.bin", data)
    assert read_range(sub, "x/data.bin", 1000, 50) == data[1000:1050]
    assert counting.calls.get("read_range") == 1 and "open_read" not in counting.calls


def test_sub_storage_maps_local_files(local_backend: Backend) -> None:
    """``mmap=True`` through a sub-storage on local disk maps the parent's files."""
    sub = SubStorage(local_backend.open().storage, "artifacts/ref")
    assert supports(sub, LocalFiles)
    store = CheckpointStore(sub)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    store.save(1, state)
    loaded = store.load(1, mmap=True)
    assert torch.equal(loaded["w"], state["w"])
    path = sub.local_path(f"{store.info(1).path}/{store.info(1).manifest.files[0].path}")
    assert path.startswith(str(local_backend.raw_root)) and "/artifacts/ref/" in path


@pytest.mark.parametrize("name", ["gcs", "azure", "ministack"])
def test_optional_capabilities_work_on_the_other_backends(request: pytest.FixtureRequest,
                                                          name: str) -> None:
    """What the adapter offers on GCS, Azure and ministack (modification times from their own
    ``info`` keys, ranged reads; multi-part uploads on ministack's S3) works, through the retry
    layer as ``ckptfs.open`` builds it."""
    backend: Backend = request.getfixturevalue(f"{name}_backend")
    raw = FsspecStorage(backend.url, **backend.options)
    assert supports(raw, RangedRead) and supports(raw, ModifiedTimes)
    assert supports(raw, MultipartUploads) == (name == "ministack")
    check_wrapper(raw, RetryingStorage(raw, base_delay=0.001, max_delay=0.004),
                  adds=(Retrying,))
