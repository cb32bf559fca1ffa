"""Replicated tensors whose copies differ between ranks are refused, never stored as one rank's
copy or a row-wise mix of several (`ckptfs.protocol.replicas`): on 2 gloo ranks, through
``store.save`` (first save of a layout and a save whose plan the coordinator kept) and a plain
``dcp.save``; tensors named in ``divergent_keys`` are stored whole from the lowest rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks

import ckptfs
from ckptfs.errors import ReplicaMismatchError
from ckptfs.protocol.replicas import check_replicas, tensor_digest

BIG = (2 << 20) + 8  # float32 rows of one: 8 MiB + 32 B, split between the two holders


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except BaseException as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _state(rank: int, mesh: Any, hsdp: Any, *, differ: str | None) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    plain = torch.arange(6, dtype=torch.float32)
    big = torch.arange(BIG, dtype=torch.float32).reshape(-1, 4)
    rep = torch.ones(4, 2)
    if rank == 1 and differ == "plain":
        plain[3] += 1
    if rank == 1 and differ == "big":
        big[-1, -1] = -1.0  # in the piece the other holder writes
    local_rep = rep + 1 if rank == 1 and differ == "rep" else rep
    from torch.distributed.tensor import DTensor

    return {"w": distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]),
            "plain": plain, "big": big,
            # replicated over the whole mesh (HSDP's replica dimension): each rank its copy
            "rep": DTensor.from_local(local_rep, hsdp, [Replicate()], run_check=False),
            "trainer": {"step": 1, "lr": 0.1 * (rank + 1)}}  # values: the lowest rank's


def job_replicas(rank: int, world: int, url: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    store = ckptfs.open(url)
    out: dict[str, Any] = {}
    out["equal"] = _outcome(lambda: store.save(1, _state(rank, mesh, mesh, differ=None)))
    # The coordinator kept step 1's plan for this layout: the kept plan's path compares too.
    for what in ("plain", "big", "rep"):
        out[what] = _outcome(lambda w=what: store.save(2, _state(rank, mesh, mesh, differ=w)))
    out["steps"] = store.steps()
    # A first save of a new layout (another store: the plan is made anew) refuses as well.
    fresh = ckptfs.open(url + "-fresh")
    state = _state(rank, mesh, mesh, differ="plain")
    state["extra"] = torch.zeros(3)
    out["fresh"] = _outcome(lambda: fresh.save(1, state))
    out["fresh_steps"] = fresh.steps()
    # A plain dcp.save: refused by ckptfs's planner; the opt-out stores the lowest rank's copy.
    out["dcp"] = _outcome(lambda: dcp.save(
        _state(rank, mesh, mesh, differ="big"), storage_writer=ckptfs.dcp.Writer(url + "-dcp", 1),
        planner=ckptfs.dcp.SavePlanner()))
    dcp.save(_state(rank, mesh, mesh, differ="big"),
             storage_writer=ckptfs.dcp.Writer(url + "-dcp", 2),
             planner=ckptfs.dcp.SavePlanner(divergent_keys=["big"]))
    # The store's opt-out: divergent tensors stored whole from the lowest rank.
    div = ckptfs.open(url + "-div", divergent_keys=["big"])
    out["div"] = _outcome(lambda: div.save(1, _state(rank, mesh, mesh, differ="big")))
    return out


@pytest.mark.sharded
def test_replicas_that_differ_are_refused_on_two_ranks(tmp_path: Path) -> None:
    r0, r1 = run_ranks(job_replicas, 2, str(tmp_path / "run"), timeout=240)
    for r in (r0, r1):
        assert r["equal"] == ("ok", "")
        for what in ("plain", "big", "rep"):
            name, text = r[what]
            assert name == "ReplicaMismatchError", (what, name, text)
            assert f"'{what}' differs between ranks" in text and "ranks 0; ranks 1" in text
            assert "divergent_keys" in text
            assert "trainer" not in text  # values keep the lowest rank's copy
        assert r["steps"] == [1]  # nothing of the refused saves committed
        assert r["fresh"][0] == "ReplicaMismatchError" and r["fresh_steps"] == []
        assert r["dcp"][0] != "ok" and "'big' differs" in r["dcp"][1]
    want = torch.arange(BIG, dtype=torch.float32).reshape(-1, 4)
    for name, step in (("run-dcp", 2), ("run-div", 1)):  # one process: the stored copy
        assert torch.equal(ckptfs.open(str(tmp_path / name)).load(step)["big"], want)
    assert r0["div"] == r1["div"] == ("ok", "")


def test_divergent_keys_must_be_key_prefixes(tmp_path: Path) -> None:
    for bad in ("loss", [""], [3]):
        with pytest.raises(TypeError, match="divergent_keys"):
            ckptfs.open(str(tmp_path), divergent_keys=bad)


def test_check_replicas_names_keys_and_rank_ranges() -> None:
    check_replicas([("a", [0, 1, 2], [5, 5, 0])])  # 0: not hashed, not compared
    with pytest.raises(ReplicaMismatchError) as info:
        check_replicas([("a", [0, 1, 2, 3, 7], [5, 5, 5, 6, 6]), ("b", [0, 1], [1, 1])])
    text = str(info.value)
    assert "'a' differs between ranks (2 different copies: ranks 0-2; ranks 3, 7)" in text
    assert "'b'" not in text
    assert isinstance(info.value, ckptfs.errors.ShardedSaveError)


def test_tensor_digest_sees_values_dtype_and_shape() -> None:
    t = torch.arange(12, dtype=torch.float32)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(t) != tensor_digest(t.reshape(3, 4))
    assert tensor_digest(t) != tensor_digest(t.view(torch.int32))
    u = t.clone()
    u[11] = 0.5
    assert tensor_digest(t) != tensor_digest(u)
    assert tensor_digest(t[::2]) == tensor_digest(t[::2].contiguous())
    assert tensor_digest(t) != 0

