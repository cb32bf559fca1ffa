"""The verified chunk reader (``ckptfs/protocol/chunks.py``): a sharded checkpoint's own file
and a referenced file read and checked alike; a short file, a missing file and a rotted chunk
are each a typed `CorruptCheckpointError` naming the file, the step and whose bytes they are."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ckptfs.errors import CorruptCheckpointError
from ckptfs.format.hashing import digest_bytes
from ckptfs.format.incremental import Reference, ReferencedFile
from ckptfs.format.sharded import Chunk, make_entry
from ckptfs.protocol.chunks import (
    StoredChunks,
    check_streamed,
    chunk_pieces,
    read_chunk,
    read_run,
    read_run_into,
)
from ckptfs.storage.fsspec import FsspecStorage

ATTEMPT = "checkpoints/step-000000000001/a-20000101T000000Z-0000000000000000"
DATA = bytes(range(40))
LENGTHS = (8, 0, 12, 20)  # a zero-length chunk shares its offset with the next one


def _chunks(data: bytes = DATA) -> tuple[Chunk, ...]:
    out, pos = [], 0
    for n in LENGTHS:
        out.append(Chunk(pos, n, digest_bytes("sha256", data[pos:pos + n]).split(":", 1)[1]))
        pos += n
    return tuple(out)


def _info(step: int) -> Any:
    return cast(Any, SimpleNamespace(path=ATTEMPT, step=step))


@pytest.fixture
def run(tmp_path: Path) -> tuple[FsspecStorage, Path]:
    (tmp_path / ATTEMPT).mkdir(parents=True)
    (tmp_path / ATTEMPT / "data.bin").write_bytes(DATA)
    return FsspecStorage(str(tmp_path)), tmp_path / ATTEMPT / "data.bin"


def _own(step: int = 1) -> StoredChunks:
    entry = make_entry("data.bin", len(DATA), "sha256", list(_chunks()), 0)
    return StoredChunks.of_entry(_info(step), entry)


def _reference(step: int = 2) -> StoredChunks:
    ref = Reference("ref-00000.safetensors", 1, ATTEMPT.rsplit("/", 1)[1], "data.bin",
                    len(DATA), "sha256", _chunks())
    return StoredChunks.of_reference(_info(step), ref)


def _read_into(storage: FsspecStorage, src: StoredChunks) -> bytes:
    bufs = [(c, memoryview(bytearray(c.length))) for c in src.chunks]
    read_run_into(storage, src, 0, bufs)
    return b"".join(bytes(v) for _, v in bufs)


def test_own_and_referenced_files_read_alike(run: tuple[FsspecStorage, Path]) -> None:
    storage, _ = run
    v4_ref = ReferencedFile.of(Reference("ref-00000.safetensors", 1, ATTEMPT.rsplit("/", 1)[1],
                                         "data.bin", len(DATA), "sha256", _chunks()))
    for src in (_own(), _reference(), StoredChunks.of_entry(_info(3), v4_ref)):
        assert src.location == f"{ATTEMPT}/data.bin"
        assert bytes(read_run(storage, src, 0, len(DATA))) == DATA
        assert bytes(read_run(storage, src, 8, 12)) == DATA[8:20]
        assert bytes(read_chunk(storage, src, src.chunks[3])) == DATA[20:]
        assert _read_into(storage, src) == DATA
        assert b"".join(bytes(p) for p in chunk_pieces(storage, src, src.chunks[3],
                                                        bound=7)) == DATA[20:]
        check_streamed(storage, src, src.chunks[3], bound=7)
    assert StoredChunks.of_entry(_info(3), v4_ref).whose() == \
        "referenced by step 3 as ref-00000.safetensors; read by rank 0"


@pytest.mark.parametrize("src,whose", [(_own(), "read by rank 0"),
                                       (_reference(), "referenced by step 2 as "
                                                      "ref-00000.safetensors")])
def test_rotted_chunk_is_named(run: tuple[FsspecStorage, Path], src: StoredChunks,
                               whose: str) -> None:
    storage, path = run
    rotted = bytearray(DATA)
    rotted[25] ^= 0x01
    path.write_bytes(bytes(rotted))
    reads = [lambda: read_run(storage, src, 0, len(DATA)),
             lambda: read_run(storage, src, 20, 20),
             lambda: read_chunk(storage, src, src.chunks[3]),
             lambda: _read_into(storage, src),
             lambda: check_streamed(storage, src, src.chunks[3], bound=7)]
    for read in reads:
        with pytest.raises(CorruptCheckpointError, match=r"bytes 20\.\.40 differ from their "
                           "digest") as ei:
            read()
        assert f"{ATTEMPT}/data.bin" in str(ei.value) and whose in str(ei.value)
        assert (ei.value.step, ei.value.path) == (src.step, src.location)
    assert bytes(read_chunk(storage, src, src.chunks[0])) == DATA[:8]  # the others are sound
    assert bytes(read_run(storage, src, 0, len(DATA), verify=False)) == bytes(rotted)


@pytest.mark.parametrize("src", [_own(), _reference()])
def test_short_and_missing_files_are_named(run: tuple[FsspecStorage, Path],
                                           src: StoredChunks) -> None:
    storage, path = run
    reads = [lambda: read_run(storage, src, 0, len(DATA)),
             lambda: read_chunk(storage, src, src.chunks[3]),
             lambda: _read_into(storage, src),
             lambda: check_streamed(storage, src, src.chunks[3], bound=7)]
    path.write_bytes(DATA[:30])
    for read in reads:
        with pytest.raises(CorruptCheckpointError, match="shorter than committed") as ei:
            read()
        assert f"{ATTEMPT}/data.bin" in str(ei.value) and src.whose() in str(ei.value)
        assert (ei.value.step, ei.value.path) == (src.step, src.location)
    path.unlink()
    for read in reads:
        with pytest.raises(CorruptCheckpointError, match="listed in the manifest but "
                           "missing") as ei:
            read()
        assert f"{ATTEMPT}/data.bin" in str(ei.value) and src.whose() in str(ei.value)
        assert (ei.value.step, ei.value.path) == (src.step, src.location)
