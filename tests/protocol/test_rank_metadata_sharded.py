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


# -- The default layout ("auto"): per-rank metadata for a large world ---------------------------


def test_auto_picks_per_rank_metadata_for_a_large_world_where_allowed() -> None:
    from ckptfs.format.features import (
        AUTO,
        PER_RANK,
        PER_RANK_MIN_WORLD,
        metadata_layout_for,
    )

    big, small = PER_RANK_MIN_WORLD, PER_RANK_MIN_WORLD - 1
    assert metadata_layout_for(AUTO, big, incremental=False) == PER_RANK
    assert metadata_layout_for(AUTO, small, incremental=False) is None
    assert metadata_layout_for(AUTO, big, incremental=True) is None
    assert metadata_layout_for(None, big, incremental=False) is None
    assert metadata_layout_for(PER_RANK, 2, incremental=False) == PER_RANK
    assert ckptfs.open("memory://auto-layout").metadata_layout == AUTO  # the default


def test_an_unknown_metadata_layout_is_refused_at_open(tmp_path: Any) -> None:
    import pytest

    from ckptfs.errors import UnsupportedValueError

    with pytest.raises(UnsupportedValueError, match="metadata_layout 'by-rank': one of"):
        ckptfs.open(str(tmp_path), metadata_layout="by-rank")


def job_auto(rank: int, world: int, url: str) -> Any:
    """With the threshold lowered to this world: the default store writes format v5, an
    incremental one v4, ``metadata_layout=None`` v2; each loads back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckptfs.format.features as features

    features.PER_RANK_MIN_WORLD = world
    mesh = init_device_mesh("cpu", (world,))
    full = _state()
    state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "b": full["b"],
             "step": full["step"], "opt": full["opt"]}
    out = []
    for root, kw in (("auto", {}), ("incremental", {"incremental": True}),
                     ("one", {"metadata_layout": None})):
        store = ckptfs.open(f"{url}/{root}", **kw)
        info = store.save(1, state)
        into = {"w": distribute_tensor(torch.zeros(8, 5), mesh, [Shard(0)]),
                "b": torch.zeros(7), "step": 0, "opt": {"lr": 0.0}}
        store.load(1, into=into)
        out.append([info.manifest.format_version,
                    bool(torch.equal(into["w"].full_tensor(), full["w"])),
                    into["step"] == full["step"]])
    return out


def test_the_default_store_writes_per_rank_metadata_from_the_threshold(tmp_path: Any) -> None:
    for out in run_ranks(job_auto, 2, str(tmp_path / "run"), timeout=240):
        assert out == [[5, True, True], [4, True, True], [2, True, True]], out
