"""A smoke run of every benchmark at tiny sizes, so they never rot: each question runs end to
end in a test of its own (once, at a size that takes seconds), writes its JSON, and the report
renders tables, target ratios and plots.  No fixture runs them all (``bench all`` at these sizes
ran past the test timeout on a loaded machine).  Nothing here checks speed (that is what the
full run in docs/benchmarks.md is for)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptfs.bench.cli import main as bench_main
from ckptfs.bench.common import QUESTIONS, REPO
from ckptfs.bench.incremental import bench_retention, gc_available
from ckptfs.bench.report import (
    INCREMENTAL_HEADING,
    TIERS_HEADING,
    load_results,
    target_rows,
    write_incremental_section,
)
from ckptfs.bench.variants import run_isolated
from ckptfs.cli.core import main as cli_main

#: Each question at a tiny size: every code path of the question runs, in seconds.
TINY: dict[str, list[str]] = {
    "hash": ["--hash-size", "1MiB", "--reps", "1"],
    "save": ["--sizes", "1MiB", "--reps", "1", "--in-process"],
    "interleaved": ["--sizes", "1MiB", "--interleaved-reps", "1"],
    "s3": ["--s3-sizes", "1MiB", "--reps", "1", "--s3-reps", "1", "--in-process"],
    "latest": ["--counts", "3,12", "--reps", "1"],
    "fresh": ["--fresh-size", "1MiB", "--fresh-rounds", "1"],
    "incremental": ["--incr-base", "1MiB", "--incr-rounds", "2", "--retention-base", "1MiB",
                    "--retention-saves", "8", "--incr-s3-base", "1MiB", "--incr-s3-rounds", "2",
                    "--incr-fresh-rounds", "1"],
    "fixed": ["--quick", "--parts", "tiny,load"],  # all four parts: tests/bench/test_fixed_costs.py
}
INCR_ROUNDS = 2
#: What the report's tables, targets and plots are made from.
REPORTED = ("hash", "save", "interleaved", "s3", "latest")


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """``bench(question)`` runs that one question at its tiny size (once per module) with
    ``--report`` and returns its results and docs directories.  No fixture runs them all: a
    test waits only for the questions it reads."""
    done: dict[str, tuple[Path, Path]] = {}

    def run(q: str) -> tuple[Path, Path]:
        if q not in done:
            root = tmp_path_factory.mktemp(q)
            results, docs = root / "results", root / "docs"
            assert bench_main([q, *TINY[q], "--results", str(results), "--docs", str(docs),
                               "--note", "smoke run", "--report"]) == 0
            done[q] = results, docs
        return done[q]

    return run


def test_every_question_has_a_tiny_run() -> None:
    assert set(TINY) == set(QUESTIONS)


def test_hash_question(bench: Callable[[str], tuple[Path, Path]]) -> None:
    results, docs = bench("hash")
    hashing = json.loads((results / "hash.json").read_text())
    assert {r["algorithm"] for r in hashing["rows"]} == {"sha256", "blake3", "xxh3-128",
                                                         "crc32c"}
    assert (results / "machine.json").exists()
    assert "## Hashing throughput" in (docs / "benchmarks.md").read_text()


def test_save_question(bench: Callable[[str], tuple[Path, Path]]) -> None:
    results, _ = bench("save")
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


def test_interleaved_question(bench: Callable[[str], tuple[Path, Path]]) -> None:
    results, docs = bench("interleaved")
    assert (results / "interleaved.json").exists()
    assert "## Save targets, variants interleaved" in (docs / "benchmarks.md").read_text()


def test_s3_question(bench: Callable[[str], tuple[Path, Path]]) -> None:
    results, _ = bench("s3")
    s3 = json.loads((results / "s3.json").read_text())
    assert [r for r in s3["results"] if "error" in r] == []
    assert len(s3["results"]) == 4


def test_fresh_process_question(bench: Callable[[str], tuple[Path, Path]]) -> None:
    """Import + first save/load in new processes, for ckptfs, DCP and torch.save, with the
    ratios against ckptfs (the regression a long-lived benchmark process never sees)."""
    results, docs = bench("fresh")
    fresh = json.loads((results / "fresh.json").read_text())
    assert set(fresh["summary"]) == {"ckptfs", "dcp", "torch"}
    for lib, s in fresh["summary"].items():
        assert 0 < s["save_import"] < s["save_fresh"], lib
        assert s["load_fresh"] > 0 and s["save_steady"] > 0, lib
    assert "dcp/ckptfs save_fresh" in fresh["ratios"]
    assert "## A fresh process" in (docs / "benchmarks.md").read_text()


def test_latest_counts_requests(bench: Callable[[str], tuple[Path, Path]]) -> None:
    results, _ = bench("latest")
    latest = json.loads((results / "latest.json").read_text())
    rows = {(r["backend"], r["checkpoints"]): r for r in latest["rows"]}
    assert set(rows) == {("local", 3), ("local", 12), ("s3", 3), ("s3", 12)}
    for r in rows.values():
        assert r["storage_calls"] == {"list_dir": 1, "read_bytes": 2}
    assert rows[("s3", 12)]["http_requests"] == {"ListObjectsV2": 1, "GetObject": 2}


@pytest.fixture
def reported(bench: Callable[[str], tuple[Path, Path]], tmp_path: Path) -> tuple[Path, Path]:
    """The results of the questions the report's tables, targets and plots are made of, in one
    directory (each question's own tiny run), and a docs directory to render into."""
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    for q in REPORTED:
        q_results, _ = bench(q)
        for f in q_results.glob("*.json"):
            if not (results / f.name).exists():
                shutil.copy(f, results / f.name)
    return results, docs


def test_report_has_tables_targets_and_plots(reported: tuple[Path, Path]) -> None:
    results, docs = reported
    assert {f"{q}.json" for q in (*REPORTED, "machine")} <= {
        p.name for p in results.glob("*.json")}
    assert cli_main(["bench", "report", "--results", str(results), "--docs", str(docs)]) == 0
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


def test_cli_report_regenerates(bench: Callable[[str], tuple[Path, Path]]) -> None:
    results, docs = bench("hash")
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


def test_remote_verify_benchmark(tmp_path: Path) -> None:
    """``ckptfs bench remote-verify`` at a tiny size (one tensor, one file above the 8 MiB
    part size: a multi-part upload) on moto and fake-gcs: the remote verify compares every file,
    reads none of the data and makes fewer requests than the full verify, which reads every
    byte."""
    assert bench_main(["remote-verify", "--size", "9MiB", "--tensors", "1", "--results",
                       str(tmp_path)]) == 0
    result = json.loads((tmp_path / "remote_verify.json").read_text())
    assert [r["backend"] for r in result["runs"]] == ["s3", "gcs"]
    for run in result["runs"]:
        assert max(f["size"] for f in run["files"]) > 8 * 2**20
        full, remote = run["variants"]
        assert full["bytes_read"] >= run["size"]
        assert remote["report"]["match"] == len(run["files"]), remote["report"]
        assert remote["requests"] < full["requests"]
        assert remote["bytes_read"] < 2**20
        if run["backend"] == "s3":
            assert remote["by_operation"]["HeadObject"] == len(run["files"])
            assert remote["bytes_read"] < 64 * 1024  # COMPLETE and MANIFEST.json only


def test_incremental_question(bench: Callable[[str], tuple[Path, Path]]) -> None:
    """Incremental saves side by side with full saves and DCP: the ratios docs/benchmarks.md
    reports are in the JSON and sane (speed is not checked at these sizes)."""
    results, docs = bench("incremental")
    inc = json.loads((results / "incremental.json").read_text())
    cases = inc["cases"]
    assert set(cases) == {"lora", "rl", "finetune"}
    for case in cases.values():
        assert case["rounds"] == INCR_ROUNDS
        for v in case["variants"].values():
            assert len(v["series"]) == INCR_ROUNDS and v["median_s"] > 0 and v["bytes_written"] > 0
    lora = cases["lora"]["ratios"]
    assert 0 < lora["incremental/full"]["bytes"] < 0.1  # the adapters, not the base
    assert 0 < lora["incremental/dcp"]["bytes"] < 0.1
    assert lora["incremental/full"]["time"] > 0
    incr = cases["lora"]["variants"]["ckptfs incremental"]
    assert incr["series"][0]["bytes_written"] == incr["series"][0]["bytes"]  # first: all
    full_logical = cases["lora"]["variants"]["ckptfs full (durable)"]["bytes"]
    assert full_logical <= incr["bytes"] < full_logical * 1.01  # + the referenced headers
    assert 0.45 < cases["rl"]["ratios"]["incremental/full"]["bytes"] < 0.55
    ft = cases["finetune"]
    assert ft["ratios"]["incremental/v1"]["bytes"] == pytest.approx(1.0, abs=0.01)
    keys = {t["key"] for t in inc["targets"]}
    assert {"lora_bytes", "lora_time", "rl_bytes", "finetune_time", "finetune_bytes"} <= keys
    assert {t["key"]: t["met"] for t in inc["targets"]}["rl_bytes"] is True
    assert {t["key"]: t["met"] for t in inc["targets"]}["finetune_bytes"] is True
    s3 = inc["s3"]["variants"]
    assert s3["ckptfs incremental"]["uploaded_bytes"] < s3["ckptfs full (durable)"][
        "uploaded_bytes"] / 5
    assert s3["ckptfs full (durable)"]["uploaded_bytes"] >= inc["s3"]["state_bytes"]
    assert s3["ckptfs full (durable)"]["requests"].get("PutObject", 0) >= 1
    fresh = inc["fresh"]["summary"]
    assert 0 < fresh["incremental"]["import_s"] < fresh["incremental"]["fresh_s"]
    assert fresh["incremental"]["first_bytes_written"] < fresh["full"]["first_bytes_written"]
    ret = inc["retention"]
    if gc_available():
        assert ret["status"] == "measured" and ret["stored_bytes"] > 0
    else:
        assert ret["status"] == "pending gc merge" and "targets" not in ret
    assert inc["note"] == "smoke run"
    md = (docs / "benchmarks.md").read_text()
    assert INCREMENTAL_HEADING in md and "img/incremental.png" in md
    assert (docs / "img" / "incremental.png").read_bytes()[:4] == b"\x89PNG"


def test_incremental_retention_figures(tmp_path: Path) -> None:
    """The keep_last=5 case runs end to end (forced when the reference-aware delete is not in
    this tree: then some retained checkpoints reference deleted bytes, which it reports)."""
    ret = bench_retention(1 << 20, 8, 7, tmp_path, force=True, log=lambda _: None)
    assert ret["retained"][-5:] == [3, 4, 5, 6, 7]  # without gc, a prune may refuse (below)
    assert ret["first_save_bytes"] > ret["median_bytes_written"] > 0
    assert set(ret["verified"]) == {str(s) for s in ret["retained"]}
    assert ret["bound_bytes"] == (ret["first_save_bytes"]
                                  + sum(ret["retained_own_bytes"].values())
                                  + ret["metadata_bytes"])
    if gc_available():
        assert ret["retained"] == [3, 4, 5, 6, 7]
        assert all(v == "ok" for v in ret["verified"].values())
        assert ret["stored_bytes"] <= ret["bound_bytes"]
        assert ret["targets"][0]["met"] is True
    else:
        assert ret["status"].startswith("forced without the gc merge")
        assert any(v != "ok" for v in ret["verified"].values())
        assert ret["targets"][0]["met"] is False


def test_report_only_incremental_splices(bench: Callable[[str], tuple[Path, Path]],
                                         tmp_path: Path) -> None:
    """``ckptfs bench report --only incremental`` replaces or inserts its section and leaves
    the rest of a (partly hand-written) benchmarks.md as it is."""
    results, _ = bench("incremental")
    docs = tmp_path / "docs"
    docs.mkdir()
    hand = ["# Benchmarks", "", "## Targets", "", "by hand", "",
            "## How ckptfs gets these figures", "", "notes", "", "## Sharded", "", "tail"]
    (docs / "benchmarks.md").write_text("\n".join(hand) + "\n")
    assert cli_main(["bench", "report", "--only", "incremental", "--results", str(results),
                     "--docs", str(docs)]) == 0
    first = (docs / "benchmarks.md").read_text()
    assert first.count(INCREMENTAL_HEADING) == 1
    assert first.index("by hand") < first.index(INCREMENTAL_HEADING) < first.index("notes")
    assert first.endswith("## Sharded\n\ntail\n")
    write_incremental_section(results, docs)
    assert (docs / "benchmarks.md").read_text() == first


def test_tiers_question(tmp_path: Path) -> None:
    """``ckptfs bench tiers`` at tiny sizes: the blocking/replication rounds and the training
    loop run end to end against a moto server, the ratios are computed from the timings, the
    loop's lag is recorded at every save, and ``report --only tiers`` splices the section and
    its plot into an existing benchmarks.md."""
    results, docs = tmp_path / "results", tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# Benchmarks\n\n## How ckptfs gets these figures\n\nn\n")
    assert bench_main(["tiers", "--tiers-size", "2MiB", "--tiers-rounds", "1", "--loop-steps",
                       "6", "--loop-every", "2", "--loop-params", "65536",
                       "--results", str(results), "--docs", str(docs)]) == 0
    t = json.loads((results / "tiers.json").read_text())
    b = t["blocking"]
    assert b["ratios"]["blocking_idle"] == pytest.approx(
        b["median"]["tiered_idle_s"] / b["median"]["local_s"], rel=1e-2)
    assert b["ratios"]["replication_vs_cp"] > 0
    o = t["overhead"]
    assert len(o["rounds"]) == 5 and o["ratio"] == pytest.approx(
        o["median"]["tiered_s"] / o["median"]["local_s"], rel=1e-2)
    loop = t["loop"]
    assert set(loop["variants"]) == {"none", "local", "two tiers"}
    assert [x["step"] for x in loop["variants"]["two tiers"]["lags"]] == [2, 4, 6]
    assert all(len(v["step_s"]) == 6 for v in loop["variants"].values())
    assert cli_main(["bench", "report", "--only", "tiers", "--results", str(results),
                     "--docs", str(docs)]) == 0
    md = (docs / "benchmarks.md").read_text()
    assert md.index(TIERS_HEADING) < md.index("## How ckptfs gets these figures")
    assert (docs / "img" / "tiers.png").read_bytes()[:4] == b"\x89PNG"


def test_outputs_go_to_the_current_directory_or_out(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``ckptfs bench`` writes where the user says (``--out``, default the current directory),
    never next to the installed package (it wrote benchmarks/results and docs/benchmarks.md
    into site-packages)."""
    import ckptfs

    package_root = Path(ckptfs.__file__).resolve().parents[1]
    before = {p for p in (package_root / "docs").rglob("*")} if (
        package_root / "docs").exists() else set()
    monkeypatch.chdir(tmp_path)
    assert cli_main(["bench", "hash", "--hash-size", "64KiB", "--reps", "1", "--report"]) == 0
    assert (tmp_path / "results" / "hash.json").exists()
    assert (tmp_path / "benchmarks.md").exists()
    out = tmp_path / "elsewhere"
    assert cli_main(["bench", "hash", "--hash-size", "64KiB", "--reps", "1", "--out",
                     str(out)]) == 0
    assert (out / "results" / "hash.json").exists()
    if before:
        assert {p for p in (package_root / "docs").rglob("*")} == before
