"""The conformance suite on GCS through gcsfs against fake-gcs-server."""

from __future__ import annotations

import pytest

from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import (
    CommitConformance,
    LatestConformance,
    RaceConformance,
    StorageConformance,
)


class GcsFixtures:
    @pytest.fixture
    def backend(self, gcs_backend: Backend) -> Backend:
        return gcs_backend


class TestGcsStorage(GcsFixtures, StorageConformance):
    pass


class TestGcsCommit(GcsFixtures, CommitConformance):
    pass


class TestGcsLatest(GcsFixtures, LatestConformance):
    pass


class TestGcsRace(GcsFixtures, RaceConformance):
    pass
