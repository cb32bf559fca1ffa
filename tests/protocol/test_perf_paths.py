"""The I/O hot paths: hash while writing (no second read), overlap with a helper thread, files in
parallel on save and load, streaming verification, bounded memory.  No timing assertions: speed
is the benchmarks' job (docs/benchmarks.md); these check the properties that make it possible."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.bench.common import Timing, timed
from ckptfs.bench.latest import CountingStorage
from ckptfs.errors import CorruptCheckpointError, StorageError
from ckptfs.format.hashing import HASH_INLINE_BYTES, digest_bytes
from ckptfs.protocol.commit import save_checkpoint
from ckptfs.protocol.formats import load_checkpoint
from ckptfs.protocol.options import SaveOptions
from ckptfs.protocol.resolve import resolve_latest
from ckptfs.storage.fsspec import FsspecStorage

MiB = 1024 * 1024


def _big_state(mib: int = 24) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    n = mib * MiB // 4
    return {"w": torch.randn(n, generator=g), "b": torch.randn(1000, generator=g),
            "meta": {"lr": 0.1}}


class Recording(CountingStorage):
    """Counts calls, records the paths read, and can hold two I/O calls at a barrier to prove
    they run at the same time."""

    def __init__(self, inner: Any, barrier_on: str | None = None) -> None:
        super().__init__(inner)
        self.read_paths: list[str] = []
        self.barrier = threading.Barrier(2, timeout=20) if barrier_on else None
        self.barrier_on = barrier_on

    def _maybe_wait(self, op: str, path: str) -> None:
        if self.barrier is not None and op == self.barrier_on and "tensors-" in path:
            self.barrier.wait()

    def read_bytes(self, path: str) -> bytes:
        self.calls["read_bytes"] = self.calls.get("read_bytes", 0) + 1
        self.read_paths.append(path)
        return bytes(self.inner.read_bytes(path))

    @contextmanager
    def open_read(self, path: str) -> Iterator[Any]:
        self.calls["open_read"] = self.calls.get("open_read", 0) + 1
        self.read_paths.append(path)
        self._maybe_wait("open_read", path)
        with self.inner.open_read(path) as f:
            yield f

    @contextmanager
    def open_write(self, path: str) -> Iterator[Any]:
        self._maybe_wait("open_write", path)
        with self.inner.open_write(path) as f:
            yield f


def test_save_never_reads_back_and_digest_matches_the_file(tmp_path: Path) -> None:
    storage = Recording(FsspecStorage(str(tmp_path / "run")))
    state = _big_state()
    info = save_checkpoint(storage, 1, state)  # type: ignore[arg-type]
    assert not [p for p in storage.read_paths if "/attempt" in p or "tensors-" in p]
    assert storage.calls.get("open_read", 0) == 0
    big = [e for e in info.manifest.files if e.size > HASH_INLINE_BYTES]
    assert big, "the state must exercise the background-hash path"
    for entry in info.manifest.files:
        on_disk = (tmp_path / "run" / info.path / entry.path).read_bytes()
        assert len(on_disk) == entry.size
        assert digest_bytes(entry.algorithm, on_disk) == entry.digest
    assert info.manifest.hash_algorithm == "blake3"


def test_copied_tensors_stay_alive_while_queued(tmp_path: Path) -> None:
    """Non-contiguous tensors are copied one at a time while streaming; the chunk views must
    keep each copy alive until written *and* hashed (use-after-free would corrupt the file or
    its digest)."""
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(1024, 1536, generator=g).t() for i in range(6)}
    assert not state["t0"].is_contiguous()
    store = ckptfs.open(str(tmp_path / "run"), durable=False)
    info = store.save(1, state)
    loaded = store.load(1)  # verifies every digest
    for k, v in state.items():
        assert torch.equal(loaded[k], v)
    assert store.verify(1).ok
    assert info.manifest.total_bytes > 6 * 1024 * 1536 * 4


@pytest.mark.parametrize("algorithm", ["sha256", "blake3", "xxh3-128", "crc32c"])
def test_round_trip_every_algorithm_through_background_path(tmp_path: Path,
                                                             algorithm: str) -> None:
    state = _big_state(12)
    store = ckptfs.open(str(tmp_path / "run"), algorithm=algorithm)
    info = store.save(3, state)
    assert all(e.algorithm == algorithm for e in info.manifest.files)
    out = store.load(3)
    assert torch.equal(out["w"], state["w"]) and out["meta"] == {"lr": 0.1}


def _storage(request: pytest.FixtureRequest, tmp_path: Path, backend: str) -> FsspecStorage:
    if backend == "local":
        return FsspecStorage(str(tmp_path / "run"))
    if backend == "memory":
        return FsspecStorage(f"memory://perf-{tmp_path.name}")
    b = request.getfixturevalue("s3_backend")
    return FsspecStorage(b.url, **b.options)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_files_are_written_in_parallel(request: pytest.FixtureRequest, tmp_path: Path,
                                       backend: str) -> None:
    """Two tensor files must be open for writing at the same time (a barrier of 2 would time
    out if they were written one after the other)."""
    storage = Recording(_storage(request, tmp_path, backend), barrier_on="open_write")
    info = save_checkpoint(storage, 1, _big_state(8), SaveOptions(threads=2),  # type: ignore[arg-type]
                           shard_bytes=3 * MiB)
    assert storage.barrier is not None and not storage.barrier.broken
    assert len([e for e in info.manifest.files if "tensors-" in e.path]) >= 2


@pytest.mark.parametrize("backend", ["local", "memory", "s3"])
def test_files_are_read_in_parallel(request: pytest.FixtureRequest, tmp_path: Path,
                                    backend: str) -> None:
    inner = _storage(request, tmp_path, backend)
    save_checkpoint(inner, 1, _big_state(8), shard_bytes=3 * MiB)  # type: ignore[arg-type]
    storage = Recording(inner, barrier_on="open_read")
    info = resolve_latest(storage)  # type: ignore[arg-type]
    assert info is not None
    state = load_checkpoint(storage, info, threads=4)  # type: ignore[arg-type]
    assert state["w"].numel() == 8 * MiB // 4
    assert storage.barrier is not None and not storage.barrier.broken
    assert storage.calls.get("read_bytes", 0) == 2  # marker + manifest, nothing re-read


def test_streaming_verification_catches_a_flipped_byte(tmp_path: Path) -> None:
    store = ckptfs.open(str(tmp_path / "run"))
    info = store.save(1, _big_state(16))
    entry = max(info.manifest.files, key=lambda e: e.size)
    assert entry.size > HASH_INLINE_BYTES
    path = tmp_path / "run" / info.path / entry.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2 + 12345] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=entry.path):
        store.load(1)
    store.load(1, verify=False)  # same size: only the digest tells


def test_tensors_are_read_into_memory_of_their_own(tmp_path: Path) -> None:
    """A load reads a tensor file straight into its tensors, each with memory of its own (as
    ``torch.load`` allocates: the allocator reuses what an earlier load freed), in the same pass
    that hashes it; a file whose header was changed is reported by its digest, before the header
    is trusted."""
    store = ckptfs.open(str(tmp_path / "run"))
    state = _big_state(8)
    info = store.save(1, state)
    out = store.load(1)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    for name in ("w", "b"):
        storage = out[name].untyped_storage()
        assert storage.nbytes() == out[name].numel() * 4, name  # not a view of the file
    assert out["w"].untyped_storage().data_ptr() != out["b"].untyped_storage().data_ptr()
    entry = max(info.manifest.files, key=lambda e: e.size)
    path = tmp_path / "run" / info.path / entry.path
    data = bytearray(path.read_bytes())
    data[9] ^= 0x01  # inside the header's JSON: it no longer parses
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="digest differs"):
        store.load(1)
    with pytest.raises(CorruptCheckpointError, match=entry.path):
        store.load(1, verify=False)  # the header itself is refused


class _FailingWrites:
    """Wraps a storage so that writes of tensor files fail after ``after`` bytes."""

    def __init__(self, inner: Any, after: int) -> None:
        self._inner = inner
        self._after = after
        self.url = inner.url
        self.capabilities = inner.capabilities

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def open_write(self, path: str) -> Iterator[Any]:
        with self._inner.open_write(path) as f:
            if "tensors-" not in path:
                yield f
                return
            outer = self

            class Broken:
                written = 0

                def write(self, data: Any) -> int:
                    self.written += len(data)
                    if self.written > outer._after:
                        raise StorageError(f"write {path}: disk full (injected)")
                    return int(f.write(data))

                def fsync(self) -> None:
                    f.fsync()

            yield Broken()


def test_write_failure_mid_file_stops_hashing_and_keeps_latest(tmp_path: Path) -> None:
    inner = FsspecStorage(str(tmp_path / "run"))
    save_checkpoint(inner, 1, {"x": torch.ones(3)})  # type: ignore[arg-type]
    broken = _FailingWrites(inner, after=10 * MiB)
    with pytest.raises(StorageError, match="disk full"):
        save_checkpoint(broken, 2, _big_state(24))  # type: ignore[arg-type]
    assert not [t for t in threading.enumerate() if t.name == "ckptfs-hash"]
    latest = resolve_latest(inner)  # type: ignore[arg-type]
    assert latest is not None and latest.step == 1
    left = [p for p in (tmp_path / "run" / "checkpoints" / "step-000000000002").rglob("*")
            if p.is_file()]
    assert left == []  # the failed attempt's files were removed


def test_save_memory_overhead_is_bounded(tmp_path: Path) -> None:
    """Peak RSS above the state during a save stays under 64 MiB + 5% of the state (the state
    is streamed from tensor memory, never copied whole).  The benchmark measures it at 1 and
    4 GiB; this guards the property at 96 MiB."""
    state = _big_state(96)
    store = ckptfs.open(str(tmp_path / "run"), durable=False)
    timing = Timing()
    timed(lambda: store.save(1, state), timing, warm=0)
    if not timing.extra_rss:
        pytest.fail("cannot read peak RSS on this system (/proc/self/clear_refs)")
    assert timing.extra_rss[0] < 64 * MiB + 0.05 * 96 * MiB


def test_latest_is_three_http_requests_on_s3(request: pytest.FixtureRequest,
                                             tmp_path: Path) -> None:
    """One listing, one GET of the marker, one GET of the manifest (no HEAD before each GET)."""
    from ckptfs.bench.latest import count_http

    storage = _storage(request, tmp_path, "s3")
    for step in range(3):
        save_checkpoint(storage, step, {"x": torch.ones(2)})  # type: ignore[arg-type]
    with count_http(storage.fs) as counts:
        info = resolve_latest(storage)  # type: ignore[arg-type]
    assert info is not None and info.step == 2
    assert counts == {"ListObjectsV2": 1, "GetObject": 2}


def test_single_process_paths_never_import_the_sharded_machinery(tmp_path: Path) -> None:
    """A one-process job (save, load, verify, save_async, the manager's save and restore,
    incremental saves and their loads) must not pay torch.distributed.checkpoint's import
    (0.7-1 s in a fresh process: it made the first save of every process 2.5x slower).
    Checked in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys, torch, ckptfs\n"
        f"s = ckptfs.open({str(tmp_path)!r})\n"
        "s.save(1, {'a': torch.ones(3), 'n': 1}); s.load(); s.load(1, keys=['a']); s.verify()\n"
        "s.save_async(2, {'a': torch.ones(3)}).result(); s.latest(); s.steps()\n"
        "m = ckptfs.CheckpointManager(s, keep_last=2)\n"
        "m.save(3, model=torch.nn.Linear(2, 2)); m.restore_latest(model=torch.nn.Linear(2, 2))\n"
        f"i = ckptfs.open({str(tmp_path) + '-incr'!r}, incremental=True)\n"
        "w = torch.ones(1000); i.save(1, {'w': w}); i.save(2, {'w': w, 'n': 2})\n"
        "assert i.info(2).bytes_written < 1000 and i.latest().manifest.format_version == 3\n"
        "i.load(2); i.load(2, keys=['w']); i.verify(2); i.save_async(3, {'w': w}).result()\n"
        "j = ckptfs.open(i.url, incremental=True)\n"
        "assert j.save(4, {'w': w}).bytes_written < 1000\n"
        "j.load(4); j.load(4, mmap=True)\n"
        "bad = sorted(k for k in sys.modules if k.startswith(('torch.distributed.checkpoint',"
        " 'torch.distributed.tensor', 'ckptfs.protocol.sharded')))\n"
        "print('IMPORTED', bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert "IMPORTED []" in out, out
