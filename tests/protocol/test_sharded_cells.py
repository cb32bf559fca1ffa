"""The sharded cells of the matrix on real gloo ranks: the same guarantees as their neighbours.

* ``save_async`` of a DTensor state on an incremental store writes format v4 (references after
  the first step), as the synchronous sharded save does, and loads bit-exact;
* ``load(into=..., allow_rollback=True)`` rolls back over a corrupt newest rank file to the
  previous step, on two ranks and on one, as the full load does;
* ``CheckpointManager.restore_latest`` of an FSDP2 run saved with ``incremental=True`` (format
  v4) restores into a fresh DTensor model and optimizer bit-exact;
* a rank that never calls a sharded ``save_async`` is named by the others' error, both when
  the store's async group is being created and once it exists."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks
from test_manager_sharded import local, outcome

import ckptfs
from ckptfs.testing.conformance import assert_state_equal


def _state(mesh: Any, step: int) -> dict[str, Any]:
    """A frozen sharded base (uneven: 7 rows on 2 ranks), a head that changes, a value."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    base = torch.randn(7, 5, generator=g)
    return {"base": distribute_tensor(base, mesh, [Shard(0)]),
            "head": distribute_tensor(torch.full((4, 3), float(step)), mesh, [Shard(0)]),
            "trainer": {"step": step}}


# -- save_async on an incremental store: format v4 ---------------------------------------------


def job_async_incremental(rank: int, world: int, url: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    store = ckptfs.open(url, incremental=True)
    base = _state(mesh, 0)["base"]  # the same tensor object at every save: frozen
    infos = []
    for step in (1, 2, 3):
        state = {**_state(mesh, step), "base": base}
        infos.append(store.save_async(step, state).result(timeout=120))
    store.close()
    return {"versions": [i.manifest.format_version for i in infos],
            "refs": [len(getattr(i.manifest, "references", ())) for i in infos],
            "written": [i.bytes_written for i in infos], "bytes": [i.bytes for i in infos]}


def test_async_sharded_save_on_an_incremental_store_writes_v4(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    r0, r1 = run_ranks(job_async_incremental, 2, url, timeout=240)
    assert r0 == r1
    assert r0["versions"] == [4, 4, 4], r0  # before: 2 (full v2, silently)
    assert r0["refs"][0] == 0 and r0["refs"][1] >= 1 and r0["refs"][2] >= 1, r0
    assert r0["written"][2] < r0["bytes"][2]  # the frozen base is referenced, not written
    store = ckptfs.open(url)
    for step in (1, 2, 3):
        got = store.load(step)
        g = torch.Generator().manual_seed(0)
        assert torch.equal(got["base"], torch.randn(7, 5, generator=g))
        assert torch.equal(got["head"], torch.full((4, 3), float(step)))
        assert got["trainer"] == {"step": step}
        store.verify(step)


# -- load(into=, allow_rollback=True) over a corrupt newest rank file ----------------------------


def job_rollback_into(rank: int, world: int, url: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    store = ckptfs.open(url)
    for step in (1, 2):
        store.save(step, _state(mesh, step))
    if rank == 0:  # damage every item of the last rank's file of step 2 (a byte each)
        info = store.info(2)
        entry = info.manifest.file(f"rank-{world - 1:05d}/data-0.safetensors")
        path = Path(url) / info.path / entry.path
        data = bytearray(path.read_bytes())
        for chunk in entry.chunks[1:]:  # type: ignore[attr-defined]
            if chunk.length:
                data[chunk.offset + chunk.length // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    dist.barrier()
    out: dict[str, Any] = {}
    target = _state(mesh, 0)
    out["refused"] = outcome(lambda: store.load(into=target))
    target = {**_state(mesh, 0), "trainer": {"step": -1}}
    store.load(into=target, allow_rollback=True)
    out["rolled_back"] = local({k: target[k] for k in ("base", "head")})
    out["trainer"] = target["trainer"]
    out["want"] = local({k: v for k, v in _state(mesh, 1).items() if k != "trainer"})
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_load_into_rolls_back_over_a_corrupt_rank_file(tmp_path: Path, world: int) -> None:
    url = str(tmp_path / "run")
    results = run_ranks(job_rollback_into, world, url, timeout=240)
    for r in results:
        name, typed, text = r["refused"]
        assert typed and name == "CorruptCheckpointError", r["refused"]
        assert "step 2" in text or "step-000000000002" in text, text
        assert_state_equal(r["rolled_back"], r["want"])  # step 1, not step 0 nor step 2
        assert r["trainer"] == {"step": 1}
    assert ckptfs.open(url).load(allow_rollback=True)["trainer"] == {"step": 1}


# -- the manager on an FSDP2 run saved with incremental=True -----------------------------------


def _fsdp(world: int, seed: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    model[0].requires_grad_(False)  # a frozen layer: referenced by every save after the first
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, opt


def job_manager_incremental(rank: int, world: int, url: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp(world, 0)
    mgr = ckptfs.CheckpointManager(ckptfs.open(url, incremental=True))
    torch.manual_seed(1)
    for step in (1, 2):
        model(torch.randn(4, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        mgr.save(step, model=model, optimizer=opt)
    msd, osd = get_state_dict(model, opt)
    saved = local({"model": msd, "optimizer": osd})
    info = mgr.store.info(2)
    fresh, fresh_opt = _fsdp(world, 123)  # another init: the restore must overwrite it
    start = ckptfs.CheckpointManager(ckptfs.open(url, incremental=True)).restore_latest(
        model=fresh, optimizer=fresh_opt)
    msd, osd = get_state_dict(fresh, fresh_opt)
    return {"version": info.manifest.format_version,
            "refs": len(getattr(info.manifest, "references", ())), "start": start,
            "saved": saved, "restored": local({"model": msd, "optimizer": osd})}


def test_manager_restores_an_incremental_fsdp2_run(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    for r in run_ranks(job_manager_incremental, 2, url, timeout=240):
        assert r["version"] == 4 and r["refs"] >= 1, r["version"]
        assert r["start"] == 3  # before: a bare RuntimeError (mixed torch.Tensor and DTensor)
        assert_state_equal(r["restored"], r["saved"])


# -- a rank that never calls a sharded save_async -----------------------------------------------


def job_async_absent(rank: int, world: int, url: str, flag: str) -> dict[str, Any] | None:
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh

    from ckptfs.protocol import sharded

    sharded.COLLECTIVE_TIMEOUT = timedelta(seconds=5)
    mesh = init_device_mesh("cpu", (world,))
    store = ckptfs.open(url)
    states = {s: _state(mesh, s) for s in (1, 2, 3)}  # distribute_tensor: collective
    store.save_async(1, states[1]).result(timeout=60)  # both ranks: the group exists
    if rank == 1:  # never calls save_async again; leaves once rank 0 is done
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.2)
        return None
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    fut = store.save_async(2, states[2])
    out["later_save"] = (*outcome(lambda: fut.result(timeout=60)), time.monotonic() - t0)
    other = ckptfs.open(url)  # a new store: its async group is created at its first save
    t0 = time.monotonic()
    out["first_save"] = (*outcome(lambda: other.save_async(3, states[3]).result(60)),
                         time.monotonic() - t0)
    with open(flag, "w") as f:
        f.write("done")
    return out


def test_rank_that_never_calls_save_async_is_named(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    r0, _ = run_ranks(job_async_absent, 2, url, str(tmp_path / "flag"), timeout=240,
                      pg_timeout=120)
    for case in ("later_save", "first_save"):
        name, typed, text, seconds = r0[case]
        assert typed and name == "ShardedSaveError", r0[case]
        assert "rank(s) [1] did not enter this async-save" in text, (case, text)
        assert "rank(s) [0" not in text, text  # never itself
        assert seconds < 60, (case, seconds)
    assert "creating the store's gloo group" in r0["first_save"][2]
    assert ckptfs.open(url).steps() == [1]
