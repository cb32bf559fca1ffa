"""``ckptfs inspect``, ``ckptfs cp``, ``ckptfs export`` and the scoped ``ckptfs bench`` options
(docs/cli.md), on local disk, memory:// and S3 (moto)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import pathlib
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ckptfs
from ckptfs.cli import inspection, tools
from ckptfs.cli.core import main
from ckptfs.format import extensions
from ckptfs.format.layout import StepPaths
from ckptfs.protocol.copy import copy_step
from ckptfs.protocol.store import CheckpointStore
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage, SimulatedCrash
from ckptfs.testing.reliability import Planter, hostile_cases, raw_storage, store_on


def state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16)},
            "optimizer": {"state": {0: {"step": torch.tensor(step)}}, "lr": 0.1,
                          "betas": (0.9, 0.999)},
            "extras": {"arr": np.arange(5.0), "out": pathlib.Path("runs/x"), "tags": {"a"}}}


def populate(backend: Backend, steps: tuple[int, ...] = (1, 2)) -> CheckpointStore:
    store = backend.open()
    for s in steps:
        store.save(s, state(s), metadata={"note": f"step {s}"})
    return store


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# -- inspect -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_inspect_tree_without_tensor_bytes(kind: str, request: pytest.FixtureRequest,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    backend: Backend = request.getfixturevalue(f"{kind}_backend")
    populate(backend)
    code, out, _ = run(["inspect", backend.url, "--step", "1", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["step"] == 1 and doc["metadata"]["note"] == "step 1"
    assert {f["path"] for f in doc["files"]} == {"state.msgpack", "tensors-00000.safetensors"}
    rows = {r["key"]: r for r in doc["tree"]}
    assert rows["model/w"] == {**rows["model/w"], "kind": "tensor", "dtype": "F32",
                               "shape": [64, 32], "bytes": 64 * 32 * 4}
    assert rows["model/b"]["dtype"] == "BF16" and rows["model/b"]["bytes"] == 64
    assert rows["optimizer/lr"]["value"] == "0.1"
    assert rows["extras/arr"]["type"] == "numpy.ndarray"
    assert rows["extras/out"] == {**rows["extras/out"], "kind": "extension",
                                  "type": "pathlib.Path", "value": "'runs/x'"}
    assert doc["tensors"]["bytes"] == 64 * 32 * 4 + 64 + 8 + 5 * 8
    code, text, _ = run(["inspect", backend.url], capsys)  # latest, text
    assert code == 0 and "step 2" in text and "w: F32 [64, 32] 8192 B" in text


class CountingStorage:
    """Delegates to a store's storage, counting the bytes read from each path."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.read: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        data: bytes = self.inner.read_range(path, start, length)
        self.read[path] = self.read.get(path, 0) + len(data)
        return data

    def open_read(self, path: str) -> Any:
        self.read[path] = self.read.get(path, 0) + 10**12  # a streaming read: count it as all
        return self.inner.open_read(path)


def test_inspect_reads_only_headers(local_backend: Backend) -> None:
    store = local_backend.open()
    big = torch.randn(256, 1024)  # 1 MiB of tensor bytes
    info = store.save(3, {"big": big})
    counting = CountingStorage(store.storage)
    doc = inspection.inspect_info(CheckpointStore(counting), info)  # type: ignore[arg-type]
    tensor_file = f"{info.path}/tensors-00000.safetensors"
    assert 0 < counting.read[tensor_file] < 1024  # the header only
    assert doc["tree"][0]["shape"] == [256, 1024]


def test_inspect_shows_unregistered_types_without_decoding(
        memory_backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    class Phase(enum.Enum):
        WARMUP = 1

    ckptfs.register_type(Phase, name="tests.Phase")
    memory_backend.open().save(1, {"phase": Phase.WARMUP})
    extensions.unregister_type("tests.Phase")
    code, out, _ = run(["inspect", memory_backend.url, "--json"], capsys)
    assert code == 0
    assert json.loads(out)["tree"][0]["type"] == "tests.Phase"


def test_inspect_missing_step_fails(memory_backend: Backend,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    populate(memory_backend, (1,))
    code, _, err = run(["inspect", memory_backend.url, "--step", "7"], capsys)
    assert code == 1 and "step 7" in err and "Traceback" not in err


def test_inspect_rows_are_bounded_and_summarized(memory_backend: Backend,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Long containers show their first --max-items children and one summary row with the
    counts of the rest; --max-rows bounds the rows in all."""
    store = memory_backend.open()
    state = {"a": list(range(10)),
             "b": {f"k{i}": torch.ones(i + 1) for i in range(5)},
             "c": [{"x": torch.zeros(2, dtype=torch.float64)}, 3, 4]}
    store.save(1, state)
    code, out, _ = run(["inspect", memory_backend.url, "--json", "--max-items", "2"], capsys)
    assert code == 0
    doc = json.loads(out)
    rows = {r["key"]: r for r in doc["tree"]}
    assert [r["key"] for r in doc["tree"] if r["depth"] == 1] == ["a", "b", "..."]
    assert rows["a"]["items"] == 10 and "a/1" in rows and "a/2" not in rows
    assert rows["a/..."] == {"key": "a/...", "depth": 2, "kind": "more", "items": 8,
                             "rows": 8, "tensors": 0, "bytes": 0}
    assert rows["b/..."]["items"] == 3 and rows["b/..."]["tensors"] == 3
    assert rows["b/..."]["bytes"] == (3 + 4 + 5) * 4
    # the top level's third key, "c", with everything under it
    assert rows["..."] == {"key": "...", "depth": 1, "kind": "more", "items": 1, "rows": 5,
                           "tensors": 1, "bytes": 16}
    # the header counts every tensor, shown or not
    assert doc["tensors"] == {"count": 6, "bytes": (1 + 2 + 3 + 4 + 5) * 4 + 16}
    code, out, _ = run(["inspect", memory_backend.url, "--json", "--max-rows", "3"], capsys)
    rows_list = json.loads(out)["tree"]
    assert [r["key"] for r in rows_list] == ["a", "a/0", "a/1", "..."]
    assert rows_list[-1]["rows"] == 8 + 6 + 5 and rows_list[-1]["tensors"] == 6
    code, text, _ = run(["inspect", memory_backend.url, "--max-items", "2"], capsys)
    assert code == 0 and "... 8 more items, 8 more rows (0 tensors, 0 B)" in text
    for bad in ("0", "-1", "x"):
        code, _, err = run(["inspect", memory_backend.url, "--max-items", bad], capsys)
        assert code == 2 and "--max-items" in err


def test_inspect_memory_does_not_grow_with_a_long_list(local_backend: Backend) -> None:
    """Regression: a 2.3 MiB checkpoint holding a 500k-int list cost ~500 MiB (one row dict
    and one text line per int); the rows are bounded now, the rest is the decoded document."""
    n = 300_000
    store = local_backend.open()
    store.save(1, {"w": torch.ones(3), "big": list(range(n)), "d": {str(i): i for i in
                                                                     range(3000)}})
    info = store.info(1)
    tracemalloc.start()
    try:
        doc = inspection.inspect_info(store, info)
        text = json.dumps(doc)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(doc["tree"]) < 2 * inspection.DEFAULT_MAX_ITEMS + 10
    more = {r["key"]: r for r in doc["tree"] if r["kind"] == "more"}
    assert more["big/..."]["items"] == n - inspection.DEFAULT_MAX_ITEMS
    assert more["d/..."]["items"] == 3000 - inspection.DEFAULT_MAX_ITEMS
    assert len(text) < 1 << 20
    assert peak < 48 << 20, peak >> 20     # was ~130 MiB at this size (rows), ~500 MiB at 500k


def test_inspect_refuses_what_load_refuses(local_backend: Backend,
                                           capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    """Every hostile checkpoint of the reliability sweep (a tree nested 300 deep, malformed
    tags, big ints, keys, headers, links, sizes...): inspect refuses each one that load
    refuses, with a typed error and a nonzero exit, and accepts the others."""
    pl = Planter(local_backend)
    reader = store_on(raw_storage(local_backend))
    refused = 0
    for name, build, _expected in hostile_cases(pl, str(tmp_path / "EXECUTED"), local=True):
        step = build()
        try:
            reader.load(step)
            load_refused = False
        except ckptfs.CkptfsError:
            load_refused = True
        try:
            code = main(["inspect", local_backend.url, "--step", str(step), "--json"])
        except ckptfs.CkptfsError as exc:  # before inspect runs: the marker/manifest
            assert load_refused, (name, exc)
            code = 1
        out, err = capsys.readouterr()
        assert "Traceback" not in err, name
        assert (code != 0) == load_refused, (name, code, err)
        if "nested 300 deep" in name:      # the reported case: unsafe, exit 1
            assert code == 1 and json.loads(out)["error"] == "UnsafeCheckpointError", out
        refused += load_refused
        local_backend.raw_delete(StepPaths(step).dir)
    assert refused > 60
    assert not (tmp_path / "EXECUTED").exists()


def _sharded_checkpoint(backend: Backend) -> CheckpointStore:
    import torch.distributed.checkpoint as dcp

    import ckptfs.dcp

    state = {"model": {f"w{i}": torch.randn(4, 4) for i in range(5)}, "step": 3}
    dcp.save(state, storage_writer=ckptfs.dcp.Writer(backend.url, 1),  # type: ignore[attr-defined]
             planner=ckptfs.dcp.SavePlanner())
    return backend.open()


@pytest.mark.sharded
def test_inspect_sharded_checkpoint(local_backend: Backend,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Format v2: the flat DCP keys, bounded by --max-rows; a damaged or linked rank file is
    refused as load refuses it."""
    store = _sharded_checkpoint(local_backend)
    info = store.info(1)
    assert info.manifest.format_version == 2
    code, out, err = run(["inspect", local_backend.url, "--json"], capsys)
    assert code == 0, err
    rows = {r["key"]: r for r in json.loads(out)["tree"]}
    assert rows["model.w0"]["kind"] == "tensor" and rows["model.w0"]["shape"] == [4, 4]
    assert rows["model.w0"]["chunks"] == 1 and rows["step"]["kind"] == "value"
    code, out, _ = run(["inspect", local_backend.url, "--json", "--max-rows", "2"], capsys)
    tree = json.loads(out)["tree"]
    assert [r["key"] for r in tree] == ["model.w0", "model.w1", "..."]
    assert tree[-1]["rows"] == 4 and tree[-1]["tensors"] == 3 and tree[-1]["bytes"] == 3 * 64
    code, text, _ = run(["inspect", local_backend.url], capsys)
    assert code == 0 and "model.w0: F32 [4, 4] 64 B  (1 chunks)" in text

    data = next(e.path for e in info.manifest.files if e.path.endswith(".safetensors"))
    rel = f"{info.path}/{data}"
    original = local_backend.raw_read(rel)
    local_backend.raw_write(rel, original[:-1])
    with pytest.raises(ckptfs.CorruptCheckpointError):
        store.load(1)
    code, _, err = run(["inspect", local_backend.url], capsys)
    assert code == 1 and data in err and "Traceback" not in err
    target = Path(local_backend.raw_root) / "elsewhere.bin"
    target.write_bytes(original)
    link = Path(local_backend.raw_root, *rel.split("/"))
    link.unlink()
    link.symlink_to(target)
    with pytest.raises(ckptfs.UnsafeCheckpointError):
        store.load(1)
    code, _, err = run(["inspect", local_backend.url, "--json"], capsys)
    assert code == 1 and "symbolic link" in err


# -- cp ----------------------------------------------------------------------------------------


def assert_same_checkpoint(src: CheckpointStore, dst: CheckpointStore, step: int) -> None:
    a, b = src.load(step), dst.load(step)
    assert torch.equal(a["model"]["w"], b["model"]["w"])
    assert np.array_equal(a["extras"]["arr"], b["extras"]["arr"])
    assert b["extras"]["out"] == pathlib.Path("runs/x") and b["extras"]["tags"] == {"a"}
    assert dst.info(step).metadata == src.info(step).metadata
    assert dst.verify(step).ok


@pytest.mark.parametrize("pair", [("local", "memory"), ("memory", "local")])
def test_cp_all_between_backends(pair: tuple[str, str], request: pytest.FixtureRequest,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    src_b: Backend = request.getfixturevalue(f"{pair[0]}_backend")
    dst_b: Backend = request.getfixturevalue(f"{pair[1]}_backend")
    src = populate(src_b, (1, 2, 3))
    src_b.raw_write(f"{StepPaths(4).dir}/a-20200101T000000Z-0000000000000004/x", b"partial")
    code, out, _ = run(["cp", src_b.url, dst_b.url, "--all", "--json"], capsys)
    assert code == 0, out
    doc = json.loads(out)
    assert [r["status"] for r in doc["steps"]] == ["copied"] * 3
    dst = dst_b.open()
    assert dst.steps() == [1, 2, 3] and dst.all_steps() == [1, 2, 3]  # the incomplete: not
    for s in (1, 2, 3):
        assert_same_checkpoint(src, dst, s)
        assert dst.info(s).attempt != src.info(s).attempt  # a fresh attempt name
        assert dst.info(s).created == src.info(s).created
    # Again: identical, nothing written.
    before = dst_b.raw_files()
    code, out, _ = run(["cp", src_b.url, dst_b.url, "--step", "2"], capsys)
    assert code == 0 and "identical" in out
    assert dst_b.raw_files() == before


@pytest.mark.parametrize("incremental", [False, True], ids=["v1", "v3"])
@pytest.mark.parametrize("dst_kind", ["memory", "local"])
def test_cp_of_files_larger_than_a_copy_slice(incremental: bool, dst_kind: str,
                                              tmp_path: pathlib.Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Files of several copy slices, with a hasher slower than the destination's writes (as
    memory:// always is): each slice must stay as it was read until it is hashed.  The copy
    used to refill one buffer for every slice, so a healthy source failed as "digest differs"
    (and the replicator gave the step up)."""
    from ckptfs.protocol import commit
    from ckptfs.protocol.copy import copy_step
    from ckptfs.protocol.copy_io import COPY_CHUNK

    class SlowHasher(commit.MultiHasher):  # type: ignore[misc,name-defined]
        def update(self, data: Any) -> None:
            time.sleep(0.005)
            super().update(data)

    monkeypatch.setattr(commit, "MultiHasher", SlowHasher)
    src = ckptfs.open(str(tmp_path / "src"), incremental=incremental)
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(COPY_CHUNK // 4 * 2 + 123, generator=g) for i in range(2)}
    src.save(1, state)
    dst = ckptfs.open(f"memory://{tmp_path.name}-dst" if dst_kind == "memory"
                      else str(tmp_path / "dst"))
    result = copy_step(src.storage, dst.storage, 1, threads=2)
    assert result.status == "copied"
    assert dst.verify(1).ok
    out = dst.load(1)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_cp_conflicting_step_is_exit_1(local_backend: Backend, memory_backend: Backend,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    populate(local_backend, (5,))
    memory_backend.open().save(5, {"other": torch.ones(1)})
    code, out, err = run(["cp", local_backend.url, memory_backend.url, "--json"], capsys)
    assert code == 1
    assert json.loads(out)["steps"][0]["error"] == "CheckpointExistsError"
    assert "already committed" in err and "Traceback" not in err
    assert "other" in memory_backend.open().load(5)  # untouched


def test_cp_deadline_bounds_each_copy(local_backend: Backend, memory_backend: Backend,
                                     capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``--deadline SECONDS`` reaches each step's copy (`copy_step`'s ``deadline_s``, tested
    against a stalling storage in tests/reliability/test_save_deadline.py); a copy within it
    commits; a deadline that is not a positive number is a usage error (exit 2)."""
    populate(local_backend, (1, 2))
    import ckptfs.protocol.copy as copy_module
    seen: list[float | None] = []
    real = copy_module.copy_step

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("deadline_s"))
        return real(*args, **kwargs)

    monkeypatch.setattr(copy_module, "copy_step", spy)
    code, out, err = run(["cp", local_backend.url, memory_backend.url, "--all", "--deadline",
                          "60", "--json", "--quiet"], capsys)
    assert code == 0, err
    assert seen == [60.0, 60.0]
    assert [r["status"] for r in json.loads(out)["steps"]] == ["copied", "copied"]
    assert memory_backend.open().steps() == [1, 2]
    for bad in ("0", "-1", "inf", "soon"):
        code, _, err = run(["cp", local_backend.url, memory_backend.url, "--deadline", bad],
                           capsys)
        assert code == 2 and "--deadline" in err and "seconds" in err, (bad, err)


def test_cp_corrupt_source_commits_nothing(local_backend: Backend, memory_backend: Backend,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    src = populate(local_backend, (1,))
    path = StepPaths(1).file(src.info(1).attempt, "tensors-00000.safetensors")
    data = bytearray(local_backend.raw_read(path))
    data[-3] ^= 0x10  # same size, other content
    local_backend.raw_write(path, bytes(data))
    code, _, err = run(["cp", local_backend.url, memory_backend.url], capsys)
    assert code == 1 and "digest differs" in err and "tensors-00000.safetensors" in err
    assert memory_backend.open().steps() == []
    assert memory_backend.raw_files() == {}  # the partial attempt was removed


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_cp_crash_at_every_call_leaves_no_committed_step(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A copy killed at any storage call of the destination leaves the step uncommitted (and
    the next copy succeeds); killed after the marker, it is committed whole."""
    src = populate(request.getfixturevalue("memory_backend"), (1,))
    base: Backend = request.getfixturevalue(f"{kind}_backend")
    clean = FaultyStorage(base.sibling("clean").open().storage)
    copy_step(src.storage, clean, 1, threads=1)
    total = clean.count
    assert total >= 4
    for k in range(1, total + 1):
        dst_b = base.sibling(f"crash{k}")
        faulty = FaultyStorage(dst_b.open().storage, crash_at=k)
        with pytest.raises(SimulatedCrash):
            copy_step(src.storage, faulty, 1, threads=1)
        assert dst_b.open().steps() == [], f"crash at call {k} of {total}"
        copy_step(src.storage, dst_b.open().storage, 1, threads=1)  # the retry commits
        assert dst_b.open().verify(1).ok
    dst_b = base.sibling("after")
    faulty = FaultyStorage(dst_b.open().storage, crash_at=total, crash_after=True)
    with pytest.raises(SimulatedCrash):
        copy_step(src.storage, faulty, 1, threads=1)
    assert dst_b.open().steps() == [1] and dst_b.open().verify(1).ok


def test_cp_local_to_s3_and_back(local_backend: Backend, s3_backend: Backend,
                                 memory_backend: Backend,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    src = populate(local_backend, (1, 2))
    opts = [f"--dst-option={k}={json.dumps(v)}" for k, v in s3_backend.options.items()]
    code, _, err = run(["cp", local_backend.url, s3_backend.url, "--all", *opts], capsys)
    assert code == 0, err
    s3 = s3_backend.open()
    assert s3.steps() == [1, 2]
    assert_same_checkpoint(src, s3, 2)
    back = [f"--src-option={k}={json.dumps(v)}" for k, v in s3_backend.options.items()]
    code, _, err = run(["cp", s3_backend.url, memory_backend.url, "--step", "1", *back],
                         capsys)
    assert code == 0, err
    assert_same_checkpoint(src, memory_backend.open(), 1)


def test_cp_interrupted_upload_to_s3(local_backend: Backend, s3_backend: Backend) -> None:
    src = populate(local_backend, (1,))
    dst = s3_backend.open()
    faulty = FaultyStorage(dst.storage, crash_at=3)
    with pytest.raises(SimulatedCrash):
        copy_step(src.storage, faulty, 1, threads=1)
    assert s3_backend.open().steps() == []
    copy_step(src.storage, s3_backend.open().storage, 1)
    assert_same_checkpoint(src, s3_backend.open(), 1)


def test_cp_usage_errors(memory_backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["cp", "memory://a", "memory://b", "--all", "--step", "1"], capsys)
    assert code == 2 and "not allowed" in err
    code, _, err = run(["cp", memory_backend.url, "memory://nowhere"], capsys)
    assert code == 1 and "no committed checkpoint" in err


# -- export --------------------------------------------------------------------------------------


def test_export_safetensors(local_backend: Backend, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    src = populate(local_backend, (1, 2))
    out = tmp_path / "model.safetensors"
    code, _, err = run(["export", local_backend.url, "--step", "1", str(out)], capsys)
    assert code == 0, err
    with safe_open(str(out), framework="pt") as f:
        keys = set(f.keys())
        assert {"model/w", "model/b", "optimizer/state/0/step", "extras/arr"} == keys
        assert torch.equal(f.get_tensor("model/w"), src.load(1)["model"]["w"])
        meta = f.metadata()
    values = json.loads(meta["ckptfs.values"])
    assert values["optimizer/lr"] == 0.1 and values["optimizer/betas/1"] == 0.999
    assert meta["ckptfs.step"] == "1" and json.loads(meta["ckptfs.metadata"])["note"] == "step 1"
    # Only the model, with its own keys (what the HF ecosystem expects).
    code, _, _ = run(["export", local_backend.url, "--key", "model", str(out)], capsys)
    assert code == 2  # exists
    code, _, err = run(["export", local_backend.url, "--key", "model", "--force", str(out)],
                       capsys)
    assert code == 0, err
    with safe_open(str(out), framework="pt") as f:
        assert set(f.keys()) == {"w", "b"}
        assert torch.equal(f.get_tensor("b"), src.load(2)["model"]["b"])  # latest
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_export_pt_and_usage(memory_backend: Backend, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    src = populate(memory_backend, (3,))
    out = tmp_path / "state.pt"
    code, out_text, err = run(["export", memory_backend.url, str(out), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out_text)["format"] == "pt"
    loaded = torch.load(out, weights_only=False)
    assert torch.equal(loaded["model"]["w"], src.load(3)["model"]["w"])
    assert loaded["extras"]["out"] == pathlib.Path("runs/x")
    code, _, err = run(["export", memory_backend.url, str(tmp_path / "x.bin")], capsys)
    assert code == 2 and ".safetensors or .pt" in err
    code, _, err = run(["export", memory_backend.url, "--key", "nope", str(tmp_path / "y.pt")],
                       capsys)
    assert code == 2 and "nope" in err and not (tmp_path / "y.pt").exists()


def test_export_unregistered_type_as_plain_dict(memory_backend: Backend,
                                                tmp_path: Path) -> None:
    class Stage(enum.Enum):
        A = 1

    ckptfs.register_type(Stage, name="tests.Stage")
    memory_backend.open().save(1, {"w": torch.ones(1), "stage": Stage.A})
    extensions.unregister_type("tests.Stage")
    out = tmp_path / "s.safetensors"
    assert main(["export", memory_backend.url, str(out)]) == 0
    with safe_open(str(out), framework="pt") as f:
        values = json.loads(f.metadata()["ckptfs.values"])
    assert values["stage"] == {"__ckptfs_type__": "tests.Stage", "value": "A"}


@dataclasses.dataclass
class _Cfg:
    lr: float
    table: torch.Tensor


def test_export_tensors_inside_extension_values(memory_backend: Backend, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: tensors inside a Namespace or a dataclass were written as their repr text
    in ckptfs.values.  Every tensor gets a safetensors key by its key path, wherever it sits;
    the extension value's type is recorded under its own path."""
    ckptfs.register_type(_Cfg, name="tests.Cfg")
    ns = argparse.Namespace(seed=3, mask=torch.arange(4), nested={"w": torch.ones(2)})
    store = memory_backend.open()
    store.save(1, {"model": {"w": torch.zeros(3)}, "args": ns,
                   "cfg": _Cfg(0.1, torch.eye(2)), "other": _Cfg(0.2, torch.ones(1))})
    extensions.unregister_type("tests.Cfg")          # the CLI does not know the class
    out = tmp_path / "x.safetensors"
    code, _, err = run(["export", memory_backend.url, str(out)], capsys)
    assert code == 0, err
    with safe_open(str(out), framework="pt") as f:
        keys = set(f.keys())
        got = {k: f.get_tensor(k) for k in keys}
        values = json.loads(f.metadata()["ckptfs.values"])
    assert keys == {"model/w", "args/mask", "args/nested/w", "cfg/table", "other/table"}
    assert torch.equal(got["args/mask"], torch.arange(4))
    assert torch.equal(got["cfg/table"], torch.eye(2))
    assert values["args"] == {"__ckptfs_type__": "argparse.Namespace"} and values["args/seed"] == 3
    assert values["cfg"] == {"__ckptfs_type__": "tests.Cfg"} and values["cfg/lr"] == 0.1
    assert "tensor(" not in json.dumps(values) and "__repr__" not in json.dumps(values)

    # registered in the exporting process: a dataclass instance, exported the same way
    ckptfs.register_type(_Cfg, name="tests.Cfg")
    try:
        code, _, err = run(["export", memory_backend.url, "--force", str(out)], capsys)
    finally:
        extensions.unregister_type("tests.Cfg")
    assert code == 0, err
    with safe_open(str(out), framework="pt") as f:
        assert {"cfg/table", "other/table"} <= set(f.keys())
        values = json.loads(f.metadata()["ckptfs.values"])
    assert values["cfg"]["__ckptfs_type__"].endswith("_Cfg") and values["cfg/lr"] == 0.1


def test_export_refuses_tensors_without_a_stable_key(memory_backend: Backend, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A tensor in a set has no stable key path: refused with a typed error naming the key
    path, nothing written (never its repr)."""
    memory_backend.open().save(1, {"model": {"w": torch.ones(1)},
                                   "extras": {"s": {torch.ones(2), "a"}}})
    out = tmp_path / "x.safetensors"
    code, _, err = run(["export", memory_backend.url, str(out)], capsys)
    assert code == 2 and "'extras/s'" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.iterdir())
    code, _, err = run(["export", memory_backend.url, "--key", "model", str(out)], capsys)
    assert code == 0, err


# -- progress bars and bench options -------------------------------------------------------------


def test_progress_only_on_a_terminal(local_backend: Backend, memory_backend: Backend,
                                     monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    populate(local_backend, (1, 2))
    code, _, err = run(["cp", local_backend.url, memory_backend.url, "--step", "1"], capsys)
    assert code == 0 and "cp:" not in err  # not a TTY: no bar
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    code, _, err = run(["cp", local_backend.url, memory_backend.url, "--step", "2"], capsys)
    assert code == 0 and "cp:" in err
    ns = tools.argparse.Namespace(quiet=True, json=False)
    assert not tools.show_progress(ns)
    assert not tools.show_progress(tools.argparse.Namespace(quiet=False, json=True))


def test_bench_subcommands_show_only_their_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "hash", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--hash-size" in text and "--sizes" not in text and "--counts" not in text
    assert main(["bench", "report", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--docs" in text and "--reps" not in text
    assert main(["bench", "latest", "--sizes", "1GiB"]) == 2
    assert "unrecognized arguments: --sizes" in capsys.readouterr().err
    assert main(["bench", "all", "--help"]) == 0
    assert "--s3-max" in capsys.readouterr().out
