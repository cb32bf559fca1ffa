"""RNG state per rank: capture/restore without pickle, world-size changes simulated in one
process (local and memory)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_util import run_ranks

import ckptfs
from ckptfs.errors import RngStateError
from ckptfs.format.layout import STATE_NAME, StepPaths
from ckptfs.lifecycle import rng
from ckptfs.testing.backend import Backend


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def draws() -> tuple[float, float, float, float]:
    return (random.random(), float(np.random.rand()), float(torch.rand(1)),
            random.gauss(0, 1))


def rank_state(r: int) -> dict[str, object]:
    rng.seed_all(1000 + r)
    random.gauss(0, 1)  # leaves a cached gauss_next: it must survive too
    return rng.capture()


def save_ranks(backend: Backend, world: int, ranks: list[int] | None = None) -> dict[int, dict]:
    states = {r: rank_state(r) for r in (ranks if ranks is not None else range(world))}
    mgr = ckptfs.CheckpointManager(backend.open(), world_size=world,
                                   rng_gather=lambda _mine: states)
    mgr.save(10)
    return states


def restore_as(backend: Backend, rank: int, world: int, **kw: object) -> rng.RestoreOutcome:
    mgr = ckptfs.CheckpointManager(backend.open(), rank=rank, world_size=world, run_seed=5,
                                   **kw)  # type: ignore[arg-type]
    mgr.restore_latest()
    assert mgr.last_rng_outcome is not None
    return mgr.last_rng_outcome


def test_capture_restore_every_generator() -> None:
    rng.seed_all(3)
    random.gauss(0, 1)
    st = rng.capture()
    assert st["torch"].dtype == torch.uint8 and isinstance(st["python"]["internal"], list)
    assert isinstance(st["numpy"]["key"], list) and len(st["numpy"]["key"]) == 624
    expected = draws()
    rng.seed_all(4)
    rng.restore(st)
    assert draws() == expected


def test_stored_without_pickle(backend: Backend) -> None:
    save_ranks(backend, 1)
    store = backend.open()
    info = store.info(10)
    raw = backend.raw_read(f"{StepPaths(10).attempt_dir(info.attempt)}/{STATE_NAME}")
    assert b"\x80\x04" not in raw[:2] and b"pickle" not in raw
    state = store.load(10)
    entry = state["rng"]
    assert entry["world_size"] == 1
    assert entry["ranks"][0]["torch"].dtype == torch.uint8
    assert all(isinstance(x, int) for x in entry["ranks"][0]["python"]["internal"])


def test_same_world_size_every_rank_restored(backend: Backend) -> None:
    states = save_ranks(backend, 3)
    for r in range(3):
        out = restore_as(backend, r, 3)
        assert out.action == "restored"
        mine = rng.capture()
        assert torch.equal(mine["torch"], states[r]["torch"])
        assert mine["python"] == states[r]["python"] and mine["numpy"] == states[r]["numpy"]


def test_more_ranks_reseeded_deterministically(backend: Backend,
                                               caplog: pytest.LogCaptureFixture) -> None:
    states = save_ranks(backend, 2)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        out0 = restore_as(backend, 0, 4, per_rank_batch_size=8)
    assert out0.action == "restored"
    assert torch.equal(rng.capture()["torch"], states[0]["torch"])
    assert "world size changed 2 -> 4" in caplog.text
    assert "from 16 to 32" in caplog.text
    seen = []
    for r in (2, 3):
        out = restore_as(backend, r, 4)
        # the run seed comes from the checkpoint (0), not the new manager's argument (5)
        assert out.action == "reseeded-new-rank" and out.seed == rng.rank_seed(0, r)
        first = draws()
        restore_as(backend, r, 4)
        assert draws() == first  # deterministic
        seen.append(first)
    assert seen[0] != seen[1]  # decorrelated


def test_fewer_ranks_ignore_extra_states(backend: Backend,
                                         caplog: pytest.LogCaptureFixture) -> None:
    save_ranks(backend, 4)
    with caplog.at_level(logging.INFO, logger="ckptfs"):
        out = restore_as(backend, 1, 2)
    assert out.action == "restored" and out.ignored_ranks == [2, 3]
    assert "rank(s) 2, 3 are ignored" in caplog.text


def test_missing_ranks_reported_by_number(backend: Backend,
                                          caplog: pytest.LogCaptureFixture) -> None:
    save_ranks(backend, 4, ranks=[0, 2])
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        out = restore_as(backend, 1, 4)
    assert out.missing_ranks == [1, 3] and out.action == "reseeded-missing"
    assert "missing the RNG state of rank(s) 1, 3" in caplog.text
    strict = ckptfs.CheckpointManager(backend.open(), rank=3, world_size=4)
    with pytest.raises(RngStateError, match="rank 3"):
        strict.restore_latest(strict_rng=True)


def test_rank_seeds_are_distinct_and_stable() -> None:
    seeds = [rng.rank_seed(42, r) for r in range(10_000)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    assert rng.rank_seed(42, 7) == rng.rank_seed(42, 7) != rng.rank_seed(43, 7)
    # consecutive ranks differ in about half their bits (decorrelated, not r + seed)
    diff = sum(bin(seeds[i] ^ seeds[i + 1]).count("1") for i in range(1000)) / 1000
    assert 25 < diff < 38


def test_malformed_state_is_typed() -> None:
    with pytest.raises(RngStateError):
        rng.restore({"python": {"version": 3}, "torch": torch.zeros(3)})


def test_cuda_states_per_device_logic(monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """The CUDA branch, with torch.cuda replaced by a fake of 2 devices (this machine has no
    GPU): one uint8 state per device is captured, and restored to the device of its index."""
    devices = {0: torch.full((16,), 1, dtype=torch.uint8),
               1: torch.full((16,), 2, dtype=torch.uint8)}
    restored: dict[int, torch.Tensor] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(devices.values()))
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda t, i: restored.__setitem__(int(i), t.clone()))
    st = rng.capture()
    assert [t.tolist()[0] for t in st["cuda"]] == [1, 2]
    rng.restore(st)
    assert sorted(restored) == [0, 1] and restored[1].tolist()[0] == 2
    restored.clear()
    del devices[1]
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        rng.restore(st)
    assert sorted(restored) == [0] and "CUDA RNG states for 2 devices" in caplog.text


# ----------------------------------------------------------------------------------------------
# The gather of every rank's state (the transformers and accelerate integrations): JSON through
# the group, on ckptfs's gloo group


def test_a_state_crosses_ranks_as_a_json_document() -> None:
    st = rank_state(2)
    st["cuda"] = [torch.full((16,), 7, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
    data = rng.encode_rng(st)
    assert json.loads(data)["torch"].keys() == {"__u8__"}  # JSON, the tensor as base64
    back = rng.decode_rng(data)
    assert back["python"] == st["python"] and back["numpy"] == st["numpy"]
    for a, b in zip([back["torch"], *back["cuda"]], [st["torch"], *st["cuda"]], strict=True):
        assert a.dtype == torch.uint8 and torch.equal(a, b)
    with pytest.raises(RngStateError, match="not a mapping"):
        rng.decode_rng(b"[1]")


def job_gather(rank: int, world: int) -> dict[str, Any]:
    mine = rank_state(rank)
    return {"mine": mine, "gathered": rng.dist_gather(mine, world)}


@pytest.mark.sharded
def test_dist_gather_over_two_gloo_ranks_stores_the_same_bytes(tmp_path: Path) -> None:
    """Every rank gets every rank's state, as it was captured; a checkpoint of the gathered
    states is byte for byte the one of the states themselves."""
    got = run_ranks(job_gather, 2, timeout=180)
    mine = {r: g["mine"] for r, g in enumerate(got)}
    store = ckptfs.open(str(tmp_path / "run"))
    store.save(1, {"rng": rng.pack_ranks(mine, 2)})
    for step, g in enumerate(got, start=2):
        assert sorted(g["gathered"]) == [0, 1]
        for r, state in g["gathered"].items():
            assert state["python"] == mine[r]["python"] and state["numpy"] == mine[r]["numpy"]
            assert state["torch"].dtype == torch.uint8
            assert torch.equal(state["torch"], mine[r]["torch"])
        store.save(step, {"rng": rng.pack_ranks(g["gathered"], 2)})

    def files(step: int) -> list[tuple[str, str]]:
        return [(f.path, f.digest) for f in store.info(step).manifest.files]

    assert files(1) == files(2) == files(3)
