"""Write the golden checkpoints under ``tests/golden/v1/run`` (format v1),
``tests/golden/v2/run`` (format v2, sharded), ``tests/golden/v3/run`` (format v3,
incremental: step 2 references step 1), ``tests/golden/v4/run`` (format v4, sharded
incremental: both steps by 2 gloo ranks, step 2 referencing step 1's rank files) and
``tests/golden/v5/run`` (format v5: format v2's run saved with ``metadata_layout="per-rank"``)
(run once, keep them).

The golden files are fixed bytes committed to the repository: every future ckptfs must load them
bit-exact (tests/format/test_golden.py), so a format change that breaks old checkpoints fails
CI.  Attempt names contain a time and random bits, so rerunning this script gives *different*
bytes: do not
regenerate a version that exists; a new format version gets a new recipe and directory beside
the others.  Usage::

    python tests/golden/make_golden.py --version 2   # refuses if the directory exists
    python tests/golden/make_golden.py --version 1 --out /tmp/x   # a throwaway copy

``golden_v1()`` to ``golden_v5()`` are the recipes: plain arithmetic (no RNG, no
transcendental functions), so any torch on any platform rebuilds the same values, and the
test compares the loaded checkpoints with what the recipe builds now. Format v2's step 1 is
written by 2 gloo ranks (processes on this machine): DTensors sharded by rows (7 rows: 4 and 3)
or by columns, replicated tensors and values, and values each rank holds alone
(``rng.ranks.<rank>``).  Format v4's two steps are written the same way by 2 gloo ranks through
one store opened with ``incremental=True`` (the first step is v4 too, with no references): step
2 holds the same ``frozen_*`` tensors as step 1 (each rank's the same local tensors, not written
to), so every rank references their bytes in its step-1 rank file.
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


def golden_v2() -> dict[int, tuple[dict[str, Any], dict[str, Any], str, int]]:
    """step -> (the full state, metadata, hash algorithm, world size) of the v2 golden run.
    With 2 ranks, :func:`rank_state` turns the full state into each rank's: tensors under
    ``rows`` become DTensors sharded by rows, under ``cols`` by columns, ``rng.ranks`` keeps
    the rank's own entry; everything else every rank holds (stored once)."""
    rows = {name: _tensor(name, (7, 3), salt) for salt, name in enumerate(V1_DTYPES)}
    rows["bf16_wide"] = _tensor("bfloat16", (7, 5), 40)
    cols = {"f32": _tensor("float32", (3, 8), 41), "i64": _tensor("int64", (2, 5), 42)}
    emb = _tensor("float32", (5, 2), 7)
    state1: dict[str, Any] = {
        "rows": rows,
        "cols": cols,
        "replicated": {"scalar_bf16": _tensor("bfloat16", (), 99),
                       "empty_f32": torch.empty((0, 5), dtype=torch.float32),
                       "special": torch.tensor([math.inf, -math.inf, math.nan, -0.0, 1e-45],
                                               dtype=torch.float32),
                       "emb": emb, "f16": _tensor("float16", (4,), 43)},
        # A list and a tuple holding tensors (walked; the tuple comes back a tuple).
        "seq": [_tensor("int32", (2,), 44), (_tensor("float64", (3,), 45), "label")],
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
            "inline": (torch.arange(3, dtype=torch.int16), {"t": _tensor("bfloat16", (2,), 46)}),
        },
        "rng": {"world_size": 2, "ranks": {0: _tensor("uint8", (6,), 47),
                                           1: _tensor("uint8", (6,), 48)}},
    }
    meta1 = {"notes": "golden v2, step 1 (2 ranks)", "nested": {"a": [1, 2.5, None, True]}}
    state2 = {"model": {"w": _tensor("bfloat16", (2, 3), 5), "b": _tensor("float16", (3,), 6)},
              "optimizer": {"state": {0: {"step": torch.tensor(3.0),
                                          "exp_avg": _tensor("float32", (2, 3), 8)}},
                            "param_groups": [{"lr": 0.001, "params": [0]}]}}
    meta2 = {"notes": "golden v2, step 2 (one process, sha256 files)"}
    return {1: (state1, meta1, "blake3", 2), 2: (state2, meta2, "sha256", 1)}


def rank_state(full: dict[str, Any], rank: int, mesh: Any,
               memo: dict[int, tuple[torch.Tensor, Any]] | None = None) -> dict[str, Any]:
    """This rank's part of a v2 or v4 golden state (see :func:`golden_v2`).  With ``memo``
    (shared by the steps of one run), a tensor of the recipe is distributed once: a later step
    holding the same tensor gets the same DTensor, whose local tensor is unchanged."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def shard(t: torch.Tensor, dim: int) -> Any:  # every rank holds the full tensor: no send
        if memo is None:
            return distribute_tensor(t, mesh, [Shard(dim)], src_data_rank=None)
        if id(t) not in memo:  # the tensor kept beside its DTensor: its id stays its own
            memo[id(t)] = (t, distribute_tensor(t, mesh, [Shard(dim)], src_data_rank=None))
        return memo[id(t)][1]

    out = dict(full)
    out["rows"] = {k: shard(v, 0) for k, v in full["rows"].items()}
    out["cols"] = {k: shard(v, 1) for k, v in full["cols"].items()}
    out["rng"] = {"world_size": 2, "ranks": {rank: full["rng"]["ranks"][rank]}}
    return out


def golden_v3() -> dict[int, tuple[dict[str, Any], dict[str, Any], str]]:
    """step -> (state, metadata, hash algorithm) of the v3 (incremental) golden run: step 2
    holds the same ``frozen`` tensor objects as step 1 (so the incremental save references them
    from step 1's file) and a changed ``head`` and ``trainer``."""
    frozen = {name: _tensor(name, (3, 4), 60 + salt) for salt, name in enumerate(V1_DTYPES)}
    frozen["scalar_bf16"] = _tensor("bfloat16", (), 98)
    frozen["empty_f32"] = torch.empty((0, 5), dtype=torch.float32)
    state1: dict[str, Any] = {"frozen": frozen,
                              "head": {"w": _tensor("float32", (4, 3), 70)},
                              "trainer": {"step": 1, "name": "golden v3 ✓", "bigint": 2**70}}
    state2: dict[str, Any] = {"frozen": frozen,
                              "head": {"w": _tensor("float32", (4, 3), 71)},
                              "trainer": {"step": 2, "name": "golden v3 ✓", "bigint": 2**70}}
    return {1: (state1, {"notes": "golden v3, step 1"}, "blake3"),
            2: (state2, {"notes": "golden v3, step 2 (references step 1)"}, "blake3")}


def golden_v4() -> dict[int, tuple[dict[str, Any], dict[str, Any], str, int]]:
    """step -> (the full state, metadata, hash algorithm, world size) of the v4 (sharded
    incremental) golden run: both steps saved by 2 gloo ranks through one store opened with
    ``incremental=True``, each rank's part built by :func:`rank_state` (one ``memo`` for both
    steps).  Both steps hold the same ``frozen_*`` tensor objects (row- and column-sharded
    DTensors and a replicated tensor): step 2 references their bytes in step 1's rank files.
    ``head``, ``bias``, ``trainer`` and ``rng`` change; ``empty`` (no bytes) is written each
    time."""
    frozen_rows = {"frozen_f32": _tensor("float32", (5, 3), 80),  # 5 rows: 3 and 2
                   "frozen_bf16": _tensor("bfloat16", (5, 2), 81),
                   "frozen_i64": _tensor("int64", (5,), 82)}
    frozen_cols = {"frozen_f16": _tensor("float16", (2, 6), 83)}
    frozen_replicated = {"frozen_u8": _tensor("uint8", (4,), 84),
                         "empty": torch.empty((0, 3), dtype=torch.float32)}

    def state(step: int) -> dict[str, Any]:
        return {"rows": {**frozen_rows, "head": _tensor("float32", (5, 2), 85 + step)},
                "cols": dict(frozen_cols),
                "replicated": {**frozen_replicated,
                               "bias": _tensor("float64", (3,), 87 + step)},
                "trainer": {"step": step, "loss": 0.5 / step, "name": "golden v4 ✓"},
                "rng": {"world_size": 2,
                        "ranks": {r: _tensor("uint8", (4,), 90 + 2 * step + r)
                                  for r in range(2)}}}

    return {1: (state(1), {"notes": "golden v4, step 1 (2 ranks)"}, "sha256", 2),
            2: (state(2), {"notes": "golden v4, step 2 (2 ranks, references step 1)"},
                "sha256", 2)}


def golden_v5() -> dict[int, tuple[dict[str, Any], dict[str, Any], str, int]]:
    """step -> (the full state, metadata, hash algorithm, world size) of the v5 golden run:
    format v2's states (step 1 by 2 gloo ranks, step 2 by one process), saved by a store
    opened with ``metadata_layout="per-rank"`` (the metadata split per rank)."""
    out = {}
    for step, (state, meta, algorithm, world) in golden_v2().items():
        out[step] = (state, {**meta, "notes": str(meta["notes"]).replace("v2", "v5")},
                     algorithm, world)
    return out


RECIPES = {1: golden_v1, 2: golden_v2, 3: golden_v3, 4: golden_v4, 5: golden_v5}


def _rank(version: int, rank: int, world: int, out: str, rdv: str) -> None:
    """One gloo rank: step 1 of the v2 run, or both steps of the v4 run (one incremental
    store, so its second save references the first's unchanged items)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ckptfs

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (world,))
        if version in (2, 5):
            full, meta, algorithm, _ = RECIPES[version]()[1]
            layout = "per-rank" if version == 5 else None
            ckptfs.open(out, algorithm=algorithm, metadata_layout=layout).save(
                1, rank_state(full, rank, mesh), metadata=meta)
        else:
            recipe = golden_v4()
            store = ckptfs.open(out, algorithm=recipe[1][2], incremental=True)
            memo: dict[int, tuple[torch.Tensor, Any]] = {}
            for step, (full, meta, _, _) in sorted(recipe.items()):
                store.save(step, rank_state(full, rank, mesh, memo), metadata=meta)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write(version: int, out: Path) -> None:
    import ckptfs

    if out.exists():
        sys.exit(f"{out} exists: golden checkpoints are written once and kept (see docstring)")
    if version == 1:
        for step, (state, meta, algorithm) in sorted(golden_v1().items()):
            ckptfs.open(str(out), algorithm=algorithm).save(step, state, metadata=meta)
    elif version == 3:  # one store: its second save references the first's unchanged tensors
        recipe = golden_v3()
        store = ckptfs.open(str(out), algorithm=recipe[1][2], incremental=True)
        for step, (state, meta, _) in sorted(recipe.items()):
            store.save(step, state, metadata=meta)
    else:
        import multiprocessing as mp
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_rank, args=(version, r, 2, str(out), f"{tmp}/rdv"))
                     for r in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(300)
            if any(p.exitcode != 0 for p in procs):
                sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        if version in (2, 5):
            state, meta, algorithm, _ = RECIPES[version]()[2]
            store = ckptfs.open(str(out), algorithm=algorithm, layout="ranks",
                                metadata_layout="per-rank" if version == 5 else None)
            store.save(2, state, metadata=meta)  # one process: the world of one
        elif not getattr(ckptfs.open(str(out)).info(2).manifest, "references", None):
            sys.exit(f"{out}: step 2 references nothing of step 1: not a v4 golden run")
    print(f"wrote format-v{version} golden run at {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", type=int, default=1, choices=sorted(RECIPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    write(args.version, args.out or HERE / f"v{args.version}" / "run")


if __name__ == "__main__":
    main()
