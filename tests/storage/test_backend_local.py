"""The conformance suite on local disk (file://)."""

from __future__ import annotations

import pytest

from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import (
    CommitConformance,
    LatestConformance,
    RaceConformance,
    StorageConformance,
)


class LocalFixtures:
    @pytest.fixture
    def backend(self, local_backend: Backend) -> Backend:
        return local_backend


class TestLocalStorage(LocalFixtures, StorageConformance):
    pass


class TestLocalCommit(LocalFixtures, CommitConformance):
    pass


class TestLocalLatest(LocalFixtures, LatestConformance):
    pass


class TestLocalRace(LocalFixtures, RaceConformance):
    pass
