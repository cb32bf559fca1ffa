"""Golden checkpoints (tests/golden/v1: format v1; tests/golden/v2: format v2, sharded, step 1
written by 2 gloo ranks; tests/golden/v3: format v3, incremental, step 2 referencing step 1;
tests/golden/v4: format v4, sharded incremental, both steps written by 2 gloo ranks, step 2
referencing step 1's rank files; tests/golden/v5: format v5, format v2's run saved with
``metadata_layout="per-rank"``; each written once by tests/golden/make_golden.py): every future
ckptfs must load them bit-exact and verify them, the by-hand checker of docs/protocol.md must
accept them, and a reader older than their format must refuse them.  The expected values are
rebuilt from the generator's recipe, never stored as output blobs.

Every fixture directory goes through one parametrized harness (`GOLDENS`: the steps and
metadata, a bit-exact load of each step, a quick and a full verify, the by-hand checker);
the checks particular to one format (ties and views, references, loads into another
placement, an older reader's refusal) follow it."""

from __future__ import annotations

import importlib.util
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.format.versions import has_rank_metadata
from ckptfs.protocol.rank_metadata import expand

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


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


# ----------------------------------------------------------------------------------------------
# The harness: every fixture directory


@dataclass(frozen=True)
class Golden:
    """One fixture directory (tests/golden/v<version>/run) and what its harness checks."""

    version: int
    #: step -> (state, metadata, hash algorithm[, world size]) of its recipe.
    recipe: Callable[[], dict[int, tuple[Any, ...]]]
    #: Sharded (format v2, v4, v5): per-rank files and a world size.
    sharded: bool = False
    #: Extra bit-exact loads: ``keys=`` (the first top-level key) and ``mmap=True``.
    extra_loads: bool = False
    #: The by-hand checker on the run (the newest step) and, with ``only_step1``, on a copy
    #: holding step 1 alone: substrings its report must hold.
    checker: tuple[str, ...] = ()
    only_step1: tuple[str, ...] = ()
    references: Callable[[Path], tuple[int, int]] | None = field(default=None)

    def __str__(self) -> str:
        return f"v{self.version}"


def _v4_references(run: Path) -> tuple[int, int]:
    """(references of the newest step, of step 1 alone) for the v4 checker's report."""
    return len(ckptfs.open(str(run)).info(2).manifest.references), 0


GOLDENS = [
    Golden(1, RECIPE.golden_v1, checker=("step 2: committed",)),
    Golden(2, RECIPE.golden_v2, sharded=True,
           checker=("step 2: committed, sharded by 1 ranks",),
           only_step1=("step 1: committed, sharded by 2 ranks",)),
    Golden(3, RECIPE.golden_v3, extra_loads=True,
           checker=("step 2: committed, 2 files verified", "1 references verified")),
    Golden(4, RECIPE.golden_v4, sharded=True,
           checker=("step 2: committed, sharded by 2 ranks, 3 files verified",),
           only_step1=("step 1: committed, sharded by 2 ranks",),
           references=_v4_references),
    Golden(5, RECIPE.golden_v5, sharded=True,
           checker=("step 2: committed, sharded by 1 ranks, per-rank metadata, 2 files and 1 "
                    "rank files verified",),
           only_step1=("step 1: committed, sharded by 2 ranks, per-rank metadata, 2 files and "
                       "2 rank files verified",)),
]
def _marks(g: Golden) -> list[Any]:
    """A sharded golden reads through the sharded machinery (torch >= 2.9)."""
    return [pytest.mark.sharded] if g.sharded else []


GOLDEN_PARAMS = [pytest.param(g, id=str(g), marks=_marks(g)) for g in GOLDENS]
STEP_PARAMS = [pytest.param(g, step, id=f"{g}-step{step}", marks=_marks(g))
               for g in GOLDENS for step in sorted(g.recipe())]


def golden_copy(version: int, tmp_path: Path) -> Path:
    """A copy of a golden run: nothing a test does can change the committed bytes."""
    src = GOLDEN / f"v{version}" / "run"
    assert (src / "checkpoints").is_dir(), f"{src} is missing: the golden files must be committed"
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("golden", GOLDEN_PARAMS)
def test_steps_and_metadata(golden: Golden, tmp_path: Path) -> None:
    store = ckptfs.open(str(golden_copy(golden.version, tmp_path)))
    recipe = golden.recipe()
    assert store.steps() == sorted(recipe)
    for step, (_, meta, algorithm, *world) in recipe.items():
        info = store.info(step)
        assert info.manifest.format_version == golden.version
        assert info.marker.format_version == 1
        assert info.manifest.hash_algorithm == algorithm
        if golden.sharded:
            assert info.manifest.world_size == world[0]
            ranks = {f"rank-{r:05d}/data-0.safetensors" for r in range(world[0])}
            if has_rank_metadata(info.manifest):  # the rank files are found through the table
                assert {f.path for f in info.manifest.files} == {
                    "dcp-spec.msgpack", "rank-table/block-00000.bin"}
                full = expand(store.storage, info).manifest.files
                assert {f.path for f in full} == {"dcp-spec.msgpack",
                                                  "rank-table/block-00000.bin", *ranks, *(
                    f"rank-{r:05d}/index.msgpack" for r in range(world[0]))}
            else:
                assert {f.path for f in info.manifest.files} == {"dcp.msgpack", *ranks}
        assert {k: v for k, v in info.metadata.items() if k != "tensor_count"} == meta


@pytest.mark.parametrize(("golden", "step"), STEP_PARAMS)
def test_loads_bit_exact(golden: Golden, step: int, tmp_path: Path) -> None:
    """Each step, loaded whole in one process (a sharded one with no process group)."""
    state = golden.recipe()[step][0]
    store = ckptfs.open(str(golden_copy(golden.version, tmp_path)))
    assert_bit_exact(store.load(step), state)
    if golden.extra_loads:
        first = next(iter(state))
        assert_bit_exact(store.load(step, keys=[first]), {first: state[first]})
        assert_bit_exact(store.load(step, mmap=True), state)


@pytest.mark.parametrize("golden", GOLDEN_PARAMS)
def test_verifies(golden: Golden, tmp_path: Path) -> None:
    store = ckptfs.open(str(golden_copy(golden.version, tmp_path)))
    for step in store.steps():
        for quick in (True, False):
            report = store.verify(step, quick=quick)
            assert report.ok, report.problems


@pytest.mark.parametrize("golden", GOLDEN_PARAMS)
def test_by_hand_checker(golden: Golden, tmp_path: Path) -> None:
    """The by-hand checker of docs/protocol.md accepts the run (it reads the newest step) and,
    for a run whose step 1 differs in kind (2 ranks; no references), a copy holding step 1
    alone."""
    from test_format_spec import checker_source

    run = golden_copy(golden.version, tmp_path)
    script = tmp_path / "check.py"
    script.write_text(checker_source())
    refs = golden.references(run) if golden.references else None
    roots = [(run, golden.checker, None if refs is None else refs[0])]
    if golden.only_step1:
        only1 = tmp_path / "only1"
        shutil.copytree(run, only1)
        shutil.rmtree(only1 / "checkpoints" / "step-000000000002")
        roots.append((only1, golden.only_step1, None if refs is None else refs[1]))
    for root, expect, n in roots:
        done = subprocess.run([sys.executable, str(script), str(root)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        for text in expect:
            assert text in done.stdout, (root.name, text, done.stdout)
        if n is not None:
            assert f"{n} references verified" in done.stdout


# ----------------------------------------------------------------------------------------------
# What one format adds


@pytest.fixture
def v1_run(tmp_path: Path) -> Path:
    return golden_copy(1, tmp_path)


@pytest.fixture
def v2_run(tmp_path: Path) -> Path:
    return golden_copy(2, tmp_path)


@pytest.fixture
def v3_run(tmp_path: Path) -> Path:
    return golden_copy(3, tmp_path)


@pytest.fixture
def v4_run(tmp_path: Path) -> Path:
    return golden_copy(4, tmp_path)


@pytest.fixture
def v5_run(tmp_path: Path) -> Path:
    return golden_copy(5, tmp_path)


def test_v1_ties_and_views(v1_run: Path) -> None:
    out = ckptfs.open(str(v1_run)).load(1)
    assert out["model"]["emb.weight"] is out["model"]["head.weight"]
    assert out["views"]["z_conj"] is not out["views"]["z"]
    assert isinstance(out["trainer"]["size"], torch.Size)
    assert out["trainer"]["dtype"] is torch.bfloat16
    dtypes = {t.dtype for t in out["tensors"].values()}
    assert {getattr(torch, n) for n in RECIPE.V1_DTYPES} <= dtypes


@pytest.mark.sharded
def test_v2_loads_into_another_placement(v2_run: Path) -> None:
    """Written by 2 ranks (rows and columns split), read into whole tensors in one process
    through the ranged reader: every chunk read, verified and copied into place."""
    state, _, _, _ = RECIPE.golden_v2()[1]
    into = {k: zeros(state[k]) for k in ("rows", "cols", "replicated")}
    ckptfs.open(str(v2_run)).load(1, into=into)
    assert_bit_exact(into, {k: state[k] for k in into})


def test_v3_references(v3_run: Path) -> None:
    """Step 2 references step 1's unchanged tensors: one reference, to step 1's attempt."""
    store = ckptfs.open(str(v3_run))
    m = store.info(2).manifest
    assert len(m.references) == 1
    ref = m.references[0]
    assert (ref.step, ref.attempt) == (1, store.info(1).attempt)
    assert store.info(2).bytes_written < store.info(2).bytes


def test_v3_refused_by_a_pre_v3_reader(v3_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that knows formats 1 and 2 only (the version check of ckptfs before v3)
    refuses v3 with FormatVersionError."""
    from ckptfs.errors import FormatVersionError
    from ckptfs.format import versions

    monkeypatch.setattr(versions, "READ_VERSIONS", (1, 2))
    monkeypatch.setattr(versions, "MAX_READ_VERSION", 2)
    with pytest.raises(FormatVersionError, match="format version 3"):
        ckptfs.open(str(v3_run)).load(2)


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


def test_v4_references(v4_run: Path) -> None:
    import msgpack

    from ckptfs.format.layout import StepPaths

    store = ckptfs.open(str(v4_run))
    recipe = RECIPE.golden_v4()
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


@pytest.mark.sharded
def test_v4_loads_into_another_placement(v4_run: Path) -> None:
    """Step 2 into whole zero tensors in one process through the ranged reader: the frozen
    chunks read from step 1's rank files through the references, each checked by its digest."""
    state, _, _, _ = RECIPE.golden_v4()[2]
    into = {k: zeros(state[k]) for k in ("rows", "cols", "replicated")}
    ckptfs.open(str(v4_run)).load(2, into=into)
    assert_bit_exact(into, {k: state[k] for k in into})


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


@pytest.mark.sharded
def test_v5_loads_into_another_placement(v5_run: Path) -> None:
    """Written by 2 ranks with per-rank metadata, read into whole tensors in one process: the
    spec, every row and both ranks' index documents, then every chunk read and verified."""
    state, _, _, _ = RECIPE.golden_v5()[1]
    into = {k: zeros(state[k]) for k in ("rows", "cols", "replicated")}
    ckptfs.open(str(v5_run)).load(1, into=into)
    assert_bit_exact(into, {k: state[k] for k in into})


def test_v5_refused_by_a_pre_v5_reader(v5_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that knows formats 1 to 4 only refuses v5, both steps, with
    FormatVersionError."""
    from ckptfs.errors import FormatVersionError
    from ckptfs.format import versions

    monkeypatch.setattr(versions, "READ_VERSIONS", (1, 2, 3, 4))
    monkeypatch.setattr(versions, "MAX_READ_VERSION", 4)
    for step in sorted(RECIPE.golden_v5()):
        with pytest.raises(FormatVersionError, match="format version 5"):
            ckptfs.open(str(v5_run)).load(step)
