"""CheckpointManager: trainer state, manager state, the bit-identical resume, save/restore
edge cases (local and memory)."""

from __future__ import annotations

import json
import logging
import pathlib
import random

import pytest
import torch

import ckptfs
from ckptfs.cli.demo import ShuffleSampler, ToyTask, train
from ckptfs.errors import CheckpointExistsError, CheckpointNotFoundError
from ckptfs.format.layout import StepPaths
from ckptfs.lifecycle.manager import decode_rng, encode_rng
from ckptfs.lifecycle.rng import capture
from ckptfs.testing.backend import Backend
from ckptfs.testing.lifecycle import (
    CrashingStorage,
    InjectedCrash,
    resume_and_finish,
    run_reference,
)


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def test_exports() -> None:
    assert ckptfs.CheckpointManager is not None and ckptfs.Best is not None
    assert "CheckpointManager" in ckptfs.__all__ and "Provenance" in ckptfs.__all__


def test_bit_identical_resume_with_dropout_and_shuffling(backend: Backend) -> None:
    """The resumed run's losses and parameters equal an uninterrupted run's, bit for bit; the
    task uses dropout and a torch-RNG shuffling sampler, so the RNG restore matters."""
    total, every = 60, 15
    ref_losses, ref_params = run_reference(total)
    task = ToyTask()
    mgr = ckptfs.CheckpointManager(backend.open(), save_every=every, run_seed=7)
    train(task, mgr, 0, 40, every, final_save=False)  # killed after step 39: last save 30
    start, resumed, params = resume_and_finish(backend, total, every)
    assert start == 31
    assert [resumed[s].hex() for s in range(31, total)] == \
        [ref_losses[s].hex() for s in range(31, total)]
    for k, v in ref_params.items():
        assert torch.equal(params[k], v), k
    assert ShuffleSampler(512, 32).n == 512  # the sampler crosses epochs in 60 steps of 32
    assert total * 32 > 512


def test_resume_without_rng_restore_diverges(backend: Backend) -> None:
    """Control for the test above: if the RNG were not restored, the run would differ."""
    total, every = 40, 10
    ref_losses, _ = run_reference(total)
    task = ToyTask()
    mgr = ckptfs.CheckpointManager(backend.open(), save_every=every)
    train(task, mgr, 0, 21, every, final_save=False)
    task2 = ToyTask()
    mgr2 = ckptfs.CheckpointManager(backend.open(), save_every=every)
    start = mgr2.restore_latest(model=task2.model, optimizer=task2.opt, scheduler=task2.sched,
                                stateful={"sampler": task2.sampler})
    ckptfs.lifecycle.rng.seed_all(1)  # throw the restored RNG away
    losses = train(task2, None, start, total, every)
    assert any(losses[s] != ref_losses[s] for s in losses)


def test_trainer_and_manager_state_restored(backend: Backend) -> None:
    model = torch.nn.Linear(3, 2)
    mgr = ckptfs.CheckpointManager(backend.open(), run_seed=99)
    for applied in (True, False, True):
        mgr.trainer.record_update(applied)
    mgr.save(5, model=model, epoch=2, extra={"tokens_seen": 12345, "note": "warmup"})
    info = backend.open().info(5)
    assert info.metadata["trainer"] == {"step": 5, "attempted_updates": 3,
                                        "successful_updates": 2, "epoch": 2}
    other = ckptfs.CheckpointManager(backend.open(), run_seed=1)
    model2 = torch.nn.Linear(3, 2)
    assert other.restore_latest(model=model2) == 6
    assert torch.equal(model2.weight, model.weight)
    t = other.trainer
    assert (t.step, t.attempted_updates, t.successful_updates, t.epoch) == (5, 3, 2, 2)
    assert t.extra == {"tokens_seen": 12345, "note": "warmup"}
    assert other.run_seed == 99 and other.resumed_from == 5
    other.save(6, model=model2)
    meta = backend.open().info(6).metadata
    assert meta["lifecycle"]["resumed_from"] == 5


def test_should_save() -> None:
    mgr = ckptfs.CheckpointManager("memory://should-save", save_every=10)
    assert [s for s in range(35) if mgr.should_save(s)] == [10, 20, 30]
    assert not ckptfs.CheckpointManager("memory://x2").should_save(10)
    with pytest.raises(ValueError):
        ckptfs.CheckpointManager("memory://x3", save_every=0)


def test_restore_empty_returns_zero(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open())
    model = torch.nn.Linear(2, 2)
    before = capture()
    assert mgr.restore_latest(model=model) == 0
    assert torch.equal(capture()["torch"], before["torch"])  # a fresh start leaves RNG alone


def test_restore_names_missing_state(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open())
    mgr.save(1, model=torch.nn.Linear(2, 2))
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(CheckpointNotFoundError, match="optimizer"):
        ckptfs.CheckpointManager(backend.open()).restore_latest(optimizer=opt)


def test_committed_step_not_overwritten(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open())
    mgr.save(3, model=torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointExistsError):
        mgr.save(3, model=torch.nn.Linear(2, 2))


def test_non_writer_rank_writes_nothing(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open(), rank=1, world_size=2)
    result = mgr.save(4, model=torch.nn.Linear(2, 2))
    assert result.info is None
    assert backend.open().all_steps() == []
    with pytest.raises(ValueError, match="outside world size"):
        ckptfs.CheckpointManager(backend.open(), rank=2, world_size=2)


def test_metrics_on_a_non_writer_rank_are_not_dropped_silently(
        backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    """Without torch.distributed a non-writer rank writes nothing; metrics given to it are
    not recorded, and it says so (once), naming the writer rank."""
    mgr = ckptfs.CheckpointManager(backend.open(), rank=1, world_size=2)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        assert mgr.save(1, metrics={"loss": 0.5}).info is None
        mgr.save(2, metrics={"loss": 0.4})
    assert caplog.text.count("its metrics are not recorded") == 1
    assert "pass metrics on rank 0" in caplog.text
    with pytest.raises(ckptfs.UnsupportedValueError):  # checked there too
        mgr.save(3, metrics={"loss": [1, 2]})


def test_restore_walks_like_the_store_when_a_newer_step_lands(backend: Backend,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """The manager resolves through the store's walk (``walk_latest``): while it reads step 2,
    another job commits step 3 and prunes step 2; the restore resumes from 3, not from 1."""
    store = backend.open()
    mgr = ckptfs.CheckpointManager(store)
    for step in (1, 2):
        mgr.save(step, model=torch.nn.Linear(2, 2))
    other = ckptfs.CheckpointManager(backend.open(), keep_last=1)
    newest = torch.nn.Linear(2, 2)
    real_load = store.load_info
    seen: list[int | None] = []

    def load_info(info: ckptfs.CheckpointInfo, **kw: object) -> dict[object, object]:
        seen.append(info.step)
        if info.step == 2 and len(seen) == 1:
            other.save(3, model=newest)  # commits 3, prunes 1 and 2
        return real_load(info, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "load_info", load_info)
    model = torch.nn.Linear(2, 2)
    assert ckptfs.CheckpointManager(store).restore_latest(model=model) == 4
    assert torch.equal(model.weight, newest.weight)
    assert seen[0] == 2 and seen[-1] == 3


def test_rank_states_from_gather_hook(backend: Backend) -> None:
    states = {}
    for r in range(3):
        torch.manual_seed(100 + r)
        random.seed(100 + r)
        states[r] = capture()
    mgr = ckptfs.CheckpointManager(backend.open(), world_size=3,
                                   rng_gather=lambda mine: states)
    mgr.save(1)
    assert backend.open().info(1).metadata["rng_ranks"] == [0, 1, 2]
    for r in range(3):
        m = ckptfs.CheckpointManager(backend.open(), rank=r, world_size=3)
        m.restore_latest()
        assert torch.equal(capture()["torch"], states[r]["torch"])
        assert capture()["python"] == states[r]["python"]


def test_rng_wire_encoding_roundtrip() -> None:
    state = capture()
    back = decode_rng(encode_rng(state))
    assert torch.equal(back["torch"], state["torch"]) and back["python"] == state["python"]
    assert back.get("numpy") == state.get("numpy")


def test_world_size_without_gather_warns(backend: Backend,
                                         caplog: pytest.LogCaptureFixture) -> None:
    mgr = ckptfs.CheckpointManager(backend.open(), rank=0, world_size=2)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        mgr.save(1)
    assert "only rank 0's RNG state is saved" in caplog.text
    assert backend.open().info(1).metadata["rng_ranks"] == [0]


def test_crash_at_data_write_leaves_previous_latest(backend: Backend) -> None:
    store = backend.open()
    mgr = ckptfs.CheckpointManager(store, keep_last=1)
    mgr.save(1, model=torch.nn.Linear(2, 2))
    store.storage = CrashingStorage(store.storage, "open_write", "step-000000000002")
    with pytest.raises(InjectedCrash, match="injected"):
        mgr.save(2, model=torch.nn.Linear(2, 2))
    fresh = backend.open()
    assert fresh.steps() == [1]  # no prune ran: the failed save never committed
    assert ckptfs.CheckpointManager(fresh).restore_latest(model=torch.nn.Linear(2, 2)) == 2


def test_metrics_in_metadata_are_json(backend: Backend) -> None:
    mgr = ckptfs.CheckpointManager(backend.open())
    mgr.save(1, metrics={"a": float("nan"), "b": torch.tensor(2.5), "c": 3, "d": None})
    meta = backend.open().info(1).metadata
    assert meta["metrics"] == {"a": None, "b": 2.5, "c": 3.0, "d": None}
    json.dumps(meta, allow_nan=False)
    assert backend.raw_exists(StepPaths(1).marker)


_DIST_WORKER = r"""
import hashlib, random, sys
import torch, torch.distributed as dist
import ckptfs
from ckptfs.lifecycle import rng
rank, world, root, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
rng.seed_all(500 + rank)
random.random()
def digest():
    st = rng.capture()
    return hashlib.sha256(st["torch"].numpy().tobytes() + repr(st["python"]).encode()
                          + repr(st.get("numpy")).encode()).hexdigest()
saved = digest()
mgr = ckptfs.CheckpointManager(root)  # rank and world size from torch.distributed
result = mgr.save(7)
dist.barrier()
rng.seed_all(1)
ckptfs.CheckpointManager(root).restore_latest()
print(rank, mgr.rank, mgr.world_size, result.info is not None and result.info.step == 7,
      saved == digest(), flush=True)
dist.barrier()  # neither rank tears the group down while the other still uses it
dist.destroy_process_group()
"""


@pytest.mark.sharded
def test_distributed_gather_two_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two real processes in a gloo group: save is collective (each rank writes its own RNG
    state under its rank's key in one sharded checkpoint), every rank gets the committed info,
    and each rank gets its own state back on restore."""
    import subprocess
    import sys

    root = str(tmp_path / "run")
    init = f"file://{tmp_path}/pg-init"
    procs = [subprocess.Popen([sys.executable, "-c", _DIST_WORKER, str(r), "2", root, init],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    lines = sorted(o[0].strip() for o in outs)
    assert lines == ["0 0 2 True True", "1 1 2 True True"]
    store = ckptfs.open(root)
    assert store.info(7).manifest.format_version == 2  # the collective (sharded) format
    state = store.load(7)  # the full load holds every rank's entry, int rank keys included
    assert sorted(state["rng"]["ranks"]) == [0, 1] and state["rng"]["world_size"] == 2
    assert not torch.equal(state["rng"]["ranks"][0]["torch"], state["rng"]["ranks"][1]["torch"])


def test_async_manager_streams_through_its_staging_budget(tmp_path: pathlib.Path) -> None:
    """``CheckpointManager(async_save=True, staging_bytes=B)``: each save's snapshot takes at
    most ``B`` bytes of host memory (the model streams through it) and restores bit-exact;
    ``staging_bytes`` without ``async_save`` is refused."""
    budget = 256 << 10
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    mgr = ckptfs.CheckpointManager(str(tmp_path / "run"), async_save=True,
                                   staging_bytes=budget)
    mgr.save(1, model=model)
    mgr.wait()
    stats = mgr.store.async_stats
    assert stats.streamed == 1 and 0 < stats.staging_peak_bytes <= budget
    want = {k: v.clone() for k, v in model.state_dict().items()}
    other = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    assert ckptfs.CheckpointManager(str(tmp_path / "run")).restore_latest(model=other) == 2
    for k, v in other.state_dict().items():
        assert torch.equal(v, want[k]), k
    with pytest.raises(ValueError, match="async_save=True"):
        ckptfs.CheckpointManager(str(tmp_path / "run2"), staging_bytes=budget)
