"""Copies of checkpoints with references (formats v3, v4): ``ckptfs cp``, ``ckptfs replicate``
and the replicator commit a copy whose every reference resolves at the destination, to bytes
read and checked there; and the commit itself refuses, before the marker, a reference that does
not resolve at its storage, whoever writes it."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_golden import GOLDEN, assert_bit_exact
from test_incremental_cp import populate, state

import ckptfs
from ckptfs.cli.core import main
from ckptfs.errors import CorruptCheckpointError, ReplicationError
from ckptfs.format.features import REFERENCES, SHARDED
from ckptfs.format.incremental import Reference
from ckptfs.format.layout import StepPaths
from ckptfs.format.manifest import Manifest
from ckptfs.format.sharded import ChunkedFileEntry
from ckptfs.protocol.commit import Attempt
from ckptfs.protocol.copy import copy_step
from ckptfs.protocol.replication import Replicator
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.testing.backend import Backend


def _recipe() -> dict[int, Any]:
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    recipe: dict[int, Any] = mod.golden_v4()
    return recipe


def _golden_v4(tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(GOLDEN / "v4" / "run", dst)
    return dst


def _attempts(storage: FsspecStorage, step: int) -> set[str]:
    m = ckptfs.CheckpointStore(storage).info(step).manifest
    assert m.format_version == 4 and m.references
    return {r.attempt for r in m.references}


# -- part 1: a v4 copy's references name the destination's own copies ---------------------------


@pytest.mark.sharded
def test_cp_of_v4_loads_bit_exact_at_the_destination(tmp_path: Path) -> None:
    src, dst = _golden_v4(tmp_path), tmp_path / "dst"
    assert main(["cp", str(src), str(dst), "--all"]) == 0
    recipe = _recipe()
    store = ckptfs.open(str(dst))
    for step in (1, 2):
        assert_bit_exact(store.load(step), recipe[step][0])
        assert store.verify(step).ok
    # step 2 references step 1's copy AT the destination, never the source's attempt
    assert _attempts(store.storage, 2) == {store.info(1).attempt}  # type: ignore[arg-type]
    assert store.info(1).attempt != ckptfs.open(str(src)).info(1).attempt


@pytest.mark.sharded
def test_replicator_of_v4_loads_bit_exact_at_the_remote(tmp_path: Path) -> None:
    """The single-process replicator (and ``ckptfs replicate``) copies through `copy_step`."""
    src, dst = _golden_v4(tmp_path), tmp_path / "remote"
    local, remote = FsspecStorage(str(src)), FsspecStorage(str(dst))
    rep = Replicator(local, remote)
    try:
        rep.enqueue(1, 0)
        rep.enqueue(2, 0)
        rep.wait()
        status = rep.status()
    finally:
        rep.close()
    assert {s: r.state for s, r in status.steps.items()} == {1: "replicated", 2: "replicated"}
    recipe = _recipe()
    store = ckptfs.open(str(dst))
    for step in (1, 2):
        assert_bit_exact(store.load(step), recipe[step][0])


@pytest.mark.sharded
def test_cp_of_a_lone_v4_step_copies_what_it_references_into_a_retired_attempt(
        tmp_path: Path) -> None:
    """Step 2 alone into a fresh root: the files it references (step 1's) are copied into a
    retired attempt of step 1 there (no marker, as a prune leaves one); step 2 loads
    bit-exact and verifies; step 1 is not a committed step there."""
    src, dst = _golden_v4(tmp_path), tmp_path / "dst"
    result = copy_step(FsspecStorage(str(src)), FsspecStorage(str(dst)), 2)
    assert result.status == "copied"
    store = ckptfs.open(str(dst))
    assert store.steps() == [2]
    assert not (dst / StepPaths(1).marker).exists()
    (retired,) = _attempts(store.storage, 2)  # type: ignore[arg-type]
    assert (dst / StepPaths(1).attempt_dir(retired) / "MANIFEST.json").exists()
    assert retired != ckptfs.open(str(src)).info(1).attempt
    assert_bit_exact(store.load(2), _recipe()[2][0])
    assert store.verify(2).ok
    # a later copy of step 1 commits it beside the retired attempt; both steps load
    copy_step(FsspecStorage(str(src)), FsspecStorage(str(dst)), 1)
    assert_bit_exact(store.load(1), _recipe()[1][0])
    assert_bit_exact(store.load(2), _recipe()[2][0])


@pytest.mark.sharded
def test_a_failed_lone_v4_copy_leaves_no_retired_attempt(tmp_path: Path) -> None:
    src, dst = _golden_v4(tmp_path), tmp_path / "dst"
    info = ckptfs.open(str(src)).info(2)
    m2 = info.manifest
    assert m2.format_version == 4
    own = next(e for e in m2.files if e.path.startswith("rank-"))
    target = src / info.path / own.path
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01  # step 2's own rank file: found while it is copied, after step 1's
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        copy_step(FsspecStorage(str(src)), FsspecStorage(str(dst)), 2)
    left = [p for p in dst.rglob("*") if p.is_file()] if dst.exists() else []
    assert left == []


def test_sharded_replica_of_a_step_not_at_the_remote_is_refused(tmp_path: Path) -> None:
    """Without the source run root (the sharded replicator: files on several nodes) a step
    the remote does not hold cannot be referenced: refused, nothing written."""
    from ckptfs.protocol.copy_io import references_at
    src = _golden_v4(tmp_path)
    m2 = ckptfs.open(str(src)).info(2).manifest
    with pytest.raises(ReplicationError, match="cannot be copied by reference"):
        references_at(FsspecStorage(str(tmp_path / "remote")), m2)


@pytest.mark.sharded
def test_cp_of_v4_refuses_rotted_destination_bytes(tmp_path: Path) -> None:
    """Step 1 copied, a byte of its rank file rotted at the destination, step 2 (which
    references it) copied: refused, naming the file; nothing committed."""
    src, dst = _golden_v4(tmp_path), tmp_path / "dst"
    s, d = FsspecStorage(str(src)), FsspecStorage(str(dst))
    copy_step(s, d, 1)
    info = ckptfs.CheckpointStore(d).info(1)
    m2 = ckptfs.CheckpointStore(s).info(2).manifest
    assert m2.format_version == 4
    ref = m2.references[0]
    target = dst / info.path / ref.source
    data = bytearray(target.read_bytes())
    data[ref.chunks[-1].offset] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=ref.source.replace("/", ".")):
        copy_step(s, d, 2)
    assert not (dst / StepPaths(2).marker).exists()


# -- part 2: v3: a rotted destination chunk is written again, never referenced -----------------


def test_cp_of_v3_writes_rotted_destination_bytes_again(local_backend: Backend, tmp_path: Path
                                                         ) -> None:
    src = populate(local_backend)
    dst = ckptfs.open(str(tmp_path / "dst"))
    copy_step(src.storage, dst.storage, 1)
    info = dst.info(1)
    m1 = info.manifest
    assert m1.format_version == 3
    rotted = next(e for e in m1.files if e.path != "state.msgpack")
    path = tmp_path / "dst" / info.path / rotted.path
    data = bytearray(path.read_bytes())
    data[rotted.chunks[1].offset] ^= 0x01  # the first tensor's first byte
    path.write_bytes(bytes(data))
    copy_step(src.storage, dst.storage, 2)
    m2 = dst.info(2).manifest
    assert m2.format_version == 3
    assert all(not (r.step == 1 and r.source == rotted.path) for r in m2.references), \
        "the copy referenced the rotted file"
    assert dst.verify(2).ok
    assert_bit_exact(dst.load(2), state(2))


def test_replicator_does_not_report_rotted_references_replicated(local_backend: Backend,
                                                                 tmp_path: Path) -> None:
    src = populate(local_backend)
    remote = FsspecStorage(str(tmp_path / "remote"))
    copy_step(src.storage, remote, 1)
    info = ckptfs.CheckpointStore(remote).info(1)
    m1 = info.manifest
    assert m1.format_version == 3
    for e in m1.files:
        if e.path != "state.msgpack":
            path = tmp_path / "remote" / info.path / e.path
            data = bytearray(path.read_bytes())
            data[e.chunks[1].offset] ^= 0x01
            path.write_bytes(bytes(data))
    rep = Replicator(src.storage, remote)
    try:
        rep.enqueue(2, 0)
        rep.wait()
        status = rep.status()
    finally:
        rep.close()
    assert status.steps[2].state == "replicated"
    store = ckptfs.CheckpointStore(remote)
    assert store.verify(2).ok  # replicated: every byte it uses is good
    assert_bit_exact(store.load(2), state(2))


# -- the commit refuses a dangling reference, for every writer -------------------------------


def test_commit_refuses_a_dangling_reference(local_backend: Backend) -> None:
    store = populate(local_backend, steps=(1,))
    info = store.info(1)
    m1 = info.manifest
    assert m1.format_version == 3
    entry = next(e for e in m1.files if e.path != "state.msgpack")
    good = Reference("ref-00000.safetensors", 1, info.attempt, entry.path, entry.size,
                     entry.algorithm, (entry.chunks[0],))
    for bad, what in ((dataclasses.replace(good, attempt="a-20000101T000000Z-0000000000000000"),
                       "which is missing"),
                      (dataclasses.replace(good, size=entry.size + 1), "size differs")):
        att = Attempt.open(store.storage, 5, algorithm=m1.hash_algorithm)
        w = att.write_file("state.msgpack", 1, lambda: iter([memoryview(b"\x80")]), pieces=[1])
        manifest = Manifest(5, att.name, (w.chunked_entry(m1.hash_algorithm, [1]),),
                            m1.created, m1.hash_algorithm, {}, m1.features, references=(bad,))
        with pytest.raises(CorruptCheckpointError, match=f"{what}.*nothing was committed"):
            att.commit(manifest)
        assert not store.storage.exists(StepPaths(5).marker)
        assert not store.storage.exists(StepPaths(5).attempt_dir(att.name))
    assert store.steps() == [1]


@pytest.mark.sharded
def test_v4_manifest_naming_the_sources_attempts_is_refused_by_the_commit(tmp_path: Path
                                                                        ) -> None:
    """What the copy of a v4 step used to commit: its manifest with only ``attempt`` changed."""
    src, dst = _golden_v4(tmp_path), tmp_path / "dst"
    s, d = FsspecStorage(str(src)), FsspecStorage(str(dst))
    copy_step(s, d, 1)
    m2 = ckptfs.CheckpointStore(s).info(2).manifest
    assert m2.format_version == 4 and m2.references
    att = Attempt.open(d, 2, algorithm=m2.hash_algorithm, durable=False)
    with pytest.raises(CorruptCheckpointError, match=r"which is missing.*nothing was committed"):
        att.commit(dataclasses.replace(m2, attempt=att.name))
    assert not (dst / StepPaths(2).marker).exists()


# -- the same guarantees on both world sizes (the one copier over a group) ---------------------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def job_copy_cells(rank: int, world: int, root: str) -> dict[str, Any]:
    """`StepCopier` on every rank of a group of ``world`` (each rank holds its own rank files
    of the v4 run; the v3 run, saved by one process, is the coordinator's): what each rank
    returns or raises."""
    import torch.distributed as dist

    from ckptfs.protocol.copy import StepCopier
    from ckptfs.protocol.group import group_of

    group = group_of(None)

    def copier(src: str, dst: str) -> StepCopier:
        return StepCopier(FsspecStorage(f"{root}/{src}"), FsspecStorage(f"{root}/{dst}"), group)

    def outcome(run: Any) -> str:
        try:
            return str(run().status)
        except Exception as exc:
            return type(exc).__name__

    out: dict[str, Any] = {}
    # A v4 step's references name the destination's own copy of the step they take bytes from.
    c = copier("v4", "dst")
    out["copy"] = [c(1).status, c(2).status]
    # A referenced chunk rotted at the destination: refused on every rank, nothing committed.
    rot = copier("v4", "rot")
    rot(1)
    if rank == 0:
        m2 = ckptfs.CheckpointStore(FsspecStorage(f"{root}/v4")).info(2).manifest
        assert {SHARDED, REFERENCES} <= m2.features
        ref = m2.references[0]
        there = ckptfs.CheckpointStore(FsspecStorage(f"{root}/rot")).info(1)
        _flip(Path(root) / "rot" / there.path / ref.source, ref.chunks[-1].offset)
    dist.barrier()
    out["rot"] = outcome(lambda: rot(2))
    # A lone v4 step: its referenced files copied into a retired attempt where the coordinator
    # holds every source file; refused where the files lie on several nodes.
    out["lone"] = outcome(lambda: copier("v4", "lone")(2))
    # v3: a rotted destination chunk is written again, never referenced.
    v3 = copier("v3", "v3dst")
    v3(1)
    if rank == 0:
        info = ckptfs.CheckpointStore(FsspecStorage(f"{root}/v3dst")).info(1)
        for e in info.manifest.files:
            if e.path != "state.msgpack":
                assert isinstance(e, ChunkedFileEntry)
                _flip(Path(root) / "v3dst" / info.path / e.path, e.chunks[1].offset)
    dist.barrier()
    out["v3"] = v3(2).status
    return out


@pytest.mark.sharded
@pytest.mark.parametrize("world", [1, 2])
def test_copy_guarantees_on_both_world_sizes(world: int, tmp_path: Path) -> None:
    """The copy of a v4 step resolves its references at the destination before the marker,
    reads and checks every destination chunk it references (v4: rot refuses; v3: rot is
    written again), whatever the world size; every rank returns or raises alike."""
    from dist_util import run_ranks

    shutil.copytree(GOLDEN / "v4" / "run", tmp_path / "v4")
    v3 = ckptfs.open(str(tmp_path / "v3"), incremental=True)
    for s in (1, 2):
        v3.save(s, state(s))
    results = run_ranks(job_copy_cells, world, str(tmp_path), timeout=240)
    lone = "copied" if world == 1 else "ReplicationError"
    assert results == [{"copy": ["copied", "copied"], "rot": "CorruptCheckpointError",
                        "lone": lone, "v3": "copied"}] * world
    dst = ckptfs.open(str(tmp_path / "dst"))
    assert _attempts(dst.storage, 2) == {dst.info(1).attempt}  # type: ignore[arg-type]
    recipe = _recipe()
    for step in (1, 2):
        assert_bit_exact(dst.load(step), recipe[step][0])
    assert not (tmp_path / "rot" / StepPaths(2).marker).exists()
    assert ckptfs.open(str(tmp_path / "lone")).steps() == ([2] if world == 1 else [])
    v3dst = ckptfs.open(str(tmp_path / "v3dst"))
    m2 = v3dst.info(2).manifest
    assert REFERENCES in m2.features and SHARDED not in m2.features
    assert all(r.step != 1 for r in m2.references), "the copy referenced a rotted file"
    assert v3dst.verify(2).ok
    assert_bit_exact(v3dst.load(2), state(2))


@pytest.mark.sharded
def test_v4_copy_whose_referenced_destination_step_is_deleted_is_copied_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The destination's step 1, which the copy of step 2 references, is deleted before the
    marker: the commit's fence refuses (as for every writer that references stored bytes)
    and the copy is made once more, its referenced files copied into a retired attempt."""
    from ckptfs.protocol import commit as commit_mod

    src, dst = _golden_v4(tmp_path), tmp_path / "dst"
    s, d = FsspecStorage(str(src)), FsspecStorage(str(dst))
    copy_step(s, d, 1)
    real, deleted = commit_mod.read_marker, []

    def read_marker(storage: Any, step: int, *args: Any) -> Any:
        if step == 1 and not deleted:
            deleted.append(1)
            ckptfs.CheckpointStore(d).delete(1)
        return real(storage, step, *args)

    monkeypatch.setattr(commit_mod, "read_marker", read_marker)
    assert copy_step(s, d, 2).status == "copied"
    assert deleted
    store = ckptfs.open(str(dst))
    assert store.steps() == [2]
    assert_bit_exact(store.load(2), _recipe()[2][0])
    assert store.verify(2).ok
