"""``ckptfs bench fixed`` (`ckptfs.bench.fixed`) and its report section
(`ckptfs.bench.fixed_report`): a ``--quick`` run of the in-process parts writes its JSON, the
"Fixed costs" section and the plot; the section is rendered from results whatever their figures
(each target stated met or not as its ratio says), spliced into an existing report without
touching the rest.  Nothing here depends on timings; the fresh-process and in-place parts run
in tests/bench/test_fixed_costs.py (through ``benchmarks/fixed_costs.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptfs.bench.cli import main as bench_main
from ckptfs.bench.fixed import PARTS, QUICK, TARGETS, summary, target_rows
from ckptfs.bench.fixed_report import FIXED_HEADING, PLOT, comparisons, write_fixed_section
from ckptfs.bench.report import write_report
from ckptfs.cli.core import main as cli_main

PNG = b"\x89PNG\r\n\x1a\n"
NOTES = "## How ckptfs gets these figures"


def test_quick_run_writes_json_section_and_plot(tmp_path: Path) -> None:
    results, docs, work = tmp_path / "results", tmp_path / "docs", tmp_path / "work"
    work.mkdir()
    assert bench_main(["fixed", "--quick", "--parts", "tiny,load", "--workdir", str(work),
                       "--results", str(results), "--docs", str(docs), "--report"]) == 0
    fx = json.loads((results / "fixed.json").read_text())
    assert fx["parts"] == ["tiny", "load"] and fx["quick"] is True
    assert fx["settings"] == QUICK
    assert "fresh" not in fx and "inplace" not in fx
    for part in ("tiny", "load"):
        r = fx[part]
        assert set(r["ratios"]) == set(r["labels"]) == set(r["ratio_ranges"])
        assert set(r["median_ms"]) == set(r["variants"]) == set(r["times_ms"])
        assert set(r["peak_extra_rss_mib"]) == set(r["variants"])  # /proc offers it here
        for label in r["labels"]:
            lo, hi = r["ratio_ranges"][label]
            assert 0 < lo <= r["ratios"][label] <= hi, label
            other, ours = r["pairs"][label]
            assert other in r["variants"] and ours in r["variants"]
        assert all(len(t) == r["rounds"] for t in r["times_ms"].values())
    assert fx["tiny"]["rounds"] == QUICK["tiny_rounds"]
    assert fx["load"]["rounds"] == QUICK["load_rounds"] and fx["load"]["size"] == 1 << 20
    assert {"tiny load: torch.load/ckptfs", "tiny save: dcp/ckptfs"} <= set(fx["tiny"]["ratios"])
    targets = {t["label"]: t for t in fx["targets"]}
    assert set(targets) == {"tiny save: dcp/ckptfs", "warm load: torch.load/ckptfs"}
    for t in targets.values():
        assert t["met"] == (t["ratio"] >= TARGETS[t["label"]]) and t["goal"] == TARGETS[t["label"]]
    assert list(work.iterdir()) == []  # its checkpoints removed
    md = (docs / "benchmarks.md").read_text()
    assert FIXED_HEADING in md and "**A `--quick` run" in md
    assert "| tiny-state save >= 1.0x DCP save |" in md
    assert "| verified 1 MiB load >= 0.8x torch.load |" in md
    assert f"![fixed costs: ratios against the targets](img/{PLOT})" in md
    assert (docs / "img" / PLOT).read_bytes()[:8] == PNG


def _part(pairs: list[tuple[str, str, str]], times: dict[str, list[float]],
          **extra: Any) -> dict[str, Any]:
    out = summary(times, pairs, {k: [1 << 20] * len(v) for k, v in times.items()})
    out.update(extra)
    return out


def fake_results() -> dict[str, Any]:
    """What a run of all four parts records (through `summary`, as `bench_fixed` does), with
    figures chosen so that two targets are met and two are missed."""
    fx: dict[str, Any] = {
        "tiny": _part([("tiny save: dcp/ckptfs", "DCP save", "ckptfs save"),
                       ("tiny load: torch.load/ckptfs", "torch.load, tiny", "ckptfs load")],
                      {"ckptfs save": [0.004, 0.005, 0.004], "DCP save": [0.003, 0.003, 0.005],
                       "ckptfs load": [0.001] * 3, "torch.load, tiny": [0.002] * 3}),
        "load": _part([("warm load: torch.load/ckptfs", "torch.load", "ckptfs load (verified)")],
                      {"ckptfs load (verified)": [0.03, 0.04], "torch.load": [0.03, 0.036]},
                      size=64 << 20),
        "fresh": _part([("fresh load: torch.load/ckptfs", "torch.load", "ckptfs"),
                        ("fresh load: dcp/ckptfs", "DCP load", "ckptfs")],
                       {"ckptfs": [0.7, 0.6], "torch.load": [0.5, 0.55], "DCP load": [0.9, 1.0]},
                       size=1 << 30),
        "inplace": _part([("in-place load: dcp/ckptfs", "dcp.load, first",
                           "ckptfs load(into=), first")],
                         {"ckptfs load(into=), first": [0.2, 0.21],
                          "dcp.load, first": [0.28, 0.3]}, size=1 << 30, world=2),
    }
    fx.update(parts=list(PARTS), quick=False, machine={"cores": 2, "date_utc": "today"},
              settings={"tiny_rounds": 3, "load_size": 64 << 20, "load_rounds": 2,
                        "fresh_size": 1 << 30, "fresh_rounds": 2, "inplace_size": 1 << 30,
                        "inplace_rounds": 2, "inplace_loads": 1})
    fx["targets"] = target_rows(fx)
    return fx


def test_target_rows_judge_the_median_of_per_round_ratios() -> None:
    rows = {t["label"]: t for t in fake_results()["targets"]}
    assert set(rows) == set(TARGETS)
    assert rows["tiny save: dcp/ckptfs"]["ratio"] == pytest.approx(0.75)  # 0.75, 0.6, 1.25
    assert rows["tiny save: dcp/ckptfs"]["range"] == pytest.approx([0.6, 1.25])
    assert not rows["tiny save: dcp/ckptfs"]["met"]
    assert rows["warm load: torch.load/ckptfs"]["met"]  # 1.0 and 0.9: 0.95 >= 0.8
    assert not rows["fresh load: torch.load/ckptfs"]["met"]
    assert rows["in-place load: dcp/ckptfs"]["met"]  # 1.4 and 1.43: 1.41 >= 1.3
    assert rows["in-place load: dcp/ckptfs"]["target"].startswith("in-place sharded load (1 GiB")


def test_report_only_fixed_splices_section_and_plot(tmp_path: Path) -> None:
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    docs.mkdir()
    (results / "fixed.json").write_text(json.dumps(fake_results(), sort_keys=True))
    before = ["# Benchmarks", "", "## Machine", "", "kept as it is", "", NOTES, "", "notes"]
    (docs / "benchmarks.md").write_text("\n".join(before) + "\n")
    assert cli_main(["bench", "report", "--only", "fixed", "--results", str(results),
                     "--docs", str(docs)]) == 0
    md = (docs / "benchmarks.md").read_text()
    assert md.index("kept as it is") < md.index(FIXED_HEADING) < md.index(NOTES)
    assert md.endswith("notes\n")
    assert "| in-place sharded load (1 GiB, 2 ranks) >= 1.3x dcp.load | **1.41x** | " \
           "1.40-1.43x |" in md
    assert "| tiny-state save >= 1.0x DCP save | **0.75x** | 0.60-1.25x |" in md
    assert md.count("| **no** |") == 2 and "Targets met in this run: 2 of 4." in md
    rows = [ln for ln in md.splitlines() if ln.startswith(("| tiny |", "| load |", "| fresh |",
                                                           "| inplace |"))]
    # Every comparison, then every variant, in the order the run measured them (the JSON's
    # sorted keys do not reorder them).
    labels = [c["label"] for c in comparisons(fake_results())]
    assert [ln.split(" | ")[1] for ln in rows[:len(labels)]] == labels
    assert labels[0] == "tiny save: dcp/ckptfs" and labels[-1] == "in-place load: dcp/ckptfs"
    assert "| fresh | DCP load | 950.00 | 1.0 |" in md
    png = docs / "img" / PLOT
    assert png.read_bytes()[:8] == PNG
    # Again: replaced where it is, not duplicated.
    write_fixed_section(results, docs)
    assert (docs / "benchmarks.md").read_text() == md


def test_full_report_has_the_section(tmp_path: Path) -> None:
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    (results / "fixed.json").write_text(json.dumps(fake_results()))
    md = write_report(results, docs).read_text()
    assert FIXED_HEADING in md and f"img/{PLOT}" in md
    assert (docs / "img" / PLOT).exists()


def test_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli_main(["bench", "fixed", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--parts", "--quick", "--inplace-size", "--inplace-rounds", "--fresh-size",
                 "--tiny-rounds", "--load-size", "--skip-fresh", "--report"):
        assert flag in text, flag
    assert cli_main(["bench", "all", "--help"]) == 0
    assert "--inplace-rounds" not in capsys.readouterr().out
    assert cli_main(["bench", "fixed", "--parts", "tiny,nope", "--out", str(tmp_path)]) == 2
    assert "unknown part(s) nope: choose from tiny,load,fresh,inplace" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
