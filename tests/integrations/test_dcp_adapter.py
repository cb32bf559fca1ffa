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
