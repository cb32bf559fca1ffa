"""Format v2 on 2 gloo ranks, hostile and unusual input: what the collective paths
must do that one process cannot show.

* values that differ between ranks are stored as one rank's copy (the lowest rank holding the
  value), never mixed key by key;
* a corrupt or newer ``dcp.msgpack``, a symbolic link in the attempt, a target tensor of another
  dtype, keys that collide once dotted: the same typed error on every rank, nothing loaded; so
  a collective ``restore_latest(allow_rollback=True)`` rolls back over a damaged newest step;
* a rank that never calls save: the survivor fails within the collective timeout it was given
  (ckptfs's group being created at the first save included; no fallback to the default group's
  timeout), naming that rank and never itself."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from dist_util import run_ranks
from sharded_tamper import RANK_FILE, attempt_dir, edit_dcp

import ckptfs


def _state(rank: int, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    return {"w": distribute_tensor(w, mesh, [Shard(0)]), "plain": torch.arange(5),
            "trainer": {"step": 100 + rank, "tag": f"rank{rank}", "same": [1, 2],
                        "lr": 0.5 * (rank + 1)}}


def _zeros(mesh: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"w": distribute_tensor(torch.zeros(4, 3, dtype=dtype), mesh, [Shard(0)]),
            "plain": torch.zeros(5, dtype=torch.int64),
            "trainer": {"step": 0, "tag": "", "same": None, "lr": 0.0}}


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except BaseException as exc:  # what every rank sees, whatever it is
        return type(exc).__name__, str(exc)
    return "ok", ""


def job_hostile(rank: int, world: int, url: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    store = ckptfs.open(url)
    state = _state(rank, mesh)
    if rank == 1:
        state["only1"] = {"x": 7}  # a value only rank 1 holds: stored by rank 1
    out: dict[str, Any] = {}
    for step in (1, 2, 3, 4):
        store.save(step, state)
    # A target of another dtype: refused on every rank before anything is read.
    into = _zeros(mesh, torch.bfloat16)
    out["dtype"] = _outcome(lambda: store.load(1, into=into))
    out["dtype_untouched"] = not into["w"].to_local().any() and not into["plain"].any()
    # Keys that collide once dotted, on rank 0 only: the same error on both ranks.
    bad = dict(state, **({"trainer.step": 1} if rank == 0 else {}))
    out["dotted"] = _outcome(lambda: store.save(5, bad))
    # Hostile files, made by rank 0 between barriers.
    root = Path(url)
    if rank == 0:
        attempt = store.info(2).attempt
        edit_dcp(root, 2, attempt, lambda d: d.update(format_version=3))
        attempt = store.info(3).attempt
        path = attempt_dir(root, 3, attempt) / "dcp.msgpack"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
        path = attempt_dir(root, 4, store.info(4).attempt) / RANK_FILE
        moved = root.parent / "moved.safetensors"
        path.rename(moved)
        os.symlink(moved, path)
    dist.barrier()
    for step, name in ((2, "newer"), (3, "flipped"), (4, "link")):
        into = _zeros(mesh)
        out[name] = _outcome(lambda s=step, i=into: store.load(s, into=i))
        out[f"{name}_untouched"] = not into["w"].to_local().any()
    into = _zeros(mesh)
    out["latest"] = _outcome(lambda: store.load(into=into))  # step 4: the link
    store.load(1, into=into)
    out["w1"] = into["w"].full_tensor()
    out["trainer1"] = into["trainer"]
    # The manager's collective restore: the newest step's dcp.msgpack is damaged.
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)),
                        mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    mgr_url = url + "-manager"
    mgr = ckptfs.CheckpointManager(mgr_url, keep_last=5)
    for step in (1, 2):
        mgr.save(step, model=model, optimizer=opt)
    if rank == 0:
        attempt = ckptfs.open(mgr_url).info(2).attempt
        path = attempt_dir(Path(mgr_url), 2, attempt) / "dcp.msgpack"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    dist.barrier()
    out["restore"] = _outcome(lambda: ckptfs.CheckpointManager(mgr_url).restore_latest(
        model=model, optimizer=opt))
    out["restore_rollback"] = ckptfs.CheckpointManager(mgr_url).restore_latest(
        model=model, optimizer=opt, allow_rollback=True)
    return out


def test_hostile_input_on_two_ranks(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    r0, r1 = run_ranks(job_hostile, 2, url, timeout=300)
    for r in (r0, r1):
        name, text = r["dtype"]
        assert name == "LoadOptionError", r["dtype"]
        assert "'w' is stored as torch.float32" in text and "bfloat16" in text
        assert r["dtype_untouched"]
        name, text = r["dotted"]
        assert name == "UnsupportedValueError" and "rank(s) [0]" in text, r["dotted"]
        assert "rename one" in text
        assert r["newer"][0] == "FormatVersionError" and "dcp.msgpack" in r["newer"][1]
        assert r["flipped"][0] == "CorruptCheckpointError" and "dcp.msgpack" in r["flipped"][1]
        assert r["link"][0] == "UnsafeCheckpointError", r["link"]
        assert RANK_FILE in r["link"][1] and "symbolic link" in r["link"][1]
        assert r["latest"][0] == "UnsafeCheckpointError", r["latest"]
        for k in ("newer", "flipped", "link"):
            assert r[f"{k}_untouched"], k
        assert torch.equal(r["w1"], torch.arange(12, dtype=torch.float32).reshape(4, 3))
        # Values every rank holds: rank 0's copy, whole; rank 1's own value: its copy.
        assert r["trainer1"] == {"step": 100, "tag": "rank0", "same": [1, 2], "lr": 0.5}
        # the manager: refused without allow_rollback, step 1 restored with it (returns 1 + 1)
        assert r["restore"][0] == "CorruptCheckpointError" and "dcp.msgpack" in r["restore"][1]
        assert r["restore_rollback"] == 2
    full = ckptfs.open(url).load(1)
    assert full["trainer"] == {"step": 100, "tag": "rank0", "same": [1, 2], "lr": 0.5}
    assert full["only1"] == {"x": 7}
    assert ckptfs.open(url).steps() == [1, 2, 3, 4]


# ----------------------------------------------------------------------------------------------
# A rank that never calls save


def job_absent(rank: int, world: int, url: str, flag: str) -> dict[str, Any] | None:
    from datetime import timedelta

    import torch.distributed as dist

    from ckptfs.protocol import sharded

    sharded.COLLECTIVE_TIMEOUT = timedelta(seconds=5)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=5))
    if rank == 1:  # never calls save; leaves once rank 0 is done
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.2)
        return None
    store = ckptfs.open(url)
    out: dict[str, Any] = {}
    for case, pg in (("first_save", None), ("own_group", group)):
        t0 = time.monotonic()
        out[case] = (*_outcome(lambda p=pg: store.save(1, {"w": torch.ones(2)},
                                                       process_group=p)),
                     time.monotonic() - t0)
    with open(flag, "w") as f:
        f.write("done")
    return out


def test_rank_that_never_saves(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    r0, _ = run_ranks(job_absent, 2, url, str(tmp_path / "flag"), timeout=240, pg_timeout=120)
    print(json.dumps(r0, indent=1))
    for case in ("first_save", "own_group"):
        name, text, seconds = r0[case]
        assert name == "ShardedSaveError", r0[case]
        assert "rank(s) [1] did not enter this save" in text, text
        assert "rank(s) [0" not in text and "[0, 1]" not in text, text  # never itself
        # bounded by the 5 s timeout given, plus a little (not +3 s of liveness wait, and not
        # the default group's timeout, 120 s here)
        assert 4.0 < seconds < 7.5, (case, seconds)
    assert "creating ckptfs's gloo group" in r0["first_save"][1]
    assert ckptfs.open(url).steps() == []
