"""The report: target ratios from the JSON results, ``docs/benchmarks.md`` and its plots in
``docs/img/``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptfs.bench.common import QUESTIONS, GiB, MiB, fmt_size
from ckptfs.bench.fixed_report import fixed_plot, fixed_section
from ckptfs.bench.markdown import pyplot, splice_section

TARGETS = [
    ("durable save, default hash >= 1.6x DCP FileSystemWriter default", 1.6),
    ("fast save with hash >= 0.85x safetensors.save_file", 0.85),
    ("load with full verify >= 1.0x DCP load", 1.0),
    ("load with full verify >= 0.8x torch.load", 0.8),
    ("hasher within 5% of the raw library (16 MiB chunks)", 0.95),
    ("save to moto >= 0.9x raw s3fs pipe of the same bytes", 0.9),
]


def _find(results: Sequence[Mapping[str, Any]], size: int, name: str) -> float | None:
    for r in results:
        if r.get("size") == size and r.get("variant") == name and "median_s" in r:
            return float(r["median_s"])
    return None


def target_rows(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each target as measured: the ratio (higher is better for ckptfs) and whether it is met."""
    rows: list[dict[str, Any]] = []
    save = data.get("save")
    if save:
        d = save["default_algorithm"]
        for size in save["sizes"]:
            res = save["results"]
            pairs = [
                (TARGETS[0], "DCP FileSystemWriter (default, fsync)", f"ckptfs {d} durable"),
                (TARGETS[1], "safetensors.save_file", f"ckptfs {d} fast"),
                (TARGETS[2], "DCP load (FileSystemReader)", f"ckptfs {d} verify"),
                (TARGETS[3], "torch.load", f"ckptfs {d} verify"),
            ]
            for (label, goal), ref, ours in pairs:
                a, b = _find(res, size, ref), _find(res, size, ours)
                if a and b:
                    rows.append({"target": label, "size": size, "goal": goal,
                                 "ratio": round(a / b, 2), "met": a / b >= goal,
                                 "detail": f"{ref} {a:.3f} s / {ours} {b:.3f} s"})
    inter = data.get("interleaved")
    if inter:
        d = inter["default_algorithm"]
        for size in inter["sizes"]:
            for (label, goal), ref, ours in [
                    (TARGETS[0], "DCP FileSystemWriter (default, fsync)", f"ckptfs {d} durable"),
                    (TARGETS[1], "safetensors.save_file", f"ckptfs {d} fast")]:
                a, b = _find(inter["results"], size, ref), _find(inter["results"], size, ours)
                if a and b:
                    rows.append({"target": label + " (interleaved runs)", "size": size,
                                 "goal": goal, "ratio": round(a / b, 2), "met": a / b >= goal,
                                 "detail": f"{ref} {a:.3f} s / {ours} {b:.3f} s"})
    for key in ("save", "s3"):
        block = data.get(key)
        if not block:
            continue
        for r in block["results"]:
            if (r.get("family") == "ckptfs" and r.get("op") == "save"
                    and r.get("peak_extra_rss_max_mib") is not None):
                bound = 64 + 0.05 * r["bytes"] / MiB
                peak = r["peak_extra_rss_max_mib"]
                rows.append({"target": "save: peak extra memory <= 64 MiB + 5% of the state",
                             "size": r["size"], "goal": round(bound), "ratio": peak,
                             "met": peak <= bound,
                             "detail": f"{r['variant']}: worst of {len(r['times_s'])} runs "
                             f"{peak} MiB (bound {bound:.0f} MiB)"})
    hashing = data.get("hash")
    if hashing:
        for row in hashing["rows"]:
            for c in row.get("chunks", []):
                if c["chunk"] == 16 * MiB:
                    r = c["ckptfs_vs_one_shot"]
                    rows.append({"target": TARGETS[4][0], "size": None, "goal": 0.95,
                                 "ratio": r, "met": r >= 0.95,
                                 "detail": f"{row['algorithm']}: {c['ckptfs_gbps']} GB/s vs "
                                 f"one-shot {row['raw_one_shot_gbps']} GB/s (vs the library fed "
                                 f"the same chunks: {c['ckptfs_vs_raw_chunked']})"})
    s3 = data.get("s3")
    if s3:
        d = s3["default_algorithm"]
        for size in s3["sizes"]:
            a = _find(s3["results"], size, "s3fs pipe (same bytes)")
            b = _find(s3["results"], size, f"ckptfs {d} -> S3")
            if a and b:
                rows.append({"target": TARGETS[5][0], "size": size, "goal": 0.9,
                             "ratio": round(a / b, 2), "met": a / b >= 0.9,
                             "detail": f"pipe {a:.2f} s / ckptfs {b:.2f} s"})
    latest = data.get("latest")
    if latest:
        for row in latest["rows"]:
            if row["checkpoints"] == 1000:
                n = row["http_requests_total"] or row["storage_calls_total"]
                rows.append({"target": "latest at 1,000 checkpoints in <= 3 storage requests",
                             "size": None, "goal": 3, "ratio": n, "met": n <= 3,
                             "detail": f"{row['backend']}: {row['storage_calls_total']} storage "
                             f"calls {row['storage_calls']}"
                             + (f", {n} HTTP requests {row['http_requests']}"
                                if row["http_requests"] else "")})
    return rows


def load_results(results_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for q in (*QUESTIONS, "tiers", "machine"):
        p = results_dir / f"{q}.json"
        if p.exists():
            data[q] = json.loads(p.read_text())
    return data


def write_report(results_dir: Path, docs_dir: Path, *,
                 md_name: str = "benchmarks.md") -> Path:
    """Render the JSON results of ``results_dir`` into ``docs_dir/md_name`` (Markdown tables)
    and ``docs_dir/img/`` (PNG plots); a ``NOTES.md`` beside ``results_dir`` (the repository's
    ``benchmarks/NOTES.md``) is appended."""
    data = load_results(results_dir)
    img = docs_dir / "img"
    img.mkdir(parents=True, exist_ok=True)
    plots = _plots(data, img)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks.run_all` (or `ckptfs bench all`) from the JSON in "
        "`benchmarks/results/`; do not edit by hand. Every ratio compares two medians measured "
        "side by side in the same run; each save/load variant ran in a fresh subprocess, its "
        "peak extra RSS is the kernel's high-water mark above the RSS just before the timed "
        "call (the state itself excluded). Before each timed call a few GiB were touched and "
        "freed (this VM returns idle free memory to the host and the next first touch is "
        "6-9x slower). Loads read from the page cache.",
        "",
    ]
    m = data.get("machine")
    if m:
        v = ", ".join(f"{k} {val}" for k, val in m["versions"].items())
        lines += ["## Machine", "",
                  f"- CPU: {m['cpu']}, {m['cores']} cores; memory "
                  f"{(m['memory_bytes'] or 0) / GiB:.1f} GiB; {m['system']}",
                  f"- Date: {m['date_utc']}; load average at start {m['load_average']}"
                  + (f", at end {m.get('load_average_end')}" if m.get("load_average_end")
                     else ""),
                  f"- Versions: {v}"]
        if m.get("concurrent_note"):
            lines.append(f"- **{m['concurrent_note']}**")
        lines.append("")
    trows = target_rows(data)
    if trows:
        lines += ["## Targets", "", "| target | state | ratio | goal | met | measured |",
                  "|---|---|---:|---:|:---:|---|"]
        for r in trows:
            lines.append(f"| {r['target']} | {fmt_size(r['size']) if r['size'] else ''} | "
                         f"{r['ratio']} | {r['goal']} | {'yes' if r['met'] else '**no**'} | "
                         f"{r['detail']} |")
        lines.append("")
    lines += _hash_section(data.get("hash"), plots)
    lines += _save_section(data.get("save"), plots, "Save and load on local disk", "save")
    lines += _interleaved_section(data.get("interleaved"))
    lines += _save_section(data.get("s3"), plots, "Save and load on S3 (moto)", "s3")
    lines += _latest_section(data.get("latest"), plots)
    lines += _fresh_section(data.get("fresh"))
    lines += _incremental_section(data.get("incremental"), plots)
    lines += _tiers_section(data.get("tiers"), _tiers_plot(data.get("tiers"), img))
    lines += fixed_section(data.get("fixed"), fixed_plot(data.get("fixed"), img))
    notes = results_dir.parent / "NOTES.md"
    if notes.exists():
        lines += ["", notes.read_text().strip(), ""]
    out = docs_dir / md_name
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out


def _fresh_section(f: Mapping[str, Any] | None) -> list[str]:
    """``ckptfs bench fresh``: import + first call in a new process, and the steady state."""
    if not f:
        return []
    lines = ["## A fresh process: import and first save/load", "",
             f"{fmt_size(f['size'])} in {f['tensors']} fp32 tensors, durable saves to local "
             f"disk; every cell is the median of {f['rounds']} new processes, variants "
             "interleaved round by round. *fresh* = import of the library + its first call "
             "(what a short job, an evaluation or a resumed job sees); *steady* = later saves "
             "in the same process.", "",
             "| variant | save fresh (s) | of which import (s) | save steady (s) | "
             "load fresh (s) |", "|---|---:|---:|---:|---:|"]
    for lib, s in f["summary"].items():
        lines.append(f"| {lib} | {s['save_fresh']:.3f} | {s['save_import']:.3f} | "
                     f"{s['save_steady']:.3f} | {s['load_fresh']:.3f} |")
    lines.append("")
    for k, v in f.get("ratios", {}).items():
        lines.append(f"- {k}: **{v:.2f}x** (above 1: ckptfs is faster)")
    return [*lines, ""]


def _hash_section(h: Mapping[str, Any] | None, plots: Mapping[str, str]) -> list[str]:
    if not h:
        return []
    chunks = [c["chunk"] for c in h["rows"][0].get("chunks", [])] if h["rows"] else []
    lines = ["## Hashing throughput", "",
             f"{fmt_size(h['bytes'])} in memory, one thread, median of {h['reps']}. GB/s = 1e9 "
             "bytes/s. *ckptfs* is `ckptfs.format.hashing.new_hasher(algo)` fed chunk by chunk (as "
             "the saver and the verifier do); *ratio* is ckptfs at that chunk size over the raw "
             "library hashing the whole buffer in one call.", "",
             "| algorithm | crypto | raw one-shot | "
             + " | ".join(f"ckptfs {fmt_size(c)} (ratio)" for c in chunks) + " |",
             "|---|:---:|---:|" + "---:|" * len(chunks)]
    for r in h["rows"]:
        if "error" in r:
            lines.append(f"| {r['algorithm']} | | {r['error']} |" + " |" * len(chunks))
            continue
        cells = [f"{c['ckptfs_gbps']} ({c['ckptfs_vs_one_shot']})" for c in r["chunks"]]
        lines.append(f"| {r['algorithm']} | {'yes' if r['cryptographic'] else 'no'} | "
                     f"{r['raw_one_shot_gbps']} | " + " | ".join(cells) + " |")
    lines.append("")
    for e in h.get("extras", []):
        lines.append(f"- {e['what']}: {e['gbps']} GB/s")
    for t in h.get("tools", []):
        lines.append(f"- `{t['tool']}`: " + (f"{t['gbps']} GB/s (file in page cache, process "
                                              "start included)" if t["installed"]
                                              else "not installed"))
    if "hash" in plots:
        lines += ["", f"![hashing throughput]({plots['hash']})"]
    return [*lines, ""]


def _save_section(s: Mapping[str, Any] | None, plots: Mapping[str, str], title: str,
                  key: str) -> list[str]:
    if not s:
        return []
    lines = [f"## {title}", "",
             f"Median of {s['reps']} runs per variant; default algorithm "
             f"`{s['default_algorithm']}`; GB/s = state bytes / time / 1e9; *CPU s* is the "
             "process's CPU time (all threads) during the call: on 2 shared cores, a variant "
             "using more CPU than another loses to it when other work runs. "
             + (f"Files on {s.get('workdir_fs')}. " if key == "save" else "")
             + f"Load average before {s.get('load_before')}, after {s.get('load_after')}.", ""]
    for size in s["sizes"]:
        res = [r for r in s["results"] if r.get("size") == size]
        for op in ("save", "load"):
            rows = [r for r in res if r.get("op") == op or ("error" in r and op == "save")]
            if not rows:
                continue
            ok = [r for r in rows if "median_s" in r]
            fastest = min((r["median_s"] for r in ok), default=None)
            lines += [f"### {op.capitalize()}, {fmt_size(size)} state", "",
                      "| variant | median s | GB/s | vs fastest | CPU s | peak extra RSS MiB "
                      "| note |",
                      "|---|---:|---:|---:|---:|---:|---|"]
            for r in sorted(ok, key=lambda r: r["median_s"]):
                rel = f"{fastest / r['median_s']:.2f}" if fastest else ""
                lines.append(f"| {r['variant']} | {r['median_s']:.3f} | {r['gb_per_s']} | "
                             f"{rel} | {r.get('cpu_s', '')} | {r.get('peak_extra_rss_mib', '')} "
                             f"| {r.get('note', '')} |")
            for r in rows:
                if "error" in r:
                    lines.append(f"| {r['variant']} | failed | | | | | "
                                 f"{r['error'][-200:].replace('|', '/').splitlines()[-1]} |")
            lines.append("")
            pk = f"{key}-{op}-{size}"
            if pk in plots:
                lines += [f"![{op} {fmt_size(size)}]({plots[pk]})", ""]
    return lines


def _interleaved_section(it: Mapping[str, Any] | None) -> list[str]:
    if not it:
        return []
    lines = ["## Save targets, variants interleaved", "",
             "The table above runs each variant's repetitions back to back in its own process, "
             "minutes apart from the next variant; on this shared machine the load drifts in "
             "between. Here one process times every variant once per round, in turn "
             f"({it['reps']} rounds), so both sides of each ratio saw the same conditions. Load "
             f"average before {it.get('load_before')}, after {it.get('load_after')}.", "",
             "| state | variant | median s | GB/s | CPU s | runs (s) |",
             "|---|---|---:|---:|---:|---|"]
    for r in it["results"]:
        lines.append(f"| {fmt_size(r['size'])} | {r['variant']} | {r['median_s']:.3f} | "
                     f"{r['gb_per_s']} | {r.get('cpu_s', '')} | "
                     f"{', '.join(f'{t:.2f}' for t in r['times_s'])} |")
    return [*lines, ""]


def _latest_section(lt: Mapping[str, Any] | None, plots: Mapping[str, str]) -> list[str]:
    if not lt:
        return []
    lines = ["## Resolving `latest`", "",
             "Committed checkpoints made of real protocol files (state, `MANIFEST.json`, "
             "`COMPLETE`), written directly with the raw filesystem, the newest by a real save. "
             "*Storage calls* are calls to ckptfs's `Storage` interface; *HTTP* are the S3 "
             f"requests s3fs sent (botocore events). Median of {lt['reps']} resolutions.", "",
             "| backend | checkpoints | median ms | storage calls | HTTP requests |",
             "|---|---:|---:|---|---|"]
    for r in lt["rows"]:
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["storage_calls"].items()))
        http = (", ".join(f"{k} {v}" for k, v in sorted(r["http_requests"].items()))
                if r["http_requests"] else "")
        lines.append(f"| {r['backend']} | {r['checkpoints']:,} | {r['median_s'] * 1000:.1f} | "
                     f"{r['storage_calls_total']} ({calls}) | "
                     + (f"{r['http_requests_total']} ({http})" if http else "n/a") + " |")
    if "latest" in plots:
        lines += ["", f"![latest]({plots['latest']})"]
    return [*lines, ""]


def _plots(data: Mapping[str, Any], img: Path) -> dict[str, str]:
    plt = pyplot()
    if plt is None:  # pragma: no cover - matplotlib is a dev dependency
        return {}
    out: dict[str, str] = {}
    h = data.get("hash")
    if h and h["rows"]:
        rows = [r for r in h["rows"] if "chunks" in r]
        fig, ax = plt.subplots(figsize=(8, 4))
        chunks = [c["chunk"] for c in rows[0]["chunks"]]
        width = 0.8 / (len(chunks) + 1)
        for j, c in enumerate(chunks):
            ax.bar([i + j * width for i in range(len(rows))],
                   [r["chunks"][j]["ckptfs_gbps"] for r in rows], width,
                   label=f"ckptfs, {fmt_size(c)} chunks")
        ax.bar([i + len(chunks) * width for i in range(len(rows))],
               [r["raw_one_shot_gbps"] for r in rows], width, label="raw library, one shot",
               color="grey")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))],
                      [r["algorithm"] for r in rows])
        ax.set_ylabel("GB/s (one thread)")
        ax.set_title("Hashing throughput")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / "hash_throughput.png", dpi=110)
        plt.close(fig)
        out["hash"] = "img/hash_throughput.png"
    for key in ("save", "s3"):
        s = data.get(key)
        if not s:
            continue
        for size in s["sizes"]:
            for op in ("save", "load"):
                rows = sorted([r for r in s["results"] if r.get("size") == size
                               and r.get("op") == op and "median_s" in r],
                              key=lambda r: -r["median_s"])
                if not rows:
                    continue
                fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
                colors = {"ckptfs": "tab:blue", "baseline": "tab:orange", "raw": "tab:grey"}
                ax.barh([r["variant"] for r in rows], [r["median_s"] for r in rows],
                        color=[colors.get(r["family"], "tab:grey") for r in rows])
                for i, r in enumerate(rows):
                    ax.text(r["median_s"], i, f" {r['gb_per_s']} GB/s", va="center", fontsize=7)
                ax.set_xlabel("seconds (median, lower is better)")
                where = "local disk" if key == "save" else "moto S3"
                ax.set_title(f"{op.capitalize()} of a {fmt_size(size)} state, {where}")
                ax.tick_params(axis="y", labelsize=7)
                ax.set_xlim(0, max(r["median_s"] for r in rows) * 1.3)
                fig.tight_layout()
                name = f"{key}_{op}_{size // MiB}MiB.png"
                fig.savefig(img / name, dpi=110)
                plt.close(fig)
                out[f"{key}-{op}-{size}"] = f"img/{name}"
    out.update(_incremental_plot(data.get("incremental"), img))
    lt = data.get("latest")
    if lt and lt["rows"]:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
        for backend in sorted({r["backend"] for r in lt["rows"]}):
            rs = [r for r in lt["rows"] if r["backend"] == backend]
            xs = [r["checkpoints"] for r in rs]
            a1.plot(xs, [r["median_s"] * 1000 for r in rs], marker="o", label=backend)
            a2.plot(xs, [r["storage_calls_total"] for r in rs], marker="o",
                    label=f"{backend}: storage calls")
            if any(r["http_requests_total"] for r in rs):
                a2.plot(xs, [r["http_requests_total"] for r in rs], marker="s", linestyle="--",
                        label=f"{backend}: HTTP requests")
        for a in (a1, a2):
            a.set_xscale("log")
            a.set_xlabel("committed checkpoints")
            a.legend(fontsize=8)
        a1.set_ylabel("ms (median)")
        a1.set_yscale("log")
        a2.set_ylabel("requests")
        top = max(max(r["storage_calls_total"], r["http_requests_total"] or 0)
                  for r in lt["rows"])
        a2.set_ylim(0, top + 2)
        a1.set_title("Time to resolve latest")
        a2.set_title("Requests to resolve latest")
        fig.tight_layout()
        fig.savefig(img / "latest.png", dpi=110)
        plt.close(fig)
        out["latest"] = "img/latest.png"
    return out



# -- incremental saves (``ckptfs bench incremental``) ------------------------------------------

INCREMENTAL_HEADING = "## Incremental checkpoints (format v3)"
KEEP_LAST_TEXT = "100 LoRA-like saves with `keep_last=5`"


def _incremental_section(inc: Mapping[str, Any] | None, plots: Mapping[str, str]) -> list[str]:
    if not inc:
        return []
    m = inc.get("machine") or {}
    lines = [INCREMENTAL_HEADING, "",
             "`ckptfs bench incremental` (module `ckptfs.bench.incremental`, entry "
             "`benchmarks/incremental.py`; raw figures in `benchmarks/results/incremental.json`)"
             + (" at the issue's sizes (`--full`)." if inc.get("full_sizes") else
                " at the default sizes (`--full` runs the issue's 1 GiB ones).")
             + " Each case runs its variants side by side in one process, interleaved round by "
             "round (each round changes the state in place, untimed, then times every variant "
             "once, the order rotating); local disk "
             f"({inc.get('workdir_fs', '')}), durable saves (fsync), a few GiB touched and freed "
             "before each timed save. Every variant keeps its run (DCP: one directory per step), "
             "so all grow their page cache alike. Round 0 is each variant's first save (an "
             "incremental save with nothing to reference writes everything); *steady* is the "
             "median of the later rounds. *Bytes written*: `info.bytes_written` (the "
             "checkpoint's own files; manifest and marker aside), for DCP the directory's size. "
             f"Load average before {inc.get('load_before')}, after {inc.get('load_after')}"
             + (f"; {m.get('date_utc')}" if m.get("date_utc") else "") + ".", ""]
    if inc.get("note"):
        lines += [f"**{inc['note']}**", ""]
    targets = inc.get("targets") or []
    if targets:
        lines += ["| target | measured | goal | met | detail |", "|---|---:|---:|:---:|---|"]
        for t in targets:
            lines.append(f"| {t['target']} | {t['value']} | {t['goal']} | "
                         f"{'yes' if t['met'] else '**no**'} | {t['detail']} |")
        lines.append("")
    ret = inc.get("retention") or {}
    if ret.get("status") == "pending gc merge":
        lines += [f"- {KEEP_LAST_TEXT}: **pending gc merge** ({ret.get('reason', '')}).", ""]
    for case in (inc.get("cases") or {}).values():
        lines += [f"### {case['case']}: {case['description']}", "",
                  f"{fmt_size(case['state_bytes'])} in {case['tensors']} tensors, "
                  f"{fmt_size(case['changing_bytes'])} changing per step "
                  f"({case['changing_fraction'] * 100:.2f}%); {case['rounds']} rounds.", "",
                  "| variant | first save (s) | steady save (s) | CPU s | bytes written per "
                  "save | logical bytes |", "|---|---:|---:|---:|---:|---:|"]
        for name, v in case["variants"].items():
            lines.append(f"| {name} | {v['first_s']:.3f} | {v['median_s']:.3f} | "
                         f"{v['cpu_s']:.3f} | {v['bytes_written']:,} | {v['bytes']:,} |")
        lines.append("")
        for k, r in case.get("ratios", {}).items():
            lines.append(f"- {k}: bytes **{r['bytes']:.4f}x**, time **{r['time']:.3f}x**")
        lines.append("")
    if ret.get("status") and ret["status"] != "pending gc merge":
        lines += [f"### {KEEP_LAST_TEXT}", "", f"Status: {ret['status']}. {ret['description']}; "
                  f"{ret['saves']} saves through `CheckpointManager(keep_last="
                  f"{ret['keep_last']})` of an incremental store; median save "
                  f"{ret['median_save_s']} s writing {ret['median_bytes_written']:,} B.", "",
                  f"- stored at the end (run directory walked): {ret['stored_bytes']:,} B "
                  f"({ret['stored_over_one_full_state']}x one full state; without incremental "
                  f"saves the {len(ret['retained'])} retained checkpoints would hold "
                  f"{ret['without_incremental_bytes']:,} B)",
                  f"- bound: one full state {ret['first_save_bytes']:,} B + the retained "
                  f"checkpoints' own bytes {sum(ret['retained_own_bytes'].values()):,} B + "
                  f"metadata {ret['metadata_bytes']:,} B = {ret['bound_bytes']:,} B",
                  f"- after `gc` with no grace (retired attempts no longer referenced removed): "
                  f"{ret.get('stored_after_gc_bytes')} B",
                  f"- retained {ret['retained']}, verified: "
                  + ", ".join(f"{k} {v}" for k, v in ret["verified"].items()), ""]
    s3 = inc.get("s3")
    if s3:
        lines += ["### The LoRA-like case to S3 (moto)", "",
                  f"{s3['description']}; {fmt_size(s3['state_bytes'])}, {s3['rounds']} saves "
                  f"per variant, {s3['server']}. Requests are the HTTP requests s3fs sent "
                  "(botocore events), uploaded bytes their request bodies; steady state.", "",
                  "| variant | steady save (s) | requests per save | uploaded per save |",
                  "|---|---:|---|---:|"]
        for name, v in s3["variants"].items():
            ops = ", ".join(f"{k} {n}" for k, n in sorted(v["requests"].items()))
            lines.append(f"| {name} | {v['median_s']:.3f} | {v['requests_total']} ({ops}) | "
                         f"{v['uploaded_bytes']:,} B |")
        r = s3["ratios"]
        lines += ["", f"- incremental/full: uploaded **{r['uploaded']:.4f}x**, requests "
                  f"{r['requests']:.2f}x, time **{r['time']:.3f}x**", ""]
    fr = inc.get("fresh")
    if fr:
        lines += ["### A fresh process: a resumed job's first incremental save", "",
                  f"A new process builds the LoRA-like state ({fmt_size(fr['base_bytes'])} base, "
                  "untimed), then times `import ckptfs` + `open` + its first save: incremental "
                  "into a run holding a committed checkpoint of the same base (it reads that "
                  "checkpoint's manifest and headers and hashes every tensor once to confirm "
                  "the reuse, and reads each stored chunk it reuses once to check it against "
                  "its digest), against a full save; then "
                  f"{fr['steady_saves']} more saves in the same process (steady). Medians of "
                  f"{fr['rounds']} rounds, variants interleaved.", "",
                  "| variant | fresh (s) | of which import (s) | first save (s) | steady (s) | "
                  "first save writes | steady save writes |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, v in fr["summary"].items():
            steady = "" if v["steady_s"] is None else f"{v['steady_s']:.3f}"
            lines.append(f"| {name} | {v['fresh_s']:.3f} | {v['import_s']:.3f} | "
                         f"{v['first_save_s']:.3f} | {steady} | {v['first_bytes_written']:,} B | "
                         f"{v['steady_bytes_written'] or 0:,} B |")
        ratio = fr["ratios"]["fresh incremental/full"]
        lines += ["", f"- fresh incremental/full: **{ratio:.3f}x**", ""]
    if "incremental" in plots:
        lines += [f"![bytes written and time per save]({plots['incremental']})", ""]
    return lines


def _incremental_plot(inc: Mapping[str, Any] | None, img: Path) -> dict[str, str]:
    """Bytes written and time per save over the LoRA-like run (and the RL-like one)."""
    cases = (inc or {}).get("cases") or {}
    if not cases:
        return {}
    plt = pyplot()
    if plt is None:  # pragma: no cover - matplotlib is a dev dependency
        return {}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {"incremental": "o-", "full": "s--", "v1": "s--", "DCP": "^:"}
    for cname, case in cases.items():
        if cname == "finetune":
            continue
        for vname, v in case["variants"].items():
            style = next((st for k, st in styles.items() if k in vname), "o-")
            label = f"{cname}: {vname}"
            xs = [p["round"] for p in v["series"]]
            a1.plot(xs, [p["bytes_written"] for p in v["series"]], style, label=label,
                    alpha=1.0 if cname == "lora" else 0.5)
            a2.plot(xs, [p["time_s"] for p in v["series"]], style, label=label,
                    alpha=1.0 if cname == "lora" else 0.5)
    a1.set_yscale("log")
    a1.set_ylabel("bytes written per save")
    a2.set_ylabel("seconds per save (durable)")
    for a in (a1, a2):
        a.set_xlabel("save (round; 0 = the first in the process)")
    a1.set_title("Bytes written per save")
    a2.set_title("Time per save")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img / "incremental.png", dpi=110)
    plt.close(fig)
    return {"incremental": "img/incremental.png"}


def write_incremental_section(results_dir: Path, docs_dir: Path, *,
                              md_name: str = "benchmarks.md") -> Path:
    """Render only the incremental section and its plot into an existing report: the section
    is replaced where it is, else inserted before the hand-written notes (where
    `write_report` puts it).  The rest of the document is left as it is."""
    p = results_dir / "incremental.json"
    inc = json.loads(p.read_text()) if p.exists() else None
    img = docs_dir / "img"
    img.mkdir(parents=True, exist_ok=True)
    return splice_section(docs_dir / md_name, INCREMENTAL_HEADING,
                          _incremental_section(inc, _incremental_plot(inc, img)))


# -- two tiers (``ckptfs bench tiers``) --------------------------------------------------------

TIERS_HEADING = "## Two tiers: local disk + S3 (moto)"


def _tiers_section(t: Mapping[str, Any] | None, plots: Mapping[str, str]) -> list[str]:
    if not t:
        return []
    b, lp = t["blocking"], t["loop"]
    m, r = b["median"], b["ratios"]
    mach = t.get("machine") or {}
    lines = [TIERS_HEADING, "",
             "`ckptfs bench tiers` (module `ckptfs.bench.tiers`, entry `benchmarks/tiers.py`; "
             "raw figures in `benchmarks/results/tiers.json`)"
             + (" at the issue's sizes (`--full`)." if t.get("full_sizes") else
                " at the default sizes (`--full`: a 1 GiB checkpoint)."),
             f"Local tier: {t.get('local_fs', '?')}; remote tier: {t['server']}: the server, the "
             "replicator and the job share the machine's "
             f"{mach.get('cpus', 2)} cores, so every figure with the replicator running "
             "includes the S3 server's CPU time.", "",
             *_overhead_lines(t.get("overhead")),
             f"### Blocking time and replication ({fmt_size(b['state_bytes'])}, "
             f"{len(b['rounds'])} alternating rounds, medians)", "",
             "Durable saves on this VM's disk vary up to 3x from one save to the next (the "
             "second of two saves is often the slow one, whichever store makes it), so the "
             "overhead is measured above on tmpfs; here, each round alternates which store "
             "saves first, and whether `ckptfs cp` runs before or after the replication.", "",
             "| measure | time | ratio | goal |", "|---|---|---|---|",
             f"| local-only save | {m['local_s']:.3f} s | 1 | |",
             f"| tiered save, replicator idle | {m['tiered_idle_s']:.3f} s | "
             f"{r['blocking_idle']:.3f}x | (the disk's noise: the goal is judged on tmpfs, "
             "above) |",
             f"| local-only save right after another | {m['local_b2b_s']:.3f} s | 1 | |",
             f"| tiered save right after another, which replicates meanwhile | "
             f"{m['tiered_busy_s']:.3f} s | {r['blocking_busy']:.3f}x | |",
             f"| `ckptfs cp` of the step alone | {m['cp_s']:.2f} s "
             f"({b['throughput_MiBps']['cp']} MiB/s) | 1 | |",
             f"| replication of the step (save returned -> committed at the remote) | "
             f"{m['replication_s']:.2f} s ({b['throughput_MiBps']['replication']} MiB/s) | "
             f"**{r['replication_vs_cp']:.3f}x** cp's throughput | >= 0.9x |", ""]
    pr = b.get("ratios_per_round_median")
    if pr:
        lines += [f"Median of the per-round ratios (each round's pair measured back to back): "
                  f"blocking {pr['blocking_idle']:.3f}x idle, {pr['blocking_busy']:.3f}x while "
                  f"replicating; replication {pr['replication_vs_cp']:.3f}x cp's throughput.",
                  ""]
    tt = lp["variants"]["two tiers"]
    lines += [f"### A training loop saving every {lp['every']} steps "
              f"({fmt_size(lp['checkpoint_bytes'])} checkpoints, {lp['steps']} steps)", "",
              "An MLP with AdamW on a fixed batch, the same loop three times; the local-only "
              "and the two-tier variants keep the last two checkpoints locally (the tiered "
              "store holds a step until it is replicated).", "",
              "| variant | steps/s | vs no checkpoint | median save |", "|---|---|---|---|"]
    for name, v in lp["variants"].items():
        save = f"{v['save_s_median']:.3f} s" if v.get("save_s_median") is not None else ""
        lines.append(f"| {name} | {v['steps_per_s']:.2f} | {lp['ratios'][name]:.3f}x | {save} |")
    lags = [x["lag_steps"] for x in tt["lags"]]
    cpu = {name: v for name, v in lp["variants"].items() if "cpu_s" in v}
    if cpu:
        lines += ["", "CPU seconds over each loop (this machine's cores are shared by the job, "
                  "the replicator and the S3 server): "
                  + "; ".join(f"{name}: the job's process {v['cpu_s']:.1f} s"
                              + (f", the S3 server {v['server_cpu_s']:.1f} s"
                                 if v.get("server_cpu_s") else "")
                              for name, v in cpu.items()) + "."]
    lines += ["", f"Replication lag seen at each save (checkpoints committed locally and not yet "
              f"at the remote): {lags}; at steady state (second half) at most "
              f"**{tt['max_lag_steady']}** (goal: at most one checkpoint interval, i.e. <= 1); "
              f"`wait_replicated()` after the last step: {tt['wait_at_end_s']:.2f} s.", ""]
    if "tiers" in plots:
        lines += [f"![training loop with and without the second tier]({plots['tiers']})", ""]
    return lines


def _overhead_lines(o: Mapping[str, Any] | None) -> list[str]:
    if not o:
        return []
    m = o["median"]
    return [f"### What a tiered save adds ({fmt_size(o['state_bytes'])}, {o['where']}, "
            f"`durable=False`, {len(o['rounds'])} alternating rounds, medians)", "",
            "Both stores in memory-backed files, so the disk's noise (below) is out of the "
            "picture; the replicator held off while the pair of saves runs.", "",
            "| local-only save | tiered save | ratio | per-round ratio (median) | goal |",
            "|---|---|---|---|---|",
            f"| {m['local_s'] * 1000:.1f} ms | {m['tiered_s'] * 1000:.1f} ms | "
            f"**{o['ratio']:.3f}x** | {o['ratio_per_round_median']:.3f}x | <= 1.05x |", ""]


def _tiers_plot(t: Mapping[str, Any] | None, img: Path) -> dict[str, str]:
    """Cumulative time of the training loop per variant, and the replication lag at saves."""
    if not t:
        return {}
    plt = pyplot()
    if plt is None:  # pragma: no cover - matplotlib is a dev dependency
        return {}
    lp = t["loop"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, v in lp["variants"].items():
        acc, xs = 0.0, []
        for dt in v["step_s"]:
            acc += dt
            xs.append(acc)
        a1.plot(range(1, len(xs) + 1), xs, label=name)
    a1.set_xlabel("training step")
    a1.set_ylabel("elapsed s")
    a1.set_title(f"Training loop, a save every {lp['every']} steps")
    a1.legend(fontsize=8)
    lags = lp["variants"]["two tiers"]["lags"]
    a2.step([x["step"] for x in lags], [x["lag_steps"] for x in lags], where="post", marker="o")
    a2.axhline(1, linestyle=":", color="grey")
    a2.set_xlabel("training step (at each save)")
    a2.set_ylabel("checkpoints not yet at the remote")
    a2.set_title("Replication lag")
    fig.tight_layout()
    fig.savefig(img / "tiers.png", dpi=110)
    plt.close(fig)
    return {"tiers": "img/tiers.png"}


def write_tiers_section(results_dir: Path, docs_dir: Path, *,
                        md_name: str = "benchmarks.md") -> Path:
    """Render only the two-tier section and its plot into an existing report."""
    p = results_dir / "tiers.json"
    t = json.loads(p.read_text()) if p.exists() else None
    img = docs_dir / "img"
    img.mkdir(parents=True, exist_ok=True)
    return splice_section(docs_dir / md_name, TIERS_HEADING,
                          _tiers_section(t, _tiers_plot(t, img)))
