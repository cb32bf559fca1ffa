"""The fast paths of the sharded (format v2) save and load keep every
guarantee: a full load reads chunks straight into its own tensors and still verifies each one
before returning (on local disk and through a ranged read elsewhere), a load into the caller's
tensors reads straight into them and never leaves an unverified byte there, a durable write
flushes large files in the background without losing an fsync error, and the commit's
directory fsyncs, moved after the data, all still happen before the marker."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import save_sharded
from sharded_tamper import RANK_FILE, attempt_dir, location

import ckptfs
from ckptfs.errors import CorruptCheckpointError, StorageError, UnsafeCheckpointError
from ckptfs.format.versions import is_sharded
from ckptfs.protocol import commit, sharded_read
from ckptfs.protocol.commit import Attempt
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.testing.conformance import assert_state_equal


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g),
                      "h": torch.randn(16, generator=g).to(torch.bfloat16),
                      "i": torch.arange(10, dtype=torch.int64), "s": torch.tensor(3.5),
                      "e": torch.zeros(0, 4)},
            "trainer": {"step": 7, "names": ["a", "b"]}}


def _spy_direct(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the chunks read straight into a destination (``read_chunks_into``)."""
    seen: list[int] = []
    real = sharded_read.read_chunks_into

    def spy(*args: Any, **kwargs: Any) -> None:
        seen.append(len(args[4]))
        real(*args, **kwargs)

    monkeypatch.setattr(sharded_read, "read_chunks_into", spy)
    return seen


def _spy_buffers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The addresses of the buffers chunks are read into (``read_chunks_into``)."""
    seen: list[int] = []
    real = sharded_read.read_chunks_into

    def spy(*args: Any, **kwargs: Any) -> None:
        seen.extend(torch.frombuffer(v, dtype=torch.uint8).data_ptr()
                    for _, v in args[4] if len(v))
        real(*args, **kwargs)

    monkeypatch.setattr(sharded_read, "read_chunks_into", spy)
    return seen


def _inside(addresses: list[int], tensors: Any) -> list[int]:
    """The ``addresses`` that lie in the memory of one of ``tensors``."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    return [a for a in addresses if any(lo <= a < hi for lo, hi in spans)]


def _flip(root: Path, step: int, attempt: str, key: str) -> None:
    """Flip the first byte of the stored item ``key`` in rank 0's file (digests unchanged)."""
    doc_path = attempt_dir(root, step, attempt) / "dcp.msgpack"
    import msgpack

    _, _, off, _ = location(msgpack.unpackb(doc_path.read_bytes()), key)[1:]
    path = attempt_dir(root, step, attempt) / RANK_FILE
    data = bytearray(path.read_bytes())
    data[off] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("url", ["local", "memory://perf-full-load"])
def test_full_load_reads_into_its_own_tensors_and_verifies(
        tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``store.load(step)`` of a v2 checkpoint: bit-exact, every dtype, empty and 0-d tensors,
    read straight into the result (local disk: positional reads; memory://: one ranged read
    copied into them); a flipped byte fails the load on both, naming the file."""
    store = ckptfs.open(str(tmp_path / "run") if url == "local" else url)
    state = _state()
    info = save_sharded(store.storage, 1, state)
    seen = _spy_direct(monkeypatch)
    assert_state_equal(store.load(1), state)
    assert sum(seen) >= 5  # the tensors went the direct way
    if url != "local":
        return
    _flip(tmp_path / "run", 1, info.attempt, "model.w")
    with pytest.raises(CorruptCheckpointError, match=r"rank-00000/data-0\.safetensors.*digest"):
        store.load(1)


def test_full_load_through_a_ranged_read_refuses_a_flipped_byte(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copying branch of ``read_chunks_into`` (no local files) verifies as well."""
    store = ckptfs.open("memory://perf-flip")
    info = save_sharded(store.storage, 1, _state())
    manifest = info.manifest
    assert is_sharded(manifest)
    entry = manifest.chunked(RANK_FILE)
    path = f"{info.path}/{RANK_FILE}"
    data = bytearray(store.storage.read_bytes(path))
    data[entry.chunks[1].offset] ^= 0xFF
    store.storage.write_bytes(path, bytes(data))
    with pytest.raises(CorruptCheckpointError, match="digest"):
        store.load(1)


@pytest.mark.parametrize("damage", ["flip", "short"])
def test_load_into_reads_into_the_callers_tensors_and_zeroes_a_failed_chunk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    """``load(into=...)`` reads each chunk that is exactly a target's region straight into the
    caller's tensor (one pass, no buffer, no second copy) and verifies it there; a chunk whose
    digest check or read fails has its target zeroed before the error is raised: after a
    failed load no target holds bytes that were not verified (neither the damaged ones nor
    what it held before)."""
    root = tmp_path / "run"
    store = ckptfs.open(str(root))
    state = _state()
    info = save_sharded(store.storage, 1, state)
    seen = _spy_buffers(monkeypatch)
    into = {"model": {k: torch.full_like(v, 0) for k, v in state["model"].items()},
            "trainer": {"step": 0, "names": []}}
    store.load(1, into=into)
    assert _inside(seen, [into["model"]["w"]]) != []  # read into the caller's memory
    assert torch.equal(into["model"]["w"], state["model"]["w"])
    if damage == "flip":
        _flip(root, 1, info.attempt, "model.w")
    else:  # the file cut inside w's chunk after the listing: the positional read comes short
        real = sharded_read.read_chunks_into

        def cut(*args: Any, **kwargs: Any) -> None:
            path = attempt_dir(root, 1, info.attempt) / RANK_FILE
            path.write_bytes(path.read_bytes()[:args[4][0][0].offset + 3])
            real(*args, **kwargs)

        monkeypatch.setattr(sharded_read, "read_chunks_into", cut)
    into["model"]["w"].fill_(-1.0)
    with pytest.raises(CorruptCheckpointError, match="digest" if damage == "flip" else "short"):
        store.load(1, into=into)
    assert not into["model"]["w"].any()  # zeroed: not -1, not the damaged bytes


def test_direct_read_refuses_a_short_file_and_a_link(tmp_path: Path) -> None:
    """The positional read checks what the listing checked, again: a rank file cut short, or
    replaced by a symbolic link, after the listing."""
    root = tmp_path / "run"
    store = ckptfs.open(str(root))
    info = save_sharded(store.storage, 1, _state())
    manifest = info.manifest
    assert is_sharded(manifest)
    entry = manifest.chunked(RANK_FILE)
    path = attempt_dir(root, 1, info.attempt) / RANK_FILE
    last = entry.chunks[-1]
    buf = memoryview(bytearray(last.length))
    good = path.read_bytes()
    path.write_bytes(good[:last.offset + 1])
    with pytest.raises(CorruptCheckpointError, match="shorter than committed"):
        sharded_read.read_chunks_into(store.storage, info, entry, last.offset, [(last, buf)])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(good)
    path.unlink()
    os.symlink(elsewhere, path)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        sharded_read.read_chunks_into(store.storage, info, entry, last.offset, [(last, buf)])
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        sharded_read.read_chunks_into(store.storage, info, entry, last.offset, [(last, buf)])


# ----------------------------------------------------------------------------------------------
# Writing: background flushes of large durable files, the commit's directory fsyncs at once


class _CountingFsync(FsspecStorage):
    """Local storage whose streamed files count their fsyncs (and can fail the ``fail_at``-th)."""

    fsyncs = 0
    fail_at = 0

    @contextmanager
    def open_write(self, path: str) -> Iterator[Any]:
        with super().open_write(path) as f:
            outer = self

            class Counting:
                def write(self, data: Any) -> int:
                    return int(f.write(data))

                def fsync(self) -> None:
                    outer.fsyncs += 1
                    if outer.fsyncs == outer.fail_at:
                        raise StorageError(f"fsync {path}: I/O error (injected)")
                    f.fsync()  # type: ignore[attr-defined]

            yield Counting()


def _pieces(storage: _CountingFsync, data: bytes) -> Iterator[memoryview]:
    """``data`` in 32 KiB pieces; after the first 128 KiB, wait (at most 10 s) for the first
    background fsync, so the test does not depend on when the helper thread gets to run."""
    step = 32 * 1024
    for i in range(0, len(data), step):
        if i == 4 * step:
            deadline = time.monotonic() + 10
            while storage.fsyncs == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
        yield memoryview(data)[i:i + step]


def test_large_durable_file_is_flushed_while_written(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit, "FLUSH_STEP", 64 * 1024)
    storage = _CountingFsync(str(tmp_path / "run"))
    data = os.urandom(1024 * 1024)
    att = Attempt.join(storage, 1, "a-test", durable=True)
    written = att.write_file("f.bin", len(data), lambda: _pieces(storage, data))
    assert written.size == len(data)
    assert (tmp_path / "run" / att.file_path("f.bin")).read_bytes() == data
    assert storage.fsyncs >= 2  # at least one along the way, and the final one
    assert not [t for t in threading.enumerate() if t.name == "ckptfs-flush"]


def test_an_early_fsync_error_fails_the_write(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A write-back error is reported to one fsync only: the background one's must fail the
    write (never hidden behind a final fsync that succeeds), and the helper thread is gone."""
    monkeypatch.setattr(commit, "FLUSH_STEP", 64 * 1024)
    storage = _CountingFsync(str(tmp_path / "run"))
    storage.fail_at = 1
    data = bytes(1024 * 1024)
    att = Attempt.join(storage, 1, "a-test", durable=True)
    with pytest.raises(StorageError, match="injected"):
        att.write_file("f.bin", len(data), lambda: _pieces(storage, data))
    assert storage.fsyncs == 1  # the failed background one: the write stopped there
    assert not [t for t in threading.enumerate() if t.name == "ckptfs-flush"]


def test_small_or_non_durable_files_have_no_flusher(tmp_path: Path) -> None:
    storage = _CountingFsync(str(tmp_path / "run"))
    att = Attempt.join(storage, 1, "a-test", durable=True)
    att.write_file("small.bin", 10, lambda: iter([memoryview(b"0123456789")]))
    assert storage.fsyncs == 1
    att = Attempt.join(storage, 1, "a-test", durable=False)
    att.write_file("big.bin", -1, lambda: iter([memoryview(bytes(commit.FLUSH_STEP + 1))]))
    assert storage.fsyncs == 1


class _Recording(FsspecStorage):
    """Local storage recording the directory syncs, renames and exclusive creates, in order."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.events: list[tuple[str, str]] = []

    def sync_dir(self, path: str) -> None:
        self.events.append(("sync", path))
        super().sync_dir(path)

    def sync_paths(self, files: Sequence[str], dirs: Sequence[str]) -> None:
        # the commit's one step (BatchedSync): recorded as its directories' syncs, in order,
        # then its files' (the data of the small files it did not fsync when written)
        self.events.extend(("sync", d) for d in dirs)
        self.events.extend(("sync-file", f) for f in files)
        super().sync_paths(files, dirs)

    def rename_dir(self, src: str, dst: str) -> None:
        self.events.append(("rename", dst))
        super().rename_dir(src, dst)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.events.append(("create", path))
        super().create_exclusive(path, data)


def test_commit_syncs_every_directory_once_after_the_rename_before_the_marker(
        tmp_path: Path) -> None:
    """The attempt's directory, the step's, checkpoints/ and the run root are fsynced once
    each, after the rename and before the marker (the power-cut sweep proves the result
    durable: tests/reliability/test_power_cut.py); nothing is synced at open."""
    storage = _Recording(str(tmp_path / "run"))
    info = commit.save_checkpoint(storage, 1, {"w": torch.ones(3)})
    step_dir = info.paths.dir
    assert storage.events[:1] == [("rename", info.paths.attempt_dir(info.attempt))]
    assert storage.events[1:5] == [("sync", info.paths.attempt_dir(info.attempt)),
                                   ("sync", step_dir), ("sync", "checkpoints"), ("sync", "")]
    attempt = info.paths.attempt_dir(info.attempt)
    assert storage.events[5:8] == [("sync-file", f"{attempt}/state.msgpack"),
                                   ("sync-file", f"{attempt}/tensors-00000.safetensors"),
                                   ("sync-file", f"{attempt}/MANIFEST.json")]
    assert storage.events[8:] == [("create", info.paths.marker), ("sync", step_dir)]
