"""The verified chunk reader: the one place ckptfs reads stored chunks and checks each against
the digest its manifest binds, for every reader of chunked files (formats v2-v4).

Whose bytes are read is described by `StoredChunks`: a file at a path from the run root, the
chunks a checkpoint's manifest binds there, and how errors name the reader (a sharded load's
rank; the step that references the file, and under which name).  Its callers: a sharded
checkpoint's own files and the files it references (format v4: `read_chunks`,
`read_chunks_into`), a format v3 checkpoint's references (load, verify, their header chunk), the
stored chunks an incremental save or a copy checks before reusing them, and a copy that
materializes a reference (`chunk_pieces`, `check_digest`).

- a run of whole chunks is one ranged read (`read_run`; `read_run_into` reads it straight
  into the caller's buffers, with one positional read per buffer on local disk);
- a long chunk can be read (`chunk_pieces`) or checked (`check_streamed`) in bounded reads;
- a missing file, a short read and a chunk that differs from its digest each raise
  `CorruptCheckpointError` naming the file, the step and whose bytes they are, in one wording.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch.distributed as dist

from ckptfs.errors import CorruptCheckpointError, StorageError, UnsafeCheckpointError
from ckptfs.format.hashing import digest_bytes, new_hasher
from ckptfs.format.incremental import Reference, ReferencedFile
from ckptfs.format.sharded import Chunk, ChunkedFileEntry
from ckptfs.protocol.resolve import CheckpointInfo, storage_url
from ckptfs.storage.base import LocalFiles, Storage, read_range, supports

__all__ = ["StoredChunks", "check_chunk", "check_digest", "check_streamed", "chunk_pieces",
           "entry_location", "read_chunk", "read_chunks", "read_chunks_into", "read_run",
           "read_run_into"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass(frozen=True)
class StoredChunks:
    """Whose bytes a chunk read takes: the file at ``location`` (from the run root, ``size``
    bytes) whose ``chunks`` (sorted by offset) the manifest of step ``step`` binds with
    ``algorithm``.  ``referenced_as``: the name step ``step`` reads the file by when it is
    another attempt's file (a reference); ``by_rank``: errors name the reading rank (a sharded
    read).  Errors name all three."""

    location: str
    size: int
    algorithm: str
    chunks: Sequence[Chunk]
    step: int
    referenced_as: str | None = None
    by_rank: bool = False

    @classmethod
    def of_entry(cls, info: CheckpointInfo, entry: ChunkedFileEntry, *, by_rank: bool = True
                 ) -> StoredChunks:
        """A chunked file of checkpoint ``info``: its own, or a file it references (format v4,
        `ReferencedFile`)."""
        name = entry.path if isinstance(entry, ReferencedFile) else None
        return cls(entry_location(info, entry), entry.size, entry.algorithm, entry.chunks,
                   info.step, name, by_rank)

    @classmethod
    def of_reference(cls, info: CheckpointInfo, ref: Reference) -> StoredChunks:
        """A file checkpoint ``info`` (format v3) references: the chunks it binds there."""
        return cls(ref.location, ref.size, ref.algorithm, ref.chunks, info.step, ref.path)

    def whose(self) -> str:
        """How errors name whose bytes these are ("" for a single-process reader's own file)."""
        parts = []
        if self.referenced_as is not None:
            parts.append(f"referenced by step {self.step} as {self.referenced_as}")
        if self.by_rank:
            parts.append(f"read by rank {_rank()}")
        return "; ".join(parts)

    def corrupt(self, message: str) -> CorruptCheckpointError:
        """The typed error, naming the file and the step."""
        return CorruptCheckpointError(message, step=self.step, path=self.location)

    def missing(self, where: str) -> CorruptCheckpointError:
        """The file is not there."""
        whose = self.whose()
        return self.corrupt(f"{where}: listed in the manifest but missing"
                           + (f" ({whose})" if whose else ""))

    def short(self, where: str, start: int, got: int, length: int) -> CorruptCheckpointError:
        """``got`` of the ``length`` bytes at ``start`` were there."""
        whose = self.whose()
        return self.corrupt(f"{where}: {got} B at offset {start}, the manifest declares {length} "
                           "B: the file is shorter than committed"
                           + (f" ({whose})" if whose else ""))

    def differs(self, where: str, chunk: Chunk, actual: str) -> CorruptCheckpointError:
        """The bytes of ``chunk`` hash to ``actual``, not to its digest."""
        whose = self.whose()
        return self.corrupt(
            f"{where}: bytes {chunk.offset}..{chunk.offset + chunk.length} differ from their "
            f"digest in the manifest (expected {chunk.digest}, got {actual}"
            + (f"; {whose}" if whose else "")
            + "): the file was modified or corrupted after commit")


def entry_location(info: CheckpointInfo, entry: ChunkedFileEntry) -> str:
    """Where ``entry``'s bytes are, from the run root: its attempt's file, or for a reference
    (format v4) the file of the attempt it names."""
    if isinstance(entry, ReferencedFile):
        return entry.location
    return f"{info.path}/{entry.path}"


def read_run(storage: Storage, src: StoredChunks, start: int, length: int, *,
             verify: bool = True) -> memoryview:
    """``length`` bytes at ``start`` of ``src`` (a run of whole chunks), in one ranged read,
    with ``verify`` every chunk of it checked against its digest.  The caller has compared the
    file's size with the listing (§5: nothing is requested or allocated beyond what the
    storage holds)."""
    if start < 0 or length < 0 or start + length > src.size:  # pragma: no cover - tiling
        where = storage_url(storage, src.location)
        raise src.corrupt(f"{where}: bytes {start}..{start + length} are outside its "
                         f"{src.size} B")
    try:
        data = read_range(storage, src.location, start, length)
    except FileNotFoundError:
        raise src.missing(storage_url(storage, src.location)) from None
    if len(data) != length:
        raise src.short(storage_url(storage, src.location), start, len(data), length)
    view = memoryview(data)
    if verify:
        pos = start
        while pos < start + length:
            chunk = _chunk_starting(src, pos)
            check_chunk(storage, src, chunk, view[pos - start:pos - start + chunk.length])
            pos += chunk.length
            if chunk.length == 0:
                break
    return view


def read_chunk(storage: Storage, src: StoredChunks, chunk: Chunk, *, verify: bool = True
               ) -> memoryview:
    """The bytes of ``chunk`` of ``src`` (one ranged read), with ``verify`` checked against its
    digest."""
    view = read_run(storage, src, chunk.offset, chunk.length, verify=False)
    if verify:
        check_chunk(storage, src, chunk, view)
    return view


def check_chunk(storage: Storage, src: StoredChunks, chunk: Chunk,
                data: bytes | bytearray | memoryview) -> None:
    """`CorruptCheckpointError` unless ``data`` (the bytes of ``chunk`` of ``src``) has the
    chunk's digest."""
    check_digest(storage, src, chunk, digest_bytes(src.algorithm, data).split(":", 1)[1])


def check_digest(storage: Storage, src: StoredChunks, chunk: Chunk, actual: str) -> None:
    """`CorruptCheckpointError` unless ``actual`` (the hex digest of the bytes of ``chunk`` of
    ``src``, with its algorithm, however they were hashed) is the chunk's digest."""
    if actual != chunk.digest:
        raise src.differs(storage_url(storage, src.location), chunk, actual)


def chunk_pieces(storage: Storage, src: StoredChunks, chunk: Chunk, *, bound: int
                 ) -> Iterator[memoryview]:
    """The bytes of ``chunk`` of ``src`` in ranged reads of at most ``bound`` bytes, each a
    buffer of its own, unverified (a copy hashes them as it writes them; `check_streamed`
    checks them)."""
    end = chunk.offset + chunk.length
    for off in range(chunk.offset, end, bound):
        yield read_run(storage, src, off, min(bound, end - off), verify=False)


def check_streamed(storage: Storage, src: StoredChunks, chunk: Chunk, *, bound: int) -> None:
    """``chunk`` of ``src`` read in reads of at most ``bound`` bytes (a chunk may be far larger
    than the memory a check should take) and checked against its digest."""
    hasher = new_hasher(src.algorithm)
    for piece in chunk_pieces(storage, src, chunk, bound=bound):
        hasher.update(piece)
    check_digest(storage, src, chunk, hasher.hexdigest())


def read_run_into(storage: Storage, src: StoredChunks, start: int,
                  chunks: list[tuple[Chunk, memoryview]], *, verify: bool = True) -> None:
    """Read the adjacent ``chunks`` of ``src`` (the first at ``start``) straight into their
    buffers (one positional read per buffer on local disk, else one ranged read copied into
    them) and, with ``verify``, check each against its digest.  Errors as `read_run`; the
    buffers hold unverified bytes when it raises."""
    length = sum(c.length for c, _ in chunks)
    if supports(storage, LocalFiles) and hasattr(os, "preadv"):
        _pread_into(storage, cast(LocalFiles, storage).local_path(src.location), start,
                    [v for _, v in chunks], src)
    else:
        data = read_run(storage, src, start, length, verify=False)
        pos = 0
        for c, v in chunks:
            if c.length:
                v[:] = data[pos:pos + c.length]
            pos += c.length
    if verify:
        for c, v in chunks:
            check_chunk(storage, src, c, v)


def _pread_into(storage: Storage, local: str, start: int, views: list[memoryview],
                src: StoredChunks) -> None:
    """Fill ``views`` with the bytes of the local file ``local`` from ``start`` on, in order
    (``preadv``: the kernel copies straight into them).  ``O_NOFOLLOW``: a file replaced by a
    link after the listing is refused."""
    where = storage_url(storage, src.location)
    fd = open_no_follow(local, where, step=src.step, path=src.location,
                        missing=lambda: src.missing(where))
    try:
        want = sum(len(v) for v in views)
        try:
            got = pread_views(fd, views, start)
        except OSError as exc:
            raise StorageError(f"read {where} failed: {exc}") from exc
        if got < want:
            raise src.short(where, start, got, want)
    finally:
        os.close(fd)


def open_no_follow(local: str, where: str, *, step: int | None, path: str,
                   missing: Callable[[], BaseException]) -> int:
    """The local file ``local`` (of the checkpoint file ``where``) opened for reading with
    ``O_NOFOLLOW``: ``missing()`` if it is not there, `UnsafeCheckpointError` if it is a
    symbolic link (replaced after the listing), `StorageError` otherwise."""
    try:
        return os.open(local, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise missing() from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeCheckpointError(
                f"{where} is a symbolic link; a checkpoint may not contain links. Refusing to "
                "read it", step=step, path=path) from None
        raise StorageError(f"{where}: cannot open: {exc}") from exc


def pread_views(fd: int, views: Sequence[memoryview], pos: int) -> int:
    """Read the consecutive ``views`` full from ``fd`` at ``pos`` (``preadv``, at most
    `_IOV_MAX` buffers a call); the bytes read: fewer where the file ends.  ``OSError`` as
    raised."""
    done = 0
    todo = [v for v in views if len(v)]
    while todo:
        n = os.preadv(fd, todo[:_IOV_MAX], pos + done)
        if n <= 0:
            break
        done += n
        while todo and n >= len(todo[0]):
            n -= len(todo.pop(0))
        if n:
            todo[0] = todo[0][n:]
    return done


#: Buffers per ``preadv`` call (Linux's IOV_MAX).
_IOV_MAX = 1024


def _chunk_starting(src: StoredChunks, offset: int) -> Chunk:
    chunks = src.chunks
    lo, hi = 0, len(chunks)
    while lo < hi:
        mid = (lo + hi) // 2
        if chunks[mid].offset < offset:
            lo = mid + 1
        else:
            hi = mid
    # Zero-length chunks share their offset with the next one: take the longest.
    while lo + 1 < len(chunks) and chunks[lo].length == 0 and chunks[lo + 1].offset == offset:
        lo += 1
    if lo >= len(chunks) or chunks[lo].offset != offset:
        raise CorruptCheckpointError(f"{src.location}: no chunk starts at {offset}",
                                     step=src.step, path=src.location)
    return chunks[lo]


# -- a sharded checkpoint's files (formats v2, v4) ---------------------------------------------


def read_chunks(storage: Storage, info: CheckpointInfo, entry: ChunkedFileEntry, start: int,
                length: int, *, verify: bool = True) -> memoryview:
    """`read_run` of a chunked file of a sharded checkpoint (its own, or one it references):
    errors name the file and the rank reading it."""
    return read_run(storage, StoredChunks.of_entry(info, entry), start, length, verify=verify)


def read_chunks_into(storage: Storage, info: CheckpointInfo, entry: ChunkedFileEntry,
                     start: int, chunks: list[tuple[Chunk, memoryview]], *,
                     verify: bool = True) -> None:
    """`read_run_into` of a chunked file of a sharded checkpoint, errors as `read_chunks`."""
    read_run_into(storage, StoredChunks.of_entry(info, entry), start, chunks, verify=verify)
