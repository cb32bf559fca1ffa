"""``ckptfs.torch_compat``: the private torch APIs ckptfs uses live there and
only there, a torch that lacks one or is older than the sharded floor fails with a message
naming what is missing.  Runs on torch >= 2.9 (the sharded floor); the floors themselves, and
what an older torch does: tests/project/test_torch_floor.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfs import torch_compat
from ckptfs.torch_compat import MIN_TORCH, TorchCompatError
from ckptfs.torch_versions import SHARDED_TORCH_FLOOR

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ckptfs"
#: Modules still reaching DTensor internals directly, to be switched to
#: ``torch_compat.dtensor_local`` / ``dtensor_like`` by their owner (the async save's).
PENDING: set[str] = set()
#: Private torch attributes ckptfs uses (reached through torch_compat only).
PRIVATE_ATTRS = re.compile(r"\._local_tensor\b|\._spec\b|distributed_c10d\._|\._get_backend\(")


def _private_torch_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            if any(part.startswith("_") for part in module.split(".")):
                found.append(module)
            found += [f"{module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "torch"
                      and any(p.startswith("_") for p in a.name.split("."))]
    return found


def test_private_torch_apis_only_in_torch_compat() -> None:
    offenders = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "ckptfs/torch_compat.py":
            continue
        found = _private_torch_imports(path)
        if rel not in PENDING:
            found += PRIVATE_ATTRS.findall(path.read_text())
        if found:
            offenders[rel] = found
    assert not offenders, f"private torch APIs outside ckptfs/torch_compat.py: {offenders}"


def test_sharded_floor_is_checked() -> None:
    assert MIN_TORCH == SHARDED_TORCH_FLOOR
    assert torch_compat.torch_version("2.13.0+cpu") == (2, 13)
    assert torch_compat.torch_version("2.14.1+cu130") == (2, 14)
    assert torch_compat.torch_version() >= MIN_TORCH  # what runs these tests
    torch_compat.check_version(f"{MIN_TORCH[0]}.{MIN_TORCH[1]}.0")
    with pytest.raises(TorchCompatError, match=r"need torch >= 2\.9 .*2\.8\.0") as info:
        torch_compat.check_version("2.8.0")
    assert isinstance(info.value, ImportError)
    torch_compat.check_version("2.14.1+cu130")
    torch_compat.check_version("2.10.0")  # (2, 10) > (2, 9): compared as numbers
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "safetensors" not in deps  # never imported by ckptfs itself: see the extras

def test_a_missing_private_api_is_named() -> None:
    with pytest.raises(TorchCompatError, match=r"torch\.distributed\.checkpoint\.default_planner"
                                               r"\._Gone .*this torch is"):
        torch_compat.lookup("torch.distributed.checkpoint.default_planner", "_Gone")
    with pytest.raises(TorchCompatError, match=r"torch_nowhere\.x"):
        torch_compat.lookup("torch_nowhere", "x")
    missing = torch_compat.optional_lookup("torch.distributed.checkpoint", "_NoSuchWriter")
    with pytest.raises(TorchCompatError, match="_NoSuchWriter"):
        missing("/tmp/x")


def test_the_looked_up_apis_work() -> None:
    t = torch.arange(12).reshape(3, 4)
    assert torch.equal(torch_compat.narrow_tensor_by_index(t, [1, 2], [2, 2]), t[1:3, 2:4])
    root: dict[str, object] = {}
    torch_compat.set_element(root, ("a", "b", 1), 5)
    assert root == {"a": {"b": [None, 5]}}
    assert issubclass(torch_compat.EmptyStateDictLoadPlanner,
                      torch.distributed.checkpoint.DefaultLoadPlanner)


def test_sharded_tensor_shards(tmp_path: Path) -> None:
    """FSDP1's ShardedTensor is recognised by its local shards' tensors (a one-rank group: a
    ShardedTensor needs one); anything else is not one."""
    import warnings

    import torch.distributed as dist
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    assert torch_compat.sharded_tensor_shards(torch.ones(2)) is None
    assert torch_compat.sharded_tensor_shards({"a": 1}) is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0,
                            world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            st = sharded_tensor.zeros(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 3, 2)
            shards = torch_compat.sharded_tensor_shards(st)
        assert shards is not None and len(shards) == 1
        assert shards[0].shape == (3, 2) and type(shards[0]) is torch.Tensor
        assert shards[0].data_ptr() == st.local_shards()[0].tensor.data_ptr()  # no copy
    finally:
        dist.destroy_process_group()
    assert torch_compat.optional_module("torch_nowhere.sharded_tensor") is None


def _private_apis_on_ranks(rank: int, world: int, root: str) -> dict[str, object]:
    """Each private API torch_compat looks up, used on a real 2-rank gloo group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8.0).reshape(4, 2)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    local = torch_compat.dtensor_local(dt)
    twin = torch_compat.dtensor_like(local * 10, dt)
    store = torch_compat.default_store()
    store.set(f"rank{rank}", "here")
    dist.barrier()
    other = store.get(f"rank{1 - rank}").decode()
    timeout = torch_compat.group_timeout(dist.group.WORLD)
    dcp.save({"w": dt}, checkpoint_id=root)  # DCP's own writer: the load below is the check
    loaded: dict[str, object] = {}  # empty: DCP's private loader builds it from the metadata
    if rank == 0:
        torch_compat.load_state_dict(
            loaded, storage_reader=dcp.FileSystemReader(root),
            planner=torch_compat.EmptyStateDictLoadPlanner(), no_dist=True)
    return {"local": local.tolist(), "twin_full": twin.full_tensor().tolist(),
            "twin_placements": str(twin.placements), "other": other,
            "timeout_s": None if timeout is None else timeout.total_seconds(),
            "loaded": {k: v.tolist() for k, v in loaded.items()
                       if isinstance(v, torch.Tensor)}}


def test_private_apis_work_on_ranks(tmp_path: Path) -> None:
    """Runs on every tested torch (scripts/run-torch-matrix.sh): the DTensor internals, the
    c10d store and timeout, and DCP's private full loader behave as ckptfs uses them."""
    from dist_util import run_ranks

    results = run_ranks(_private_apis_on_ranks, 2, str(tmp_path / "dcp"), pg_timeout=42.0)
    full = torch.arange(8.0).reshape(4, 2)
    for rank, r in enumerate(results):
        assert r["local"] == full[2 * rank:2 * rank + 2].tolist()
        assert r["twin_full"] == (full * 10).tolist()
        assert r["twin_placements"] == "(Shard(dim=0),)"
        assert r["other"] == "here"
        assert r["timeout_s"] == 42.0
    assert results[0]["loaded"] == {"w": full.tolist()}
    assert results[1]["loaded"] == {}


def test_the_save_planner_plans_with_ckptfs_on_this_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's ``create_global_plan`` (with its plan caching, its bookkeeping) reaches ckptfs's
    override of its private ``_create_global_plan`` hook on every tested torch (2.6 had no
    such hook: DCP planned inline there, and ckptfs's planner would be bypassed)."""
    from ckptfs.protocol.sharded_plan import SavePlanner
    calls: list[int] = []
    own = SavePlanner._create_global_plan

    def spy(self: SavePlanner, all_plans: list[Any]) -> Any:
        calls.append(len(all_plans))
        return own(self, all_plans)

    monkeypatch.setattr(SavePlanner, "_create_global_plan", spy)
    planner = SavePlanner()
    planner.set_up_planner({"w": torch.arange(6.0), "step": 3}, None, True)
    plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    assert calls == [1]
    assert planner.metadata is metadata and planner.global_plan is not None
    assert set(metadata.state_dict_metadata) == {"w", "step"}
    assert [i.index.fqn for i in plans[0].items] == ["w", "step"]



@pytest.mark.parametrize("size,shards", [(10, 4), (7, 4), (3, 4), (0, 2), (12, 3)])
def test_shard_size_and_offset_is_dtensors_cut(size: int, shards: int) -> None:
    """`shard_size_and_offset` (public in DTensor 2.13 and 2.14, private in 2.9) cuts as
    ``torch.chunk`` does, empty shards at the end: the shards tile the dimension in order."""
    chunks = torch.arange(size).chunk(shards) if size else ()
    want = [(len(c), int(c[0])) for c in chunks if len(c)]
    got = [torch_compat.shard_size_and_offset(size, shards, i) for i in range(shards)]
    assert [g for g in got if g[0]] == want
    assert sum(s for s, _ in got) == size
    assert all(s == 0 for s, _ in got[len(want):])  # the empty ones come last
