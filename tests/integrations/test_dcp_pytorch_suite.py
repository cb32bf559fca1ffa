"""PyTorch's own DCP tests that check a storage layer, run with ckptfs substituted.

Ported from pytorch/pytorch ``test/distributed/checkpoint/`` (BSD-3-Clause, Copyright (c)
Meta Platforms, Inc. and affiliates; the scenarios and their checks re-written here, each case
named after the test it ports): every ``FileSystemWriter``/``FileSystemReader``/
``FsspecWriter``/``FsspecReader`` is a ``ckptfs.dcp.Writer``/``Reader`` (one committed step per
save: ckptfs never writes over a committed step), and DCP's planners are ckptfs's
(``ckptfs.dcp.SavePlanner``/``LoadPlanner``: DCP's pickle non-tensor values, which the Writer
refuses).  Where ckptfs deliberately differs from DCP the case says so and checks ckptfs's
behaviour (a dtype is never converted on load; a committed step is never overwritten).
Changes forced by the machine: CUDA becomes CPU (FSDP1 with ``device_id=cpu``), NCCL gloo, the
4-rank 2-D meshes of ``test_dtensor_resharding`` a (2, 1) mesh of 2 ranks; every comparison
is bit for bit (``torch.equal``) where PyTorch's uses ``allclose``.

Every distributed case runs in one job of 2 gloo ranks (spawning ranks is the expensive part),
case after case, each rank reporting each case's outcome; the tests below read them.  The
cases that test DCP's own file format (``.distcp``/``.metadata``, its stream extensions, its
``FileSystem`` class, DCP's planning functions) are listed in `NOT_PORTED` with the reason and
skipped.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_util import run_ranks

import ckptfs
import ckptfs.dcp
from ckptfs.errors import CheckpointExistsError, LoadOptionError

THREADS = (1, 2)  # PyTorch's _THREAD_COUNTS: the writer's threads


class Steps:
    """Each save of a case commits its own step (``Writer(url, step)``)."""

    def __init__(self, url: str) -> None:
        self.url, self.step = url, 0

    def writer(self, threads: int = 1) -> ckptfs.dcp.Writer:
        self.step += 1
        return ckptfs.dcp.Writer(self.url, self.step, threads=threads)

    def reader(self) -> ckptfs.dcp.Reader:
        return ckptfs.dcp.Reader(self.url, self.step)


def save(state: dict[str, Any], steps: Steps, threads: int = 1) -> Any:
    return dcp.save(state, storage_writer=steps.writer(threads),
                    planner=ckptfs.dcp.SavePlanner())


def load(state: dict[str, Any], steps: Steps) -> None:
    dcp.load(state, storage_reader=steps.reader(), planner=ckptfs.dcp.LoadPlanner())


# ----------------------------------------------------------------------------------------------
# ShardedTensor helpers (FSDP1's tensors)


def chunk_spec(dim: int, ranks: list[int]) -> Any:
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


def enum_spec(shards: list[tuple[list[int], list[int], int]]) -> Any:
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

    return EnumerableShardingSpec([ShardMetadata(shard_offsets=o, shard_sizes=s,
                                                 placement=f"rank:{r}/cpu")
                                   for o, s, r in shards])


def st_rand(spec: Any, *size: int) -> Any:
    from torch.distributed._shard import sharded_tensor

    return sharded_tensor.rand(spec, *size)


def st_zeros(spec: Any, *size: int) -> Any:
    from torch.distributed._shard import sharded_tensor

    return sharded_tensor.zeros(spec, *size)


def full_of(t: Any) -> torch.Tensor:
    """The full tensor of a ShardedTensor (collective), or ``t`` itself."""
    if not hasattr(t, "local_shards"):
        return t
    mine = [(list(s.metadata.shard_offsets), s.tensor) for s in t.local_shards()]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = torch.full(tuple(t.size()), float("nan"), dtype=t.dtype)
    for parts in every:
        for offsets, part in parts:
            out[tuple(slice(o, o + n) for o, n in zip(offsets, part.shape, strict=True))] = part
    return out


def assert_state_dict_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """PyTorch's ``assert_state_dict_equal``: same keys, every ShardedTensor's local shards and
    every tensor equal (bit for bit), other values equal."""
    assert set(a) == set(b), (sorted(a), sorted(b))
    for key, va in a.items():
        vb = b[key]
        if hasattr(va, "local_shards"):
            for sa, sb in zip(va.local_shards(), vb.local_shards(), strict=True):
                assert torch.equal(sa.tensor, sb.tensor), f"{key}'s shard does not match"
        elif isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), f"{key}'s tensor does not match"
        else:
            assert va == vb, (key, va, vb)


def sharded_model1_state(spec: Any) -> dict[str, Any]:
    """What PyTorch's ``MyShardedModel1`` gives with ``state_dict_hook``: two (10, 20)
    ShardedTensors (one in a submodule) and a replicated parameter of each level."""
    return {"sharded_tensor1": st_rand(spec, 10, 20), "random_tensor1": torch.rand(2, 2),
            "submodule.sharded_tensor2": st_rand(spec, 10, 20),
            "submodule.random_tensor2": torch.rand(2, 2)}


# ----------------------------------------------------------------------------------------------
# test_file_system_checkpoint_cpu.py


def read_write_shard_tensor(rank: int, steps: Steps, threads: int) -> None:
    """TestDistributedStateDictSaveLoadWithSharedTensor.test_read_write_shard_tensor."""
    spec = chunk_spec(0, [0, 1])
    torch.manual_seed(1)  # the replicated tensors: the same on every rank, as PyTorch's seed
    saved = sharded_model1_state(spec)
    save(saved, steps, threads)
    into = sharded_model1_state(spec)
    with pytest.raises(AssertionError):
        assert_state_dict_equal(into, saved)
    load(into, steps)
    assert_state_dict_equal(into, saved)


def _shard_plans() -> list[Any]:
    return [chunk_spec(0, [0, 1]), chunk_spec(0, [0, 1, 1, 0]),
            enum_spec([([0, 0], [2, 20], 0), ([2, 0], [1, 20], 1), ([3, 0], [3, 20], 0),
                       ([6, 0], [3, 20], 1), ([9, 0], [1, 20], 0)]),
            enum_spec([([0, 0], [8, 20], 1), ([8, 0], [2, 20], 0)])]


def load_with_different_shard_plan(rank: int, steps: Steps, threads: int) -> None:
    """TestDistributedReshardOnLoad.test_load_with_different_shard_plan: every pair of four
    shard plans (ranks holding several shards, uneven ones) saved with one, loaded into the
    other."""
    specs = _shard_plans()
    for i, s0 in enumerate(specs):
        for j, s1 in enumerate(specs):
            if i == j:
                continue
            saved = {"sharded_tensor": st_rand(s0, 10, 20)}
            save(saved, steps, threads)
            into = {"sharded_tensor": st_zeros(s1, 10, 20)}
            load(into, steps)
            assert torch.equal(full_of(saved["sharded_tensor"]),
                               full_of(into["sharded_tensor"])), (i, j)


def load_rowwise_to_colwise(rank: int, steps: Steps, threads: int) -> None:
    """TestDistributedReshardOnLoad.test_load_rowwise_to_colwise (on CPU)."""
    saved = {"sharded_tensor": st_rand(chunk_spec(0, [0, 1]), 10, 20)}
    save(saved, steps, threads)
    into = {"sharded_tensor": st_zeros(chunk_spec(1, [0, 1]), 10, 20)}
    load(into, steps)
    assert torch.equal(full_of(saved["sharded_tensor"]), full_of(into["sharded_tensor"]))


def save_load_bytes(rank: int, steps: Steps, threads: int) -> None:
    """TestDistributedReshardOnLoad.test_save_load_bytes (values: ckptfs's msgpack)."""
    save({"bytes0": [1], "bytes1": "string"}, steps, threads)
    into: dict[str, Any] = {"bytes0": [2], "bytes1": "other"}
    load(into, steps)
    assert into == {"bytes0": [1], "bytes1": "string"}


def switch_between_sharded_tensor_to_tensor(rank: int, steps: Steps, threads: int) -> None:
    """TestDistributedReshardOnLoad.test_switch_between_sharded_tensor_to_tensor: a
    ShardedTensor loaded into a plain tensor and a plain (replicated) one into a
    ShardedTensor, for every pair of four shard plans."""
    n = 32
    specs = [chunk_spec(0, [0, 1]), chunk_spec(0, [0, 1, 1, 0]),
             enum_spec([([0], [8], 1), ([8], [n - 8], 0)]),
             enum_spec([([0], [10], 0), ([10], [n - 10], 1)])]
    for i, save_spec in enumerate(specs):
        for j, load_spec in enumerate(specs):
            saved = {"sharded": st_rand(save_spec, n), "replicated": torch.rand(n)}
            dist.broadcast(saved["replicated"], src=0)
            save(saved, steps, threads)
            into = {"sharded": torch.zeros(n), "replicated": st_zeros(load_spec, n)}
            load(into, steps)
            assert torch.equal(full_of(saved["sharded"]), into["sharded"]), (i, j)
            assert torch.equal(saved["replicated"], full_of(into["replicated"])), (i, j)


# ----------------------------------------------------------------------------------------------
# test_fsspec.py


class _Net(torch.nn.Module):
    """PyTorch's ``MyTestModule`` of test_fsspec.py."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        self.net2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
        self.net3 = torch.nn.Linear(32, 64)
        self.net4 = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net4(self.net3(self.net2(self.net1(x))))
        return out


def fsspec_fsdp1(rank: int, steps: Steps, threads: int) -> None:
    """TestFSSpec.test_fsspec: an FSDP1 model's and Adam's SHARDED_STATE_DICT saved, loaded
    into another FSDP1 model and optimizer; parameters and Adam's state then equal.  The
    optimizer state is loaded by ``dcp.load`` into ``FSDP.optim_state_dict`` of the new
    optimizer (PyTorch's ``load_sharded_optimizer_state_dict``: see
    `load_sharded_optimizer_state_dict_case`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    def make() -> tuple[Any, Any]:
        model = FSDP(_Net(), device_id=torch.device("cpu"))
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.rand(8, 8)).sum().backward()
        optim.step()
        return model, optim

    torch.manual_seed(0)
    model, optim = make()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)},
             steps, threads)
    torch.manual_seed(1)
    model_2, optim_2 = make()
    with FSDP.summon_full_params(model), FSDP.summon_full_params(model_2):
        for (_, p1), (_, p2) in zip(model.named_parameters(), model_2.named_parameters(),
                                    strict=True):
            assert not torch.equal(p1, p2)
    with FSDP.state_dict_type(model_2, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model_2.state_dict(), "optim": FSDP.optim_state_dict(model_2, optim_2)}
        load(state, steps)
        model_2.load_state_dict(state["model"])
        optim_2.load_state_dict(FSDP.optim_state_dict_to_load(model_2, optim_2, state["optim"]))
    with FSDP.summon_full_params(model), FSDP.summon_full_params(model_2):
        for (_, p1), (_, p2) in zip(model.named_parameters(), model_2.named_parameters(),
                                    strict=True):
            assert torch.equal(p1, p2)
    for s1, s2 in zip(optim.state.values(), optim_2.state.values(), strict=True):
        assert torch.equal(s1["exp_avg"], s2["exp_avg"])
        assert torch.equal(s1["exp_avg_sq"], s2["exp_avg_sq"])
    assert optim_2.param_groups[0]["lr"] == 0.1


def _fsdp1_dummy(world: int) -> Any:
    """PyTorch's ``TestDummyModel`` of test_fsdp_optim_state.py, wrapped by FSDP1 on CPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    d1, d2, d3 = world, world * 2, world * 3
    net = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, d1), torch.nn.ReLU()),
                              torch.nn.Sequential(torch.nn.Linear(d1, d2), torch.nn.ReLU()),
                              torch.nn.Sequential(torch.nn.Linear(d2, d3), torch.nn.ReLU()))
    return FSDP(net, device_id=torch.device("cpu"))


def load_sharded_optimizer_state_dict_case(rank: int, steps: Steps, threads: int,
                                           pass_planner: bool) -> None:
    """FsdpOptimStateCheckpoint.test_load_sharded_optimizer_state_dict: FSDP1's model and Adam
    state saved; the model loaded by ``dcp.load``, the optimizer by DCP's helper
    ``load_sharded_optimizer_state_dict``, into a new model and optimizer whose optimizer state
    then equals the saved one.  ``pass_planner``: the helper given ``ckptfs.dcp.LoadPlanner()``
    (PyTorch's case passes DCP's ``DefaultLoadPlanner``); without it the helper loads with DCP's
    default planner, which unpickles values: the ckptfs Reader refuses that, on every rank,
    with the error naming ``ckptfs.dcp.LoadPlanner``."""
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _fsdp1_dummy(world)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.rand(8, 8)).sum().backward()
    optim.step()
    FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    optim_osd = FSDP.optim_state_dict(model, optim)
    save({"model": model.state_dict(), "optim": optim_osd}, steps, threads)
    torch.manual_seed(1)
    model_2 = _fsdp1_dummy(world)
    optim_2 = torch.optim.Adam(model_2.parameters(), lr=0.1)
    FSDP.set_state_dict_type(model_2, StateDictType.SHARDED_STATE_DICT)
    assert len(optim_2.state) == 0  # Adam makes its state lazily
    state = {"model": model_2.state_dict()}
    load(state, steps)
    model_2.load_state_dict(state["model"])
    if not pass_planner:
        try:
            load_sharded_optimizer_state_dict(model_state_dict=state["model"],
                                              optimizer_key="optim",
                                              storage_reader=steps.reader())
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            text = str(exc)
            assert "ckptfs.dcp.LoadPlanner" in text and "unpickle" in text, text
            return
        raise AssertionError("DCP's unpickling planner was not refused")
    optim_state = load_sharded_optimizer_state_dict(
        model_state_dict=state["model"], optimizer_key="optim",
        storage_reader=steps.reader(), planner=ckptfs.dcp.LoadPlanner())
    optim_2.load_state_dict(FSDP.optim_state_dict_to_load(model_2, optim_2,
                                                          optim_state["optim"]))
    after = FSDP.optim_state_dict(model_2, optim_2)["state"]
    before = optim_osd["state"]
    assert len(before) == len(after)
    for fqn, states in before.items():
        for name, value in states.items():
            value2 = after[fqn][name]
            if hasattr(value, "local_shards"):
                assert hasattr(value2, "local_shards")
                for a, b in zip(value.local_shards(), value2.local_shards(), strict=True):
                    assert torch.equal(a.tensor, b.tensor), (fqn, name)
            elif isinstance(value, torch.Tensor):
                assert torch.equal(value, value2), (fqn, name)
            else:
                assert value == value2, (fqn, name)


def optim_with_planner(rank: int, steps: Steps, threads: int) -> None:
    load_sharded_optimizer_state_dict_case(rank, steps, threads, pass_planner=True)


def optim_without_planner(rank: int, steps: Steps, threads: int) -> None:
    load_sharded_optimizer_state_dict_case(rank, steps, threads, pass_planner=False)


def _fsdp_model_state(steps: Steps, threads: int, process_group: Any) -> None:
    """FsdpModelStateCheckpoint._test_fsdp_model_state: an FSDP1 ``Linear`` saved (sharded
    over every rank) and loaded into one sharded over ``process_group`` (None: every rank)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    torch.manual_seed(0)
    model = FSDP(torch.nn.Linear(8, 8), device_id=torch.device("cpu"))
    model(torch.rand(8, 8)).sum().backward()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        save({"model": model.state_dict()}, steps, threads)
    torch.manual_seed(1)
    model_2 = FSDP(torch.nn.Linear(8, 8), device_id=torch.device("cpu"),
                   process_group=process_group)
    with FSDP.summon_full_params(model), FSDP.summon_full_params(model_2):
        assert not torch.equal(model.weight, model_2.weight)
        assert not torch.equal(model.bias, model_2.bias)
    with FSDP.state_dict_type(model_2, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model_2.state_dict()}
        load(state, steps)
        model_2.load_state_dict(state["model"])
    with FSDP.summon_full_params(model), FSDP.summon_full_params(model_2):
        assert torch.equal(model.weight, model_2.weight)
        assert torch.equal(model.bias, model_2.bias)


def fsdp_model_state_no_resharding(rank: int, steps: Steps, threads: int) -> None:
    """FsdpModelStateCheckpoint.test_fsdp_model_state_no_resharding."""
    _fsdp_model_state(steps, threads, None)


def fsdp_model_state_with_resharding(rank: int, steps: Steps, threads: int) -> None:
    """FsdpModelStateCheckpoint.test_fsdp_model_state_with_resharding: loaded into FSDP1
    groups of the even and of the odd ranks (of 2 ranks: each rank a group of its own)."""
    world = dist.get_world_size()
    groups = [dist.new_group(ranks=[r for r in range(world) if r % 2 == parity])
              for parity in (0, 1)]
    _fsdp_model_state(steps, threads, groups[rank % 2])


def overwrite(rank: int, steps: Steps, threads: int) -> None:
    """TestFSSpec.test_overwrite, ckptfs's way: a committed step is never overwritten (DCP's
    ``overwrite=True`` has no counterpart: a new save is a new step); saving it again is
    refused with `CheckpointExistsError` on every rank and the first save still loads."""
    t1, t2 = torch.randn(10), torch.randn(10)
    dist.broadcast(t1, src=0)
    save({"random": t1}, steps, threads)
    try:
        dcp.save({"random": t2}, storage_writer=ckptfs.dcp.Writer(steps.url, steps.step),
                 planner=ckptfs.dcp.SavePlanner())
    except BaseException as exc:
        assert "CheckpointExistsError" in f"{exc!r} {exc}" or \
            isinstance(exc, CheckpointExistsError), repr(exc)
    else:
        raise AssertionError("a committed step was written again")
    sd = {"random": torch.zeros(10)}
    load(sd, steps)
    assert torch.equal(sd["random"], t1)
    save({"random": t2}, steps, threads)  # the next step holds the new value
    load(sd, steps)
    assert torch.equal(sd["random"], t2)


# ----------------------------------------------------------------------------------------------
# test_dtensor_checkpoint.py and test_dtensor_resharding.py


def distributed_tensor_planner(rank: int, steps: Steps, threads: int) -> None:
    """DTensorPlanner.test_distributed_tensor_planner: a sharded and a replicated DTensor
    parameter and a module's extra state (an int and a tensor) saved, then loaded into a model
    made with other values: the saved ones come back."""
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))

    def model_state(scale: float, extra: int) -> dict[str, Any]:
        return {"rdt": distribute_tensor(torch.arange(4, 8, dtype=torch.float32) * scale, mesh,
                                         [Replicate()]),
                "sdt": distribute_tensor(torch.arange(0, 4, dtype=torch.float32) * scale, mesh,
                                         [Shard(0)]),
                "_extra_state": {"extra_state": extra,
                                 "extra_state_tensor": torch.zeros(1) + extra - 1}}

    saved = model_state(1, 1)
    save(saved, steps, threads)
    state = model_state(10, 10)
    load(state, steps)
    assert torch.equal(state["rdt"].to_local(), saved["rdt"].to_local())
    assert torch.equal(state["sdt"].to_local(), saved["sdt"].to_local())
    assert state["_extra_state"]["extra_state"] == 1
    assert torch.equal(state["_extra_state"]["extra_state_tensor"], torch.tensor([0.0]))


def _placements_1d() -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [[Shard(0)], [Replicate()]]


def _placements_2d() -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [[Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(0), Replicate()],
            [Shard(0), Shard(0)]]


def _reshard(steps: Steps, threads: int, mesh_a: Any, place_a: Any, mesh_b: Any,
             place_b: Any) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor, zeros

    global_tensor = torch.arange(16, dtype=torch.float).view(4, 4)
    saved = {"dtensor": distribute_tensor(global_tensor, mesh_a, place_a)}
    save(saved, steps, threads)
    into = {"dtensor": zeros([4, 4], device_mesh=mesh_b, placements=place_b)}
    load(into, steps)
    full = into["dtensor"].redistribute(mesh_b, [Replicate()] * mesh_b.ndim).to_local()
    assert torch.equal(full, global_tensor), (place_a, place_b)
    if mesh_a is mesh_b:
        back = into["dtensor"].redistribute(mesh_a, place_a)
        assert torch.equal(back.to_local(), saved["dtensor"].to_local())


def _meshes() -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (2, world // 2))


def reshard_1d_to_1d(rank: int, steps: Steps, threads: int) -> None:
    """TestDTensorReshardPlacementChange.test_1d_to_1d_reshard_placement_change (both
    parametrizations: Replicate to Shard(0) and back)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, _ = _meshes()
    for a, b in (([Replicate()], [Shard(0)]), ([Shard(0)], [Replicate()])):
        _reshard(steps, threads, mesh, a, mesh, b)


def reshard_2d_to_2d(rank: int, steps: Steps, threads: int) -> None:
    """TestDTensorReshardPlacementChange.test_2d_to_2d_reshard_placement_change (its 12
    parametrizations: every ordered pair of four 2-D placements), on a (2, 1) mesh."""
    _, mesh = _meshes()
    for a in _placements_2d():
        for b in _placements_2d():
            if a != b:
                _reshard(steps, threads, mesh, a, mesh, b)


def reshard_1d_to_2d(rank: int, steps: Steps, threads: int) -> None:
    """TestDTensorReshardMeshChange.test_1d_to_2d_reshard_mesh_change."""
    mesh_1d, mesh_2d = _meshes()
    for a in _placements_1d():
        for b in _placements_2d():
            _reshard(steps, threads, mesh_1d, a, mesh_2d, b)


def reshard_2d_to_1d(rank: int, steps: Steps, threads: int) -> None:
    """TestDTensorReshardMeshChange.test_2d_to_1d_reshard_mesh_change."""
    mesh_1d, mesh_2d = _meshes()
    for a in _placements_2d():
        for b in _placements_1d():
            _reshard(steps, threads, mesh_2d, a, mesh_1d, b)


# ----------------------------------------------------------------------------------------------
# test_save_load_api.py


def auto_detect(rank: int, steps: Steps, threads: int) -> None:
    """TestSaveAndLoadAPI.test_auto_detect, as it bears on ckptfs: ``checkpoint_id=`` alone
    detects DCP's own ``FileSystemWriter`` (DCP's format: ``.metadata``, no ckptfs commit),
    never ckptfs (``Writer``/``Reader.validate_checkpoint_id`` is False: docs/sharded.md);
    an unknown scheme is still "Cannot detect"."""
    base = Path(steps.url)
    paths: list[Any] = [str(base / "first")]
    state = {"w": torch.arange(6.0)}
    dcp.save(state, checkpoint_id=paths[0])
    sd = {"w": torch.zeros(6)}
    dcp.load(sd, checkpoint_id=paths[0])
    assert torch.equal(sd["w"], state["w"])
    assert (base / "first" / ".metadata").exists()  # DCP's own format, not ckptfs's
    assert ckptfs.open(paths[0]).steps() == []
    assert not ckptfs.dcp.Writer.validate_checkpoint_id(paths[0])
    assert not ckptfs.dcp.Reader.validate_checkpoint_id(paths[0])
    for call in (lambda: dcp.save(state, checkpoint_id="abc://abc.abc"),
                 lambda: dcp.load(state, checkpoint_id="abc://abc.abc")):
        with pytest.raises(RuntimeError, match="Cannot detect"):
            call()


#: name -> (PyTorch's test it ports, case, thread counts); run in one 2-rank job.
DISTRIBUTED: dict[str, tuple[str, Callable[[int, Steps, int], None], tuple[int, ...]]] = {
    "read_write_shard_tensor": (
        "test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoadWithSharedTensor"
        "::test_read_write_shard_tensor", read_write_shard_tensor, THREADS),
    "load_with_different_shard_plan": (
        "test_file_system_checkpoint_cpu.py::TestDistributedReshardOnLoad"
        "::test_load_with_different_shard_plan", load_with_different_shard_plan, THREADS),
    "load_rowwise_to_colwise": (
        "test_file_system_checkpoint_cpu.py::TestDistributedReshardOnLoad"
        "::test_load_rowwise_to_colwise", load_rowwise_to_colwise, THREADS),
    "save_load_bytes": (
        "test_file_system_checkpoint_cpu.py::TestDistributedReshardOnLoad::test_save_load_bytes",
        save_load_bytes, THREADS),
    "switch_between_sharded_tensor_to_tensor": (
        "test_file_system_checkpoint_cpu.py::TestDistributedReshardOnLoad"
        "::test_switch_between_sharded_tensor_to_tensor", switch_between_sharded_tensor_to_tensor,
        THREADS),
    "fsspec": ("test_fsspec.py::TestFSSpec::test_fsspec", fsspec_fsdp1, (1,)),
    "load_sharded_optimizer_state_dict[pass_planner=True]": (
        "test_fsdp_optim_state.py::FsdpOptimStateCheckpoint"
        "::test_load_sharded_optimizer_state_dict[pass_planner=True]", optim_with_planner, (1,)),
    "load_sharded_optimizer_state_dict[pass_planner=False]": (
        "test_fsdp_optim_state.py::FsdpOptimStateCheckpoint"
        "::test_load_sharded_optimizer_state_dict[pass_planner=False]", optim_without_planner,
        (1,)),
    "fsdp_model_state_no_resharding": (
        "test_fsdp_model_state.py::FsdpModelStateCheckpoint"
        "::test_fsdp_model_state_no_resharding", fsdp_model_state_no_resharding, (1,)),
    "fsdp_model_state_with_resharding": (
        "test_fsdp_model_state.py::FsdpModelStateCheckpoint"
        "::test_fsdp_model_state_with_resharding", fsdp_model_state_with_resharding, (1,)),
    "overwrite": ("test_fsspec.py::TestFSSpec::test_overwrite", overwrite, (1,)),
    "distributed_tensor_planner": (
        "test_dtensor_checkpoint.py::DTensorPlanner::test_distributed_tensor_planner",
        distributed_tensor_planner, (1,)),
    "reshard_1d_to_1d": (
        "test_dtensor_resharding.py::TestDTensorReshardPlacementChange"
        "::test_1d_to_1d_reshard_placement_change", reshard_1d_to_1d, (1,)),
    "reshard_2d_to_2d": (
        "test_dtensor_resharding.py::TestDTensorReshardPlacementChange"
        "::test_2d_to_2d_reshard_placement_change", reshard_2d_to_2d, (1,)),
    "reshard_1d_to_2d": (
        "test_dtensor_resharding.py::TestDTensorReshardMeshChange"
        "::test_1d_to_2d_reshard_mesh_change", reshard_1d_to_2d, (1,)),
    "reshard_2d_to_1d": (
        "test_dtensor_resharding.py::TestDTensorReshardMeshChange"
        "::test_2d_to_1d_reshard_mesh_change", reshard_2d_to_1d, (1,)),
    "auto_detect": ("test_save_load_api.py::TestSaveAndLoadAPI::test_auto_detect",
                    auto_detect, (1,)),
}

#: PyTorch's tests of the files above that are not ported, and why.
NOT_PORTED: dict[str, str] = {
    "test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoadRot13"
    "::test_read_write_tensor_and_blob":
        "FileSystemWriter's private _extensions (stream transforms of DCP's own .distcp "
        "files): no storage-layer counterpart",
    "test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoadZStandard"
    "::test_read_write_only_tensor":
        "FileSystemWriter's ZStandard extension (compression of DCP's own .distcp files)",
    "test_fsspec.py::TestFileSystem::test_remove_on_fail":
        "tests DCP's FileSystem class (the streams of its own format); ckptfs's failed save "
        "leaves no marker: tests/protocol/test_sharded.py",
    "test_planner.py (test_local_plan, test_global_plan, test_local_load_plan, "
    "test_load_with_resharding, test_load_with_world_size_diff_by_one, "
    "test_create_read_item_from_chunks)":
        "unit tests of DCP's planning functions (create_default_*), not of a storage layer; "
        "ckptfs's global plan is checked against DCP's own in tests/protocol/test_plan_tiling.py",
    "test_file_system_checkpoint.py":
        "the CUDA twin of test_file_system_checkpoint_cpu.py (the same cases on GPU tensors, "
        "NCCL); its cases are ported above on CPU tensors",
    "test_state_dict_utils.py":
        "tests DCP's state-dict utilities (gather, offload to CPU, copy), which use no storage "
        "layer",
    "test_checkpoint.py":
        "DCP's error propagation through fault-injecting storages of its own (no storage "
        "layer under test); ckptfs's failures: tests/protocol/test_sharded.py",
    "test_format_utils.py, test_dcp_to_torch_save.py, test_torch_save_to_dcp.py, "
    "test_compatibility.py":
        "convert or read DCP's own .distcp/.metadata files (its format, not a storage layer)",
    "test_hf_storage.py, test_hf_safetensor_e2e.py, test_consolidate_hf_safetensors.py":
        "DCP's Hugging Face storage layer and its safetensors layout, a storage layer of its "
        "own",
    "test_tp_checkpoint.py, test_hsdp_checkpoint.py, test_2d_*.py, test_fsdp_tp_checkpoint_"
    "conversion.py":
        "need 2-4 CUDA devices and NCCL; the DTensor save and load paths they take are the "
        "DTensor cases above",
}


def job_suite(rank: int, world: int, base: str) -> dict[str, str]:
    """Every case of `DISTRIBUTED`, each thread count, in order; each one's outcome ("ok" or
    its traceback).  A barrier after each keeps the ranks in step after a failing case."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    out: dict[str, str] = {}
    for name, (_, case, threads) in DISTRIBUTED.items():
        for n in threads:
            key = f"{name}[threads={n}]"
            try:
                case(rank, Steps(f"{base}/{name}-{n}"), n)
                out[key] = "ok"
            except BaseException:
                out[key] = traceback.format_exc()
            dist.barrier()
    return out


@cache
def _suite_results(base: str) -> list[dict[str, str]]:
    return run_ranks(job_suite, 2, base, timeout=300)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return _suite_results(str(tmp_path_factory.mktemp("dcp-suite")))


@pytest.mark.parametrize("key", [f"{name}[threads={n}]" for name, (_, _, ts) in
                                 DISTRIBUTED.items() for n in ts])
def test_pytorch_dcp_case_on_two_ranks(suite: list[dict[str, str]], key: str) -> None:
    for rank, results in enumerate(suite):
        assert results.get(key) == "ok", f"rank {rank}, {key}:\n{results.get(key)}"


# ----------------------------------------------------------------------------------------------
# One process (no_dist=True)


class _Module(torch.nn.Module):
    """PyTorch's ``MyTestModule`` of test_file_system_checkpoint_cpu.py."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


@pytest.mark.parametrize("threads", THREADS)
def test_read_write_only_tensor(tmp_path: Path, threads: int) -> None:
    """test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoad
    ::test_read_write_only_tensor (``no_dist=True``)."""
    saved = _Module().state_dict()
    url = str(tmp_path / "run")
    dcp.save(saved, storage_writer=ckptfs.dcp.Writer(url, 1, threads=threads),
             planner=ckptfs.dcp.SavePlanner(), no_dist=True)
    into = _Module().state_dict()
    with pytest.raises(AssertionError):
        assert_state_dict_equal(into, saved)
    dcp.load(into, storage_reader=ckptfs.dcp.Reader(url), planner=ckptfs.dcp.LoadPlanner(),
             no_dist=True)
    assert_state_dict_equal(into, saved)


def test_dtype_mismatch_casting(tmp_path: Path) -> None:
    """test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoad
    ::test_dtype_mismatch_casting, ckptfs's way: DCP casts silently (newer torch refuses
    narrowing casts with ``allow_unsafe_types=False``, which 2.13 lacks); ckptfs never converts
    a dtype on load, narrowing or widening, with its planner or DCP's: `LoadOptionError`
    before anything is read."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    for i, (saved_dtype, into_dtype) in enumerate(((torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.float32))):
        url = str(tmp_path / f"run{i}")
        dcp.save({"w": torch.rand(4, 3, dtype=saved_dtype)},
                 storage_writer=ckptfs.dcp.Writer(url, 1), planner=ckptfs.dcp.SavePlanner(),
                 no_dist=True)
        for planner in (ckptfs.dcp.LoadPlanner(), DefaultLoadPlanner()):
            into = {"w": torch.zeros(4, 3, dtype=into_dtype)}
            with pytest.raises(BaseException) as info:
                dcp.load(into, storage_reader=ckptfs.dcp.Reader(url), planner=planner,
                         no_dist=True)
            text = f"{info.value!r} {info.value}"
            assert isinstance(info.value, LoadOptionError) or "LoadOptionError" in text, text
            assert str(saved_dtype) in text and str(into_dtype) in text, text
            assert torch.equal(into["w"], torch.zeros(4, 3, dtype=into_dtype))  # untouched


def test_not_ported_cases_have_reasons() -> None:
    """The cases left out are named with a reason (the module docstring), and none of them is
    also run."""
    ported = {src for src, _, _ in DISTRIBUTED.values()}
    assert NOT_PORTED and all(len(reason) > 40 for reason in NOT_PORTED.values())
    assert not ported & set(NOT_PORTED)


@pytest.mark.parametrize("case", sorted(NOT_PORTED))
def test_not_ported(case: str) -> None:
    pytest.skip(NOT_PORTED[case])
