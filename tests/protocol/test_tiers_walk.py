"""The one walk over a group (``resolve.walk_tiers(..., group=)``, docs/tiers.md "Load across
tiers"): the coordinator lists both tiers and decides, every rank runs ``use`` on each
candidate, a failure on any rank is the candidate's failure on every rank, the remote copy
stands in for a failing local copy only if it is the same checkpoint, and every rank logs what
it used and why.  Two ranks are two threads over an in-process group (the same JSON documents
a process group carries), so the walk's decisions are tested here without gloo;
tests/protocol/test_tiers_sharded.py runs them on real ranks."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.errors import CorruptCheckpointError, TierMismatchError
from ckptfs.protocol.group import Default, Group
from ckptfs.protocol.resolve import CheckpointInfo, Tier, use_step, walk_tiers
from ckptfs.protocol.store import CheckpointStore


class ThreadGroup(Group):
    """Rank ``rank`` of ``world`` threads exchanging JSON documents through shared slots."""

    def __init__(self, rank: int, world: int, shared: dict[str, Any]) -> None:
        self.rank, self.world_size, self.ranks = rank, world, list(range(world))
        self.shared = shared

    def _exchange(self, doc: Any) -> list[Any]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = json.loads(json.dumps(doc))
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    def broadcast(self, doc: Any, src: int = 0, *, default: Default = None) -> Any:
        return self._exchange(doc if self.rank == src else None)[src]

    def all_gather(self, doc: Any, *, default: Default = None) -> list[Any]:
        return self._exchange(doc)


def on_ranks(world: int, fn: Any) -> list[Any]:
    """``fn(group)`` on ``world`` threads; each one's result or exception."""
    shared = {"slots": [None] * world, "barrier": threading.Barrier(world, timeout=30)}
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = fn(ThreadGroup(rank, world, shared))
        except Exception as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def two_tiers(tmp_path: Path, *, same: bool) -> tuple[list[Tier], dict[str, Any]]:
    """Step 1 in a local and a remote tier: the same checkpoint (copied) or another run's."""
    local, remote = ckptfs.open(str(tmp_path / "local")), ckptfs.open(str(tmp_path / "remote"))
    state = {"w": torch.arange(6.0), "step": 1}
    local.save(1, state)
    if same:
        from ckptfs.protocol.copy import copy_step
        copy_step(local.storage, remote.storage, 1)
    else:
        remote.save(1, {"w": torch.zeros(6), "step": 1})
    return [("local", local.storage), ("remote", remote.storage)], state


def loader(tiers: list[Tier], fail_local_on: int | None = None) -> Any:
    """The ``use`` of a rank: load the candidate from its tier; ``fail_local_on``: that rank's
    local loads fail as corrupt."""
    stores = {name: CheckpointStore(st) for name, st in tiers}

    def make(group: Group) -> Any:
        def use(info: CheckpointInfo) -> dict[Any, Any]:
            name = next(n for n, st in tiers if info.url.startswith(st.url + "/"))
            if name == "local" and group.rank == fail_local_on:
                raise CorruptCheckpointError(f"rank {group.rank}: injected digest mismatch",
                                             step=info.step)
            return stores[name].load_info(info)
        return use

    return make


def test_one_ranks_failure_is_every_ranks_and_the_same_remote_copy_stands_in(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tiers, state = two_tiers(tmp_path, same=True)
    make = loader(tiers, fail_local_on=1)
    caplog.set_level(logging.WARNING, logger="ckptfs")
    got = on_ranks(2, lambda g: walk_tiers(tiers, make(g), group=g))
    for found in got:
        assert not isinstance(found, Exception), found
        info, loaded = found
        assert info.url.startswith(tiers[1][1].url) and torch.equal(loaded["w"], state["w"])
    messages = [r.getMessage() for r in caplog.records]
    fails = [m for m in messages if "the local copy of step 1 at" in m and "fails" in m]
    uses = [m for m in messages if "using the remote copy of step 1" in m]
    assert len(fails) == 2 and len(uses) == 2, messages  # the coordinator's and rank 1's
    # A step asked by number: the same rule.
    got = on_ranks(2, lambda g: use_step(tiers, 1, make(g), group=g))
    assert all(f[0].url.startswith(tiers[1][1].url) for f in got), got


def test_another_runs_remote_step_never_stands_in_on_any_rank(tmp_path: Path) -> None:
    tiers, _ = two_tiers(tmp_path, same=False)
    make = loader(tiers, fail_local_on=1)
    got = on_ranks(2, lambda g: walk_tiers(tiers, make(g), group=g))
    assert all(isinstance(e, TierMismatchError) for e in got), got
    assert str(got[0]) == str(got[1])  # the coordinator's error, carried
    got = on_ranks(2, lambda g: walk_tiers(tiers, make(g), group=g, allow_rollback=True))
    assert got == [None, None]  # nothing older to fall back to


def test_the_walk_of_a_group_of_one_is_the_walk(tmp_path: Path) -> None:
    tiers, state = two_tiers(tmp_path, same=True)
    make = loader(tiers)
    found = on_ranks(1, lambda g: walk_tiers(tiers, make(g), group=g))[0]
    assert found[0].url.startswith(tiers[0][1].url) and torch.equal(found[1]["w"], state["w"])


def test_load_into_of_a_single_process_checkpoint_fills_it(tmp_path: Path) -> None:
    """load(into=) reads either layout, on a two-tier store too (it refused format v1)."""
    store = ckptfs.tiered(str(tmp_path / "local"), str(tmp_path / "remote"))
    try:
        store.save(1, {"w": torch.arange(3.0)})
        into = {"w": torch.zeros(3)}
        assert store.load(into=into) is into and torch.equal(into["w"], torch.arange(3.0))
    finally:
        store.close()


@pytest.mark.sharded
@pytest.mark.parametrize("metadata_layout", [None, "per-rank"])
def test_a_store_given_as_the_local_tier_keeps_its_layout(tmp_path: Path,
                                                          metadata_layout: str | None) -> None:
    """``ckptfs.tiered(ckptfs.open(L, layout=, metadata_layout=, divergent_keys=), R)``
    saves with the local store's options (they were dropped: a per-rank store silently
    committed format v1), replicates that format and loads it back."""
    local = ckptfs.open(str(tmp_path / "local"), layout="ranks",
                        metadata_layout=metadata_layout, divergent_keys=["n"])
    store = ckptfs.tiered(local, str(tmp_path / "remote"))
    try:
        assert (store.layout, store.metadata_layout, store.divergent_keys) == (
            local.layout, local.metadata_layout, local.divergent_keys)
        state = {"w": torch.arange(12.0).reshape(3, 4), "n": 1}
        want = 5 if metadata_layout else 2
        assert store.save(3, state).manifest.format_version == want
        store.wait_replicated(3)
        assert store.remote.info(3).manifest.format_version == want
        assert torch.equal(store.remote.load(3)["w"], state["w"])
        into = {"w": torch.zeros(3, 4), "n": 0}
        store.load(into=into)
        assert torch.equal(into["w"], state["w"]) and into["n"] == 1
    finally:
        store.close()
