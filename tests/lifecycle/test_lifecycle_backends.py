"""The lifecycle conformance suite (resume, retention, best, GC through the manager) on every
backend."""

from __future__ import annotations

import pytest

from ckptfs.testing.backend import Backend
from ckptfs.testing.lifecycle import ManagerConformance


class TestLocalManager(ManagerConformance):
    @pytest.fixture
    def backend(self, local_backend: Backend) -> Backend:
        return local_backend


class TestMemoryManager(ManagerConformance):
    @pytest.fixture
    def backend(self, memory_backend: Backend) -> Backend:
        return memory_backend


class TestS3Manager(ManagerConformance):
    @pytest.fixture
    def backend(self, s3_backend: Backend) -> Backend:
        return s3_backend


class TestMinistackManager(ManagerConformance):
    @pytest.fixture
    def backend(self, ministack_backend: Backend) -> Backend:
        return ministack_backend


class TestGcsManager(ManagerConformance):
    @pytest.fixture
    def backend(self, gcs_backend: Backend) -> Backend:
        return gcs_backend


class TestAzureManager(ManagerConformance):
    @pytest.fixture
    def backend(self, azure_backend: Backend) -> Backend:
        return azure_backend
