"""The read side: names matched exactly, step directories addressed by their listed
name, a delete racing a reader, stray entries and permanent errors, access problems that are
not corruption, symlinks under quick verify.  Each test failed before its fix; the storage
tests run on local disk, memory:// and S3 (moto).  The symlink, stray-file and rollback tests
run for a checkpoint of every writer and through every reader (tests/paths.py)."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import paths
import pytest
import torch

from ckptfs.errors import (
    CheckpointDeletedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageAccessError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptfs.format.layout import (
    StepPaths,
    check_relpath,
    is_attempt_name,
    is_canonical_step_dir,
    parse_attempt_name,
    parse_step_dir,
)
from ckptfs.lifecycle.gc import collect
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.retry import RetryingStorage, is_retryable
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage, TransientStorageError
from ckptfs.testing.reliability import raw_storage, state_for, store_on

LONG20 = "step-0000000000020"  # 13 digits: step 20, not the canonical step-000000000020


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def _rename_step_dir(backend: Backend, step: int, new_name: str) -> None:
    """Move a step directory to another name through the backdoor (object stores: copy)."""
    old = StepPaths(step).dir
    for rel in backend.raw_files(old):
        backend.raw_write(f"checkpoints/{new_name}/{rel[len(old) + 1:]}", backend.raw_read(rel))
    backend.raw_delete(old)


def _copy_step_dir(backend: Backend, step: int, new_name: str) -> None:
    old = StepPaths(step).dir
    for rel in backend.raw_files(old):
        backend.raw_write(f"checkpoints/{new_name}/{rel[len(old) + 1:]}", backend.raw_read(rel))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and \
        a["trainer"] == b["trainer"]


# -- names: exact, ASCII, whole string ---------------------------------------------------------


def test_names_are_whole_string_ascii_matches() -> None:
    assert parse_step_dir("step-000000000030\n") is None
    assert parse_step_dir("step-" + "\u0660" * 10 + "\u0663\u0660") is None  # Arabic-Indic
    assert parse_step_dir("step-00000000003\uff10") is None  # fullwidth zero
    assert parse_step_dir(LONG20) == 20 and not is_canonical_step_dir(LONG20)
    assert is_canonical_step_dir("step-000000000020")
    # A huge digit string is not a step (and never reaches int(): no raw ValueError).
    assert parse_step_dir("step-" + "9" * 5000) is None
    assert parse_step_dir("step-" + "0" * 5000 + "7") == 7
    attempt = "a-20261130T012500Z-3f9c2a1b0c4d5e6f"
    assert is_attempt_name(attempt) and not is_attempt_name(attempt + "\n")
    assert not is_attempt_name("a-2026113\u0660T012500Z-3f9c2a1b")
    assert parse_attempt_name(attempt + "\n") is None
    assert parse_attempt_name("a-20261399T999999Z-3f9c2a1b") is None  # matches, not a date
    for bad in ("evil.bin\n", "state.msgpack\n", "a/b\n", "x\u0660"):
        with pytest.raises(UnsafeCheckpointError):
            check_relpath(bad)


def test_step_paths_use_the_listed_name() -> None:
    p = StepPaths.of(LONG20)
    assert p.step == 20 and p.dir == f"checkpoints/{LONG20}"
    assert p.marker == f"checkpoints/{LONG20}/COMPLETE"
    assert StepPaths(20).dir == "checkpoints/step-000000000020"
    with pytest.raises(ValueError):
        StepPaths(21, LONG20)


def test_inexact_step_names_are_not_listed(backend: Backend) -> None:
    """A trailing newline and Unicode digits are not step names: steps() and latest() agree.
    (moto cannot store a key containing a newline: S3 gets the Unicode-digit name only.)"""
    store = backend.open()
    store.save(10, state_for(10))
    names = ["step-00000000003\u0663"]  # ARABIC-INDIC DIGIT THREE: matched by \d
    if backend.protocol != "s3":
        names.append("step-000000000030\n")
    for name in names:
        _copy_step_dir(backend, 10, name)
    assert store.steps() == [10] and store.all_steps() == [10]
    info = store.latest()
    assert info is not None and info.step == 10


# -- defect 3: step directories with more than 12 digits ----------------------------------------


def test_long_step_name_is_latest_and_loads(backend: Backend) -> None:
    store = backend.open()
    store.save(10, state_for(10))
    store.save(20, state_for(20))
    _rename_step_dir(backend, 20, LONG20)
    assert store.steps() == [10, 20]
    info = store.latest()
    assert info is not None and info.step == 20 and LONG20 in info.url
    assert _same(store.load(), state_for(20))
    assert _same(store.load(20), state_for(20))
    assert store.info(20).path.startswith(f"checkpoints/{LONG20}/")
    assert store.verify(20).ok and store.verify().ok and store.verify(quick=True).ok


def test_gc_keeps_the_committed_attempt_of_a_long_step_name(backend: Backend) -> None:
    store = backend.open()
    store.save(10, state_for(10))
    store.save(20, state_for(20))
    _rename_step_dir(backend, 20, LONG20)
    report = collect(store.storage, older_than=timedelta(0))
    assert [i.path for i in report.items if LONG20 in i.path] == []
    assert _same(store.load(20), state_for(20))


def test_delete_removes_a_long_step_name(backend: Backend) -> None:
    store = backend.open()
    store.save(10, state_for(10))
    store.save(20, state_for(20))
    _rename_step_dir(backend, 20, LONG20)
    store.delete(20)
    assert store.steps() == [10]
    assert backend.raw_files(f"checkpoints/{LONG20}") == {}


def test_two_directories_of_one_step_are_an_error_naming_both(backend: Backend) -> None:
    store = backend.open()
    store.save(10, state_for(10))
    store.save(20, state_for(20))
    _copy_step_dir(backend, 20, LONG20)
    for call in (store.latest, store.load, lambda: store.load(20), lambda: store.info(20)):
        with pytest.raises(CorruptCheckpointError) as exc:
            call()
        assert "step-000000000020" in str(exc.value) and LONG20 in str(exc.value)
    # Rolling back past it is an explicit choice, and is logged.
    info = store.latest(allow_rollback=True)
    assert info is not None and info.step == 10


# -- defect 6: a delete racing a reader is "deleted", not corruption ----------------------------


def _reader(backend: Backend, hook: Callable[[str, str], None]) -> CheckpointStore:
    return store_on(FaultyStorage(raw_storage(backend), hook=hook))


def _once(when: Callable[[str, str], bool], action: Callable[[], None]) -> Callable[[str, str],
                                                                                   None]:
    fired: list[bool] = []

    def hook(op: str, path: str) -> None:
        if not fired and when(op, path):
            fired.append(True)
            action()

    return hook


@pytest.mark.parametrize("call", ["load", "verify", "verify_quick", "info"])
def test_step_deleted_between_marker_and_manifest_is_not_found(backend: Backend,
                                                               call: str) -> None:
    writer = store_on(raw_storage(backend))
    writer.save(3, state_for(3))
    hook = _once(lambda op, p: op == "read_bytes" and p.endswith("MANIFEST.json"),
                 lambda: writer.delete(3))
    reader = _reader(backend, hook)
    run = {"load": lambda: reader.load(3), "verify": lambda: reader.verify(3),
           "verify_quick": lambda: reader.verify(3, quick=True),
           "info": lambda: reader.info(3)}[call]
    with pytest.raises(CheckpointNotFoundError) as exc:
        run()
    assert not isinstance(exc.value, CorruptCheckpointError)
    assert "deleted or replaced while" in str(exc.value)


def test_step_deleted_during_verify_listing_is_not_found(backend: Backend) -> None:
    writer = store_on(raw_storage(backend))
    writer.save(3, state_for(3))
    hook = _once(lambda op, p: op == "list_tree" and "/a-" in p, lambda: writer.delete(3))
    with pytest.raises(CheckpointDeletedError):
        _reader(backend, hook).verify(3, quick=True)


@pytest.mark.parametrize(("call", "at"), [("load", "COMPLETE"), ("load", "MANIFEST.json"),
                                          ("load", ".safetensors"), ("latest", "COMPLETE"),
                                          ("latest", "MANIFEST.json")])
@pytest.mark.parametrize("rollback", [False, True])
def test_resume_while_a_writer_commits_and_prunes_finds_the_newer_step(
        backend: Backend, call: str, at: str, rollback: bool) -> None:
    """The worst case of the issue: a reader resolving latest reads step 3 while a writer
    commits step 4 and prunes step 3.  The reader must return step 4: neither "step 3 is
    corrupt" nor (with allow_rollback) step 2.  ``at``: the read of step 3 the prune comes
    just before (its marker, its manifest, its first tensor file)."""
    writer = store_on(raw_storage(backend))
    writer.save(2, state_for(2))
    writer.save(3, state_for(3))

    def commit_4_prune_3() -> None:
        writer.save(4, state_for(4))
        writer.delete(3)

    def reading_step_3(op: str, p: str) -> bool:
        wanted = "open_read" if at == ".safetensors" else "read_bytes"
        return op == wanted and "step-000000000003/" in p and p.endswith(at)

    reader = _reader(backend, _once(reading_step_3, commit_4_prune_3))
    if call == "load":
        assert _same(reader.load(allow_rollback=rollback), state_for(4))
    else:
        info = reader.latest(allow_rollback=rollback)
        assert info is not None and info.step == 4
    assert writer.steps() == [2, 4]  # the race did happen


# -- defect 9: stray entries and permanent errors ------------------------------------------------


def test_stray_file_named_like_a_step_is_skipped_and_logged(
        backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    store = backend.open()
    store.save(5, state_for(5))
    backend.raw_write("checkpoints/step-000000000009", b"not a directory")
    retrying = store.storage
    assert isinstance(retrying, RetryingStorage)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        info = store.latest()
    assert info is not None and info.step == 5
    assert _same(store.load(), state_for(5))
    assert store.all_steps() == [5] and store.steps() == [5]
    with pytest.raises(CheckpointNotFoundError):
        store.load(9)
    assert retrying.retries == 0
    assert any("step-000000000009" in r.getMessage() and "not a step directory" in r.getMessage()
               for r in caplog.records)


class _Raises:
    """A storage whose every call raises ``exc`` (counted)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc, self.calls = exc, 0

    def __getattr__(self, name: str) -> Any:
        def call(*a: object, **k: object) -> None:
            self.calls += 1
            raise self.exc
        return call


def _wrapped(os_error: OSError) -> StorageError:
    try:
        raise StorageError("write x failed") from os_error
    except StorageError as exc:
        return exc


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.ENOTDIR, errno.EISDIR, errno.EROFS,
                                  errno.ENAMETOOLONG, errno.EDQUOT])
def test_permanent_os_errors_are_not_retried(code: int) -> None:
    exc = _wrapped(OSError(code, os.strerror(code)))
    assert not is_retryable(exc)
    inner = _Raises(exc)
    inner.url, inner.capabilities = "memory://x", None  # type: ignore[attr-defined]
    r = RetryingStorage(inner, attempts=4, base_delay=0, max_delay=0)  # type: ignore[arg-type]
    with pytest.raises(StorageError) as got:
        r.write_bytes("a", b"1")
    assert got.value is exc and inner.calls == 1 and r.retries == 0


def test_transient_errors_stay_retryable() -> None:
    assert is_retryable(TransientStorageError("503"))
    assert is_retryable(_wrapped(OSError(errno.EIO, "i/o")))  # s3fs: InternalError etc.
    assert is_retryable(_wrapped(OSError(errno.EINVAL, "IncompleteBody")))


def test_not_a_directory_on_local_disk_fails_at_once(local_backend: Backend) -> None:
    store = local_backend.open()
    local_backend.raw_write("checkpoints/blocker", b"x")
    with pytest.raises(StorageError) as exc:
        store.storage.makedirs("checkpoints/blocker/sub")
    assert store.storage.retries == 0  # type: ignore[attr-defined]
    assert "regular file" in str(exc.value) and "network" not in str(exc.value)


def test_full_disk_at_the_marker_fails_once_and_leaves_no_temporary_file(
        local_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    store = local_backend.open()
    storage = store.storage
    assert isinstance(storage, RetryingStorage)
    storage.makedirs("checkpoints/step-000000000001")
    real_write = os.write

    def full_disk(fd: int, data: Any) -> int:
        if "/.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(StorageError) as exc:
        storage.create_exclusive("checkpoints/step-000000000001/COMPLETE", b"{}")
    monkeypatch.undo()
    assert storage.retries == 0 and "no space left" in str(exc.value)
    assert not isinstance(exc.value, FileExistsError)
    left = os.listdir(f"{local_backend.raw_root}/checkpoints/step-000000000001")
    assert left == [], left


# -- an access problem is not corruption ---------------------------------------------------------


def test_unreadable_attempt_is_an_access_error_not_corruption(
        local_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    store = local_backend.open(retries=0)
    info = store.save(1, state_for(1))
    attempt_dir = f"{local_backend.raw_root}/{info.path}"
    real_scandir = os.scandir

    def scandir(path: Any = ".") -> Any:
        if os.fspath(path).rstrip("/") == attempt_dir:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    for call in (lambda: store.verify(1, quick=True), lambda: store.verify(1),
                 lambda: store.load(1), store.load):
        with pytest.raises(StorageAccessError):
            call()


# -- symlinks and stray files, through every write and read path -----------------------------

def _written(backend: Backend, path: paths.WritePath, *steps: int) -> CheckpointStore:
    """The checkpoints ``steps`` written through ``path`` (``path.state(step)``); a reader store
    on the same view.  A path with references (v3) primes step 0 first, so that every step
    written here references it."""
    writer = backend.open()
    if path.references:
        path.save(writer, 0, path.state(0))
    for step in steps:
        path.save(writer, step, path.state(step))
    return backend.open()


def _tensor_file(store: CheckpointStore, info: Any) -> str:
    """A tensor file of ``info`` (a rank file of format v5 is found through its table)."""
    return next(e.path for e in paths.every_file(store, info).manifest.files
                if e.path.endswith(".safetensors"))


def _every_path(default: tuple[str, ...] = ("local", "memory"),
                xfail: dict[str, str] | None = None) -> list[Any]:
    """(backend, write path): v1 on local, memory and S3 (as before), every other in-process
    cell on ``default`` (S3 with --runslow; the two-tier remote copies on memory:// only by
    default), two gloo ranks on local disk with --runslow."""
    out = []
    for where in ("local", "memory", "s3"):
        names = paths.EVERY + (paths.RANKS if where == "local" else [])
        slow = (names[1:] if where not in default else
                paths.REPLICAS if where != "memory" and "memory" in default else [])
        for p in paths.params(names, slow=slow, xfail=xfail):
            (path,) = p.values
            if where not in default and path is paths.V1 and where != "s3":
                continue
            out.append(pytest.param(where, path, id=f"{where}-{path.name}", marks=p.marks))
    return out


_LINK_PATHS = [p for p in _every_path(("local",)) if p.values[0] == "local"]


@pytest.mark.parametrize(("where", "path"), _LINK_PATHS)
def test_every_reader_refuses_a_symlink(where: str, path: paths.WritePath,
                                        request: pytest.FixtureRequest) -> None:
    """A tensor file replaced by a link to a file outside the checkpoint (same bytes, so only
    the link check can refuse it), for a checkpoint of every writer: quick and full verify
    report it, load, ckptfs cp and inspect refuse it with UnsafeCheckpointError, and the copy
    commits nothing."""
    backend = path.at(request.getfixturevalue(f"{where}_backend"))
    store = _written(backend, path, 1)
    info = store.info(1)
    target = f"{backend.raw_root}/{info.path}/{_tensor_file(store, info)}"
    outside = f"{backend.raw_root}/../outside-{path.name}.safetensors"
    os.replace(target, outside)
    os.symlink(os.path.abspath(outside), target)
    for how in ("verify-quick", "verify"):
        with pytest.raises(CorruptCheckpointError, match="symbolic link"):
            paths.read(how, store, 1)
    for how in ("load", "load-unverified", "load-into", "cp", "inspect"):
        if how not in paths.reads_of(path):
            continue
        with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
            paths.read(how, store, 1)


@pytest.mark.parametrize(("where", "path"), _every_path())
def test_stray_file_is_ignored_by_load_and_reported_by_verify(
        where: str, path: paths.WritePath, request: pytest.FixtureRequest,
        caplog: pytest.LogCaptureFixture) -> None:
    """A file the manifest does not list: load ignores it (and logs it), verify reports it,
    ckptfs cp copies the checkpoint without it, inspect shows the checkpoint."""
    backend = path.at(request.getfixturevalue(f"{where}_backend"))
    store = _written(backend, path, 1)
    info = store.info(1)
    backend.raw_write(f"{info.path}/notes.txt", b"hello")
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        assert _same(store.load(1), path.state(1))
    assert any("notes.txt" in r.getMessage() for r in caplog.records)
    with pytest.raises(CorruptCheckpointError, match=r"notes\.txt: not in the manifest"):
        store.verify(1, quick=True)
    copy: CheckpointStore = paths.read("cp", store, 1)
    assert copy.verify(1, quick=True).ok and _same(copy.load(1), path.state(1))
    assert paths.read("inspect", store, 1)["step"] == 1


@pytest.mark.parametrize(("where", "path"), _every_path())
def test_latest_rollback_checks_the_commit_load_rollback_checks_the_data(
        where: str, path: paths.WritePath, request: pytest.FixtureRequest) -> None:
    """The documented difference: latest() checks marker and manifest; load() also the
    files.  A newest step with a damaged tensor file is still latest(), and load() refuses it
    (or, with allow_rollback, loads the previous one)."""
    backend = path.at(request.getfixturevalue(f"{where}_backend"))
    store = _written(backend, path, 1, 2)
    info = store.info(2)
    damaged = f"{info.path}/{_tensor_file(store, info)}"
    data = bytearray(backend.raw_read(damaged))
    data[-1] ^= 0xFF
    backend.raw_write(damaged, bytes(data))
    latest = store.latest(allow_rollback=True)
    assert latest is not None and latest.step == 2
    with pytest.raises(CorruptCheckpointError, match="step 2"):
        store.load()
    assert _same(store.load(allow_rollback=True), path.state(1))


def _sharded_paths() -> list[Any]:
    """The sharded cells (format v2, v4, v5): ``load(into=)`` reads these."""
    return [p for p in _every_path()
            if "load-into" in paths.reads_of(p.values[1])]


@pytest.mark.parametrize("damage", ["flip", "delete"])
@pytest.mark.parametrize(("where", "path"), _sharded_paths())
def test_load_into_rolls_back_as_load_does(where: str, path: paths.WritePath, damage: str,
                                           request: pytest.FixtureRequest) -> None:
    """The newest step's rank files damaged (a byte flipped in each of their items, so that
    whatever a load reads of them is damaged; the files deleted; every rank file the step
    wrote: on two ranks the items ``load(into=)`` reads may all be in one of them):
    ``load(into=, allow_rollback=True)`` fills the state from the previous step, as the full
    load with ``allow_rollback`` returns it, and without ``allow_rollback`` both refuse the
    newest step with CorruptCheckpointError."""
    backend = path.at(request.getfixturevalue(f"{where}_backend"))
    store = _written(backend, path, 1, 2)
    info = store.info(2)
    for entry in [e for e in paths.every_file(store, info).manifest.files
                  if e.path.endswith(".safetensors")]:
        damaged = f"{info.path}/{entry.path}"
        if damage == "flip":
            data = bytearray(backend.raw_read(damaged))
            for chunk in entry.chunks[1:]:
                if chunk.length:
                    data[chunk.offset + chunk.length // 2] ^= 0xFF
            backend.raw_write(damaged, bytes(data))
        else:
            backend.raw_delete(damaged)
    newest = r"step 2|step-000000000002"
    with pytest.raises(CorruptCheckpointError, match=newest):
        store.load()
    with pytest.raises(CorruptCheckpointError, match=newest):
        store.load(into=paths.into_target())
    assert _same(store.load(allow_rollback=True), path.state(1))
    into = paths.into_target()
    store.load(into=into, allow_rollback=True)
    want = path.state(1)
    for part in into:
        for k, v in into[part].items():
            assert torch.equal(v, want[part][k]), (part, k)


# -- the manager on an incremental run ---------------------------------------------------------


class _Frozen(torch.nn.Module):
    """A frozen base and a trained head: an incremental save references the base."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base = torch.nn.Parameter(torch.randn(8, 8, generator=g), requires_grad=False)
        self.head = torch.nn.Parameter(torch.randn(8, generator=g))


@pytest.mark.parametrize("where", ["memory", pytest.param("local", marks=pytest.mark.slow)])
def test_manager_restores_an_incremental_run(where: str,
                                             request: pytest.FixtureRequest) -> None:
    """CheckpointManager on an incremental store (format v3: each save references the frozen
    base in the first one's file): a damaged newest step is refused by restore_latest, and
    with allow_rollback the previous step is restored bit-exact; a damaged base, which every
    step references, leaves no readable step (CheckpointNotFoundError listing them), never a
    silent start from step 0 nor the damaged bytes."""
    import ckptfs

    backend: Backend = request.getfixturevalue(f"{where}_backend")
    mgr = ckptfs.CheckpointManager(ckptfs.open(backend.url, incremental=True, retries=0))
    model = _Frozen()
    heads = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            model.head.add_(1.0)
        heads[step] = model.head.detach().clone()
        mgr.save(step, model=model)
    store = backend.open()
    newest, first = store.info(3), store.info(1)
    assert newest.manifest.format_version == 3 and newest.manifest.references
    assert newest.bytes_written < newest.bytes
    own = f"{newest.path}/{_tensor_file(store, newest)}"
    data = bytearray(backend.raw_read(own))
    data[-1] ^= 0xFF
    backend.raw_write(own, bytes(data))
    fresh = _Frozen()
    with pytest.raises(CorruptCheckpointError, match="step 3"):
        ckptfs.CheckpointManager(backend.open()).restore_latest(model=fresh)
    assert ckptfs.CheckpointManager(backend.open()).restore_latest(
        model=fresh, allow_rollback=True) == 3  # step 2 restored: continue from 3
    assert torch.equal(fresh.head, heads[2]) and torch.equal(fresh.base, model.base)
    base = f"{first.path}/{_tensor_file(store, first)}"  # step 1's file: every step reads the base
    data = bytearray(backend.raw_read(base))
    data[len(data) // 2] ^= 0xFF
    backend.raw_write(base, bytes(data))
    other = _Frozen()
    with pytest.raises((CheckpointNotFoundError, CorruptCheckpointError)):
        ckptfs.CheckpointManager(backend.open()).restore_latest(model=other,
                                                               allow_rollback=True)
    assert torch.equal(other.head, _Frozen().head)  # nothing restored into the model


@pytest.mark.sharded
@pytest.mark.parametrize("incremental", [
    pytest.param(False, id="v2"),
    pytest.param(True, id="v4")])
def test_manager_restores_a_sharded_run_into_dtensors(memory_backend: Backend,
                                                      incremental: bool) -> None:
    """CheckpointManager under a one-rank process group, the model's parameters DTensors
    (as FSDP2 holds them): the collective saves (format v2; v4 on an incremental store, the
    second referencing the frozen base) restore into a fresh DTensor model bit-exact."""
    from torch.distributed.tensor import distribute_module

    import ckptfs
    from ckptfs.testing.reliability.paths import world_of_one

    url = memory_backend.url
    with world_of_one() as mesh:
        model = distribute_module(_Frozen(), mesh)
        mgr = ckptfs.CheckpointManager(ckptfs.open(url, incremental=incremental))
        for step in (1, 2):
            with torch.no_grad():
                model.head.add_(1.0)
            mgr.save(step, model=model)
        info = ckptfs.open(url).info(2)
        assert info.manifest.format_version == (4 if incremental else 2)
        assert bool(getattr(info.manifest, "references", ())) == incremental
        fresh = distribute_module(_Frozen(), mesh)
        assert ckptfs.CheckpointManager(ckptfs.open(url, incremental=incremental)
                                        ).restore_latest(model=fresh) == 3
        for name in ("base", "head"):
            assert torch.equal(getattr(fresh, name).full_tensor(),
                               getattr(model, name).full_tensor()), name
