"""The figures of ``ckptfs bench scale``: how each measure grows with the world size (`slope`,
`growth`), the tables of the coordinator's work and of a loading rank's (`table`, `load_table`)
and the plot.  Pure functions of the rows `ckptfs.bench.scale.run_scale` measures."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["growth", "load_table", "plot", "slope", "table"]



def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The exponent k of y ~ x^k: least-squares slope of log y on log x (None below 2
    points or for non-positive values)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


#: (column, ckptfs key, DCP key or None, unit) of the table.
COLUMNS: tuple[tuple[str, str, str | None, str], ...] = (
    ("coordinator s", "coordinator_s", "coordinator_s", "s"),
    ("coordinator all in s", "coordinator_all_in_s", "coordinator_all_in_s", "s"),
    ("coordinator again s", "coordinator_again_s", None, "s"),
    ("metadata MB", "metadata_bytes", "metadata_bytes", "MB"),
    ("plans MB", "plans_bytes", "plans_bytes", "MB"),
    ("plans pickle s", "plans_pickle_s", "plans_pickle_s", "s"),
    ("broadcast MB", "broadcast_bytes", "broadcast_bytes", "MB"),
    ("broadcast unpickle s/rank", "broadcast_unpickle_s", "broadcast_unpickle_s", "s"),
    ("read MB/loading rank", "read_per_rank_bytes", "read_per_rank_bytes", "MB"),
    ("load s/rank", "load_per_rank_s", "load_per_rank_s", "s"),
    ("busiest writer / mean", "writers_balance", "writers_balance", "x"),
)


def _fmt(v: float, unit: str) -> str:
    if unit == "x":
        return f"{v:.2f}"
    if unit == "MB":
        return f"{v / 1e6:.3f}" if v < 1e7 else f"{v / 1e6:.1f}"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def growth(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per mesh, the exponent in W of every column (``ckptfs/<key>``, ``dcp/<key>``)."""
    out: dict[str, dict[str, float | None]] = {}
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        rs = [r for r in rows if r["mesh"] == mesh]
        ws = [r["world"] for r in rs]
        g: dict[str, float | None] = {}
        for _, ours, theirs, _unit in COLUMNS:
            g[f"ckptfs/{ours}"] = slope(ws, [r["ckptfs"][ours] for r in rs])
            if theirs is not None:
                g[f"dcp/{theirs}"] = slope(ws, [r["dcp"][theirs] for r in rs])
        out[mesh] = g
    return out


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """One Markdown table per mesh: each cell ``ckptfs / DCP``; then the growth exponents."""
    lines: list[str] = []
    slopes = growth(rows)
    for mesh, g in slopes.items():
        rs = [r for r in rows if r["mesh"] == mesh]
        r0 = rs[0]
        lines += [f"**{mesh}**, {r0['layers']} layer(s): {r0['tensors']} tensors, "
                  f"{r0['values']} values; each cell ckptfs / DCP", "",
                  "| W | " + " | ".join(c for c, *_ in COLUMNS) + " |",
                  "|---" * (len(COLUMNS) + 1) + "|"]
        for r in rs:
            cells = [f"{_fmt(r['ckptfs'][o], u)} / {_fmt(r['dcp'][t], u)}" if t else
                     _fmt(r["ckptfs"][o], u) for _, o, t, u in COLUMNS]
            lines.append(f"| {r['world']:,} | " + " | ".join(cells) + " |")
        if len(rs) > 1:
            def k(key: str, g: Mapping[str, float | None] = g) -> str:
                v = g.get(key)
                return "-" if v is None else f"{v:.2f}"
            lines.append("| growth in W | " + " | ".join(
                f"{k('ckptfs/' + o)} / {k('dcp/' + t)}" if t else k("ckptfs/" + o)
                for _, o, t, _u in COLUMNS) + " |")
        lines.append("")
    return "\n".join(lines)


def load_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per mesh, what one loading rank reads of the metadata: ckptfs's default layout (format
    v2: marker, manifest, ``dcp.msgpack``), ``metadata_layout="per-rank"`` (format v5: marker,
    manifest, spec, its table blocks and the index documents it needs; the larger of ranks 0
    and W - 1) and DCP (``.metadata``): bytes read (each of them decoded too) and seconds."""
    lines: list[str] = []
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        lines += [f"**{mesh}**, metadata per loading rank; each cell v2 / v5 / DCP", "",
                  "| W | read and decoded KiB | load s/rank | v5 coordinator s, first / again "
                  "| v5 coordinator all in s, first / again |",
                  "|---|---|---|---|---|"]
        for r in (r for r in rows if r["mesh"] == mesh and "v5" in r):
            kib = [r[k]["read_per_rank_bytes"] / 1024 for k in ("ckptfs", "v5", "dcp")]
            sec = [r[k]["load_per_rank_s"] for k in ("ckptfs", "v5", "dcp")]
            v5 = r["v5"]
            lines.append(f"| {r['world']:,} | " + " / ".join(f"{v:,.1f}" for v in kib)
                         + " | " + " / ".join(f"{v:.4f}" for v in sec) + " | "
                         + f"{v5['coordinator_s']:.3f} / {v5['coordinator_again_s']:.3f} | "
                         + f"{v5.get('coordinator_all_in_s', float('nan')):.3f} / "
                         + f"{v5.get('coordinator_all_in_again_s', float('nan')):.3f} |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """Per mesh, two log-log panels against W: the coordinator's save seconds (ckptfs v2 and v5,
    a first save and the next of the same layout; DCP)
    and the metadata one loading rank reads (v2, v5, DCP), written to ``path`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    fig, axes = plt.subplots(len(meshes), 2, figsize=(10, 3.6 * len(meshes)), squeeze=False)
    for (left, right), mesh in zip(axes, meshes, strict=True):
        mine = [r for r in rows if r["mesh"] == mesh]
        for key, field, label in (
                ("ckptfs", "coordinator_s", "ckptfs v2, first save"),
                ("ckptfs", "coordinator_again_s", "ckptfs v2, same layout again"),
                ("v5", "coordinator_s", "ckptfs v5, first save"),
                ("v5", "coordinator_again_s", "ckptfs v5, same layout again"),
                ("dcp", "coordinator_s", "DCP")):
            have = [r for r in mine if field in r.get(key, {})]
            left.plot([r["world"] for r in have], [r[key][field] for r in have], "o-",
                      label=label)
        left.axhline(1.0, color="grey", linestyle=":", label="goal: 1 s")
        left.set(xscale="log", yscale="log", xlabel="ranks (W)", ylabel="coordinator s",
                 title=f"{mesh}: the coordinator's save work")
        for key, label in (("ckptfs", "ckptfs v2"), ("v5", "ckptfs v5 (per-rank)"),
                           ("dcp", "DCP")):
            have = [r for r in mine if key in r]
            right.plot([r["world"] for r in have],
                       [r[key]["read_per_rank_bytes"] / 1024 for r in have], "o-", label=label)
        right.axhline(64, color="grey", linestyle=":", label="goal: 64 KiB")
        right.set(xscale="log", yscale="log", xlabel="ranks (W)",
                  ylabel="KiB read per loading rank",
                  title=f"{mesh}: metadata a loading rank reads")
        for ax in (left, right):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
