"""Start and stop real object-storage servers for tests.

Tests of ``ckptfs`` talk to real S3, GCS and Azure *protocol* implementations
(emulators running as local subprocesses) rather than to in-process mocks,
because the properties we depend on (create-only writes, preconditions,
listing behaviour) are implemented by the server, and mocks tend to agree
with whatever the client library assumes.

Each context manager in `SERVERS` starts one server on a free loopback
port, creates an empty bucket, yields a `ServerInfo` and stops the
server on exit::

    from ckptfs.testing.servers import SERVERS, available

    if (why := available("moto")) is None:
        with SERVERS["moto"]() as srv:
            fs = srv.filesystem()
            fs.pipe_file(srv.url("a.bin"), b"data")
            srv.reset()

This package only imports the standard library at import time; ``fsspec`` (and
through it ``s3fs``/``gcsfs``/``adlfs``) is imported lazily, only where a
client is needed, so that `available` can report a missing package
instead of the import failing.

Traps handled here (see also ``/work/shared/notes/backends.md``):

* Ports are chosen by the OS (bind to port 0) instead of being fixed, because
  fixed ports collide between parallel test runs (``pytest -n``, two
  checkouts on one machine).  There is a small window between closing the
  probe socket and the server binding it; a start that fails with "address in
  use" is retried on a new port.
* Server output goes to a log file, never to a pipe: nobody reads the pipe
  while tests run, it fills up (64 KiB) and the server blocks mid-request.
* Servers run in their own process group so that stopping one also stops any
  child it started (``azurite-blob`` is a node script, ``ministack`` may spawn
  helpers), without touching anything else on the machine.
* ``gcsfs`` must see ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` *before it is
  first imported* when talking to an emulator, otherwise every open makes a
  failing gRPC call that is retried for minutes.  `ServerInfo.env`
  carries it for subprocesses; `ServerInfo.filesystem` sets it (if
  unset) before importing gcsfs.
* Listing caches: s3fs, gcsfs and adlfs cache directory listings per instance
  and fsspec caches instances, so ``storage_options`` always disable both
  (``use_listings_cache=False``, ``skip_instance_cache=True``); otherwise a
  test would see a filesystem bound to a server that has since been stopped,
  or stale listings after another process (or `ServerInfo.reset`) wrote.

Layout (everything public is re-exported here):

- `.info`: `ServerInfo`, `ServerStartError`, the default bucket name.
- `.process`: free ports, starting a server subprocess and waiting for it, stopping its
  process group.  Its `START_TIMEOUT` and `STOP_TIMEOUT` are
  read at call time, so set them there (not re-exported here, where a change would not count).
- `.s3` (moto, ministack), `.gcs` (fake-gcs-server), `.azure` (azurite): one
  module per server family.
- `.registry`: `SERVERS` and `available`.
- ``python -m ckptfs.testing.servers [name ...]``: smoke test of each available server.
"""

from ckptfs.testing.servers.azure import azurite_connection_string as azurite_connection_string
from ckptfs.testing.servers.azure import azurite_server
from ckptfs.testing.servers.gcs import fake_gcs_server
from ckptfs.testing.servers.info import DEFAULT_BUCKET, ServerInfo, ServerStartError
from ckptfs.testing.servers.process import free_port
from ckptfs.testing.servers.registry import SERVERS, available
from ckptfs.testing.servers.s3 import ministack_server, moto_server

__all__ = [
    "DEFAULT_BUCKET",
    "SERVERS",
    "ServerInfo",
    "ServerStartError",
    "available",
    "azurite_server",
    "fake_gcs_server",
    "free_port",
    "ministack_server",
    "moto_server",
]
