"""A smoke run of every benchmark at tiny sizes, so they never rot: each question runs end to
end, writes its JSON, and the report renders tables, target ratios and plots.  Nothing here
checks speed (that is what the full run in docs/benchmarks.md is for)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfs.bench.cli import main as bench_main
from ckptfs.bench.common import QUESTIONS, REPO
from ckptfs.bench.report import load_results, target_rows
from ckptfs.bench.variants import run_isolated
from ckptfs.cli.core import main as cli_main


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bench")
    results, docs = root / "results", root / "docs"
    rc = bench_main(["all", "--sizes", "2MiB", "--s3-sizes", "2MiB", "--hash-size", "1MiB",
                     "--counts", "3,12", "--reps", "1", "--in-process",
                     "--fresh-size", "2MiB", "--fresh-rounds", "1",
                     "--results", str(results), "--docs", str(docs),
                     "--note", "smoke run"])
    assert rc == 0
    return results, docs


def test_fresh_process_question(smoke: tuple[Path, Path]) -> None:
    """Import + first save/load in new processes, for ckptfs, DCP and torch.save, with the
    ratios against ckptfs (the regression a long-lived benchmark process never sees)."""
    results, docs = smoke
    fresh = json.loads((results / "fresh.json").read_text())
    assert set(fresh["summary"]) == {"ckptfs", "dcp", "torch"}
    for lib, s in fresh["summary"].items():
        assert 0 < s["save_import"] < s["save_fresh"], lib
        assert s["load_fresh"] > 0 and s["save_steady"] > 0, lib
    assert "dcp/ckptfs save_fresh" in fresh["ratios"]
    assert "## A fresh process" in (docs / "benchmarks.md").read_text()


def test_every_question_wrote_results(smoke: tuple[Path, Path]) -> None:
    results, _ = smoke
    for q in (*QUESTIONS, "machine"):
        assert (results / f"{q}.json").exists(), q
    save = json.loads((results / "save.json").read_text())
    errors = [r for r in save["results"] if "error" in r]
    assert errors == []
    names = {r["variant"] for r in save["results"]}
    for algo in ("sha256", "blake3", "xxh3-128", "crc32c"):
        assert f"ckptfs {algo} durable" in names and f"ckptfs {algo} fast" in names
        assert f"ckptfs {algo} verify" in names
    for baseline in ("torch.save", "torch.load", "safetensors.save_file",
                     "safetensors.load_file + clone", "DCP FileSystemWriter (default, fsync)",
                     "DCP load (FileSystemReader)"):
        assert baseline in names
    assert all(r["median_s"] > 0 for r in save["results"])
    s3 = json.loads((results / "s3.json").read_text())
    assert [r for r in s3["results"] if "error" in r] == []
    assert len(s3["results"]) == 4
    hashing = json.loads((results / "hash.json").read_text())
    assert {r["algorithm"] for r in hashing["rows"]} == {"sha256", "blake3", "xxh3-128",
                                                         "crc32c"}


def test_latest_counts_requests(smoke: tuple[Path, Path]) -> None:
    results, _ = smoke
    latest = json.loads((results / "latest.json").read_text())
    rows = {(r["backend"], r["checkpoints"]): r for r in latest["rows"]}
    assert set(rows) == {("local", 3), ("local", 12), ("s3", 3), ("s3", 12)}
    for r in rows.values():
        assert r["storage_calls"] == {"list_dir": 1, "read_bytes": 2}
    assert rows[("s3", 12)]["http_requests"] == {"ListObjectsV2": 1, "GetObject": 2}


def test_report_has_tables_targets_and_plots(smoke: tuple[Path, Path]) -> None:
    results, docs = smoke
    md = (docs / "benchmarks.md").read_text()
    for heading in ("## Machine", "## Targets", "## Hashing throughput",
                    "## Save and load on local disk", "## Save targets, variants interleaved",
                    "## Save and load on S3 (moto)",
                    "## Resolving `latest`", "smoke run"):
        assert heading in md, heading
    data = load_results(results)
    targets = {r["target"] for r in target_rows(data)}
    assert len(targets) == 9  # latest's request-count target needs 1,000 checkpoints
    pngs = sorted(p.name for p in (docs / "img").glob("*.png"))
    assert "hash_throughput.png" in pngs and "latest.png" in pngs
    assert any(p.startswith("save_save_") for p in pngs)
    assert any(p.startswith("s3_load_") for p in pngs)
    for p in pngs:
        assert (docs / "img" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"img/{p}" in md


def test_cli_report_regenerates(smoke: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
                                ) -> None:
    results, docs = smoke
    (docs / "benchmarks.md").unlink()
    assert cli_main(["bench", "report", "--results", str(results), "--docs", str(docs)]) == 0
    assert (docs / "benchmarks.md").exists()


def test_isolated_worker_runs_one_variant(tmp_path: Path) -> None:
    """The full run measures each variant in a fresh process; check that path works."""
    spec = {"question": "save", "size": 1 << 20, "variant": "ckptfs blake3 durable", "reps": 1,
            "warm": 0, "workdir": str(tmp_path / "w"), "s3": None,
            "default_algo": "blake3", "algorithms": ["blake3"]}
    r = run_isolated(spec, timeout=120)
    assert "error" not in r, r
    assert r["variant"] == "ckptfs blake3 durable" and r["median_s"] > 0
    assert r["peak_extra_rss_mib"] is not None


def test_scripts_have_help() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.latest", "--help"],
                         capture_output=True, text=True, timeout=120,
                         cwd=str(REPO))
    assert out.returncode == 0 and "--counts" in out.stdout
