"""Sharded checkpoints (format v2, sharded.md): collective saves on 2 and 4 gloo ranks, loads into
1, 2 and 4 ranks with other placements, corruption caught by the rank that reads it, a failing
rank failing the save everywhere, and the in-process parts (codecs, full load, v1 refusal).

The multi-rank jobs are few and reused (spawning a rank costs seconds on 2 cores): one W=2 job
saves on local disk and S3 and exercises the W=2 cases; one W=4 job loads and saves with 4
ranks and meets a corrupted file.  Bit-exactness is checked against the full tensors the
saving ranks assembled themselves (``DTensor.full_tensor``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_util import run_ranks, save_sharded

import ckptfs
import ckptfs.dcp
from ckptfs.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    ShardedSaveError,
    StorageError,
    UnsupportedValueError,
)
from ckptfs.format.layout import StepPaths
from ckptfs.format.manifest import Manifest
from ckptfs.format.sharded import (
    METADATA_NAME,
    chunk_list_digest,
    decode_value,
    encode_value,
)
from ckptfs.format.versions import decode_manifest, is_sharded
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal

# ----------------------------------------------------------------------------------------------
# What every job saves: an FSDP2 MLP with AdamW (uneven Shard(0): 7 and 3 rows), DTensors with
# uneven shards, plain replicated tensors, and every value type of format v1.


def trainer_values() -> dict[Any, Any]:
    return {"step": 10, "loss": 0.25, "nan": math.nan, "inf": -math.inf, "neg0": -0.0,
            "big": 2**70, "none": None, "flag": True, "name": "run-1", "blob": b"\x00\x80",
            0: (1, 2.5), "nested": {"a": [1, {"b": ()}], (1, "k"): "tuple key"}, "empty": [],
            "emptyd": {}, "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
            "pair": (torch.arange(3), torch.ones(2, dtype=torch.float16)),
            "ints": torch.arange(5, dtype=torch.int64), "flags": torch.tensor([True, False]),
            "empty_t": torch.zeros(0, 4)}


def build_state(world: int) -> tuple[dict[str, Any], Any]:
    """(state with DTensors, the mesh) on this rank; identical values on every world size."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    g = torch.arange(21, dtype=torch.float32).reshape(7, 3) / 7
    dts = {"a": distribute_tensor(g, mesh, [Shard(0)]),
           "b": distribute_tensor(g.to(torch.bfloat16).t().contiguous(), mesh, [Shard(0)]),
           "c": distribute_tensor(torch.arange(9, dtype=torch.int64), mesh, [Shard(0)])}
    return {"model": msd, "optimizer": osd, "dt": dts, "trainer": trainer_values()}, mesh


def to_plain(value: Any) -> Any:
    """Full tensors (collective for DTensors: every rank walks the same tree)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(to_plain(v) for v in value)
    return value


def targets(plain: Any, mesh: Any, placement: Any) -> Any:
    """An empty state shaped like ``plain``: 2-D+ tensors as DTensors with ``placement(t)``,
    others plain zeros, values replaced by None (the load must bring them back)."""
    from torch.distributed.tensor import distribute_tensor

    if isinstance(plain, torch.Tensor):
        z = torch.zeros_like(plain)
        p = placement(plain)
        return z if p is None else distribute_tensor(z, mesh, [p])
    if isinstance(plain, dict):
        return {k: targets(v, mesh, placement) for k, v in plain.items()}
    if isinstance(plain, list):
        return [targets(v, mesh, placement) for v in plain]
    if isinstance(plain, tuple) and not isinstance(plain, torch.Size):
        return tuple(targets(v, mesh, placement) for v in plain)
    return None


class FailingWrites:
    """This rank's storage: data-file writes fail (a storage error in the middle of a save)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def open_write(self, path: str) -> Any:
        if "/rank-" in path:
            raise StorageError(f"write {path}: injected failure on this rank")
        return self._inner.open_write(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# ----------------------------------------------------------------------------------------------
# Jobs (module level: pickled by name into the spawned ranks)


def job_save_w2(rank: int, world: int, backends: list[tuple[str, dict[str, Any]]]) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    state, mesh = build_state(world)
    plain = to_plain(state)
    out: dict[str, Any] = {"plain": plain if rank == 0 else None}
    for i, (url, opts) in enumerate(backends):
        store = ckptfs.open(url, **opts)
        info = store.save(10, state)
        info12 = store.save(12, state)  # a second copy, corrupted later by the parent
        out[f"info{i}"] = (info.step, info.attempt, info.manifest.format_version, info12.attempt)
        # W'=2, another placement: Shard(1) for matrices, Replicate for vectors.
        into = targets(plain, mesh, lambda t: Shard(1) if t.dim() >= 2 and t.shape[1] > 1
                       else (Replicate() if t.dim() == 1 else None))
        back = store.load(10, into=into)
        assert back is into
        assert_state_equal(to_plain(into), plain)
    # One rank fails while writing: every rank gets the typed error naming it; no marker.
    store = ckptfs.open(backends[0][0], **backends[0][1])
    if rank == 1:
        store.storage = FailingWrites(store.storage)  # type: ignore[assignment]
    try:
        store.save(11, state)
    except ShardedSaveError as exc:
        out["failure"] = (type(exc).__name__, str(exc), sorted(exc.failures))
    else:
        out["failure"] = None
    out["latest_after_failure"] = ckptfs.open(backends[0][0], **backends[0][1]).latest().step
    # ... and the coordinator discarded the attempt rank 0 wrote its file into
    out["left_after_failure"] = 11 in ckptfs.open(backends[0][0], **backends[0][1]).all_steps()
    # A bad value on one rank only: every rank fails before anything is written.
    bad = dict(state, extra={"x": object()}) if rank == 0 else state
    try:
        store.save(13, bad)
    except UnsupportedValueError as exc:
        out["bad_value"] = str(exc)
    return out


def job_w4(rank: int, world: int, backends: list[tuple[str, dict[str, Any]]],
           expected: dict[str, Any], corrupt_url: str) -> Any:
    from torch.distributed.tensor import Shard

    state, mesh = build_state(world)
    out: dict[str, Any] = {}
    for url, opts in backends:
        store = ckptfs.open(url, **opts)
        into = targets(expected, mesh, lambda t: Shard(0) if t.dim() >= 1 and t.numel() else None)
        store.load(into=into)  # latest (step 12 is newer but the parent deletes it first)
        assert_state_equal(to_plain(into), expected)
        info = store.save(20, state)  # W=4 save
        out.setdefault("w4", []).append((info.attempt, info.manifest.world_size))
    store = ckptfs.open(corrupt_url)
    into = targets(expected, mesh, lambda t: Shard(0) if t.dim() >= 1 and t.numel() else None)
    try:
        store.load(12, into=into)
    except CorruptCheckpointError as exc:
        out["corrupt"] = str(exc)
    return out


# ----------------------------------------------------------------------------------------------
# The multi-rank test (one W=2 job, one W=4 job)


def _flip_byte(backend: Backend, step: int, attempt: str, relpath: str, offset: int) -> None:
    path = StepPaths(step).file(attempt, relpath)
    data = bytearray(backend.raw_read(path))
    data[offset] ^= 0x01
    backend.raw_fs.pipe_file(backend._p(path), bytes(data))


def test_sharded_save_load_any_world_size(local_backend: Backend, s3_backend: Backend) -> None:
    backends = [(b.url, dict(b.options)) for b in (local_backend, s3_backend)]
    r0, r1 = run_ranks(job_save_w2, 2, backends, timeout=240)
    expected = r0["plain"]
    for i, b in enumerate((local_backend, s3_backend)):
        assert r0[f"info{i}"] == r1[f"info{i}"]  # every rank: the same committed checkpoint
        assert r0[f"info{i}"][2] == 2
        # W'=1: a full load in this process, plain tensors, the nested structure saved.
        full = b.open().load(10)
        assert_state_equal(full, expected)
        assert full["trainer"][0] == (1, 2.5) and isinstance(full["trainer"]["pair"], tuple)
        assert b.open().verify(10).ok
        manifest = json.loads(b.raw_read(StepPaths(10).manifest(r0[f"info{i}"][1])))
        assert manifest["format_version"] == 2 and manifest["world_size"] == 2
        paths = {f["path"] for f in manifest["files"]}
        assert paths == {METADATA_NAME, "rank-00000/data-0.safetensors",
                         "rank-00001/data-0.safetensors"}
    # The failing rank failed the save on every rank, named; no marker; latest untouched.
    for r in (r0, r1):
        name, text, ranks = r["failure"]
        assert name == "ShardedSaveError" and ranks == [1] and "injected failure" in text
        assert r["latest_after_failure"] == 12
        assert not r["left_after_failure"], "the failed attempt's files were left behind"
        assert "rank(s) [0]" in r["bad_value"] and "object" in r["bad_value"]
    assert not local_backend.raw_fs.exists(local_backend._p(StepPaths(11).marker))
    assert not local_backend.raw_fs.exists(local_backend._p(StepPaths(13).dir))
    # Corrupt one byte of rank 1's file in step 12 (inside dt/a's chunk, rows 4..6), then hide
    # step 12 from "latest" on the intact backends by deleting it there.
    attempt12 = r0["info0"][3]
    m = decode_manifest(local_backend.raw_read(StepPaths(12).manifest(attempt12)))
    assert is_sharded(m)
    entry = m.chunked("rank-00001/data-0.safetensors")
    header = json.loads(local_backend.raw_read(StepPaths(12).file(attempt12, entry.path))[
        8:entry.chunks[0].length])
    begin = header["dt.a@4,0"]["data_offsets"][0] + entry.chunks[0].length
    corrupt = local_backend.sibling("corrupt")
    local_backend.raw_fs.copy(local_backend.raw_root, corrupt.raw_root, recursive=True)
    _flip_byte(corrupt, 12, attempt12, entry.path, begin)
    for b in (local_backend, s3_backend):
        b.open().delete(12)
    with pytest.raises(CorruptCheckpointError, match=r"rank-00001/data-0\.safetensors"):
        corrupt.open().load(12)
    results = run_ranks(job_w4, 4, backends, expected, corrupt.url, timeout=300)
    for r in results:
        assert len(r["w4"]) == 2 and all(w == 4 for _, w in r["w4"])
        # Rows 4..6 of dt.a are read by ranks 2 and 3 (Shard(0) of 7 rows over 4 ranks).
        assert "rank-00001/data-0.safetensors" in r["corrupt"]
        assert "read by rank 2" in r["corrupt"] and "rank(s) [2, 3]" in r["corrupt"]
    assert len({a for a, _ in results[0]["w4"]}) == 2
    for b in (local_backend, s3_backend):
        full = b.open().load(20)
        assert_state_equal(full, expected)
        assert b.open().info(20).manifest.world_size == 4  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------
# In one process: the format, the v1 refusal, full and in-place loads without torch.distributed


def test_single_process_save_stays_v1(tmp_path: Path) -> None:
    info = ckptfs.open(str(tmp_path)).save(1, {"w": torch.ones(2)})
    assert type(info.manifest) is Manifest and info.manifest.format_version == 1


def test_v1_reader_refuses_v2_and_v2_reader_refuses_v1(tmp_path: Path) -> None:
    store = ckptfs.open(str(tmp_path))
    info = save_sharded(store.storage, 5, {"w": torch.arange(4.0)})
    mbytes = (tmp_path / StepPaths(5).manifest(info.attempt)).read_bytes()
    with pytest.raises(FormatVersionError, match="format version 2"):
        Manifest.from_bytes(mbytes)  # the v1 codec: what a ckptfs predating v2 runs
    store.save(6, {"w": torch.zeros(1)})
    with pytest.raises(BaseException, match="single-process"):
        dcp.load({"w": torch.zeros(1)}, storage_reader=ckptfs.dcp.Reader(str(tmp_path), 6),
                 planner=ckptfs.dcp.LoadPlanner(), no_dist=True)


def test_every_v1_value_round_trips_in_one_process(tmp_path: Path) -> None:
    state = {"model": torch.nn.Linear(3, 2).state_dict(), "trainer": trainer_values()}
    store = ckptfs.open(str(tmp_path))
    info = save_sharded(store.storage, 3, state)
    assert info.manifest.format_version == 2
    assert_state_equal(store.load(3), state)
    assert_state_equal(store.load(), state)  # latest
    into: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                            "trainer": {"step": -1, 0: None, "pair": (torch.zeros(3, dtype=
                                        torch.int64), torch.zeros(2, dtype=torch.float16))}}
    w = into["model"]["weight"]
    store.load(3, into=into)
    assert into["model"]["weight"] is w and torch.equal(w, state["model"]["weight"])
    assert into["trainer"]["step"] == 10 and into["trainer"][0] == (1, 2.5)
    assert torch.equal(into["trainer"]["pair"][1], state["trainer"]["pair"][1])


def test_value_codec_refuses_pickle_and_keeps_types() -> None:
    import io
    import pickle

    for v in trainer_values().values():
        assert_state_equal(decode_value(encode_value(v, key="k"), where="k"), v)
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    for blob in (buf.getvalue(), pickle.dumps({"a": 1})):
        with pytest.raises(CorruptCheckpointError, match="never unpickles"):
            decode_value(blob, where="k")
    with pytest.raises(UnsupportedValueError, match="k"):
        encode_value(object(), key="k")


def test_manifest_chunks_bind_the_file_digest(tmp_path: Path) -> None:
    store = ckptfs.open(str(tmp_path))
    info = save_sharded(store.storage, 4, {"w": torch.arange(6.0), "v": 3})
    m = info.manifest
    assert is_sharded(m)
    for e in m.files:
        assert e.digest == chunk_list_digest(e.algorithm, e.chunks)  # type: ignore[attr-defined]
    doc = json.loads(m.to_bytes())
    doc["files"][0]["chunks"][0][2] = "0" * len(doc["files"][0]["chunks"][0][2])
    with pytest.raises(CorruptCheckpointError, match="chunk list"):
        decode_manifest(json.dumps(doc).encode())
    doc = json.loads(m.to_bytes())
    doc["files"][0]["chunks"][0][1] += 1
    with pytest.raises(CorruptCheckpointError, match="tile"):
        decode_manifest(json.dumps(doc).encode())
    doc = json.loads(m.to_bytes())
    doc["format_version"] = 6  # 3-5 are read (incremental, per-rank metadata); 6 is newer
    with pytest.raises(FormatVersionError, match="reads up to 5"):
        decode_manifest(json.dumps(doc).encode())


def test_missing_step_is_a_clear_error(tmp_path: Path) -> None:
    store = ckptfs.open(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        store.load(into={"w": torch.zeros(1)})
    with pytest.raises(CheckpointNotFoundError, match="step 9"):
        store.load(9, into={"w": torch.zeros(1)})


def test_a_new_world_gets_its_own_gloo_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """ckptfs's dedicated group belongs to the world it was made in: after
    ``destroy_process_group`` and a new ``init_process_group``, whose default group may get the
    destroyed one's ``id()`` (forced here: every object the same id), a collective save's group
    is the new world's, never the destroyed one's (whose collectives fail: "not initialized in
    the world group map")."""
    import torch.distributed as dist

    from ckptfs.protocol import sharded
    from ckptfs.testing.reliability.paths import world_of_one

    monkeypatch.setattr(sharded, "id", lambda obj: 1, raising=False)
    groups = []
    for _ in range(3):
        with world_of_one():
            group = sharded.collective_group(None)
            assert group is sharded.collective_group(None)  # made once per world
            dist.barrier(group=group)  # a group of a destroyed world raises here
            groups.append(group)
    assert groups[0] is not groups[1] and groups[1] is not groups[2]


@pytest.mark.parametrize("layout", [None, "per-rank"])
def test_sharded_manifests_count_the_tensors(tmp_path: Path, layout: str | None) -> None:
    """A collective save's manifest records how many tensors the state holds (v2 and v5
    recorded 0 for a 12-tensor state), as a single-process save's does."""
    from ckptfs.testing.reliability.paths import save_v2

    state = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(12)}
    state["trainer"] = {"step": 3}  # a value: not a tensor
    store = ckptfs.open(str(tmp_path))
    info = save_v2(store, 1, state, metadata_layout=layout)
    assert info.manifest.format_version == (5 if layout else 2)
    assert info.manifest.metadata["tensor_count"] == 12
    assert store.save(2, state).manifest.metadata["tensor_count"] == 12  # v1: the same


def test_a_store_of_layout_ranks_writes_rank_files_in_one_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``layout="ranks"``: a single process writes the rank files (v2; v4 incremental; v5
    per-rank metadata, its async save too) through the collective save's driver, a world of
    one; each loads back bit for bit; an unknown layout is refused at open."""
    from ckptfs.protocol import save_rounds

    calls: list[int] = []
    real = save_rounds.drive_save

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_rounds, "drive_save", counted)
    state = {"w": torch.arange(6.0).reshape(2, 3), "t": {"step": 4, "names": ["a"]}}
    for name, opts, version in (("v2", {}, 2), ("v4", {"incremental": True}, 4),
                                ("v5", {"metadata_layout": "per-rank"}, 5)):
        store = ckptfs.open(str(tmp_path / name), layout="ranks", **opts)
        store.save(1, state)
        info = store.save(2, state)
        assert info.manifest.format_version == version, name
        got = store.load(2)
        assert torch.equal(got["w"], state["w"]) and got["t"] == state["t"]
        fut = store.save_async(3, state)
        assert fut.result().manifest.format_version == version
        store.close()
    assert len(calls) == 9  # every save through the one collective driver
    assert ckptfs.open(str(tmp_path / "v1")).save(1, state).manifest.format_version == 1
    with pytest.raises(TypeError, match="layout 'rank'"):
        ckptfs.open(str(tmp_path / "x"), layout="rank")
