"""The figures command: run every sweep on each backend (starting the storage servers needed),
write the raw results to docs/reliability.json and the table between the ``figures`` markers
of docs/reliability.md.  ``python -m ckptfs.testing.reliability`` runs `main`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from ckptfs.testing.backend import Backend, unique_name
from ckptfs.testing.reliability.common import Sweep
from ckptfs.testing.reliability.corruption import corruption_matrix
from ckptfs.testing.reliability.crash import (
    sweep_delete_crashes,
    sweep_gc_crashes,
    sweep_prune_crashes,
    sweep_save_crashes,
)
from ckptfs.testing.reliability.hostile import hostile_sweep
from ckptfs.testing.reliability.power import sweep_power_cut_delete, sweep_power_cuts
from ckptfs.testing.reliability.races import (
    sweep_free_race,
    sweep_prune_during_save,
    sweep_reader_during_saves,
    sweep_zombie,
)
from ckptfs.testing.reliability.tiers import replication_sweeps
from ckptfs.testing.reliability.transient import sweep_transient

SERVER_OF = {"s3": "moto", "ministack": "ministack", "gcs": "gcs", "azure": "azurite"}
NAME_OF = {"local": "local", "memory": "memory", "s3": "s3-moto", "ministack": "s3-ministack",
           "gcs": "gcs-fake", "azure": "azure-azurite"}


@contextlib.contextmanager
def backends(names: list[str], tmp: str) -> Iterator[dict[str, Callable[[], Backend]]]:
    """Factories of fresh backends by short name, starting the servers needed."""
    from ckptfs.testing import servers

    with contextlib.ExitStack() as stack:
        out: dict[str, Callable[[], Backend]] = {}
        for name in names:
            if name == "local":
                out[name] = lambda: Backend("local", f"file://{tmp}/{unique_name()}")
            elif name == "memory":
                out[name] = lambda: Backend("memory", f"memory://{unique_name()}")
            else:
                info = stack.enter_context(servers.SERVERS[SERVER_OF[name]]())

                def make(info: Any = info, name: str = name) -> Backend:
                    return Backend(NAME_OF[name], info.url(unique_name()),
                                   dict(info.storage_options), env=dict(info.env))

                out[name] = make
        yield out


def sweeps_for(name: str, make: Callable[[], Backend]) -> list[Sweep]:
    """Every sweep of one backend, as the figures command runs them (the tests run the same
    functions, some with fewer trials)."""
    from ckptfs.testing.reliability.sharded import sweep_sharded_save_crashes  # imports DCP

    out = [sweep_save_crashes(make()), sweep_delete_crashes(make()),
           sweep_prune_crashes(make()), sweep_gc_crashes(make()),
           sweep_sharded_save_crashes(make())]
    if name in ("local", "memory"):
        out.append(sweep_save_crashes(make(), threads=4))
    if name == "local":
        out += [sweep_power_cuts(make()), sweep_power_cut_delete(make())]
    out += [sweep_zombie(make()), sweep_free_race(make(), trials=5, writers=3),
            sweep_reader_during_saves(make()), sweep_prune_during_save(make()),
            corruption_matrix(make()), sweep_transient(make(), trials=25, p=0.1),
            sweep_transient(make(), trials=25, p=0.2), hostile_sweep(make())]
    return out + replication_sweeps(name, make)


def run_all(names: list[str], tmp: str, *, only_tiers: bool = False) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {}
    with backends(names, tmp) as factories:
        for name, make in factories.items():
            t0 = time.monotonic()
            sweeps = replication_sweeps(name, make) if only_tiers else sweeps_for(name, make)
            results[name] = [s.as_dict() for s in sweeps]
            print(f"{name}: {sum(s.tried for s in sweeps)} scenarios, "
                  f"{sum(len(s.violations) for s in sweeps)} violations, "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
            for s in sweeps:
                for v in s.violations:
                    print("  VIOLATION", v, file=sys.stderr)
    return {"generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "results": results}


COLUMNS = [
    ("save-crash", "save crash points"),
    ("delete-crash", "delete crash points"),
    ("prune-crash", "prune crash points"),
    ("gc-crash", "gc crash points"),
    ("sharded-save-crash", "sharded save crash points (2 ranks)"),
    ("power-cut", "power cuts"),
    ("race", "race trials"),
    ("corruption", "corruptions detected / tried"),
    ("transient", "saves under transient faults (committed)"),
    ("hostile", "hostile inputs"),
    ("replication-crash", "replicator crash/outage points (remote tier)"),
    ("two-tier", "two-tier outage and local-loss scenarios"),
]


def _merge(sweeps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by: dict[str, dict[str, Any]] = {}
    for s in sweeps:
        key = s["name"]
        for family in ("race", "replication-crash", "two-tier"):
            if key.startswith(family):
                key = family
        cur = by.setdefault(key, {"tried": 0, "violations": [], "counters": {}})
        cur["tried"] += s["tried"]
        cur["violations"] = cur["violations"] + s["violations"]
        for k, v in s["counters"].items():
            if k.endswith("_max") or k.startswith("calls_per") or k.endswith("_per_copy"):
                cur["counters"][k] = max(cur["counters"].get(k, 0), v)
            else:
                cur["counters"][k] = cur["counters"].get(k, 0) + v
    return by


def table(doc: dict[str, Any]) -> str:
    lines = ["| backend | " + " | ".join(c[1] for c in COLUMNS) + " | violations |",
             "|---|" + "---:|" * (len(COLUMNS) + 1)]
    for name, sweeps in doc["results"].items():
        by = _merge(sweeps)
        cells = []
        for key, _ in COLUMNS:
            s = by.get(key)
            if s is None:
                cells.append("n/a")
            elif key == "corruption":
                cells.append(f"{s['counters'].get('detected', 0)} / {s['tried']}")
            elif key == "transient":
                cells.append(f"{s['tried']} ({s['counters'].get('committed', 0)})")
            else:
                cells.append(str(s["tried"]))
        viol = sum(len(s["violations"]) for s in sweeps)
        lines.append(f"| {NAME_OF.get(name, name)} | " + " | ".join(cells) + f" | {viol} |")
    return "\n".join(lines)


def details(doc: dict[str, Any]) -> str:
    """One line per backend with the counters behind the table."""
    lines = []
    for name, sweeps in doc["results"].items():
        by = _merge(sweeps)

        def c(key: str, counter: str, by: dict[str, dict[str, Any]] = by) -> int:
            return int(by.get(key, {}).get("counters", {}).get(counter, 0))

        parts = [f"{c('save-crash', 'calls_per_save')} mutating calls per save",
                 f"{c('sharded-save-crash', 'calls_per_sharded_save')} per 2-rank sharded save",
                 f"{c('save-crash', 'tear')} torn writes",
                 f"quick verify {c('corruption', 'quick_detected')} / "
                 f"{c('corruption', 'quick_tried')} size or inventory changes",
                 f"load detected {c('corruption', 'load_detected')} (+"
                 f"{c('corruption', 'load_unaffected_by_stray')} stray files that do not "
                 "change what it loads)",
                 f"load() of the damaged latest raised {c('corruption', 'latest_raised')} times"]
        if c("corruption", "marker_flips"):
            parts.append(f"marker byte flips {c('corruption', 'marker_flips')}: "
                         f"{c('corruption', 'marker_flips_detected')} detected, "
                         f"{c('corruption', 'marker_flips_harmless')} provably harmless")
        if "power-cut" in by:
            parts.append(f"power cuts rolled back {c('power-cut', 'entries_rolled_back')} "
                         "directory entries")
        parts.append(f"transient faults injected {c('transient', 'faults_injected')}, retries "
                     f"{c('transient', 'retries')}")
        parts.append(f"hostile-input peak memory "
                     f"{c('hostile', 'peak_bytes_max') / 2**20:.1f} MiB")
        lines.append(f"- {NAME_OF.get(name, name)}: " + "; ".join(parts) + ".")
    return "\n".join(lines)


BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
TIERS_BEGIN, TIERS_END = "<!-- tiers-figures:begin -->", "<!-- tiers-figures:end -->"


def tiers_table(doc: dict[str, Any]) -> str:
    """The two-tier figures (docs/reliability.md, *Two tiers*): per remote backend, the
    replicator's mutating calls per replication (v1 / an incremental v3 step), the scenarios of
    each kind, what was recovered and collected, and the wall time."""
    lines = ["| remote tier | calls per replication (v1 / v3) | crash points | outage points "
             "(before and after the call) | lost-answer points | outage and local-loss "
             "scenarios | recovered | leaked attempts collected by gc | files left after gc "
             "| save during the outage, ms (local-only) | violations | time (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, sweeps in doc["results"].items():
        tiers = [s for s in sweeps
                 if s["name"].startswith(("replication-crash", "two-tier"))]
        if not tiers:
            continue

        def total(counter: str, tiers: list[dict[str, Any]] = tiers) -> int:
            return sum(int(s["counters"].get(counter, 0)) for s in tiers)

        calls = {s["name"]: s["counters"].get("calls_per_replication", 0) for s in tiers}
        lines.append(
            f"| {NAME_OF.get(name, name)} | {calls.get('replication-crash', 0)} / "
            f"{calls.get('replication-crash (v3)', 0)} | {total('crash_points')} | "
            f"{total('outage_points')} | {total('blip_points')} | "
            f"{sum(s['tried'] for s in tiers if s['name'].startswith('two-tier'))} | "
            f"{total('recovered') + total('resumed') + total('caught_up')} | "
            f"{total('leaked_attempts_collected')} | {total('leaked_files_left')} | "
            f"{total('save_ms_during_outage_max')} ({total('save_ms_local_only_max')}) | "
            f"{sum(len(s['violations']) for s in tiers)} | {total('sweep_ms') / 1000:.0f} |")
    return "\n".join(lines)


def update_doc(doc_path: str, doc: dict[str, Any]) -> None:
    text = f"{BEGIN}\n{END}\n"
    if os.path.exists(doc_path):
        with open(doc_path) as f:
            text = f.read()
    block = (f"{BEGIN}\nLast run: {doc['generated']} (`python -m ckptfs.testing.reliability`).\n\n"
             f"{table(doc)}\n\n{details(doc)}\n{END}")
    text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text,
                  flags=re.DOTALL)
    with open(doc_path, "w") as f:
        f.write(text)


def update_block(doc_path: str, begin: str, end: str, body: str) -> None:
    """Replace what lies between ``begin`` and ``end`` in ``doc_path`` (appended if absent)."""
    with open(doc_path) as f:
        text = f.read()
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text,
                      flags=re.DOTALL)
    else:
        text = text.rstrip("\n") + f"\n\n{block}\n"
    with open(doc_path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import tempfile

    import ckptfs.testing.reliability as package  # its docstring is the command's description

    parser = argparse.ArgumentParser(prog="python -m ckptfs.testing.reliability",
                                     description=(package.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=list(NAME_OF),
                        choices=list(NAME_OF))
    parser.add_argument("--tiers", action="store_true",
                        help="only the two-tier sweeps (docs/reliability-tiers.json and the "
                        "tiers-figures block)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--doc", default="docs/reliability.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        doc = run_all(args.backends, tmp, only_tiers=args.tiers)
    json_path = args.json or ("docs/reliability-tiers.json" if args.tiers
                              else "docs/reliability.json")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    if args.tiers:
        scenarios = sum(s["tried"] for sweeps in doc["results"].values() for s in sweeps)
        update_block(args.doc, TIERS_BEGIN, TIERS_END,
                     f"Last run: {doc['generated']} (`python -m ckptfs.testing.reliability "
                     f"--tiers --backends {' '.join(args.backends)}`; {scenarios} "
                     f"scenarios).\n\n{tiers_table(doc)}")
        print(tiers_table(doc))
    else:
        update_doc(args.doc, doc)
        print(table(doc))
    violations = sum(len(s["violations"]) for v in doc["results"].values() for s in v)
    return 1 if violations else 0
