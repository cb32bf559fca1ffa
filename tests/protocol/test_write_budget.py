"""A save bounds the bytes its parallel streaming writes hold in part buffers.

Counted in bytes, not wall time: a fake object store whose writer buffers like s3fs (one part
of ``block`` bytes, sent when full, with the part copied out for the request) records the most
bytes buffered across all open writers at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from ckptfs.protocol import commit
from ckptfs.protocol.commit import WRITE_BUFFER_BUDGET, save_checkpoint, write_streams
from ckptfs.protocol.options import SaveOptions
from ckptfs.storage.backends import BACKENDS
from ckptfs.storage.base import Capabilities, Entry
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.storage.sub import SubStorage

MiB = 1024 * 1024


class _Meter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.open = 0
        self.peak_open = 0

    def add(self, n: int) -> None:
        with self.lock:
            self.now += n
            self.peak = max(self.peak, self.now)


class _BufferingWriter:
    """s3fs-like: bytes accumulate in a buffer; a full part is copied out and "uploaded" (a short
    sleep, so parallel writers overlap), then dropped."""

    def __init__(self, meter: _Meter, block: int, sink: bytearray) -> None:
        self.meter, self.block, self.sink = meter, block, sink
        self.buf = bytearray()

    def write(self, data: Any) -> int:
        # Split at part boundaries, as FsspecStorage's writer does for object stores (tested
        # below on the adapter itself), then buffer like the library.
        mv = memoryview(data).cast("B")
        total = len(mv)
        while mv:
            piece = mv[:self.block - len(self.buf)]
            self.buf += piece
            self.meter.add(len(piece))
            mv = mv[len(piece):]
            if len(self.buf) >= self.block:
                self._upload(self.block)
        return total

    def _upload(self, n: int) -> None:
        part = bytes(self.buf[:n])  # the request's copy
        self.meter.add(len(part))
        time.sleep(0.002)
        self.sink += part
        del self.buf[:n]
        self.meter.add(-2 * len(part))

    def close(self) -> None:
        if self.buf:
            self._upload(len(self.buf))


class FakeObjectStore:
    """Just enough of the Storage interface for a save, in memory, with s3-like capabilities."""

    def __init__(self, block: int, copies: int) -> None:
        self.capabilities = Capabilities("fake-s3", exclusive_create="process_lock",
                                         atomic_rename=False, fsync=False,
                                         empty_create_safe=True, real_directories=False,
                                         shared=False, stream_buffer_bytes=block * copies)
        self.block = block
        self.url = "fake://bucket/run"
        self.meter = _Meter()
        self.files: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @contextmanager
    def open_write(self, path: str) -> Iterator[Any]:
        sink = bytearray()
        w = _BufferingWriter(self.meter, self.block, sink)
        with self.meter.lock:
            self.meter.open += 1
            self.meter.peak_open = max(self.meter.peak_open, self.meter.open)
        try:
            yield w
            w.close()
        finally:
            with self.meter.lock:
                self.meter.open -= 1
        with self._lock:
            self.files[path] = bytes(sink)

    def write_bytes(self, path: str, data: bytes) -> None:
        with self._lock:
            self.files[path] = bytes(data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        with self._lock:
            assert path not in self.files
            self.files[path] = bytes(data)

    def read_bytes(self, path: str) -> bytes:
        with self._lock:
            if path not in self.files:
                raise FileNotFoundError(path)
            return self.files[path]

    def exists(self, path: str) -> bool:
        with self._lock:
            return path in self.files or any(k.startswith(path.rstrip("/") + "/")
                                             for k in self.files)

    def list_dir(self, path: str) -> list[Entry]:  # pragma: no cover - not used by a save
        raise NotImplementedError

    def makedirs(self, path: str) -> None:
        pass

    def delete_tree(self, path: str) -> None:
        with self._lock:
            for k in [k for k in self.files if k.startswith(path.rstrip("/") + "/")]:
                del self.files[k]


def _state(nfiles: int, per_file: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randint(0, 255, (per_file,), dtype=torch.uint8, generator=g)
            for i in range(nfiles)}


def _save(store: FakeObjectStore, monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    monkeypatch.setattr(commit, "WRITE_BUFFER_BUDGET", budget)
    monkeypatch.setattr(commit.write_streams, "__defaults__", (budget,))
    # 4 tensors of 3 MiB, one file each (shard_bytes), 4 threads asked for.
    save_checkpoint(store, 1, _state(4, 3 * MiB), SaveOptions(threads=4),
                    shard_bytes=3 * MiB + 1)


def test_budget_bounds_bytes_buffered_across_parallel_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    block = 1 * MiB
    budget = 4 * MiB
    store = FakeObjectStore(block, copies=2)  # 2 MiB per stream: 2 streams fit in 4 MiB
    _save(store, monkeypatch, budget)
    assert store.meter.peak_open == 2
    assert store.meter.peak <= budget, store.meter.peak
    assert store.meter.now == 0
    # Every byte of the state went through the budgeted streams, into 4 data files.
    big = [k for k, v in store.files.items() if len(v) >= 3 * MiB]
    assert len(big) == 4, sorted(store.files)


def test_the_fake_would_exceed_the_budget_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement can fail: with a budget that admits every thread, four streams are open
    together and buffer more than the real budget allows."""
    block = 1 * MiB
    store = FakeObjectStore(block, copies=2)
    _save(store, monkeypatch, 1 << 40)
    assert store.meter.peak_open == 4
    assert store.meter.peak > 4 * MiB


def test_a_stream_larger_than_the_budget_still_writes_alone() -> None:
    store = FakeObjectStore(8 * MiB, copies=3)  # 24 MiB per stream
    assert write_streams(store, 8, 10, budget=16 * MiB) == 1  # type: ignore[arg-type]
    assert write_streams(store, 8, 10, budget=48 * MiB) == 2  # type: ignore[arg-type]
    assert write_streams(store, 8, 1, budget=1 << 40) == 1  # type: ignore[arg-type]


@pytest.mark.parametrize("protocol", ["s3", "gs", "az"])
def test_object_stores_declare_their_stream_buffers(protocol: str) -> None:
    spec = BACKENDS[protocol]
    assert spec.write_block_size is not None
    assert spec.min_block_size is not None and spec.write_block_size >= spec.min_block_size
    assert spec.stream_buffer_bytes == spec.write_block_size * spec.write_block_copies > 0
    # With the default budget a save writes at least one file at a time, never more than fit.
    n = WRITE_BUFFER_BUDGET // spec.stream_buffer_bytes
    assert n * spec.stream_buffer_bytes <= WRITE_BUFFER_BUDGET


def test_local_and_memory_streams_are_unbounded_by_the_budget(tmp_path: Any) -> None:
    local = FsspecStorage(str(tmp_path))
    mem = FsspecStorage("memory://write-budget")
    assert local.capabilities.stream_buffer_bytes == 0
    assert mem.capabilities.stream_buffer_bytes == 0
    assert write_streams(local, 4, 10) == 4  # type: ignore[arg-type]


class _RecordingFile:
    def __init__(self, blocksize: int) -> None:
        self.blocksize = blocksize
        self.buffered = 0
        self.peak = 0
        self.out = bytearray()

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        self.buffered += len(mv)
        self.peak = max(self.peak, self.buffered)
        self.out += mv
        if self.buffered >= self.blocksize:
            self.buffered = 0  # flushed
        return len(mv)


def test_adapter_splits_writes_at_part_boundaries(tmp_path: Any) -> None:
    """The library's buffer never holds more than one part, whatever the write sizes."""
    from ckptfs.storage.fsspec import _Translating

    st = FsspecStorage(str(tmp_path))
    rec = _RecordingFile(1000)
    w = _Translating(rec, st, "x", block=1000)
    payload = bytes(range(256)) * 40  # 10240 bytes
    sizes = [1, 999, 1500, 700, 3000, 4040]
    pos = 0
    for n in sizes:
        assert w.write(memoryview(payload)[pos:pos + n]) == n
        pos += n
    assert pos == len(payload)
    assert bytes(rec.out) == payload
    assert rec.peak <= 1000


def test_a_sub_storage_is_budgeted_like_its_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Artifacts and the Lightning integration save through a sub-storage: its streams are
    bounded by the parent's ``stream_buffer_bytes`` (capability data, copied), not unbounded."""
    store = FakeObjectStore(1 * MiB, copies=2)
    sub = SubStorage(store, "artifacts/ref")  # type: ignore[arg-type]
    assert sub.capabilities.stream_buffer_bytes == 2 * MiB
    monkeypatch.setattr(commit, "WRITE_BUFFER_BUDGET", 4 * MiB)
    monkeypatch.setattr(commit.write_streams, "__defaults__", (4 * MiB,))
    save_checkpoint(sub, 1, _state(4, 3 * MiB), SaveOptions(threads=4),
                    shard_bytes=3 * MiB + 1)
    assert store.meter.peak_open == 2 and store.meter.peak <= 4 * MiB
    assert all(k.startswith("artifacts/ref/") for k in store.files)
