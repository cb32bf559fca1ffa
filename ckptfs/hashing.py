"""Content hashing, shared by the writer, the verifier and the benchmarks.

A digest is written as ``"<algorithm>:<lowercase hex>"`` in manifests and markers, so a reader
needs nothing but the named algorithm to check a file.  ``sha256`` comes with Python; the fast
non-cryptographic ones are optional extras and raise :class:`HashAlgorithmUnavailableError`
naming the package to install.  Every hasher accepts ``memoryview``s (no copies) and releases the
GIL on large updates, so several files can be hashed on several threads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .errors import CorruptCheckpointError, HashAlgorithmUnavailableError

DEFAULT_ALGORITHM = "sha256"


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

    return blake3.blake3()  # type: ignore[no-any-return]


def _xxh3_128() -> Hasher:
    import xxhash

    return xxhash.xxh3_128()  # type: ignore[no-any-return]


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
            f"hash algorithm {algorithm!r} needs the {algo.package!r} package: "
            f"pip install {algo.package}"
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
    """Split ``"algo:hex"``; raise :class:`CorruptCheckpointError` on anything else."""
    if not isinstance(digest, str) or ":" not in digest or len(digest) > 200:
        raise CorruptCheckpointError(f"malformed digest {digest!r}: expected 'algorithm:hex'")
    algo, hexpart = digest.split(":", 1)
    if algo not in ALGORITHMS or not hexpart or any(c not in "0123456789abcdef" for c in hexpart):
        raise CorruptCheckpointError(f"malformed digest {digest!r}: unknown algorithm or not hex")
    return algo, hexpart


def digest_bytes(algorithm: str, data: bytes | bytearray | memoryview) -> str:
    h = new_hasher(algorithm)
    h.update(data)
    return format_digest(algorithm, h.hexdigest())


CHUNK_SIZE = 8 * 1024 * 1024
