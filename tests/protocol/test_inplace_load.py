"""The in-place sharded load: ``store.load(into=state)`` of an FSDP-style
state on 2 gloo ranks reads each of its shards once, on the reading threads, into a buffer
each thread reuses, and copies it into the target once verified (the caller's tensors never
see unverified bytes: tests/protocol/test_sharded_perf.py).

* loaded into the sharding it was saved from: every shard chunk placed into its target by
  the reading threads, nothing exchanged between the ranks (the few replicated values are
  read by each rank: sharing them would cost more than it spares), bit-exact, twice in a
  row;
* the same process then loads into a state resharded differently (rows -> columns): the
  copying path, bit-exact, and back into the first layout, bit-exact;
* a shard corrupted on storage: `CorruptCheckpointError` naming the file on every rank;
* `plan_reads(negligible=)` (pure): reads alone only when sharing spares few bytes and a small
  part of the load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks, save_sharded
from sharded_tamper import RANK_FILE, attempt_dir

import ckptfs
from ckptfs.protocol.balance import plan_reads
from ckptfs.protocol.sharded import load_into
from ckptfs.protocol.sharded_read import ShardedReader

pytestmark = pytest.mark.sharded

STEP = 5


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(256, 128, generator=g), "b": torch.randn(256, generator=g),
            "i": torch.arange(512, dtype=torch.int64).reshape(128, 4)}


def _state(placements: list[Any], zero: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {
        k: distribute_tensor(torch.zeros_like(v) if zero else v, mesh,
                             placements if v.dim() > 1 else [Shard(0)])
        for k, v in _full().items()}
    # A replicated plain tensor and values, as an optimizer's step and a trainer dict.
    out["step"] = torch.zeros(()) if zero else torch.tensor(7.0)
    out["trainer"] = {"step": 0 if zero else STEP}
    return out


class Recording(ShardedReader):
    """Records the chunks `_direct` placed straight into their targets."""

    placed = 0

    def _direct(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._direct(*args, **kwargs)
        type(self).placed += len(out)
        return out


def _exact(into: dict[str, Any]) -> bool:
    return (all(torch.equal(into[k].full_tensor(), v) for k, v in _full().items())
            and float(into["step"]) == 7.0 and into["trainer"] == {"step": STEP})


def job_save_load(rank: int, world: int, url: str) -> dict[str, Any]:
    from torch.distributed.tensor import Shard

    storage = ckptfs.open(url).storage
    save_sharded(storage, STEP, _state([Shard(0)], zero=False))
    out: dict[str, Any] = {"rows": [], "placed": []}
    rows = _state([Shard(0)], zero=True)
    for _ in range(2):  # the same target twice
        for v in rows.values():
            if isinstance(v, torch.Tensor):
                (v.to_local() if hasattr(v, "to_local") else v).zero_()
        Recording.placed = 0
        reader = Recording(storage, STEP)
        load_into(storage, STEP, rows, reader=reader)
        out["rows"].append(_exact(rows))
        out["placed"].append(Recording.placed)
        out["received"] = reader.bytes_received
    cols = _state([Shard(1)], zero=True)  # resharded: columns of "w" and "i"
    load_into(storage, STEP, cols)
    out["cols"] = _exact(cols)
    again = _state([Shard(0)], zero=True)
    load_into(storage, STEP, again)
    out["again"] = _exact(again)
    return out


def test_in_place_load_reads_into_the_targets_bit_exact(tmp_path: Path) -> None:
    results = run_ranks(job_save_load, 2, str(tmp_path), timeout=240)
    for r in results:
        assert r["rows"] == [True, True] and r["cols"] and r["again"], r
        # the three sharded tensors' chunks (and the replicated step on the rank saving it)
        assert all(p >= 3 for p in r["placed"]), r
        assert r["received"] == 0, r  # the replicated values: read by each rank


def job_load_rows(rank: int, world: int, url: str) -> tuple[str, str]:
    from torch.distributed.tensor import Shard

    try:
        load_into(ckptfs.open(url).storage, STEP, _state([Shard(0)], zero=True))
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def job_save(rank: int, world: int, url: str) -> None:
    from torch.distributed.tensor import Shard

    save_sharded(ckptfs.open(url).storage, STEP, _state([Shard(0)], zero=False))


def test_a_corrupt_shard_read_in_place_fails_every_rank(tmp_path: Path) -> None:
    url = str(tmp_path)
    run_ranks(job_save, 2, url, timeout=240)
    info = ckptfs.open(url).latest()
    assert info is not None
    adir = attempt_dir(tmp_path, STEP, info.attempt)
    manifest = json.loads((adir / "MANIFEST.json").read_text())
    entry = next(f for f in manifest["files"] if f["path"] == RANK_FILE)
    offset = entry["chunks"][-1][0]
    path = adir / RANK_FILE
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    outcomes = run_ranks(job_load_rows, 2, url, timeout=240)
    for name, message in outcomes:
        assert name == "CorruptCheckpointError", message  # on every rank
        assert RANK_FILE in message and "differ from their digest" in message


def test_plan_reads_negligible_sharing_reads_alone() -> None:
    big0 = [("r0", 0, 64), ("r0", 64, 10_000)]
    big1 = [("r1", 0, 64), ("r1", 64, 10_000)]
    tiny = [("r0", 10_064, 4)]  # a replicated scalar both ranks need
    needs = [big0 + tiny, big1 + tiny]
    assert plan_reads(needs, max_piece=1 << 20, round_bytes=1 << 20) is not None
    assert plan_reads(needs, max_piece=1 << 20, round_bytes=1 << 20, negligible=1024) is None
    # sharing spares more than `negligible`: kept
    assert plan_reads(needs, max_piece=1 << 20, round_bytes=1 << 20, negligible=2) is not None
    # everything replicated: sharing spares half the load, kept however small
    same = [big0, big0]
    assert plan_reads(same, max_piece=1 << 20, round_bytes=1 << 20,
                      negligible=1 << 30) is not None
