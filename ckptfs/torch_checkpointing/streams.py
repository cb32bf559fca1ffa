"""The streams of `ckptfs.torch_checkpointing`: a writer that hashes what it writes and
records the file's sidecar when it closes, and a seekable reader that checks every block
against its digest before returning any of its bytes."""

from __future__ import annotations

import errno
import io
from contextlib import ExitStack
from types import TracebackType
from typing import Any, BinaryIO

from ckptfs.errors import CorruptCheckpointError
from ckptfs.format.hashing import new_hasher
from ckptfs.storage.base import Storage as Adapter
from ckptfs.storage.base import read_range
from ckptfs.torch_checkpointing.records import BlockHasher, FileSum, sidecar_bytes, sum_key


def byte_view(data: Any) -> memoryview:
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1 or view.format != "B":
        view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    return view


class HashingWriter(io.RawIOBase):
    """A write stream that hashes what it passes on and, closed cleanly, records the file's
    sidecar.  Leaving its ``with`` block by an exception aborts the upload where the backend
    can and records nothing."""

    def __init__(self, adapter: Adapter, key: str, algorithm: str, block_size: int) -> None:
        super().__init__()
        self._adapter, self._key, self._block_size = adapter, key, block_size
        self._hasher = BlockHasher(algorithm, block_size)
        self._stack = ExitStack()
        self._file: BinaryIO = self._stack.enter_context(adapter.open_write(key))
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._done:
            raise ValueError(f"write to closed stream {self._key}")
        view = byte_view(data)
        self._hasher.update(view)
        self._file.write(view)
        return len(view)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._stack.close()
            self._adapter.write_bytes(sum_key(self._key),
                                      sidecar_bytes(self._hasher.result(), self._block_size))
        super().close()

    def abort(self, exc: BaseException) -> None:
        if not self._done:
            self._done = True
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
        super().close()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self.abort(exc)
        else:
            self.close()


class VerifiedReader(io.RawIOBase):
    """A seekable reader of one file that fetches whole blocks and checks each against its
    digest before handing out any of its bytes (``expected`` None: unverified ranged reads)."""

    def __init__(self, adapter: Adapter, key: str, name: str, size: int,
                 expected: FileSum | None, block_size: int) -> None:
        super().__init__()
        self._adapter, self._key, self._name = adapter, key, name
        self._size, self._expected, self._block_size = size, expected, block_size
        self._pos = 0
        self._block: tuple[int, bytes] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, f"negative seek position in {self._name}")
        self._pos = base + offset
        return self._pos

    def _get_block(self, index: int) -> bytes:
        if self._block is not None and self._block[0] == index:
            return self._block[1]
        start = index * self._block_size
        length = min(self._block_size, self._size - start)
        data = read_range(self._adapter, self._key, start, length)
        if len(data) != length:
            raise CorruptCheckpointError(
                f"{self._name}: {len(data)} bytes at offset {start} where {length} were "
                f"recorded (the file is {self._size} bytes): it was truncated or replaced "
                "after it was written; restore it or delete the checkpoint", path=self._name)
        if self._expected is not None:
            algorithm, _, digest = self._expected.blocks[index].partition(":")
            h = new_hasher(algorithm)
            h.update(data)
            if h.hexdigest() != digest:
                raise CorruptCheckpointError(
                    f"{self._name}: bytes {start}-{start + length - 1} do not match the digest "
                    "recorded when it was written (the file changed after it was written); "
                    "restore it or delete the checkpoint", path=self._name)
        self._block = (index, data)
        return data

    def readinto(self, buffer: Any) -> int:
        # The views are released even when a block is refused: the caller may close the
        # buffer (an mmap) while the exception propagates.
        with memoryview(buffer) as view, view.cast("B") as out:
            return self._readinto(out)

    def _readinto(self, out: memoryview) -> int:
        done = 0
        while done < len(out) and self._pos < self._size:
            index, offset = divmod(self._pos, self._block_size)
            block = self._get_block(index)
            n = min(len(out) - done, len(block) - offset)
            out[done:done + n] = block[offset:offset + n]
            done += n
            self._pos += n
        return done

    def readall(self) -> bytes:
        chunks = []
        while self._pos < self._size:
            index, offset = divmod(self._pos, self._block_size)
            block = self._get_block(index)
            chunks.append(block[offset:])
            self._pos += len(block) - offset
            self._block = None
        return b"".join(chunks)

