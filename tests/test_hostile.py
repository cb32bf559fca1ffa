"""Hostile checkpoints (invariant 6: someone hands you a bucket).  Each planted with a valid
marker, as an attacker would: every one gives a typed error (UnsafeCheckpointError for paths,
links and extension types), no storage access outside the checkpoints, nothing written, nothing
executed, bounded memory."""

from __future__ import annotations

import tracemalloc

import pytest

from ckptfs.errors import CorruptCheckpointError
from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability import (
    HOSTILE_MEMORY_LIMIT,
    Planter,
    hostile_sweep,
    raw_storage,
    store_on,
)


@pytest.mark.parametrize("where", [
    "local", "memory",
    # the decoders are the same on every backend; the object stores add ~25 s each
    pytest.param("s3", marks=pytest.mark.slow), pytest.param("gcs", marks=pytest.mark.slow),
    pytest.param("azure", marks=pytest.mark.slow),
])
def test_hostile_checkpoints(where: str, request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    sweep = hostile_sweep(backend)
    assert sweep.tried >= 75
    assert sweep.counters["UnsafeCheckpointError"] > 0
    assert sweep.counters["peak_bytes_max"] < HOSTILE_MEMORY_LIMIT
    assert sweep.violations == []


@pytest.mark.parametrize("declared", [1 << 30, 1 << 40, 1 << 50])
def test_declared_size_is_not_allocated(local_backend: Backend, declared: int) -> None:
    """Regression: load allocated a buffer of the *declared* size before reading (8 GiB
    resident for a manifest declaring 8 GiB; a raw MemoryError for 1 TiB/1 PiB)."""
    pl = Planter(local_backend)
    entries = pl.entries(pl.files)
    for e in entries:
        if e["path"].endswith(".safetensors"):
            e["size"] = declared
    step = pl.plant(entries=entries)
    store = store_on(raw_storage(local_backend))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="size differs from the manifest"):
            store.load(step)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024
