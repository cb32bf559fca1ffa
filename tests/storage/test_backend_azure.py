"""The conformance suite on Azure Blob through adlfs against azurite."""

from __future__ import annotations

import pytest

from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import (
    CommitConformance,
    LatestConformance,
    RaceConformance,
    StorageConformance,
)
from ckptfs.testing.servers import ServerInfo


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


# -- block-blob hygiene ------------------------------------------------------------------------

MiB = 2**20


def test_aborted_block_upload_commits_nothing(azure_backend: Backend,
                                              azurite: ServerInfo) -> None:
    """An exception mid-write leaves staged blocks uncommitted (no Put Block List): no blob
    appears, and the service drops the blocks later."""
    from azure.storage.blob import BlobServiceClient

    st = FsspecStorage(azure_backend.url, **azure_backend.options)
    with pytest.raises(RuntimeError), st.open_write("big/file.bin") as f:
        for _ in range(17):  # more than the adapter's 16 MiB block: a block is staged
            f.write(b"x" * MiB)
        raise RuntimeError("writer killed mid-file")
    assert not azure_backend.raw_exists("big/file.bin")
    blob = st.full("big/file.bin").split("/", 1)[1]
    svc = BlobServiceClient.from_connection_string(azurite.storage_options["connection_string"])
    with svc:
        committed, uncommitted = svc.get_blob_client(azurite.bucket, blob).get_block_list("all")
    assert committed == []
    assert uncommitted, "no block was staged: the test did not exercise a multi-block write"
