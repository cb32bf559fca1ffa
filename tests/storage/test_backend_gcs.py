"""The conformance suite on GCS through gcsfs against fake-gcs-server."""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.request
from typing import Any

import pytest

from ckptfs.storage.fsspec import FsspecStorage
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


# -- resumable-upload hygiene ------------------------------------------------------------------

MiB = 2**20


def _abort_mid_write(backend: Backend) -> tuple[FsspecStorage, str, list[tuple[str, str]]]:
    """Write more than one 16 MiB chunk (a resumable session with data in it), then fail."""
    st = FsspecStorage(backend.url, **backend.options)
    calls: list[tuple[str, str]] = []
    real_call = st.fs.call

    def spy(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        calls.append((method, str(path)))
        return real_call(method, path, *args, **kwargs)

    st.fs.call = spy
    location = ""
    with pytest.raises(RuntimeError), st.open_write("big/file.bin") as f:
        for _ in range(17):
            f.write(b"x" * MiB)
        location = str(f._f.location)  # type: ignore[attr-defined]
        assert "upload_id=" in location
        raise RuntimeError("writer killed mid-file")
    return st, location, calls


def test_aborted_resumable_upload_creates_nothing(gcs_backend: Backend) -> None:
    _, location, calls = _abort_mid_write(gcs_backend)
    assert ("DELETE", location) in calls  # the session was cancelled
    assert not gcs_backend.raw_exists("big/file.bin")
    assert gcs_backend.raw_files() == {}


@pytest.mark.xfail(strict=True, reason="fake-gcs-server answers the cancel (DELETE of the "
                   "session URL) with 499 like GCS, but keeps accepting chunks and finalizes "
                   "the object; real GCS refuses a cancelled session with 499/404")
def test_cancelled_session_cannot_be_finished(gcs_backend: Backend) -> None:
    _, location, _ = _abort_mid_write(gcs_backend)
    size = 17 * MiB
    req = urllib.request.Request(location, data=b"z", method="PUT",
                                 headers={"Content-Range": f"bytes {size}-{size}/{size + 1}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with contextlib.suppress(urllib.error.HTTPError):
        opener.open(req, timeout=30).close()
    assert not gcs_backend.raw_exists("big/file.bin")
