"""Invariant 4 (concurrent writers never mix) and readers/pruning during saves, on all six
backends: a zombie job and its replacement on the same and neighbouring steps, unsynchronised
racing writers, a reader looping over latest()/load() while saves and deletions run, and prune +
garbage collection while a save waits just before its commit."""

from __future__ import annotations

import paths
import pytest

from ckptfs.errors import CheckpointNotFoundError
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage
from ckptfs.testing.reliability import (
    raw_storage,
    state_for,
    store_on,
    sweep_free_race,
    sweep_prune_during_save,
    sweep_reader_during_saves,
    sweep_zombie,
)
from ckptfs.torch_versions import sharded_supported


def test_zombie_and_replacement(any_backend: Backend) -> None:
    sweep = sweep_zombie(any_backend)
    assert sweep.tried == 3
    assert "not_exclusive" not in sweep.counters  # every backend here has exclusive create
    assert sweep.violations == []


def test_unsynchronised_writers_one_winner(any_backend: Backend) -> None:
    sweep = sweep_free_race(any_backend, trials=2, writers=3)
    assert sweep.tried == 2
    assert sweep.violations == []


def test_reader_during_saves_and_deletes(any_backend: Backend) -> None:
    sweep = sweep_reader_during_saves(any_backend)
    assert sweep.tried >= 5  # the reader overlapped every save
    assert sweep.violations == []


def test_prune_and_gc_during_a_save(any_backend: Backend) -> None:
    sweep = sweep_prune_during_save(any_backend)
    assert sweep.tried == 2
    assert sweep.violations == []


@pytest.mark.parametrize("where", ["local", "memory"])
def test_checkpoint_deleted_while_loading_is_not_found_not_corrupt(
        where: str, request: pytest.FixtureRequest) -> None:
    """Regression: a prune deleting the checkpoint a reader is loading made load() report
    CorruptCheckpointError ("listed in the manifest but missing"), a false corruption alarm."""
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    writer = store_on(raw_storage(backend))
    writer.save(1, state_for(1))
    writer.save(2, state_for(2))
    fired = []

    def delete_first(op: str, path: str) -> None:
        if op == "open_read" and path.endswith(".safetensors") and not fired:
            fired.append(path)
            writer.delete(1)

    reader = store_on(FaultyStorage(raw_storage(backend), hook=delete_first))
    with pytest.raises(CheckpointNotFoundError, match="deleted or replaced while"):
        reader.load(1)
    assert fired
    assert reader.load(2)["trainer"]["step"] == 2


@pytest.mark.parametrize("where", ["memory", "local",
                                   pytest.param("s3", marks=pytest.mark.slow)])
def test_writers_of_every_path_race_one_winner(where: str,
                                               request: pytest.FixtureRequest) -> None:
    """A save, an async save, a copy (ckptfs cp) and a sharded save on one rank race on one
    step, each with its own state: exactly one commits, the others get
    CheckpointExistsError, and the committed checkpoint is exactly the winner's state."""
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    racers = [paths.V1, paths.ASYNC, paths.CP, paths.V2]
    if not sharded_supported():  # torch < 2.9: no sharded save (ckptfs/torch_versions.py)
        racers = [p for p in racers if not p.sharded]
    sweep = sweep_free_race(backend, trials=2, writers=len(racers), paths=racers)
    assert sweep.tried == 2
    assert sweep.violations == []
