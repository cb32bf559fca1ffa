"""The fault-injecting storage wrapper itself: if it did not crash, tear or fail exactly as
asked, every sweep built on it would prove nothing."""

from __future__ import annotations

import pytest

from ckptfs.errors import StorageError
from ckptfs.storage.base import OPTIONAL_CAPABILITIES, Storage, supports
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage, SimulatedCrash, TransientStorageError
from ckptfs.testing.reliability import raw_storage, state_for, store_on


def test_is_a_storage_and_keeps_the_capabilities(local_backend: Backend) -> None:
    """An explicit wrapper (no ``__getattr__``): the capabilities data and every optional
    capability of the storage it wraps (the full check: tests/storage/test_storage_wrappers.py)."""
    raw = raw_storage(local_backend)
    fs = FaultyStorage(raw)
    assert isinstance(fs, Storage)
    assert fs.capabilities == fs.inner.capabilities
    assert all(supports(fs, c) == supports(raw, c) for c in OPTIONAL_CAPABILITIES)
    assert "__getattr__" not in vars(FaultyStorage)


def test_optional_reads_are_requests_too(memory_backend: Backend) -> None:
    """A ranged read is a read: counted, and failed transiently like the others."""
    fs = FaultyStorage(raw_storage(memory_backend), transient_p=1.0)
    with pytest.raises(TransientStorageError, match="read_range"):
        fs.read_range("a", 0, 1)
    assert fs.stats.reads == 1 and [c.op for c in fs.calls] == ["read_range"]


def test_optional_mutations_are_numbered(local_backend: Backend) -> None:
    """``remove_empty_dir`` mutates: it is numbered, and a crash point like the others."""
    fs = FaultyStorage(raw_storage(local_backend), crash_at=2)
    fs.makedirs("d")
    with pytest.raises(SimulatedCrash):
        fs.remove_empty_dir("d")
    assert [c.op for c in fs.calls] == ["makedirs", "remove_empty_dir"]
    assert local_backend.raw_exists("d") or local_backend.raw_fs.isdir(
        f"{local_backend.raw_root}/d")


def test_simulated_crash_bypasses_except_exception() -> None:
    assert not issubclass(SimulatedCrash, Exception)
    assert issubclass(SimulatedCrash, BaseException)


def test_counts_then_crashes_and_refuses_everything_after(memory_backend: Backend) -> None:
    fs = FaultyStorage(raw_storage(memory_backend), crash_at=2)
    fs.write_bytes("a", b"1")
    with pytest.raises(SimulatedCrash):
        fs.write_bytes("b", b"2")
    assert fs.crashed and fs.count == 2
    for call in (lambda: fs.read_bytes("a"), lambda: fs.exists("a"), lambda: fs.delete("a"),
                 lambda: fs.list_dir(""), lambda: fs.write_bytes("c", b"3")):
        with pytest.raises(SimulatedCrash):
            call()
    assert memory_backend.raw_files() == {"a": 1}  # call 2 never took effect, nor any later


def test_crash_after_takes_effect_then_dies(memory_backend: Backend) -> None:
    fs = FaultyStorage(raw_storage(memory_backend), crash_at=1, crash_after=True)
    with pytest.raises(SimulatedCrash):
        fs.create_exclusive("m", b"marker")
    assert memory_backend.raw_read("m") == b"marker"


def test_save_crash_runs_no_cleanup(local_backend: Backend) -> None:
    """ckptfs removes a failed attempt in ``except BaseException``; a killed writer cannot."""
    counter = FaultyStorage(raw_storage(local_backend))
    store_on(counter).save(1, state_for(1))
    marker_call = next(c.index for c in counter.calls if c.op == "create_exclusive")
    fs = FaultyStorage(raw_storage(local_backend), crash_at=marker_call)
    with pytest.raises(SimulatedCrash):
        store_on(fs).save(2, state_for(2))
    left = local_backend.raw_files("checkpoints/step-000000000002")
    assert any(k.endswith("MANIFEST.json") for k in left), left  # the attempt stayed
    assert not any(k.endswith("COMPLETE") for k in left)


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_killed_stream_leaves_partial_only_where_visible(where: str,
                                                          request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    fs = FaultyStorage(raw_storage(backend), crash_at=2)
    with pytest.raises(SimulatedCrash), fs.open_write("f") as f:
        f.write(b"abcd")
        f.write(b"efgh")  # call 2: dies here
    files = backend.raw_files()
    if where == "s3":
        assert files == {}  # an uncompleted upload is no object
    else:
        assert backend.raw_read("f") == b"abcd"


def test_torn_write_keeps_a_prefix(local_backend: Backend) -> None:
    fs = FaultyStorage(raw_storage(local_backend), tear_at=1, tear_keep=0.25)
    with pytest.raises(SimulatedCrash):
        fs.write_bytes("f", b"12345678")
    assert local_backend.raw_read("f") == b"12"
    liar = FaultyStorage(raw_storage(local_backend), tear_at=1, tear_then_crash=False)
    with liar.open_write("g") as f:
        f.write(b"12345678")  # call 1 torn, no crash: the storage lies
    assert local_backend.raw_read("g") == b"1234"
    assert not liar.crashed


def test_transient_faults_are_seeded_and_typed(memory_backend: Backend) -> None:
    def run(seed: int) -> list[str]:
        fs = FaultyStorage(raw_storage(memory_backend), transient_p=0.3, seed=seed)
        out = []
        for i in range(200):
            try:
                fs.write_bytes(f"x{i}", b"1")
                out.append("ok")
            except TransientStorageError as exc:
                assert isinstance(exc, StorageError)
                out.append("after" if exc.after else "before")
        return out

    a, b = run(7), run(7)
    assert a == b
    failed = 200 - a.count("ok")
    assert 30 <= failed <= 90  # 30% of 200, loosely
    assert a.count("after") and a.count("before")


def test_hook_sees_every_call_in_order(memory_backend: Backend) -> None:
    seen: list[tuple[str, str]] = []
    fs = FaultyStorage(raw_storage(memory_backend), hook=lambda op, p: seen.append((op, p)))
    fs.write_bytes("a", b"1")
    fs.read_bytes("a")
    assert seen == [("write_bytes", "a"), ("read_bytes", "a")]


@pytest.mark.sharded
def test_figures_command_writes_json_and_table(tmp_path: pytest.TempPathFactory) -> None:
    """The command behind docs/reliability.md, on the in-process backend."""
    import json
    import re

    from ckptfs.testing.reliability.report import BEGIN, END, main

    doc = tmp_path / "r.md"  # type: ignore[operator]
    doc.write_text(f"# title\n\n{BEGIN}\nold\n{END}\n\ntail\n")
    out = tmp_path / "r.json"  # type: ignore[operator]
    assert main(["--backends", "memory", "--json", str(out), "--doc", str(doc)]) == 0
    results = json.loads(out.read_text())["results"]["memory"]
    assert {s["name"] for s in results} >= {"save-crash", "corruption", "hostile", "transient"}
    assert all(s["violations"] == [] for s in results)
    text = doc.read_text()
    assert text.startswith("# title") and text.endswith("tail\n") and "old" not in text
    row = next(line for line in text.splitlines() if line.startswith("| memory |"))
    detected = re.search(r"\| (\d+) / (\d+) \|", row)
    assert detected and detected.group(1) == detected.group(2) and int(detected.group(2)) > 40
