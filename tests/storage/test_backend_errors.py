"""Bad input and faults on real servers: a typed ckptfs error naming the URL and the cause, raised
at ``ckptfs.open`` (one bounded probe of the bucket) before anything is written; never a raw
botocore / google / azure exception, never a multi-minute hang."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

import ckptfs
from ckptfs.errors import (
    BackendUnavailableError,
    CkptfsError,
    StorageAccessError,
    StorageError,
    StorageNotFoundError,
)
from ckptfs.testing import servers
from ckptfs.testing.conformance import small_state
from ckptfs.testing.servers import ServerInfo, free_port

SERVER_FIXTURES = ["moto", "ministack", "fake_gcs", "azurite"]

#: Generous bound for "fails in seconds": the probe gives up after 10 s; without it gcsfs retries
#: a refused connection for about 67 s and adlfs for about 90 s (measured), botocore's legacy
#: mode about 12 s.  Not a speed claim, a guard against the library's multi-minute retries.
UNREACHABLE_BOUND_S = 45.0


@pytest.fixture(params=SERVER_FIXTURES)
def server(request: pytest.FixtureRequest) -> ServerInfo:
    info: ServerInfo = request.getfixturevalue(request.param)
    info.reset()
    return info


def _assert_typed(exc: BaseException, url: str) -> None:
    assert isinstance(exc, CkptfsError), f"raw exception escaped: {type(exc)!r}: {exc}"
    assert type(exc).__module__ == "ckptfs.errors"
    assert url in str(exc), str(exc)


def _raw_files(info: ServerInfo) -> list[str]:
    fs = info.filesystem()
    return [str(p) for p in fs.find(info.bucket)]


# -- missing bucket ----------------------------------------------------------------------------


def test_missing_bucket_fails_at_open(server: ServerInfo) -> None:
    url = f"{server.protocol}://no-such-bucket-ckptfs/run"
    with pytest.raises(StorageNotFoundError) as ei:
        ckptfs.open(url, **server.storage_options)
    _assert_typed(ei.value, url)
    assert "no-such-bucket-ckptfs" in str(ei.value) and "does not exist" in str(ei.value)


def test_missing_bucket_without_probe_is_typed_on_save(server: ServerInfo) -> None:
    """With the open-time probe off, the first write fails typed (not a raw library error)."""
    url = f"{server.protocol}://no-such-bucket-ckptfs/run"
    store = ckptfs.open(url, probe=False, **server.storage_options)
    with pytest.raises(StorageNotFoundError) as ei:
        store.save(1, small_state())
    _assert_typed(ei.value, url)
    assert store.steps() == []


# -- unreachable endpoint ----------------------------------------------------------------------


def _dead_options(protocol: str) -> dict[str, Any]:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    if protocol == "s3":
        return {"key": "k", "secret": "s", "endpoint_url": endpoint}
    if protocol == "gs":
        return {"token": "anon", "endpoint_url": endpoint, "project": "test"}
    return {"connection_string": servers.azurite_connection_string(endpoint)}


@pytest.mark.parametrize("protocol", ["s3", "gs", "az"])
def test_unreachable_endpoint_fails_fast_at_open(protocol: str) -> None:
    url = f"{protocol}://bucket/run"
    t0 = time.monotonic()
    with pytest.raises(StorageError) as ei:
        ckptfs.open(url, **_dead_options(protocol))
    elapsed = time.monotonic() - t0
    _assert_typed(ei.value, url)
    msg = str(ei.value).lower()
    assert "connect" in msg and "127.0.0.1" in msg, msg
    assert elapsed < UNREACHABLE_BOUND_S, f"took {elapsed:.0f} s"


# -- wrong credentials -------------------------------------------------------------------------


def test_wrong_azure_key_fails_at_open(azurite: ServerInfo) -> None:
    azurite.reset()
    options = dict(azurite.storage_options)
    options["connection_string"] = options["connection_string"].replace("AccountKey=Eby8",
                                                                        "AccountKey=Xby8")
    url = azurite.url("run")
    with pytest.raises(StorageAccessError) as ei:
        ckptfs.open(url, **options)
    _assert_typed(ei.value, url)
    assert "authenticate" in str(ei.value) and "credentials" in str(ei.value)
    assert _raw_files(azurite) == []


@pytest.fixture(scope="module")
def moto_with_auth() -> Iterator[ServerInfo]:
    """A moto server that checks credentials (after its first, bucket-creating request): it
    knows no access key, so every key is wrong."""
    with servers.moto_server(extra_env={"INITIAL_NO_AUTH_ACTION_COUNT": "1"}) as info:
        yield info


def test_wrong_s3_credentials_fail_at_open(moto_with_auth: ServerInfo) -> None:
    url = moto_with_auth.url("run")
    with pytest.raises(StorageAccessError) as ei:
        ckptfs.open(url, **{**moto_with_auth.storage_options, "secret": "wrong"})
    _assert_typed(ei.value, url)
    assert "403" in str(ei.value) and "credentials" in str(ei.value)


def test_wrong_credentials_without_probe_typed_on_save(moto_with_auth: ServerInfo) -> None:
    url = moto_with_auth.url("run2")
    store = ckptfs.open(url, probe=False, **{**moto_with_auth.storage_options, "secret": "x"})
    with pytest.raises(StorageAccessError) as ei:
        store.save(1, small_state())
    _assert_typed(ei.value, url)


# -- bucket names the service rejects -----------------------------------------------------------


def test_s3_bad_bucket_name_gives_reason(moto: ServerInfo) -> None:
    url = "s3://Bad_Name!/run"
    with pytest.raises(StorageError) as ei:
        ckptfs.open(url, **moto.storage_options)
    _assert_typed(ei.value, url)
    assert "Invalid bucket name" in str(ei.value)


def test_azure_bad_container_name_gives_reason(azurite: ServerInfo) -> None:
    url = "az://Bad_Name/run"
    with pytest.raises(StorageError) as ei:
        ckptfs.open(url, **azurite.storage_options)
    _assert_typed(ei.value, url)
    assert "invalid characters" in str(ei.value)
    assert "RequestId" not in str(ei.value)  # the service's reason, not its response dump


def test_gcs_bad_bucket_name_is_typed(fake_gcs: ServerInfo) -> None:
    """fake-gcs-server answers 404 for an invalid name (real GCS answers 400 with a reason);
    either way the error is typed and names the URL."""
    url = "gs://Bad_Name!/run"
    with pytest.raises(StorageError) as ei:
        ckptfs.open(url, **fake_gcs.storage_options)
    _assert_typed(ei.value, url)


# -- other bad input ---------------------------------------------------------------------------


def test_unknown_protocol() -> None:
    with pytest.raises(BackendUnavailableError) as ei:
        ckptfs.open("nosuchproto://x/y")
    assert "nosuchproto" in str(ei.value)


def test_bad_storage_option_is_typed(moto: ServerInfo) -> None:
    url = moto.url("run")
    with pytest.raises(CkptfsError) as ei:
        ckptfs.open(url, **moto.storage_options, no_such_option_xyz=1)
    _assert_typed(ei.value, url)


def test_local_root_is_a_file(tmp_path: Any) -> None:
    root = tmp_path / "file"
    root.write_bytes(b"not a directory")
    store = ckptfs.open(str(root))
    with pytest.raises(StorageError) as ei:
        store.save(1, small_state())
    _assert_typed(ei.value, str(root))
    assert root.read_bytes() == b"not a directory"


def test_probe_can_be_skipped(moto: ServerInfo) -> None:
    """``probe=False`` opens without any request (so no error for a missing bucket yet)."""
    moto.reset()
    url = "s3://no-such-bucket-ckptfs/run"
    store = ckptfs.open(url, probe=False, **moto.storage_options)  # no request, no error
    assert store.url == url


def test_endpoint_that_never_answers_is_bounded() -> None:
    """A server that accepts connections but never answers (a hung proxy) is given more time
    than a refused port, then fails typed, saying so."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel accepts connections; nobody ever reads or answers
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        url = "s3://bucket/run"
        t0 = time.monotonic()
        with pytest.raises(StorageError) as ei:
            ckptfs.open(url, key="k", secret="s", endpoint_url=endpoint, probe_timeout=1)
        elapsed = time.monotonic() - t0
    _assert_typed(ei.value, url)
    assert "accepts connections but did not answer" in str(ei.value)
    assert elapsed < UNREACHABLE_BOUND_S, f"took {elapsed:.0f} s"
