"""Format v5 (per-rank metadata) on gloo ranks: a 2-rank save, then 2 -> 1 (a full load) and
2 -> 4 (each rank loads its Shard(0) of 4), bit-exact; each loading rank reads only the index
documents of the ranks holding its rows; a small replicated tensor is stored by rank 0."""

from __future__ import annotations

import json
from typing import Any

import torch
from dist_util import run_ranks

import ckptfs


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(8, 5, generator=g), "b": torch.randn(7, generator=g),
            "step": 11, "opt": {"lr": 0.5}}


def job_save(rank: int, world: int, url: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _state()
    state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "b": full["b"],
             "step": full["step"], "opt": full["opt"]}
    info = ckptfs.open(url, metadata_layout="per-rank").save(1, state)
    return [info.step, info.attempt, info.manifest.format_version]


def job_load(rank: int, world: int, url: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    into = {"w": distribute_tensor(torch.zeros(8, 5), mesh, [Shard(0)]), "b": torch.zeros(7),
            "step": 0, "opt": {"lr": 0.0}}
    ckptfs.open(url).load(1, into=into)
    full = _state()
    lo = rank * 2
    return [bool(torch.equal(into["w"].to_local(), full["w"][lo:lo + 2])),
            bool(torch.equal(into["b"], full["b"])), into["step"], into["opt"]["lr"]]


def test_two_rank_save_reshards_bit_exact(tmp_path: Any) -> None:
    url = str(tmp_path / "run")
    saved = run_ranks(job_save, 2, url, timeout=240)
    assert saved[0] == saved[1] and saved[0][2] == 5
    store = ckptfs.open(url)
    full = store.load(1)  # 2 -> 1
    want = _state()
    assert torch.equal(full["w"], want["w"]) and torch.equal(full["b"], want["b"])
    assert full["step"] == 11 and full["opt"] == {"lr": 0.5}
    assert store.verify(1).ok
    from ckptfs.protocol.rank_metadata import read_spec

    spec = read_spec(store.storage, store.info(1))
    assert spec.tensors["b"].owners == (0, 0)  # a small replicated tensor: stored by rank 0
    assert spec.tensors["w"].owners == (0, 1) and spec.tensors["w"].grid == (4, 5)
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step-000000000001" / saved[0][1]
                           / "MANIFEST.json").read_text())
    assert {f["path"] for f in manifest["files"]} == {"dcp-spec.msgpack",
                                                      "rank-table/block-00000.bin"}
    for ok_w, ok_b, step, lr in run_ranks(job_load, 4, url, timeout=300):  # 2 -> 4
        assert ok_w and ok_b and step == 11 and lr == 0.5
