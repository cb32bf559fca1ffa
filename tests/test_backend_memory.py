"""The conformance suite on the in-process memory:// filesystem."""

from __future__ import annotations

import pytest

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
