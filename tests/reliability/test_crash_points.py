"""Invariants 2 and 3 of docs/protocol.md at every storage call: a save or a delete killed at
any mutating call (and once just after the commit took effect) leaves the previous latest
intact, every retained committed checkpoint verifiable, and the next save working.  On all six
backends; the sweeps live in :mod:`ckptfs.testing.reliability` (also run by the figures
command).  The save sweep also runs through every other writer (tests/paths.py)."""

from __future__ import annotations

import paths
import pytest

from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability import (
    sweep_delete_crashes,
    sweep_gc_crashes,
    sweep_prune_crashes,
    sweep_save_crashes,
    sweep_shared_gc_crashes,
)


def test_save_crash_at_every_call(any_backend: Backend) -> None:
    sweep = sweep_save_crashes(any_backend)
    assert sweep.tried > sweep.counters["calls_per_save"] >= 4
    assert sweep.violations == []


def test_delete_crash_at_every_call(any_backend: Backend) -> None:
    sweep = sweep_delete_crashes(any_backend)
    assert sweep.tried >= 3
    assert sweep.counters.get("still_committed", 0) >= 1  # the crash before the marker delete
    assert sweep.violations == []


@pytest.mark.parametrize("where", ["local", "memory", "s3", "gcs", "azure"])
def test_delete_of_shared_bytes_crash_at_every_call(where: str,
                                                    request: pytest.FixtureRequest) -> None:
    """Incremental checkpoints (format v3): the deleted step holds the frozen model the later
    steps reference; a crash at every call of its delete, then the delete again, never takes a
    byte they use, and leaves exactly the referenced file and the retired attempt's manifest."""
    if where not in ("local", "memory") and not request.config.getoption("--runslow"):
        pytest.skip("larger sweep: run with --runslow")
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    sweep = sweep_delete_crashes(backend, path=paths.V3)
    assert sweep.tried == sweep.counters["calls_per_delete"] + 1 >= 4
    assert sweep.violations == []


@pytest.mark.parametrize("where", ["local", "memory", "s3", "gcs", "azure"])
def test_gc_of_shared_bytes_crash_at_every_call(where: str,
                                                request: pytest.FixtureRequest) -> None:
    """Incremental checkpoints: gc crashed at every call with a retired step whose file the
    committed ones reference: they verify after every crash; clean runs leave only that file
    and the retired attempt's manifest."""
    if where not in ("local", "memory") and not request.config.getoption("--runslow"):
        pytest.skip("larger sweep: run with --runslow")
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    sweep = sweep_shared_gc_crashes(backend)
    assert sweep.counters["retired_first_run"] == 1
    assert sweep.tried == sweep.counters["calls_per_gc"] + 1 >= 3
    assert sweep.violations == []


def test_prune_crash_at_every_call(any_backend: Backend) -> None:
    sweep = sweep_prune_crashes(any_backend)
    assert sweep.tried == sweep.counters["calls_per_prune"] + 1 >= 4
    assert sweep.violations == []


def test_gc_crash_at_every_call(any_backend: Backend) -> None:
    sweep = sweep_gc_crashes(any_backend)
    assert sweep.counters["garbage_items_first_run"] >= 2
    assert sweep.tried == sweep.counters["calls_per_gc"] + 1
    assert sweep.violations == []


@pytest.mark.parametrize("where", ["local", "memory"])
def test_save_crash_with_parallel_file_writes(where: str, request: pytest.FixtureRequest) -> None:
    """Four writer threads: the crash hits one of them, the others find the writer dead."""
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    sweep = sweep_save_crashes(backend, threads=4)
    assert sweep.tried > sweep.counters["calls_per_save"]
    assert sweep.violations == []


def _path_params() -> list[object]:
    """save_async and ckptfs cp on local disk and memory, the sub-storage and the copy of a
    sharded checkpoint on memory; every other combination, and the object stores, with
    --runslow.  The sharded save (two simulated ranks driving DCP's call sequence) has its own
    sweep in tests/reliability/test_sharded_crash.py."""
    default = {("memory", "async"), ("memory", "cp"), ("local", "async"), ("local", "cp"),
               ("memory", "sub"), ("memory", "cp-v2"), ("memory", "v3"), ("local", "v3"),
               ("memory", "v4"), ("memory", "async-v3"), ("memory", "v5")}
    out: list[object] = []
    for where in ("memory", "local", "s3", "ministack", "gcs", "azure"):
        for p in paths.params([p for p in paths.EVERY if p not in ("v1", *paths.REPLICAS)]):
            (path,) = p.values
            slow = [] if (where, path.name) in default else [pytest.mark.slow]
            out.append(pytest.param(where, path, id=f"{where}-{path.name}",
                                    marks=[*p.marks, *slow]))
    return out


@pytest.mark.parametrize(("where", "path"), _path_params())
def test_save_crash_at_every_call_on_every_path(where: str, path: paths.WritePath,
                                                request: pytest.FixtureRequest) -> None:
    """The crash sweep through another writer: the background thread of save_async, the
    destination of ckptfs cp (its source is a scratch root), a sub-storage, dcp.save on one
    rank (DCP reports the crash as ShardedSaveError: it counts as the crash), an incremental
    save (format v3) whose model tensors are references to an earlier checkpoint's file:
    every committed checkpoint, the latest included, loads bit-exactly through its references."""
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    sweep = sweep_save_crashes(backend, path=path)
    paths.check_violations(sweep.violations)
    assert sweep.tried > sweep.counters["calls_per_save"] >= 4
    if path.references:  # every save after the primed step 0 references it (or its source)
        assert sweep.counters["with_references"] >= sweep.counters["calls_per_save"]
