"""The "Fixed costs" section of ``benchmarks.md`` and its plot (``img/fixed_costs.png``), from
the results of ``ckptfs bench fixed`` (`ckptfs.bench.fixed`): every comparison's ratio with the
range of its per-round ratios, each variant's median and peak extra memory, and which of the
targets the run met."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptfs.bench.common import fmt_size
from ckptfs.bench.fixed import PARTS, TARGETS, target_rows
from ckptfs.bench.markdown import pyplot, splice_section

FIXED_HEADING = "## Fixed costs: small saves and loads, a fresh process, the in-place load"
PLOT = "fixed_costs.png"


def comparisons(fx: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every comparison of the run, in part order: its label, part, ratio (median of the
    per-round ratios), range, ratio of the medians and goal (None: no target)."""
    rows = []
    for part in PARTS:
        r = fx.get(part)
        if not isinstance(r, Mapping):
            continue
        for label in r.get("labels") or r["ratios"]:
            rows.append({"part": part, "label": label, "ratio": float(r["ratios"][label]),
                         "range": r["ratio_ranges"][label],
                         "of_medians": float(r["ratios_of_medians"][label]),
                         "goal": TARGETS.get(label)})
    return rows


def fixed_section(fx: Mapping[str, Any] | None, plots: Mapping[str, str]) -> list[str]:
    """The section's Markdown lines (none without results)."""
    if not fx:
        return []
    cfg = fx.get("settings") or {}
    m = fx.get("machine") or {}
    loads = [fx[p]["load_average"] for p in PARTS
             if isinstance(fx.get(p), Mapping) and "load_average" in fx[p]]
    lines = [FIXED_HEADING, "",
             "`ckptfs bench fixed` (module `ckptfs.bench.fixed`, entry "
             "`benchmarks/fixed_costs.py`; raw figures in `benchmarks/results/fixed.json`): what "
             "a save or a load costs on top of its bytes, each comparison measured side by side "
             "in one run, its variants interleaved round by round. A ratio is *other time / "
             "ckptfs time* (above 1: ckptfs is faster), the median of the per-round ratios; the "
             "range is the lowest and highest per-round ratio, *of the medians* the ratio of the "
             "two medians. *tiny*: 4 fp32 tensors of 64x64 and a trainer dict, saved durably "
             "(ckptfs's 9 fsyncs, 7 of them at once, against DCP's 2 and `torch.save` + "
             "fsync's 1; DCP with the 2 "
             "directory fsyncs it lacks is the *same durability* row), then loaded (verified), "
             f"{cfg.get('tiny_rounds')} rounds; *load*: a GPT-shaped state and its AdamW "
             f"state, {fmt_size(cfg.get('load_size') or 0)}, verified, in a warm process, "
             f"{cfg.get('load_rounds')} rounds (DCP loads into tensors allocated untimed); "
             f"*fresh*: {fmt_size(cfg.get('fresh_size') or 0)} in 64 tensors, each timing a "
             "new process's import of the library and its first load (torch imported untimed), "
             f"{cfg.get('fresh_rounds')} rounds; *inplace*: "
             f"{fmt_size(cfg.get('inplace_size') or 0)} FSDP2 state (8 layers + AdamW) on 2 "
             "gloo ranks, `store.load(step, into=state)` against `dcp.load(state, ...)`, one "
             f"job per library and round, {cfg.get('inplace_rounds')} rounds of "
             f"{cfg.get('inplace_loads')} loads (*first*: a job resuming; *steady*: the later "
             "loads; every load compared bit for bit). Peak extra RSS: the kernel's high-water "
             "mark above the RSS before the call (fresh: after `import torch`; in-place: before "
             "the job's loads, the larger rank)."
             + f" Parts in this run: {', '.join(fx.get('parts') or [])}."
             + (f" {m.get('cores')} cores, {m.get('date_utc')}" if m else "")
             + (f"; load average per part (start, end): {loads}" if loads else "") + ".", ""]
    if fx.get("note"):
        lines += [f"**{fx['note']}**", ""]
    if fx.get("quick"):
        lines += ["**A `--quick` run (tiny sizes, one or two rounds): its figures mean "
                  "nothing.**", ""]
    rows = fx.get("targets") or target_rows(fx)
    if rows:
        lines += ["| target | ratio | per-round range | of the medians | rounds | goal | met |",
                  "|---|---:|---:|---:|---:|---:|:---:|"]
        for t in rows:
            lo, hi = t["range"]
            lines.append(f"| {t['target']} | **{t['ratio']:.2f}x** | {lo:.2f}-{hi:.2f}x | "
                         f"{t['ratio_of_medians']:.2f}x | {t['rounds']} | >= {t['goal']}x | "
                         f"{'yes' if t['met'] else '**no**'} |")
        met = sum(1 for t in rows if t["met"])
        lines += ["", f"Targets met in this run: {met} of {len(rows)}.", ""]
    lines += ["| part | comparison (other / ckptfs) | ratio | per-round range | of the medians |",
              "|---|---|---:|---:|---:|"]
    for c in comparisons(fx):
        lo, hi = c["range"]
        lines.append(f"| {c['part']} | {c['label']} | {c['ratio']:.2f}x | {lo:.2f}-{hi:.2f}x | "
                     f"{c['of_medians']:.2f}x |")
    lines += ["", "| part | variant | median ms | peak extra RSS MiB |", "|---|---|---:|---:|"]
    for part in PARTS:
        r = fx.get(part)
        if not isinstance(r, Mapping):
            continue
        rss = r.get("peak_extra_rss_mib") or {}
        for name in r.get("variants") or r["median_ms"]:
            peak = "" if rss.get(name) is None else f"{rss[name]:.1f}"
            lines.append(f"| {part} | {name} | {r['median_ms'][name]:.2f} | {peak} |")
    lines.append("")
    if "fixed" in plots:
        lines += [f"![fixed costs: ratios against the targets]({plots['fixed']})", ""]
    return lines


def fixed_plot(fx: Mapping[str, Any] | None, img: Path) -> dict[str, str]:
    """A horizontal bar per comparison, from 1.0 to its ratio on a log scale (left of the line
    at 1.0: ckptfs is slower), the per-round range as an error bar, and each target's goal;
    green: target met, red: missed, grey: no target."""
    rows = comparisons(fx) if fx else []
    if not rows:
        return {}
    plt = pyplot()
    if plt is None:  # pragma: no cover - matplotlib is a dev dependency
        return {}
    rows = rows[::-1]  # the first comparison on top
    ys = list(range(len(rows)))
    colors = ["tab:grey" if r["goal"] is None else
              ("tab:green" if r["ratio"] >= r["goal"] else "tab:red") for r in rows]
    err = [[max(0.0, r["ratio"] - r["range"][0]) for r in rows],
           [max(0.0, r["range"][1] - r["ratio"]) for r in rows]]
    fig, ax = plt.subplots(figsize=(9, 0.38 * len(rows) + 1.6))
    ax.set_xscale("log")
    ax.barh(ys, [r["ratio"] - 1.0 for r in rows], left=1.0, color=colors, xerr=err, capsize=3,
            error_kw={"elinewidth": 0.8, "ecolor": "black"})
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1, label="1.0 (as fast)")
    first = True
    for y, r in zip(ys, rows, strict=True):
        ax.text(max(r["ratio"], r["range"][1], 1.0), y, f"  {r['ratio']:.2f}x", va="center",
                ha="left", fontsize=7)
        if r["goal"] is not None:
            ax.plot([r["goal"], r["goal"]], [y - 0.45, y + 0.45], color="tab:blue",
                    linewidth=2.5, label="target" if first else None)
            first = False
    ax.set_yticks(ys, [r["label"] for r in rows])
    ax.tick_params(axis="y", labelsize=7)
    top = max(max(r["range"][1], r["goal"] or 0) for r in rows)
    low = min(min(r["range"][0], r["ratio"]) for r in rows)
    ax.set_xlim(min(low * 0.8, 0.5), max(top * 1.6, 2.0))
    ticks = [t for t in (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
             if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("other time / ckptfs time (median of per-round ratios; > 1: ckptfs faster)")
    quick = bool(fx and fx.get("quick"))
    ax.set_title("Fixed costs" + (" (--quick run: figures mean nothing)" if quick else ""))
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(color="tab:green", label="target met"),
                Patch(color="tab:red", label="target missed"),
                Patch(color="tab:grey", label="no target")]
    ax.legend(handles=handles, fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(img / PLOT, dpi=110)
    plt.close(fig)
    return {"fixed": f"img/{PLOT}"}


def load_fixed(results_dir: Path) -> dict[str, Any] | None:
    p = results_dir / "fixed.json"
    return json.loads(p.read_text()) if p.exists() else None


def write_fixed_section(results_dir: Path, docs_dir: Path, *,
                        md_name: str = "benchmarks.md") -> Path:
    """Render only the fixed-costs section and its plot into an existing report (the section
    replaced where it is, else inserted before the hand-written notes)."""
    fx = load_fixed(results_dir)
    img = docs_dir / "img"
    img.mkdir(parents=True, exist_ok=True)
    return splice_section(docs_dir / md_name, FIXED_HEADING,
                          fixed_section(fx, fixed_plot(fx, img)))
