"""A load of a single-process checkpoint on local disk reads a large file in spans on several
threads, hashed in file order (ckptfs/protocol/spans.py), into tensors allocated on the
caller's thread (`preallocate`).  Bit-exact, every byte verified, every damage named, the
pool's threads given back in a forked child."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptfs.protocol import reader, spans
from ckptfs.protocol.spans import SpanReads, cut


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(1536, 1024, generator=g),  # 6 MiB
                  "b": torch.randn(1024, generator=g),
                  "h": torch.randn(1024, 1024, generator=g).half()},
        "optimizer": {"m": torch.randn(3072, 1024, generator=g),  # 12 MiB
                      "v": torch.randn(2048, 1024, generator=g),
                      "step": torch.tensor(7)},
        "epoch": 3,
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


@pytest.fixture(autouse=True)
def two_processors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load shares its bytes over two processors, whatever this machine has."""
    monkeypatch.setattr(spans, "processors", lambda: 2)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The spans of every file read in spans, per file."""
    seen: list[int] = []

    class Counting(SpanReads):
        def __enter__(self) -> SpanReads:
            seen.append(len(self.spans))
            return super().__enter__()

    monkeypatch.setattr(reader, "SpanReads", Counting)
    return seen


def test_cut_tiles_the_views_in_order() -> None:
    rng = random.Random(5)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 3, 64, 1000, 5000]) for _ in range(rng.randrange(1, 12))]
        views = [memoryview(bytearray(n)) for n in sizes]
        span = rng.choice([1, 7, 64, 4096])
        start = rng.randrange(0, 100)
        out = cut(views, start, span)
        total = sum(sizes)
        assert [len(v) for _, vs in out for v in vs if len(v)] == \
            [len(p) for p in _pieces(views, span)]
        offset = start
        for k, (at, vs) in enumerate(out):
            assert at == offset
            n = sum(len(v) for v in vs)
            assert n == span or (k == len(out) - 1 and n <= span)
            offset += n
        assert offset == start + total


def _pieces(views: list[memoryview], span: int) -> list[memoryview]:
    """The views cut at every multiple of ``span`` (the reference for `cut`)."""
    out, done = [], 0
    for v in views:
        at = 0
        while at < len(v):
            n = min(len(v) - at, span - done % span)
            out.append(v[at:at + n])
            at += n
            done += n
    return out


def test_windows_share_the_bytes_over_the_processors(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptfs.protocol.spans import windows_of

    assert windows_of([22, 44], 4) == [1, 2]  # 2 processors: the larger file in 2 spans
    assert windows_of([512, 512], 4) == [1, 1]  # balanced: each in one stream
    assert windows_of([100], 4) == [2]
    assert windows_of([22, 44], 1) == [1, 1]
    assert windows_of([], 4) == []
    monkeypatch.setattr(spans, "processors", lambda: 16)
    assert windows_of([10, 10, 80], 8) == [1, 1, 7]
    assert windows_of([100], 4) == [4]
    monkeypatch.setattr(spans, "processors", lambda: 1)
    assert windows_of([22, 44], 4) == [1, 1]


def test_a_large_file_is_read_in_spans_bit_exact(tmp_path: Any, counted: list[int]) -> None:
    state = _state()
    store = ckptfs.open(str(tmp_path))
    store.save(1, state)
    assert _equal(store.load(1), state)
    # the model (8 MiB + 4 KiB) in one stream, the optimizer (20 MiB + 8 B): larger than its
    # share of two processors, in 6 spans, 2 at a time
    assert counted == [6]
    counted.clear()
    assert _equal(store.load(1, verify=False), state)
    assert counted == [6]


def test_one_thread_reads_in_one_stream(tmp_path: Any, counted: list[int]) -> None:
    ckptfs.open(str(tmp_path)).save(1, _state())
    assert _equal(ckptfs.open(str(tmp_path), threads=1).load(1), _state())
    assert counted == []


@pytest.mark.parametrize("where", [0.02, 0.3, 0.55, 0.99])
def test_a_flipped_byte_in_any_span_is_named(tmp_path: Any, where: float,
                                             counted: list[int]) -> None:
    store = ckptfs.open(str(tmp_path))
    info = store.save(1, _state())
    entry = max(info.manifest.files, key=lambda e: e.size)
    path = f"{tmp_path}/{info.path}/{entry.path}"
    at = int(entry.size * where)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match=f"{entry.path}: content digest differs"):
        store.load(1)
    assert counted  # it was read in spans
    with pytest.raises(CorruptCheckpointError, match=f"{entry.path}: content digest differs"):
        store.verify(1)


def test_spans_of_a_missing_or_linked_file(tmp_path: Any) -> None:
    data = os.urandom(1000)
    (tmp_path / "f").write_bytes(data)
    os.symlink(tmp_path / "f", tmp_path / "link")
    views = [memoryview(bytearray(300)) for _ in range(3)]
    parts = cut(views, 10, 256)
    with SpanReads(str(tmp_path / "f"), parts, 2, where="f", step=1, path="f") as r:
        assert all(r.wait(k) for k in range(len(parts)))
        assert r.extra_byte(900)  # 1000 bytes: one past 900
        assert not r.extra_byte(1000)
    assert b"".join(bytes(v) for v in views) == data[10:910]
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"), \
            SpanReads(str(tmp_path / "link"), parts, 2, where="link", step=1, path="link"):
        pass
    with pytest.raises(CorruptCheckpointError, match="missing"), \
            SpanReads(str(tmp_path / "none"), parts, 2, where="none", step=1, path="none"):
        pass
    # a file shorter than its spans: the span that reaches its end says so
    short = cut([memoryview(bytearray(2000))], 0, 512)
    with SpanReads(str(tmp_path / "f"), short, 2, where="f", step=1, path="f") as r:
        assert [r.wait(k) for k in range(len(short))] == [True, False, False, False]


def test_many_small_tensors_in_one_span(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                        counted: list[int]) -> None:
    """More tensors in a span than one preadv takes (its buffers are read in turns)."""
    monkeypatch.setattr(spans, "SPAN_BYTES", 32 * 1024)  # 1,638 tensors of 20 B per span
    state = {"model": {f"t{i}": torch.full((5,), float(i)) for i in range(6000)}}
    store = ckptfs.open(str(tmp_path))
    store.save(1, state)
    assert _equal(store.load(1), state)
    assert counted == [4]


def test_a_state_document_declaring_more_than_its_file_allocates_nothing_first() -> None:
    """`preallocate` allocates a file's tensors only when their bytes fit its size in the
    manifest (a hostile document cannot make the load allocate before the header is
    checked)."""
    from ckptfs.format.manifest import FileEntry
    from ckptfs.format.serialize import TensorSlot

    entry = FileEntry("tensors-00000.safetensors", 1024, "blake3:" + "0" * 64)
    huge = [TensorSlot(entry.path, "w", "F32", (1 << 40, 1 << 20))]
    fits = [TensorSlot(entry.path, "w", "F32", (16, 16))]
    assert reader.preallocate(huge, {entry.path: entry}) == {}
    empty_but_wide = [TensorSlot(entry.path, "w", "F32", (0, 1 << 63))]  # 0 bytes, no int64
    assert reader.preallocate(empty_but_wide, {entry.path: entry}) == {}
    got = reader.preallocate(fits, {entry.path: entry})
    assert tuple(got[entry.path]["w"].shape) == (16, 16)


def test_a_forked_child_reads_in_spans(tmp_path: Any) -> None:
    """The pool's threads do not survive a fork: a forked child makes its own and reads in
    spans (the child touches no torch: only the spans' own reads, into plain buffers)."""
    data = os.urandom(3 * 4096 + 17)
    (tmp_path / "f").write_bytes(data)

    def read_all() -> bytes:
        views = [memoryview(bytearray(len(data)))]
        parts = cut(views, 0, 4096)
        with SpanReads(str(tmp_path / "f"), parts, 2, where="f", step=1, path="f") as r:
            assert all(r.wait(k) for k in range(len(parts)))
        return bytes(views[0])

    assert read_all() == data  # the parent's pool exists, its threads started
    pid = os.fork()
    if pid == 0:  # the child: exit at once, its status the outcome
        code = 1
        try:
            code = 0 if read_all() == data else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish its span reads in 60 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert read_all() == data  # and the parent's pool still works
