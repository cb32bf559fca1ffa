"""Process and port machinery shared by every server: a free loopback port, a subprocess in
its own process group with its output in a log file, waiting until it answers over HTTP
(retrying on a port lost to another process), and stopping the whole group.

`run_server` reads `START_TIMEOUT` from this module at call time, so tests can lower
it here (``ckptfs.testing.servers.process.START_TIMEOUT``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from ckptfs.testing.servers.info import ServerStartError

#: Seconds to wait for a server to answer before giving up.  Generous because
#: the machines running tests have 2 shared cores and moto's imports alone take
#: a few seconds when the machine is busy.
START_TIMEOUT = 30.0

#: Seconds to wait after SIGTERM before SIGKILL.
STOP_TIMEOUT = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that is free right now.

    The OS picks it (bind to port 0) because fixed ports collide between
    parallel test runs.  Another process may take it before the server binds
    it; `run_server` retries on "address in use".
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


def http_request(
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
        http_request("GET", url, timeout=2.0)
    except (OSError, urllib.error.URLError):
        return False
    return True


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``proc`` and its process group: SIGTERM, then SIGKILL after
    `STOP_TIMEOUT` seconds.  Only the group created for this server is
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
def run_server(
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
