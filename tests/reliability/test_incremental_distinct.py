"""Distinct places load as distinct tensors on every incremental path.

An incremental save stores equal bytes once: two distinct tensors with the same bytes (AdamW's
per-parameter ``step`` counters, which are equal scalars) are referenced as one stored chunk.
The reader must still give each place its own tensor, as a full save's load does: a resumed
AdamW whose ``step`` tensors came back as one object increments it once per parameter and
diverges silently.  Checked on the incremental cells of tests/paths.py (format v3, its async
save, ``ckptfs cp`` of v3, the remote copy of a two-tier store, format v4 in one process) and
on a real AdamW resumed from an incremental step against one resumed from a full save."""

from __future__ import annotations

from typing import Any

import paths
import pytest
import torch

from ckptfs.format.incremental import references_of
from ckptfs.format.layout import STATE_NAME
from ckptfs.format.serialize import decode_state_doc
from ckptfs.format.versions import SHARDED, features
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.testing.backend import Backend

PARAMS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(8, 5, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _resume(state: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return model, opt


def _aliased_slots(info: CheckpointInfo, backend: Backend) -> int:
    """How many slots of a v3 checkpoint's state document name a stored tensor another slot
    names too (what makes the reader's rule matter)."""
    doc = backend.raw_read(f"{info.path}/{STATE_NAME}")
    _, slots = decode_state_doc(doc, where="test")
    seen = [(s.file, s.name) for s in slots]
    return len(seen) - len(set(seen))


@pytest.mark.parametrize("where", ["memory", "local"])
def test_adamw_resumed_from_an_incremental_step_matches_a_full_save(
        where: str, request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    assert len(list(model.parameters())) == PARAMS
    _train(model, opt, 3, seed=1)
    full = backend.sibling("full").open()
    inc = backend.open(incremental=True)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    inc.save(1, state())
    # Saved again before the next optimizer step (an evaluation checkpoint): every tensor is
    # reused, the four equal step counters from one stored chunk.
    info = inc.save(2, state())
    full.save(2, state())
    assert references_of(info.manifest) and info.bytes_written < info.bytes / 2
    assert _aliased_slots(info, backend) >= PARAMS - 1

    resumed_full = _resume(full.load(2))
    resumed_inc = _resume(backend.open().load(2))  # a new process' store: nothing cached
    for m, o in (resumed_full, resumed_inc):
        _train(m, o, 2, seed=2)
    steps = [s["step"] for s in resumed_inc[1].state_dict()["state"].values()]
    assert [float(s) for s in steps] == [5.0] * PARAMS
    want, got = resumed_full[0].state_dict(), resumed_inc[0].state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k  # bit for bit
    for (_, a), (_, b) in zip(sorted(resumed_full[1].state_dict()["state"].items()),
                              sorted(resumed_inc[1].state_dict()["state"].items()),
                              strict=True):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def _counters_state(shared: torch.Tensor) -> dict[str, Any]:
    """Four distinct scalar tensors with equal bytes, a larger pair with equal bytes, and one
    tensor object at two places (tied: it must stay one object where the format keeps ties)."""
    return {"optim": {str(i): {"step": torch.tensor(3.0)} for i in range(PARAMS)},
            "model": {"a": torch.arange(64, dtype=torch.float32),
                      "b": torch.arange(64, dtype=torch.float32),
                      "tied": shared, "tied_again": shared},
            "n": 1}


def _distinct(tensors: list[torch.Tensor]) -> None:
    assert len({id(t) for t in tensors}) == len(tensors)
    ptrs = [t.untyped_storage().data_ptr() for t in tensors]
    assert len(set(ptrs)) == len(ptrs), ptrs


def _check_loaded(got: dict[str, Any], *, ties: bool) -> None:
    steps = [got["optim"][str(i)]["step"] for i in range(PARAMS)]
    assert all(float(s) == 3.0 for s in steps)
    _distinct([*steps, got["model"]["a"], got["model"]["b"]])
    steps[0].add_(1)  # a write to one place changes no other
    assert [float(s) for s in steps] == [4.0, 3.0, 3.0, 3.0]
    if ties:
        assert got["model"]["tied"] is got["model"]["tied_again"]


CELLS = ["v3", "async", "cp-v3", "replica-v3", "v4", "cp-v4"]


@pytest.mark.parametrize("path", paths.params(CELLS))
def test_equal_bytes_at_distinct_places_load_as_distinct_tensors(
        memory_backend: Backend, path: paths.WritePath) -> None:
    store = memory_backend.open(incremental=True)
    shared = torch.linspace(0, 1, 32)
    state = _counters_state(shared)
    path.save(store, 1, state)
    info = path.save(store, 2, state)
    assert references_of(info.manifest), "the second save references the first"
    if SHARDED not in features(info.manifest):
        assert _aliased_slots(info, memory_backend) >= PARAMS
    reader = memory_backend.open()
    _check_loaded(reader.load(2), ties=path.format_version == 3)
    _check_loaded(reader.load(2, verify=False), ties=path.format_version == 3)
    got = reader.load(2, keys=["optim", "model/a", "model/b"]) \
        if path.format_version == 3 else None
    if got is not None:
        steps = [got["optim"][str(i)]["step"] for i in range(PARAMS)]
        _distinct([*steps, got["model"]["a"], got["model"]["b"]])
    if path.format_version == 4:
        into = paths.zeros_of(_counters_state(torch.zeros(32)))
        assert reader.load(2, into=into) is into
        _check_loaded(into, ties=False)


def test_mmap_load_of_equal_bytes_gives_each_place_its_memory(local_backend: Backend) -> None:
    """``mmap=True`` (own files mapped, referenced tensors read into memory): two places naming
    one stored tensor still get two tensors, and a write to one never reaches the other."""
    store = local_backend.open(incremental=True)
    state = _counters_state(torch.linspace(0, 1, 32))
    store.save(1, state)
    store.save(2, state)
    got = local_backend.open().load(2, mmap=True)
    _check_loaded(got, ties=True)
