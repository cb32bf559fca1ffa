"""Golden checkpoints (tests/golden/v1: format v1; tests/golden/v2: format v2, sharded, step 1
written by 2 gloo ranks; tests/golden/v3: format v3, incremental, step 2 referencing step 1;
tests/golden/v4: format v4, sharded incremental, both steps written by 2 gloo ranks, step 2
referencing step 1's rank files; each written once by tests/golden/make_golden.py): every future
ckptfs must load them bit-exact and verify them, the by-hand checker of docs/protocol.md must
accept them, and a reader older than their format must refuse them.  The expected values are
rebuilt from the generator's recipe, never stored as output blobs."""

from __future__ import annotations

import importlib.util
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import ckptfs

GOLDEN = Path(__file__).resolve().parent / "golden"


def _recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RECIPE = _recipe()


def zeros(value: Any) -> Any:
    """``value`` with every tensor replaced by zeros of its dtype and shape (a load target)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: zeros(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(zeros(v) for v in value)
    return value


def assert_bit_exact(got: Any, want: Any, path: str = "") -> None:
    """Equal types, keys in order, tensors by dtype, shape and raw bytes (so -0.0, NaN payloads
    and every bf16/f8 bit count), floats by their IEEE bytes."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor, path
        want = want.resolve_conj().resolve_neg()
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert not got.is_conj() and not got.is_neg(), path
        raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(raw(got), raw(want)), path
        return
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_bit_exact(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bit_exact(g, w, f"{path}/{i}")
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), (path, got, want)
    else:
        assert got == want, (path, got, want)


@pytest.fixture
def v1_run(tmp_path: Path) -> Path:
    """A copy of the golden run: nothing a test does can change the committed bytes."""
    src = GOLDEN / "v1" / "run"
    assert (src / "checkpoints").is_dir(), f"{src} is missing: the golden files must be committed"
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def test_v1_steps_and_metadata(v1_run: Path) -> None:
    store = ckptfs.open(str(v1_run))
    recipe = RECIPE.golden_v1()
    assert store.steps() == sorted(recipe)
    for step, (_, meta, algorithm) in recipe.items():
        info = store.info(step)
        assert info.manifest.format_version == 1 and info.marker.format_version == 1
        assert info.manifest.hash_algorithm == algorithm
        assert {k: v for k, v in info.metadata.items() if k != "tensor_count"} == meta


@pytest.mark.parametrize("step", sorted(RECIPE.golden_v1()))
def test_v1_loads_bit_exact(v1_run: Path, step: int) -> None:
    state, _, _ = RECIPE.golden_v1()[step]
    out = ckptfs.open(str(v1_run)).load(step)
    assert_bit_exact(out, state)


def test_v1_ties_and_views(v1_run: Path) -> None:
    out = ckptfs.open(str(v1_run)).load(1)
    assert out["model"]["emb.weight"] is out["model"]["head.weight"]
    assert out["views"]["z_conj"] is not out["views"]["z"]
    assert isinstance(out["trainer"]["size"], torch.Size)
    assert out["trainer"]["dtype"] is torch.bfloat16
    dtypes = {t.dtype for t in out["tensors"].values()}
    assert {getattr(torch, n) for n in RECIPE.V1_DTYPES} <= dtypes


def test_v1_verifies(v1_run: Path) -> None:
    store = ckptfs.open(str(v1_run))
    for step in store.steps():
        for quick in (True, False):
            report = store.verify(step, quick=quick)
            assert report.ok, report.problems


def test_v1_by_hand_checker(v1_run: Path, tmp_path: Path) -> None:
    from test_format_spec import checker_source

    script = tmp_path / "check.py"
    script.write_text(checker_source())
    done = subprocess.run([sys.executable, str(script), str(v1_run)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "step 2: committed" in done.stdout


# ----------------------------------------------------------------------------------------------
# Format v2


@pytest.fixture
def v2_run(tmp_path: Path) -> Path:
    src = GOLDEN / "v2" / "run"
    assert (src / "checkpoints").is_dir(), f"{src} is missing: the golden files must be committed"
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def test_v2_steps_and_metadata(v2_run: Path) -> None:
    from ckptfs.format.sharded import ShardedManifest

    store = ckptfs.open(str(v2_run))
    recipe = RECIPE.golden_v2()
    assert store.steps() == sorted(recipe)
    for step, (_, meta, algorithm, world) in recipe.items():
        info = store.info(step)
        assert isinstance(info.manifest, ShardedManifest)
        assert info.manifest.format_version == 2 and info.marker.format_version == 1
        assert info.manifest.hash_algorithm == algorithm and info.manifest.world_size == world
        assert {f.path for f in info.manifest.files} == {
            "dcp.msgpack", *(f"rank-{r:05d}/data-0.safetensors" for r in range(world))}
        assert {k: v for k, v in info.metadata.items() if k != "tensor_count"} == meta


@pytest.mark.parametrize("step", sorted(RECIPE.golden_v2()))
def test_v2_loads_bit_exact(v2_run: Path, step: int) -> None:
    state, _, _, _ = RECIPE.golden_v2()[step]
    out = ckptfs.open(str(v2_run)).load(step)
    assert_bit_exact(out, state)


def test_v2_loads_into_another_placement(v2_run: Path) -> None:
    """Written by 2 ranks (rows and columns split), read into whole tensors in one process
    through the ranged reader: every chunk read, verified and copied into place."""
    state, _, _, _ = RECIPE.golden_v2()[1]
    into = {k: zeros(state[k]) for k in ("rows", "cols", "replicated")}
    ckptfs.open(str(v2_run)).load(1, into=into)
    assert_bit_exact(into, {k: state[k] for k in into})


def test_v2_verifies(v2_run: Path) -> None:
    store = ckptfs.open(str(v2_run))
    for step in store.steps():
        for quick in (True, False):
            report = store.verify(step, quick=quick)
            assert report.ok, report.problems


def test_v2_by_hand_checker(v2_run: Path, tmp_path: Path) -> None:
    from test_format_spec import checker_source

    script = tmp_path / "check.py"
    script.write_text(checker_source())
    # The checker reads the newest step; check step 1 (2 ranks) alone too.
    for root, expect in ((v2_run, "step 2: committed, sharded by 1 ranks"),
                         (tmp_path / "only1", "step 1: committed, sharded by 2 ranks")):
        if not root.exists():
            shutil.copytree(v2_run, root)
            shutil.rmtree(root / "checkpoints" / "step-000000000002")
        done = subprocess.run([sys.executable, str(script), str(root)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert expect in done.stdout


# ----------------------------------------------------------------------------------------------
# Format v3 (incremental): step 2 references step 1's unchanged tensors


@pytest.fixture
def v3_run(tmp_path: Path) -> Path:
    src = GOLDEN / "v3" / "run"
    assert (src / "checkpoints").is_dir(), f"{src} is missing: the golden files must be committed"
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def test_v3_steps_metadata_and_references(v3_run: Path) -> None:
    from ckptfs.format.incremental import IncrementalManifest

    store = ckptfs.open(str(v3_run))
    recipe = RECIPE.golden_v3()
    assert store.steps() == sorted(recipe)
    for step, (_, meta, algorithm) in recipe.items():
        info = store.info(step)
        assert info.manifest.format_version == 3 and info.manifest.hash_algorithm == algorithm
        assert {k: v for k, v in info.metadata.items() if k != "tensor_count"} == meta
    m = store.info(2).manifest
    assert isinstance(m, IncrementalManifest) and len(m.references) == 1
    ref = m.references[0]
    assert (ref.step, ref.attempt) == (1, store.info(1).attempt)
    assert store.info(2).bytes_written < store.info(2).bytes


@pytest.mark.parametrize("step", sorted(RECIPE.golden_v3()))
def test_v3_loads_bit_exact(v3_run: Path, step: int) -> None:
    state, _, _ = RECIPE.golden_v3()[step]
    store = ckptfs.open(str(v3_run))
    assert_bit_exact(store.load(step), state)
    assert_bit_exact(store.load(step, keys=["frozen"]), {"frozen": state["frozen"]})
    assert_bit_exact(store.load(step, mmap=True), state)


def test_v3_verifies(v3_run: Path) -> None:
    store = ckptfs.open(str(v3_run))
    for step in store.steps():
        for quick in (True, False):
            report = store.verify(step, quick=quick)
            assert report.ok, report.problems


def test_v3_by_hand_checker(v3_run: Path, tmp_path: Path) -> None:
    from test_format_spec import checker_source

    script = tmp_path / "check.py"
    script.write_text(checker_source())
    done = subprocess.run([sys.executable, str(script), str(v3_run)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "step 2: committed, 2 files verified" in done.stdout
    assert "1 references verified" in done.stdout


def test_v3_refused_by_a_pre_v3_reader(v3_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that knows formats 1 and 2 only (the version check of ckptfs before v3)
    refuses v3 with FormatVersionError."""
    from ckptfs.errors import FormatVersionError
    from ckptfs.format import versions

    monkeypatch.setattr(versions, "READ_VERSIONS", (1, 2))
    monkeypatch.setattr(versions, "MAX_READ_VERSION", 2)
    with pytest.raises(FormatVersionError, match="format version 3"):
        ckptfs.open(str(v3_run)).load(2)


# ----------------------------------------------------------------------------------------------
# Format v4 (sharded incremental): both steps by 2 gloo ranks, step 2 referencing the frozen
# items of step 1's rank files


@pytest.fixture
def v4_run(tmp_path: Path) -> Path:
    src = GOLDEN / "v4" / "run"
    assert (src / "checkpoints").is_dir(), f"{src} is missing: the golden files must be committed"
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def _unchanged(before: Any, after: Any, path: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """DCP name -> tensor, for the tensors with bytes that ``after`` holds as the very objects
    ``before`` holds at the same key path: what an incremental save of ``after`` references."""
    if isinstance(after, torch.Tensor):
        return {".".join(path): after} if after is before and after.numel() else {}
    out: dict[str, torch.Tensor] = {}
    if isinstance(after, dict) and isinstance(before, dict):
        for k, v in after.items():
            if k in before:
                out.update(_unchanged(before[k], v, (*path, str(k))))
    return out


def test_v4_steps_metadata_and_references(v4_run: Path) -> None:
    import msgpack

    from ckptfs.format.incremental import ShardedIncrementalManifest
    from ckptfs.format.layout import StepPaths

    store = ckptfs.open(str(v4_run))
    recipe = RECIPE.golden_v4()
    assert store.steps() == sorted(recipe)
    for step, (_, meta, algorithm, world) in recipe.items():
        info = store.info(step)
        assert isinstance(info.manifest, ShardedIncrementalManifest)
        assert info.manifest.format_version == 4 and info.marker.format_version == 1
        assert info.manifest.hash_algorithm == algorithm and info.manifest.world_size == world
        assert {f.path for f in info.manifest.files} == {
            "dcp.msgpack", *(f"rank-{r:05d}/data-0.safetensors" for r in range(world))}
        assert {k: v for k, v in info.metadata.items() if k != "tensor_count"} == meta
    # Step 1 (the first save of its processes) references nothing: every byte written.
    first, second = store.info(1), store.info(2)
    assert not first.manifest.references and first.bytes_written == first.bytes
    # Step 2 references step 1's attempt: one reference per rank file (both ranks hold frozen
    # row shards), each naming the file that holds the bytes, with its size.
    refs = second.manifest.references
    sizes = {f.path: f.size for f in first.manifest.files if f.path != "dcp.msgpack"}
    assert all((r.step, r.attempt) == (1, first.attempt) for r in refs)
    assert {r.source: r.size for r in refs} == sizes and len(refs) == len(sizes)
    # dcp.msgpack places exactly the frozen tensors (those step 2 holds as step 1's objects)
    # in the references, and their bytes are exactly the referenced item chunks.
    frozen = _unchanged(recipe[1][0], recipe[2][0])
    assert frozen and not any(k.startswith(("rows.head", "replicated.bias")) for k in frozen)
    md = msgpack.unpackb((v4_run / StepPaths(2).file(second.attempt, "dcp.msgpack")
                          ).read_bytes(), raw=False, strict_map_key=False)
    in_refs = {fqn for fqn, _, path, _, _ in md["storage_data"] if path in {r.path for r in refs}}
    assert in_refs == set(frozen)
    frozen_bytes = sum(t.numel() * t.element_size() for t in frozen.values())
    assert sum(c.length for r in refs for c in r.chunks[1:]) == frozen_bytes
    assert second.bytes - second.bytes_written == sum(c.length for r in refs for c in r.chunks)


@pytest.mark.parametrize("step", sorted(RECIPE.golden_v4()))
def test_v4_loads_bit_exact(v4_run: Path, step: int) -> None:
    """Written by 2 ranks, loaded whole in one process (no process group)."""
    state, _, _, _ = RECIPE.golden_v4()[step]
    assert_bit_exact(ckptfs.open(str(v4_run)).load(step), state)


def test_v4_loads_into_another_placement(v4_run: Path) -> None:
    """Step 2 into whole zero tensors in one process through the ranged reader: the frozen
    chunks read from step 1's rank files through the references, each checked by its digest."""
    state, _, _, _ = RECIPE.golden_v4()[2]
    into = {k: zeros(state[k]) for k in ("rows", "cols", "replicated")}
    ckptfs.open(str(v4_run)).load(2, into=into)
    assert_bit_exact(into, {k: state[k] for k in into})


def test_v4_verifies(v4_run: Path) -> None:
    store = ckptfs.open(str(v4_run))
    for step in store.steps():
        for quick in (True, False):
            report = store.verify(step, quick=quick)
            assert report.ok, report.problems


def test_v4_by_hand_checker(v4_run: Path, tmp_path: Path) -> None:
    from test_format_spec import checker_source

    script = tmp_path / "check.py"
    script.write_text(checker_source())
    refs = len(ckptfs.open(str(v4_run)).info(2).manifest.references)
    # The checker reads the newest step; check step 1 (no references) alone too.
    for root, expect in ((v4_run, "step 2: committed, sharded by 2 ranks, 3 files verified"),
                         (tmp_path / "only1", "step 1: committed, sharded by 2 ranks")):
        if not root.exists():
            shutil.copytree(v4_run, root)
            shutil.rmtree(root / "checkpoints" / "step-000000000002")
        done = subprocess.run([sys.executable, str(script), str(root)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert expect in done.stdout
        n = refs if root == v4_run else 0
        assert f"{n} references verified" in done.stdout


def test_v4_refused_by_a_pre_v4_reader(v4_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that knows formats 1 to 3 only (the version check of ckptfs before v4)
    refuses v4, both steps, with FormatVersionError."""
    from ckptfs.errors import FormatVersionError
    from ckptfs.format import versions

    monkeypatch.setattr(versions, "READ_VERSIONS", (1, 2, 3))
    monkeypatch.setattr(versions, "MAX_READ_VERSION", 3)
    for step in sorted(RECIPE.golden_v4()):
        with pytest.raises(FormatVersionError, match="format version 4"):
            ckptfs.open(str(v4_run)).load(step)
