"""``ckptfs export --format hf`` and ``ckptfs.export_hf`` (docs/cli.md "export"): Hugging Face
sharded safetensors that ``transformers``' ``from_pretrained`` loads bit for bit, from a
single-process checkpoint and from a checkpoint saved by 2 gloo ranks from DTensors (formats v2
and v5); the shard rule, the index, atomic files, the refusal of an earlier export, and a
corrupted byte."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks
from safetensors import safe_open

import ckptfs
from ckptfs.cli.core import main
from ckptfs.format.hf_shards import (
    INDEX_NAME,
    ITEMSIZE,
    TensorSpec,
    parse_size,
    plan_shards,
)
from ckptfs.protocol import hf_export
from ckptfs.protocol.hf_export import export_hf

CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}


def llama(tie: bool = False, seed: int = 0) -> Any:
    """A tiny Llama built from a config (no hub), its weights random from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=tie))


def load_back(model: Any, out: Path) -> dict[str, torch.Tensor]:
    """``from_pretrained(out)`` with the model's ``config.json`` beside the export."""
    from transformers import LlamaForCausalLM

    model.config.save_pretrained(out)
    loaded = LlamaForCausalLM.from_pretrained(out)
    return loaded.state_dict()  # type: ignore[no-any-return]


def assert_bit_exact(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name


def check_index(out: Path, limit: int) -> dict[str, Any]:
    """The index against the files: every tensor of every shard named once in ``weight_map``
    with its file, ``total_size`` their bytes, no other shard file, and each shard within
    ``limit`` unless it holds one tensor."""
    index = json.loads((out / INDEX_NAME).read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    seen: dict[str, str] = {}
    total = 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            keys = list(f.keys())
            size = 0
            for k in keys:
                t = f.get_tensor(k)
                size += t.numel() * t.element_size()
                assert k not in seen
                seen[k] = name
            assert f.metadata()["format"] == "pt"
        assert size <= limit or len(keys) == 1, (name, size, keys)
        total += size
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == total
    return index  # type: ignore[no-any-return]


def load_files(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the export, by name, read with safetensors."""
    got: dict[str, torch.Tensor] = {}
    for name in sorted(p.name for p in out.glob("model-*.safetensors")):
        with safe_open(str(out / name), framework="pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return got


# -- the pure layout ----------------------------------------------------------------------------


def test_parse_size_as_save_pretrained() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("20kib") == 20 * 1024
    assert parse_size("1048576") == 1048576
    assert parse_size(4096) == 4096
    for bad in ("5 parsecs", "", "-1", "0", "GB", True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)  # type: ignore[arg-type]


def test_plan_shards_hugging_face_rule() -> None:
    specs = [TensorSpec(f"t{i}", "F32", (n,)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    # 40 B, 40 B, 120 B (over the limit of 100: alone), 20 B x 3
    assert plan_shards(specs, 100) == [[0, 1], [2], [3, 4, 5]]
    assert plan_shards(specs, 80) == [[0, 1], [2], [3, 4, 5]]
    assert plan_shards(specs, 40) == [[0], [1], [2], [3, 4], [5]]
    assert plan_shards(specs, 10**9) == [[0, 1, 2, 3, 4, 5]]


# -- single-process checkpoints (format v1) ------------------------------------------------------


def test_export_loads_bit_exact_in_several_shards(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    model = llama()
    sd = model.state_dict()
    store = ckptfs.open(str(tmp_path / "run"))
    store.save(7, {"model": sd, "trainer": {"step": 7, "lr": 0.1, "ema": torch.ones(3)}})
    out = tmp_path / "hf"
    limit = 20_000
    rc = main(["export", str(tmp_path / "run"), "--step", "7", "--key", "model", "--format",
               "hf", "--max-shard-size", "20KB", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    index = check_index(out, limit)
    assert summary["shards"] == len(summary["files"]) > 3
    assert summary["tensors"] == len(sd) == len(index["weight_map"])
    assert summary["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert summary["skipped"] == []
    # every shard's data is exactly its tensors: the largest tensor (the 128 x 32 embedding,
    # 16 KiB) fits, so no shard holds more than 20 KB
    assert_bit_exact(sd, load_back(model, out))
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_tied_weights_load(tmp_path: Path) -> None:
    """``tie_word_embeddings``: the state dict holds one tensor under two keys (stored once by
    ckptfs); both keys are exported and ``from_pretrained`` loads them tied."""
    from transformers import LlamaForCausalLM

    model = llama(tie=True, seed=1)
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    store = ckptfs.open(str(tmp_path / "run"))
    store.save(1, {"model": sd})
    out = tmp_path / "hf"
    result = export_hf(store, 1, out, key="model", max_shard_size="10KB")
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(
        json.loads((out / INDEX_NAME).read_text())["weight_map"])
    model.config.save_pretrained(out)
    loaded = LlamaForCausalLM.from_pretrained(out)
    assert_bit_exact(sd, loaded.state_dict())
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert result.tensors == len(sd)


def test_tensor_larger_than_shard_size_gets_its_own_shard(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    state = {"model": {"a": torch.arange(10, dtype=torch.float32),
                       "big": torch.randn(64, 32),                    # 8 KiB > 4 KB
                       "b": torch.arange(6, dtype=torch.int64),
                       "c": torch.ones(2, 3, dtype=torch.bfloat16),
                       "nested": {"w": torch.randn(3, 3)}},
             "trainer": {"step": 3}}
    store = ckptfs.open(str(tmp_path / "run"))
    store.save(3, state)
    out = tmp_path / "hf"
    result = export_hf(store, None, out, max_shard_size=4000)  # whole state, latest step
    index = check_index(out, 4000)
    big_file = index["weight_map"]["model.big"]
    assert [k for k, f in index["weight_map"].items() if f == big_file] == ["model.big"]
    assert result.skipped == ["trainer/step"]
    flat = {"model.a": state["model"]["a"], "model.big": state["model"]["big"],
            "model.b": state["model"]["b"], "model.c": state["model"]["c"],
            "model.nested.w": state["model"]["nested"]["w"]}
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / name), framework="pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    assert_bit_exact(flat, got)
    # the CLI notes the skipped value on stderr
    main(["export", str(tmp_path / "run"), "--format", "hf", str(tmp_path / "hf2"), "--quiet"])
    assert "skipped 1 non-tensor value(s)" in capsys.readouterr().err


def test_reads_one_tensor_file_at_a_time_and_frees_it(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded memory, format v1: one load per tensor file (its digest covers the whole file),
    each selecting only that file's tensors, and the previous load's tensors freed before the
    next load starts."""
    import weakref

    store = ckptfs.open(str(tmp_path / "run"))
    store.shard_bytes = 256 * 1024  # 4 tensor files of the model's 8 x 128 KiB
    sd = {f"layers.{i}.weight": torch.randn(128, 256) for i in range(8)}
    info = store.save(1, {"model": sd})
    files = [e.path for e in info.manifest.files if e.path.startswith("tensors-")]
    assert len(files) == 4
    loads: list[list[Any]] = []
    alive: list[weakref.ref[torch.Tensor]] = []
    real = type(store).load_info

    def load_info(self: Any, info: Any, **kw: Any) -> Any:
        assert all(ref() is None for ref in alive), "an earlier load is still held"
        loads.append(sorted(p[1] for p in kw["keys"]))
        state = real(self, info, **kw)
        alive.extend(weakref.ref(t) for t in state["model"].values())
        return state

    monkeypatch.setattr(type(store), "load_info", load_info)
    export_hf(store, 1, tmp_path / "hf", key="model", max_shard_size="300KB")
    assert loads == [[f"layers.{i}.weight" for i in (j, j + 1)] for j in range(0, 8, 2)]
    got = load_files(tmp_path / "hf")
    assert_bit_exact(sd, got)


@pytest.mark.sharded
def test_sharded_reads_batches_and_frees_them(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded memory, sharded formats: each load reads at most READ_BATCH_BYTES of tensors
    (here 40 KB: two of the 16 KiB tensors), the previous batch freed first."""
    import weakref

    from ckptfs.protocol import sharded

    sd = {f"layers.{i}.weight": torch.randn(64, 64) for i in range(5)}
    url = str(tmp_path / "run")
    run_ranks(job_save_dtensors, 2, url, sd, None, timeout=240)
    monkeypatch.setattr(hf_export, "READ_BATCH_BYTES", 40_000)
    loads: list[list[str]] = []
    alive: list[weakref.ref[torch.Tensor]] = []
    real = sharded.load_full

    def load_full(*args: Any, **kw: Any) -> Any:
        assert all(ref() is None for ref in alive), "an earlier batch is still held"
        loads.append(sorted(kw["keys"]))
        state = real(*args, **kw)
        alive.extend(weakref.ref(t) for t in state["model"].values())
        return state

    monkeypatch.setattr(sharded, "load_full", load_full)
    export_hf(url, 4, tmp_path / "hf", key="model")
    assert loads == [[f"model.layers.{i}.weight" for i in (j, j + 1) if i < 5]
                     for j in range(0, 5, 2)]
    assert_bit_exact(sd, load_files(tmp_path / "hf"))


def test_refuses_an_earlier_export_unless_forced(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    store = ckptfs.open(str(tmp_path / "run"))
    store.save(1, {"model": {"w": torch.randn(40, 10), "v": torch.randn(40, 10)}})
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a directory holding other files is fine
    first = export_hf(store, 1, out, key="model", max_shard_size=1600)
    assert first.files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ckptfs.ExportExistsError, match=r"already holds an export.*--force"):
        export_hf(store, 1, out, key="model")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched
    rc = main(["export", str(tmp_path / "run"), "--key", "model", "--format", "hf", str(out)])
    assert rc == 2 and "--force" in capsys.readouterr().err
    # --force: one shard now; the earlier shards are gone, config.json is kept
    rc = main(["export", str(tmp_path / "run"), "--key", "model", "--format", "hf", str(out),
               "--force", "--quiet"])
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", INDEX_NAME]
    check_index(out, 5 * 10**9)
    # an output that is a file
    (tmp_path / "file").write_text("x")
    with pytest.raises(ckptfs.ExportExistsError, match="not a directory"):
        export_hf(store, 1, tmp_path / "file", key="model")


def test_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = ckptfs.open(str(tmp_path / "run"))
    store.save(1, {"model": {"w": torch.randn(4)}, "n": 3})
    url = str(tmp_path / "run")
    assert main(["export", url, "--format", "hf", "--max-shard-size", "5XB",
                 str(tmp_path / "a")]) == 2
    assert "--max-shard-size" in capsys.readouterr().err
    assert main(["export", url, "--max-shard-size", "5GB", str(tmp_path / "a.pt")]) == 2
    assert "--format hf only" in capsys.readouterr().err
    assert main(["export", url, "--key", "nope", "--format", "hf", str(tmp_path / "a")]) == 2
    assert "no 'nope'" in capsys.readouterr().err
    with pytest.raises(ckptfs.UnsupportedValueError, match="no tensor"):
        export_hf(store, 1, tmp_path / "b", key="n")
    with pytest.raises(ckptfs.UnsupportedValueError, match="selects one tensor"):
        export_hf(store, 1, tmp_path / "b", key="model/w")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_corrupt_byte_fails_and_leaves_no_final_shard(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    model = llama(seed=2)
    store = ckptfs.open(str(tmp_path / "run"))
    info = store.save(2, {"model": model.state_dict()})
    tensor_files = [e.path for e in info.manifest.files if e.path.endswith(".safetensors")]
    victim = Path(info.url) / tensor_files[-1]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01  # a tensor byte near the end: headers stay valid
    victim.write_bytes(bytes(data))
    out = tmp_path / "hf"
    with pytest.raises(ckptfs.CorruptCheckpointError, match=tensor_files[-1]):
        export_hf(store, 2, out, key="model", max_shard_size="20KB")
    assert sorted(p.name for p in out.iterdir()) == []  # no shard, no index, no temporary
    rc = main(["export", str(tmp_path / "run"), "--key", "model", "--format", "hf", str(out)])
    assert rc == 1 and tensor_files[-1] in capsys.readouterr().err
    assert list(out.iterdir()) == []


# -- sharded checkpoints: 2 gloo ranks, DTensors --------------------------------------------------


def job_save_dtensors(rank: int, world: int, url: str, full: dict[str, torch.Tensor],
                      layout: str | None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = {k: distribute_tensor(t, mesh, [Shard(0) if t.dim() else Replicate()])
             for k, t in full.items()}
    info = ckptfs.open(url, metadata_layout=layout).save(
        4, {"model": model, "trainer": {"step": 4, "note": "two ranks"}})
    return info.manifest.format_version


@pytest.mark.sharded
@pytest.mark.parametrize("layout", [None, "per-rank"], ids=["v2", "v5-per-rank"])
def test_sharded_dtensor_checkpoint_exports_bit_exact(tmp_path: Path, layout: str | None) -> None:
    model = llama(seed=3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    url = str(tmp_path / "run")
    versions = run_ranks(job_save_dtensors, 2, url, sd, layout, timeout=240)
    assert versions[0] == versions[1] and versions[0] >= 2
    out = tmp_path / "hf"
    result = export_hf(url, 4, out, key="model", max_shard_size="24KB")
    assert result.tensors == len(sd) and len(result.files) > 2
    assert result.total_size == sum(math.prod(t.shape) * t.element_size() for t in sd.values())
    check_index(out, 24_000)
    assert_bit_exact(sd, load_back(model, out))


@pytest.mark.sharded
def test_sharded_corrupt_chunk_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_export, "READ_BATCH_BYTES", 1)  # one tensor a read
    sd = {"b": torch.randn(16), "w": torch.randn(16, 8)}
    url = str(tmp_path / "run")
    run_ranks(job_save_dtensors, 2, url, sd, None, timeout=240)
    info = ckptfs.open(url).info(4)
    written: list[int] = []
    entry = next(e for e in info.manifest.files if e.path.startswith("rank-00001/"))
    victim = Path(info.url) / entry.path
    data = bytearray(victim.read_bytes())
    rows = next(c for c in entry.chunks if c.length == 8 * 8 * 4)  # rank 1's rows of "w"
    data[rows.offset + 7] ^= 0x10
    victim.write_bytes(bytes(data))
    out = tmp_path / "hf"
    # the documents and headers are intact: the export starts, and the byte is found as read
    with pytest.raises(ckptfs.CorruptCheckpointError, match=entry.path):
        export_hf(url, 4, out, key="model", max_shard_size=100, progress=written.append)
    assert written == [64]  # "b" (the first shard) was written, then "w" failed as read
    assert list(out.iterdir()) == []  # and the first shard's temporary file is gone


def job_plain_dcp_save(rank: int, world: int, url: str, full: dict[str, torch.Tensor]) -> Any:
    """A plain ``dcp.save`` through ckptfs's Writer: no stored tree, DCP's flat names only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckptfs.dcp

    mesh = init_device_mesh("cpu", (world,))
    model = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in full.items()}
    dcp.save({"model": model, "epoch": 2}, storage_writer=ckptfs.dcp.Writer(url, 6),
             planner=ckptfs.dcp.SavePlanner())
    return 0


@pytest.mark.sharded
def test_plain_dcp_save_exports(tmp_path: Path) -> None:
    sd = {"embed.weight": torch.randn(8, 4), "layers.0.w": torch.randn(6, 4),
          "norm.weight": torch.randn(4)}
    url = str(tmp_path / "run")
    run_ranks(job_plain_dcp_save, 2, url, sd, timeout=240)
    result = export_hf(url, 6, tmp_path / "hf", key="model", max_shard_size=100)
    assert result.tensors == 3 and len(result.files) == 3  # 128 B alone, 96 B, 16 B
    assert_bit_exact(sd, load_files(tmp_path / "hf"))
    check_index(tmp_path / "hf", 100)


def test_incremental_checkpoint_exports(tmp_path: Path) -> None:
    """Format v3 (incremental): the unchanged tensors are references to the earlier step's
    files, read and verified where they are stored."""
    store = ckptfs.open(str(tmp_path / "run"), incremental=True)
    sd = {f"layers.{i}.weight": torch.randn(128, 256) for i in range(8)}
    store.save(1, {"model": sd})
    sd = {**sd, "layers.3.weight": torch.randn(128, 256)}
    info = store.save(2, {"model": sd})
    from ckptfs.format.incremental import references_of

    assert references_of(info.manifest)  # the unchanged tensors live in step 1's files
    result = export_hf(store, 2, tmp_path / "hf", key="model", max_shard_size="300KB")
    assert len(result.files) == 4
    assert_bit_exact(sd, load_files(tmp_path / "hf"))


def test_lists_and_nested_keys(tmp_path: Path) -> None:
    """Tensors in lists and nested dicts get their ``"."``-joined key paths; ``--key`` takes a
    ``/``-separated path; tensors in a list are read with the list."""
    state = {"run": {"net": {"blocks": [torch.randn(3), {"w": torch.randn(2, 2)}],
                             "head": {"b": torch.zeros(4, dtype=torch.int32)}, "name": "x"}}}
    store = ckptfs.open(str(tmp_path / "run"))
    store.save(1, state)
    result = export_hf(store, 1, tmp_path / "hf", key="run/net")
    net = state["run"]["net"]
    assert_bit_exact({"blocks.0": net["blocks"][0], "blocks.1.w": net["blocks"][1]["w"],
                      "head.b": net["head"]["b"]}, load_files(tmp_path / "hf"))
    assert result.skipped == ["run/net/name"]


@pytest.mark.parametrize("backend", ["memory_backend", "s3_backend"])
def test_exports_from_object_stores(tmp_path: Path, request: pytest.FixtureRequest,
                                    backend: str) -> None:
    b = request.getfixturevalue(backend)
    model = llama(seed=4)
    sd = model.state_dict()
    store = ckptfs.open(b.url, **b.options)
    store.save(9, {"model": sd, "step": 9})
    out = tmp_path / "hf"
    result = export_hf(store, 9, out, key="model", max_shard_size="40KB")
    assert result.source.startswith(b.url.split("://")[0]) and len(result.files) > 1
    check_index(out, 40_000)
    assert_bit_exact(sd, load_back(model, out))


def test_itemsize_table_matches_torch() -> None:
    from ckptfs.format.serialize import CODE_DTYPES

    for code, dtype in CODE_DTYPES.items():
        assert ITEMSIZE[code] == dtype.itemsize, code
