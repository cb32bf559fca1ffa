"""Cooperative load on gloo ranks: a chunk several ranks need (data-parallel replicas, HSDP's
replicate dimension, a resharded load splitting one stored chunk) is read from storage by one of
them and sent to the others, each of which checks its digest again before using it.

* 2 replicas x 2 shards and 4 replicas x 1: the bytes read from storage, summed over every
  rank, stay within 1.05x the checkpoint's data files (today's reader: once per replica), and
  every rank gets the saved values bit for bit;
* a chunk corrupted on storage: every rank raises `CorruptCheckpointError` naming the file,
  no hang (the cooperation stops on every rank, and each rank needing the chunk reads it
  itself); a peer that sends bytes other than the stored ones is caught by each receiver's own
  check, named, and the chunk read from storage instead; a peer that hangs in an exchange is
  named by the survivor within the collective timeout;
* resharded loads 2 -> 1 and 2 -> 4 stay bit-exact;
* `plan_reads` (pure): each shared chunk read once, by a rank needing it, balanced by bytes.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks, save_sharded
from sharded_tamper import RANK_FILE, attempt_dir

import ckptfs
from ckptfs.errors import CorruptCheckpointError
from ckptfs.protocol.balance import balance_writers, plan_reads, split_writers
from ckptfs.protocol.sharded import load_into
from ckptfs.protocol.sharded_read import ShardedReader

STEP = 3


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "u": torch.randn(48, 16, generator=g),
            "i": torch.arange(256, dtype=torch.int64)}


def _save(rank: int, world: int, url: str) -> None:
    """Step `STEP` saved by a world of ``world`` ranks, tensors sharded by rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {k: distribute_tensor(v, mesh, [Shard(0)])
                             for k, v in _full().items()}
    state["trainer"] = {"step": STEP, "names": ["a", "b"]}
    save_sharded(ckptfs.open(url).storage, STEP, state)


def job_save(rank: int, world: int, url: str) -> None:
    _save(rank, world, url)


def _targets(mesh: Any, placements: list[Any]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    out: dict[str, Any] = {k: distribute_tensor(torch.zeros_like(v), mesh, placements)
                           for k, v in _full().items()}
    out["trainer"] = {"step": 0, "names": None}
    return out


def _load(url: str, into: dict[str, Any], reader: ShardedReader | None = None
          ) -> dict[str, Any]:
    store = ckptfs.open(url)
    reader = reader or ShardedReader(store.storage, STEP)
    load_into(store.storage, STEP, into, reader=reader)
    exact = all(torch.equal(into[k].full_tensor(), v) for k, v in _full().items())
    return {"exact": exact and into["trainer"] == {"step": STEP, "names": ["a", "b"]},
            "read": reader.bytes_read, "received": reader.bytes_received}


def job_load(rank: int, world: int, url: str, shape: list[int], cooperate: bool
             ) -> dict[str, Any]:
    """Load into a mesh of ``shape`` (replicate, shard) or (shard,): the last dimension
    shards rows, the others replicate."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", tuple(shape))
    placements = [Replicate()] * (len(shape) - 1) + [Shard(0)]
    if shape[-1] == 1:
        placements[-1] = Replicate()
    reader = ShardedReader(ckptfs.open(url).storage, STEP)
    reader.cooperative = cooperate
    return _load(url, _targets(mesh, placements), reader)


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # what every rank sees
        return type(exc).__name__, str(exc)
    return "ok", ""


def job_corrupt(rank: int, world: int, url: str) -> tuple[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (world,))
    return _outcome(lambda: _load(url, _targets(mesh, [Replicate()])))


class LyingReader(ShardedReader):
    """A faulty peer: what it reads (and verifies) is altered before it is used or sent."""

    def _fetch(self, *args: Any, **kwargs: Any) -> Iterator[list[tuple[Any, memoryview]]]:
        for views in super()._fetch(*args, **kwargs):
            out = []
            for key, view in views:
                data = bytearray(view)
                if key[1] > 0 and data:  # an item, not a header
                    data[-1] ^= 0xFF
                out.append((key, memoryview(data)))
            yield out


def job_liar(rank: int, world: int, url: str) -> dict[str, Any]:
    import logging

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (world,))
    storage = ckptfs.open(url).storage
    reader = (LyingReader if rank == 1 else ShardedReader)(storage, STEP)
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("ckptfs").addHandler(Keep(logging.WARNING))
    got: dict[str, Any] = {}

    def load() -> None:
        got.update(_load(url, _targets(mesh, [Replicate()]), reader))

    outcome = _outcome(load)
    return {"outcome": outcome, "exact": got.get("exact"), "log": messages,
            "refused": [src for _, src in reader.refused_from_peers]}


def _data_bytes(root: Path) -> int:
    """Bytes of the checkpoint's rank files (``dcp.msgpack``, read by every rank, aside)."""
    store = ckptfs.open(str(root))
    info = store.latest()
    assert info is not None
    manifest = json.loads((attempt_dir(root, STEP, info.attempt) / "MANIFEST.json").read_text())
    return sum(f["size"] for f in manifest["files"] if f["path"].startswith("rank-"))


TENSOR_BYTES = sum(v.numel() * v.element_size() for v in _full().values())


@pytest.mark.parametrize("shape", [[2, 2], [4, 1]], ids=["2x2", "4x1"])
def test_each_byte_read_once_per_replica_group(tmp_path: Path, shape: list[int]) -> None:
    url = str(tmp_path)
    run_ranks(job_save, 2, url, timeout=240)
    size = _data_bytes(tmp_path)
    coop = run_ranks(job_load, 4, url, shape, True, timeout=240)
    alone = run_ranks(job_load, 4, url, shape, False, timeout=240)
    assert all(r["exact"] for r in coop + alone)
    read, sent = sum(r["read"] for r in coop), sum(r["received"] for r in coop)
    print(f"\n{shape}: checkpoint {size} B ({TENSOR_BYTES} B of tensors); read from storage "
          f"{read} B cooperatively ({[r['read'] for r in coop]} per rank, {sent} B received), "
          f"{sum(r['read'] for r in alone)} B alone")
    assert read <= 1.05 * size
    assert read <= 1.05 * TENSOR_BYTES + 4096  # the rank files' headers aside
    assert sum(r["read"] for r in alone) >= 4 // shape[-1] * 0.9 * size
    # balanced: every rank reads a share
    assert min(r["read"] for r in coop) > 0


def test_corrupt_chunk_is_the_same_typed_error_on_every_rank(tmp_path: Path) -> None:
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
    outcomes = run_ranks(job_corrupt, 4, url, timeout=240)
    for name, message in outcomes:
        assert name == "CorruptCheckpointError", message
        assert RANK_FILE in message and "differ from their digest" in message


def test_a_lying_peer_is_caught_by_every_receiver(tmp_path: Path) -> None:
    """Bytes a peer altered after reading them are refused by each receiver's own check,
    logged naming that peer (not as a file corrupted on storage, which it is not), and read
    from storage instead: the receivers' loads are bit-exact."""
    url = str(tmp_path)
    run_ranks(job_save, 2, url, timeout=240)
    outcomes = run_ranks(job_liar, 3, url, timeout=240)
    for rank in (0, 2):
        out = outcomes[rank]
        assert out["outcome"] == ("ok", "") and out["exact"], out
        assert out["refused"] and all(src == 1 for src in out["refused"]), out
        assert any("sent by rank 1" in m and "not at fault" in m for m in out["log"]), out
        assert not any("modified or corrupted after commit" in m for m in out["log"]), out


class HangingReader(ShardedReader):
    """A peer that hangs in its first shared round (until the flag file exists)."""

    flag = ""

    def _fetch(self, *args: Any, **kwargs: Any) -> Iterator[list[tuple[Any, memoryview]]]:
        if self._marks >= 1:  # inside the rounds: after the needs were exchanged
            deadline = time.monotonic() + 120
            while not os.path.exists(self.flag) and time.monotonic() < deadline:
                time.sleep(0.1)
            raise RuntimeError("the hanging rank gives up")
        yield from super()._fetch(*args, **kwargs)


def job_hang(rank: int, world: int, url: str, flag: str) -> tuple[str, str, float]:
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    from ckptfs.protocol import sharded

    sharded.COLLECTIVE_TIMEOUT = timedelta(seconds=5)
    mesh = init_device_mesh("cpu", (world,))
    storage = ckptfs.open(url).storage
    reader = (HangingReader if rank == 1 else ShardedReader)(storage, STEP)
    reader.flag = flag  # type: ignore[attr-defined]
    t0 = time.monotonic()
    out = _outcome(lambda: _load(url, _targets(mesh, [Replicate()]), reader))
    if rank == 0:
        with open(flag, "w") as f:
            f.write("done")
    return (*out, time.monotonic() - t0)


def test_a_peer_that_hangs_in_a_cooperative_load_is_named(tmp_path: Path) -> None:
    """A cooperative load whose peer hangs in an exchange fails within the collective timeout
    on the survivor, naming the rank that did not reach the exchange (it said "rank(s)
    unknown": the survivor had not finished its own part)."""
    url = str(tmp_path / "run")
    run_ranks(job_save, 2, url, timeout=240)
    r0, _ = run_ranks(job_hang, 2, url, str(tmp_path / "flag"), timeout=240, pg_timeout=120)
    name, text, seconds = r0
    assert name == "ShardedLoadError", r0
    assert "rank(s) [1] did not reach exchange" in text, text
    assert "unknown" not in text and "[0" not in text, text
    assert seconds < 30, seconds


def job_resharded(rank: int, world: int, url: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    return _load(url, _targets(mesh, [Shard(0)]))


@pytest.mark.parametrize("world", [1, 4])
def test_resharded_loads_are_bit_exact(tmp_path: Path, world: int) -> None:
    url = str(tmp_path)
    run_ranks(job_save, 2, url, timeout=240)
    out = run_ranks(job_resharded, world, url, timeout=240)
    assert all(r["exact"] for r in out)
    if world == 4:  # each stored chunk (a row block of 2 ranks') is split between 2 readers
        assert sum(r["read"] for r in out) <= 1.05 * _data_bytes(tmp_path)
        assert sum(r["received"] for r in out) > 0


# -- plan_reads ------------------------------------------------------------------------------


def test_plan_reads_nothing_shared() -> None:
    assert plan_reads([[("a", 0, 8), ("a", 8, 4)], [("b", 0, 8)]], max_piece=100,
                      round_bytes=100) is None


def test_plan_reads_each_chunk_once_balanced() -> None:
    keys = [("f", 0, 10)] + [("f", 10 + 100 * i, 100) for i in range(8)]
    plan = plan_reads([keys, keys, keys, keys], max_piece=1 << 20, round_bytes=1 << 20)
    assert plan is not None
    read = [t.key for r in plan.rounds for t in r]
    assert sorted(read) == sorted(keys)  # each once
    assert plan.rounds[0] and all(t.key[1] == 0 for t in plan.rounds[0])  # headers first
    assert all(t.needers == (0, 1, 2, 3) and t.reader in t.needers
               for r in plan.rounds for t in r)
    assert sorted(plan.loads) == [200, 200, 200, 210]
    assert plan.alone == [[], [], [], []]


def test_plan_reads_rounds_bounded() -> None:
    keys = [("f", 100 * i + 1, 100) for i in range(10)]
    plan = plan_reads([keys, keys], max_piece=100, round_bytes=300)
    assert plan is not None
    assert len(plan.rounds) >= 3
    for r in plan.rounds:
        traffic = sum(t.key[2] for t in r)
        assert traffic <= 300


def test_plan_reads_alone_and_shared() -> None:
    plan = plan_reads([[("a", 0, 5), ("a", 5, 50), ("s", 5, 40)], [("s", 5, 40)]],
                      max_piece=100, round_bytes=100)
    assert plan is not None
    assert plan.alone == [[("a", 5, 50)], []]
    assert plan.loads == [55, 40]  # rank 1 reads the shared chunk: rank 0 has its own


# -- balance_writers (replica-parallel save: who writes a replicated item) ---------------------


def test_balance_writers_largest_first_least_loaded_holder() -> None:
    items = [(10, [0, 1]), (40, [0, 1]), (30, [0, 1]), (20, [0, 1])]
    writers = balance_writers(items, 2)
    loads = [sum(s for (s, _), w in zip(items, writers, strict=True) if w == r) for r in (0, 1)]
    assert loads == [50, 50] and writers == [0, 0, 1, 1]
    assert balance_writers([(5, [1])], 2) == [1]  # only a holder writes
    assert balance_writers([(5, [0, 1])], 2, fixed=[9, 0]) == [1]
    with pytest.raises(ValueError):
        balance_writers([(5, [])], 2)


def test_balance_writers_hsdp_within_five_percent() -> None:
    """4 replicas x 2 shards of 32 row-sharded tensors of assorted sizes: every rank writes
    within 5% of the mean (DCP's dedup, assigning in item order, does not promise it)."""
    world, shards = 8, 2
    items = []
    for i in range(32):
        size = 1000 * (1 + i % 7) * (1 + i % 3)
        for s in range(shards):
            items.append((size, [r for r in range(world) if r % shards == s]))
    writers = balance_writers(items, world)
    loads = [0] * world
    for (size, holders), w in zip(items, writers, strict=True):
        assert w in holders
        loads[w] += size
    mean = sum(loads) / world
    assert max(loads) <= 1.05 * mean and min(loads) >= 0.95 * mean


def job_dcp_load(rank: int, world: int, url: str, cooperate: bool) -> dict[str, Any]:
    """A plain ``dcp.load`` through ``ckptfs.dcp.Reader`` on 4 replicas, with a gloo group
    given to the reader (``cooperate``) or not."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    import ckptfs.dcp

    mesh = init_device_mesh("cpu", (world,))
    into = _targets(mesh, [Replicate()])
    group = dist.new_group(backend="gloo") if cooperate else None
    reader = ckptfs.dcp.Reader(url, STEP, process_group=group)
    dcp.load(into, storage_reader=reader, planner=ckptfs.dcp.LoadPlanner())
    exact = all(torch.equal(into[k].full_tensor(), v) for k, v in _full().items())
    return {"exact": exact and into["trainer"]["step"] == STEP, "read": reader.bytes_read}


def test_a_plain_dcp_load_cooperates_given_a_group(tmp_path: Path) -> None:
    url = str(tmp_path)
    run_ranks(job_save, 2, url, timeout=240)
    size = _data_bytes(tmp_path)
    coop = run_ranks(job_dcp_load, 4, url, True, timeout=240)
    alone = run_ranks(job_dcp_load, 4, url, False, timeout=240)
    assert all(r["exact"] for r in coop + alone)
    assert sum(r["read"] for r in coop) <= 1.05 * size
    assert sum(r["read"] for r in alone) >= 4 * 0.9 * size


# -- split_writers (replica-parallel save: a replicated item larger than a share, split) ------


def test_split_writers_splits_only_what_is_larger_than_a_share() -> None:
    mib = 1 << 20
    # 4 holders, one 96 MiB item and a few small: split along its rows between the least
    # loaded holders, in row order, pieces of about half a share (but at least min_piece).
    items = [(96 * mib, [0, 1, 2, 3], 96), (2 * mib, [0, 1, 2, 3], 4), (mib, [0, 1], 1)]
    out = split_writers(items, 4, min_piece=8 * mib)
    big = out[0]
    assert len(big) == 4 and [p[1] for p in big] == [0, 24, 48, 72]
    assert sorted(p[0] for p in big) == [0, 1, 2, 3] and sum(p[2] for p in big) == 96
    assert len(out[1]) == 1 and len(out[2]) == 1  # smaller than a share, or one row
    # Nothing split under two pieces of min_piece, nor with one holder or one row.
    assert len(split_writers([(15 * mib, [0, 1], 64)], 2, min_piece=8 * mib)[0]) == 1
    assert split_writers([(96 * mib, [2], 96)], 4) == [[(2, 0, 96)]]
    assert split_writers([(96 * mib, [0, 1], 1)], 4) == [[(0, 0, 1)]]
    # balance_writers is its case of items written whole.
    assert balance_writers([(96 * mib, [0, 1])], 2) == [0]


def test_hsdp_over_32_replicas_writes_within_five_percent() -> None:
    """The scale benchmark's HSDP plans of a 70B slice at 256 ranks (32 replicas of 8
    shards): one embedding shard alone is 3.8 times a rank's share; split between its holders,
    every rank writes within 5% of the mean (written whole: 3.79x), and the split plan is
    still DCP's construction (pieces tile every tensor once: the planner's own check)."""
    from ckptfs.bench.scale import Spec, local_plans
    from ckptfs.protocol.sharded_plan import SavePlanner

    plans = local_plans(Spec(mesh="hsdp", layers=1, hsdp_shard=8), 256)
    planner = SavePlanner()
    planner.set_up_planner({}, None, True)
    global_plans, md = planner.create_global_plan(plans)
    loads = [sum(math.prod(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize
                 for i in p.items if i.tensor_data is not None) for p in global_plans]
    mean = sum(loads) / len(loads)
    assert max(loads) <= 1.05 * mean, max(loads) / mean
    emb = md.state_dict_metadata["model.tok_embeddings.weight"]
    assert len(emb.chunks) > 8  # its 8 shards written in pieces


def _replicated() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"big": torch.randn(4096, 1024, generator=g),   # 16 MiB, on every rank
            "small": torch.randn(64, 8, generator=g)}


def job_replicated(rank: int, world: int, url: str, layout: str | None) -> dict[str, Any]:
    """Every rank holds the same tensors (DDP): the 16 MiB one is written in pieces by
    several ranks; loaded back whole (every rank) bit for bit."""
    store = ckptfs.open(url, metadata_layout=layout)
    info = store.save(STEP, {**_replicated(), "trainer": {"step": STEP}})
    into: dict[str, Any] = {k: torch.zeros_like(v) for k, v in _replicated().items()}
    into["trainer"] = {"step": 0}
    store.load(STEP, into=into)
    exact = all(torch.equal(into[k], v) for k, v in _replicated().items())
    files = {str(p.relative_to(Path(url) / info.path)): p.stat().st_size
             for p in (Path(url) / info.path).glob("rank-*/data-0.safetensors")}
    return {"exact": exact and into["trainer"] == {"step": STEP}, "files": files}


@pytest.mark.parametrize("layout", [None, "per-rank"])
def test_a_replicated_tensor_larger_than_a_share_is_written_by_several_ranks(
        tmp_path: Path, layout: str | None) -> None:
    """Format v2 and v5 (whose spec then lists the pieces as explicit chunks)."""
    url = str(tmp_path / "run")
    out = run_ranks(job_replicated, 4, url, layout, timeout=240)
    assert all(o["exact"] for o in out)
    files = out[0]["files"]
    assert len(files) >= 2, files  # more than one rank wrote a piece of "big"
    assert max(files.values()) <= 0.6 * sum(files.values()), files
    # A load in one process (the whole checkpoint) and a verify read the pieces back.
    store = ckptfs.open(url)
    assert store.verify(STEP).ok
    got = store.load(STEP)
    assert all(torch.equal(got[k], v) for k, v in _replicated().items())
    # A byte of one piece changed on storage: refused by its chunk's digest, naming the file.
    info = store.info(STEP)
    name = max(files, key=lambda f: files[f])
    path = Path(url) / info.path / name
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=name.split("/")[0]):
        store.load(STEP)
    with pytest.raises(CorruptCheckpointError, match=name.split("/")[0]):
        store.verify(STEP)
