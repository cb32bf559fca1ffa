"""The conformance suite on the in-process memory:// filesystem."""

from __future__ import annotations

import pytest

import ckptfs
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import (
    CommitConformance,
    LatestConformance,
    RaceConformance,
    StorageConformance,
)


class MemoryFixtures:
    @pytest.fixture
    def backend(self, memory_backend: Backend) -> Backend:
        return memory_backend


class TestMemoryStorage(MemoryFixtures, StorageConformance):
    pass


class TestMemoryCommit(MemoryFixtures, CommitConformance):
    pass


class TestMemoryLatest(MemoryFixtures, LatestConformance):
    pass


class TestMemoryRace(MemoryFixtures, RaceConformance):
    pass


@pytest.mark.parametrize("race", [KeyError("/checkpoints/gone"),
                                  RuntimeError("dictionary changed size during iteration")],
                         ids=["deleted-after-snapshot", "dict-changed-while-iterated"])
def test_listing_survives_files_deleted_by_another_thread(memory_backend: Backend,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         race: Exception) -> None:
    """fsspec's in-memory filesystem looks a key up again after snapshotting its dict, so a
    file another thread deletes in between makes ``ls``/``find``/``info``/``exists`` raise
    ``KeyError`` (a racing loser discarding its attempt broke another writer's listing: a rare
    CI failure of the every-path race; ~1 in 5,000 listings with threads switching at every
    instruction); and its ``ls`` iterates the shared dict itself, so a file another thread
    adds or removes meanwhile raises ``RuntimeError`` "dictionary changed size during
    iteration" (the same CI failure, seen again under load).  The adapter repeats the call
    until the dict is stable: here each call raises twice, as a racing writer would, then
    answers; any other ``RuntimeError`` is not repeated."""
    from ckptfs.storage.fsspec import FsspecStorage

    storage = FsspecStorage(memory_backend.url)  # the adapter alone (no retry layer above it)
    storage.write_bytes("checkpoints/a", b"x")
    fs = storage.fs
    for name in ("ls", "find", "exists", "rm"):
        real = getattr(fs, name)
        left = {"n": 2}

        def flaky(*args: object, _real: object = real, _left: dict[str, int] = left,
                  **kwargs: object) -> object:
            if _left["n"]:
                _left["n"] -= 1
                raise race
            return _real(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(fs, name, flaky)
    assert [e.basename for e in storage.list_dir("checkpoints")] == ["a"]
    assert [e.basename for e in storage.list_tree("checkpoints")] == ["a"]
    assert storage.exists("checkpoints/a")
    storage.delete_tree("checkpoints")  # its expansion iterates the dict as well
    assert not storage.exists("checkpoints/a")
    monkeypatch.setattr(fs, "ls", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug")))
    with pytest.raises(ckptfs.StorageError, match="bug"):
        storage.list_dir("checkpoints")
