"""CheckpointManager on every rank of a distributed job.

One W=2 gloo job trains an FSDP2 MLP (uneven Shard(0): 7 and 3 rows) with AdamW and a
scheduler, and saves through ``CheckpointManager`` on every rank (collective, sharded; each
rank's RNG state under its own key), with retention and a best pool (the same SaveResult on
every rank), then meets two failures on rank 1 only (a bad metric, a storage error): every rank
raises a typed error and no marker is written.  The last checkpoint is then restored in a new
W=2 job, in a W=1 FSDP2 job and in this process without torch.distributed (a plain module):
parameters and optimizer state bit-exact, each rank's RNG state, the trainer counters.
A DDP-style plain module (replicated on every rank) saves through the same collective path."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks
from test_sharded import FailingWrites, to_plain

import ckptfs
from ckptfs.format.layout import StepPaths
from ckptfs.lifecycle import rng
from ckptfs.testing.conformance import assert_state_equal


def rng_digest() -> str:
    st = rng.capture()
    return hashlib.sha256(st["torch"].numpy().tobytes() + repr(st["python"]).encode()
                          + repr(st.get("numpy")).encode()).hexdigest()


def build(world: int, seed: int) -> tuple[Any, Any, Any]:
    """(FSDP2 model, AdamW, StepLR) on this rank; the init depends on ``seed``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def local(value: Any) -> Any:
    """This rank's shards, as plain tensors (picklable)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().clone()
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [local(v) for v in value]
    return value


def summary(result: Any) -> tuple[Any, ...]:
    return (result.info.step, result.info.attempt, result.best_improved,
            result.evicted_from_best, result.prune.deleted if result.prune else None,
            result.errors)


def outcome(fn: Any) -> tuple[str, bool, str]:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, isinstance(exc, ckptfs.CkptfsError), str(exc)
    return "no error", False, ""


def per_rank_from(threshold: int | None) -> None:
    """The world size from which a store writes per-rank metadata by default (None: ckptfs's,
    64): lowered, this job's saves take the path a job of that many ranks takes."""
    if threshold is not None:
        import ckptfs.format.features as features

        features.PER_RANK_MIN_WORLD = threshold


def job_save(rank: int, world: int, url: str, plain_url: str, threshold: int | None
             ) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    per_rank_from(threshold)
    model, opt, sched = build(world, 0)
    mgr = ckptfs.CheckpointManager(url, keep_last=2, run_seed=7,
                                   best=ckptfs.Best(metric="loss", mode="min", keep=1))
    rng.seed_all(100 + rank)
    random.random()
    torch.manual_seed(0)  # the same data on every rank (FSDP: one model)
    results = []
    for step in (1, 2, 3):
        loss = model(torch.randn(4, 5)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        mgr.trainer.record_update()
        rng.seed_all(1000 * step + rank)  # each rank's RNG differs, and differs per step
        digest = rng_digest()
        results.append(summary(mgr.save(step, model=model, optimizer=opt, scheduler=sched,
                                        metrics={"loss": 1.0 / step}, epoch=1)))
    msd, osd = get_state_dict(model, opt)
    out = {"results": results, "rng": digest, "local": local({"model": msd, "optimizer": osd}),
           "full": to_plain({"model": msd, "optimizer": osd}), "sched": sched.state_dict()}
    # Rank 1 alone fails: a bad metric (before anything is written), then a storage error.
    out["bad_metric"] = outcome(lambda: mgr.save(
        4, model=model, optimizer=opt, metrics={"loss": "oops" if rank == 1 else 0.1}))
    if rank == 1:
        mgr.store.storage = FailingWrites(mgr.store.storage)  # type: ignore[assignment]
    out["bad_storage"] = outcome(lambda: mgr.save(5, model=model, optimizer=opt))
    # A plain module replicated on every rank (DDP-style): the same collective path.
    torch.manual_seed(5)
    lin = torch.nn.Linear(3, 2)
    lin_opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.randn(2, 3)).sum().backward()
    lin_opt.step()
    plain = ckptfs.CheckpointManager(plain_url).save(1, model=lin, optimizer=lin_opt)
    out["plain"] = (plain.info.step if plain.info else None, local(lin.state_dict()))
    return out


def job_restore(rank: int, world: int, url: str, threshold: int | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    per_rank_from(threshold)
    model, opt, sched = build(world, 123)  # another init: the restore must overwrite it
    mgr = ckptfs.CheckpointManager(url, keep_last=2, run_seed=7)
    rng.seed_all(5)
    start = mgr.restore_latest(model=model, optimizer=opt, scheduler=sched)
    digest = rng_digest()
    msd, osd = get_state_dict(model, opt)
    # Step 1 was pruned: the writer rank finds that out, and every rank raises it.
    missing = outcome(lambda: mgr.restore(1, model=model, optimizer=opt))
    action = mgr.last_rng_outcome.action  # type: ignore[union-attr]
    return {"start": start, "rng": digest, "missing": missing, "action": action,
            "trainer": mgr.trainer.to_state(), "local": local({"model": msd, "optimizer": osd}),
            "full": to_plain({"model": msd, "optimizer": osd}), "sched": sched.state_dict()}


@pytest.mark.parametrize("threshold, version", [(None, 2), (2, 5)])
def test_manager_sharded_save_restore_any_world_size(tmp_path: Path, threshold: int | None,
                                                     version: int) -> None:
    """The default store (``metadata_layout="auto"``) at 2 ranks (format v2) and as at 64 ranks
    or more (the threshold lowered: format v5, per-rank metadata): the same behaviour."""
    url, plain_url = str(tmp_path / "run"), str(tmp_path / "plain")
    saved = run_ranks(job_save, 2, url, plain_url, threshold, timeout=150, pg_timeout=60)

    # Every rank returned the same SaveResult: committed info, best pool, prune (keep_last=2).
    for step_results in zip(*(s["results"] for s in saved), strict=True):
        assert step_results[0] == step_results[1], step_results
    (s1, _, b1, _, _, _), (s2, _, b2, _, _, _), (s3, _, b3, ev3, del3, err3) = saved[0]["results"]
    assert (s1, s2, s3) == (1, 2, 3) and b1 and b2 and b3
    assert ev3 == [2] and del3 == [1] and err3 == []
    # A failure on rank 1 only is a typed error on both ranks, and nothing was committed.
    for key, cls in (("bad_metric", "UnsupportedValueError"), ("bad_storage", "ShardedSaveError")):
        for rank in (0, 1):
            name, typed, text = saved[rank][key]
            assert typed and name == cls, (key, rank, saved[rank][key])
            assert "rank(s) [1]" in text, text
    store = ckptfs.open(url)
    assert store.steps() == [2, 3]
    assert not (tmp_path / "run" / StepPaths(4).marker).exists()
    assert not (tmp_path / "run" / StepPaths(5).marker).exists()
    info = store.info(3)
    assert info.manifest.format_version == version and info.metadata["rng_ranks"] == [0, 1]
    full = store.load(3)
    assert sorted(full["rng"]["ranks"]) == [0, 1]  # each rank's own state, written by it
    assert not torch.equal(full["rng"]["ranks"][0]["torch"], full["rng"]["ranks"][1]["torch"])

    # A new W=2 job: each rank gets its own shards and RNG state back, bit for bit.
    again = run_ranks(job_restore, 2, url, threshold, timeout=150, pg_timeout=60)
    for rank in (0, 1):
        got = again[rank]
        assert got["start"] == 4 and got["action"] == "restored"
        assert got["missing"][:2] == ("CheckpointNotFoundError", True), got["missing"]
        assert got["rng"] == saved[rank]["rng"], rank
        assert_state_equal(got["local"], saved[rank]["local"])
        assert got["sched"] == saved[rank]["sched"]
        assert got["trainer"] == {"step": 3, "attempted_updates": 3, "successful_updates": 3,
                                  "epoch": 1, "extra": {}}
    assert_state_equal(again[0]["full"], saved[0]["full"])

    # W'=1 (FSDP2 on one rank): the whole model in one rank; rank 0's RNG state.
    (one,) = run_ranks(job_restore, 1, url, threshold, timeout=150, pg_timeout=60)
    assert one["start"] == 4 and one["action"] == "restored" and one["rng"] == saved[0]["rng"]
    assert_state_equal(one["full"], saved[0]["full"])
    assert_state_equal(one["local"], saved[0]["full"])  # one rank holds every row

    # No process group at all: a plain module and optimizer (full load, set_state_dict).
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    mgr = ckptfs.CheckpointManager(url)
    assert mgr.restore_latest(model=model, optimizer=opt) == 4
    assert mgr.last_rng_outcome.action == "restored"  # type: ignore[union-attr]
    assert rng_digest() == saved[0]["rng"]
    msd, osd = get_state_dict(model, opt)
    assert_state_equal({"model": msd, "optimizer": osd}, saved[0]["full"])

    # The replicated plain module: committed once, loads in one process.
    for rank in (0, 1):
        assert saved[rank]["plain"][0] == 1
    lin = torch.nn.Linear(3, 2)
    lin_opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    assert ckptfs.CheckpointManager(plain_url).restore_latest(model=lin, optimizer=lin_opt) == 2
    assert_state_equal(local(lin.state_dict()), saved[0]["plain"][1])
    assert lin_opt.state_dict()["state"][0]["momentum_buffer"].shape == (2, 3)


def test_rank_trees_merge_and_conflicts_are_refused() -> None:
    """The stored tree is the union of the ranks' trees (rank-keyed values keep their int keys
    in a full load); a path that is a dict on one rank and a value on another is refused."""
    import pytest

    from ckptfs.errors import UnsupportedValueError
    from ckptfs.format.sharded_tree import dcp_view, restore
    from ckptfs.protocol.sharded import _select, merge_trees

    _, tree0 = dcp_view({"rng": {"world_size": 2, "ranks": {0: {"s": 1}}}, "t": [1, 2]})
    _, tree1 = dcp_view({"rng": {"world_size": 2, "ranks": {1: {"s": 2}}}, "t": [1, 2]})
    merged = merge_trees([tree0, tree1])
    loaded = {"rng": {"world_size": 2, "ranks": {"0": {"s": 1}, "1": {"s": 2}}}, "t": [1, 2]}
    assert restore(merged, loaded, where="x") == {
        "rng": {"world_size": 2, "ranks": {0: {"s": 1}, 1: {"s": 2}}}, "t": [1, 2]}
    assert restore(tree0, loaded, where="x")["rng"]["ranks"] == {0: {"s": 1}}  # one rank's
    part = _select(merged, {"rng.world_size", "rng.ranks.1"})
    assert restore(part, loaded, where="x") == {"rng": {"world_size": 2, "ranks": {1: {"s": 2}}}}
    _, bad = dcp_view({"rng": {"world_size": 2, "ranks": 5}, "t": [1, 2]})
    with pytest.raises(UnsupportedValueError, match="at rng/ranks: rank 1 holds a value"):
        merge_trees([tree0, bad])
