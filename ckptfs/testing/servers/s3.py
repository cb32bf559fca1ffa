"""S3 emulators: moto (``python -m moto.server``) and MiniStack, two independent
implementations, each in a subprocess with an empty bucket."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ckptfs.testing.servers.info import DEFAULT_BUCKET, ServerInfo, ServerStartError
from ckptfs.testing.servers.process import http_request, run_server

# Test-only credentials.  S3 emulators accept anything; keys must be
# non-empty so botocore signs requests instead of looking for real
# credentials (environment, ~/.aws, instance metadata).
_S3_KEY = "testing"
_S3_SECRET = "testing"


def _s3_options(endpoint: str) -> dict[str, Any]:
    # No region_name in client_kwargs: with a region other than us-east-1
    # bucket creation through s3fs fails on moto (InvalidLocationConstraint).
    return {
        "key": _S3_KEY,
        "secret": _S3_SECRET,
        "endpoint_url": endpoint,
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }


def _s3_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": _S3_KEY,
        "AWS_SECRET_ACCESS_KEY": _S3_SECRET,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def _s3_create_bucket(endpoint: str, bucket: str) -> None:
    """Create a bucket with a plain (unsigned) PUT.

    Both emulators accept unsigned requests, and doing it with urllib keeps
    server start independent of the client library under test.
    """
    status, body = http_request("PUT", f"{endpoint}/{bucket}", body=b"")
    if status not in (200, 409):
        raise ServerStartError(
            f"creating bucket {bucket!r} at {endpoint}: HTTP {status}: {body[:500]!r}"
        )


def _s3_reset(endpoint: str, reset_path: str, bucket: str) -> Callable[[], None]:
    def reset() -> None:
        status, body = http_request("POST", f"{endpoint}{reset_path}", body=b"")
        if status != 200:
            raise RuntimeError(f"reset {endpoint}{reset_path}: HTTP {status}: {body[:500]!r}")
        _s3_create_bucket(endpoint, bucket)

    return reset


@contextlib.contextmanager
def moto_server(
    bucket: str = DEFAULT_BUCKET, extra_env: Mapping[str, str] | None = None
) -> Iterator[ServerInfo]:
    """Run moto's S3 server (``python -m moto.server``) in a subprocess.

    A subprocess rather than ``ThreadedMotoServer`` so that the server does
    not compete for this process's GIL (benchmarks and thread races in the
    test would be distorted) and so that a crash or hang cannot take the test
    process with it.  moto keeps everything in memory (about 1 GiB RSS after
    1 GiB written): reset between tests that write a lot.

    ``reset()`` is ``POST /moto-api/reset`` (wipes every service) followed by
    re-creating the bucket.  ``extra_env`` goes to the server process, e.g.
    ``{"INITIAL_NO_AUTH_ACTION_COUNT": "1"}`` for a server that checks
    credentials after its first request (moto accepts any key by default).
    """
    with run_server(
        "moto",
        lambda port, _wd: [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        "/moto-api/",
        make_env=(lambda _port, _wd: dict(extra_env or {})),
    ) as (proc, port, _wd, log_path):
        endpoint = f"http://127.0.0.1:{port}"
        _s3_create_bucket(endpoint, bucket)
        yield ServerInfo(
            name="moto",
            protocol="s3",
            endpoint=endpoint,
            storage_options=_s3_options(endpoint),
            bucket=bucket,
            env=_s3_env(endpoint),
            reset=_s3_reset(endpoint, "/moto-api/reset", bucket),
            pid=proc.pid,
            log_path=str(log_path),
        )


@contextlib.contextmanager
def ministack_server(bucket: str = DEFAULT_BUCKET) -> Iterator[ServerInfo]:
    """Run MiniStack with only S3 enabled (``python -m ministack``).

    A second, independent S3 implementation: where it and moto disagree, the
    client code is relying on one server's quirks.  Notably its 412 has no
    ``Condition`` element, so s3fs raises ``OSError`` rather than
    ``FileExistsError`` for a failed create-only write.

    ``BIND_HOST=127.0.0.1`` because it binds every interface by default;
    ``S3_PERSIST=0``/``PERSIST_STATE=0`` and private ``STATE_DIR``/
    ``S3_DATA_DIR`` so that parallel runs never share state through ``/tmp``.
    ``reset()`` is ``POST /_ministack/reset`` and re-creating the bucket.
    """

    def env(port: int, workdir: Path) -> dict[str, str]:
        return {
            "GATEWAY_PORT": str(port),
            "BIND_HOST": "127.0.0.1",
            "SERVICES": "s3",
            "S3_PERSIST": "0",
            "PERSIST_STATE": "0",
            "STATE_DIR": str(workdir / "state"),
            "S3_DATA_DIR": str(workdir / "s3"),
            "LOG_LEVEL": "WARNING",
        }

    with run_server(
        "ministack",
        lambda _port, _wd: [sys.executable, "-m", "ministack"],
        "/_ministack/health",
        make_env=env,
    ) as (proc, port, _wd, log_path):
        endpoint = f"http://127.0.0.1:{port}"
        _s3_create_bucket(endpoint, bucket)
        yield ServerInfo(
            name="ministack",
            protocol="s3",
            endpoint=endpoint,
            storage_options=_s3_options(endpoint),
            bucket=bucket,
            env=_s3_env(endpoint),
            reset=_s3_reset(endpoint, "/_ministack/reset", bucket),
            pid=proc.pid,
            log_path=str(log_path),
        )
