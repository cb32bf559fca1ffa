"""The conformance suite on S3 through s3fs against ministack (its 412 has no Condition element,
so s3fs raises OSError(EINVAL), not FileExistsError)."""

from __future__ import annotations

import pytest
from test_backend_s3 import check_aborted_multipart_upload_is_aborted

from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import (
    CommitConformance,
    LatestConformance,
    RaceConformance,
    StorageConformance,
)


class MinistackFixtures:
    @pytest.fixture
    def backend(self, ministack_backend: Backend) -> Backend:
        return ministack_backend


class TestMinistackStorage(MinistackFixtures, StorageConformance):
    pass


class TestMinistackCommit(MinistackFixtures, CommitConformance):
    pass


class TestMinistackLatest(MinistackFixtures, LatestConformance):
    pass


class TestMinistackRace(MinistackFixtures, RaceConformance):
    pass


def test_aborted_multipart_upload_is_aborted(ministack_backend: Backend) -> None:
    check_aborted_multipart_upload_is_aborted(ministack_backend)
