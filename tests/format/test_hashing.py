"""ckptfs.format.hashing: every algorithm against published reference values, the error for a
missing package, digest formatting/parsing, and the background hasher used by save and load."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import threading

import pytest

from ckptfs.errors import CorruptCheckpointError, HashAlgorithmUnavailableError
from ckptfs.format.hashing import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    BackgroundHasher,
    available_algorithms,
    digest_bytes,
    format_digest,
    new_hasher,
    parse_digest,
)

# Published test vectors: FIPS 180-2 (sha256), the BLAKE3 reference implementation, xxHash's
# XXH3_128 of the empty input, and the CRC-32C check value of "123456789" (RFC 3720, iSCSI).
KNOWN = [
    ("sha256", b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    ("sha256", b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    ("blake3", b"", "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"),
    ("blake3", b"abc", "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"),
    ("xxh3-128", b"", "99aa06d3014798d86001c324468d497f"),
    ("xxh3-128", b"abc", "06b05ab6733a618578af5f94892f3950"),
    ("crc32c", b"", "00000000"),
    ("crc32c", b"123456789", "e3069283"),
]


def test_every_algorithm_is_available_here() -> None:
    assert set(available_algorithms()) == set(ALGORITHMS) == {
        "sha256", "blake3", "xxh3-128", "crc32c"}


def test_default_is_cryptographic() -> None:
    assert DEFAULT_ALGORITHM == "blake3"
    assert ALGORITHMS[DEFAULT_ALGORITHM].cryptographic


@pytest.mark.parametrize(("algorithm", "data", "expected"), KNOWN)
def test_known_values(algorithm: str, data: bytes, expected: str) -> None:
    assert digest_bytes(algorithm, data) == f"{algorithm}:{expected}"


@pytest.mark.parametrize(("algorithm", "data", "expected"), KNOWN)
def test_known_values_through_every_buffer_type(algorithm: str, data: bytes,
                                                expected: str) -> None:
    """The saver feeds writable memoryviews of tensor memory, the reader views of a bytearray,
    the manifest bytes: all must give the same digest, split anywhere."""
    for kind in (bytes, bytearray, memoryview, lambda b: memoryview(bytearray(b))):
        buf = kind(data)
        for cut in range(len(data) + 1):
            h = new_hasher(algorithm)
            h.update(buf[:cut])
            h.update(buf[cut:])
            assert h.hexdigest() == expected, (kind, cut)


def _pattern(n: int) -> bytearray:
    return bytearray((i * 2654435761 >> 7) & 0xFF for i in range(n))


def _reference(algorithm: str, data: bytes) -> str:
    """Each library called directly on the whole buffer (not through ckptfs)."""
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    if algorithm == "blake3":
        import blake3

        return str(blake3.blake3(data).hexdigest())
    if algorithm == "xxh3-128":
        import xxhash

        return str(xxhash.xxh3_128(data).hexdigest())
    import crc32c

    return f"{crc32c.crc32c(data):08x}"


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_large_input_in_uneven_chunks(algorithm: str) -> None:
    data = _pattern(3 * 1024 * 1024 + 17)
    view = memoryview(data)
    h = new_hasher(algorithm)
    pos = 0
    for step in (1, 4096, 1024 * 1024 + 3, 7, 10**9):
        h.update(view[pos:pos + step])
        pos += step
    assert h.hexdigest() == _reference(algorithm, bytes(data))


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="coreutils sha256sum not here")
def test_sha256_matches_coreutils(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = bytes(_pattern(1024 * 1024 + 5))
    p = tmp_path / "f"
    p.write_bytes(data)
    out = subprocess.run(["sha256sum", str(p)], capture_output=True, text=True, check=True)
    assert digest_bytes("sha256", data) == "sha256:" + out.stdout.split()[0]


@pytest.mark.parametrize(("algorithm", "module", "package"), [
    ("blake3", "blake3", "blake3"),
    ("xxh3-128", "xxhash", "xxhash"),
    ("crc32c", "crc32c", "crc32c"),
])
def test_missing_package_names_it(monkeypatch: pytest.MonkeyPatch, algorithm: str, module: str,
                                  package: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes ``import module`` raise ImportError
    with pytest.raises(HashAlgorithmUnavailableError) as info:
        new_hasher(algorithm)
    assert f'pip install "ckptfs[{package}]"' in str(info.value)  # the extra that installs it
    assert algorithm in str(info.value)
    assert isinstance(info.value, ImportError)
    assert algorithm not in available_algorithms()
    assert "sha256" in available_algorithms()


def test_unknown_algorithm() -> None:
    with pytest.raises(HashAlgorithmUnavailableError, match=r"md5.*sha256"):
        new_hasher("md5")


def test_format_and_parse_round_trip() -> None:
    for name in ALGORITHMS:
        d = digest_bytes(name, b"payload")
        algo, hexpart = parse_digest(d)
        assert algo == name
        assert format_digest(algo, hexpart) == d


@pytest.mark.parametrize("bad", [
    None, 12, b"sha256:00", "", "sha256", "sha256:", ":abcd", "md5:abcd", "sha256:ABCD",
    "sha256:xyz", "sha256: ab", "blake3:" + "a" * 300,
])
def test_parse_rejects_malformed(bad: object) -> None:
    with pytest.raises(CorruptCheckpointError, match="malformed digest"):
        parse_digest(bad)


# -- BackgroundHasher ------------------------------------------------------------------------


@pytest.mark.parametrize("background", [True, False])
def test_background_hasher_gives_the_same_digest(background: bool) -> None:
    data = _pattern(5 * 1024 * 1024)
    view = memoryview(data)
    h = new_hasher("blake3")
    with BackgroundHasher(h, max_lead=1024 * 1024, background=background) as bg:
        for off in range(0, len(data), 300_001):
            bg.feed(view[off:off + 300_001])
    assert h.hexdigest() == _reference("blake3", bytes(data))


class _Gated:
    """A hasher whose updates wait until released, counting the bytes it has seen."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.seen = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        assert self.go.wait(10)
        self.seen += len(data)

    def hexdigest(self) -> str:
        return str(self.seen)


def test_feed_blocks_when_the_hasher_lags_by_max_lead() -> None:
    gated = _Gated()
    done = threading.Event()
    with BackgroundHasher(gated, max_lead=10) as bg:
        bg.feed(b"x" * 8)

        def second() -> None:
            bg.feed(b"y" * 8)  # 16 > max_lead while the first is pending
            done.set()

        t = threading.Thread(target=second)
        t.start()
        assert not done.wait(0.3)  # still blocked: the lead is bounded
        gated.go.set()
        t.join(10)
        assert done.is_set()
    assert gated.hexdigest() == "16"


class _Failing:
    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        raise ValueError("hash library failed")

    def hexdigest(self) -> str:
        return ""


def test_hasher_error_reaches_the_caller() -> None:
    with pytest.raises(ValueError, match="hash library failed"), \
            BackgroundHasher(_Failing(), max_lead=1) as bg:
        for _ in range(1000):
            bg.feed(b"abc")


def test_caller_error_stops_the_helper_thread() -> None:
    gated = _Gated()
    before = {t.ident for t in threading.enumerate() if t.name == "ckptfs-hash"}
    with pytest.raises(RuntimeError, match="write failed"), \
            BackgroundHasher(gated, max_lead=100) as bg:
        bg.feed(b"a" * 10)
        gated.go.set()
        raise RuntimeError("write failed")
    alive = {t.ident for t in threading.enumerate() if t.name == "ckptfs-hash"}
    assert alive <= before
