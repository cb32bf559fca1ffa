"""Write the golden format-v1 checkpoints under ``tests/golden/v1/run`` (run once, keep them).

The golden files are fixed bytes committed to the repository: every future ckptfs must load them
bit-exact (tests/test_golden.py), so a format change that breaks old checkpoints fails CI.  Attempt
names contain a time and random bits, so rerunning this script gives *different* bytes: do not
regenerate v1.  When format v2 lands, add a ``v2`` recipe and directory beside it, never replace
v1.  Usage::

    python tests/golden/make_golden.py            # refuses if the directory exists
    python tests/golden/make_golden.py --version 1 --out /tmp/x   # a throwaway copy

``golden_v1()`` is the recipe: plain arithmetic (no RNG, no transcendental functions), so any
torch on any platform rebuilds the same values, and the test compares the loaded checkpoints
with what the recipe builds now.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

#: dtype name -> safetensors code; the golden tensors cover all of them.
V1_DTYPES = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
             "int64", "int32", "int16", "int8", "uint8", "bool", "complex64"]


def _values(n: int, salt: int) -> torch.Tensor:
    """n float64 values in [-7.2, 7.2], exact rationals of a fixed recipe."""
    i = torch.arange(n, dtype=torch.float64)
    return ((i * 37 + salt) % 101 - 50) / 7


def _tensor(dtype_name: str, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    n = math.prod(shape)
    v = _values(n, salt)
    if dtype == torch.bool:
        t = v > 0
    elif dtype == torch.complex64:
        t = torch.complex(v.float(), (-v * 2).float())
    elif dtype.is_floating_point:
        t = v.to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = (v * 7 * 13).round().clamp(info.min, info.max).to(torch.int64).to(dtype)
    return t.reshape(shape)


def golden_v1() -> dict[int, tuple[dict[str, Any], dict[str, Any], str]]:
    """step -> (state, metadata, hash algorithm) of the v1 golden run."""
    tensors = {name: _tensor(name, (3, 4), salt) for salt, name in enumerate(V1_DTYPES)}
    tensors["scalar_bf16"] = _tensor("bfloat16", (), 99)
    tensors["empty_f32"] = torch.empty((0, 5), dtype=torch.float32)
    tensors["special"] = torch.tensor([math.inf, -math.inf, math.nan, -0.0, 1e-45],
                                      dtype=torch.float32)
    emb = _tensor("float32", (5, 2), 7)
    z = _tensor("complex64", (4,), 11)
    state1: dict[str, Any] = {
        "tensors": tensors,
        # Tied weights (one storage, two places), a conjugate and a negative view, and a
        # non-contiguous view: each comes back with its own values, the tie kept.
        "model": {"emb.weight": emb, "head.weight": emb, "head.bias": emb[:, 1]},
        "views": {"z": z, "z_conj": z.conj(), "z_imag_neg": z.conj().imag,
                  "transposed": emb.t()},
        "trainer": {
            "step": 1, "epoch": 0, "loss": 0.25, "lr": 3e-4, "done": False, "none": None,
            "name": "golden ✓", "raw": b"\x00\xff\x10", "tuple": (1, (2, 3), [4, (5,)]),
            "int_keys": {0: "zero", -5: "neg", 2**40: "big"},
            "mixed_keys": {1.5: "float", None: "none", b"k": "bytes", (1, "a"): "tuple",
                           True: "bool"},
            "bigint": 2**200, "negbig": -(3**90), "u64max": 2**64 - 1, "i64min": -(2**63),
            "floats": [math.inf, -math.inf, math.nan, -0.0, 5e-324],
            "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
            "empty": {"d": {}, "l": [], "t": ()},
            "nested": {"a": [{"b": ({"c": [1, [2, [3]]]},)}]},
        },
    }
    meta1 = {"notes": "golden v1, step 1", "nested": {"a": [1, 2.5, None, True, "x"]},
             "big": 2**70}
    state2 = {"model": {"w": _tensor("bfloat16", (2, 3), 5), "b": _tensor("float16", (3,), 6)},
              "optimizer": {"state": {0: {"step": torch.tensor(3.0),
                                          "exp_avg": _tensor("float32", (2, 3), 8)}},
                            "param_groups": [{"lr": 0.001, "params": [0]}]}}
    meta2 = {"notes": "golden v1, step 2 (sha256 files)"}
    return {1: (state1, meta1, "blake3"), 2: (state2, meta2, "sha256")}


RECIPES = {1: golden_v1}


def write(version: int, out: Path) -> None:
    import ckptfs

    if out.exists():
        sys.exit(f"{out} exists: golden checkpoints are written once and kept (see docstring)")
    for step, (state, meta, algorithm) in sorted(RECIPES[version]().items()):
        ckptfs.open(str(out), algorithm=algorithm).save(step, state, metadata=meta)
    print(f"wrote format-v{version} golden run at {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", type=int, default=1, choices=sorted(RECIPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    write(args.version, args.out or HERE / f"v{args.version}" / "run")


if __name__ == "__main__":
    main()
