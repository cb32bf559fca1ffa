"""Write-once run artifacts and side outputs committed with their checkpoint (local and
memory)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import ckptfs
from ckptfs.errors import (
    ArtifactConflictError,
    ArtifactMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from ckptfs.lifecycle.artifacts import SIDE_COMMITS_DIR, RunArtifacts
from ckptfs.testing.backend import Backend
from ckptfs.testing.lifecycle import CrashingStorage, InjectedCrash

DESC = {"model": "ref-policy", "revision": "abc123", "dtype": "float32"}


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def ref_state(v: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), v), "b": torch.arange(4.0)}


# -- write-once artifacts --------------------------------------------------------------------


def test_save_once_then_noop_then_conflict(backend: Backend) -> None:
    arts = RunArtifacts(backend.open())
    info, created = arts.save("reference", ref_state(), descriptor=DESC)
    assert created and info.descriptor == DESC
    again, created2 = arts.save("reference", ref_state(2.0), descriptor=dict(DESC))
    assert not created2 and again.content_digest == info.content_digest
    assert torch.equal(arts.load("reference")["w"], ref_state()["w"])  # not overwritten
    with pytest.raises(ArtifactConflictError, match="already exists with descriptor"):
        arts.save("reference", ref_state(), descriptor={**DESC, "revision": "def456"})
    assert arts.names() == ["reference"]


def test_load_checks_descriptor(backend: Backend) -> None:
    arts = RunArtifacts(backend.open())
    arts.save("reference", ref_state(), descriptor=DESC)
    assert arts.load("reference", descriptor=DESC)["b"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ArtifactMismatchError, match="revision"):
        arts.load("reference", descriptor={**DESC, "revision": "zzz"})
    with pytest.raises(CheckpointNotFoundError, match="no artifact 'other'"):
        arts.load("other")
    with pytest.raises(ValueError):
        arts.save("../escape", ref_state(), descriptor=DESC)


def test_load_checks_content(backend: Backend) -> None:
    arts = RunArtifacts(backend.open())
    arts.save("reference", ref_state(), descriptor=DESC)
    sub = "artifacts/reference"
    files = backend.raw_files(sub)
    tensor_file = next(k for k in files if k.endswith(".safetensors"))
    data = bytearray(backend.raw_read(tensor_file))
    data[-1] ^= 0xFF
    backend.raw_write(tensor_file, bytes(data))
    with pytest.raises(CorruptCheckpointError):
        arts.load("reference")


def test_edited_descriptor_detected(backend: Backend) -> None:
    arts = RunArtifacts(backend.open())
    arts.save("reference", ref_state(), descriptor=DESC)
    manifest = next(k for k in backend.raw_files("artifacts/reference")
                    if k.endswith("MANIFEST.json"))
    doc = json.loads(backend.raw_read(manifest))
    doc["metadata"]["descriptor"]["revision"] = "forged"
    backend.raw_write(manifest, json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError):  # the marker binds the manifest
        arts.load("reference")


def test_racing_first_saves_make_one_artifact(backend: Backend) -> None:
    results: list[object] = []

    def save(v: float) -> None:
        try:
            results.append(RunArtifacts(backend.open()).save("ref", ref_state(v),
                                                              descriptor=DESC)[1])
        except BaseException as exc:  # pragma: no cover - reported below
            results.append(exc)

    threads = [threading.Thread(target=save, args=(float(i),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(str, results)) == ["False", "False", "False", "True"]
    w = RunArtifacts(backend.open()).load("ref")["w"]
    assert w.unique().numel() == 1  # all bytes from one writer


# -- side outputs ----------------------------------------------------------------------------


def test_side_outputs_commit_with_checkpoint(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open())
    p = mgr.write_side_output(10, "eval.json", b'{"acc": 0.5}')
    assert mgr.side_output_status().uncommitted == [p]
    mgr.save(10)
    st = mgr.side_output_status()
    assert st.committed == [p] and st.uncommitted == []
    listed = backend.open().info(10).metadata["side_outputs"]
    assert set(listed) == {p} and listed[p]["size"] == 12


def test_crash_before_checkpoint_discards_on_resume(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open())
    kept = mgr.write_side_output(10, "eval.json", b"ok")
    mgr.save(10)
    lost = mgr.write_side_output(15, "eval.json", b"from a run that crashed")
    store = backend.open()
    store.storage = CrashingStorage(store.storage, "create_exclusive", "COMPLETE")
    crashing = ckptfs.CheckpointManager(store)
    crashing.side_outputs._pending = dict(mgr.side_outputs._pending)
    with pytest.raises(InjectedCrash):
        crashing.save(20)
    resumed = ckptfs.CheckpointManager(backend.open())
    before = resumed.side_output_status()
    assert before.committed == [kept] and before.uncommitted == [lost]
    resumed.restore_latest()
    after = resumed.side_output_status()
    assert after.committed == [kept] and after.uncommitted == []
    assert not backend.raw_exists(lost)


def test_side_outputs_stay_committed_after_prune(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open(), keep_last=1)
    p = mgr.write_side_output(1, "log.txt", b"step 1")
    mgr.save(1)
    mgr.save(2)
    assert backend.open().steps() == [2]
    assert mgr.side_output_status().committed == [p]
    assert backend.raw_exists(f"{SIDE_COMMITS_DIR}/step-000000000001.json")


def test_record_missing_after_crash_is_reconciled(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open())
    p = mgr.write_side_output(1, "log.txt", b"x")
    mgr.save(1)
    backend.raw_delete(f"{SIDE_COMMITS_DIR}/step-000000000001.json")  # crash before record
    other = ckptfs.CheckpointManager(backend.open())
    assert other.side_output_status().committed == [p]  # the checkpoint commits it anyway
    other.restore_latest()
    assert backend.raw_exists(f"{SIDE_COMMITS_DIR}/step-000000000001.json")
    assert backend.raw_exists(p)


def test_modified_side_output_detected(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open())
    p = mgr.write_side_output(1, "log.txt", b"original")
    mgr.save(1)
    backend.raw_write(p, b"tampered")
    assert mgr.side_output_status().modified == [p]
    with pytest.raises(TypeError):
        mgr.write_side_output(2, "x", "not bytes")  # type: ignore[arg-type]
    assert mgr.side_outputs.path(1, "a") == "lifecycle/side/step-000000000001/a"


def test_rollback_restore_past_an_unreadable_manifest_keeps_its_side_outputs(
        backend: Backend) -> None:
    """The newest step's manifest damaged and its side-commit record missing (a crash before
    the record): ``restore_latest(allow_rollback=True)`` restores the previous step (the
    reconciliation after a resume skips the unreadable step, logged, instead of raising), and
    the side output only that step lists is kept, not discarded as uncommitted: what an
    unreadable manifest lists is not known."""
    mgr = ckptfs.CheckpointManager(backend.open())
    first = mgr.write_side_output(1, "eval.json", b"one")
    mgr.save(1)
    second = mgr.write_side_output(2, "eval.json", b"two")
    mgr.save(2)
    backend.raw_delete(f"{SIDE_COMMITS_DIR}/step-000000000002.json")
    info = backend.open().info(2)
    manifest = f"{info.path}/MANIFEST.json"
    data = bytearray(backend.raw_read(manifest))
    data[len(data) // 2] ^= 0xFF
    backend.raw_write(manifest, bytes(data))
    resumed = ckptfs.CheckpointManager(backend.open())
    with pytest.raises(CorruptCheckpointError, match="step 2"):
        resumed.restore_latest()
    assert resumed.restore_latest(allow_rollback=True) == 2  # step 1 restored
    assert backend.raw_exists(first) and backend.raw_exists(second)
