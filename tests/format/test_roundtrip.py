"""Round-trip exactness of the state format (format v1) on local disk and memory."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.errors import UnsupportedValueError
from ckptfs.format.serialize import supported_dtypes
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def roundtrip(backend: Backend, state: dict[str, Any], **load_kw: Any) -> dict[Any, Any]:
    backend.open().save(1, state)
    return backend.open().load(1, **load_kw)


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(shape, generator=g, dtype=torch.float32) * 3
        if dtype.is_complex:
            return torch.complex(base, -base).to(dtype)
        return base.to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", supported_dtypes(), ids=str)
def test_every_dtype_bit_exact(backend: Backend, dtype: torch.dtype) -> None:
    state = {"t": _sample(dtype, (3, 5)), "scalar": _sample(dtype, ()),
             "empty": torch.empty((0, 4), dtype=dtype)}
    out = roundtrip(backend, state)
    assert_state_equal(out, state)
    assert out["scalar"].dim() == 0 and out["empty"].shape == (0, 4)


def test_dtypes_cover_the_issue_list() -> None:
    names = {str(d) for d in supported_dtypes()}
    for required in ("torch.bfloat16", "torch.float16", "torch.float32", "torch.float64",
                     "torch.bool", "torch.int8", "torch.int16", "torch.int32", "torch.int64",
                     "torch.uint8", "torch.float8_e4m3fn", "torch.float8_e5m2"):
        assert required in names


def test_special_floats_in_tensors_and_values(backend: Backend) -> None:
    t = torch.tensor([math.inf, -math.inf, math.nan, -0.0, 1e-45])
    state = {"t": t, "v": {"inf": math.inf, "ninf": -math.inf, "nan": math.nan, "negz": -0.0}}
    out = roundtrip(backend, state)
    assert_state_equal(out, state)
    assert math.copysign(1.0, out["v"]["negz"]) == -1.0


def test_non_contiguous_views(backend: Backend) -> None:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    state = {"transposed": base.t(), "strided": base[::2, 1::3], "expanded":
             torch.ones(1, 3).expand(4, 3), "conj": torch.complex(base[:2], base[:2]).conj()}
    out = roundtrip(backend, state)
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj()), k
        assert out[k].is_contiguous()


def test_tied_weights_come_back_tied(backend: Backend) -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    sd = model.state_dict(keep_vars=False)
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    out = roundtrip(backend, {"model": sd, "again": [sd["emb.weight"]]})
    assert out["model"]["emb.weight"] is out["model"]["head.weight"]
    assert out["again"][0] is out["model"]["emb.weight"]
    # Stored once: one tensor in the state document.
    info = backend.open().info(1)
    assert info.manifest.metadata["tensor_count"] == 1


def test_overlapping_different_views_are_independent_copies(backend: Backend) -> None:
    base = torch.arange(10, dtype=torch.int32)
    state = {"a": base[:6], "b": base[4:]}
    out = roundtrip(backend, state)
    assert torch.equal(out["a"], base[:6]) and torch.equal(out["b"], base[4:])
    out["a"][5] = -1
    assert out["b"][1] == 5  # not aliased after load (documented)


def test_value_types_exact(backend: Backend) -> None:
    state = {
        "trainer": OrderedDict([("step", 1000), ("epoch", 3), ("loss", 0.42)]),
        "ints": {0: "zero", 1: "one", -5: "neg", 2**40: "big"},
        "mixed_keys": {1: "int", "1": "str", 1.5: "float", None: "none", b"k": "bytes",
                       (1, "a"): "tuple"},
        "tuple": (1, (2, 3), [4, (5,)]),
        "none": None, "bools": [True, False], "bytes": b"\x00\xff" * 10, "str": "héllo ✓",
        "bigint": 2**100, "negbig": -(2**80), "u64max": 2**64 - 1,
        "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
        "empty": {"d": {}, "l": [], "t": ()},
    }
    out = roundtrip(backend, state)
    assert_state_equal(out, state)
    assert type(out["tuple"][1]) is tuple and type(out["tuple"][2]) is list
    assert isinstance(out["size"], torch.Size)
    assert out["dtype"] is torch.bfloat16


def test_optimizer_state_int_keys_and_resume(backend: Backend) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x = torch.randn(16, 4)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict()}
    out = roundtrip(backend, state)
    assert_state_equal(out, state)
    assert set(out["optimizer"]["state"]) == {0, 1, 2, 3}

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optimizer"])
    sched2.load_state_dict(out["scheduler"])
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
        s.step()
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p1, p2)


def test_transformer_adamw_bit_exact_memory() -> None:
    """The issue's done-when: a real nn.Transformer + AdamW after a few steps, via memory://."""
    torch.manual_seed(1)
    model = torch.nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2,
                                 num_decoder_layers=2, dim_feedforward=64, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    src, tgt = torch.randn(5, 2, 32), torch.randn(4, 2, 32)
    for _ in range(3):
        opt.zero_grad()
        model(src, tgt).pow(2).mean().backward()
        opt.step()
    store = ckptfs.open("memory://transformer-roundtrip")
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "trainer": {"step": 3, "epoch": 0, "loss": 0.25}}
    store.save(3, state)
    out = ckptfs.open("memory://transformer-roundtrip").load()
    assert_state_equal(out, state)
    fresh = torch.nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2,
                                 num_decoder_layers=2, dim_feedforward=64, dropout=0.0)
    fresh.load_state_dict(out["model"])
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), fresh.state_dict().items(),
                                  strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


def test_map_location(backend: Backend) -> None:
    state = {"t": torch.arange(4.0), "tied": None}
    state["tied"] = state["t"]
    out = roundtrip(backend, state, map_location="cpu")
    assert out["t"].device.type == "cpu" and out["tied"] is out["t"]
    out = roundtrip_step2(backend, state, map_location=torch.device("meta"))
    assert out["t"].device.type == "meta" and out["tied"] is out["t"]


def roundtrip_step2(backend: Backend, state: dict[str, Any], **kw: Any) -> dict[Any, Any]:
    backend.open().save(2, state)
    return backend.open().load(2, **kw)


def test_sharding_many_files(backend: Backend) -> None:
    store = ckptfs.CheckpointStore(backend.open().storage, shard_bytes=1000)
    state = {f"w{i}": torch.full((100,), float(i)) for i in range(7)}  # 400 B each
    info = store.save(1, state)
    assert len([f for f in info.manifest.files if f.path.endswith(".safetensors")]) >= 3
    assert_state_equal(backend.open().load(1), state)


def test_loaded_tensors_are_writable_and_independent(backend: Backend) -> None:
    out = roundtrip(backend, {"a": torch.zeros(3), "b": torch.zeros(3)})
    out["a"] += 1
    assert torch.equal(out["b"], torch.zeros(3))


@pytest.mark.parametrize("bad,where", [
    ({"m": {"fn": print}}, "m/fn"),
    ({"m": [1, 2, object()]}, "m/2"),
    ({"opt": {"state": {0: {"x": range(2)}}}}, "opt/state/0/x"),
    ({"s": torch.zeros(2).to_sparse()}, "s"),
])
def test_unsupported_values_named_before_writing(backend: Backend, bad: dict[str, Any],
                                                 where: str) -> None:
    with pytest.raises(UnsupportedValueError) as ei:
        backend.open().save(1, bad)
    assert where in str(ei.value)
    assert isinstance(ei.value, TypeError)
    assert backend.raw_files() == {}


def test_cycle_and_non_dict_root(backend: Backend) -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(UnsupportedValueError, match="cycle"):
        backend.open().save(1, {"loop": loop})
    with pytest.raises(UnsupportedValueError, match="dict"):
        backend.open().save(1, [1, 2])  # type: ignore[arg-type]


def test_a_rebuilt_tree_holds_its_tensors_no_longer_than_its_owner() -> None:
    """build_tree leaves no reference cycle: a load's tensors are freed as soon as the state
    is dropped, not when the cyclic collector runs (an export or a batched load grew by a
    tensor file per file)."""
    import gc
    import weakref

    from ckptfs.format.serialize import build_tree

    t = torch.arange(4.0)
    ref = weakref.ref(t)
    tree = ["d", [["a", ["T", 0]], ["b", ["l", [1, 2]]]]]
    gc.disable()
    try:
        state = build_tree(tree, [t], where="x")
        assert state["a"] is t
        del state, t
        assert ref() is None
    finally:
        gc.enable()
