"""``ckptfs cp`` and ``ckptfs export`` of incremental checkpoints (format v3, docs/protocol.md
§9): the copy holds every byte it uses (references materialized as its own files, each tensor
checked against its digest while copied), or references only the destination's own committed
checkpoint when that already holds the same content."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptfs.cli.core import main
from ckptfs.errors import CorruptCheckpointError
from ckptfs.format.manifest import Manifest
from ckptfs.protocol.copy import copy_step
from ckptfs.protocol.store import CheckpointStore
from ckptfs.testing.backend import Backend

_g = torch.Generator().manual_seed(0)
#: The frozen part: the same tensor objects at every save (as a model's frozen parameters are),
#: so the writer's hint (data_ptr, _version) finds them unchanged and references them.
BASE = {"w1": torch.randn(64, 64, generator=_g), "w2": torch.randn(32, 64, generator=_g),
        "b": torch.zeros(7, dtype=torch.bfloat16), "empty": torch.empty(0)}


def state(step: int) -> dict[str, Any]:
    base = dict(BASE)
    torch.manual_seed(step)
    return {"base": base, "adapter": {"a": torch.randn(4, 64) * step},
            "step": step, "lr": 0.1}


def populate(backend: Backend, steps: tuple[int, ...] = (1, 2)) -> CheckpointStore:
    store = backend.open(incremental=True)
    for s in steps:
        store.save(s, state(s), metadata={"note": f"step {s}"})
    return store


def manifest(store: CheckpointStore, step: int) -> Manifest:
    m = store.info(step).manifest
    assert m.format_version == 3
    return m


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            assert torch.equal(a[k].view(torch.uint8) if a[k].numel() else a[k], b[k].view(
                torch.uint8) if b[k].numel() else b[k])
        else:
            assert a[k] == b[k]


@pytest.mark.parametrize("pair", [("local", "memory"), ("memory", "local")])
def test_cp_materializes_references(pair: tuple[str, str], request: pytest.FixtureRequest
                                    ) -> None:
    src_b: Backend = request.getfixturevalue(f"{pair[0]}_backend")
    dst_b: Backend = request.getfixturevalue(f"{pair[1]}_backend")
    src = populate(src_b)
    assert manifest(src, 2).references  # the frozen base is referenced from step 1
    result = copy_step(src.storage, dst_b.open().storage, 2, threads=1)
    assert result.status == "copied"
    dst = dst_b.open()
    assert dst.steps() == [2]
    m = manifest(dst, 2)
    assert m.references == ()  # self-contained: nothing outside itself
    src_m = manifest(src, 2)
    assert {e.path for e in m.files} == {e.path for e in src_m.files} | {
        r.path for r in src_m.references}
    assert m.file("state.msgpack").digest == src_m.file("state.msgpack").digest
    assert m.logical_bytes <= src_m.logical_bytes + 4096  # headers aside: the same bytes
    assert_same(src.load(2), dst.load(2))
    assert dst.verify(2).ok
    assert_same(src.load(2, keys=["base"]), dst.load(2, keys=["base"]))
    # The source's step 1 gone: the copy does not need it.
    src.delete(1)
    assert_same(state(2), dst_b.open().load(2))
    # Again: identical, nothing written.
    before = dst_b.raw_files()
    assert copy_step(src.storage, dst.storage, 2).status == "identical"
    assert dst_b.raw_files() == before


def test_cp_all_references_the_destinations_own_checkpoint(
        local_backend: Backend, memory_backend: Backend,
        capsys: pytest.CaptureFixture[str]) -> None:
    src = populate(local_backend, (1, 2, 3))
    code = main(["cp", local_backend.url, memory_backend.url, "--all"])
    assert code == 0, capsys.readouterr().err
    dst = memory_backend.open()
    assert dst.steps() == [1, 2, 3]
    for s in (1, 2, 3):
        assert_same(src.load(s), dst.load(s))
        assert dst.verify(s).ok
    one = dst.info(1)
    for s in (2, 3):
        refs = manifest(dst, s).references
        assert refs, f"step {s} copied without reusing what the destination holds"
        for r in refs:  # only the destination's own committed checkpoints
            assert (r.step, r.attempt) in {(i.step, i.attempt) for i in
                                           (dst.info(t) for t in dst.steps())}
        # What the copy wrote there: the changed adapter and the documents, not the base.
        assert dst.info(s).bytes_written < one.bytes_written / 4
        assert dst.info(s).bytes == src.info(s).bytes
    # Copying step 2 again into a destination that has no step 1: materialized.
    other = memory_backend.sibling()
    copy_step(local_backend.open().storage, other.open().storage, 3)
    assert manifest(other.open(), 3).references == ()


@pytest.mark.parametrize("where", ["tensor", "header"])
def test_cp_tampered_reference_commits_nothing(where: str, local_backend: Backend,
                                               memory_backend: Backend,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    src = populate(local_backend)
    ref = manifest(src, 2).references[0]
    chunk = ref.chunks[0] if where == "header" else max(ref.chunks[1:], key=lambda c: c.length)
    data = bytearray(local_backend.raw_read(ref.location))
    data[chunk.offset + chunk.length - 3] ^= 0x10  # same size, other content
    local_backend.raw_write(ref.location, bytes(data))
    with pytest.raises(CorruptCheckpointError) as err:
        copy_step(src.storage, memory_backend.open().storage, 2, threads=1)
    assert ref.location in str(err.value)
    assert memory_backend.open().steps() == []
    assert memory_backend.raw_files() == {}  # the partial attempt was removed
    code = main(["cp", local_backend.url, memory_backend.url, "--step", "2"])
    assert code == 1 and "Traceback" not in capsys.readouterr().err
    assert memory_backend.raw_files() == {}


def test_cp_missing_reference_commits_nothing(local_backend: Backend,
                                              memory_backend: Backend) -> None:
    src = populate(local_backend)
    local_backend.raw_delete(manifest(src, 2).references[0].location)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        copy_step(src.storage, memory_backend.open().storage, 2)
    assert memory_backend.raw_files() == {}


def test_cp_reuse_falls_back_when_the_destination_step_is_deleted(
        local_backend: Backend, memory_backend: Backend,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The destination checkpoint a copy references is deleted before the copy's marker: the
    fence refuses, and the copy is made again holding every byte."""
    src = populate(local_backend)
    copy_step(src.storage, memory_backend.open().storage, 1)
    dst = memory_backend.open()
    from ckptfs.protocol import commit as commit_mod  # the fence is the commit's

    real = commit_mod.read_marker
    deleted = []

    def read_marker(storage: Any, step: int, *args: Any) -> Any:
        if step == 1 and not deleted:
            deleted.append(1)
            dst.delete(1)
        return real(storage, step, *args)

    monkeypatch.setattr(commit_mod, "read_marker", read_marker)
    assert copy_step(src.storage, dst.storage, 2).status == "copied"
    assert deleted
    assert manifest(dst, 2).references == ()
    assert_same(state(2), memory_backend.open().load(2))
    assert memory_backend.open().verify(2).ok


def test_export_of_incremental_step(local_backend: Backend, tmp_path: Any,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    populate(local_backend)
    out = tmp_path / "s2.safetensors"
    code = main(["export", local_backend.url, "--step", "2", str(out)])
    assert code == 0, capsys.readouterr().err
    tensors = load_file(str(out))
    assert torch.equal(tensors["base/w1"], state(2)["base"]["w1"])
    assert torch.equal(tensors["adapter/a"], state(2)["adapter"]["a"])


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("reuse", [False, True], ids=["materialize", "reference"])
def test_cp_crash_at_every_call_commits_nothing_partial(
        kind: str, reuse: bool, request: pytest.FixtureRequest) -> None:
    """A v3 copy killed at any mutating call of the destination leaves step 2 uncommitted (the
    destination's step 1, which it may reference, untouched) and the next copy succeeds;
    killed after the marker, it is committed whole."""
    from ckptfs.testing.faults import FaultyStorage, SimulatedCrash

    src = populate(request.getfixturevalue("memory_backend"))
    base: Backend = request.getfixturevalue(f"{kind}_backend")

    def fresh(name: str) -> Backend:
        b = base.sibling(name)
        if reuse:
            copy_step(src.storage, b.open().storage, 1, threads=1)
        return b

    clean = FaultyStorage(fresh("clean").open().storage)
    copy_step(src.storage, clean, 2, threads=1)
    total = clean.count
    assert total >= 4
    for k in range(1, total + 1):
        dst_b = fresh(f"crash{k}")
        faulty = FaultyStorage(dst_b.open().storage, crash_at=k)
        with pytest.raises(SimulatedCrash):
            copy_step(src.storage, faulty, 2, threads=1)
        dst = dst_b.open()
        assert dst.steps() == ([1] if reuse else []), f"crash at call {k} of {total}"
        copy_step(src.storage, dst.storage, 2, threads=1)  # the retry commits
        assert dst_b.open().verify(2).ok
        assert bool(manifest(dst_b.open(), 2).references) == reuse
    dst_b = fresh("after")
    faulty = FaultyStorage(dst_b.open().storage, crash_at=total, crash_after=True)
    with pytest.raises(SimulatedCrash):
        copy_step(src.storage, faulty, 2, threads=1)
    assert 2 in dst_b.open().steps() and dst_b.open().verify(2).ok
    assert_same(state(2), dst_b.open().load(2))


def test_same_content_of_v4_compares_references_not_their_attempt_names() -> None:
    """A copy (or replica) of a v4 step is the same checkpoint whatever attempt its references
    name (a replica names the remote's own copy of the referenced step), and another checkpoint
    if a reference's chunks differ: the comparison used to look at the own files only, so a
    remote v4 step with other references counted as identical (ckptfs cp left it, a tiered
    store counted the step as replicated)."""
    from ckptfs.format.incremental import Reference
    from ckptfs.format.sharded import Chunk, make_entry
    from ckptfs.format.versions import CHUNKED, REFERENCES, SHARDED
    from ckptfs.protocol.copy import same_content

    head, item = Chunk(0, 16, "aa" * 32), Chunk(16, 8, "bb" * 32)
    own = make_entry("rank-00000/data-0.safetensors", 24, "blake3", (head, item), 0)
    ref = Reference("ref-00000.safetensors", 1, "a-20260101T000000Z-0000000000000001",
                    "rank-00001/data-0.safetensors", 64, "blake3", (head, item))

    def v4(attempt: str, r: Reference) -> Manifest:
        return Manifest(2, attempt, (own,), "2026-01-01T00:00:00Z", "blake3", {},
                        frozenset({SHARDED, CHUNKED, REFERENCES}), world_size=2, references=(r,))

    a = v4("a-20260101T000000Z-000000000000000a", ref)
    renamed = dataclasses.replace(ref, attempt="a-20260102T000000Z-000000000000000b")
    assert same_content(a, v4("a-20260102T000000Z-000000000000000c", renamed))
    other = dataclasses.replace(ref, chunks=(head, Chunk(16, 8, "cc" * 32)))
    assert not same_content(a, v4("a-20260101T000000Z-000000000000000a", other))
    assert not same_content(a, v4("a-20260101T000000Z-000000000000000a",
                                  dataclasses.replace(ref, step=0)))


def test_cp_outliving_its_lease_copies_every_byte_again(
        local_backend: Backend, memory_backend: Backend,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A referencing copy whose marker lands after its lease, when a collector removed a file
    it references meanwhile: the copy is uncommitted and made again holding every byte (it
    used to raise CorruptCheckpointError "copy again", which the replicator took as permanent
    and gave the step up)."""
    import time as real_time
    from types import SimpleNamespace

    from ckptfs.protocol import commit as commit_mod  # the lease is the commit's

    src = populate(local_backend)
    copy_step(src.storage, memory_backend.open().storage, 1)
    dst = memory_backend.open()
    late: list[bool] = []
    real_commit = commit_mod.Attempt.commit
    real_create = dst.storage.create_exclusive
    referenced: list[str] = []

    def commit(self: Any, manifest: Any, **kw: Any) -> Any:
        referenced[:] = [r.location for r in getattr(manifest, "references", ())]
        return real_commit(self, manifest, **kw)

    def create_exclusive(path: str, data: bytes) -> Any:
        out = real_create(path, data)
        if referenced and not late:  # the lease runs out, a collector takes a referenced file
            late.append(True)
            dst.storage.delete(referenced[0])
        return out

    monkeypatch.setattr(commit_mod.Attempt, "commit", commit)
    monkeypatch.setattr(dst.storage, "create_exclusive", create_exclusive)
    monkeypatch.setattr(commit_mod, "time", SimpleNamespace(
        monotonic=lambda: real_time.monotonic() + (1e6 if late else 0.0)))
    assert copy_step(src.storage, dst.storage, 2).status == "copied"
    assert late
    assert manifest(dst, 2).references == ()
    assert_same(state(2), memory_backend.open().load(2))
    assert memory_backend.open().verify(2).ok
