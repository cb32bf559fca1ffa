"""A smoke run of ``benchmarks/fixed_costs.py`` (`ckptfs.bench.fixed`: the fixed costs of a save
and a load: a tiny state's save and load against DCP and torch.save/torch.load, a verified load
against torch.load and DCP, a verified load in fresh processes against both, and the in-place
sharded load at 2 gloo ranks against dcp.load) at tiny sizes, so it never rots.  Nothing here
checks speed: only that every variant ran and every ratio and target is printed and recorded.
``ckptfs bench fixed`` and its report: tests/bench/test_bench_fixed.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ckptfs.bench.common import REPO

RATIOS = {
    "tiny": ["tiny save: dcp/ckptfs", "tiny save, same durability: dcp+dir fsyncs/ckptfs",
             "tiny save: torch.save/ckptfs", "tiny save, no fsync of data: dcp/ckptfs",
             "tiny load: torch.load/ckptfs", "tiny load: dcp/ckptfs"],
    "load": ["warm load: torch.load/ckptfs", "warm load: dcp/ckptfs"],
    "fresh": ["fresh load: torch.load/ckptfs", "fresh load: dcp/ckptfs"],
    "inplace": ["in-place load: dcp/ckptfs", "in-place load, steady: dcp/ckptfs"],
}


def test_fixed_costs_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "fixed.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.fixed_costs", "--tiny-rounds", "2", "--load-size",
         "1MiB", "--load-rounds", "1", "--fresh-size", "1MiB", "--fresh-rounds", "1",
         "--inplace-size", "2MiB", "--inplace-rounds", "1", "--inplace-loads", "2",
         "--workdir", str(tmp_path), "--json", str(out)],
        cwd=str(REPO), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    result = json.loads(out.read_text())
    for part, labels in RATIOS.items():
        assert set(result[part]["ratios"]) == set(labels), part
        for label in labels:
            ratio = result[part]["ratios"][label]
            assert ratio > 0, label
            assert f"ratio {label}: {ratio:.2f}x (of the medians: " in text, label
            lo, hi = result[part]["ratio_ranges"][label]
            assert f"; per round {lo:.2f}-{hi:.2f}x)" in text, label
            assert result[part]["ratios_of_medians"][label] > 0, label
        assert all(v > 0 for v in result[part]["median_ms"].values()), part
    assert len(result["tiny"]["times_ms"]["ckptfs save (durable)"]) == 2
    assert len(result["fresh"]["times_ms"]["ckptfs"]) == 1
    assert set(result["fresh"]["peak_extra_rss_mib"]) == {"ckptfs", "torch.load", "DCP load"}
    inplace = result["inplace"]
    assert inplace["bit_exact"] and inplace["world"] == 2 and inplace["size"] == 2 << 20
    assert len(inplace["times_ms"]["ckptfs load(into=), first"]) == 1
    assert set(inplace["peak_extra_rss_mib"]) == {"ckptfs load(into=), first",
                                                  "dcp.load, first"}
    targets = ("tiny save: dcp/ckptfs", "warm load: torch.load/ckptfs",
               "fresh load: torch.load/ckptfs", "in-place load: dcp/ckptfs")
    assert [t["label"] for t in result["targets"]] == list(targets)
    for target in targets:
        line = next(ln for ln in text.splitlines() if f"ratio {target}:" in ln)
        assert "(target >= " in line and ("met)" in line or "missed)" in line), line
    assert "durability:" in text
    assert list(tmp_path.iterdir()) == [out]  # its checkpoints removed


def test_fixed_costs_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fixed_costs", "--help"],
                          cwd=str(REPO), capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--fresh-size", "--inplace-size", "--skip-fresh", "--parts", "--json"):
        assert flag in proc.stdout, flag
    assert "--results" not in proc.stdout  # it writes only --json
