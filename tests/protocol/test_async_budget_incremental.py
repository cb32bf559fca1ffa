"""``save_async(..., staging_bytes=B)`` on an incremental store (format v3, docs/async.md
section 5): its reuse is decided on the caller's thread before the call returns (the caller's
tensors hashed as they are at the call), then only the tensors it writes stream through the
budget; a tensor it references (a frozen base) is never copied.  The checkpoint holds the
values at the call, the pool's accounting stays within the budget, and a save whose
referenced checkpoint is deleted before its marker fails with `ProtectorGoneError` instead of
being written again from tensors it did not copy."""

from __future__ import annotations

from typing import Any

import pytest
from test_async_budget import (
    BUDGET,
    Accounting,
    assert_state_equal,
    big_state,
    clone,
    mutate_tensors,
)

import ckptfs
from ckptfs.format.layout import StepPaths
from ckptfs.protocol import commit, staging
from ckptfs.protocol.commit import ProtectorGoneError
from ckptfs.testing.backend import Backend


def _state(frozen: dict[str, Any], step: int) -> dict[str, Any]:
    """A frozen base (the same tensors every step) and a head that changes."""
    return {"base": frozen, "head": big_state(2 * BUDGET, seed=step)["model"],
            "trainer": {"step": step}}


def _mutate_head(state: dict[str, Any]) -> None:
    mutate_tensors(state["head"])
    state["trainer"]["step"] = -1


def _copied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The data pointers of every caller tensor the staging copies."""
    seen: list[int] = []
    real = staging._copy_all

    def spy(pairs: Any) -> None:
        seen.extend(src.data_ptr() for src, _ in pairs)
        real(pairs)

    monkeypatch.setattr(staging, "_copy_all", spy)
    return seen


@pytest.mark.parametrize("where", ["memory", "local"])
def test_an_incremental_save_streams_only_what_it_writes(
        where: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    store = ckptfs.open(backend.open().url, incremental=True)
    Accounting(monkeypatch, BUDGET)
    copied = _copied(monkeypatch)
    frozen = big_state(4 * BUDGET, seed=100)["model"]
    base_ptrs = {t.data_ptr() for t in frozen.values() if t.numel()}
    for step in (1, 2, 3):
        state = _state(frozen, step)
        expected = clone(state)
        copied.clear()
        fut = store.save_async(step, state, staging_bytes=BUDGET)
        _mutate_head(state)  # right after the call returned
        info = fut.result(timeout=120)
        assert info.manifest.format_version == 3
        stats = store.async_stats
        assert stats.streamed == step and stats.unstaged == 0
        assert 0 < stats.staging_peak_live_bytes <= BUDGET
        assert stats.staging_peak_bytes <= BUDGET
        assert_state_equal(store.load(step), expected)
        assert store.verify(step).ok
        if step == 1:  # nothing to reference yet: the base is streamed too
            assert base_ptrs & set(copied)
            assert not info.manifest.references
        else:  # the base referenced, never copied
            assert not base_ptrs & set(copied), "a referenced tensor was staged"
            assert info.manifest.references
            assert info.bytes_written < info.bytes // 2
    assert store.async_stats.pool.live_bytes == 0


def test_a_deleted_protector_fails_the_save_instead_of_writing_it_again(
        local_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint a streamed incremental save references is uncommitted before its
    marker: the save cannot be written again in full (the tensors it references were not
    copied, and may have changed), so its future raises `ProtectorGoneError` saying so;
    nothing of step 2 is left committed, and the next save commits whole."""
    store = ckptfs.open(local_backend.open().url, incremental=True)
    frozen = big_state(4 * BUDGET, seed=100)["model"]
    store.save_async(1, _state(frozen, 1), staging_bytes=BUDGET).result(timeout=120)
    real = commit.fence_protectors

    def gone(storage: Any, protectors: Any, lease: Any) -> None:
        storage.delete(StepPaths(1).marker)  # a concurrent delete of the protector
        real(storage, protectors, lease)

    monkeypatch.setattr(commit, "fence_protectors", gone)
    state = _state(frozen, 2)
    fut = store.save_async(2, state, staging_bytes=BUDGET)
    with pytest.raises(ProtectorGoneError, match="not written again in full"):
        fut.result(timeout=120)
    monkeypatch.setattr(commit, "fence_protectors", real)
    assert store.latest() is None
    assert not local_backend.raw_exists(StepPaths(2).marker)
    state = _state(frozen, 3)
    expected = clone(state)
    info = store.save_async(3, state, staging_bytes=BUDGET).result(timeout=120)
    assert not info.manifest.references  # nothing committed to reference: written whole
    assert_state_equal(store.load(3), expected)
