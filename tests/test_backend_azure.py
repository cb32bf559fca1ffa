"""The conformance suite on Azure Blob through adlfs against azurite."""

from __future__ import annotations

import pytest

from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import (
    CommitConformance,
    LatestConformance,
    RaceConformance,
    StorageConformance,
)


class AzureFixtures:
    @pytest.fixture
    def backend(self, azure_backend: Backend) -> Backend:
        return azure_backend


class TestAzureStorage(AzureFixtures, StorageConformance):
    pass


class TestAzureCommit(AzureFixtures, CommitConformance):
    pass


class TestAzureLatest(AzureFixtures, LatestConformance):
    pass


class TestAzureRace(AzureFixtures, RaceConformance):
    pass
