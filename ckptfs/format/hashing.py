"""Content hashing, shared by the writer, the verifier and the benchmarks.

A digest is written as ``"<algorithm>:<lowercase hex>"`` in manifests and markers, so a reader
needs nothing but the named algorithm to check a file.

The default is ``blake3``: cryptographic (what a security reviewer expects: it detects deliberate
as well as accidental modification) and, at about 5 GB/s per core, fast enough that hashing hides
behind the write; ``sha256`` (about 1.1-1.8 GB/s per core here) would make a save to the page
cache 2-3x slower (docs/benchmarks.md).  ``sha256`` needs only Python; ``xxh3-128`` and
``crc32c`` are faster non-cryptographic extras.  An algorithm whose package is missing raises
`HashAlgorithmUnavailableError` naming the package to install.  Every hasher accepts
``memoryview``s (no copies) and releases the GIL on large updates, so hashing runs on its own
thread beside the I/O (`BackgroundHasher`) and several files are hashed at once.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from ckptfs.errors import CorruptCheckpointError, HashAlgorithmUnavailableError
from ckptfs.format.limits import MAX_DIGEST_CHARS

DEFAULT_ALGORITHM = "blake3"


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


@dataclass(frozen=True)
class Algorithm:
    name: str
    package: str | None  # PyPI package that provides it; None for the standard library
    cryptographic: bool
    factory: Callable[[], Hasher]


def _sha256() -> Hasher:
    return hashlib.sha256()


def _blake3() -> Hasher:
    import blake3

    return cast(Hasher, blake3.blake3())


def _xxh3_128() -> Hasher:
    import xxhash

    return cast(Hasher, xxhash.xxh3_128())


class _Crc32c:
    """The ``crc32c`` package's function returns the running value; wrap it as a hasher.  (It
    takes any buffer, memoryviews included, and releases the GIL; google-crc32c rejects
    writable memoryviews.)"""

    def __init__(self) -> None:
        import crc32c

        self._value = 0
        self._fn = crc32c.crc32c

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._value = self._fn(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


ALGORITHMS: dict[str, Algorithm] = {
    "sha256": Algorithm("sha256", None, True, _sha256),
    "blake3": Algorithm("blake3", "blake3", True, _blake3),
    "xxh3-128": Algorithm("xxh3-128", "xxhash", False, _xxh3_128),
    "crc32c": Algorithm("crc32c", "crc32c", False, _Crc32c),
}


class _Crc32:
    """zlib's CRC-32 (the ISO-HDLC polynomial S3 calls ``CRC32``; botocore sends it with every
    upload by default), as a hasher.  ``zlib.crc32`` releases the GIL on large buffers."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


#: Whole-object checksums an object store computes or keeps itself, recorded in a manifest's
#: optional ``store_checksums`` (docs/protocol.md section 2.1) so that a copy can be checked
#: from metadata requests alone (docs/remote-verify.md).  Not content digests: never named in
#: ``files[].digest``.  Value: the checksum as big-endian lowercase hex.
STORE_CHECKSUMS: dict[str, Callable[[], Hasher]] = {
    "crc32": _Crc32,
    "crc32c": _Crc32c,
}
#: Hex digits of each store checksum's value.
STORE_CHECKSUM_HEX: dict[str, int] = {"crc32": 8, "crc32c": 8, "crc64nvme": 16}


def new_store_hasher(algorithm: str) -> Hasher:
    """A fresh hasher of the store checksum ``algorithm`` (one of `STORE_CHECKSUMS`)."""
    return STORE_CHECKSUMS[algorithm]()


#: Slice of a `MultiHasher` update: about an L2 cache.
MULTI_SLICE = 1 << 20


class MultiHasher:
    """Several hashers fed the same bytes in one pass over them (the content digest and the
    store's checksums, on the same helper thread): each slice of `MULTI_SLICE` bytes goes
    to every hasher in turn while it is still in the CPU's cache, so memory is read once.
    `hexdigest` is the first hasher's."""

    def __init__(self, first: Hasher, *others: Hasher) -> None:
        self.hashers = (first, *others)

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        if len(self.hashers) == 1:
            self.hashers[0].update(data)
            return
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        for start in range(0, len(view), MULTI_SLICE):
            piece = view[start:start + MULTI_SLICE]
            for h in self.hashers:
                h.update(piece)

    def hexdigest(self) -> str:
        return self.hashers[0].hexdigest()


def new_hasher(algorithm: str) -> Hasher:
    """A fresh incremental hasher for ``algorithm``."""
    try:
        algo = ALGORITHMS[algorithm]
    except KeyError:
        raise HashAlgorithmUnavailableError(
            f"unknown hash algorithm {algorithm!r}; choose one of {sorted(ALGORITHMS)}"
        ) from None
    try:
        return algo.factory()
    except ImportError as exc:
        raise HashAlgorithmUnavailableError(
            f"hash algorithm {algorithm!r} needs the {algo.package!r} package, which is not "
            f'installed: pip install "ckptfs[{algo.package}]" (or "ckptfs[fast]" for every '
            "fast hash)"
        ) from exc


def available_algorithms() -> list[str]:
    out = []
    for name in ALGORITHMS:
        try:
            new_hasher(name)
        except HashAlgorithmUnavailableError:
            continue
        out.append(name)
    return out


def format_digest(algorithm: str, hexdigest: str) -> str:
    return f"{algorithm}:{hexdigest}"


def parse_digest(digest: object) -> tuple[str, str]:
    """Split ``"algo:hex"``; raise `CorruptCheckpointError` on anything else."""
    if not isinstance(digest, str) or ":" not in digest or len(digest) > MAX_DIGEST_CHARS:
        raise CorruptCheckpointError(
            f"malformed digest {digest!r:.100}: expected 'algorithm:hex' of at most "
            f"{MAX_DIGEST_CHARS} characters")
    algo, hexpart = digest.split(":", 1)
    if algo not in ALGORITHMS or not hexpart or any(c not in "0123456789abcdef" for c in hexpart):
        raise CorruptCheckpointError(f"malformed digest {digest!r:.100}: unknown algorithm or "
                                     "not hex")
    return algo, hexpart


def digest_bytes(algorithm: str, data: bytes | bytearray | memoryview) -> str:
    h = new_hasher(algorithm)
    h.update(data)
    return format_digest(algorithm, h.hexdigest())


#: Smallest read of the verifying reader (one ``readinto`` per chunk, hashed while the next is
#: read).
CHUNK_SIZE = 8 * 1024 * 1024

#: Largest read.  A file is read in about 8 chunks between the two bounds: on object stores each
#: read is one ranged GET, and fewer, larger GETs are several times faster (moto: a 256 MiB file
#: in 8 MiB GETs 5.9 s, in 64 MiB GETs 1.6 s); on local disk the size hardly matters.
MAX_CHUNK_SIZE = 64 * 1024 * 1024


def read_chunk_size(total: int) -> int:
    """The ``readinto`` size for a file of ``total`` bytes."""
    return min(MAX_CHUNK_SIZE, max(CHUNK_SIZE, total // 8))

#: Files up to this size are hashed on the calling thread: a helper thread costs more than it
#: hides.
HASH_INLINE_BYTES = 4 * 1024 * 1024


class BackgroundHasher:
    """Feed chunks to a hasher that runs on a helper thread, in order, while the caller does I/O.

    The saver writes (or uploads, or fsyncs) a chunk while the previous ones are hashed; the
    reader reads the next chunk while the last one is hashed.  Both the hash libraries and file
    I/O release the GIL, so on two cores the hash hides almost entirely behind the I/O.  Chunks
    are not copied: the caller must not modify a chunk after feeding it (the saver feeds views of
    tensor memory, the reader views of a buffer it fills once).  ``max_lead`` bounds, in bytes,
    how far the caller may run ahead of the hasher.

    Use as a context manager; leaving it normally waits until every chunk is hashed, so the
    hasher's digest is final afterwards.  Leaving on an exception stops the helper without
    hashing the rest.  With ``background=False`` chunks are hashed at once on the calling
    thread (small files)."""

    def __init__(self, hasher: Hasher, *, max_lead: int = 256 * 1024 * 1024,
                 background: bool = True) -> None:
        self._hasher = hasher
        self._max_lead = max_lead
        self._background = background
        self._cond = threading.Condition()
        self._pending: collections.deque[bytes | bytearray | memoryview] = collections.deque()
        self._pending_bytes = 0
        self._closed = False
        self._abort = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BackgroundHasher:
        if self._background:
            self._thread = threading.Thread(target=self._run, name="ckptfs-hash", daemon=True)
            self._thread.start()
        return self

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        if not self._background:
            self._hasher.update(chunk)
            return
        n = len(chunk)
        with self._cond:
            while (self._error is None and self._pending
                   and self._pending_bytes + n > self._max_lead):
                self._cond.wait()
            if self._error is not None:
                raise self._error
            self._pending.append(chunk)
            self._pending_bytes += n
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending or self._abort:
                    return
                chunk = self._pending[0]
            try:
                self._hasher.update(chunk)
            except BaseException as exc:  # handed to the feeding thread
                with self._cond:
                    self._error = exc
                    self._pending.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                if self._abort:
                    return
                self._pending.popleft()
                self._pending_bytes -= len(chunk)
                self._cond.notify_all()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._closed = True
            if exc_type is not None:
                self._abort = True
                self._pending.clear()
            self._cond.notify_all()
        self._thread.join()
        if exc_type is None and self._error is not None:
            raise self._error


class PieceHasher:
    """A `Hasher` that digests consecutive pieces of a stream separately: the pieces are
    ``lengths`` bytes long, in order, whatever slices the stream is fed in (format v2 chunks:
    a file's header, then each item).  `digests` gives each piece's hex digest once the
    stream is complete; bytes beyond the last piece go into one more piece (the caller's size
    check reports them)."""

    def __init__(self, algorithm: str, lengths: list[int]) -> None:
        self._algorithm = algorithm
        self._lengths = list(lengths)
        self._index = 0
        self._hasher = new_hasher(algorithm)
        self._left = self._lengths[0] if self._lengths else -1
        self._done: list[str] = []

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
        while len(view):
            self._close_empty()
            if self._left < 0:  # past the last piece
                self._hasher.update(view)
                return
            n = min(self._left, len(view))
            self._hasher.update(view[:n])
            view, self._left = view[n:], self._left - n

    def _close_empty(self) -> None:
        while self._left == 0:
            self._done.append(self._hasher.hexdigest())
            self._hasher = new_hasher(self._algorithm)
            self._index += 1
            self._left = self._lengths[self._index] if self._index < len(self._lengths) else -1

    def hexdigest(self) -> str:
        return ""

    def digests(self) -> list[str]:
        """Each piece's hex digest (a stream that ended early: the partial piece, then empty
        ones; the caller's size check reports it)."""
        self._close_empty()
        out = list(self._done)
        if self._index < len(self._lengths):
            out.append(self._hasher.hexdigest())
            empty = new_hasher(self._algorithm).hexdigest()
            out += [empty] * (len(self._lengths) - len(out))
        return out
