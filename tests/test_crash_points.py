"""Invariants 2 and 3 of docs/protocol.md at every storage call: a save or a delete killed at
any mutating call (and once just after the commit took effect) leaves the previous latest
intact, every retained committed checkpoint verifiable, and the next save working.  On all six
backends; the sweeps live in :mod:`ckptfs.testing.reliability` (also run by the figures
command)."""

from __future__ import annotations

import pytest

from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability import (
    sweep_delete_crashes,
    sweep_gc_crashes,
    sweep_prune_crashes,
    sweep_save_crashes,
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
