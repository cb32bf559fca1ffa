"""What a test gets from a running storage server (`ServerInfo`), the error when one
does not start, and the default bucket name."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

#: Default bucket/container name.  Valid for S3, GCS and Azure alike
#: (lowercase, 3-63 characters, letters, digits and hyphens).
DEFAULT_BUCKET = "ckptfs-test"


class ServerStartError(RuntimeError):
    """A server did not start (exited early or did not answer in time).

    The message includes the tail of the server's log, since that is
    usually the only place the real reason is written.
    """


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """What a test needs to talk to one running storage server.

    Attributes:
        name: key in `SERVERS` (``"moto"``, ``"ministack"``, ``"gcs"``,
            ``"azurite"``).
        protocol: fsspec protocol: ``"s3"``, ``"gs"`` or ``"az"``.
        endpoint: base URL of the server, e.g. ``http://127.0.0.1:40123``.
        storage_options: keyword arguments for ``fsspec.filesystem(protocol,
            **storage_options)`` or ``fsspec.core.url_to_fs(url,
            **storage_options)``.  Treat as read-only (copy before changing):
            the dataclass is frozen but a dict cannot be.
        bucket: name of a bucket (container) that exists and is empty when
            the context manager yields.
        env: environment variables a subprocess needs to reach this server
            with the same library (credentials, endpoint, gcsfs switch).
            Merge into ``os.environ`` for the child, e.g.
            ``subprocess.run(..., env={**os.environ, **srv.env})``.
        reset: callable that empties the server and leaves `bucket`
            existing and empty.  Cheaper than restarting (no process start),
            so fixtures can share one server per session and reset per test.
        pid: process id of the server (for checks that it stopped).
        log_path: the server's combined stdout/stderr log (deleted when the
            context manager exits).
    """

    name: str
    protocol: str
    endpoint: str
    storage_options: dict[str, Any]
    bucket: str
    env: dict[str, str]
    reset: Callable[[], None] = dataclasses.field(repr=False, compare=False)
    pid: int = 0
    log_path: str = ""

    def url(self, path: str = "") -> str:
        """Return ``protocol://bucket/path`` for a path inside the bucket."""
        path = path.lstrip("/")
        return (
            f"{self.protocol}://{self.bucket}/{path}"
            if path
            else f"{self.protocol}://{self.bucket}"
        )

    def filesystem(self) -> Any:
        """Return a fresh fsspec filesystem for this server.

        For ``gs`` this sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` in
        this process's environment (unless already set) before gcsfs is
        imported, and instantiates ``gcsfs.core.GCSFileSystem`` directly so
        that the experimental class is not used even if gcsfs was imported
        earlier without the variable.
        """
        if self.protocol == "gs":
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            from gcsfs.core import GCSFileSystem

            return GCSFileSystem(**self.storage_options)
        import fsspec

        return fsspec.filesystem(self.protocol, **self.storage_options)
