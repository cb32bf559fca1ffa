"""The conformance suite on S3 through s3fs against a moto server."""

from __future__ import annotations

import pytest

from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import (
    CommitConformance,
    LatestConformance,
    RaceConformance,
    StorageConformance,
)


class S3Fixtures:
    @pytest.fixture
    def backend(self, s3_backend: Backend) -> Backend:
        return s3_backend


class TestS3Storage(S3Fixtures, StorageConformance):
    pass


class TestS3Commit(S3Fixtures, CommitConformance):
    pass


class TestS3Latest(S3Fixtures, LatestConformance):
    pass


class TestS3Race(S3Fixtures, RaceConformance):
    pass
