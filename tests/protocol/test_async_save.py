"""``store.save_async`` (docs/async.md): the caller blocks only for the snapshot; the commit runs
in the background on the unchanged synchronous path; errors are never lost; back-pressure,
staging-buffer reuse, exit and kill behaviour; ``CheckpointManager(async_save=True)``."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import enum
import gc
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import ckptfs
from ckptfs.errors import (
    AsyncSaveError,
    CheckpointExistsError,
    InvalidStepError,
    StorageError,
    UnsupportedValueError,
)
from ckptfs.format import extensions
from ckptfs.format.serialize import plan_state, supported_dtypes
from ckptfs.lifecycle.manager import CheckpointManager
from ckptfs.protocol import async_save, collective, snapshot, staging
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.base import Storage
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal
from ckptfs.testing.faults import FaultyStorage, SimulatedCrash
from ckptfs.testing.reliability.common import raw_storage, state_for, store_on

ROOT = Path(__file__).resolve().parents[2]


class Gate:
    """A FaultyStorage hook that holds the background save thread (only that one) at its first
    storage call while the gate is closed: the test then knows the write has not started."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.reached = threading.Event()

    def close(self) -> None:
        self.opened.clear()
        self.reached.clear()

    def open(self) -> None:
        self.opened.set()

    def __call__(self, op: str, path: str) -> None:
        if threading.current_thread().name.startswith("ckptfs-async-save"):
            self.reached.set()
            assert self.opened.wait(60), "gate never opened"


def gated_store(backend: Backend, gate: Gate, **kwargs: Any) -> CheckpointStore:
    return CheckpointStore(FaultyStorage(backend.open().storage, hook=gate), **kwargs)


def rich_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    base = torch.randn(8, 8, generator=g)
    return {
        "model": {"w": w, "w_tied": w, "b": torch.randn(32, generator=g).to(torch.bfloat16),
                  "ids": torch.arange(10, dtype=torch.int64),
                  "t_view": base.t(),  # non-contiguous
                  "offset": torch.arange(10.0)[3:],  # contiguous, storage offset 3
                  "conj": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
                  "grad": torch.randn(4, 4, generator=g, requires_grad=True)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 32, generator=g)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "trainer": {"step": seed, "tag": "run", "blob": b"\x00\x01", "none": None,
                    "dtype": torch.float16, "size": torch.Size([2, 3])},
    }


def clone_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone_state(v) for v in state]
    if isinstance(state, torch.Size):
        return state
    if isinstance(state, tuple):
        return tuple(clone_state(v) for v in state)
    return copy.copy(state)


def mutate(state: dict[str, Any]) -> None:
    """Everything a training step may do to the caller's objects after save_async returned."""
    with torch.no_grad():
        state["model"]["w"].add_(100.0)
        state["model"]["b"].zero_()
        state["model"]["t_view"].fill_(-1.0)
        state["model"]["offset"].fill_(-2.0)
        state["model"]["conj"].mul_(0)
        state["model"]["grad"].mul_(0)
        state["optimizer"]["state"][0]["exp_avg"].copy_(torch.ones(64, 32))
    state["optimizer"]["param_groups"][0]["lr"] = 123.0
    state["optimizer"]["param_groups"][0]["params"].append(99)
    state["trainer"]["step"] = -1
    state["model"]["ids"] = torch.zeros(3)
    del state["trainer"]["tag"]


# -- snapshot semantics --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_mutate_after_return(where: str, request: pytest.FixtureRequest) -> None:
    """save_async returns before the background write starts (the gate holds it), the caller
    then changes every tensor and container: the checkpoint holds the values at call time."""
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    gate = Gate()
    store = gated_store(backend, gate)
    state = rich_state(3)
    expected = clone_state(state)
    gate.close()
    fut = store.save_async(3, state, metadata={"note": ["a"]})
    assert isinstance(fut, async_save.SaveFuture) and not fut.done()
    assert gate.reached.wait(30)  # the background thread is at its first storage call
    mutate(state)
    del state
    gate.open()
    info = fut.result(timeout=120)
    assert info.step == 3 and info.metadata["note"] == ["a"]
    loaded = backend.open().load(3)
    assert_state_equal(loaded, expected)
    # tied weights stay one tensor, as with the synchronous save
    assert loaded["model"]["w"] is loaded["model"]["w_tied"]
    store.close()


def test_snapshot_matches_sync_save_bytes(local_backend: Backend) -> None:
    """The async save of a state writes the same files, byte for byte, as the sync save."""
    store = local_backend.open()
    state = rich_state(5)
    sync = store.save(1, state)
    asyn = store.save_async(2, state).result()
    a = {e.path: e.digest for e in sync.manifest.files}
    b = {e.path: e.digest for e in asyn.manifest.files}
    assert a == b and len(a) >= 2


# -- every value type the sync save accepts, snapshotted at the call ------------------------------


class Point(NamedTuple):
    """A registered container type (a NamedTuple)."""

    x: Any
    y: Any


class Config(dict):  # type: ignore[type-arg]
    """A registered container type (a dict subclass)."""


@dataclasses.dataclass
class OptCfg:
    lr: float
    w: torch.Tensor
    hist: list[int]


class Mood(enum.Enum):
    OK = "ok"
    BAD = "bad"


class Perm(enum.Flag):
    R = 1
    W = 2


_REGISTERED = {"tests.async.Point": Point, "tests.async.Config": Config,
               "tests.async.OptCfg": OptCfg, "tests.async.Mood": Mood, "tests.async.Perm": Perm}


@pytest.fixture
def registered() -> Iterator[None]:
    ckptfs.register_type(Point, lambda p: list(p), lambda v: Point(*v), name="tests.async.Point")
    ckptfs.register_type(Config, lambda c: dict(c), Config, name="tests.async.Config")
    for name in ("tests.async.OptCfg", "tests.async.Mood", "tests.async.Perm"):
        ckptfs.register_type(_REGISTERED[name], name=name)
    yield
    for name in _REGISTERED:
        extensions.unregister_type(name)


def _sample(dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(3, 5, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(3, 5, generator=g) * 3
        return (torch.complex(base, -base) if dtype.is_complex else base).to(dtype)
    return torch.randint(0, 100, (3, 5), generator=g).to(dtype)


def every_value(seed: int) -> dict[str, Any]:
    """Every kind of value the synchronous save accepts (tests/format/test_roundtrip.py,
    tests/format/test_extension_types.py), built the same way each call."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g)

    w, z, base = rnd(8, 4), torch.complex(rnd(5), rnd(5)), rnd(6, 8)
    arr = np.arange(12, dtype=np.float32).reshape(3, 4) + seed
    return {
        "tensors": {**{str(dt): _sample(dt, g) for dt in supported_dtypes()},
                    "scalar": rnd(), "empty_a": torch.empty(0), "empty_b": torch.empty(0),
                    "empty_2d": torch.empty(0, 4, dtype=torch.int64)},
        "views": {"t": base.t(), "strided": base[::2, 1::3], "offset": base.view(-1)[5:20],
                  "expanded": rnd(1, 3).expand(4, 3), "z": z, "conj": z.conj(),
                  "neg": z.conj().imag, "grad": rnd(4).requires_grad_()},
        "tied": {"w": w, "w_again": w, "w_row": w[0], "in_list": [w]},
        "values": {"int_keys": {0: "a", -5: 2**70}, "list": [1, [2, 3], (4, [5])],
                   "mixed": {1: "i", "1": "s", 1.5: None, b"k": True, (1, "a"): (2, 3)},
                   "bytes": b"\x00\xff", "str": "héllo", "none": None, "f": 0.1, "b": False,
                   "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
                   "ordered": OrderedDict(a=1, b=[2])},
        "ext": {"path": pathlib.Path("a/b"), "posix": pathlib.PurePosixPath("/x"),
                "win": pathlib.PureWindowsPath(r"C:\t"), "set": {3, 1, 2},
                "fset": frozenset({"a", "b"}), "device": torch.device("cpu"),
                "ns": argparse.Namespace(lr=0.1, w=rnd(3), tags=["a"]),
                "np": arr, "np_list": [arr[0].copy(), np.arange(3)],
                "np_big_endian": np.arange(4, dtype=">i4"), "np_strided": np.arange(12.0)[::-2],
                "np_str": np.array(["ab", "c"]), "np_scalar": np.float32(1.5),
                "np_int": np.int64(-7), "np_date": np.datetime64("2024-01-02"),
                "mood": Mood.OK, "perm": Perm.R | Perm.W,
                "dataclass": OptCfg(0.1, rnd(2), [1]),
                "point": Point(rnd(2), [1, 2]), "config": Config(lr=0.1, w=rnd(2), hist=[1])},
    }


def mutate_everything(value: Any) -> None:
    """Change in place every mutable object of ``value`` (every tensor's bytes included)."""
    if isinstance(value, torch.Tensor):
        raw = torch.empty(0, dtype=torch.uint8).set_(value.untyped_storage())
        raw.fill_(0x5A)
    elif isinstance(value, np.ndarray):
        value[...] = value.flat[-1] if value.size else value
    elif isinstance(value, dict):
        for v in list(value.values()):
            mutate_everything(v)
        value["mutated"] = 1
    elif isinstance(value, list):
        for v in value:
            mutate_everything(v)
        value.append("mutated")
    elif isinstance(value, tuple):
        for v in value:
            mutate_everything(v)
    elif isinstance(value, set):
        value.add(99)
    elif isinstance(value, argparse.Namespace) or dataclasses.is_dataclass(value):
        for v in list(vars(value).values()):
            mutate_everything(v)
        value.lr = -1.0  # type: ignore[union-attr]


def _digests(info: Any) -> dict[str, str]:
    return {e.path: e.digest for e in info.manifest.files}


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_every_value_type_mutated_after_return_loads_as_at_call(
        where: str, request: pytest.FixtureRequest, registered: None) -> None:
    """Every value type the synchronous save accepts, changed in place right after save_async
    returned (the background write held at its first storage call meanwhile): the checkpoint
    is byte for byte the synchronous save of the same state, unchanged, and loads with the
    same types and the same tied/distinct tensors (conj/neg views as their values, two empty
    tensors as two tensors, registered containers as themselves)."""
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    sync = backend.open().save(100, every_value(7), metadata={"tags": ["a"]})
    gate = Gate()
    store = gated_store(backend, gate)
    state = every_value(7)
    meta = {"tags": ["a"]}
    gate.close()
    fut = store.save_async(1, state, metadata=meta)
    assert gate.reached.wait(30)  # the background save has not written a byte yet
    mutate_everything(state)
    meta["tags"].append("mutated")
    gate.open()
    info = fut.result(timeout=120)
    store.close()
    assert _digests(info) == _digests(sync)
    assert info.metadata == sync.metadata and info.metadata["tags"] == ["a"]
    out = backend.open().load(1)
    ext, tied, tensors = out["ext"], out["tied"], out["tensors"]
    assert type(ext["point"]) is Point and type(ext["config"]) is Config
    assert type(ext["dataclass"]) is OptCfg and type(ext["ns"]) is argparse.Namespace
    assert ext["set"] == {1, 2, 3} and ext["ns"].tags == ["a"] and ext["dataclass"].hist == [1]
    assert [type(a) for a in ext["np_list"]] == [np.ndarray, np.ndarray]
    assert np.array_equal(ext["np"], every_value(7)["ext"]["np"])
    assert tied["w"] is tied["w_again"] is tied["in_list"][0] and tied["w_row"] is not tied["w"]
    assert tensors["empty_a"] is not tensors["empty_b"]
    assert_same(out, backend.open().load(100))


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equal values of exactly the same types, tensors and arrays bit for bit."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, argparse.Namespace) or dataclasses.is_dataclass(a):
        assert_same(vars(a), vars(b), path)
    else:
        assert a == b or (a != a and b != b), path


def test_extension_values_are_snapshotted(memory_backend: Backend, registered: None) -> None:
    """NumPy arrays (also inside a list), sets, Namespaces and registered dataclasses, with the
    tensors inside them, changed after save_async returned: the checkpoint holds them as they
    were at the call (before: as they were when the background thread read them)."""
    gate = Gate()
    store = gated_store(memory_backend, gate)
    arr = np.arange(4, dtype=np.float32)
    state = {"np": [arr], "set": {1, 2}, "ns": argparse.Namespace(w=torch.ones(2), k=[1]),
             "dc": OptCfg(0.5, torch.zeros(2), [7])}
    gate.close()
    fut = store.save_async(1, state)
    assert gate.reached.wait(30)
    arr += 10
    state["set"].add(3)
    state["ns"].w.add_(5)
    state["ns"].k.append(2)
    state["dc"].lr = 9.0
    state["dc"].w.fill_(3)
    gate.open()
    fut.result(timeout=60)
    out = memory_backend.open().load(1)
    assert np.array_equal(out["np"][0], np.arange(4, dtype=np.float32))
    assert out["set"] == {1, 2} and out["ns"].k == [1] and torch.equal(out["ns"].w, torch.ones(2))
    assert out["dc"].lr == 0.5 and torch.equal(out["dc"].w, torch.zeros(2))
    assert memory_backend.open().verify(1).ok


def test_conj_and_neg_views_are_stored_as_their_values(memory_backend: Backend) -> None:
    """A conjugate or negative view next to its base is a different tensor: save_async
    stores each as the synchronous save does (before: as the base)."""
    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    state = {"z": z, "conj": z.conj(), "neg": z.conj().imag, "imag": z.imag}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    store = memory_backend.open()
    info = store.save_async(1, state).result()
    assert _digests(info) == _digests(store.save(2, state))
    out = store.load(1)
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj().resolve_neg()), k
    assert info.metadata["tensor_count"] == 4


def test_distinct_empty_tensors_stay_distinct(memory_backend: Backend) -> None:
    """Two empty tensors (both at address 0) are two tensors, as in the synchronous save."""
    state = {"a": torch.empty(0), "b": torch.empty(0), "c": torch.empty(0, 3)}
    store = memory_backend.open()
    info = store.save_async(1, state).result()
    assert info.metadata["tensor_count"] == store.save(2, state).metadata["tensor_count"] == 3
    out = store.load(1)
    assert out["a"] is not out["b"] and out["c"].shape == (0, 3)


def test_registered_containers_keep_their_type(memory_backend: Backend,
                                               registered: None) -> None:
    """A registered NamedTuple and dict subclass come back as themselves through save_async,
    as through save (before: as a plain tuple and dict)."""
    state = {"p": Point(torch.ones(2), [1]), "c": Config(a=1, t=torch.zeros(1))}
    store = memory_backend.open()
    store.save_async(1, state).result()
    out = store.load(1)
    assert type(out["p"]) is Point and type(out["c"]) is Config
    assert out["c"]["a"] == 1 and torch.equal(out["p"].x, torch.ones(2))


def test_only_the_plans_tensors_are_staged(memory_backend: Backend,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """One identity function: the tensors staged are exactly the serializer's plan tensors
    (numpy data included), one buffer each, and nothing else of the state is traversed."""
    staged: list[list[torch.Tensor]] = []
    real = snapshot.stage

    def spy(pool: staging.StagingPool, tensors: Any) -> staging.Staged:
        staged.append(list(tensors))
        return real(pool, tensors)

    monkeypatch.setattr(snapshot, "stage", spy)
    w = torch.ones(3, dtype=torch.complex64)
    state = {"w": w, "w2": w, "c": w.conj(), "e1": torch.empty(0), "e2": torch.empty(0),
             "arr": [np.zeros(2, dtype=np.float32)], "n": 1}
    memory_backend.open().save_async(1, state).result()
    [tensors] = staged
    assert len(tensors) == plan_state(state).tensor_count == 5


def test_invalid_input_raises_from_save_async(memory_backend: Backend) -> None:
    store = memory_backend.open()
    with pytest.raises(UnsupportedValueError, match="opt/param_groups/0/fn"):
        store.save_async(1, {"opt": {"param_groups": [{"fn": object()}]}})
    with pytest.raises(UnsupportedValueError, match="metadata"):
        store.save_async(1, {"x": torch.zeros(1)}, metadata={"bad": object()})
    with pytest.raises(InvalidStepError):
        store.save_async(-1, {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="max_in_flight"):
        store.save_async(1, {"x": torch.zeros(1)}, max_in_flight=0)
    assert store.async_stats.submitted == 0
    assert store.all_steps() == []
    assert store.async_stats.staging_bytes == 0  # nothing was copied


def test_sharded_state_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                          memory_backend: Backend) -> None:
    """A DTensor (stood in for by a meta tensor here, which the serializer refuses as it
    refuses a DTensor) without torch.distributed initialized cannot be saved collectively:
    save_async refuses it, naming the key path and why, rather than writing one rank's shards
    as a full state (the collective form: tests/protocol/test_async_collective.py)."""
    monkeypatch.setattr(collective, "is_dtensor", lambda t: t.device.type == "meta")
    store = memory_backend.open()
    with pytest.raises(UnsupportedValueError, match=r"'model/layers/1/w'.*not initialized"):
        store.save_async(1, {"model": {"layers": [{"w": torch.ones(1)},
                                                  {"w": torch.ones(1, device="meta")}]}})
    assert store.all_steps() == []


def test_same_step_in_flight_is_refused_at_once(memory_backend: Backend) -> None:
    gate = Gate()
    store = gated_store(memory_backend, gate)
    gate.close()
    fut = store.save_async(1, state_for(1), max_in_flight=2)
    with pytest.raises(CheckpointExistsError, match="in flight"):
        store.save_async(1, state_for(1), max_in_flight=2)
    gate.open()
    assert fut.result(timeout=60).step == 1
    # once committed, the commit protocol refuses it (from the future)
    with pytest.raises(CheckpointExistsError):
        store.save_async(1, state_for(1)).result(timeout=60)


# -- staging buffers and memory --------------------------------------------------------------------


def test_staging_buffers_are_reused(local_backend: Backend) -> None:
    store = local_backend.open()
    state = rich_state(1)
    store.save_async(1, state).result()
    stats = store.async_stats
    first = [b.data_ptr() for b in stats.pool.free_buffers()]
    allocations = stats.staging_allocations
    # one buffer per distinct tensor (the tied weight is staged once)
    assert allocations == 8
    expected_bytes = sum(t.numel() * t.element_size() for k, t in state["model"].items()
                         if k != "w_tied")
    expected_bytes += 64 * 32 * 4
    assert stats.staging_bytes == expected_bytes
    for step in (2, 3, 4):
        with torch.no_grad():
            state["model"]["w"].add_(1.0)
        store.save_async(step, state).result()
        assert [b.data_ptr() for b in stats.pool.free_buffers()] == first
        assert stats.staging_allocations == allocations
    assert stats.staging_reuses == 3 * allocations
    # other shapes: the pool follows the state, the buffers it no longer needs are freed
    store.save_async(5, {"x": torch.zeros(1000)}).result()
    assert stats.staging_bytes == 4000
    store.close()
    assert stats.staging_bytes == 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_peak_extra_memory_is_one_state_plus_64mib(local_backend: Backend) -> None:
    """RSS sampled every millisecond during save_async + result(): the extra over the caller's
    own memory stays within the state's size + 64 MiB, and within 64 MiB once the staging
    buffers exist (the second save)."""
    mib = 1024 * 1024
    state = {f"layer{i}": torch.ones(16 * mib // 4) * i for i in range(8)}  # 128 MiB
    size = 128 * mib
    store = local_backend.open(durable=False)

    def peak_during(step: int) -> int:
        base = _rss()
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.001)

        t = threading.Thread(target=sample)
        t.start()
        try:
            store.save_async(step, state).result()
        finally:
            stop.set()
            t.join()
        return peak[0] - base

    first = peak_during(1)
    second = peak_during(2)
    assert first <= size + 64 * mib, first / mib
    assert second <= 64 * mib, second / mib
    assert store.async_stats.staging_bytes == size
    store.close()


def test_cuda_branch_pinned_non_blocking_one_sync(monkeypatch: pytest.MonkeyPatch,
                                                  memory_backend: Backend) -> None:
    """The CUDA path's logic with CPU stand-ins: pinned buffers, non-blocking copies, one
    synchronize per device after the last copy and before save_async returns, reuse."""
    events: list[tuple[Any, ...]] = []
    real_alloc, real_copy = staging._alloc, staging._copy_into
    monkeypatch.setattr(staging, "_needs_pinned", lambda t: t.dtype == torch.float32)

    def alloc(key: staging.PoolKey) -> torch.Tensor:
        events.append(("alloc", key[2]))
        return real_alloc((key[0], key[1], False))

    def copy_into(buf: torch.Tensor, t: torch.Tensor, non_blocking: bool) -> None:
        events.append(("copy", t.dtype, non_blocking))
        real_copy(buf, t, non_blocking)

    def synchronize(devices: set[torch.device]) -> None:
        events.append(("sync", sorted(str(d) for d in devices)))

    monkeypatch.setattr(staging, "_alloc", alloc)
    monkeypatch.setattr(staging, "_copy_into", copy_into)
    monkeypatch.setattr(staging, "_synchronize", synchronize)
    store = memory_backend.open()
    state = {"a": torch.ones(4), "b": torch.ones(3), "i": torch.arange(2)}
    fut = store.save_async(1, state)
    assert events[-1] == ("sync", ["cpu"])  # synchronized before returning
    assert [e for e in events if e[0] == "copy"] == [
        ("copy", torch.float32, True), ("copy", torch.float32, True),
        ("copy", torch.int64, False)]
    assert [e for e in events if e[0] == "alloc"] == [("alloc", True)] * 2 + [("alloc", False)]
    fut.result()
    events.clear()
    store.save_async(2, state).result()
    assert not [e for e in events if e[0] == "alloc"]  # reused
    assert events.count(("sync", ["cpu"])) == 1
    state_int = {"i": torch.arange(2)}
    events.clear()
    store.save_async(3, state_int).result()
    assert not [e for e in events if e[0] == "sync"]  # nothing on a device: no synchronize


# -- back-pressure and lifetime -----------------------------------------------------------------


def test_back_pressure_waits_logs_and_counts(memory_backend: Backend,
                                             caplog: pytest.LogCaptureFixture) -> None:
    gate = Gate()
    store = gated_store(memory_backend, gate)
    gate.close()
    fut1 = store.save_async(1, state_for(1))
    assert gate.reached.wait(30)
    returned = threading.Event()
    futs: list[Any] = []

    def second() -> None:
        futs.append(store.save_async(2, state_for(2)))
        returned.set()

    caplog.set_level(logging.INFO, logger="ckptfs")
    t = threading.Thread(target=second)
    t.start()
    assert not returned.wait(0.5)  # blocked behind save 1
    gate.open()
    t.join(60)
    assert returned.is_set()
    assert fut1.result().step == 1 and futs[0].result().step == 2
    st = store.async_stats
    assert st.waits == 1 and st.wait_seconds >= 0.4 and st.last_wait_seconds >= 0.4
    assert st.submitted == st.committed == 2
    assert any("back-pressure" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_max_in_flight_two_does_not_wait(memory_backend: Backend) -> None:
    gate = Gate()
    store = gated_store(memory_backend, gate)
    gate.close()
    f1 = store.save_async(1, state_for(1), max_in_flight=2)
    f2 = store.save_async(2, state_for(2), max_in_flight=2)  # returns although 1 is pending
    assert not f1.done() and not f2.done()
    assert store.async_stats.waits == 0
    gate.open()
    store.wait()
    assert f1.result().step == 1 and f2.result().step == 2
    assert store.steps() == [1, 2]


def test_two_consecutive_save_async(local_backend: Backend) -> None:
    store = local_backend.open()
    s1 = rich_state(1)
    e1 = clone_state(s1)
    f1 = store.save_async(1, s1)
    mutate(s1)
    s2 = rich_state(2)
    e2 = clone_state(s2)
    f2 = store.save_async(2, s2)
    mutate(s2)
    assert f1.result().step == 1 and f2.result().step == 2
    reader = local_backend.open()
    assert_state_equal(reader.load(1), e1)
    assert_state_equal(reader.load(2), e2)
    assert reader.latest().step == 2  # type: ignore[union-attr]


def test_sync_save_waits_for_pending_async(memory_backend: Backend) -> None:
    gate = Gate()
    store = gated_store(memory_backend, gate)
    gate.close()
    fut = store.save_async(1, state_for(1))
    threading.Timer(0.3, gate.open).start()
    store.save(2, state_for(2))  # waits for step 1 first: commits in the order asked
    assert fut.done() and fut.result().step == 1
    assert store.steps() == [1, 2]


def _save_threads() -> int:
    return sum(t.name.startswith("ckptfs-async-save") for t in threading.enumerate())


def test_context_manager_and_close_flush(local_backend: Backend) -> None:
    _settle()  # a store dropped by an earlier test may stop its thread while this one counts
    before = _save_threads()
    with local_backend.open() as store:
        fut = store.save_async(1, state_for(1))
        assert _save_threads() == before + 1  # the store's one background thread
    assert fut.done() and fut.result().step == 1
    assert _save_threads() == before  # close() stopped it
    # a closed store can save again (the thread starts again)
    assert store.save_async(2, state_for(2)).result().step == 2
    store.close()


def test_leaving_with_on_an_exception_keeps_that_exception(
        memory_backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(FailingStorage(memory_backend.open().storage))
    with pytest.raises(KeyError, match="from the block"), store:
        store.save_async(1, state_for(1))
        raise KeyError("from the block")
    assert any("a pending async save failed too" in r.getMessage() for r in caplog.records)


# -- errors ---------------------------------------------------------------------------------------


class FailingStorage:
    """Delegates to ``inner``; the manifest write (a whole document, or streamed) of the first
    ``fail`` saves fails with a StorageError (an ordinary Exception, unlike SimulatedCrash)."""

    def __init__(self, inner: Storage, fail: int = 1) -> None:
        self.inner = inner
        self.fail = fail
        self._failing: set[str] = set()
        self.url = inner.url
        self.capabilities = inner.capabilities

    def write_bytes(self, path: str, data: bytes) -> None:
        if path.endswith("MANIFEST.json") and self.fail > 0:
            self.fail -= 1
            raise StorageError(f"{path}: injected failure")
        self.inner.write_bytes(path, data)

    def open_write(self, path: str) -> Any:
        # a durable save on local disk streams its manifest (its fsync in the commit's step),
        # under the commit's retries: every retry of a failing save's manifest fails too
        if path.endswith("MANIFEST.json") and (path in self._failing or self.fail > 0):
            if path not in self._failing:
                self.fail -= 1
                self._failing.add(path)
            raise StorageError(f"{path}: injected failure")
        return self.inner.open_write(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_failure_raises_from_result_and_is_then_collected(memory_backend: Backend) -> None:
    store = CheckpointStore(FailingStorage(memory_backend.open().storage))
    fut = store.save_async(1, state_for(1))
    with pytest.raises(StorageError, match="injected") as ei:
        fut.result()
    notes = getattr(ei.value, "__notes__", [])
    assert sys.version_info < (3, 11) or any("save_async" in n for n in notes)
    assert store.steps() == []  # no marker
    store.wait()  # collected by result(): not raised again
    assert store.save_async(1, state_for(1)).result().step == 1
    assert store.async_stats.failed == 1 and store.async_stats.committed == 1


@pytest.mark.parametrize("next_call", ["save_async", "save", "wait"])
def test_uncollected_failure_raises_from_the_next_call(memory_backend: Backend,
                                                       next_call: str) -> None:
    store = CheckpointStore(FailingStorage(memory_backend.open().storage))
    fut = store.save_async(1, state_for(1))
    while not fut.done():
        time.sleep(0.01)
    calls = {"save_async": lambda: store.save_async(2, state_for(2)),
             "save": lambda: store.save(2, state_for(2)),
             "wait": store.wait}
    with pytest.raises(StorageError, match="injected") as ei:
        calls[next_call]()
    assert ei.value is fut.failure()
    assert store.steps() == []  # the failed save left no marker, the refused call wrote nothing
    calls[next_call]()  # raised once, then cleared
    store.wait()
    assert store.steps() == ([] if next_call == "wait" else [2])
    with pytest.raises(StorageError):  # the future itself still tells
        fut.result()


def test_callback_on_the_background_thread_cannot_deadlock(memory_backend: Backend) -> None:
    """A done callback runs on the background thread: waiting for the store there would wait
    for itself, so it raises a typed error instead of hanging."""
    gate = Gate()
    store = gated_store(memory_backend, gate)
    seen: list[BaseException] = []
    ran = threading.Event()

    def callback(_fut: Any) -> None:
        for call in (lambda: store.save_async(2, state_for(2)), store.wait,
                     lambda: store.save(2, state_for(2))):
            try:
                call()
            except BaseException as exc:
                seen.append(exc)
        ran.set()

    gate.close()
    fut = store.save_async(1, state_for(1))
    fut.add_done_callback(callback)
    gate.open()
    assert fut.result().step == 1
    assert ran.wait(30)
    assert [type(e) for e in seen] == [AsyncSaveError] * 3, seen
    assert [str(e).split("(")[0] for e in seen] == ["save_async", "wait", "save"]
    store.wait()
    assert store.steps() == [1]


def test_close_from_a_done_callback_is_refused_before_touching_anything(
        memory_backend: Backend) -> None:
    """close() from a done callback (the background thread) raises AsyncSaveError at once,
    the store keeps its background thread and works on; close() from the caller then stops
    it (before: RuntimeError 'cannot join current thread', after detaching the thread)."""
    gate = Gate()  # each callback is attached while its save is held: it runs on the worker
    store = gated_store(memory_backend, gate)
    seen: list[BaseException] = []
    threads: list[threading.Thread] = []
    ran = threading.Event()

    def callback(_fut: Any) -> None:
        threads.append(threading.current_thread())
        try:
            store.close()
        except BaseException as exc:
            seen.append(exc)
        ran.set()

    gate.close()
    fut = store.save_async(1, state_for(1))
    fut.add_done_callback(callback)
    gate.open()
    assert fut.result(timeout=60).step == 1
    assert ran.wait(30)
    assert len(seen) == 1 and type(seen[0]) is AsyncSaveError, seen
    assert "close()" in str(seen[0]) and "background save thread" in str(seen[0])
    [worker] = threads
    assert worker.name.startswith("ckptfs-async-save") and worker.is_alive()  # still attached
    gate.close()
    fut2 = store.save_async(2, state_for(2))
    fut2.add_done_callback(lambda _f: threads.append(threading.current_thread()))
    gate.open()
    assert fut2.result(timeout=60).step == 2
    assert threads[1:] == [worker]  # the same thread saved step 2
    store.close()
    worker.join(30)
    assert not worker.is_alive()  # close() from the caller stopped it
    assert store.steps() == [1, 2]


def two_failing_saves(backend: Backend) -> tuple[CheckpointStore, async_save.SaveFuture,
                                                  async_save.SaveFuture]:
    """Two ``save_async`` whose background writes both fail, both done.  Both are submitted
    while the store's thread is held at a gate, so the first failure cannot already be
    raised by the second call (before: it sometimes was, when the first save failed before
    the second was submitted)."""
    gate = Gate()
    store = CheckpointStore(FailingStorage(FaultyStorage(backend.open().storage, hook=gate),
                                           fail=2))
    gate.close()
    f1 = store.save_async(1, state_for(1), max_in_flight=2)
    f2 = store.save_async(2, state_for(2), max_in_flight=2)
    gate.open()
    while not (f1.done() and f2.done()):
        time.sleep(0.01)
    return store, f1, f2


@pytest.mark.parametrize("calls", ["wait", "save_async", "close"])
def test_every_uncollected_failure_is_raised(memory_backend: Backend, calls: str) -> None:
    """Two background saves fail and nobody collects either: each is raised, one per call,
    oldest first, as its own exception object (so `except StorageError` works); the first
    carries a note naming the second, which the next call raises (before: the second was only
    named in a note, never raised)."""
    store, f1, f2 = two_failing_saves(memory_backend)
    call = {"wait": store.wait, "close": store.close,
            "save_async": lambda: store.save_async(3, state_for(3))}[calls]
    with pytest.raises(StorageError, match="injected") as ei:
        call()
    assert ei.value is f1.failure()
    notes = getattr(ei.value, "__notes__", [])
    [also] = [n for n in notes if "more background save" in n]
    assert "step 2" in also
    assert f1.collected and not f2.collected
    with pytest.raises(StorageError, match="injected") as ei2:
        call()
    assert ei2.value is f2.failure() and f2.collected
    store.wait()  # nothing left to raise
    assert store.save_async(3, state_for(3)).result().step == 3
    assert store.steps() == [3] and store.async_stats.failed == 2


def test_a_failure_collected_through_its_future_is_not_raised_again(
        memory_backend: Backend) -> None:
    """Of two uncollected failures, the second read through its future before the next call:
    only the first is raised by the store."""
    store, f1, f2 = two_failing_saves(memory_backend)
    assert isinstance(f2.exception(timeout=60), StorageError)
    with pytest.raises(StorageError) as ei:
        store.wait()
    assert ei.value is f1.failure()
    store.wait()


def test_fork_while_a_save_is_in_flight(local_backend: Backend) -> None:
    """os.fork() while a save is held in its background write.  The child: the parent's
    future fails with AsyncSaveError at once (it is the parent's save), store.save and
    save_async work, wait/close return, and the child exits (before: the child hung at exit
    and in store.save).  The parent: its save commits as if nothing happened."""
    code = CHILD_PRELUDE.format(url=local_backend.url) + """
    import os
    from ckptfs.errors import AsyncSaveError
    parent = os.getpid()
    release = threading.Event()
    def hook(op, path):
        if os.getpid() == parent and threading.current_thread() is not threading.main_thread():
            release.wait(60)
    store = CheckpointStore(FaultyStorage(open_store(url).storage, hook=hook))
    fut = store.save_async(1, {"w": torch.ones(100), "step": 1})
    called = []
    fut.add_done_callback(lambda f: called.append(os.getpid() == parent))
    pid = os.fork()
    if pid == 0:
        t0 = time.monotonic()
        try:
            fut.result(timeout=30)
            print("CHILD result returned", flush=True)
        except AsyncSaveError as exc:
            print("CHILD AsyncSaveError", "forked" in str(exc), flush=True)
        print("CHILD quick", time.monotonic() - t0 < 5, flush=True)
        print("CHILD callbacks", called, flush=True)  # the parent's: not run here
        store.save(2, {"w": torch.ones(3), "step": 2})
        print("CHILD saved", store.save_async(3, {"w": torch.ones(3)}).result(timeout=60).step,
              flush=True)
        store.wait()
        store.close()
        sys.exit(0)  # a normal exit: the exit hook runs
    deadline = time.monotonic() + 90
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("PARENT child hung", flush=True)
    print("PARENT child exit", status, flush=True)
    release.set()
    print("PARENT committed", fut.result(timeout=60).step, flush=True)
    deadline = time.monotonic() + 30
    while not called and time.monotonic() < deadline:
        time.sleep(0.01)
    print("PARENT callbacks", called, flush=True)
    """
    child = _run_child(code)
    try:
        out, err = child.communicate(timeout=240)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    lines = [ln for ln in out.splitlines() if ln.startswith(("CHILD", "PARENT"))]
    assert lines == ["CHILD AsyncSaveError True", "CHILD quick True", "CHILD callbacks []",
                     "CHILD saved 3", "PARENT child exit 0", "PARENT committed 1",
                     "PARENT callbacks [True]"], (out, err)
    assert local_backend.open().steps() == [1, 2, 3]


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_crash_at_every_mutating_call_of_the_background_write(
        where: str, request: pytest.FixtureRequest) -> None:
    """Failure injection at each mutating storage call of the background write: result()
    raises, the store's next call raises it if uncollected, no marker, the previous latest
    intact and loadable, and a fresh store saves the same step."""
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    store_on(raw_storage(backend)).save(0, state_for(0))
    counter = FaultyStorage(raw_storage(backend))
    store_on(counter).save_async(1, state_for(1)).result()
    n = counter.count
    assert n >= 4
    store_on(raw_storage(backend)).delete(1)
    step = 1
    for k in range(1, n + 1):
        fs = FaultyStorage(raw_storage(backend), crash_at=k)
        store = store_on(fs)
        state = state_for(step)
        fut = store.save_async(step, state)
        mutate_simple(state)
        if k % 2:
            with pytest.raises(SimulatedCrash):
                fut.result(timeout=120)
        else:
            with pytest.raises(SimulatedCrash):
                store.wait()  # uncollected: the next call raises it
        assert fs.count == k, (k, fs.calls[-1])
        reader = backend.open()
        assert step not in reader.steps(), f"crash at call {k}: a marker exists"
        assert reader.latest().step == step - 1  # type: ignore[union-attr]
        assert_state_equal(reader.load(), state_for(step - 1))
        # the next run resumes: the same step saves on a fresh store
        assert store_on(raw_storage(backend)).save_async(step, state_for(step)).result()
        assert_state_equal(backend.open().load(), state_for(step))
        step += 1


def mutate_simple(state: dict[str, Any]) -> None:
    with torch.no_grad():
        state["model"]["w"].add_(1)
    state["trainer"]["step"] = -5


# -- leaks, exit, kill ---------------------------------------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settle() -> None:
    """Let the threads of stores dropped by earlier tests finish exiting."""
    gc.collect()
    for _ in range(50):
        n = threading.active_count()
        time.sleep(0.02)
        if threading.active_count() == n:
            return


def test_no_thread_or_fd_leak_after_100_async_saves(local_backend: Backend) -> None:
    _settle()
    threads0, fds0, named0 = threading.active_count(), _fds(), _save_threads()
    store = local_backend.open()
    state = {"w": torch.zeros(256), "step": 0}
    store.save_async(0, state).result()
    threads1, fds1 = threading.active_count(), _fds()
    assert threads1 <= threads0 + 1
    for step in range(1, 101):
        state["w"].fill_(float(step))
        state["step"] = step
        store.save_async(step, state)
    store.wait()
    assert store.async_stats.committed == 101
    assert threading.active_count() <= threads1
    assert _save_threads() == named0 + 1
    assert _fds() <= fds1
    assert store.load(100)["w"][0].item() == 100.0
    store.close()
    assert threading.active_count() <= threads0
    assert _save_threads() == named0
    assert _fds() <= fds0


def _run_child(code: str, env_extra: dict[str, str] | None = None
               ) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


CHILD_PRELUDE = """
    import sys, threading, time, torch
    from ckptfs.protocol.store import CheckpointStore, open as open_store
    from ckptfs.testing.faults import FaultyStorage
    url = sys.argv[1] if len(sys.argv) > 1 else {url!r}
"""


def test_kill_during_background_write(local_backend: Backend) -> None:
    """SIGKILL while the background thread is writing (after save_async returned): no marker,
    the previous latest intact, and the next run resumes from it and saves again."""
    local_backend.open().save(1, state_for(1))
    code = CHILD_PRELUDE.format(url=local_backend.url) + """
    returned = threading.Event()
    def hook(op, path):
        if threading.current_thread() is not threading.main_thread() and op == "commit":
            returned.wait(30)
            print("WRITING", flush=True)
            time.sleep(60)
    store = CheckpointStore(FaultyStorage(open_store(url).storage, hook=hook))
    state = {"w": torch.ones(1000, 1000), "step": 2}
    fut = store.save_async(2, state)
    print("RETURNED", flush=True)
    returned.set()
    time.sleep(60)
    """
    child = _run_child(code)
    try:
        assert child.stdout is not None
        lines = [child.stdout.readline().strip() for _ in range(2)]
        assert lines == ["RETURNED", "WRITING"], (lines, child.stderr)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    reader = local_backend.open()
    assert reader.steps() == [1]
    assert 2 in reader.all_steps()  # the killed attempt is there, uncommitted
    assert reader.latest().step == 1  # type: ignore[union-attr]
    assert_state_equal(reader.load(), state_for(1))
    mgr = CheckpointManager(local_backend.open(), async_save=True)
    start = mgr.restore_latest()
    assert start == 2
    mgr.save(2)
    assert [r.info.step for r in mgr.wait() if r.info] == [2]
    assert local_backend.open().steps() == [1, 2]


def test_exit_completes_a_pending_save_and_says_so(local_backend: Backend) -> None:
    code = CHILD_PRELUDE.format(url=local_backend.url) + """
    def hook(op, path):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)
    store = CheckpointStore(FaultyStorage(open_store(url).storage, hook=hook))
    store.save_async(7, {"w": torch.ones(10), "step": 7})
    print("END OF SCRIPT", flush=True)
    """
    child = _run_child(code)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert "END OF SCRIPT" in out
    assert "interpreter exit: waiting for 1 pending async save" in err
    assert "committed at interpreter exit" in err
    assert local_backend.open().steps() == [7]


def test_exit_reports_an_uncollected_failure(local_backend: Backend) -> None:
    code = CHILD_PRELUDE.format(url=local_backend.url) + """
    def hook(op, path):
        if op in ("write_bytes", "open_write") and path.endswith("MANIFEST.json"):
            raise OSError("disk on fire")
    store = CheckpointStore(FaultyStorage(open_store(url).storage, hook=hook))
    store.save_async(8, {"w": torch.ones(10)})
    """
    child = _run_child(code)
    _, err = child.communicate(timeout=120)
    assert "step 8" in err and "nobody collected the error" in err and "disk on fire" in err
    assert local_backend.open().steps() == []


# -- CheckpointManager(async_save=True) ------------------------------------------------------------


@pytest.fixture
def gated_manager(memory_backend: Backend) -> Iterator[tuple[CheckpointManager, Gate]]:
    gate = Gate()
    mgr = CheckpointManager(gated_store(memory_backend, gate), keep_last=2, async_save=True,
                            best=ckptfs.Best(metric="loss", mode="min", keep=1))
    yield mgr, gate
    gate.open()


def test_manager_async_prunes_only_after_the_commit(
        gated_manager: tuple[CheckpointManager, Gate]) -> None:
    mgr, gate = gated_manager
    model = torch.nn.Linear(4, 2)
    for step, loss in ((1, 0.5), (2, 0.9)):
        res = mgr.save(step, model=model, metrics={"loss": loss})
        assert res.info is None and res.future is not None
    done = mgr.wait()
    assert [r.info.step for r in done if r.info] == [2]  # step 1 was finished by save(2)
    assert mgr.store.steps() == [1, 2]
    gate.close()
    res = mgr.save(3, model=model, metrics={"loss": 0.7})
    assert gate.reached.wait(30)
    # step 3 is snapshotted, not committed: nothing pruned, the best pool unchanged
    assert mgr.store.steps() == [1, 2] and mgr.best_steps() == [1]
    with torch.no_grad():
        model.weight.fill_(7.0)  # after the snapshot
    gate.open()
    [r3] = mgr.wait()
    assert r3.info is not None and r3.info.step == 3 and r3.prune is not None
    # keep_last=2 keeps 2 and 3, best keeps 1
    assert mgr.store.steps() == [1, 2, 3] and mgr.best_steps() == [1]
    mgr.save(4, model=model, metrics={"loss": 0.1})
    mgr.wait()
    assert mgr.store.steps() == [3, 4] and mgr.best_steps() == [4]
    assert not torch.equal(mgr.store.load(3)["model"]["weight"], model.weight.detach())


def test_manager_restore_latest_waits_for_the_pending_save(
        gated_manager: tuple[CheckpointManager, Gate]) -> None:
    mgr, gate = gated_manager
    gate.close()
    mgr.save(5, model=torch.nn.Linear(2, 2))
    threading.Timer(0.3, gate.open).start()
    assert mgr.restore_latest(model=torch.nn.Linear(2, 2)) == 6


def test_manager_async_failure_skips_bookkeeping_and_raises_next(
        memory_backend: Backend) -> None:
    store = CheckpointStore(FailingStorage(memory_backend.open().storage, fail=0))
    mgr = CheckpointManager(store, keep_last=1, async_save=True)
    mgr.save(1)
    mgr.wait()
    store.storage.fail = 1  # type: ignore[attr-defined]
    mgr.save(2)
    with pytest.raises(StorageError, match="injected"):
        mgr.save(3)  # the failure of 2 surfaces before 3 is taken
    assert store.steps() == [1]  # nothing pruned for the failed save
    mgr.save(3)
    mgr.wait()
    assert store.steps() == [3]


# -- the benchmark (smoke) -----------------------------------------------------------------------


def test_benchmark_smoke(tmp_path: Path) -> None:
    from ckptfs.bench import async_save as bench

    res = bench.run(sizes_mib=[1], repeats=2, s3_mib=0, root=str(tmp_path), log=lambda _m: None,
                    loop={"steps": 4, "every": 2, "width": 16, "depth": 2, "batch": 2})
    [blk] = res["blocking"]
    assert blk["size_bytes"] == bench.MIB and blk["save_async_block_s"] > 0
    assert blk["ratio_vs_sync"] == blk["save_async_block_s"] / blk["sync_save_s"]
    summary = res["loop"]["summary"]
    assert set(summary) == set(bench.MODES)
    assert summary["none"]["blocked_s"] == 0 and summary["sync"]["blocked_s"] > 0
    assert all(r["checkpoints"] == 2 for r in res["loop"]["runs"]["dcp_async"])
    text = bench.report(res)
    assert "x sync (goal <= 0.2)" in text and "ckptfs_async" in text
    bench.plot(res, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
