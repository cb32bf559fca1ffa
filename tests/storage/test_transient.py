"""Transient storage failures: with 10-20% of storage calls failing, a save commits a checkpoint
that verifies or fails with a typed error naming the store and leaves no marker; retries are
bounded.  Plus the retry layer's own rules (what is retried, and the ambiguous commit)."""

from __future__ import annotations

import pytest

from ckptfs import open as open_store
from ckptfs.errors import CheckpointExistsError, StorageError, StorageNotFoundError
from ckptfs.storage.retry import RetryingStorage
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage, TransientStorageError
from ckptfs.testing.reliability import raw_storage, state_for, store_on, sweep_transient


@pytest.mark.parametrize("p", [0.1, 0.2])
def test_saves_under_transient_faults(any_backend: Backend, p: float) -> None:
    sweep = sweep_transient(any_backend, trials=4, p=p)
    assert sweep.tried == 4
    assert sweep.counters["faults_injected"] > 0
    assert sweep.counters.get("committed", 0) >= 2  # the retry layer makes most saves succeed
    assert sweep.violations == []


def test_faults_inside_streams_fail_cleanly(memory_backend: Backend) -> None:
    """Every write() of a stream may fail too: the whole file is re-streamed from memory."""
    inner = raw_storage(memory_backend)
    outcomes = []
    for seed in range(10):
        faulty = FaultyStorage(inner, transient_p=0.15, transient_stream_writes=True, seed=seed)
        store = store_on(RetryingStorage(faulty, attempts=4, base_delay=0, max_delay=0))
        try:
            store.save(seed, state_for(seed))
            outcomes.append("ok")
        except StorageError as exc:
            assert memory_backend.url in str(exc)
            assert not memory_backend.raw_exists(f"checkpoints/step-{seed:012d}/COMPLETE")
            outcomes.append("failed")
    assert outcomes.count("ok") >= 5
    reader = memory_backend.open()
    for s in reader.steps():
        reader.verify(s)


class _Flaky:
    """Fails the first ``n`` calls of every method with a retryable error."""

    def __init__(self, inner: object, n: int, exc: Exception | None = None) -> None:
        self.inner, self.n, self.calls = inner, n, 0
        self.exc = exc or TransientStorageError("flaky")

    def __getattr__(self, name: str) -> object:
        target = getattr(self.inner, name)
        if not callable(target):
            return target

        def call(*a: object, **k: object) -> object:
            self.calls += 1
            if self.calls <= self.n:
                raise self.exc
            return target(*a, **k)

        return call


def _retrying(inner: object, attempts: int = 3) -> RetryingStorage:
    return RetryingStorage(inner, attempts=attempts, base_delay=0, max_delay=0)  # type: ignore[arg-type]


def test_retries_are_bounded(memory_backend: Backend) -> None:
    flaky = _Flaky(raw_storage(memory_backend), n=100)
    r = _retrying(flaky, attempts=3)
    with pytest.raises(StorageError, match="failed 3 times, giving up"):
        r.write_bytes("a", b"1")
    assert flaky.calls == 3 and r.retries == 2


def test_recovers_within_the_bound(memory_backend: Backend) -> None:
    flaky = _Flaky(raw_storage(memory_backend), n=2)
    r = _retrying(flaky, attempts=3)
    r.write_bytes("a", b"1")
    assert memory_backend.raw_read("a") == b"1"


def test_permanent_errors_are_not_retried(memory_backend: Backend) -> None:
    flaky = _Flaky(raw_storage(memory_backend), n=100, exc=StorageNotFoundError("gone"))
    r = _retrying(flaky, attempts=5)
    with pytest.raises(StorageNotFoundError):
        r.read_bytes("a")
    assert flaky.calls == 1


def test_ambiguous_commit_is_recognised_as_ours(memory_backend: Backend) -> None:
    """The create took effect, its answer was lost, the retry is told "exists": it is ours."""
    faulty = FaultyStorage(raw_storage(memory_backend))
    faulty.transient_p = 1.0
    faulty.transient_reads = False
    calls = []

    def once(op: str, path: str) -> None:
        calls.append(op)
        if len(calls) > 1:
            faulty.transient_p = 0.0

    faulty.hook = once
    # force the "after" branch for the first call
    faulty._rng.random = iter([0.0, 0.0] + [1.0] * 100).__next__  # type: ignore[method-assign]
    r = _retrying(faulty)
    r.create_exclusive("m", b"mine")
    assert memory_backend.raw_read("m") == b"mine"
    assert faulty.stats.transient_after == 1


def test_retry_never_claims_someone_elses_object(memory_backend: Backend) -> None:
    memory_backend.raw_write("m", b"theirs")
    flaky = _Flaky(raw_storage(memory_backend), n=1)
    r = _retrying(flaky)
    with pytest.raises(CheckpointExistsError):
        r.create_exclusive("m", b"mine")
    assert memory_backend.raw_read("m") == b"theirs"


def test_open_wires_the_retry_layer(memory_backend: Backend) -> None:
    assert isinstance(open_store(memory_backend.url).storage, RetryingStorage)
    assert open_store(memory_backend.url, retries=2).storage.attempts == 3  # type: ignore[attr-defined]
    assert not isinstance(open_store(memory_backend.url, retries=0).storage, RetryingStorage)
