"""``ckptfs bench {hash,save,interleaved,s3,latest,fresh,incremental,fixed,scale,all,report}`` (also
``main``, which the scripts in ``benchmarks/`` call) and the isolated worker's entry point:
``python -m ckptfs.bench.cli SPEC`` runs one variant (`ckptfs.bench.variants.run_isolated`);
``python -m ckptfs.bench.cli ARGS`` is ``ckptfs bench ARGS``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptfs.bench.common import QUESTIONS, RESULT_TAG, machine_info, parse_size

# Only the standard library and ckptfs's core dependencies at import: ``ckptfs --help`` loads
# this module to offer ``bench``.  Each question imports its module (and what that needs:
# ``pip install "ckptfs[bench]"``) when it runs.


def _save_json(results_dir: Path, name: str, payload: Mapping[str, Any]) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    p = results_dir / f"{name}.json"
    p.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return p


def _sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def run_question(q: str, args: argparse.Namespace) -> dict[str, Any]:
    isolate = not getattr(args, "in_process", False)
    if q == "hash":
        from ckptfs.bench.hashing import bench_hash

        return bench_hash(parse_size(args.hash_size), reps=args.reps)
    if q in ("save", "interleaved", "s3"):
        from ckptfs.bench.save import bench_interleaved, bench_s3, bench_save
    if q == "save":
        return bench_save(_sizes(args.sizes), reps=args.reps, isolate=isolate,
                          full_up_to=parse_size(args.full_up_to))
    if q == "interleaved":
        return bench_interleaved(_sizes(args.sizes), reps=args.interleaved_reps)
    if q == "s3":
        return bench_s3(_sizes(args.s3_sizes), reps=args.s3_reps or args.reps, isolate=isolate)
    if q == "fresh":
        from ckptfs.bench.fresh import bench_fresh

        return bench_fresh(parse_size(args.fresh_size), rounds=args.fresh_rounds,
                           baseline=args.baseline or None)
    if q == "fixed":
        from ckptfs.bench.fixed import run_args

        out = run_args(args)
        out["note"] = args.note  # machine.json is only rewritten by ``all``
        return out
    if q == "latest":
        from ckptfs.bench.latest import bench_latest

        return bench_latest([int(c) for c in args.counts.split(",")], reps=max(args.reps, 3),
                            s3_max=args.s3_max)
    if q == "incremental":
        from ckptfs.bench.incremental import bench_incremental

        out = bench_incremental(
            full=args.incr_full, base=parse_size(args.incr_base) if args.incr_base else None,
            rounds=args.incr_rounds,
            retention_base=parse_size(args.retention_base) if args.retention_base else None,
            retention_saves=args.retention_saves,
            s3_base=parse_size(args.incr_s3_base) if args.incr_s3_base else None,
            s3_rounds=args.incr_s3_rounds, fresh_rounds=args.incr_fresh_rounds,
            force_retention=args.retention_without_gc)
        out["machine"] = machine_info()  # machine.json is only rewritten by ``all``
        out["note"] = args.note
        return out
    if q == "remote-verify":
        from ckptfs.bench.remote_verify import bench_remote_verify
        from ckptfs.bench.remote_verify import table as remote_verify_table

        out = bench_remote_verify(parse_size(args.rv_size),
                                  [b for b in args.rv_backends.split(",") if b],
                                  tensors=args.rv_tensors)
        print(remote_verify_table(out))
        return out
    if q == "tiers":
        from ckptfs.bench.tiers import bench_tiers

        return bench_tiers(full=args.tiers_full,
                           size=parse_size(args.tiers_size) if args.tiers_size else None,
                           rounds=args.tiers_rounds, loop_steps=args.loop_steps,
                           every=args.loop_every, loop_params=args.loop_params or None)
    raise ValueError(q)


def output_dirs(args: argparse.Namespace) -> tuple[Path, Path]:
    """Where the JSON goes and where the report (``benchmarks.md``, ``img/``) goes:
    ``--results`` / ``--docs`` if given, else ``OUT/results`` and ``OUT`` (``--out``, default
    the current directory).  Never the installed package."""
    out = Path(args.out)
    return (Path(args.results) if args.results else out / "results",
            Path(args.docs) if args.docs else out)


def cmd_bench(args: argparse.Namespace) -> int:
    from ckptfs.bench.fixed_report import write_fixed_section
    from ckptfs.bench.report import write_incremental_section, write_report, write_tiers_section

    results, docs = output_dirs(args)
    what = args.bench_command
    if what == "report":
        if args.only == "incremental":
            print(write_incremental_section(results, docs))
        elif args.only == "tiers":
            print(write_tiers_section(results, docs))
        elif args.only == "fixed":
            print(write_fixed_section(results, docs))
        else:
            print(write_report(results, docs))
        return 0
    questions = QUESTIONS if what == "all" else (what,)
    machine = machine_info()
    t0 = time.perf_counter()
    for q in questions:
        print(f"[{time.strftime('%H:%M:%S')}] {q} ...", flush=True)
        _save_json(results, q.replace("-", "_"), run_question(q, args))
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    machine["duration_s"] = round(time.perf_counter() - t0, 1)
    if args.note:
        machine["concurrent_note"] = args.note
    if what == "all" or not (results / "machine.json").exists():
        _save_json(results, "machine", machine)
    if what == "all" or args.report:
        print(write_report(results, docs))
    return 0


def _fixed_parts(text: str) -> list[str]:
    """``--parts`` of ``ckptfs bench fixed``: comma-separated names of its parts."""
    from ckptfs.bench.fixed import PARTS

    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(unknown) or '(none)'}: "
                                         f"choose from {','.join(PARTS)}")
    return parts


#: Each option once: (flags, argparse keywords); _OWN says which subcommands show it.
_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "reps": (("--reps",), dict(type=int, default=3, help="timed runs per variant (median)")),
    "sizes": (("--sizes",), dict(default="1GiB,4GiB", help="local save/load state sizes")),
    "full_up_to": (("--full-up-to",), dict(
        default="2GiB", help="run every variant up to this size; above it, only the default "
        "algorithm and the main baselines (time: the full set takes ~5 min per GiB)")),
    "interleaved_reps": (("--interleaved-reps",), dict(
        type=int, default=3, help="rounds of the interleaved save-target check (each times "
        "every variant)")),
    "s3_sizes": (("--s3-sizes",), dict(default="1GiB",
                                       help="state sizes for the moto benchmark")),
    "s3_reps": (("--s3-reps",), dict(type=int, default=2, help="timed runs per moto variant "
                                     "(default: --reps); one 1 GiB run takes 10-30 s there")),
    "hash_size": (("--hash-size",), dict(default="512MiB",
                                         help="buffer size for hashing throughput")),
    "counts": (("--counts",), dict(default="10,100,1000,10000",
                                   help="checkpoint counts (latest)")),
    "s3_max": (("--s3-max",), dict(type=int, default=1000, help="largest checkpoint count "
                                   "populated on moto (it takes ~3 PUTs each)")),
    "fresh_size": (("--fresh-size",), dict(default="1GiB", help="state size of the fresh-"
                                           "process save/load")),
    "fresh_rounds": (("--fresh-rounds",), dict(type=int, default=3, help="interleaved rounds "
                                               "of the fresh-process variants")),
    "baseline": (("--baseline",), dict(default="", help="a checkout (e.g. a git worktree of "
                                       "the previous commit) whose ckptfs runs as 'baseline' "
                                       "beside this one")),
    "incr_full": (("--full",), dict(
        action="store_true", default=False, help="incremental: the issue's sizes (a 1 GiB "
        "LoRA base in 32 x 32 MiB, 1 GiB RL and fine-tuning states, the retention run and the "
        "S3 case at 1 GiB); default: 256 MiB (retention 128 MiB, S3 64 MiB)")),
    "incr_base": (("--incr-base",), dict(default="", help="incremental: the LoRA base size "
                                         "(also the RL and fine-tuning state size)")),
    "incr_rounds": (("--incr-rounds",), dict(type=int, default=6, help="incremental: saves "
                                             "per variant, interleaved (the first, then the "
                                             "steady state)")),
    "retention_base": (("--retention-base",), dict(default="", help="incremental: the LoRA "
                                                   "base of the keep_last=5 run")),
    "retention_saves": (("--retention-saves",), dict(type=int, default=100, help="incremental: "
                                                     "saves of the keep_last=5 run")),
    "retention_without_gc": (("--retention-without-gc",), dict(
        action="store_true", default=False, help="incremental: run the keep_last=5 case even "
        "without the reference-aware delete (its figures are then not valid)")),
    "incr_s3_base": (("--incr-s3-base",), dict(default="", help="incremental: the LoRA base "
                                               "saved to moto")),
    "incr_s3_rounds": (("--incr-s3-rounds",), dict(type=int, default=3, help="incremental: "
                                                   "saves per variant to moto")),
    "incr_fresh_rounds": (("--incr-fresh-rounds",), dict(type=int, default=2, help="incremental: "
                                                         "fresh-process rounds")),
    "tiers_full": (("--full",), dict(
        action="store_true", default=False, help="tiers: the issue's sizes (a 1 GiB "
        "checkpoint, a 96 MiB-parameter loop); default: 256 MiB and 48 MiB")),
    "tiers_size": (("--tiers-size",), dict(default="", help="tiers: the checkpoint size of "
                                           "the blocking and replication rounds")),
    "tiers_rounds": (("--tiers-rounds",), dict(type=int, default=3, help="tiers: alternating "
                                               "rounds")),
    "loop_steps": (("--loop-steps",), dict(type=int, default=120, help="tiers: training steps "
                                           "of each loop variant")),
    "loop_every": (("--loop-every",), dict(type=int, default=20, help="tiers: save every N "
                                           "steps in the loop")),
    "loop_params": (("--loop-params",), dict(type=int, default=0, help="tiers: parameters "
                                             "of the loop's model (default: 4M; --full: 8M)")),
    "rv_tensors": (("--tensors",), dict(type=int, default=8, help="remote-verify: tensors, "
                                        "one file each (a file above 8 MiB is a multi-part "
                                        "upload)")),
    "rv_size": (("--size",), dict(default="1GiB", help="remote-verify: checkpoint size")),
    "rv_backends": (("--backends",), dict(default="s3,gcs", help="remote-verify: "
                                          "comma-separated, of s3 (moto) and gcs (fake-gcs)")),
    "fixed_parts": (("--parts",), dict(default="tiny,load,fresh,inplace", type=_fixed_parts,
                                       help="fixed: which "
                                       "comparisons to run, comma-separated (default: all four)")),
    "fixed_quick": (("--quick",), dict(action="store_true", default=False, help="fixed: every "
                                       "part at tiny sizes and few rounds (a smoke test, in "
                                       "seconds; its figures mean nothing)")),
    "fixed_tiny_rounds": (("--tiny-rounds",), dict(type=int, default=0, help="fixed: rounds of "
                                                   "the tiny save and load (default 40)")),
    "fixed_load_size": (("--load-size",), dict(default="", help="fixed: state of the verified "
                                               "warm load (default 64MiB)")),
    "fixed_load_rounds": (("--load-rounds",), dict(type=int, default=0, help="fixed: rounds of "
                                                   "the warm load (default 15)")),
    "fixed_fresh_size": (("--fresh-size",), dict(default="", help="fixed: state of the fresh-"
                                                 "process load (default 1GiB)")),
    "fixed_fresh_rounds": (("--fresh-rounds",), dict(type=int, default=0, help="fixed: rounds "
                                                     "of fresh processes (default 3)")),
    "fixed_inplace_size": (("--inplace-size",), dict(default="", help="fixed: total state of "
                                                     "the in-place sharded load, 2 ranks "
                                                     "(default 1GiB)")),
    "fixed_inplace_rounds": (("--inplace-rounds",), dict(type=int, default=0, help="fixed: "
                                                         "rounds of the in-place load, one job "
                                                         "per library each (default 3)")),
    "fixed_inplace_loads": (("--inplace-loads",), dict(type=int, default=0, help="fixed: loads "
                                                       "per in-place job: the first, then the "
                                                       "steady state (default 3)")),
    "fixed_skip_fresh": (("--skip-fresh",), dict(action="store_true", default=False,
                                                 help="fixed: leave out the fresh part")),
    "fixed_workdir": (("--workdir",), dict(default="", help="fixed: where checkpoints go "
                                           "(default: a temporary directory under /tmp, "
                                           "removed afterwards)")),
    "scale_quick": (("--quick",), dict(action="store_true", default=False,
                                       help="scale: W in 8,64,256 only")),
    "scale_worlds": (("--worlds",), dict(default="", help="scale: comma-separated world "
                                         "sizes (default 8,64,256,1024,4096)")),
    "scale_mesh": (("--mesh",), dict(default="all", help="scale: comma-separated meshes of "
                                     "fsdp, hsdp, tp (default: all)")),
    "scale_layers": (("--layers",), dict(type=int, default=1, help="scale: decoder layers of "
                                         "the 70B-shaped state")),
    "scale_hsdp_shard": (("--hsdp-shard",), dict(type=int, default=8, help="scale: ranks "
                                                 "per HSDP shard group")),
    "scale_real": (("--real",), dict(default="", metavar="W,W", help="scale: also run real "
                                     "gloo saves at these world sizes and check the "
                                     "simulator against them (alone unless --worlds/--quick)")),
    "scale_shrink": (("--shrink",), dict(type=int, default=64, help="scale: --real divides "
                                         "every dimension by this (a few MB)")),
    "scale_json": (("--json",), dict(default="", metavar="PATH",
                                     help="scale: write the results as JSON")),
    "scale_plot": (("--plot",), dict(default="", metavar="PATH",
                                     help="scale: plot coordinator seconds and metadata read "
                                          "per loading rank against W (PNG)")),
    "only": (("--only",), dict(default="", choices=["", "incremental", "tiers", "fixed"],
                               help="render only "
                               "this section (and its plot) into the existing benchmarks.md, "
                               "leaving the rest of it as it is")),
    "in_process": (("--in-process",), dict(
        action="store_true", default=False, help="run variants in this process (smoke tests; "
        "RSS then less meaningful)")),
    "out": (("--out",), dict(default=".", metavar="DIR", help="where the outputs go: the JSON "
                             "in DIR/results/, the report in DIR/benchmarks.md and DIR/img/ "
                             "(default: the current directory)")),
    "results": (("--results",), dict(default="", metavar="DIR",
                                     help="where the JSON goes (default: OUT/results)")),
    "docs": (("--docs",), dict(default="", metavar="DIR",
                               help="where benchmarks.md and img/ go (default: OUT)")),
    "report": (("--report",), dict(action="store_true", default=False,
                                   help="regenerate the report afterwards")),
    "note": (("--note",), dict(default="", help="a remark stored with the machine description "
                                "(e.g. that other work was running)")),
}
_COMMON = ("out", "results", "docs", "report", "note")
_OWN: dict[str, tuple[str, ...]] = {
    "hash": ("reps", "hash_size", *_COMMON),
    "save": ("reps", "sizes", "full_up_to", "in_process", *_COMMON),
    "interleaved": ("sizes", "interleaved_reps", *_COMMON),
    "s3": ("reps", "s3_sizes", "s3_reps", "in_process", *_COMMON),
    "latest": ("reps", "counts", "s3_max", *_COMMON),
    "fresh": ("fresh_size", "fresh_rounds", "baseline", *_COMMON),
    "incremental": ("incr_full", "incr_base", "incr_rounds", "retention_base", "retention_saves",
                    "retention_without_gc", "incr_s3_base", "incr_s3_rounds", "incr_fresh_rounds",
                    *_COMMON),
    "tiers": ("tiers_full", "tiers_size", "tiers_rounds", "loop_steps", "loop_every",
              "loop_params", *_COMMON),
    "remote-verify": ("rv_size", "rv_backends", "rv_tensors", *_COMMON),
    "fixed": (*(d for d in _OPTIONS if d.startswith("fixed_")), *_COMMON),
    "scale": ("scale_quick", "scale_worlds", "scale_mesh", "scale_layers", "scale_hsdp_shard",
              "scale_real", "scale_shrink", "scale_json", "scale_plot"),
    "all": tuple(d for d in _OPTIONS
                 if not d.startswith(("tiers_", "rv_", "scale_", "fixed_"))),
    "report": ("out", "results", "docs", "only"),
}


def add_arguments(p: argparse.ArgumentParser, command: str = "all", *,
                  common: bool = True) -> None:
    """The options of ``ckptfs bench COMMAND`` only; the others still get their defaults (so
    `run_question` reads every attribute), they are just not offered.  ``common=False``: not
    the output options either (``--out``, ``--results``, ``--docs``, ``--report``, ``--note``:
    a script that writes its own outputs)."""
    own = tuple(d for d in _OWN[command] if common or d not in _COMMON)
    for dest, (flags, kw) in _OPTIONS.items():
        if dest in own:
            p.add_argument(*flags, dest=dest, **kw)
    p.set_defaults(**{d: kw["default"] for d, (_, kw) in _OPTIONS.items() if d not in own})


def add_subcommands(subparsers: Any) -> None:
    """``ckptfs bench {hash,save,interleaved,s3,latest,fresh,incremental,fixed,scale,all,
    report}``."""
    p = subparsers.add_parser("bench", help="run the benchmarks (see docs/benchmarks.md)")
    sub = p.add_subparsers(dest="bench_command", required=True)
    helps = {"hash": "hashing throughput of every algorithm",
             "save": "save/load on local disk against torch.save, safetensors and DCP",
             "interleaved": "the save targets with the variants interleaved run by run",
             "s3": "save/load on a moto S3 server against raw s3fs",
             "latest": "cost of resolving latest vs number of checkpoints",
             "fresh": "import + first save/load in a fresh process, and steady state, "
                      "against DCP, torch.save and (--baseline) another checkout",
             "incremental": "incremental saves (format v3): bytes written and time per save "
                            "against full saves and DCP (LoRA-like, RL-like, full fine-tuning, "
                            "keep_last=5 retention, S3, a fresh process)",
             "tiers": "two tiers (local disk + moto S3): blocking time against a local-only "
                      "save, replication against ckptfs cp, lag and throughput of a training "
                      "loop",
             "fixed": "the fixed costs: a tiny state's save and load, a verified 64 MiB load, a "
                      "fresh process's verified 1 GiB load, the in-place sharded load at 2 "
                      "ranks, each against DCP and torch.save/torch.load, interleaved",
             "remote-verify": "verify --remote of a checkpoint against a full verify on S3 "
                              "(moto) and GCS (fake-gcs): requests, bytes read, time",
             "scale": "simulated sharded saves and loads at 8 to 4,096 ranks: ckptfs's "
                      "coordinator, metadata and per-rank load beside DCP's planners "
                      "(--real: checked against real gloo jobs)",
             "all": "everything, then the report",
             "report": "regenerate benchmarks.md and img/ from the JSON"}
    for name, text in helps.items():
        q = sub.add_parser(name, help=text)
        add_arguments(q, name)
        q.set_defaults(func=cmd_scale if name == "scale" else cmd_bench)


def main_fixed_costs(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.fixed_costs``: the options of ``ckptfs bench fixed`` and
    ``--json PATH``; prints the results (`ckptfs.bench.fixed.print_report`), writes only
    ``--json``."""
    from ckptfs.bench.fixed import __doc__ as about
    from ckptfs.bench.fixed import run_args

    ap = argparse.ArgumentParser(prog="python -m benchmarks.fixed_costs",
                                 description=(about or "").split("\n\n")[0])
    add_arguments(ap, "fixed", common=False)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    results = run_args(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    """``ckptfs bench scale``: prints its tables, writes only ``--json`` (not ``--out``)."""
    from ckptfs.bench.scale import main_scale

    return main_scale(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckptfs-bench")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))


def _worker_main(argv: Sequence[str]) -> int:
    from ckptfs.bench.variants import run_worker

    spec = json.loads(argv[0])
    result = run_worker(spec)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        sys.exit(_worker_main(sys.argv[1:]))
    sys.exit(main())
