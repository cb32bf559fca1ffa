"""The first minutes with a store URL: a protocol without its ``//`` is refused
instead of becoming a local directory, an endpoint whose host cannot be resolved fails at
once naming the host, one that accepts connections but never answers fails after the probe
timeout, and a missing backend package names the extra that installs it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ckptfs
from ckptfs.cli.core import main
from ckptfs.errors import CkptfsError, InvalidURLError, StorageError
from ckptfs.storage.backends import endpoint_of
from ckptfs.storage.fsspec import SLOW_PROBE_FACTOR, FsspecStorage

TYPOS = [
    ("s3:/bucket/run", "s3://bucket/run"),
    ("s3:bucket/run", "s3://bucket/run"),
    ("s3:", "s3://"),
    ("S3:/bucket/run", "s3://bucket/run"),
    ("gs:/bucket/run", "gs://bucket/run"),
    ("gcs:/bucket/run", "gcs://bucket/run"),
    ("gcs:bucket/run", "gcs://bucket/run"),
    ("az:/container/run", "az://container/run"),
    ("abfs:/container/run", "abfs://container/run"),
    ("memory:/run", "memory://run"),
    ("memory:run", "memory://run"),
    ("nosuchproto:/bucket/run", "nosuchproto://bucket/run"),  # unknown, first part ends in ':'
    ("simplecache::s3:/bucket/run", "s3://bucket/run"),       # a chained URL's link
]


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("url", "meant"), TYPOS)
def test_a_protocol_without_its_slashes_is_refused(url: str, meant: str, in_tmp: Path) -> None:
    with pytest.raises(InvalidURLError) as ei:
        ckptfs.open(url)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, CkptfsError)
    msg = str(ei.value)
    assert repr(url) in msg and f"Did you mean {meant!r}" in msg, msg
    assert "local relative path" in msg
    assert list(in_tmp.iterdir()) == []  # nothing made on local disk


@pytest.mark.parametrize("url", ["file:{tmp}/run", "local:{tmp}/run", "./s3:/bucket/run",
                                 "{tmp}/s3:/bucket/run", "run:1/x", "file://{tmp}/run"])
def test_local_forms_that_stay_legal(url: str, in_tmp: Path) -> None:
    """``file:`` and ``local:`` are fsspec's own local prefixes; an explicit ``./`` or an
    absolute path asks for a directory whose name ends in ':'; an unknown ``name:`` followed
    by a name (``run:1``) is a directory name."""
    store = ckptfs.open(url.format(tmp=in_tmp))
    info = store.save(1, {"trainer": {"step": 1}})
    assert info.step == 1 and store.steps() == [1]


def test_every_cli_verb_refuses_the_typo(in_tmp: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["ls", "s3:/bucket/run"], ["latest", "gs:/b/run"],
                 ["verify", "s3:bucket/run"], ["gc", "az:/c/run"],
                 ["cp", "memory://nothing", "s3:/bucket/run"]):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert "Did you mean" in err and "://" in err and "Traceback" not in err, err
    assert list(in_tmp.iterdir()) == []


# -- endpoints: a name that cannot be resolved, a port that never answers --------------------


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                "all_proxy"):
        monkeypatch.delenv(var, raising=False)


UNRESOLVABLE = [
    ("s3://bucket/run", {"endpoint_url": "http://nosuchhost.invalid:9", "key": "testing",
                         "secret": "testing"}),
    ("gs://bucket/run", {"endpoint_url": "http://nosuchhost.invalid:9", "token": "anon"}),
    ("az://container/run", {"connection_string": "DefaultEndpointsProtocol=http;AccountName="
                            "acct;AccountKey=a2V5;BlobEndpoint=http://nosuchhost.invalid:9/acct;"}),
]


@pytest.mark.parametrize(("url", "options"), UNRESOLVABLE, ids=["s3", "gcs", "az"])
def test_an_unresolvable_host_fails_at_once_naming_it(
        url: str, options: dict[str, str], no_proxy: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    started = time.monotonic()
    with pytest.raises(StorageError) as ei:
        ckptfs.open(url, probe_timeout=30, **options)
    took = time.monotonic() - started
    msg = str(ei.value)
    assert "'nosuchhost.invalid'" in msg and "cannot be resolved" in msg, msg
    assert f"cannot open {url}" in msg
    assert took < 6, took  # the resolver's answer, not the 30 s probe


def test_the_endpoint_resolved_is_the_one_the_library_uses(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST",
                "GOOGLE_CLOUD_UNIVERSE_DOMAIN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert endpoint_of("s3", {}) == "https://s3.amazonaws.com"
    assert endpoint_of("s3", {"client_kwargs": {"endpoint_url": "http://h:1"}}) == "http://h:1"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:2")
    assert endpoint_of("s3", {}) == "http://env:2"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    (tmp_path / "config").write_text("[default]\nendpoint_url = http://onprem:9000\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    assert endpoint_of("s3", {}) is None  # botocore's profile decides: not guessed
    assert endpoint_of("gs", {}) == "https://storage.googleapis.com"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    assert endpoint_of("gcs", {}) == "http://127.0.0.1:4443"
    assert endpoint_of("az", {"account_name": "acct"}) == "https://acct.blob.core.windows.net"
    assert endpoint_of("az", {}) is None
    assert endpoint_of("memory", {}) is None and endpoint_of("file", {}) is None


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A loopback port that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            held.append(conn)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        for c in held:
            c.close()
        srv.close()


def test_a_host_that_accepts_but_never_answers_fails_after_the_probe_timeout(
        silent_server: int, no_proxy: None) -> None:
    timeout = 0.5
    started = time.monotonic()
    with pytest.raises(StorageError) as ei:
        ckptfs.open("s3://bucket/run", endpoint_url=f"http://127.0.0.1:{silent_server}",
                    key="testing", secret="testing", probe_timeout=timeout)
    took = time.monotonic() - started
    msg = str(ei.value)
    assert "accepts connections but did not answer" in msg, msg
    assert "cannot be resolved" not in msg
    # probe_timeout, then SLOW_PROBE_FACTOR times more for a server that accepts (plus the
    # two 3 s connection checks at most): never botocore's minute of retries.
    assert timeout <= took < timeout * (1 + SLOW_PROBE_FACTOR) + 8, took


def test_probe_false_skips_the_endpoint_checks(no_proxy: None) -> None:
    store = ckptfs.open("s3://bucket/run", endpoint_url="http://nosuchhost.invalid:9",
                        key="testing", secret="testing", probe=False, retries=0)
    assert store.url == "s3://bucket/run"


# -- a backend whose package is not installed ----------------------------------------------


def test_a_missing_backend_package_names_the_extra() -> None:
    """Each backend's package blocked (``sys.modules[name] = None``, so ``import`` fails) in
    a fresh process, where no filesystem class was cached yet."""
    script = """
import sys
for name in ("s3fs", "gcsfs", "adlfs"):
    sys.modules[name] = None
from ckptfs.errors import BackendUnavailableError
from ckptfs.storage.fsspec import FsspecStorage
for url in ("s3://bucket/run", "gs://bucket/run", "az://container/run"):
    try:
        FsspecStorage(url, probe=False)
    except BackendUnavailableError as exc:
        print(exc)
    else:
        print("opened", url)
"""
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=env, check=True).stdout.splitlines()
    assert len(out) == 3, out
    for line, url, package, extra in zip(
            out, ("s3://bucket/run", "gs://bucket/run", "az://container/run"),
            ("s3fs", "gcsfs", "adlfs"), ("s3", "gcs", "az"), strict=True):
        assert line.startswith(f"cannot open {url}: "), line
        assert f"needs the {package} package" in line
        assert f'pip install "ckptfs[{extra}]"' in line, line


def test_storage_is_checked_before_the_library_is_asked() -> None:
    """The typo check is the storage adapter's, so every way of opening a store has it."""
    with pytest.raises(InvalidURLError):
        FsspecStorage("gs:/bucket/run", probe=False)
