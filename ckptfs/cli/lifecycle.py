"""``ckptfs prune``, ``ckptfs gc`` and ``ckptfs best``: the lifecycle subcommands.

``prune`` applies a retention policy to a run root from outside the training job (the running
best pool and the step the run last resumed from, both read from the store, are always kept);
``gc`` removes what crashed writers left behind after a grace period; ``best`` shows the running
best record.  All take ``--json``; ``--dry-run`` shows what would be removed.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

from ckptfs.cli.core import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    add_store_args,
    emit,
    int_option,
    open_from_args,
    step_option,
)
from ckptfs.format.layout import MAX_STEP

# The lifecycle modules (and torch, which they import) are imported by the verbs when they
# run, not with this module: ``ckptfs gc --help`` imports none of them.


def grace_option(text: str) -> timedelta:
    """argparse ``type`` of ``--older-than``: a duration of more than zero (a zero grace would
    remove the attempt of a writer that is saving right now)."""
    from ckptfs.lifecycle.gc import InvalidDurationError, parse_duration

    try:
        grace = parse_duration(text)
    except InvalidDurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if grace <= timedelta(0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is zero: the attempt of a writer saving right now would be removed; give "
            "the longest save plus clock skew, e.g. 1h (at least 1s)")
    return grace


def _protected_from_latest(store: Any) -> list[int]:
    """The step the run last resumed from (recorded by the manager in the newest checkpoint)
    and the steps its manager was told to protect."""
    info = store.latest()
    if info is None:
        return []
    life = info.metadata.get("lifecycle")
    if not isinstance(life, dict):
        return []
    out = [s for s in life.get("protected") or [] if isinstance(s, int)]
    if isinstance(life.get("resumed_from"), int):
        out.append(life["resumed_from"])
    return sorted(set(out))


def cmd_prune(args: argparse.Namespace) -> int:
    if args.keep_last is None and args.keep_every is None:
        print("ckptfs prune: give --keep-last and/or --keep-every")
        return EXIT_USAGE
    from ckptfs.lifecycle.artifacts import SideOutputs
    from ckptfs.lifecycle.retention import RetentionPolicy, best_steps_of, prune, read_best

    store = open_from_args(args)
    # --keep-every alone keeps only the milestones (and the newest, always kept)
    policy = RetentionPolicy(args.keep_last if args.keep_last is not None else 1,
                             args.keep_every)
    best = best_steps_of(read_best(store))  # a malformed record raises: nothing is deleted
    protected = sorted(set(_protected_from_latest(store)) | set(args.protect or []))
    if not args.dry_run:
        SideOutputs(store).reconcile()
    report = prune(store, policy, best=best, protected=protected, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    steps = report.plan.delete if args.dry_run else report.deleted
    lines = [f"{verb} {len(steps)} checkpoint(s): {steps if steps else '-'}"]
    lines += [f"  keep {s}: {', '.join(why)}" for s, why in sorted(report.plan.keep.items())]
    lines += [f"  already deleted by another process: {s}" for s in report.already_gone]
    lines += [f"  FAILED {s}: {e}" for s, e in sorted(report.errors.items())]
    if report.refused:
        lines.append(f"REFUSED: {report.refused}")
    emit(args, {"url": store.url, **report.as_dict()}, "\n".join(lines))
    return EXIT_FAILED if report.errors or report.refused else EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    grace = args.older_than
    if isinstance(grace, str):  # the default, not passed through the option's type
        grace = grace_option(grace)
    from ckptfs.lifecycle.gc import collect

    store = open_from_args(args)
    report = collect(store.storage, older_than=grace, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    items = report.items if args.dry_run else [i for i in report.items if i.removed]
    size = report.bytes_found if args.dry_run else report.bytes_freed
    lines = [f"{verb} {len(items)} item(s), {size} bytes (grace {grace})"]
    lines += [f"  {i.kind:10} {i.path}  {i.bytes} bytes" for i in items]
    lines += [f"  {i.kind:10} {i.path}: {i.note}" for i in report.items if i.note]
    lines += [f"  kept (younger than grace): {p}" for p in report.kept_young]
    lines += [f"  kept (retired: referenced by checkpoints): {i.path}  {i.bytes} bytes"
              for i in report.retired]
    lines += [f"  skipped: {s}" for s in report.skipped]
    lines += [f"  FAILED {i.path}: {i.error}" for i in report.items if i.error]
    emit(args, report.as_dict(), "\n".join(lines))
    return EXIT_FAILED if any(i.error for i in report.items) else EXIT_OK


def cmd_best(args: argparse.Namespace) -> int:
    from ckptfs.lifecycle.retention import read_best

    store = open_from_args(args)
    doc = read_best(store)
    if doc is None:
        emit(args, {"url": store.url, "best": None}, f"no best record at {store.url}")
        return EXIT_FAILED
    committed = set(store.steps())
    pool = [dict(e, committed=e["step"] in committed) for e in doc.get("pool") or []]
    head = (f"{doc.get('metric')} ({doc.get('mode')}, keep {doc.get('keep')}): high-water "
            f"{doc.get('high_water')}")
    lines = [head] + [f"  step {e['step']}: {e['value']}"
                      + ("" if e["committed"] else "  (no committed checkpoint)")
                      for e in reversed(pool)]
    emit(args, {"url": store.url, "best": {**doc, "pool": pool}}, "\n".join(lines))
    return EXIT_OK


def add_subcommands(sub: Any) -> None:
    p = sub.add_parser("prune", help="delete checkpoints outside a retention policy")
    add_store_args(p)
    p.add_argument("--keep-last", type=int_option(1, MAX_STEP + 1), default=None, metavar="N",
                   help="keep the N newest committed checkpoints (N >= 1)")
    p.add_argument("--keep-every", type=int_option(1, MAX_STEP), default=None, metavar="K",
                   help="keep every step divisible by K")
    p.add_argument("--protect", type=step_option, action="append", metavar="STEP",
                   help="never delete this step (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="show what would be deleted")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("gc", help="remove uncommitted attempts and leftovers older than a grace "
                       "period")
    add_store_args(p)
    p.add_argument("--older-than", type=grace_option, default="1h", metavar="DURATION",
                   help="grace period, e.g. 30m, 1h, 2d (default 1h): a running writer's "
                   "attempt is younger and survives")
    p.add_argument("--dry-run", action="store_true", help="show what would be removed")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("best", help="show the running-best record")
    add_store_args(p)
    p.set_defaults(func=cmd_best)
