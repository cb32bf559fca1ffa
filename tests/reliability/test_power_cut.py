"""Power cuts on local disk (the page-cache model of :class:`ckptfs.testing.faults.PowerCutModel`):
a save cut after any of its storage calls leaves the previous checkpoint committed and intact,
and a save that returned survives the cut.  The model itself is checked first: it must catch a
writer that skips an fsync, or the sweep would prove nothing."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import paths
import pytest

from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal
from ckptfs.testing.faults import FaultyStorage, PowerCutModel
from ckptfs.testing.reliability import raw_storage, state_for, store_on, sweep_power_cuts


def test_power_cut_after_every_call_of_a_save(local_backend: Backend) -> None:
    sweep = sweep_power_cuts(local_backend)
    assert sweep.tried == 2 * (sweep.counters["calls_per_save"] + 1)
    assert sweep.counters["entries_rolled_back"] > 0  # the model did roll things back
    assert sweep.violations == []


def test_model_drops_unsynced_data_and_entries(tmp_path: Any) -> None:
    root = tmp_path / "r"
    (root / "old").mkdir(parents=True)
    (root / "old" / "kept").write_bytes(b"durable")
    model = PowerCutModel(str(root))
    model.makedirs("new")
    model.write_file("new/f", b"lost", synced=True)  # data synced, entry "new" is not
    model.write_file("old/unsynced", b"data", synced=False)
    model.sync_dir("old")  # the entry is durable, its data is not
    model.write_file("old/kept", b"rewritten", synced=False)
    model.apply("empty")
    assert sorted(os.listdir(root)) == ["old"]
    assert (root / "old" / "unsynced").read_bytes() == b""
    assert (root / "old" / "kept").read_bytes() == b"durable"


def test_model_rename_needs_parent_sync(tmp_path: Any) -> None:
    root = tmp_path / "r"
    root.mkdir()
    model = PowerCutModel(str(root))
    model.makedirs("d/.tmp")
    model.sync_dir("")
    model.sync_dir("d")
    model.write_file("d/.tmp/f", b"x", synced=True)
    model.sync_dir("d/.tmp")
    model.rename("d/.tmp", "d/final")
    model.apply("empty")
    assert os.listdir(root / "d") == [".tmp"]  # the rename was not made durable
    assert (root / "d" / ".tmp" / "f").read_bytes() == b"x"


class _SkipSync(FaultyStorage):
    """A writer that forgets one fsync: the kind of bug the power-cut sweep exists for."""

    skip_root_sync = False
    skip_file_fsync = False

    def sync_dir(self, path: str) -> None:
        if self.skip_root_sync and path == "":
            return
        super().sync_dir(path)

    def sync_paths(self, files: Sequence[str], dirs: Sequence[str]) -> None:
        # the commit's one step (BatchedSync): the same fsync forgotten there
        super().sync_paths([] if self.skip_file_fsync else files,
                           [d for d in dirs if not (self.skip_root_sync and d == "")])

    def _commit(self, path: str, data: bytes, fsync: bool) -> None:
        super()._commit(path, data, fsync and not self.skip_file_fsync)


@pytest.mark.parametrize("bug", ["skip_root_sync", "skip_file_fsync"])
def test_model_catches_a_missing_fsync(local_backend: Backend, bug: str) -> None:
    fs = _SkipSync(raw_storage(local_backend), power_model=True)
    setattr(fs, bug, True)
    store_on(fs).save(1, state_for(1))  # returned: the caller believes it is durable
    fs.power_cut()
    reader = local_backend.open()
    try:
        survived = reader.latest() is not None and reader.verify(1).ok
    except Exception:
        survived = False
    assert not survived, f"the model did not notice {bug}"


def test_power_cut_after_every_call_of_a_delete(local_backend: Backend) -> None:
    from ckptfs.testing.reliability import sweep_power_cut_delete

    sweep = sweep_power_cut_delete(local_backend)
    assert sweep.tried == sweep.counters["calls_per_delete"] + 1
    assert sweep.counters.get("deleted", 0) >= 1 and sweep.counters.get("still_committed", 0) >= 1
    assert sweep.violations == []


def _record_durability(monkeypatch: pytest.MonkeyPatch, *, files: bool = False
                       ) -> list[tuple[str, str]]:
    """Record, in order, every directory created (``mkdir``), every directory fsynced and,
    with ``files``, every file fsynced and every ``link`` (its new name), by absolute path."""
    events: list[tuple[str, str]] = []
    fds: dict[int, str] = {}
    real_open, real_mkdir, real_fsync, real_link = os.open, os.mkdir, os.fsync, os.link

    def mkdir(path: Any, *a: Any, **k: Any) -> None:
        real_mkdir(path, *a, **k)
        events.append(("mkdir", os.path.abspath(os.fspath(path))))

    def open_(path: Any, flags: int, *a: Any, **k: Any) -> int:
        fd = real_open(path, flags, *a, **k)
        fds[fd] = os.path.abspath(os.fspath(path))
        return fd

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if fd in fds and (files or os.path.isdir(fds[fd])):
            events.append(("fsync", fds[fd]))

    def link(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        real_link(src, dst, *a, **k)
        events.append(("link", os.path.abspath(os.fspath(dst))))

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    if files:
        monkeypatch.setattr(os, "link", link)
    return events


def _entries_not_made_durable(events: list[tuple[str, str]]) -> list[str]:
    """Directories created whose parent was not fsynced afterwards (the model's rule: an entry
    is durable only once its parent directory is fsynced)."""
    lost = []
    for i, (kind, path) in enumerate(events):
        if kind == "mkdir" and ("fsync", os.path.dirname(path)) not in events[i + 1:]:
            lost.append(path)
    return lost


def test_a_brand_new_run_root_is_durable(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a save into a run root that did not exist (nor its parents) made the entries
    inside the root durable, but not the root's own entry in its parent: a power cut after
    save() returned lost the whole run."""
    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.storage.fsspec import FsspecStorage

    root = tmp_path / "new" / "deeper" / "run"
    events = _record_durability(monkeypatch)
    CheckpointStore(FsspecStorage(f"file://{root}")).save(1, state_for(1))
    created = [p for kind, p in events if kind == "mkdir"]
    assert str(tmp_path / "new") in created and str(root / "checkpoints") in created
    assert _entries_not_made_durable(events) == []


def test_a_record_in_a_new_directory_is_durable(tmp_path: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The same class for the local exclusive create (markers, lifecycle records): the
    directories it creates are made durable with the file."""
    from ckptfs.storage.fsspec import FsspecStorage

    storage = FsspecStorage(f"file://{tmp_path / 'run'}")
    events = _record_durability(monkeypatch)
    storage.create_exclusive("lifecycle/best/gen-000000000001.json", b"{}")
    assert len([e for e in events if e[0] == "mkdir"]) == 3
    assert _entries_not_made_durable(events) == []


@pytest.mark.parametrize("path", paths.params(paths.EVERY))
def test_a_returned_save_survives_a_power_cut(local_backend: Backend,
                                              path: paths.WritePath) -> None:
    """Every writer: once its save returned, a power cut loses nothing (a regression: a copy of a
    sharded checkpoint did not make its rank-00000/ directory entries durable, so a power cut
    after ckptfs cp returned lost rank-00000/data-0.safetensors)."""
    fs = FaultyStorage(raw_storage(local_backend), power_model=True)
    path.save(store_on(fs), 1, path.state(1))
    fs.power_cut()
    reader = local_backend.open()
    assert reader.verify(1).ok
    assert_state_equal(reader.load(1), path.state(1))


@pytest.mark.slow
@pytest.mark.parametrize("path", paths.params(
    [p for p in paths.EVERY if p not in ("v1", *paths.REPLICAS)]))
def test_power_cut_after_every_call_on_every_path(local_backend: Backend,
                                                  path: paths.WritePath) -> None:
    sweep = sweep_power_cuts(local_backend, path=path)
    assert sweep.tried == 2 * (sweep.counters["calls_per_save"] + 1)
    paths.check_violations(sweep.violations)


def test_every_file_is_fsynced_before_the_marker_with_one_batched_step(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit's one step (BatchedSync, local disk): the small files the writer did not
    fsync when it wrote them, MANIFEST.json and the directories are fsynced at once, and every
    file of the attempt is fsynced before the marker is linked into place (real fsyncs,
    recorded by path; not the model)."""
    from ckptfs.protocol import commit
    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.storage.fsspec import FsspecStorage

    events = _record_durability(monkeypatch, files=True)
    steps: list[tuple[list[str], list[str]]] = []
    real_sync = FsspecStorage.sync_paths

    def sync_paths(self: FsspecStorage, files: Sequence[str], dirs: Sequence[str]) -> None:
        steps.append((list(files), list(dirs)))
        real_sync(self, files, dirs)

    monkeypatch.setattr(FsspecStorage, "sync_paths", sync_paths)
    store = CheckpointStore(FsspecStorage(f"file://{tmp_path / 'run'}"))
    info = store.save(1, state_for(1))
    assert len(steps) == 1
    files, dirs = steps[0]
    assert {f.rsplit("/", 1)[1] for f in files} == {"MANIFEST.json"} | {
        f.path for f in info.manifest.files if f.size <= commit.DEFERRED_SYNC_BYTES}
    assert "" in dirs and "checkpoints" in dirs
    marker = next(i for i, (kind, p) in enumerate(events)
                  if kind == "link" and p.endswith("/COMPLETE"))
    attempt = str(tmp_path / "run" / "checkpoints" / "step-000000000001" / info.attempt)
    synced = {p for kind, p in events[:marker] if kind == "fsync"}
    for f in [*info.manifest.files, "MANIFEST.json"]:
        name = f if isinstance(f, str) else f.path
        assert f"{attempt}/{name}" in synced, f"{name} was not fsynced before the marker"
    assert attempt in synced and str(tmp_path / "run") in synced
    assert CheckpointStore(FsspecStorage(f"file://{tmp_path / 'run'}")).verify(1).ok


def test_a_failed_fsync_in_the_batched_step_commits_nothing(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync of the commit's one step that fails (EIO) is the save's typed error naming the
    file; no marker, the attempt discarded, the other paths' fsyncs still ran."""
    import errno

    from ckptfs.errors import StorageError
    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.storage import syncs
    from ckptfs.storage.fsspec import FsspecStorage

    real = syncs.fsync_path
    ran: list[str] = []

    def failing(full: str, directory: bool) -> None:
        ran.append(full)
        if full.endswith("state.msgpack"):
            raise OSError(errno.EIO, "Input/output error", full)
        real(full, directory)

    monkeypatch.setattr(syncs, "fsync_path", failing)
    store = CheckpointStore(FsspecStorage(f"file://{tmp_path / 'run'}"))
    with pytest.raises(StorageError, match=r"state\.msgpack"):
        store.save(1, state_for(1))
    assert len(ran) >= 6  # the small files and the directories of the step, all tried
    assert store.steps() == [] and store.latest() is None
    step_dir = tmp_path / "run" / "checkpoints" / "step-000000000001"
    assert not step_dir.exists() or os.listdir(step_dir) == []
