"""The conformance suite on S3 through s3fs against a moto server."""

from __future__ import annotations

import pytest

from ckptfs.errors import StorageError
from ckptfs.storage.fsspec import FsspecStorage
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


# -- multipart hygiene -------------------------------------------------------------------------

MiB = 2**20


def _uploads(st: FsspecStorage) -> list[str]:
    return [str(u["Key"]) for u in st.fs.list_multipart_uploads(st.bucket)]


def check_aborted_multipart_upload_is_aborted(backend: Backend) -> None:
    """An exception in the middle of a multi-part write aborts the multipart upload: no
    object, and no open upload left to accumulate storage charges."""
    st = FsspecStorage(backend.url, **backend.options)
    key = st.full("big/file.bin")
    with pytest.raises(RuntimeError), st.open_write("big/file.bin") as f:
        for _ in range(17):  # more than the adapter's 16 MiB part size: a part is uploaded
            f.write(b"x" * MiB)
        assert _uploads(st) == [key.split("/", 1)[1]]  # the multipart upload is under way
        raise RuntimeError("writer killed mid-file")
    assert _uploads(st) == []
    assert not backend.raw_exists("big/file.bin")


def test_aborted_multipart_upload_is_aborted(s3_backend: Backend) -> None:
    check_aborted_multipart_upload_is_aborted(s3_backend)


def test_failed_close_aborts_multipart_upload(s3_backend: Backend) -> None:
    """If completing the upload fails (CompleteMultipartUpload refused, connection lost), the
    upload is aborted too, and the failure is a typed storage error."""
    st = FsspecStorage(s3_backend.url, **s3_backend.options)
    with pytest.raises(StorageError) as ei, st.open_write("big/file.bin") as f:
        for _ in range(17):
            f.write(b"x" * MiB)
        assert len(_uploads(st)) == 1

        def refuse() -> None:
            raise ConnectionResetError("connection lost while completing the upload")

        f._f.commit = refuse  # type: ignore[attr-defined]
    assert "connection lost" in str(ei.value) and s3_backend.url in str(ei.value)
    assert _uploads(st) == []
    assert not s3_backend.raw_exists("big/file.bin")
