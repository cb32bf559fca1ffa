"""A checkpoint of the files layout (format v1, and v3 of an incremental store) loads into any
world size and placement through the one ``load(into=)`` entry: DTensors sharded on 1, 2 and 4
gloo ranks, a replicated DTensor, plain tensors, without a process group; bit for bit, values
included; a refusal (another dtype or shape, a name the checkpoint lacks) touches nothing and is
the same on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks

import ckptfs


def _full() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {"model": {"w": torch.randn(10, 6, generator=g), "b": torch.randn(7, generator=g),
                      "emb": torch.randn(9, 4, generator=g).to(torch.bfloat16)},
            "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "lr": 0.25},
            "trainer": {"step": 12, "names": ["a", "b"]}}


def _save(url: str, incremental: bool) -> None:
    store = ckptfs.open(url, incremental=incremental)
    store.save(1, _full())
    full = _full()
    full["model"]["b"] = full["model"]["b"] + 1  # step 2 of a v3 store references step 1
    full["trainer"]["step"] = 13
    store.save(2, full)


def _want(step: int) -> dict[str, Any]:
    full = _full()
    if step == 2:
        full["model"]["b"] = full["model"]["b"] + 1
        full["trainer"]["step"] = 13
    return full


def _targets(mesh: Any, placements: list[Any]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    full = _full()
    return {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, placements)
                      for k, v in full["model"].items()},
            "opt": {"state": {0: {"step": torch.tensor(0.0)}}, "lr": 0.0},
            "trainer": {"step": 0, "names": None}}


def job_into(rank: int, world: int, url: str, step: int | None, replicate: bool
             ) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    into = _targets(mesh, [Replicate() if replicate else Shard(0)])
    got = ckptfs.open(url).load(step, into=into)
    want = _want(2 if step is None else step)
    exact = got is into and all(
        torch.equal(into["model"][k].full_tensor(), v) for k, v in want["model"].items())
    shards_local = all(into["model"][k].to_local().shape[0] <= v.shape[0]
                       for k, v in want["model"].items())
    # A refusal: another dtype on one tensor; nothing is touched, on every rank.
    bad = _targets(mesh, [Shard(0)])
    from torch.distributed.tensor import distribute_tensor

    bad["model"]["w"] = distribute_tensor(torch.zeros(10, 6, dtype=torch.float64), mesh,
                                          [Shard(0)])
    try:
        ckptfs.open(url).load(1, into=bad)
        refused = ("ok", "")
    except Exception as exc:
        refused = (type(exc).__name__, str(exc))
    untouched = not any(bool(t.to_local().any()) for t in bad["model"].values())
    return {"exact": exact, "local": shards_local,
            "opt": [into["opt"]["state"][0]["step"].item(), into["opt"]["lr"]],
            "trainer": into["trainer"], "refused": refused, "untouched": untouched}


@pytest.mark.sharded
@pytest.mark.parametrize("world, incremental, replicate", [
    (1, False, False), (2, False, False), (2, True, True), (4, False, False)],
    ids=["v1-1-rank", "v1-2-ranks", "v3-2-ranks-replicated", "v1-4-ranks"])
def test_a_files_checkpoint_loads_into_dtensors(tmp_path: Path, world: int, incremental: bool,
                                                replicate: bool) -> None:
    url = str(tmp_path / "run")
    _save(url, incremental)
    info = ckptfs.open(url).info(2)
    assert info.manifest.format_version == (3 if incremental else 1)
    for step in (1, None):
        results = run_ranks(job_into, world, url, step, replicate, timeout=240)
        want = _want(2 if step is None else step)
        for r in results:
            assert r["exact"] and r["local"], r
            assert r["opt"] == [3.0, 0.25] and r["trainer"] == want["trainer"], r
            name, text = r["refused"]
            assert name == "UnsupportedValueError" or "dtype" in text, r["refused"]
            assert "model.w" in text and r["untouched"], r


def test_a_files_checkpoint_loads_into_plain_tensors_without_a_group(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _save(url, False)
    into = {"model": {k: torch.zeros_like(v) for k, v in _full()["model"].items()},
            "opt": {"state": {0: {"step": torch.tensor(0.0)}}, "lr": 0.0},
            "trainer": {"step": 0, "names": None}}
    ids = {k: id(v) for k, v in into["model"].items()}
    ckptfs.open(url).load(1, into=into)
    for k, v in _full()["model"].items():
        assert torch.equal(into["model"][k], v) and id(into["model"][k]) == ids[k]
    assert into["trainer"] == {"step": 12, "names": ["a", "b"]} and into["opt"]["lr"] == 0.25
    missing = {"model": {"nope": torch.zeros(2)}}
    with pytest.raises(KeyError, match=r"holds no 'model\.nope'"):
        ckptfs.open(url).load(1, into=missing)
    wrong = {"model": {"w": torch.zeros(5, 6)}}
    with pytest.raises(KeyError, match="shape"):
        ckptfs.open(url).load(1, into=wrong)
    assert not wrong["model"]["w"].any()
