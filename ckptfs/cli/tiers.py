"""``ckptfs replicate LOCAL REMOTE``: finish the replication a two-tier job left undone
(docs/tiers.md, docs/cli.md).  ``ckptfs ls LOCAL --remote REMOTE`` (both tiers side by side) is
``ls`` in `ckptfs.cli.core`.

``replicate`` opens the two tiers as the job did (`ckptfs.tiered`: every step committed
locally and not at the remote is queued, oldest first), says what it will copy, and waits while
the replicator copies it with ``ckptfs cp``'s copy (every byte verified, marker last), showing
progress in bytes and steps.  Exit 0 when every locally committed step is committed at the
remote; 1 when a step failed for good (a corrupt local copy, another checkpoint of the step at
the remote) or ``--timeout`` ran out (an outage: the replicator retries until then); 2 for bad
usage or a tier that cannot be opened.  ``--dry-run`` says what would be copied, what is
already there (the same content) and which steps differ at the remote (another checkpoint of
that step number: replicate would fail them, exit 1, and so does the dry run).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from ckptfs.cli.core import (
    EXIT_FAILED,
    EXIT_OK,
    emit,
    int_option,
    option_pair,
    parse_options,
    seconds_option,
)
from ckptfs.errors import CkptfsError, ReplicationError, StorageError
from ckptfs.format.content import same_content

# The protocol (and torch, which it imports) is imported by the verb when it runs, not with
# this module: ``ckptfs replicate --help`` imports neither.
if TYPE_CHECKING:
    from ckptfs.protocol.replication import ReplicationStatus
    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.protocol.tiers import TieredStore

#: How often the progress is refreshed while waiting (seconds).
POLL_S = 0.25


def _quiet(args: argparse.Namespace) -> bool:
    return bool(args.quiet or args.json)


def _say(args: argparse.Namespace, text: str) -> None:
    """A progress line on stderr (stdout keeps the result, or the JSON)."""
    if not _quiet(args):
        print(text, file=sys.stderr, flush=True)


def _bytes_per_s(text: str) -> float:
    """argparse ``type`` of ``--bytes-per-s``: a positive number, with an optional K/M/G
    (binary) suffix: ``50M`` is 50 MiB/s."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r:.40} is not a rate (e.g. 104857600 or "
                                         "100M)") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r:.40} must be a positive rate")
    return value


def _plan(store: TieredStore) -> tuple[list[int], list[int], int]:
    """(steps to replicate, steps already at the remote, their bytes) as queued at open."""
    status = store.replication()
    todo = sorted(s for s, r in status.steps.items() if r.state != "replicated")
    done = sorted(s for s, r in status.steps.items() if r.state == "replicated")
    return todo, done, sum(status.steps[s].bytes for s in todo)


def _rows(status: ReplicationStatus, steps: list[int]) -> list[dict[str, Any]]:
    rows = []
    for s in steps:
        r = status.steps.get(s)
        if r is None:  # deleted locally meanwhile (dropped from the queue)
            rows.append({"step": s, "state": "gone"})
            continue
        rows.append({"step": s, "state": r.state, "bytes": r.bytes,
                     "copied_bytes": r.copied_bytes, "attempts": r.attempts, "error": r.error})
    return rows


def cmd_replicate(args: argparse.Namespace) -> int:
    from ckptfs.protocol.store import open as open_store
    from ckptfs.protocol.tiers import tiered

    shared = parse_options(args.option)
    local_options = {**shared, **parse_options(args.local_option)}
    remote_options = {**shared, **parse_options(args.remote_option)}
    if args.dry_run:
        return _dry_run(args, open_store(args.local, **local_options),
                        open_store(args.remote, **remote_options))
    store = tiered(args.local, args.remote, local_options=local_options,
                   remote_options=remote_options, replicate_threads=args.threads,
                   bytes_per_s=args.bytes_per_s, max_attempts=args.max_attempts)
    try:
        return _replicate(args, store)
    finally:
        store.close()


def _dry_run(args: argparse.Namespace, local: CheckpointStore, remote: CheckpointStore) -> int:
    """What ``replicate`` would do, decided as it decides: a step committed at the remote is
    "already there" only if the remote's copy has the local copy's content (the rule of the
    store's open-time scan and of the copy, `same_content`); one with other content (another
    run's step of that number) is reported as differing: ``replicate`` would fail it
    (CheckpointExistsError), never overwrite it, and exit 1, so the dry run exits 1 too."""
    from ckptfs.protocol.resolve import committed_steps
    from ckptfs.protocol.tiers import check_tiers

    check_tiers(local, remote)
    at_remote = set(committed_steps(remote.storage))
    steps = committed_steps(local.storage)
    todo = [s for s in steps if s not in at_remote]
    already: list[int] = []
    differs: list[int] = []
    for s in steps:
        if s in at_remote:
            try:
                same = same_content(local.info(s).manifest, remote.info(s).manifest)
            except CkptfsError:  # a copy that cannot be read: the copy would fail it
                same = False
            (already if same else differs).append(s)
    size = sum(local.info(s).bytes for s in todo)
    text = (f"would replicate {len(todo)} checkpoint(s) ({size} B) from {local.url} to "
            f"{remote.url}: {todo}" if todo else
            f"nothing to copy from {local.url} to {remote.url}")
    if differs:
        text += (f"\nstep(s) {differs} differ: {remote.url} holds another checkpoint of that "
                 "step number (other content, or a copy that cannot be read); replicate would "
                 "report them failed (never overwriting them) and exit 1")
    elif not todo:
        text = f"nothing to replicate: every checkpoint at {local.url} is at {remote.url}"
    if already and (todo or differs):
        text += f"\nalready there (same content): {already}"
    emit(args, {"local": local.url, "remote": remote.url, "dry_run": True,
                "replicate": todo, "already": already, "differs": differs, "bytes": size},
         text)
    return EXIT_FAILED if differs else EXIT_OK


def _replicate(args: argparse.Namespace, store: TieredStore) -> int:
    from ckptfs.cli.tools import progress_bar

    todo, done, total = _plan(store)
    remote = store.remote.url
    _say(args, f"replicating {len(todo)} checkpoint(s) ({total} B) from {store.url} to "
         f"{remote}: {todo}" + (f"; already there: {done}" if done else "")
         if todo else f"nothing to replicate: every checkpoint at {store.url} is at {remote}")
    t0 = time.monotonic()
    deadline = None if args.timeout is None else t0 + args.timeout
    error: str | None = None
    reported: set[int] = set()
    with progress_bar(args, total, "replicate") as bar:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                store.wait_replicated(timeout=POLL_S if left is None else
                                      max(0.0, min(POLL_S, left)))
                finished = True
            except TimeoutError:
                finished = False
                if left is not None and left <= POLL_S:
                    lag = store.replication()
                    error = (f"{lag.lag_steps} checkpoint(s) ({lag.lag_bytes} B) not at "
                             f"{remote} after --timeout {args.timeout:g} s"
                             + (f" (last error: {lag.outage})" if lag.outage else "")
                             + "; run 'ckptfs replicate' again once the remote is reachable "
                             "(an interrupted upload is never committed; "
                             f"'ckptfs gc {remote}' removes it)")
            except ReplicationError as exc:
                finished = True
                error = str(exc)
            status = store.replication()
            bar.update(sum(status.steps[s].copied_bytes for s in todo
                           if s in status.steps) - bar.n)
            for s in todo:
                r = status.steps.get(s)
                if r is not None and r.state in ("replicated", "failed") and s not in reported:
                    reported.add(s)
                    _say(args, f"step {s}: {r.state} ({r.copied_bytes} B copied"
                         + (f"; {r.error}" if r.error else "") + f"), {len(reported)}/"
                         f"{len(todo)} steps")
            if finished or error is not None:
                break
    status = store.replication()
    rows = _rows(status, todo)
    tiers: dict[str, list[int]] = {}
    if error is None:
        try:
            tiers = store.tier_steps()
        except StorageError as exc:
            error = f"cannot list the tiers after replicating: {exc}"
        else:
            error = _check_tiers(store, tiers)
    seconds = time.monotonic() - t0
    copied = sum(r.get("copied_bytes", 0) for r in rows)
    ok = error is None
    emit(args, {"local": store.url, "remote": remote, "ok": ok, "replicate": todo,
                "already": done, "steps": rows, "bytes": total, "copied_bytes": copied,
                "seconds": round(seconds, 3), "error": error,
                "tiers": tiers},
         (f"OK: {len(todo)} checkpoint(s) replicated to {remote} ({copied} B copied in "
          f"{seconds:.1f} s); every checkpoint at {store.url} is at the remote") if ok else
         f"FAILED: {sum(r['state'] == 'replicated' for r in rows)} of {len(todo)} "
         "checkpoint(s) replicated (the error is on stderr)")
    if not ok:
        print(f"ckptfs: error: {error}", file=sys.stderr)
    return EXIT_OK if ok else EXIT_FAILED


def _check_tiers(store: TieredStore, tiers: dict[str, list[int]]) -> str | None:
    """Why the remote does not hold every local checkpoint, or None.  (A step committed there
    with other content is never counted as replicated: the store compares content at open and
    the copy fails it, CheckpointExistsError, so it is reported as failed.)"""
    missing = sorted(set(tiers["local"]) - set(tiers["remote"]))
    if missing:
        return (f"steps {missing} are committed at {store.url} but not at {store.remote.url} "
                "(committed locally while this command ran?); run 'ckptfs replicate' again")
    return None


def add_subcommands(sub: Any) -> None:
    p = sub.add_parser("replicate", help="copy every checkpoint of a local tier that the remote "
                       "tier lacks (finish a two-tier job's replication)")
    p.add_argument("local", help="the local tier's run root URL (or path)")
    p.add_argument("remote", help="the remote tier's run root URL")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   type=option_pair, help="storage option for both tiers (repeatable)")
    p.add_argument("--local-option", action="append", default=[], metavar="KEY=VALUE",
                   type=option_pair, help="storage option for the local tier only")
    p.add_argument("--remote-option", action="append", default=[], metavar="KEY=VALUE",
                   type=option_pair, help="storage option for the remote tier only")
    p.add_argument("--timeout", type=seconds_option, default=None, metavar="SECONDS",
                   help="give up (exit 1) if not everything is at the remote by then; the "
                   "default waits (and retries through an outage) until it is")
    p.add_argument("--bytes-per-s", type=_bytes_per_s, default=None, metavar="RATE",
                   help="bandwidth bound, bytes per second (K/M/G suffixes: 100M)")
    p.add_argument("--threads", type=int_option(1, 256), default=2,
                   help="files copied at once (default 2; memory: ~8 MiB each)")
    p.add_argument("--max-attempts", type=int_option(1, 1_000_000), default=None,
                   help="give a step up after this many failed attempts (default: retry "
                   "until --timeout)")
    p.add_argument("--dry-run", action="store_true", help="only say what would be replicated "
                   "(exit 1 if a step differs at the remote: replicate would fail it)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_replicate)
