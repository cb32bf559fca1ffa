"""Azure emulator: azurite's blob service (npm ``azurite@3``) in memory, with its well-known
development account."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckptfs.testing.servers.info import DEFAULT_BUCKET, ServerInfo, ServerStartError
from ckptfs.testing.servers.process import run_server

# Azurite's well-known development account (published in Azure's docs; not a
# secret).
_AZURITE_ACCOUNT = "devstoreaccount1"
_AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

# ckptfs/testing/servers/azure.py -> the repository root (for <repo>/.tools).
_REPO_ROOT = Path(__file__).resolve().parents[3]


def azurite_binary() -> Path | str:
    """Find ``azurite-blob``: ``$CKPTFS_AZURITE``, then
    ``<repo>/.tools/node_modules/.bin/azurite-blob``, then ``PATH``.  Returns
    a reason string if none is found."""
    override = os.environ.get("CKPTFS_AZURITE")
    if override:
        return (
            Path(override)
            if Path(override).is_file()
            else f"CKPTFS_AZURITE={override!r} is not a file"
        )
    local = _REPO_ROOT / ".tools" / "node_modules" / ".bin" / "azurite-blob"
    if local.is_file():
        return local
    found = shutil.which("azurite-blob")
    if found:
        return Path(found)
    return (
        "azurite-blob not found (set CKPTFS_AZURITE, install npm azurite@3 into "
        f"{local.parent.parent.parent}, or put it on PATH)"
    )


def azurite_connection_string(endpoint: str) -> str:
    return (
        "DefaultEndpointsProtocol=http;"
        f"AccountName={_AZURITE_ACCOUNT};"
        f"AccountKey={_AZURITE_KEY};"
        f"BlobEndpoint={endpoint}/{_AZURITE_ACCOUNT};"
    )


def _az_options(endpoint: str) -> dict[str, Any]:
    # adlfs ignores ls(refresh=True); use_listings_cache=False is what works.
    return {
        "connection_string": azurite_connection_string(endpoint),
        "account_name": _AZURITE_ACCOUNT,
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }


def _az_container(endpoint: str, bucket: str, *, delete_first: bool) -> None:
    """(Re)create the container with adlfs's synchronous Azure SDK
    dependency (azure-storage-blob), which is needed anyway to use adlfs."""
    from azure.core.exceptions import ResourceExistsError, ResourceNotFoundError
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(azurite_connection_string(endpoint)) as svc:
        if delete_first:
            with contextlib.suppress(ResourceNotFoundError):
                svc.delete_container(bucket)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                svc.create_container(bucket)
                return
            except ResourceExistsError:
                if not delete_first:
                    return
                # Deleted container still being removed ("ContainerBeingDeleted").
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@contextlib.contextmanager
def azurite_server(bucket: str = DEFAULT_BUCKET) -> Iterator[ServerInfo]:
    """Run azurite's blob service (npm ``azurite@3``) in memory.

    Found via `azurite_binary`.  ``--skipApiVersionCheck`` because the
    Azure SDK installed with adlfs is usually newer than the API versions
    azurite knows and would otherwise be refused.  ``reset()`` deletes and
    re-creates the container, which also drops uncommitted blocks.
    """
    binary = azurite_binary()
    if isinstance(binary, str):
        raise ServerStartError(binary)
    with run_server(
        "azurite",
        lambda port, _wd: [
            str(binary),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--disableTelemetry",
            "--skipApiVersionCheck",
            # No --location: azurite refuses it together with
            # --inMemoryPersistence.  cwd is a private temporary directory.
        ],
        "/",
    ) as (proc, port, _wd, log_path):
        endpoint = f"http://127.0.0.1:{port}"
        _az_container(endpoint, bucket, delete_first=False)
        yield ServerInfo(
            name="azurite",
            protocol="az",
            endpoint=f"{endpoint}/{_AZURITE_ACCOUNT}",
            storage_options=_az_options(endpoint),
            bucket=bucket,
            env={"AZURE_STORAGE_CONNECTION_STRING": azurite_connection_string(endpoint)},
            reset=lambda: _az_container(endpoint, bucket, delete_first=True),
            pid=proc.pid,
            log_path=str(log_path),
        )
