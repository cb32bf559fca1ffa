"""Sharded checkpoints (format v2) on GCS (fake-gcs-server) and Azure (azurite): the
backends tests/protocol/test_sharded.py does not cover (it runs local disk and S3).

One W=2 gloo job serves both backends (spawning ranks is the expensive part).  On each backend
it saves an FSDP2 MLP with AdamW plus uneven DTensors twice (steps 10 and 12), loads step 10
into W'=2 with another placement (Shard(1) / Replicate), then rank 0 flips one byte of rank 1's
data file of step 12 through the raw backdoor and both ranks load step 12 with Shard(0): the
rank that reads the damaged chunk (rank 1) must catch it, naming the file, and every rank must
get the error.  The parent then loads step 10 in one process (W'=1, full tensors) bit-exactly
and sees the damaged step 12 refused by both a full load and a full verification."""

from __future__ import annotations

import json
from typing import Any

import pytest
from dist_util import run_ranks
from test_sharded import build_state, targets, to_plain

import ckptfs
from ckptfs.errors import CorruptCheckpointError
from ckptfs.format.layout import StepPaths
from ckptfs.format.sharded import METADATA_NAME
from ckptfs.format.versions import decode_manifest, is_sharded
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal

DAMAGED = "rank-00001/data-0.safetensors"


def flip_in_rank_file(backend: Backend, step: int, attempt: str, key: str) -> int:
    """Flip the first byte of ``key``'s chunk in rank 1's data file (through the backdoor,
    never through ckptfs); returns the file offset flipped."""
    m = decode_manifest(backend.raw_read(StepPaths(step).manifest(attempt)))
    assert is_sharded(m)
    entry = m.chunked(DAMAGED)
    rel = StepPaths(step).file(attempt, entry.path)
    data = bytearray(backend.raw_read(rel))
    header = json.loads(bytes(data[8:entry.chunks[0].length]))
    offset = int(header[key]["data_offsets"][0]) + entry.chunks[0].length
    data[offset] ^= 0x01
    backend.raw_fs.pipe_file(backend._p(rel), bytes(data))
    return offset


def job_backends(rank: int, world: int, backends: list[tuple[str, dict[str, Any]]]) -> Any:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    state, mesh = build_state(world)
    plain = to_plain(state)
    out: dict[str, Any] = {"plain": plain if rank == 0 else None}
    for i, (url, opts) in enumerate(backends):
        store = ckptfs.open(url, **opts)
        info = store.save(10, state)
        info12 = store.save(12, state)
        out[f"info{i}"] = (info.step, info.attempt, info.manifest.format_version,
                           info.manifest.world_size, info12.attempt)  # type: ignore[attr-defined]
        into = targets(plain, mesh, lambda t: Shard(1) if t.dim() >= 2 and t.shape[1] > 1
                       else (Replicate() if t.dim() == 1 else None))
        assert store.load(10, into=into) is into
        assert_state_equal(to_plain(into), plain)
        if rank == 0:  # dt.a has 7 rows: rank 1 saved rows 4..6 ("dt.a@4,0") in its own file
            out[f"flipped{i}"] = flip_in_rank_file(Backend("b", url, opts), 12, info12.attempt,
                                                   "dt.a@4,0")
        dist.barrier()
        into = targets(plain, mesh, lambda t: Shard(0) if t.dim() >= 1 and t.numel() else None)
        try:
            store.load(12, into=into)
            out[f"corrupt{i}"] = None
        except CorruptCheckpointError as exc:
            out[f"corrupt{i}"] = (type(exc).__name__, str(exc))
    return out


def test_sharded_on_gcs_and_azure(gcs_backend: Backend, azure_backend: Backend) -> None:
    bs = (gcs_backend, azure_backend)
    env = {k: v for b in bs for k, v in b.env.items()}
    r0, r1 = run_ranks(job_backends, 2, [(b.url, dict(b.options)) for b in bs], timeout=240,
                       env=env)
    expected = r0["plain"]
    for i, b in enumerate(bs):
        assert r0[f"info{i}"] == r1[f"info{i}"], b.name  # one commit, the same on every rank
        step, attempt, version, world, attempt12 = r0[f"info{i}"]
        assert (step, version, world) == (10, 2, 2)
        manifest = json.loads(b.raw_read(StepPaths(10).manifest(attempt)))
        assert {f["path"] for f in manifest["files"]} == {
            METADATA_NAME, "rank-00000/data-0.safetensors", DAMAGED}
        # W'=1: the whole state in this process, plain full-size tensors, bit-exact.
        store = b.open()
        assert store.steps() == [10, 12]
        assert_state_equal(store.load(10), expected)
        assert store.verify(10).ok
        # The flipped byte: caught by rank 1 (the reader of rows 4..6), named, on every rank.
        for r in (r0, r1):
            _, text = r[f"corrupt{i}"]
            assert DAMAGED in text, (b.name, text)
            assert "rank(s) [1]" in text and "read by rank 1" in text, (b.name, text)
        with pytest.raises(CorruptCheckpointError, match=DAMAGED):
            store.load(12)
        with pytest.raises(CorruptCheckpointError, match=DAMAGED):
            store.verify(12)
        assert attempt12 != attempt
