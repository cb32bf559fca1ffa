"""Saves bounded in time (docs/reliability.md "Bounded saves").

Every save path with a deadline (``save_deadline_s``) commits or fails within it: a storage
that stalls one file's write forever (memory:// or local disk behind `FaultyStorage`, whose
hook blocks; S3 on moto behind a TCP proxy that stops forwarding) makes the save raise
`SaveDeadlineError` (a ``TimeoutError``) naming the rank, the stalled file and how long it
made no progress, within the deadline plus a small slack; nothing is committed, not even
after the stalled request is let go.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dist_util import run_ranks

import ckptfs
from ckptfs.errors import (
    ReplicationError,
    SaveDeadlineError,
    ShardedSaveDeadlineError,
    ShardedSaveError,
)
from ckptfs.protocol.copy import copy_step
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.testing.faults import FaultyStorage

#: Long enough for everything a save or copy does before its stalled write (planning, the
#: source's listing) on a loaded 2-core machine: at 1 s the torch 2.6 matrix once timed a copy
#: out during its listing of the source, not at the stalled write the test names.
DEADLINE = 2.0
#: Allowed past the deadline: the hand-over of the error, the attempt's clean-up started in
#: the background, a loaded 2-core machine.
SLACK = 1.5


class Stall:
    """A `FaultyStorage` hook that blocks every streamed write of a tensor file whose path
    holds ``part`` until released (as a stalled upload would, forever)."""

    def __init__(self, part: str = "") -> None:
        self.part = part
        self.release = threading.Event()
        self.stalled = threading.Event()

    def __call__(self, op: str, path: str) -> None:
        if op == "write" and path.endswith(".safetensors") and self.part in path:
            self.stalled.set()
            self.release.wait()


def state(mib: float = 1.0) -> dict[str, Any]:
    n = int(mib * 2**20) // 4
    return {"model": {"w": torch.arange(n, dtype=torch.float32)}, "trainer": {"step": 1}}


def stalling_store(url: str, stall: Stall, **kwargs: Any) -> CheckpointStore:
    return CheckpointStore(FaultyStorage(FsspecStorage(url), hook=stall), **kwargs)


def assert_deadline_error(exc: BaseException, elapsed: float, deadline: float,
                          where: str) -> None:
    assert isinstance(exc, SaveDeadlineError) and isinstance(exc, TimeoutError), exc
    assert deadline - 0.05 <= elapsed <= deadline + SLACK, (elapsed, exc)
    msg = str(exc)
    assert where in msg, msg
    assert "made no progress for" in msg and f"deadline of {deadline:g} s" in msg, msg
    assert "nothing was committed" in msg, msg


def assert_never_committed(store: CheckpointStore, stall: Stall) -> None:
    """No marker now, nor once the stalled request is let go (it is never completed)."""
    assert store.steps() == []
    stall.release.set()
    time.sleep(0.3)
    assert store.steps() == []


def test_open_takes_the_deadline() -> None:
    assert ckptfs.open("memory://deadline-open", save_deadline_s=2).save_deadline_s == 2.0
    assert ckptfs.open("memory://deadline-open").save_deadline_s is None
    with pytest.raises(ValueError, match="save_deadline_s"):
        ckptfs.open("memory://deadline-open", save_deadline_s=0)


def test_a_progressing_save_within_the_deadline_commits(tmp_path: Any) -> None:
    store = ckptfs.open(str(tmp_path), save_deadline_s=30)
    info = store.save(1, state(4))
    assert store.steps() == [1] and info.step == 1
    assert torch.equal(store.load(1)["model"]["w"], state(4)["model"]["w"])
    fut = store.save_async(2, state(4))
    assert fut.result(timeout=60).step == 2


def test_single_process_save_fails_within_the_deadline() -> None:
    stall = Stall()
    store = stalling_store("memory://deadline-single", stall, save_deadline_s=DEADLINE)
    t0 = time.monotonic()
    with pytest.raises(SaveDeadlineError) as err:
        store.save(1, state())
    elapsed = time.monotonic() - t0
    assert_deadline_error(err.value, elapsed, DEADLINE, "tensors-00000.safetensors")
    assert err.value.rank is None and err.value.path.endswith("tensors-00000.safetensors")
    assert err.value.stalled_s is not None and err.value.stalled_s <= DEADLINE + 0.1
    assert_never_committed(store, stall)
    assert store.save(2, state()).step == 2  # the next save starts afresh


def test_save_async_fails_within_the_deadline() -> None:
    stall = Stall()
    store = stalling_store("memory://deadline-async", stall, save_deadline_s=DEADLINE)
    t0 = time.monotonic()
    fut = store.save_async(1, state())
    exc = fut.exception(timeout=DEADLINE + 30)
    elapsed = time.monotonic() - t0
    assert exc is not None
    assert_deadline_error(exc, elapsed, DEADLINE, "tensors-00000.safetensors")
    with pytest.raises(SaveDeadlineError):
        fut.result()
    assert_never_committed(store, stall)


def test_tiered_local_save_and_replication_fail_within_the_deadline() -> None:
    # The local tier stalls: the save itself fails within the deadline.
    stall = Stall()
    local = stalling_store("memory://deadline-tier-local", stall, save_deadline_s=DEADLINE)
    remote = CheckpointStore(FsspecStorage("memory://deadline-tier-remote"))
    store = ckptfs.tiered(local, remote, max_attempts=1)
    try:
        t0 = time.monotonic()
        with pytest.raises(SaveDeadlineError) as err:
            store.save(1, state())
        assert_deadline_error(err.value, time.monotonic() - t0, DEADLINE, "tensors-00000")
        assert_never_committed(local, stall)
    finally:
        store.close()

    # The remote tier stalls: the local save commits, its replication fails within the
    # deadline (max_attempts=1: failed for good), and the remote holds no step.
    stall = Stall()
    local = CheckpointStore(FsspecStorage("memory://deadline-tier-local2"),
                            save_deadline_s=DEADLINE)
    remote = stalling_store("memory://deadline-tier-remote2", stall)
    store = ckptfs.tiered(local, remote, max_attempts=1)
    try:
        store.save(1, state())
        t0 = time.monotonic()
        with pytest.raises(ReplicationError):
            store.wait_replicated(timeout=DEADLINE + 30)
        elapsed = time.monotonic() - t0
        assert elapsed <= DEADLINE + SLACK, elapsed
        status = store.replication()
        error = status.steps[1].error or ""
        assert status.steps[1].state == "failed", status
        assert error.startswith("SaveDeadlineError: copy of step 1 to memory://"), error
        assert "tensors-00000.safetensors made no progress" in error, error
        assert local.steps() == [1]
        assert_never_committed(remote, stall)
    finally:
        store.close()


def test_copy_fails_within_the_deadline() -> None:
    src = CheckpointStore(FsspecStorage("memory://deadline-copy-src"))
    src.save(1, state())
    stall = Stall()
    dst = stalling_store("memory://deadline-copy-dst", stall)
    t0 = time.monotonic()
    with pytest.raises(SaveDeadlineError) as err:
        copy_step(src.storage, dst.storage, 1, deadline_s=DEADLINE)
    assert_deadline_error(err.value, time.monotonic() - t0, DEADLINE,
                          "tensors-00000.safetensors")
    assert str(err.value).startswith("copy of step 1 to memory://deadline-copy-dst")
    assert_never_committed(dst, stall)


# -- a collective save on 2 gloo ranks, rank 1 stalling ------------------------------------------


def job_collective_stall(rank: int, world: int, root: str, deadline: float) -> Any:
    stall = Stall("rank-00001/" if rank == 1 else "no file of rank 0")
    store = stalling_store(root, stall, save_deadline_s=deadline)
    t0 = time.monotonic()
    try:
        store.save(5, {"model": {f"w{rank}": torch.full((1 << 16,), float(rank))},
                       "trainer": {"step": 5}})
    except ShardedSaveError as exc:
        out: Any = (type(exc).__name__, str(exc), sorted(exc.failures),
                    isinstance(exc, SaveDeadlineError), isinstance(exc, TimeoutError))
    else:
        out = None
    elapsed = time.monotonic() - t0
    stall.release.set()
    return out, elapsed


@pytest.mark.sharded
def test_collective_save_fails_on_every_rank_naming_the_stalled_rank(tmp_path: Any) -> None:
    deadline = 2.0
    root = str(tmp_path / "run")
    results = run_ranks(job_collective_stall, 2, root, deadline, timeout=120, pg_timeout=60)
    for rank, (out, elapsed) in enumerate(results):
        assert out is not None, f"rank {rank} did not fail"
        name, msg, failures, is_deadline, is_timeout = out
        assert name == ShardedSaveDeadlineError.__name__ and is_deadline and is_timeout, out
        assert failures == [1], out
        assert "rank 1: SaveDeadlineError: rank 1: sharded save of step 5" in msg, msg
        assert "made no progress for" in msg and ".safetensors" in msg, msg
        # No rank waits past the deadline (+ the collective's hand-over of the failure).
        assert elapsed <= deadline + SLACK + 1.0, (rank, elapsed)
    assert ckptfs.open(root).steps() == []


# -- S3 (moto) behind a proxy that stops forwarding ----------------------------------------------


class StallingProxy:
    """A TCP proxy on a loopback port in front of ``upstream`` (host, port): it forwards both
    ways until a connection has sent ``limit`` bytes upstream (once ``armed``), then stops
    reading from that client (the request hangs, as on a stalled network path)."""

    def __init__(self, upstream: tuple[str, int], limit: int) -> None:
        self.upstream = upstream
        self.limit = limit
        self.armed = threading.Event()
        self.stalled = threading.Event()
        self.closing = threading.Event()
        self.sockets: list[socket.socket] = []
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:  # the server is gone (teardown): drop the client
                client.close()
                continue
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        sent = 0
        try:
            while True:
                if upstream and self.armed.is_set() and sent >= self.limit:
                    self.stalled.set()
                    self.closing.wait()  # stop forwarding: the client's request hangs
                    return
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
                if upstream and self.armed.is_set():
                    sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closing.set()
        self.listener.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture
def proxy_s3(s3_backend: Any) -> Iterator[tuple[StallingProxy, str, dict[str, Any]]]:
    options = dict(s3_backend.options)
    endpoint = str(options["endpoint_url"])
    host, port = endpoint.split("//", 1)[1].rstrip("/").split(":")
    proxy = StallingProxy((host, int(port)), limit=1 << 20)
    options["endpoint_url"] = f"http://127.0.0.1:{proxy.port}"
    try:
        yield proxy, s3_backend.url, options
    finally:
        proxy.close()


def test_s3_save_behind_a_stalling_network_fails_within_the_deadline(
        proxy_s3: tuple[StallingProxy, str, dict[str, Any]], s3_backend: Any) -> None:
    proxy, url, options = proxy_s3
    store = ckptfs.open(url, save_deadline_s=3.0, **options)
    proxy.armed.set()
    t0 = time.monotonic()
    with pytest.raises(SaveDeadlineError) as err:
        store.save(1, state(12))  # larger than one 8 MiB part: a multipart upload
    elapsed = time.monotonic() - t0
    assert proxy.stalled.is_set()
    assert_deadline_error(err.value, elapsed, 3.0, "tensors-00000.safetensors")
    proxy.armed.clear()
    fresh = s3_backend.open()  # straight to moto: no marker, no completed tensor object
    assert fresh.steps() == []
    tensors = [e.name for e in fresh.storage.list_tree("checkpoints")
               if e.name.endswith(".safetensors")]
    assert tensors == [], tensors  # the multipart upload was never completed
