"""The one CheckpointManager body under a process group: each defect found
in the distributed manager, on 2 gloo ranks with an FSDP2 MLP (uneven Shard(0): 7 and 3 rows).

* metrics given on one rank only are recorded and tracked (they were dropped: the best pool
  stayed empty and ``keep_last=1`` deleted the best step); differing values are refused;
* ``restore_latest(map_location=...)`` takes every form ``torch.load`` takes, as one process
  does (one implementation: ``ckptfs.protocol.load_options.tensor_map``);
* a one-process (format v1) checkpoint restores into 2 FSDP2 ranks, bit-exact (it raised a
  raw ``RuntimeError``: mixed Tensor and DTensor);
* ``CheckpointManager(async_save=True)`` works under a process group (it was refused):
  bookkeeping after the commit, the same outcome on every rank, failures agreed;
* the distributed restore walks like the store (``walk_latest``): a corrupt newest checkpoint
  raises on every rank, ``allow_rollback`` moves every rank to the same older one.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch
from dist_util import run_ranks
from test_manager_sharded import build, local, outcome
from test_sharded import to_plain

import ckptfs
from ckptfs.errors import StorageError
from ckptfs.format.layout import StepPaths
from ckptfs.storage.base import StorageWrapper
from ckptfs.testing.conformance import assert_state_equal


class FailingWrites(StorageWrapper):
    """This rank's storage: data-file writes fail (a storage error in the middle of a save)."""

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        if "/rank-" in path:
            raise StorageError(f"write {path}: injected failure on this rank")
        return super().open_write(path)


class Buffer:
    """A stateful object holding a tensor (to see ``map_location`` applied to it)."""

    def __init__(self) -> None:
        self.t = torch.arange(6, dtype=torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = state["t"]


def summary(result: Any) -> tuple[Any, ...]:
    return (result.info.step if result.info else None, result.best_improved,
            result.evicted_from_best, result.prune.deleted if result.prune else None,
            result.errors)


def train_step(model: Any, opt: Any) -> None:
    torch.manual_seed(0)  # the same data on every rank (FSDP: one model)
    model(torch.randn(4, 5)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def full_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    # collective (every rank); cloned: a 0-dim "step" tensor is the optimizer's own object
    return local(to_plain({"model": msd, "optimizer": osd}))  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------------------------
# Metrics given on one rank


def job_metrics(rank: int, world: int, url: str) -> dict[str, Any]:
    model, opt, _ = build(world, 0)
    mgr = ckptfs.CheckpointManager(url, keep_last=1,
                                   best=ckptfs.Best(metric="loss", mode="min", keep=1))
    out: dict[str, Any] = {}
    # The loss is known on the last rank only (a pipeline's last stage); accuracy on rank 0.
    out["s1"] = summary(mgr.save(1, model=model, optimizer=opt,
                                 metrics={"loss": 0.1} if rank == 1 else {"acc": 0.9}))
    out["s2"] = summary(mgr.save(2, model=model, optimizer=opt,
                                 metrics={"loss": 0.5} if rank == 1 else None))
    # Given on both ranks with different values: refused on both, before anything is written.
    out["differ"] = outcome(lambda: mgr.save(3, model=model, optimizer=opt,
                                             metrics={"loss": 0.2 + rank}))
    out["steps_after_differ"] = mgr.store.steps()
    out["s3"] = summary(mgr.save(3, model=model, optimizer=opt, metrics={"loss": 0.05}))
    out["best"] = mgr.best()
    return out


def test_metrics_on_one_rank_are_recorded_and_keep_the_best(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    got = run_ranks(job_metrics, 2, url, timeout=200)
    assert {k: v for k, v in got[0].items() if k != "differ"} == {
        k: v for k, v in got[1].items() if k != "differ"}
    for rank in (0, 1):
        g = got[rank]
        assert g["s1"] == (1, True, [], [], [])  # tracked although rank 0 gave no loss
        assert g["s2"] == (2, False, [], [], [])  # keep_last=1 keeps the best step 1
        name, typed, text = g["differ"]
        assert (name, typed) == ("ValueError", False), g["differ"]
        assert "'loss': rank 0: 0.2, rank 1: 1.2" in text, text
        assert g["steps_after_differ"] == [1, 2]
        assert g["s3"] == (3, True, [1], [1, 2], [])
        assert g["best"] == {"step": 3, "value": 0.05}
    store = ckptfs.open(url)
    assert store.steps() == [3]
    assert store.info(3).metadata["metrics"] == {"loss": 0.05}


def test_metrics_of_every_rank_merge_the_same_everywhere() -> None:
    from ckptfs.lifecycle.schema import merge_rank_metrics

    assert merge_rank_metrics([(0, {"acc": 0.9}), (1, {"loss": 0.1})]) == {"acc": 0.9,
                                                                             "loss": 0.1}
    assert merge_rank_metrics([(0, {"loss": None}), (1, {"loss": None})]) == {"loss": None}
    assert merge_rank_metrics([(0, {"ok": True}), (1, {"ok": True})]) == {"ok": True}
    with pytest.raises(ValueError, match=r"'ok': rank 0: True, rank 1: 1\.0"):
        merge_rank_metrics([(0, {"ok": True}), (1, {"ok": 1.0})])


# ----------------------------------------------------------------------------------------------
# map_location, every form


def job_map_location(rank: int, world: int, url: str) -> dict[str, Any]:
    model, opt, sched = build(world, 0)
    buf = Buffer()
    mgr = ckptfs.CheckpointManager(url)
    mgr.save(1, model=model, optimizer=opt, scheduler=sched, stateful={"buf": buf})
    before = local(model.state_dict())
    calls: list[str] = []

    def mapper(storage: Any, location: str) -> Any:
        calls.append(location)
        return storage

    def bad_mapper(storage: Any, location: str) -> Any:
        return "not a storage"

    out: dict[str, Any] = {}
    forms: dict[str, Any] = {"str": "cpu", "device": torch.device("cpu"),
                             "dict": {"cpu": "cpu"}, "dict-other": {"cuda:0": "cpu"},
                             "callable": mapper, "none": None}
    for name, form in forms.items():
        buf.t = torch.zeros(1)
        out[name] = outcome(lambda form=form: mgr.restore_latest(  # type: ignore[misc]
            model=model, optimizer=opt, scheduler=sched, stateful={"buf": buf},
            map_location=form))
        out[name + "-buf"] = buf.t.clone()
    out["calls"] = sorted(set(calls))
    for name, form in (("dtype", torch.float16), ("bad-callable", bad_mapper),
                       ("bad-type", 3)):
        out[name] = outcome(lambda form=form: mgr.restore_latest(  # type: ignore[misc]
            model=model, optimizer=opt, stateful={"buf": buf}, map_location=form))
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(
        before.values(), local(model.state_dict()).values(), strict=True))
    return out


def test_distributed_restore_takes_every_map_location_form(tmp_path: Path) -> None:
    got = run_ranks(job_map_location, 2, str(tmp_path / "run"), timeout=200)
    for rank in (0, 1):
        g = got[rank]
        for name in ("str", "device", "dict", "dict-other", "callable", "none"):
            assert g[name] == ("no error", False, ""), (rank, name, g[name])
            assert torch.equal(g[name + "-buf"], torch.arange(6, dtype=torch.float32))
        assert g["calls"] == ["cpu"]  # torch.load's protocol: (storage, "cpu")
        for name in ("dtype", "bad-callable", "bad-type"):
            cls, typed, text = g[name]
            assert (cls, typed) == ("LoadOptionError", True), (rank, name, g[name])
            assert "map_location" in text
        assert g["untouched"]


# ----------------------------------------------------------------------------------------------
# A one-process (v1) checkpoint into 2 FSDP2 ranks


def one_process_run(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run saved by one process (format v1), and its state as DCP names it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(2):
        train_step(model, opt)
        sched.step()
    mgr = ckptfs.CheckpointManager(url, run_seed=3)
    mgr.trainer.record_update()
    mgr.save(2, model=model, optimizer=opt, scheduler=sched)
    assert ckptfs.open(url).info(2).manifest.format_version == 1
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}, sched.state_dict()


def tuples_as_lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: tuples_as_lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return [tuples_as_lists(v) for v in value]
    return value


def job_v1_into_fsdp2(rank: int, world: int, url: str) -> dict[str, Any]:
    model, opt, sched = build(world, 123)  # another init: the restore must overwrite it
    mgr = ckptfs.CheckpointManager(url)
    calls: list[int] = []
    start = mgr.restore_latest(model=model, optimizer=opt, scheduler=sched,
                               map_location=lambda s, loc: calls.append(1) or s)
    out: dict[str, Any] = {"start": start, "full": full_state(model, opt),
                           "sched": sched.state_dict(), "trainer": mgr.trainer.to_state(),
                           "mapped": len(calls) > 0,
                           "rng": mgr.last_rng_outcome.action}  # type: ignore[union-attr]
    # It trains on, and its next save is a sharded one that restores as well.
    train_step(model, opt)
    mgr.save(3, model=model, optimizer=opt, scheduler=sched)
    out["after_step"] = full_state(model, opt)
    again, opt2, sched2 = build(world, 7)
    out["start3"] = ckptfs.CheckpointManager(url).restore_latest(model=again, optimizer=opt2,
                                                                 scheduler=sched2)
    out["full3"] = full_state(again, opt2)
    # An optimizer over other parameter groups: a clear error on both ranks, nothing touched.
    other, _, _ = build(world, 9)
    before = local(other.state_dict())
    params = list(other.parameters())
    wrong = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=0.1)
    out["mismatch"] = outcome(lambda: ckptfs.CheckpointManager(url).restore(
        2, model=other, optimizer=wrong))
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(
        before.values(), local(other.state_dict()).values(), strict=True))
    return out


def test_one_process_checkpoint_restores_into_two_fsdp2_ranks(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    expected, sched = one_process_run(url)
    got = run_ranks(job_v1_into_fsdp2, 2, url, timeout=240)
    for rank in (0, 1):
        g = got[rank]
        assert g["start"] == 3 and g["mapped"]
        # parameters and AdamW state, bit-exact (DCP's set_state_dict gives the param groups'
        # tuples, e.g. betas, back as lists: as after any restore through DCP)
        assert_state_equal(tuples_as_lists(g["full"]), tuples_as_lists(expected))
        assert g["sched"] == sched
        assert g["trainer"]["step"] == 2 and g["trainer"]["attempted_updates"] == 1
        assert g["rng"] == ("restored" if rank == 0 else "reseeded-new-rank")
        assert g["start3"] == 4
        assert_state_equal(g["full3"], g["after_step"])
        cls, _, text = g["mismatch"]
        assert cls == "ValueError" and "param groups of [4] parameters" in text, g["mismatch"]
        assert g["untouched"]
    assert_state_equal(got[0]["after_step"], got[1]["after_step"])
    assert ckptfs.open(url).info(3).manifest.format_version == 2


# ----------------------------------------------------------------------------------------------
# async_save=True under a process group


def job_async(rank: int, world: int, url: str) -> dict[str, Any]:
    model, opt, sched = build(world, 0)
    mgr = ckptfs.CheckpointManager(url, async_save=True, keep_last=1,
                                   best=ckptfs.Best(metric="loss", mode="min", keep=1))
    out: dict[str, Any] = {"pending": []}
    for step, loss in ((1, 0.5), (2, 0.9), (3, 0.1)):
        train_step(model, opt)
        out[f"state{step}"] = full_state(model, opt)
        res = mgr.save(step, model=model, optimizer=opt, scheduler=sched,
                       metrics={"loss": loss} if rank == 1 else None)
        out["pending"].append((res.info, res.future is not None))
        with torch.no_grad():  # after the snapshot: never in the checkpoint
            for p in model.parameters():
                p.fill_(7.0)
    out["done3"] = [summary(r) for r in mgr.wait()]
    loaded = ckptfs.open(url).load(3)  # in this process, whole
    out["loaded3"] = {"model": loaded["model"], "optimizer": loaded["optimizer"]}
    out["steps"] = mgr.store.steps()
    out["best"] = mgr.best()
    # A storage failure on rank 1: every rank raises it from wait(); nothing is pruned.
    storage = mgr.store.storage
    if rank == 1:
        mgr.store.storage = FailingWrites(storage)
    res = mgr.save(4, model=model, optimizer=opt)
    out["failed_future"] = res.future is not None
    out["failure"] = outcome(mgr.wait)
    mgr.store.storage = storage
    out["steps_after_failure"] = mgr.store.steps()
    # restore_latest waits for a pending save of this manager (every rank).
    mgr.save(4, model=model, optimizer=opt, metrics={"loss": 0.01})
    again, opt2, _ = build(world, 5)
    out["restored"] = mgr.restore_latest(model=again, optimizer=opt2)
    out["steps_end"] = mgr.store.steps()
    return out


def test_async_save_under_a_process_group(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    got = run_ranks(job_async, 2, url, timeout=300)
    for rank in (0, 1):
        g = got[rank]
        assert g["pending"] == [(None, True)] * 3  # save returned before the commit
        # bookkeeping of 3 after its commit: best 3 (given on rank 1 only), 1 and 2 pruned
        assert g["done3"] == [(3, True, [1], [1, 2], [])]
        assert g["steps"] == [3] and g["best"] == {"step": 3, "value": 0.1}
        name, typed, text = g["failure"]
        assert (name, typed) == ("ShardedSaveError", True), g["failure"]
        assert "rank 1" in text or "rank(s) [1]" in text, text
        assert g["steps_after_failure"] == [3]
        assert g["restored"] == 5 and g["steps_end"] == [4]
        # The values at the call, though the parameters were overwritten right after it.
        assert_state_equal(g["loaded3"], got[0]["state3"])


# ----------------------------------------------------------------------------------------------
# The restore walk: corrupt newest, rollback, every one corrupt


def corrupt(root: Path, step: int) -> None:
    """Flip the last byte of every tensor data file of ``step`` (a hash mismatch on load)."""
    for f in (root / StepPaths(step).dir).rglob("*.safetensors"):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))


def job_rollback(rank: int, world: int, url: str) -> dict[str, Any]:
    import torch.distributed as dist

    model, opt, _ = build(world, 0)
    mgr = ckptfs.CheckpointManager(url)
    random.seed(rank)
    mgr.save(1, model=model, optimizer=opt)
    train_step(model, opt)
    state2 = full_state(model, opt)
    mgr.save(2, model=model, optimizer=opt)
    train_step(model, opt)
    mgr.save(3, model=model, optimizer=opt)
    dist.barrier()
    if rank == 0:
        corrupt(Path(url), 3)
    dist.barrier()
    out: dict[str, Any] = {}
    fresh, fopt, _ = build(world, 9)
    out["refused"] = outcome(lambda: mgr.restore_latest(model=fresh, optimizer=fopt))
    out["rolled"] = mgr.restore_latest(model=fresh, optimizer=fopt, allow_rollback=True)
    out["state"] = full_state(fresh, fopt)
    out["state2"] = state2
    dist.barrier()
    if rank == 0:
        corrupt(Path(url), 2)
        corrupt(Path(url), 1)
    dist.barrier()
    out["none"] = outcome(lambda: mgr.restore_latest(model=fresh, optimizer=fopt,
                                                     allow_rollback=True))
    out["explicit"] = outcome(lambda: mgr.restore(2, model=fresh, optimizer=fopt))
    return out


def test_distributed_restore_walks_like_the_store(tmp_path: Path) -> None:
    got = run_ranks(job_rollback, 2, str(tmp_path / "run"), timeout=240)
    for rank in (0, 1):
        g = got[rank]
        name, typed, text = g["refused"]
        assert (name, typed) == ("CorruptCheckpointError", True), g["refused"]
        assert "step 3" in text and "allow_rollback=True" in text, text
        assert g["rolled"] == 3  # every rank on step 2
        assert_state_equal(g["state"], g["state2"])
        name, typed, text = g["none"]
        assert (name, typed) == ("CheckpointNotFoundError", True), g["none"]
        assert "every one is corrupt" in text and "step 1" in text, text
        assert g["explicit"][:2] == ("CorruptCheckpointError", True), g["explicit"]


def test_a_message_that_cannot_cross_during_the_led_walk_is_the_restore_s_error() -> None:
    """A peer dead or hung while the writer leads the restore walk: the broken collective is
    raised as the coordinated step's error class, naming the restore, as every other message
    of the distributed coordinator (not the process group's own RuntimeError)."""
    from ckptfs.errors import ShardedLoadError
    from ckptfs.lifecycle.coordinator import ProcessGroup
    from ckptfs.protocol.group import Group

    class Broken(Group):
        rank, world_size, ranks = 0, 2, [0, 1]

        def broadcast(self, doc: Any, src: int = 0, *, default: Any = None) -> Any:
            raise RuntimeError("[gloo] Connection closed by peer")

        def all_gather(self, doc: Any, *, default: Any = None) -> list[Any]:
            raise RuntimeError("[gloo] Connection closed by peer")

    coord = object.__new__(ProcessGroup)
    coord._messages = Broken()  # type: ignore[assignment]
    coord._rank, coord._world_size, coord.ranks = 0, 2, [0, 1]
    used: list[int] = []

    def walk(run: Any) -> Any:
        return None  # no checkpoint: the walk's end is still told to every rank

    with pytest.raises(ShardedLoadError, match="restore at x: a checkpoint collective failed"):
        coord.walk([("", None)], walk, lambda info: used.append(1), "restore at x",  # type: ignore[list-item]
                   ShardedLoadError)
    assert used == []
