"""CUDA paths: saving GPU tensors (copied to host one tensor at a time), loading with
map_location onto the GPU, tied weights and dtypes on the device.  These need a CUDA device, so
on CPU-only machines (CI) they are skipped with that reason; they were run on an H200 (see the
CHANGELOG / issue notes for the run)."""

from __future__ import annotations

import pytest
import torch

import ckptfs
from ckptfs.testing.conformance import assert_state_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (run on a GPU machine)")


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Transformer(d_model=64, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                                 dim_feedforward=128, dropout=0.0, batch_first=True).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    src, tgt = torch.randn(4, 7, 64, device="cuda"), torch.randn(4, 5, 64, device="cuda")
    for _ in range(3):
        opt.zero_grad()
        model(src, tgt).pow(2).mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("url", ["memory://cuda-rt", "local"])
def test_gpu_state_roundtrip_to_gpu(url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = str(tmp_path / "run") if url == "local" else f"{url}-{id(tmp_path)}"
    model, opt = _model_and_opt()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    ckptfs.open(url).save(3, state)
    out = ckptfs.open(url).load(map_location="cuda")
    assert_state_equal(out, state)
    assert all(t.is_cuda for t in out["model"].values())
    cpu = ckptfs.open(url).load()
    assert all(t.device.type == "cpu" for t in cpu["model"].values())
    assert_state_equal(cpu, state)
    fresh = torch.nn.Transformer(d_model=64, nhead=4, num_encoder_layers=2,
                                 num_decoder_layers=2, dim_feedforward=128, dropout=0.0,
                                 batch_first=True).cuda()
    fresh.load_state_dict(out["model"])


def test_gpu_tied_noncontiguous_and_dtypes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w = torch.randn(16, 8, device="cuda")
    state = {"a": w, "b": w, "t": w.t(), "bf16": w.to(torch.bfloat16),
             "f8": w.to(torch.float8_e4m3fn), "i": torch.arange(5, device="cuda"),
             "scalar": torch.tensor(3.5, device="cuda")}
    ckptfs.open(str(tmp_path)).save(1, state)
    out = ckptfs.open(str(tmp_path)).load(1, map_location=torch.device("cuda", 0))
    assert out["a"] is out["b"] and out["a"].is_cuda
    assert torch.equal(out["t"], w.t()) and out["t"].is_contiguous()
    for k in ("bf16", "i", "scalar"):
        assert torch.equal(out[k], state[k])
    assert torch.equal(out["f8"].view(torch.uint8), state["f8"].view(torch.uint8))


def test_large_gpu_state_bounded_host_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """1 GiB of GPU tensors: save copies one tensor at a time to the host, so the process's
    peak RSS grows by far less than the state size."""
    import resource

    state = {f"w{i}": torch.randn(64, 1024, 1024, device="cuda") for i in range(4)}  # 4x256 MiB
    torch.cuda.synchronize()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ckptfs.open(str(tmp_path), durable=False).save(1, state)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grown = peak - before
    print(f"peak RSS grew by {grown / 2**20:.0f} MiB while saving 1024 MiB of GPU tensors")
    assert grown < 700 * 2**20
    out = ckptfs.open(str(tmp_path)).load(1, map_location="cuda")
    for k, v in state.items():
        assert torch.equal(out[k], v)


def test_cuda_rng_state_roundtrip_through_store(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ckptfs.lifecycle import rng

    torch.cuda.manual_seed_all(123)
    torch.randn(10, device="cuda")
    state = rng.capture()
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.randn(1000, device="cuda")
    ckptfs.open(str(tmp_path)).save(1, {"rng": state})
    torch.cuda.manual_seed_all(999)  # disturb
    loaded = ckptfs.open(str(tmp_path)).load(1)["rng"]
    rng.restore(loaded)
    assert torch.equal(torch.randn(1000, device="cuda"), expected)


def test_manager_bit_exact_resume_on_cuda(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Dropout on the GPU draws from the CUDA generator: a resumed run continues bit-exactly
    only if the CUDA RNG state was restored."""
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.3),
                                torch.nn.Linear(64, 1)).cuda()
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    def train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
        losses = []
        for _ in steps:
            x = torch.randn(16, 32, device="cuda")
            loss = m(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    ref_m, ref_opt = build()
    torch.cuda.manual_seed_all(7)
    ref = train(ref_m, ref_opt, range(40))

    m, opt = build()
    torch.cuda.manual_seed_all(7)
    mgr = ckptfs.CheckpointManager(str(tmp_path / "run"))
    first = train(m, opt, range(20))
    mgr.save(20, model=m, optimizer=opt)
    m2, opt2 = build()
    torch.cuda.manual_seed_all(12345)  # a fresh process would start elsewhere
    start = ckptfs.CheckpointManager(str(tmp_path / "run")).restore_latest(model=m2,
                                                                           optimizer=opt2)
    assert start in (20, 21)
    second = train(m2, opt2, range(20, 40))
    assert first + second == ref
    for p, q in zip(ref_m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, q)
