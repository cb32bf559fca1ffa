"""A hash whose package is missing names the extra that installs it: ``open`` and
``save`` with that algorithm refuse it so, and ``ckptfs bench hash`` says it skipped it instead
of leaving it out silently.  The packages are made unimportable (``sys.modules[name] = None``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ckptfs
from ckptfs.bench.hashing import bench_hash
from ckptfs.errors import HashAlgorithmUnavailableError
from ckptfs.format.hashing import ALGORITHMS, available_algorithms, new_hasher

#: algorithm -> (package, extra)
OPTIONAL = {"xxh3-128": ("xxhash", "xxhash"), "crc32c": ("crc32c", "crc32c"),
            "blake3": ("blake3", "blake3")}


@pytest.fixture
def no_hash_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    for package, _ in OPTIONAL.values():
        monkeypatch.setitem(sys.modules, package, None)


def test_optional_algorithms_are_the_ones_with_a_package() -> None:
    assert {n for n, a in ALGORITHMS.items() if a.package} == set(OPTIONAL)


@pytest.mark.parametrize("algorithm", sorted(OPTIONAL))
def test_a_missing_hash_package_names_its_extra(algorithm: str, no_hash_packages: None,
                                                tmp_path: Path) -> None:
    package, extra = OPTIONAL[algorithm]
    with pytest.raises(HashAlgorithmUnavailableError) as ei:
        new_hasher(algorithm)
    msg = str(ei.value)
    assert f"needs the {package!r} package" in msg
    assert f'pip install "ckptfs[{extra}]"' in msg and '"ckptfs[fast]"' in msg, msg
    with pytest.raises(HashAlgorithmUnavailableError, match=rf"ckptfs\[{extra}\]"):
        ckptfs.open(str(tmp_path / "run"), algorithm=algorithm)
    assert algorithm not in available_algorithms()


def test_bench_hash_says_what_it_skipped(no_hash_packages: None) -> None:
    lines: list[str] = []
    result = bench_hash(64 * 1024, chunk_sizes=(16 * 1024,), reps=1, log=lines.append)
    measured = [r["algorithm"] for r in result["rows"] if "error" not in r]
    assert measured == ["sha256"]
    for algorithm, (_, extra) in OPTIONAL.items():
        (line,) = [x for x in lines if f"hash {algorithm}: skipped" in x]
        assert f'pip install "ckptfs[{extra}]"' in line, line
    (row,) = [r for r in result["rows"] if r["algorithm"] == "xxh3-128"]
    assert 'ckptfs[xxhash]' in row["error"]
