"""Selective and lazy load (docs/loading.md): ``load(keys=...)`` reads and verifies only the
files holding the selected values (counted byte by byte through a storage proxy),
``map_location`` in every form ``torch.load`` accepts, and ``mmap=True`` on local disk."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.format import sharding_plan
from ckptfs.format.serialize import decode_state_doc
from ckptfs.protocol.store import CheckpointStore
from ckptfs.testing.backend import Backend

MIB = 1024 * 1024


class _CountingFile:
    def __init__(self, inner: Any, add: Any) -> None:
        self._inner, self._add = inner, add

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._inner.read(n)
        self._add(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        n: int = self._inner.readinto(buf)
        self._add(n or 0)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ByteCountingStorage:
    """A Storage proxy recording how many bytes were read from each path."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.url = inner.url
        self.capabilities = inner.capabilities
        self.bytes_read: dict[str, int] = {}

    def _add(self, path: str, n: int) -> None:
        self.bytes_read[path] = self.bytes_read.get(path, 0) + n

    def read_bytes(self, path: str) -> bytes:
        data: bytes = self._inner.read_bytes(path)
        self._add(path, len(data))
        return data

    @contextmanager
    def open_read(self, path: str) -> Iterator[Any]:
        with self._inner.open_read(path) as f:
            yield _CountingFile(f, lambda n: self._add(path, n))

    def __getattr__(self, name: str) -> Any:
        if name == "read_range":  # not offered: every read goes through open_read, counted
            raise AttributeError(name)
        return getattr(self._inner, name)

    def files_read(self) -> dict[str, int]:
        """Bytes read per file of an attempt (by file name), marker and manifest excluded."""
        out: dict[str, int] = {}
        for path, n in self.bytes_read.items():
            name = path.rsplit("/", 1)[-1]
            if name not in ("COMPLETE", "MANIFEST.json") and n:
                out[name] = out.get(name, 0) + n
        return out


def _state() -> dict[Any, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=g)  # 2 MiB
    return {
        "model": {"layer.weight": w, "layer.bias": torch.randn(1024, generator=g),
                  "tied": w, 0: torch.arange(5)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(512, 1024, generator=g),
                                    "exp_avg_sq": torch.randn(512, 1024, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "sched": {"last_epoch": 3, "x": torch.ones(4)},
        "step": 7,
        ("a", "b"): {"c": torch.zeros(2)},
    }


def _counting(backend: Backend) -> tuple[CheckpointStore, ByteCountingStorage]:
    plain = backend.open()
    counting = ByteCountingStorage(plain.storage)
    return CheckpointStore(counting, threads=2), counting


def _tensor_files(store: CheckpointStore, step: int) -> dict[str, set[str]]:
    """Top-level key (as str) -> the tensor files holding its tensors, from state.msgpack."""
    info = store.info(step)
    _tree, slots = decode_state_doc(store.storage.read_bytes(f"{info.path}/state.msgpack"),
                                   where="test")
    out: dict[str, set[str]] = {}
    for s in slots:
        out.setdefault(s.name.split("/", 1)[0], set()).add(s.file)
    return out


def _assert_equal(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _assert_equal(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _assert_equal(a, b)
    else:
        assert got == want


# -- keys= reads only the selected values' bytes ---------------------------------------------


@pytest.mark.parametrize("backend_name", ["local", "memory", "s3"])
def test_loading_model_reads_no_optimizer_bytes(backend_name: str,
                                                request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    state = _state()
    store, counting = _counting(backend)
    store.save(1, state)
    files = _tensor_files(store, 1)
    # The layout: the model's and the optimizer's tensors share no file.
    assert files["model"] and files["optimizer"] and not files["model"] & files["optimizer"]
    sizes = {e.path: e.size for e in store.info(1).manifest.files}

    counting.bytes_read.clear()
    got = store.load(1, keys=["model"])
    read = counting.files_read()
    assert set(read) == {"state.msgpack", *files["model"]}
    for name in files["model"] | {"state.msgpack"}:
        assert read[name] == sizes[name]  # each read whole (verified), once
    assert not set(read) & files["optimizer"]
    _assert_equal(got, {"model": state["model"]})
    assert got["model"]["tied"] is got["model"]["layer.weight"]  # ties survive

    counting.bytes_read.clear()
    got = store.load(keys=["optimizer/state"])  # latest, a key path
    assert set(counting.files_read()) == {"state.msgpack", *files["optimizer"]}
    _assert_equal(got, {"optimizer": {"state": state["optimizer"]["state"]}})

    counting.bytes_read.clear()
    full = store.load(1)
    assert set(counting.files_read()) == set(sizes)
    _assert_equal(full, state)


@pytest.mark.parametrize("backend_name", ["local", "memory"])
def test_selective_load_verifies_only_what_it_reads(backend_name: str,
                                                    request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    store = backend.open()
    state = _state()
    store.save(1, state)
    opt_file = sorted(_tensor_files(store, 1)["optimizer"])[0]
    rel = f"{store.info(1).path}/{opt_file}"
    data = bytearray(backend.raw_read(rel))
    data[-1] ^= 0xFF  # damage an optimizer byte (same size)
    backend.raw_write(rel, bytes(data))

    _assert_equal(store.load(1, keys=["model", "step"]),
                  {"model": state["model"], "step": 7})
    with pytest.raises(ckptfs.CorruptCheckpointError, match=opt_file):
        store.load(1, keys=["optimizer"])
    with pytest.raises(ckptfs.CorruptCheckpointError, match=opt_file):
        store.load(1)


@pytest.mark.parametrize("damage", ["truncated", "missing", "grown"])
@pytest.mark.parametrize("backend_name", ["local", "memory"])
def test_unselected_file_truncated_or_missing_does_not_stop_selective_load(
        backend_name: str, damage: str, request: pytest.FixtureRequest) -> None:
    """docs/loading.md: a damaged file the selection does not read does not stop keys= (the
    listing is checked only for the files the load reads); a full load, a load selecting it
    and verify still refuse or report it."""
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    store = backend.open()
    state = _state()
    store.save(1, state)
    opt_file = sorted(_tensor_files(store, 1)["optimizer"])[0]
    rel = f"{store.info(1).path}/{opt_file}"
    data = backend.raw_read(rel)
    if damage == "missing":
        backend.raw_delete(rel)
    else:
        backend.raw_write(rel, data[: len(data) // 2] if damage == "truncated" else data + b"x")

    _assert_equal(store.load(1, keys=["model", "step"]),
                  {"model": state["model"], "step": 7})
    for keys in (["optimizer"], None):
        with pytest.raises(ckptfs.CorruptCheckpointError, match=opt_file):
            store.load(1, keys=keys)
    with pytest.raises(ckptfs.CorruptCheckpointError, match=opt_file):
        store.verify(1)


@pytest.mark.sharded
def test_sharded_unselected_damaged_file_stops_selective_load(local_backend: Backend) -> None:
    """Format v2: keys= selects after the whole checkpoint is loaded and verified
    (docs/loading.md), so a damaged file outside the selection still refuses the load."""
    import torch.distributed.checkpoint as dcp

    import ckptfs.dcp

    state = {"model": {"w": torch.randn(4, 4)}, "optimizer": {"m": torch.randn(4, 4)}}
    dcp.save(state, storage_writer=ckptfs.dcp.Writer(local_backend.url, 1),  # type: ignore[attr-defined]
             planner=ckptfs.dcp.SavePlanner())
    store = local_backend.open()
    info = store.info(1)
    data_files = [e.path for e in info.manifest.files if e.path.endswith(".safetensors")]
    assert data_files
    rel = f"{info.path}/{data_files[0]}"
    local_backend.raw_write(rel, local_backend.raw_read(rel)[:-1])
    with pytest.raises(ckptfs.CorruptCheckpointError, match=data_files[0]):
        store.load(1, keys=["model"])


def test_key_paths_and_errors(local_backend: Backend) -> None:
    store = local_backend.open()
    state = _state()
    store.save(1, state)
    got = store.load(1, keys=["model/layer.bias", ("model", 0), "step", (("a", "b"), "c")])
    _assert_equal(got, {"model": {"layer.bias": state["model"]["layer.bias"],
                                  0: state["model"][0]},
                        "step": 7, ("a", "b"): {"c": state[("a", "b")]["c"]}})
    # A path and its prefix: the prefix selects the value whole.
    _assert_equal(store.load(1, keys=["sched/x", "sched"]), {"sched": state["sched"]})
    # Saved order is kept, whatever the order of keys.
    assert list(store.load(1, keys=["step", "model"])) == ["model", "step"]

    with pytest.raises(ckptfs.CheckpointKeyError) as exc:
        store.load(1, keys=["modle"])
    assert isinstance(exc.value, KeyError) and isinstance(exc.value, ckptfs.CkptfsError)
    for k in ("'model'", "'optimizer'", "'sched'", "'step'", "('a', 'b')", "'modle'"):
        assert k in str(exc.value)
    with pytest.raises(KeyError, match=r"keys under 'model'.*'layer\.weight'"):
        store.load(1, keys=["model/nope"])
    with pytest.raises(KeyError, match=r"no key path 'model/0'"):  # "0" is a str, the key an int
        store.load(1, keys=["model/0"])
    with pytest.raises(ckptfs.CheckpointKeyError, match=r"not a dict.*select 'optimizer/param"):
        store.load(1, keys=["optimizer/param_groups/0"])
    for bad in ("model", ("model",), [], [""], ["model//x"], [("model", [1])], [3], 5):
        with pytest.raises(ckptfs.LoadOptionError):
            store.load(1, keys=bad)  # type: ignore[arg-type]


def test_old_layout_loads_selectively(local_backend: Backend,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints written before the per-key layout (one shard for all) load the same with
    keys=: only less cheaply (the shared shard is read and verified whole)."""
    monkeypatch.setattr(sharding_plan, "OWN_FILES_BYTES", 1 << 40)
    store, counting = _counting(local_backend)
    state = _state()
    store.save(1, state)
    files = _tensor_files(store, 1)
    assert files["model"] == files["optimizer"]  # one shared file
    counting.bytes_read.clear()
    _assert_equal(store.load(1, keys=["model"]), {"model": state["model"]})
    assert set(counting.files_read()) == {"state.msgpack", *files["model"]}


def test_shard_plan_groups_by_top_level_key() -> None:
    big, small = 2 * MIB, 1000
    sizes = [big, small, big, small, small, big, small]
    groups = ["model", "model", "opt", "sched", "rng", "opt", "x"]
    shards = sharding_plan.plan_shards(sizes, [100] * 7, groups, shard_bytes=3 * MIB,
                                       header_budget=10_000)
    assert shards == [[0, 1], [2], [5], [3, 4, 6]]  # opt split at shard_bytes; smalls shared
    # Many small top-level keys (a flat state dict's biases) share files, not one each.
    many = sharding_plan.plan_shards([10] * 1000, [100] * 1000, list(range(1000)),
                                     shard_bytes=3 * MIB, header_budget=20_000)
    assert len(many) == 5 and sorted(i for s in many for i in s) == list(range(1000))


@pytest.mark.sharded
def test_sharded_checkpoint_keys(local_backend: Backend) -> None:
    """Format v2 (written by torch.distributed.checkpoint in one process): keys= selects after
    the full sharded load; map_location applies; mmap is refused clearly."""
    import torch.distributed.checkpoint as dcp

    import ckptfs.dcp

    state = {"model": {"w": torch.randn(4, 4)}, "optimizer": {"m": torch.randn(4, 4)}}
    dcp.save(state, storage_writer=ckptfs.dcp.Writer(local_backend.url, 1),  # type: ignore[attr-defined]
             planner=ckptfs.dcp.SavePlanner())
    store = local_backend.open()
    assert store.info(1).manifest.format_version == 2
    got = store.load(1, keys=["model"], map_location="meta")
    assert list(got) == ["model"] and got["model"]["w"].device.type == "meta"
    assert torch.equal(store.load(1, keys=["optimizer/m"])["optimizer"]["m"],
                       state["optimizer"]["m"])
    with pytest.raises(ckptfs.CheckpointKeyError, match="'model', 'optimizer'"):
        store.load(1, keys=["nope"])
    with pytest.raises(ckptfs.LoadOptionError, match="format v2"):
        store.load(1, mmap=True)


# -- map_location ------------------------------------------------------------------------------


def test_map_location_forms(memory_backend: Backend) -> None:
    store = memory_backend.open()
    state = _state()
    store.save(1, state)

    def devices(s: dict[str, Any]) -> set[str]:
        return {s["model"]["layer.weight"].device.type, s["optimizer"]["state"][0][
            "exp_avg"].device.type}

    assert devices(store.load(1, map_location="meta")) == {"meta"}
    assert devices(store.load(1, map_location=torch.device("meta"))) == {"meta"}
    assert devices(store.load(1, map_location={"cpu": "meta"})) == {"meta"}
    assert devices(store.load(1, map_location={torch.device("cpu"): torch.device("meta")})
                   ) == {"meta"}
    # Every tensor is restored from "cpu" (the format does not record the saving device).
    assert devices(store.load(1, map_location={"cuda:0": "meta"})) == {"cpu"}
    _assert_equal(store.load(1, map_location="cpu"), state)

    seen: list[tuple[int, str]] = []

    def keep(storage: Any, location: str) -> Any:
        seen.append((storage.nbytes(), location))
        return storage

    got = store.load(1, map_location=keep)
    _assert_equal(got, state)
    assert {loc for _, loc in seen} == {"cpu"}
    # One call per stored tensor (the tied weight once), each with that tensor's bytes only.
    assert sorted(n for n, _ in seen) == sorted(
        [512 * 1024 * 4] * 3 + [1024 * 4, 5 * 8, 4 * 4, 2 * 4])
    assert got["model"]["tied"] is got["model"]["layer.weight"]

    copied = store.load(1, map_location=lambda s, loc: s.clone())
    _assert_equal(copied, state)
    assert devices(store.load(1, map_location=lambda s, loc: None)) == {"cpu"}
    assert devices(store.load(1, map_location=lambda s, loc: torch.empty(
        s.nbytes(), dtype=torch.uint8, device="meta").untyped_storage())) == {"meta"}
    with pytest.raises(ckptfs.LoadOptionError, match="storage of 0 B"):
        store.load(1, map_location=lambda s, loc: torch.UntypedStorage(0))  # type: ignore[no-untyped-call]

    for bad in (torch.float16, 3, 1.5, ["cpu"], "nonsense-device", {"cpu": torch.float16},
                {"cpu": 0.5}):
        with pytest.raises(ckptfs.LoadOptionError) as exc:
            store.load(1, map_location=bad)  # type: ignore[arg-type]
        assert isinstance(exc.value, TypeError)
    with pytest.raises(ckptfs.LoadOptionError, match="returned str"):
        store.load(1, map_location=lambda s, loc: "cpu")


# -- mmap --------------------------------------------------------------------------------------


def test_mmap_local(local_backend: Backend) -> None:
    store = local_backend.open()
    state = _state()
    store.save(1, state)
    got = store.load(1, mmap=True)
    _assert_equal(got, state)
    # Copy-on-write: writing to a loaded tensor never changes the checkpoint.
    got["model"]["layer.weight"].add_(1.0)
    _assert_equal(store.load(1), state)
    store.verify(1)
    _assert_equal(store.load(1, mmap=True, keys=["model"], map_location="meta").keys(),
                  {"model": None}.keys())

    # Verified before return: the mapped bytes are hashed.
    opt_file = sorted(_tensor_files(store, 1)["optimizer"])[0]
    rel = f"{store.info(1).path}/{opt_file}"
    data = bytearray(local_backend.raw_read(rel))
    data[-1] ^= 0xFF
    local_backend.raw_write(rel, bytes(data))
    with pytest.raises(ckptfs.CorruptCheckpointError, match=opt_file):
        store.load(1, mmap=True)
    _assert_equal(store.load(1, mmap=True, keys=["model"]), {"model": state["model"]})
    # verify=False: nothing hashed, the damaged byte is what the tensor shows.
    lazy = store.load(1, mmap=True, verify=False)
    assert not torch.equal(lazy["optimizer"]["state"][0]["exp_avg_sq"],
                           state["optimizer"]["state"][0]["exp_avg_sq"]) or not torch.equal(
        lazy["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])


def test_mmap_refused_off_local_disk(memory_backend: Backend) -> None:
    store = memory_backend.open()
    store.save(1, {"x": torch.ones(2)})
    with pytest.raises(ckptfs.LoadOptionError, match="local-disk"):
        store.load(1, mmap=True)
    with pytest.raises(ckptfs.LoadOptionError, match="into"):
        store.load(1, keys=["x"], into={"x": torch.zeros(2)})
