"""Sharded incremental checkpoints (format v4, docs/protocol.md §9.6): every
rank of a collective save references the items of its previous save in this process that did
not change (an FSDP2 model with a frozen layer), and every reader treats the references as it
treats the rank files: loads on 2 ranks and in one process (resharded 2 -> 1), verify,
``check_checkpoint``, a tampered referenced chunk caught, a pre-v4 reader refusing.

One W=2 gloo job saves three steps and loads each on both ranks; everything else runs in this
process on what it wrote."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks, save_sharded
from test_sharded import targets, to_plain

import ckptfs
import ckptfs.format.versions as versions
from ckptfs.errors import CorruptCheckpointError, FormatVersionError
from ckptfs.format.incremental import (
    referenced_chunks,
    references_of,
)
from ckptfs.format.layout import StepPaths
from ckptfs.lifecycle.gc import collect
from ckptfs.protocol.formats import check_checkpoint
from ckptfs.protocol.incremental import ReuseMemory
from ckptfs.testing.conformance import assert_state_equal

STEPS = (1, 2, 3)
#: Bytes of the frozen layer (Linear(128, 65), fp32): referenced, never written again.
FROZEN_BYTES = (65 * 128 + 65) * 4


def job_three_saves(rank: int, world: int, url: str) -> Any:
    """Train a 2-layer MLP whose first (large) layer is frozen, FSDP2 on ``world`` ranks
    (uneven Shard(0): 65 rows), saving after each step with an incremental store; each step
    is loaded back on every rank (another target placement) and compared bit-exact."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(128, 65), torch.nn.ReLU(),
                                torch.nn.Linear(65, 3))
    model[0].requires_grad_(False)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    store = ckptfs.open(url, incremental=True)
    out: dict[str, Any] = {"infos": [], "plain": []}
    for step in STEPS:
        model(torch.randn(4, 128)).sum().backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "trainer": {"step": step, "lr": 0.01}}
        info = store.save(step, state)
        plain = _copied(to_plain(state))  # the optimizer's step tensors change in place
        out["infos"].append((info.step, info.attempt, info.manifest.format_version,
                             info.bytes_written, info.bytes))
        out["plain"].append(plain if rank == 0 else None)
        into = targets(plain, mesh, lambda t: Shard(1) if t.dim() >= 2 and t.shape[1] > 1
                       else (Replicate() if t.dim() == 1 else None))
        assert store.load(step, into=into) is into
        assert_state_equal(to_plain(into), plain)
    return out


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_sharded_incremental_two_ranks(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r0, r1 = run_ranks(job_three_saves, 2, str(run), timeout=300)
    assert r0["infos"] == r1["infos"]  # every rank: the same committed checkpoints
    store = ckptfs.open(str(run))
    for i, (step, _, version, written, logical) in enumerate(r0["infos"]):
        assert version == 4
        if i == 0:
            assert written == logical  # nothing to reuse yet: everything written
        else:
            # Every byte of the frozen layer is referenced (the rest: the trained layer, its
            # optimizer state, dcp.msgpack).
            assert logical - written >= FROZEN_BYTES, (step, written, logical)
            assert written < logical / 2, (step, written, logical)
        info = store.info(step)
        m = info.manifest
        assert m.format_version == 4
        assert bool(m.references) == (i > 0)
        # Resharded 2 -> 1: the whole state in this process, bit-exact.
        assert_state_equal(store.load(step), r0["plain"][i])
        report = store.verify(step)
        assert report.ok, report.problems
        check_checkpoint(store.storage, info)
    # Step 3 references the files of step 1 (frozen since) through step 2's index: a
    # reference always names the file that holds the bytes.
    m3 = store.info(3).manifest
    assert {r.step for r in references_of(m3)} == {1}
    chunks = referenced_chunks([m3])
    assert chunks and all(loc.startswith("checkpoints/step-000000000001/") for loc in chunks)

    # A tampered referenced chunk: CorruptCheckpointError on load and on verify.
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    ref = references_of(m3)[0]
    used = ref.chunks[1]  # a frozen weight's chunk (chunks[0] is the header)
    _flip(bad / ref.location, used.offset + used.length // 2)
    bad_store = ckptfs.open(str(bad))
    with pytest.raises(CorruptCheckpointError, match=r"rank-0000[01]/data-0\.safetensors"):
        bad_store.load(3)
    with pytest.raises(CorruptCheckpointError, match=f"{ref.path}: .*differ from their digest"):
        bad_store.verify(3)
    # A tampered header chunk of a referenced file: refused as well (its digest).
    bad2 = tmp_path / "bad2"
    shutil.copytree(run, bad2)
    _flip(bad2 / ref.location, 20)
    with pytest.raises(CorruptCheckpointError):
        ckptfs.open(str(bad2)).load(3)
    # A referenced file deleted: the listing check refuses before reading.
    (bad2 / ref.location).unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        ckptfs.open(str(bad2)).load(3)

    # Deletes and gc never take what a v4 checkpoint references: step 1 deleted (its attempt
    # retired, its files still used by 2 and 3), then 2; step 3 still loads bit-exact.  Once
    # 3 is gone too, gc frees every byte.
    store.delete(1)
    store.delete(2)
    assert (run / ref.location).exists()
    assert_state_equal(store.load(3), r0["plain"][2])
    assert store.verify(3).ok
    collect(store.storage, older_than=timedelta(0))
    assert_state_equal(store.load(3), r0["plain"][2])
    store.delete(3)
    collect(store.storage, older_than=timedelta(0))
    assert not [p for p in (run / "checkpoints").rglob("*") if p.is_file()]


def test_pre_v4_reader_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ckptfs.open(str(tmp_path), incremental=True)
    info = save_sharded(store.storage, 1, {"w": torch.ones(8)}, memory=ReuseMemory())
    assert info.manifest.format_version == 4
    monkeypatch.setattr(versions, "READ_VERSIONS", (1, 2, 3))
    with pytest.raises(FormatVersionError, match="format version 4"):
        ckptfs.open(str(tmp_path)).load(1)


def test_in_process_reuse_and_fence(tmp_path: Path) -> None:
    """One process, no process group: the v4 save reuses what did not change, by digest
    (a tensor changed without bumping its version is written), and a protector deleted
    before the next save fails the fence: that save is written in full, and committed."""
    store = ckptfs.open(str(tmp_path), incremental=True)
    mem = ReuseMemory()
    frozen, w = torch.randn(64, 64), torch.randn(8)
    state = {"frozen": frozen, "w": w, "n": 1}
    first = save_sharded(store.storage, 1, state, memory=mem)
    assert first.bytes_written == first.bytes
    with torch.no_grad():
        w.add_(1)
    second = save_sharded(store.storage, 2, state, memory=mem)
    assert second.bytes_written < second.bytes / 4
    assert_state_equal(store.load(2), state)
    # Same data_ptr and _version, different bytes (written behind autograd's back): the
    # digest decides, so it is written, not referenced.
    frozen.data[0, 0] += 1
    third = save_sharded(store.storage, 3, state, memory=mem)
    assert third.bytes_written > frozen.numel() * 4
    assert all(c.length != frozen.numel() * 4 for r in references_of(third.manifest)
               for c in r.chunks[1:])  # w (unchanged) is referenced, frozen is not
    assert_state_equal(store.load(3), state)
    # Step 4 would reference step 3 (its protector): deleted first, so the fence refuses and
    # the save is retried writing every byte.
    fourth_state = dict(state, n=4)
    save_sharded(store.storage, 4, fourth_state, memory=mem)  # references step 3
    assert references_of(store.info(4).manifest)
    store.delete(4)
    store.delete(3)
    mem_before = mem.rank_index
    assert mem_before is not None and mem_before.protector[0] == 4
    fifth = save_sharded(store.storage, 5, fourth_state, memory=mem)
    # The memory's protector (step 4) is gone: the fence failed, the retry wrote every byte.
    assert not references_of(fifth.manifest)
    assert fifth.bytes_written == fifth.bytes
    assert_state_equal(store.load(5), fourth_state)
    assert store.verify(5).ok
    assert not (tmp_path / StepPaths(4).marker).exists()


# -- a resumed job: the first save of a new process reuses what the run stores ----------------


def job_one_save(rank: int, world: int, url: str, step: int) -> Any:
    """A job that saves once: FSDP2 on ``world`` ranks, a frozen first layer (the same
    seeded values in every job) and a trained second layer whose values depend on ``step``; a
    fresh process, so its store has no reuse memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(128, 65), torch.nn.ReLU(),
                                torch.nn.Linear(65, 3))
    with torch.no_grad():
        model[2].weight.add_(float(step))  # the trained part changed since the last job
    model[0].requires_grad_(False)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    store = ckptfs.open(url, incremental=True)
    info = store.save(step, {"model": model.state_dict(), "trainer": {"step": step}})
    return info.step, info.attempt, info.bytes_written, info.bytes


def test_a_resumed_two_rank_job_writes_only_what_changed(tmp_path: Path) -> None:
    """Step 1 by one job, step 2 by a new job (new processes, nothing in memory): step 2 reads
    the run's newest checkpoint to decide what it reuses, as a single-process save does, and
    writes only what changed (before: every byte, the first save of a process wrote
    everything)."""
    run = tmp_path / "run"
    first = run_ranks(job_one_save, 2, str(run), 1, timeout=300)
    second = run_ranks(job_one_save, 2, str(run), 2, timeout=300)
    assert first[0] == first[1] and second[0] == second[1]
    _, _, written1, logical1 = first[0]
    _, _, written2, logical2 = second[0]
    assert written1 == logical1
    assert logical2 - written2 >= FROZEN_BYTES, (written2, logical2)  # the frozen layer
    assert written2 < logical2 / 2
    store = ckptfs.open(str(run))
    m = store.info(2).manifest
    assert {r.step for r in references_of(m)} == {1}
    assert store.verify(2).ok
    got, one = store.load(2), store.load(1)
    assert torch.equal(got["model"]["0.weight"], one["model"]["0.weight"])
    assert torch.allclose(got["model"]["2.weight"], one["model"]["2.weight"] + 1.0)


def test_a_new_process_reuses_after_checking_each_stored_chunk(tmp_path: Path) -> None:
    """One rank, a new reuse memory per save (a new job each time): the save reuses the newest
    checkpoint's unchanged items by digest, after reading each stored chunk and its file's
    header chunk once; a rotted item chunk or header chunk is never reused (the item is
    written again, and the checkpoint loads), and a non-matching digest is written."""
    store = ckptfs.open(str(tmp_path), incremental=True)
    frozen, other, w = torch.randn(64, 64), torch.randn(32, 32), torch.randn(8)
    first = save_sharded(store.storage, 1, {"frozen": frozen, "other": other, "w": w},
                         memory=ReuseMemory())
    assert first.bytes_written == first.bytes
    # New objects with the same bytes (a job that loaded them): the digest decides.
    state2 = {"frozen": frozen.clone(), "other": other.clone(), "w": w + 1}
    second = save_sharded(store.storage, 2, state2, memory=ReuseMemory())
    assert second.bytes_written < second.bytes - (64 * 64 + 32 * 32) * 4 + 1
    assert {r.step for r in references_of(second.manifest)} == {1}
    assert_state_equal(store.load(2), state2)
    # Rot in the stored chunk of `other` (step 1's rank file): a new job writes it again.
    ref = references_of(second.manifest)[0]
    rank_file = tmp_path / ref.location
    sizes = sorted(c.length for c in ref.chunks[1:])
    other_chunk = next(c for c in ref.chunks[1:] if c.length == 32 * 32 * 4)
    assert sizes == [32 * 32 * 4, 64 * 64 * 4]
    _flip(rank_file, other_chunk.offset + 7)
    third = save_sharded(store.storage, 3, dict(state2), memory=ReuseMemory())
    used = {c.length for r in references_of(third.manifest) for c in r.chunks[1:]}
    assert 32 * 32 * 4 not in used and 64 * 64 * 4 in used
    assert_state_equal(store.load(3), state2)
    assert store.verify(3).ok
    # Rot in the header chunk of the file step 3 still references: nothing of it is reused.
    ref3 = next(r for r in references_of(third.manifest) if r.step == 1)
    _flip(tmp_path / ref3.location, 20)
    fourth = save_sharded(store.storage, 4, dict(state2), memory=ReuseMemory())
    assert all(r.step != 1 for r in references_of(fourth.manifest))
    assert_state_equal(store.load(4), state2)
    assert store.verify(4).ok
