"""CheckpointManager on a two-tier store (docs/tiers.md): the restore resumes across
tiers through the store's one walk (local copy first, the remote one when the local is missing
or fails), bit for bit after the local disk is lost; per-tier retention (``keep_last`` locally,
``remote_retention`` remotely, in the background); the best pool survives a lost local disk."""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.cli.demo import ToyTask, train
from ckptfs.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ckptfs.lifecycle.retention import Best, RetentionPolicy
from ckptfs.lifecycle.rng import seed_all
from ckptfs.protocol.store import CheckpointStore
from ckptfs.protocol.tiers import TieredStore, tiered
from ckptfs.storage.base import Entry, StorageWrapper
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage
from ckptfs.testing.lifecycle import run_reference

FAST = {"retry_base_s": 0.01, "retry_max_s": 0.05}


def open_tiers(local: Backend, remote: Backend | CheckpointStore, **kw: Any) -> TieredStore:
    r = remote.open() if isinstance(remote, Backend) else remote
    return tiered(local.open(), r, **{**FAST, **kw})


def _corrupt(backend: Backend, store: CheckpointStore, step: int) -> None:
    info = store.info(step)
    entry = max(info.manifest.files, key=lambda e: e.size)
    rel = f"{info.path}/{entry.path}"
    data = bytearray(backend.raw_read(rel))
    data[-1] ^= 0xFF
    backend.raw_write(rel, bytes(data))


def test_resume_from_remote_after_local_disk_loss_is_bit_identical(
        local_backend: Backend, memory_backend: Backend,
        caplog: pytest.LogCaptureFixture) -> None:
    """Three saves on a tiered store, replicated; the node's disk is lost; a new manager
    restores the newest from the remote: model, optimizer, scheduler, sampler, RNG states,
    trainer counters, run seed, and the rest of the run equals an uninterrupted one."""
    total, every = 50, 10
    ref_losses, ref_params = run_reference(total)
    task = ToyTask()
    store = open_tiers(local_backend, memory_backend)
    mgr = ckptfs.CheckpointManager(store, save_every=every, run_seed=7, keep_last=2,
                                   best=Best("train/loss", keep=1))
    train(task, mgr, 0, 35, every, final_save=False)  # saves 10, 20, 30; killed after 34
    store.wait_replicated(timeout=60)
    best = mgr.best()
    assert best is not None
    store.close()
    assert store.tier_steps()["remote"] == [10, 20, 30]
    shutil.rmtree(local_backend.raw_root)  # the node was replaced: its disk is gone

    seed_all(987654)
    random.random()
    task2 = ToyTask(seed=4242)  # different init: everything must come from the checkpoint
    again = open_tiers(local_backend, memory_backend)
    mgr2 = ckptfs.CheckpointManager(again, save_every=every, run_seed=0, keep_last=2,
                                    best=Best("train/loss", keep=1))
    with caplog.at_level(logging.INFO, logger="ckptfs"):
        start = mgr2.restore_latest(model=task2.model, optimizer=task2.opt,
                                    scheduler=task2.sched, stateful={"sampler": task2.sampler})
    assert start == 31
    assert mgr2.resumed_from == 30 and mgr2.run_seed == 7  # the checkpoint's run seed
    assert mgr2.last_rng_outcome is not None and mgr2.last_rng_outcome.action == "restored"
    assert mgr2.trainer.step == 30 and mgr2.trainer.attempted_updates == 31
    assert mgr2.best() == best  # the best pool, rebuilt from the remote tier's metrics
    losses = train(task2, mgr2, start, total, every)
    assert [losses[s].hex() for s in range(31, total)] == \
        [ref_losses[s].hex() for s in range(31, total)]
    for k, v in ref_params.items():
        assert torch.equal(task2.params()[k], v), k
    again.wait_replicated(timeout=60)
    assert again.tier_steps() == {"local": [40, 49], "remote": [10, 20, 30, 40, 49]}
    again.close()


def test_restore_uses_remote_copy_when_local_fails(local_backend: Backend,
                                                   memory_backend: Backend,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    store = open_tiers(local_backend, memory_backend)
    mgr = ckptfs.CheckpointManager(store)
    saved = {}
    for s in (1, 2, 3):
        model = torch.nn.Linear(8, 4)
        saved[s] = model.state_dict()
        mgr.save(s, model=model)
    store.wait_replicated(timeout=60)
    _corrupt(local_backend, store.local, 3)
    model = torch.nn.Linear(8, 4)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        assert ckptfs.CheckpointManager(store).restore_latest(model=model) == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved[3].items())
    assert "the local copy of step 3" in caplog.text and "using the remote copy" in caplog.text
    # a step asked by number: the same rule
    model = torch.nn.Linear(8, 4)
    assert ckptfs.CheckpointManager(store).restore(3, model=model) == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved[3].items())
    # corrupt in both tiers: no silent rollback; allow_rollback takes step 2
    _corrupt(memory_backend, store.remote, 3)
    with pytest.raises(CorruptCheckpointError, match="step 3, fails in every tier"):
        ckptfs.CheckpointManager(store).restore_latest(model=torch.nn.Linear(8, 4))
    with pytest.raises(CorruptCheckpointError, match="fails in every tier"):
        ckptfs.CheckpointManager(store).restore(3, model=torch.nn.Linear(8, 4))
    model = torch.nn.Linear(8, 4)
    assert ckptfs.CheckpointManager(store).restore_latest(model=model,
                                                          allow_rollback=True) == 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved[2].items())
    store.close()


def test_restore_never_takes_another_runs_step_for_a_corrupt_local_copy(
        local_backend: Backend, memory_backend: Backend) -> None:
    """The remote holds another run's step 2; this run's step 2 is corrupt locally: the
    manager's restore (latest and by number) raises `TierMismatchError` naming both copies
    instead of restoring the other run's weights; allow_rollback restores step 1."""
    ckptfs.CheckpointManager(memory_backend.open()).save(2, model=torch.nn.Linear(8, 4))
    store = open_tiers(local_backend, memory_backend, max_attempts=1)
    mgr = ckptfs.CheckpointManager(store)
    saved = {}
    for s in (1, 2):
        model = torch.nn.Linear(8, 4)
        saved[s] = model.state_dict()
        mgr.save(s, model=model)
    with contextlib.suppress(ckptfs.ReplicationError):
        store.wait_replicated(timeout=60)
    assert store.replication().state(2) == "failed"
    _corrupt(local_backend, store.local, 2)
    with pytest.raises(ckptfs.TierMismatchError, match="not the same checkpoint"):
        ckptfs.CheckpointManager(store).restore_latest(model=torch.nn.Linear(8, 4))
    with pytest.raises(ckptfs.TierMismatchError, match="not the same checkpoint"):
        ckptfs.CheckpointManager(store).restore(2, model=torch.nn.Linear(8, 4))
    model = torch.nn.Linear(8, 4)
    assert ckptfs.CheckpointManager(store).restore_latest(model=model,
                                                          allow_rollback=True) == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved[1].items())
    store.close()


def test_restore_during_remote_outage_uses_local(local_backend: Backend,
                                                 memory_backend: Backend) -> None:
    faulty = FaultyStorage(memory_backend.open().storage)  # begin_outage(): every call fails
    remote = CheckpointStore(faulty)
    store = open_tiers(local_backend, remote)
    mgr = ckptfs.CheckpointManager(store)
    mgr.save(1, model=torch.nn.Linear(2, 2))
    store.wait_replicated(timeout=60)
    faulty.begin_outage()
    model = torch.nn.Linear(2, 2)
    assert ckptfs.CheckpointManager(store).restore_latest(model=model) == 2
    store.close()


def test_per_tier_retention(local_backend: Backend, memory_backend: Backend) -> None:
    """keep_last=2 locally; remotely the last 3, every 4th, the best pool (kept in both
    tiers) and whatever the local tier holds."""
    store = open_tiers(local_backend, memory_backend)
    mgr = ckptfs.CheckpointManager(store, keep_last=2, best=Best("loss", keep=1),
                                   remote_retention=RetentionPolicy(keep_last=3, keep_every=4))
    assert "remote_retention=" in repr(mgr)
    model = torch.nn.Linear(2, 2)
    for s in range(1, 11):
        result = mgr.save(s, model=model, metrics={"loss": 0.1 if s == 2 else 1.0 + s})
        assert not result.errors, result.errors
    store.wait_replicated(timeout=60)
    # A save's local prune keeps a step that was not replicated yet (held): once every step is
    # at the remote, the local prune deletes what the policy does not keep.
    mgr.prune()
    mgr.wait_remote_prune(timeout=60)
    report = mgr.prune_remote()  # the background runs raced replication: settle it now
    assert report.refused is None and not report.errors
    assert store.tier_steps() == {"local": [2, 9, 10], "remote": [2, 4, 8, 9, 10]}
    assert "best" in report.plan.keep[2] and "every-4" in report.plan.keep[4]
    assert mgr.prune_remote(dry_run=True).plan.delete == []
    for s in (2, 4, 8, 9, 10):
        assert store.remote.verify(s).ok
    store.close()


def test_remote_retention_keeps_local_steps_and_newest(local_backend: Backend,
                                                       memory_backend: Backend) -> None:
    """The remote keeps every step the local tier holds (a pruned remote copy would be
    replicated again at the next open) and its own newest, whatever keep_last says."""
    store = open_tiers(local_backend, memory_backend)
    mgr = ckptfs.CheckpointManager(store, keep_last=3,
                                   remote_retention=RetentionPolicy(keep_last=1))
    model = torch.nn.Linear(2, 2)
    for s in range(1, 6):
        mgr.save(s, model=model)
    store.wait_replicated(timeout=60)
    mgr.prune()  # what a save's prune held while it was not replicated yet
    mgr.prune_remote()
    assert store.tier_steps() == {"local": [3, 4, 5], "remote": [3, 4, 5]}
    store.close()
    again = open_tiers(local_backend, memory_backend)
    assert again.replication().lag_steps == 0  # nothing to replicate again
    again.close()


def test_remote_prune_during_outage_and_damaged_newest(local_backend: Backend,
                                                       memory_backend: Backend) -> None:
    """During a remote outage saves go on locally with no bookkeeping error (the remote
    prune is skipped, or fails in the background, logged); once the remote is back a remote
    newest that fails a quick verify refuses the remote prune: nothing deleted."""
    faulty = FaultyStorage(memory_backend.open().storage)  # begin_outage(): every call fails
    remote = CheckpointStore(faulty)
    store = open_tiers(local_backend, remote)
    mgr = ckptfs.CheckpointManager(store, keep_last=1,
                                   remote_retention=RetentionPolicy(keep_last=1))
    model = torch.nn.Linear(2, 2)
    for s in (1, 2):
        mgr.save(s, model=model)
    store.wait_replicated(timeout=60)
    mgr.prune()  # step 1 may have been held by save 2's prune (not replicated yet)
    mgr.prune_remote()
    assert memory_backend.open().steps() == [2]
    faulty.begin_outage()
    for s in (3, 4):
        result = mgr.save(s, model=model)
        assert not result.errors, result.errors
    with contextlib.suppress(StorageError):  # a run begun before the outage was noticed
        mgr.wait_remote_prune(timeout=60)
    assert store.local.steps() == [3, 4]  # held locally: not replicated
    faulty.end_outage()
    store.wait_replicated(timeout=60)
    assert memory_backend.open().steps() == [2, 3, 4]
    info = store.remote.info(4)
    memory_backend.raw_delete(f"{info.path}/{info.manifest.files[0].path}")
    report = mgr.prune_remote()
    assert report.refused is not None and "step 4" in report.refused and not report.deleted
    assert memory_backend.open().steps() == [2, 3, 4]
    store.close()


def test_remote_retention_needs_two_tiers(local_backend: Backend) -> None:
    with pytest.raises(ValueError, match="two-tier"):
        ckptfs.CheckpointManager(local_backend.open(),
                                 remote_retention=RetentionPolicy(keep_last=2))
    mgr = ckptfs.CheckpointManager(local_backend.open())
    with pytest.raises(ValueError, match="no remote_retention"):
        mgr.prune_remote()


def test_empty_tiers_start_from_zero(local_backend: Backend, memory_backend: Backend) -> None:
    store = open_tiers(local_backend, memory_backend)
    assert ckptfs.CheckpointManager(store).restore_latest(model=torch.nn.Linear(2, 2)) == 0
    with pytest.raises(CheckpointNotFoundError):
        ckptfs.CheckpointManager(store).restore(5, model=torch.nn.Linear(2, 2))
    store.close()


def test_remote_prune_reads_the_local_steps_after_listing_the_remote(
        local_backend: Backend, memory_backend: Backend) -> None:
    """What the local tier holds is read by the remote prune right after it lists the remote,
    not when a save asked for the prune: a request answered late (after more steps reached the
    remote) used to delete, remotely, a step the local tier still held."""
    from ckptfs.lifecycle.retention import prune

    remote = memory_backend.open()
    model = torch.nn.Linear(2, 2)
    for s in range(1, 6):
        remote.save(s, {"w": model.weight})
    order: list[str] = []

    class Listed(StorageWrapper):  # the prune's listing of the remote's committed steps
        def list_tree(self, path: str) -> list[Entry]:
            order.append("list")
            return super().list_tree(path)

    def local_steps() -> list[int]:
        order.append("hold")
        return [3]

    report = prune(CheckpointStore(Listed(remote.storage)), RetentionPolicy(keep_last=1),
                   hold=local_steps)
    assert order[:2] == ["list", "hold"]
    assert sorted(report.deleted) == [1, 2, 4] and remote.steps() == [3, 5]
