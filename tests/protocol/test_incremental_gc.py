"""Deleting shared bytes (docs/protocol.md §9.5): the two-phase reference scan, ``store.delete``
keeping retired attempts, gc freeing an attempt only once nothing references it, and the sizes
``ckptfs ls`` shows.

Most tests build their format v3 checkpoints by hand (raw writes through the backdoor: files,
a v3 manifest and a marker binding it) so the sizes and references are exactly known; the last
ones save through ``ckptfs.open(url, incremental=True)`` and load what a delete kept.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, BinaryIO

import pytest

from ckptfs.cli.core import main as cli_main
from ckptfs.errors import CorruptCheckpointError
from ckptfs.format.hashing import digest_bytes
from ckptfs.format.incremental import DEFAULT_GRACE_S, Reference
from ckptfs.format.layout import CHECKPOINTS_DIR, STATE_NAME, StepPaths, new_attempt_name
from ckptfs.format.manifest import MARKER_DIGEST_ALGORITHM, Manifest, Marker
from ckptfs.format.sharded import Chunk, ChunkedFileEntry, chunk_list_digest
from ckptfs.format.versions import CHUNKED, REFERENCES
from ckptfs.lifecycle.gc import DEFAULT_GRACE, collect
from ckptfs.protocol.references import run_usage, scan_references
from ckptfs.storage.base import Entry, Storage, StorageWrapper
from ckptfs.testing.backend import Backend

ALGO = "sha256"
ZERO = timedelta(0)


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


@pytest.fixture(params=["local", "memory"])
def quick_backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def _hex(data: bytes) -> str:
    return digest_bytes(ALGO, data).split(":", 1)[1]


@dataclass
class Planted:
    step: int
    attempt: str
    files: dict[str, bytes]
    manifest: Manifest

    @property
    def dir(self) -> str:
        return StepPaths(self.step).attempt_dir(self.attempt)

    def location(self, name: str) -> str:
        return f"{self.dir}/{name}"

    def ref(self, name: str, index: int, *spans: tuple[int, int]) -> Reference:
        """A reference to the chunks ``spans`` of this attempt's file ``name``."""
        data = self.files[name]
        chunks = tuple(Chunk(o, n, _hex(data[o:o + n])) for o, n in spans)
        return Reference(f"ref-{index:05d}.safetensors", self.step, self.attempt, name,
                         len(data), ALGO, chunks)


def plant_v3(backend: Backend, step: int, files: dict[str, bytes], *,
             refs: tuple[Reference, ...] = (), commit: bool = True, age_h: float = 2.0,
             attempt: str | None = None) -> Planted:
    """A v3 attempt written by hand: ``files`` (each one chunk), ``state.msgpack``, a v3
    manifest with ``refs``, and (``commit``) the marker binding it."""
    attempt = attempt or new_attempt_name(datetime.now(timezone.utc) - timedelta(hours=age_h))
    files = {STATE_NAME: b"\x80" * 7, **files}
    entries = []
    for name, data in files.items():
        chunks = (Chunk(0, len(data), _hex(data)),)
        entries.append(ChunkedFileEntry(name, len(data), chunk_list_digest(ALGO, chunks),
                                        chunks, None))
    manifest = Manifest(step, attempt, tuple(entries), "2026-01-01T00:00:00Z", ALGO, {},
                        frozenset({CHUNKED, REFERENCES}), references=refs)
    paths = StepPaths(step)
    for name, data in files.items():
        backend.raw_write(paths.file(attempt, name), data)
    mbytes = manifest.to_bytes()
    backend.raw_write(paths.manifest(attempt), mbytes)
    if commit:
        marker = Marker(step, attempt, digest_bytes(MARKER_DIGEST_ALGORITHM, mbytes),
                        len(mbytes), manifest.created, {})
        backend.raw_write(paths.marker, marker.to_bytes())
    return Planted(step, attempt, files, manifest)


def attempt_files(backend: Backend, planted: Planted) -> dict[str, int]:
    return backend.raw_files(planted.dir)


def a_and_b(backend: Backend) -> tuple[Planted, Planted]:
    """Step 1 (A: 100 B of its own tensors) and step 2 (B: its own 30 B, and 60 B of A's file
    used through a reference: the header chunk and one tensor)."""
    a = plant_v3(backend, 1, {"tensors-00000.safetensors": bytes(range(100))})
    b = plant_v3(backend, 2, {"tensors-00000.safetensors": b"b" * 30},
                 refs=(a.ref("tensors-00000.safetensors", 0, (0, 20), (50, 40)),))
    return a, b


# -- the scan ---------------------------------------------------------------------------------


def test_scan_returns_committed_references(quick_backend: Backend) -> None:
    a, _ = a_and_b(quick_backend)
    refs = scan_references(quick_backend.open().storage, grace_s=DEFAULT_GRACE_S)
    assert refs == {a.location("tensors-00000.safetensors"): {(0, 20), (50, 40)}}


def test_scan_keeps_young_in_flight_references_only(quick_backend: Backend) -> None:
    a = plant_v3(quick_backend, 1, {"tensors-00000.safetensors": b"a" * 64})
    # an uncommitted save past its fence: young (its name says 1 minute ago)
    plant_v3(quick_backend, 2, {}, refs=(a.ref("tensors-00000.safetensors", 0, (0, 64)),),
             commit=False, age_h=1 / 60)
    storage = quick_backend.open().storage
    assert scan_references(storage, grace_s=3600) == {
        a.location("tensors-00000.safetensors"): {(0, 64)}}
    assert scan_references(storage, grace_s=30) == {}  # older than this grace: not in flight


def test_scan_ignores_undecodable_in_flight_manifest(quick_backend: Backend) -> None:
    a_and_b(quick_backend)
    young = new_attempt_name(datetime.now(timezone.utc))
    quick_backend.raw_write(StepPaths(3).manifest(young), b'{"half a manifest": ')
    refs = scan_references(quick_backend.open().storage, grace_s=3600)
    assert len(refs) == 1


class BetweenPhases(StorageWrapper):
    """Runs ``action`` when the scan's second listing of ``checkpoints/`` starts (the start of
    phase 2), and records every call, to check that phase 1 read everything before it."""

    def __init__(self, inner: Storage, action: Any) -> None:
        super().__init__(inner)
        self.action = action
        self.calls: list[str] = []

    def list_tree(self, path: str) -> list[Entry]:
        self.calls.append(f"list_tree {path}")
        if sum(c.startswith("list_tree") for c in self.calls) == 2:
            self.action()
        return super().list_tree(path)

    def read_bytes(self, path: str) -> bytes:
        self.calls.append(f"read {path}")
        return super().read_bytes(path)


def test_scan_phase_1_before_phase_2(quick_backend: Backend) -> None:
    """A saver S reusing C's own file writes its manifest (and fences on C) while the scan runs
    phase 1; then C's marker is deleted.  Phase 1 read C while it was committed (its references
    to A kept); phase 2 lists after both, so it sees S's manifest (C's own file kept)."""
    a = plant_v3(quick_backend, 1, {"tensors-00000.safetensors": b"a" * 40}, commit=False)
    c = plant_v3(quick_backend, 5, {"tensors-00000.safetensors": b"c" * 50},
                 refs=(a.ref("tensors-00000.safetensors", 0, (0, 40)),))

    def saver_then_delete() -> None:
        plant_v3(quick_backend, 6, {}, commit=False, age_h=0,
                 refs=(c.ref("tensors-00000.safetensors", 0, (0, 50)),))
        quick_backend.raw_delete(StepPaths(5).marker)

    storage = BetweenPhases(quick_backend.open().storage, saver_then_delete)
    refs = scan_references(storage, grace_s=DEFAULT_GRACE_S)
    assert refs == {a.location("tensors-00000.safetensors"): {(0, 40)},
                    c.location("tensors-00000.safetensors"): {(0, 50)}}
    phase2 = [i for i, call in enumerate(storage.calls) if call.startswith("list_tree")][1]
    assert any(c.attempt in call for call in storage.calls[:phase2])  # C read in phase 1
    assert all("step-000000000006" not in call for call in storage.calls[:phase2])
    assert any("step-000000000006" in call for call in storage.calls[phase2:])


# -- delete and gc ----------------------------------------------------------------------------


def test_delete_keeps_referenced_then_gc_frees_everything(backend: Backend) -> None:
    a, _b = a_and_b(backend)
    store = backend.open()
    a_files = attempt_files(backend, a)
    store.delete(1)
    assert store.steps() == [2]
    # retired: without its marker, only the referenced file and the manifest kept (the
    # manifest says "v3, may be referenced" to a later delete or gc); state.msgpack freed
    kept = {p: n for p, n in a_files.items()
            if p.endswith(("/tensors-00000.safetensors", "/MANIFEST.json"))}
    assert attempt_files(backend, a) == kept and len(kept) == len(a_files) - 1
    assert not backend.raw_exists(StepPaths(1).marker)
    report = collect(store.storage, older_than=DEFAULT_GRACE)
    assert report.items == []
    assert [i.path for i in report.retired] == [a.dir]
    assert report.retired[0].bytes == sum(kept.values()) == report.bytes_retired
    assert report.as_dict()["bytes_retired"] == report.bytes_retired
    store.delete(2)
    assert store.steps() == [] and backend.raw_files(StepPaths(2).dir) == {}
    assert attempt_files(backend, a) == kept  # b was young: no gc in delete
    report = collect(store.storage, older_than=ZERO)
    assert [i.path for i in report.items if i.kind == "attempt"] == [a.dir]
    assert report.retired == [] and report.bytes_freed == sum(kept.values())
    assert backend.raw_files(CHECKPOINTS_DIR) == {}  # 0 leaked bytes


def test_delete_referencing_step_first_frees_it_at_once(quick_backend: Backend) -> None:
    a_and_b(quick_backend)
    store = quick_backend.open()
    store.delete(2)  # nothing references B: gone whole
    assert quick_backend.raw_files(StepPaths(2).dir) == {}
    store.delete(1)  # B is gone: nothing references A any more
    assert quick_backend.raw_files(CHECKPOINTS_DIR) == {}


def test_in_flight_save_protects_from_delete_and_gc(quick_backend: Backend) -> None:
    a = plant_v3(quick_backend, 1, {"tensors-00000.safetensors": b"a" * 80})
    s = plant_v3(quick_backend, 2, {"tensors-00000.safetensors": b"s" * 10}, commit=False,
                 age_h=0.1, refs=(a.ref("tensors-00000.safetensors", 0, (0, 80)),))
    store = quick_backend.open()
    kept = {p: n for p, n in attempt_files(quick_backend, a).items()
            if not p.endswith("/state.msgpack")}  # what a retired attempt keeps
    store.delete(1)
    assert attempt_files(quick_backend, a) == kept
    report = collect(store.storage, older_than=DEFAULT_GRACE)
    assert [i.path for i in report.retired] == [a.dir] and s.dir in report.kept_young
    assert report.items == []
    # past the grace the save is no longer in flight (its lease ran out): both freed
    report = collect(store.storage, older_than=timedelta(minutes=1))
    assert sorted(i.path for i in report.items if i.kind == "attempt") == sorted([a.dir, s.dir])
    assert quick_backend.raw_files(CHECKPOINTS_DIR) == {}


def test_gc_keeps_attempt_retired_by_a_crashed_delete(quick_backend: Backend) -> None:
    """A delete that crashed right after removing the marker leaves A whole; gc must not take
    it while B references it."""
    a, _b = a_and_b(quick_backend)
    quick_backend.raw_delete(StepPaths(1).marker)
    report = collect(quick_backend.open().storage, older_than=ZERO)
    assert [i.path for i in report.retired] == [a.dir] and report.items == []
    assert "B of its files are referenced" in (report.retired[0].note or "")
    assert attempt_files(quick_backend, a)


def test_old_uncommitted_v1_attempt_still_collected_without_a_scan(
        quick_backend: Backend) -> None:
    a_and_b(quick_backend)
    old = StepPaths(9).attempt_dir(new_attempt_name(datetime.now(timezone.utc)
                                                    - timedelta(hours=3)))
    quick_backend.raw_write(f"{old}/state.msgpack", b"s" * 10)
    report = collect(quick_backend.open().storage, older_than=DEFAULT_GRACE)
    assert [i.path for i in report.items if i.kind == "attempt"] == [old]


class Counting(StorageWrapper):
    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.calls: list[str] = []

    def list_tree(self, path: str) -> list[Entry]:
        self.calls.append(f"list_tree {path}")
        return super().list_tree(path)

    def read_bytes(self, path: str) -> bytes:
        self.calls.append(f"read {path}")
        return super().read_bytes(path)


def test_delete_of_a_v1_step_runs_no_scan(quick_backend: Backend) -> None:
    import torch

    store = quick_backend.open()
    store.save(1, {"x": torch.ones(4)})
    store.save(2, {"x": torch.zeros(4)})
    attempt = store.info(1).attempt
    counting = Counting(store.storage)
    store.storage = counting
    store.delete(1)
    # one read of the step's manifest (format v1: nothing can reference it), no scan
    assert counting.calls == [f"read {StepPaths(1).manifest(attempt)}"]
    assert store.steps() == [2]
    assert quick_backend.raw_files(StepPaths(1).dir) == {}


def test_corrupt_committed_manifest_keeps_everything(
        quick_backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    _a, b = a_and_b(quick_backend)
    c = plant_v3(quick_backend, 3, {"tensors-00000.safetensors": b"c" * 5})
    quick_backend.raw_write(StepPaths(3).manifest(c.attempt), b'{"tampered": 1}\n')
    store = quick_backend.open()
    with pytest.raises(CorruptCheckpointError, match="step-000000000003") as err:
        scan_references(store.storage, grace_s=DEFAULT_GRACE_S)
    assert err.value.step == 3
    # deleting B (which nothing references) also frees nothing: C might reference it
    b_files = attempt_files(quick_backend, b)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        store.delete(2)
    assert "step-000000000003" in caplog.text and "files are kept" in caplog.text
    assert store.steps() == [1, 3] and attempt_files(quick_backend, b) == b_files
    report = collect(store.storage, older_than=ZERO)
    assert report.items == [] and [i.path for i in report.retired] == [b.dir]
    assert any("step-000000000003" in s for s in report.skipped)
    # the corrupt step itself can be deleted (skip_step): then everything is freed
    store.delete(3)
    assert quick_backend.raw_files(StepPaths(3).dir) == {}
    store.delete(1)
    collect(store.storage, older_than=ZERO)
    assert quick_backend.raw_files(CHECKPOINTS_DIR) == {}


# -- ckptfs ls --------------------------------------------------------------------------------


def _ls(backend: Backend, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert cli_main(["ls", backend.url, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_ls_sizes(quick_backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = a_and_b(quick_backend)
    incomplete = StepPaths(7).attempt_dir(new_attempt_name())
    quick_backend.raw_write(f"{incomplete}/state.msgpack", b"x" * 1000)
    state = 7  # plant_v3's state.msgpack
    a_dir = sum(attempt_files(quick_backend, a).values())  # files + manifest
    b_dir = sum(attempt_files(quick_backend, b).values())
    doc = _ls(quick_backend, capsys)
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert rows[1] == {"step": 1, "committed": True, "attempt": a.attempt,
                       "bytes": 100 + state, "bytes_written": 100 + state,
                       "exclusive_bytes": state}  # B references its tensors: kept
    assert rows[2] == {"step": 2, "committed": True, "attempt": b.attempt,
                       "bytes": 30 + state + 20 + 40, "bytes_written": 30 + state,
                       "exclusive_bytes": 30 + state}
    assert rows[7] == {"step": 7, "committed": False}
    assert doc["stored_bytes"] == a_dir + b_dir and doc["retired"] == []
    assert cli_main(["ls", quick_backend.url]) == 0
    text = capsys.readouterr().out
    assert f"stored {a_dir + b_dir} bytes" in text
    quick_backend.open().delete(1)
    doc = _ls(quick_backend, capsys)
    assert doc["checkpoints"][0] == {"step": 1, "committed": False, "retired": True}
    assert [r["step"] for r in doc["checkpoints"]] == [1, 2, 7]
    assert doc["stored_bytes"] == a_dir - state + b_dir and doc["retired"] == [a.dir]
    assert doc["checkpoints"][1]["exclusive_bytes"] == 30 + state
    assert cli_main(["ls", quick_backend.url]) == 0
    assert "           1  retired" in capsys.readouterr().out


def test_run_usage_with_an_unreadable_checkpoint(quick_backend: Backend) -> None:
    _a, b = a_and_b(quick_backend)
    quick_backend.raw_write(StepPaths(2).manifest(b.attempt), b"garbage")
    usage = run_usage(quick_backend.open().storage)
    assert [c.step for c in usage.checkpoints] == [1] and list(usage.unreadable) == [2]
    assert usage.checkpoints[0].exclusive_bytes is None  # step 2 might reference it


# -- with the incremental writer and reader ---------------------------------------------------


_BASE: dict[str, Any] = {}


def lora(step: int) -> dict[str, Any]:
    """A frozen base (the same tensor objects, same bytes, at every step: what a training loop
    saves) and a small adapter that changes."""
    import torch

    if not _BASE:
        g = torch.Generator().manual_seed(0)
        _BASE.update({f"layer{i}": torch.randn(64, 64, generator=g) for i in range(4)})
    return {"base": dict(_BASE), "adapter": torch.full((8, 64), float(step)), "step": step}


def _equal(got: Any, want: Any) -> bool:
    import torch

    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype
                and got.shape == want.shape
                and bytes(got.contiguous().view(torch.uint8).numpy())
                == bytes(want.contiguous().view(torch.uint8).numpy()))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(
            _equal(got[k], want[k]) for k in want)
    return bool(got == want)


def stored_files(backend: Backend) -> dict[str, int]:
    return {p: n for p, n in backend.raw_files(CHECKPOINTS_DIR).items()
            if not p.endswith("/COMPLETE")}


def test_saved_delete_keeps_bytes_later_loads_then_everything_freed(backend: Backend) -> None:
    store = backend.open(incremental=True)
    store.save(1, lora(1))
    info2 = store.save(2, lora(2))
    assert info2.bytes_written < info2.bytes  # the base is referenced, not written
    first = store.info(1)
    store.delete(1)
    assert store.steps() == [2]
    assert backend.raw_exists(f"{first.path}/MANIFEST.json")  # retired: step 2 uses it
    fresh = backend.open()
    assert _equal(fresh.load(2), lora(2))
    fresh.verify(2)
    usage = run_usage(fresh.storage)
    assert usage.retired == [first.path]
    assert usage.stored_bytes == sum(stored_files(backend).values())  # nothing else stored
    store.delete(2)
    assert store.steps() == []
    report = collect(store.storage, older_than=ZERO)
    assert [i.path for i in report.items if i.kind == "attempt"] == [first.path]
    assert stored_files(backend) == {}  # 0 leaked bytes


def test_run_of_saves_with_keep_last_leaks_nothing(quick_backend: Backend) -> None:
    """Six saves, each older one deleted once two newer exist: after a gc, what is stored is
    exactly what the committed checkpoints need (their attempts and the retired attempts they
    reference), and each loads bit-exact."""
    store = quick_backend.open(incremental=True)
    for step in range(1, 7):
        store.save(step, lora(step))
        for old in store.steps()[:-2]:
            store.delete(old)
    collect(store.storage, older_than=ZERO)
    usage = run_usage(store.storage)
    assert [c.step for c in usage.checkpoints] == [5, 6]
    assert usage.retired == [store.info(5).manifest.references[0].attempt_dir]
    files = stored_files(quick_backend)
    assert usage.stored_bytes == sum(files.values())
    needed = {store.info(s).path for s in (5, 6)} | set(usage.retired)
    assert {p.rsplit("/", 1)[0] for p in files} == needed
    for step in (5, 6):
        assert _equal(quick_backend.open().load(step), lora(step))
    info6 = store.info(6)
    row = {c.step: c for c in usage.checkpoints}[6]
    assert (row.bytes, row.bytes_written) == (info6.bytes, info6.bytes_written)
    assert row.exclusive_bytes == info6.bytes_written  # nothing references step 6's files


class AfterFence(StorageWrapper):
    """Runs ``action`` once, right after the saver's fence read its protector's marker (its
    manifest is written): the delete then races a save that is past its fence."""

    def __init__(self, inner: Storage, protector_marker: str, action: Any) -> None:
        super().__init__(inner)
        self.marker = protector_marker
        self.action = action
        self.manifest_written = False
        self.fired = False

    def write_bytes(self, path: str, data: bytes) -> None:
        super().write_bytes(path, data)
        if path.endswith("/MANIFEST.json"):
            self.manifest_written = True

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        # a local save streams its manifest (its fsync in the commit's one step)
        with super().open_write(path) as f:
            yield f
        if path.endswith("/MANIFEST.json"):
            self.manifest_written = True

    def read_bytes(self, path: str) -> bytes:
        data = super().read_bytes(path)
        if path == self.marker and self.manifest_written and not self.fired:
            self.fired = True
            self.action()
        return data


def test_delete_racing_a_save_past_its_fence_keeps_its_bytes(quick_backend: Backend) -> None:
    store = quick_backend.open(incremental=True)
    store.save(1, lora(1))
    protector = store.info(1)
    deleter = quick_backend.open()

    def delete_and_collect() -> None:
        deleter.delete(1)  # the save's manifest is young: what it references is kept
        assert quick_backend.raw_exists(f"{protector.path}/MANIFEST.json")
        collect(deleter.storage, older_than=DEFAULT_GRACE)
        assert quick_backend.raw_exists(f"{protector.path}/MANIFEST.json")

    hooked = AfterFence(store.storage, StepPaths(1).marker, delete_and_collect)
    store.storage = hooked
    info = store.save(2, lora(2))
    assert hooked.fired and info.bytes_written < info.bytes
    assert deleter.steps() == [2]
    assert _equal(quick_backend.open().load(2), lora(2))
    quick_backend.open().verify(2)


def test_in_flight_save_manifest_protects_from_gc(quick_backend: Backend,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """gc during the same race: the protector saved two hours ago (its attempt is older than
    the grace), its marker removed by a delete that stopped right after it, the save young and
    past its fence: gc's scan keeps the protector's attempt, from the save's manifest alone."""
    import ckptfs.protocol.commit as commit

    def two_hours_ago() -> str:
        return new_attempt_name(datetime.now(timezone.utc) - timedelta(hours=2))

    store = quick_backend.open(incremental=True)
    monkeypatch.setattr(commit, "new_attempt_name", two_hours_ago)
    store.save(1, lora(1))
    monkeypatch.undo()
    protector = store.info(1)
    other = quick_backend.open()
    seen: list[Any] = []

    def crash_deleter_then_gc() -> None:
        quick_backend.raw_delete(StepPaths(1).marker)  # a delete that stopped after the marker
        seen.append(collect(other.storage, older_than=DEFAULT_GRACE))

    store.storage = AfterFence(store.storage, StepPaths(1).marker, crash_deleter_then_gc)
    info = store.save(2, lora(2))  # its fence saw the marker (t1 < t2): it commits
    (report,) = seen
    assert [i.path for i in report.retired] == [protector.path] and report.items == []
    assert {r.attempt_dir for r in info.manifest.references} == {protector.path}
    assert _equal(quick_backend.open().load(2), lora(2))
    report = collect(other.storage, older_than=DEFAULT_GRACE)  # now step 2 is committed
    assert [i.path for i in report.retired] == [protector.path] and report.items == []
