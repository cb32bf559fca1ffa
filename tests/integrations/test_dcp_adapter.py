"""``ckptfs.dcp``: plain ``dcp.save``/``dcp.async_save``/``dcp.load`` with ckptfs's Writer,
Reader and planners, on 2 gloo ranks: the same format v2 commit, digests and layout as
``store.save``; pickling planners and per-rank metadata refused; no ``.metadata``/``.distcp``.
One rank job does every distributed case (spawning ranks is the expensive part)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_util import run_ranks
from test_sharded import build_state, targets, to_plain

import ckptfs
import ckptfs.dcp
from ckptfs.format.layout import StepPaths
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal


def adapter_state(world: int) -> tuple[dict[str, Any], Any]:
    """The FSDP2 + DTensor state of test_sharded, with str keys only (plain DCP names values by
    ``str(key)`` and a raw ``dcp.load`` cannot give int keys back)."""
    state, mesh = build_state(world)
    state["trainer"] = {"step": 10, "lr": 0.1, "betas": (0.9, 0.99), "names": ["a", "b"],
                        "blob": b"\x00\x80", "big": 2**70, "ids": torch.arange(4)}
    return state, mesh


def sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: sorted_keys(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list):
        return [sorted_keys(v) for v in value]
    return value


def _failure_text(fn: Any) -> str:
    try:
        fn()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def job_adapter(rank: int, world: int, url: str, opts: dict[str, Any]) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    state, mesh = adapter_state(world)
    plain = to_plain(state)
    out: dict[str, Any] = {"plain": plain if rank == 0 else None}
    writer = ckptfs.dcp.Writer(url, 1, **opts)
    md = dcp.save(state, storage_writer=writer, planner=ckptfs.dcp.SavePlanner())
    out["save"] = md._ckptfs_info.attempt  # type: ignore[attr-defined]
    # async_save on a dedicated gloo group (the training group's collectives stay free).
    group = dist.new_group(backend="gloo")
    resp = dcp.async_save(state, storage_writer=ckptfs.dcp.Writer(url, 2, **opts),
                          planner=ckptfs.dcp.SavePlanner(), process_group=group)
    (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
    # Load the newest (step 2) into another placement with plain dcp.load.
    into = targets(plain, mesh, lambda t: Shard(1) if t.dim() >= 2 and t.shape[1] > 1
                   else (Replicate() if t.dim() == 1 else None))
    dcp.load(into, storage_reader=ckptfs.dcp.Reader(url, **opts),
             planner=ckptfs.dcp.LoadPlanner())
    assert_state_equal(to_plain(into), plain)
    # A checkpoint of dcp.save loads with store.load(into=...), and the other way round.
    into2 = targets(plain, mesh, lambda t: Shard(0) if t.dim() >= 1 and t.numel() else None)
    ckptfs.open(url, **opts).load(1, into=into2)
    assert_state_equal(to_plain(into2), plain)
    ckptfs.open(url, **opts).save(4, state)
    into3 = targets(plain, mesh, lambda t: None)
    dcp.load(into3, storage_reader=ckptfs.dcp.Reader(url, 4, **opts),
             planner=ckptfs.dcp.LoadPlanner())
    assert_state_equal(to_plain(into3), plain)
    # Refusals: DCP's pickling planners, per-rank metadata, a missing step.
    out["pickle_save"] = _failure_text(lambda: dcp.save(
        state, storage_writer=ckptfs.dcp.Writer(url, 3, **opts)))
    out["pickle_load"] = _failure_text(lambda: dcp.load(
        targets(plain, mesh, lambda t: None), storage_reader=ckptfs.dcp.Reader(url, 1, **opts)))
    out["no_collectives"] = _failure_text(lambda: dcp.save(
        state, storage_writer=ckptfs.dcp.Writer(url, 5, **opts),
        planner=ckptfs.dcp.SavePlanner(), use_collectives=False))
    out["missing"] = _failure_text(lambda: dcp.load(
        targets(plain, mesh, lambda t: None), storage_reader=ckptfs.dcp.Reader(url, 99, **opts),
        planner=ckptfs.dcp.LoadPlanner()))
    # A damaged dcp.msgpack: the typed ckptfs error inside DCP's exception on every rank (not
    # DCP's "metadata is None"); the step is deleted again afterwards.
    store = ckptfs.open(url, **opts)
    store.save(6, state)
    if rank == 0:
        info = store.info(6)
        path = Path(url.removeprefix("file://")) / StepPaths(6).file(info.attempt,
                                                                      "dcp.msgpack")
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    dist.barrier()
    out["corrupt_md"] = _failure_text(lambda: dcp.load(
        targets(plain, mesh, lambda t: None), storage_reader=ckptfs.dcp.Reader(url, 6, **opts),
        planner=ckptfs.dcp.LoadPlanner()))
    dist.barrier()
    if rank == 0:
        store.delete(6)
    return out


def test_dcp_adapter_save_async_load_and_refusals(local_backend: Backend) -> None:
    b = local_backend
    r0, r1 = run_ranks(job_adapter, 2, b.url, dict(b.options), timeout=240)
    plain = r0["plain"]
    assert r0["save"] == r1["save"]
    store = ckptfs.open(b.url)
    assert store.steps() == [1, 2, 4]
    for step in (1, 2, 4):
        info = store.info(step)
        assert info.manifest.format_version == 2
        assert {f.path for f in info.manifest.files} == {
            "dcp.msgpack", "rank-00000/data-0.safetensors", "rank-00001/data-0.safetensors"}
        assert store.verify(step).ok
    assert store.info(1).attempt == r0["save"]
    # Written by plain dcp.async_save: DCP's own nesting (key order is DCP's), plain tensors.
    assert_state_equal(sorted_keys(store.load(2)), sorted_keys(plain))
    assert_state_equal(store.load(4), plain)  # written by store.save: the exact tree
    for r in (r0, r1):
        assert "UnsupportedValueError" in r["pickle_save"] and "pickle" in r["pickle_save"]
        assert "unpickle" in r["pickle_load"] and "ckptfs.dcp.LoadPlanner" in r["pickle_load"]
        assert r["no_collectives"].startswith("UnsupportedValueError") and \
            "use_collectives=False" in r["no_collectives"]
        assert "step 99 is not committed" in r["missing"]
        assert "CorruptCheckpointError" in r["corrupt_md"] and "dcp.msgpack" in r["corrupt_md"]
        assert "metadata is None" not in r["corrupt_md"], r["corrupt_md"]
    names = [p for p in b.raw_fs.find(b.raw_root)]
    assert not [p for p in names if p.endswith((".metadata", ".distcp"))]
    assert not b.raw_fs.exists(b._p(StepPaths(3).marker))
    assert not b.raw_fs.exists(b._p(StepPaths(5).dir))


def test_writer_refuses_foreign_checkpoint_id(tmp_path: Any) -> None:
    w = ckptfs.dcp.Writer(str(tmp_path), 1)
    w.reset(w.checkpoint_id)
    try:
        w.reset("/somewhere/else")
    except ckptfs.InvalidStepError as exc:
        assert "Writer(url, step)" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("a foreign checkpoint_id was accepted")
    assert not ckptfs.dcp.Writer.validate_checkpoint_id(str(tmp_path))


def job_replicated(rank: int, world: int, url: str) -> Any:
    """A plain ``dcp.save`` of a tensor every rank holds (DDP), large enough that its writing is
    split between the ranks (replica-parallel save), then ``dcp.load`` back."""
    g = torch.Generator().manual_seed(4)
    full = torch.randn(1024, 512, generator=g)  # 2 MiB: more than a rank's share of the bytes
    writer = ckptfs.dcp.Writer(url, 1)
    md = dcp.save({"w": full.clone()}, storage_writer=writer, planner=ckptfs.dcp.SavePlanner())
    info = md._ckptfs_info  # type: ignore[attr-defined]
    into = {"w": torch.zeros(1024, 512)}
    dcp.load(into, storage_reader=ckptfs.dcp.Reader(url, 1), planner=ckptfs.dcp.LoadPlanner())
    chunks = md.state_dict_metadata["w"].chunks
    return {"exact": bool(torch.equal(into["w"], full)), "chunks": len(chunks),
            "files": sorted(f.path for f in info.manifest.files)}


def test_dcp_save_splits_a_large_replicated_tensor_between_ranks(tmp_path: Any) -> None:
    url = str(tmp_path / "run")
    for out in run_ranks(job_replicated, 2, url, timeout=240):
        assert out["exact"] and out["chunks"] == 2, out
        assert out["files"] == ["dcp.msgpack", "rank-00000/data-0.safetensors",
                                "rank-00001/data-0.safetensors"], out
    assert ckptfs.open(url).verify(1).ok


# ----------------------------------------------------------------------------------------------
# FSDP1's SHARDED_STATE_DICT: ShardedTensors (with non-tensor values beside them) through
# ckptfs's planners, by plain dcp.save/dcp.load and by store.save/store.load(into=...).


def full_tensors() -> dict[str, torch.Tensor]:
    """The full tensors the ShardedTensor job shards (every process builds the same ones)."""
    g = torch.Generator().manual_seed(34)
    return {"w": torch.randn(7, 3, generator=g),
            "h": torch.randn(5, generator=g).to(torch.bfloat16),
            "m": torch.randn(7, 3, generator=g)}


def sharded(full: torch.Tensor, dim: int, rank: int, world: int) -> Any:
    """``full`` as a ShardedTensor of ``world`` chunks along ``dim`` (torch's chunking: 4 and 3
    rows of 7), this rank's chunk filled from ``full``."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_tensor.empty(spec, *full.shape, dtype=full.dtype)
    for shard in st.local_shards():
        md = shard.metadata
        idx = tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes,
                                                    strict=True))
        shard.tensor.copy_(full[idx])
    return st


def fsdp1_like_state(rank: int, world: int, dim: int = 0, fill: bool = True) -> dict[str, Any]:
    """A model's and an optimizer's state as FSDP1 gives them (ShardedTensors; optimizer state
    keyed by name, ``param_groups`` of values); zeros when not ``fill``."""
    full = full_tensors() if fill else {k: torch.zeros_like(v)
                                        for k, v in full_tensors().items()}
    return {"model": {"w": sharded(full["w"], dim, rank, world),
                      "h": sharded(full["h"], 0, rank, world)},
            "optim": {"state": {"w": {"exp_avg": sharded(full["m"], dim, rank, world),
                                      "step": torch.tensor(3.0 if fill else 0.0)}},
                      "param_groups": [{"lr": 0.1 if fill else 0.0,
                                        "betas": (0.9, 0.99) if fill else (0.0, 0.0),
                                        "params": ["w"] if fill else []}]},
            "trainer": {"step": 10 if fill else 0}}


def local_parts(value: Any) -> Any:
    """Every ShardedTensor of ``value`` as its local shards' (offsets, tensor) pairs."""
    if isinstance(value, dict):
        return {k: local_parts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [local_parts(v) for v in value]
    if hasattr(value, "local_shards"):
        return [(tuple(s.metadata.shard_offsets), s.tensor.clone())
                for s in value.local_shards()]
    return value


def job_sharded_tensor(rank: int, world: int, url: str) -> Any:
    import warnings

    warnings.filterwarnings("ignore", "Please use DTensor", FutureWarning)
    full = full_tensors()
    state = fsdp1_like_state(rank, world)
    md = dcp.save(state, storage_writer=ckptfs.dcp.Writer(url, 1),
                  planner=ckptfs.dcp.SavePlanner())
    out: dict[str, Any] = {"saved_version": md.version}
    ckptfs.open(url).save(2, state)
    # dcp.load of each step into ShardedTensors chunked along the other dimension (resharded).
    for step in (1, 2):
        into = fsdp1_like_state(rank, world, dim=1, fill=False)
        planner = ckptfs.dcp.LoadPlanner()
        dcp.load(into, storage_reader=ckptfs.dcp.Reader(url, step), planner=planner)
        out[f"version{step}"] = planner.metadata.version if planner.metadata else "no metadata"
        out[f"dcp_load{step}"] = local_parts(into)
    # store.load(into=...) of the dcp.save checkpoint, into ShardedTensors chunked as saved.
    into = fsdp1_like_state(rank, world, fill=False)
    ckptfs.open(url).load(1, into=into)
    out["store_load"] = local_parts(into)
    # ... and into a DTensor (Shard(1)) and a plain tensor.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    into = {"model": {"w": distribute_tensor(torch.zeros(7, 3), mesh, [Shard(1)]),
                      "h": torch.zeros(5, dtype=torch.bfloat16)}}
    dcp.load(into, storage_reader=ckptfs.dcp.Reader(url, 1),
             planner=ckptfs.dcp.LoadPlanner(allow_partial_load=True))
    out["into_dtensor"] = into["model"]["w"].full_tensor()
    out["into_plain"] = into["model"]["h"]
    # Several shards a rank, uneven, in format v5 (per-rank metadata), loaded along columns.
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

    spec = EnumerableShardingSpec([ShardMetadata([o, 0], [n, 3], f"rank:{r % world}/cpu")
                                   for o, n, r in ((0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 1, 1))])
    st = sharded_tensor.empty(spec, 7, 3)
    for shard in st.local_shards():
        o, n = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        shard.tensor.copy_(full["w"][o:o + n])
    out["v5_shards"] = len(st.local_shards())
    ckptfs.open(url, metadata_layout="per-rank").save(3, {"w": st, "lr": 0.5})
    into = {"w": sharded(torch.zeros(7, 3), 1, rank, world), "lr": 0.0}
    ckptfs.open(url).load(3, into=into)
    out["v5_load"] = local_parts(into)
    out["v5_expected"] = local_parts({"w": sharded(full["w"], 1, rank, world), "lr": 0.5})
    out["expected_dim1"] = local_parts(fsdp1_like_state(rank, world, dim=1))
    out["expected_dim0"] = local_parts(fsdp1_like_state(rank, world))
    out["full"] = full
    return out


def assert_parts_equal(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (got, want)
        for k in want:
            assert_parts_equal(got[k], want[k])
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            assert_parts_equal(g, w)
    elif isinstance(want, tuple) and len(want) == 2 and isinstance(want[1], torch.Tensor):
        assert got[0] == want[0]
        assert got[1].dtype == want[1].dtype and torch.equal(got[1], want[1]), (got, want)
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
        assert torch.equal(got, want), (got, want)
    else:
        assert got == want and type(got) is type(want), (got, want)


def test_sharded_tensor_states_save_and_load_through_ckptfs_planners(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    outs = run_ranks(job_sharded_tensor, 2, url, timeout=240)
    for out in outs:
        assert out["saved_version"] == ckptfs.dcp.DCP_VERSION == "1.0.0"
        assert out["version1"] == ckptfs.dcp.DCP_VERSION  # stamped by Writer.finish
        # bit for bit, values included (the tuple of betas stays a tuple), resharded
        for step in (1, 2):
            assert_parts_equal(out[f"dcp_load{step}"], out["expected_dim1"])
        assert_parts_equal(out["store_load"], out["expected_dim0"])
        assert_parts_equal(out["into_dtensor"], out["full"]["w"])
        assert_parts_equal(out["into_plain"], out["full"]["h"])
        assert out["v5_shards"] == 2
        assert_parts_equal(out["v5_load"], out["v5_expected"])
    # Each rank held its own rows: the ranks' chunks differ and cover the tensor.
    offsets = [[o for o, _ in out["expected_dim0"]["model"]["w"]] for out in outs]
    assert offsets == [[(0, 0)], [(4, 0)]]
    full = outs[0]["full"]
    store = ckptfs.open(url)
    assert store.info(3).manifest.format_version == 5 and store.verify(3).ok
    assert torch.equal(store.load(3)["w"], full["w"])
    for step in (1, 2):
        assert store.verify(step).ok
        loaded = store.load(step)  # one process: plain full-size tensors
        assert_parts_equal(loaded["model"]["w"], full["w"])
        assert_parts_equal(loaded["model"]["h"], full["h"])
        assert_parts_equal(loaded["optim"]["state"]["w"]["exp_avg"], full["m"])
        assert loaded["optim"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99),
                                                    "params": ["w"]}]
        assert loaded["trainer"] == {"step": 10}
        # two rank files: each rank wrote its own shards
        assert sorted(f.path for f in store.info(step).manifest.files) == [
            "dcp.msgpack", "rank-00000/data-0.safetensors", "rank-00001/data-0.safetensors"]


def _fsdp1_model(seed: int) -> Any:
    """A small MLP wrapped by FSDP1 on CPU (``device_id=cpu``: without it FSDP1 asks for an
    accelerator) with AdamW after one step (the optimizer's state exists)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(seed)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(),
                                     torch.nn.Linear(6, 3)), device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * seed)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _fsdp1_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt),
                "trainer": {"step": 7}}


def _fsdp1_restore(model: Any, opt: Any, state: dict[str, Any]) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(state["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, state["optim"]))


def job_fsdp1(rank: int, world: int, url: str) -> Any:
    """FSDP1's SHARDED_STATE_DICT and optimizer state (accelerate's FSDP1 path) saved with
    plain ``dcp.save`` and ckptfs's planners, and with ``store.save``; each loaded into another
    FSDP1 model and optimizer, whose sharded state is then the saved one, bit for bit."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    model, opt = _fsdp1_model(1)
    state = _fsdp1_state(model, opt)
    kinds = sorted({type(v).__name__ for v in state["model"].values()})
    saved = local_parts(state)
    dcp.save(state, storage_writer=ckptfs.dcp.Writer(url, 1), planner=ckptfs.dcp.SavePlanner())
    ckptfs.open(url).save(2, state)
    out: dict[str, Any] = {"kinds": kinds, "saved": saved}
    for step in (1, 2):
        model2, opt2 = _fsdp1_model(2)  # other weights, other lr, other optimizer state
        into = _fsdp1_state(model2, opt2)
        if step == 1:
            dcp.load(into, storage_reader=ckptfs.dcp.Reader(url, 1),
                     planner=ckptfs.dcp.LoadPlanner())
        else:
            ckptfs.open(url).load(2, into=into)
        _fsdp1_restore(model2, opt2, into)
        out[f"restored{step}"] = local_parts(_fsdp1_state(model2, opt2))
    return out


def assemble(parts: list[Any], like: torch.Tensor) -> torch.Tensor:
    """The full tensor of the ranks' (offsets, tensor) parts (each rank's list)."""
    out = torch.full_like(like, float("nan")) if like.is_floating_point() else \
        torch.zeros_like(like)
    for rank_parts in parts:
        for offsets, t in rank_parts:
            idx = tuple(slice(o, o + s) for o, s in zip(offsets, t.shape, strict=True))
            out[idx] = t
    return out


def test_fsdp1_sharded_state_dict_through_ckptfs(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    outs = run_ranks(job_fsdp1, 2, url, timeout=240)
    for out in outs:
        assert out["kinds"] == ["ShardedTensor"]  # a real FSDP1 sharded state dict
        assert out["saved"]["optim"]["param_groups"][0]["lr"] == 0.01
        for step in (1, 2):
            assert_parts_equal(out[f"restored{step}"], out["saved"])
    # The full load in one process: every tensor equals the ranks' shards put together.
    store = ckptfs.open(url)
    for step in (1, 2):
        assert store.verify(step).ok
        full = store.load(step)
        for name, t in full["model"].items():
            parts = [o["saved"]["model"][name] for o in outs]
            assert sum(p[0][1].numel() for p in parts if p) == t.numel()
            assert torch.equal(assemble(parts, t), t), name
        exp_avg = full["optim"]["state"]["0.weight"]["exp_avg"]
        assert torch.equal(assemble([o["saved"]["optim"]["state"]["0.weight"]["exp_avg"]
                                     for o in outs], exp_avg), exp_avg)
        assert full["optim"]["param_groups"] == outs[0]["saved"]["optim"]["param_groups"]


def job_one_rank_sharded_tensor(rank: int, world: int, url: str) -> Any:
    """A job of one rank: a ShardedTensor state with no process group given is a plain
    (single-process) save, refused with the error saying how to save it; with one, saved."""
    import warnings

    warnings.filterwarnings("ignore", "Please use DTensor", FutureWarning)
    full = torch.arange(6.0).reshape(3, 2)
    state = {"w": sharded(full, 0, rank, world)}
    out: dict[str, Any] = {}
    try:
        ckptfs.open(url).save(1, state)
        out["plain"] = "saved"
    except ckptfs.UnsupportedValueError as exc:
        out["plain"] = str(exc)
    ckptfs.open(url).save(2, state, process_group=dist.group.WORLD)
    return out


def test_sharded_tensor_in_a_job_of_one_rank(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    (out,) = run_ranks(job_one_rank_sharded_tensor, 1, url, timeout=120)
    assert "ShardedTensor" in out["plain"] and "process_group=" in out["plain"], out
    assert ckptfs.open(url).steps() == [2]
    assert torch.equal(ckptfs.open(url).load(2)["w"], torch.arange(6.0).reshape(3, 2))
