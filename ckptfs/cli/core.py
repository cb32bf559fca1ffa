"""The ``ckptfs`` command.

Core subcommands live here (``ls``, ``latest``, ``verify``); feature modules add theirs through
an ``add_subcommands(subparsers)`` function (listed in ``_PLUGINS``), so this file stays small.
Every subcommand but ``bench`` takes ``--json`` and exits non-zero on failure: 1 for a failed
check (corrupt, missing, nothing at the URL), 2 for bad usage or an unreachable store, 3 from
``verify --remote`` alone (no mismatch, but the store could not vouch for every file).  A
mistyped verb or option gets the close matches (`SuggestingParser`); a plug-in whose optional
dependency is missing still shows its verb, which says what to install (`_missing_extra`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import ckptfs
from ckptfs.errors import (
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    StorageNotFoundError,
)
from ckptfs.format.incremental import references_of
from ckptfs.format.layout import MAX_STEP, parse_step_dir

if TYPE_CHECKING:
    from ckptfs.protocol.store import CheckpointStore

#: The modules that add verbs (``add_subcommands``), each with its verbs and the extra that
#: installs what it imports beyond the core dependencies (None: it needs none).  A plug-in is
#: imported only when one of its verbs runs (or shows its ``--help``): ``ckptfs --help`` lists
#: its verbs with their `VERB_HELP` lines, ``ckptfs --version`` imports none of them (none
#: imports torch; tests/cli/test_cli_startup.py keeps the two in step).
_PLUGINS: tuple[tuple[str, tuple[str, ...], str | None], ...] = (
    ("ckptfs.cli.doctor", ("doctor",), None),
    ("ckptfs.cli.lifecycle", ("prune", "gc", "best"), None),
    ("ckptfs.cli.inspection", ("inspect",), None),
    ("ckptfs.cli.tools", ("cp", "export"), None),
    ("ckptfs.cli.tiers", ("replicate",), None),
    ("ckptfs.bench.cli", ("bench",), "bench"),
)

#: The one-line help ``ckptfs --help`` shows for a plug-in's verb without importing it (the
#: same text as the verb's own ``add_parser(help=...)``).
VERB_HELP: dict[str, str] = {
    "doctor": "check that a store gives the guarantees ckptfs relies on",
    "prune": "delete checkpoints outside a retention policy",
    "gc": "remove uncommitted attempts and leftovers older than a grace period",
    "best": "show the running-best record",
    "inspect": "show a checkpoint's keys, dtypes, shapes and sizes without reading tensor "
               "bytes",
    "cp": "copy committed checkpoints to another URL (verified, marker last)",
    "export": "write one step as a .safetensors file, a .pt file, or Hugging Face sharded "
              "safetensors (--format hf)",
    "replicate": "copy every checkpoint of a local tier that the remote tier lacks (finish a "
                 "two-tier job's replication)",
    "bench": "run the benchmarks (see docs/benchmarks.md)",
}

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: ``verify --remote``: no mismatch, but the store could not vouch for every file.
EXIT_INCOMPLETE = 3


class UsageError(CkptfsError, ValueError):
    """A command-line value that is not acceptable (exit status 2)."""


def seconds_option(text: str) -> float:
    """An argparse ``type`` for a positive, finite number of seconds (a usage error, exit 2,
    otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r:.40} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r:.40} must be a positive number of seconds")
    return value


def int_option(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in ``[lo, hi]``: anything else is a usage error
    (exit 2) whose message names the option, never a traceback."""
    def integer(text: str) -> int:
        t = text.strip()
        if not re.fullmatch(r"[+-]?[0-9]+", t):
            raise argparse.ArgumentTypeError(f"{text!r:.40} is not an integer")
        if len(t.lstrip("+-").lstrip("0")) > len(str(max(abs(lo), abs(hi)))):
            raise argparse.ArgumentTypeError(f"{t[:20]}... is out of range [{lo}, {hi}]")
        value = int(t)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range [{lo}, {hi}]")
        return value

    return integer


#: ``--step`` and other step numbers
step_option = int_option(0, MAX_STEP)


def option_pair(text: str) -> str:
    """argparse ``type`` of ``-o key=value``."""
    if "=" not in text or not text.split("=", 1)[0]:
        raise argparse.ArgumentTypeError(f"storage option {text!r:.60} must look like key=value")
    return text


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``-o key=value`` storage options; values parsed as JSON when they parse, else str."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UsageError(f"storage option {pair!r} must look like key=value")
        key, value = pair.split("=", 1)
        try:
            out[key] = json.loads(value)
        except (ValueError, RecursionError):
            out[key] = value
    return out


def add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="run root URL (file://, memory://, s3://, gs://, az://, or a path)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   type=option_pair,
                   help="storage option passed to fsspec (repeatable), e.g. "
                   "-o endpoint_url=http://127.0.0.1:9000")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def open_from_args(args: argparse.Namespace) -> CheckpointStore:
    from ckptfs.protocol.store import open as open_store

    return open_store(args.url, **parse_options(args.option))


def emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2, sort_keys=True, default=str))
    else:
        print(text)


def _info_dict(info: Any) -> dict[str, Any]:
    return {"step": info.step, "attempt": info.attempt, "url": info.url,
            "created": info.created, "files": len(info.manifest.files),
            "bytes": info.total_bytes, "hash_algorithm": info.manifest.hash_algorithm}


def cmd_ls(args: argparse.Namespace) -> int:
    store = open_from_args(args)
    if args.remote is not None:
        return _ls_tiers(args, store)
    if not store.storage.exists(""):
        hint = bucket_hint(args.url)
        emit(args, {"url": store.url, "exists": False, "checkpoints": [],
                     **({"hint": hint} if hint else {})},
             f"nothing at {store.url}: no such directory or prefix"
             + (f"\n{hint}" if hint else ""))
        return EXIT_FAILED
    rows, usage = _ls_rows(store)
    lines = [_ls_line(r) for r in rows]
    if rows:
        lines.append(f"stored {usage.stored_bytes} bytes (committed checkpoints"
                     + (f" and {len(usage.retired)} retired attempt(s) they reference)"
                        if usage.retired else ")"))
    emit(args, {"url": store.url, "checkpoints": rows, "stored_bytes": usage.stored_bytes,
                "retired": usage.retired},
         "\n".join(lines) if lines else f"no checkpoints at {store.url}")
    return EXIT_OK


#: A bucket or container name (S3's rules, which GCS's and Azure's names also follow).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def bucket_hint(url: str) -> str | None:
    """For a plain relative path whose first component exists neither here nor as a local
    directory and looks like a bucket name (``mybucket/runs/x``): what was probably meant.
    A path without a scheme is a local path; a bucket needs ``s3://``, ``gs://`` or
    ``az://``."""
    if "://" in url or os.path.isabs(url) or url.startswith(("~", ".")):
        return None
    head, sep, _ = url.partition("/")
    if not sep or not _BUCKET.fullmatch(head) or os.path.exists(head):
        return None
    return (f"a path without a scheme is a local path: did you mean s3://{url} "
            f"(or gs://{url}, az://{url})?")


def _ls_tiers(args: argparse.Namespace, local: CheckpointStore) -> int:
    """``ls LOCAL --remote REMOTE``: per step, the tiers where it is committed (``local``,
    ``remote``, ``both``; ``none`` for a step incomplete in each tier that has it) and each
    tier's row as ``ls`` shows it."""
    from ckptfs.protocol.store import open as open_store
    from ckptfs.storage.base import check_tier_roots

    remote = open_store(args.remote, **parse_options(args.remote_option))
    check_tier_roots(local.storage, remote.storage)  # the same root twice: all "both"
    merged: dict[int, dict[str, Any]] = {}
    stored: dict[str, int] = {}
    for tier, st in (("local", local), ("remote", remote)):
        rows, usage = _ls_rows(st)
        stored[tier] = usage.stored_bytes
        for r in rows:
            merged.setdefault(r["step"], {"step": r["step"], "local": None,
                                          "remote": None})[tier] = r
    for m in merged.values():
        where = [t for t in ("local", "remote") if m[t] is not None and m[t]["committed"]]
        m["where"] = "both" if len(where) == 2 else where[0] if where else "none"
    steps = [merged[s] for s in sorted(merged)]
    lines = [f"{m['step']:>12}  {m['where']:<6}  local: {_tier_cell(m['local'])}  "
             f"remote: {_tier_cell(m['remote'])}" for m in steps]
    lines.append(f"stored {stored['local']} bytes at {local.url}, {stored['remote']} bytes at "
                 f"{remote.url}")
    emit(args, {"local": local.url, "remote": remote.url, "checkpoints": steps,
                "stored_bytes": stored}, "\n".join(lines))
    return EXIT_OK


def _tier_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if "error" in row:
        return f"UNREADABLE ({row['error']})"
    if not row["committed"]:
        return "retired" if row.get("retired") else "incomplete"
    return f"{row['bytes']} B" if "bytes" in row else "committed"


def _ls_rows(store: CheckpointStore) -> tuple[list[dict[str, Any]], Any]:
    """The rows of ``ls`` (committed and incomplete steps, ascending) and the run's usage."""
    from ckptfs.protocol.references import run_usage

    committed = store.steps()
    everything = store.all_steps()
    usage = run_usage(store.storage)
    sizes = {c.step: c for c in usage.checkpoints}
    incomplete = sorted(set(everything) - set(committed))
    rows: list[dict[str, Any]] = []
    for s in committed:
        row: dict[str, Any] = {"step": s, "committed": True}
        c = sizes.get(s)
        if c is not None:
            row.update(attempt=c.attempt, bytes=c.bytes, bytes_written=c.bytes_written,
                       exclusive_bytes=c.exclusive_bytes)
        elif s in usage.unreadable:
            row["error"] = usage.unreadable[s]
        rows.append(row)
    retired = {parse_step_dir(p.split("/")[1]) for p in usage.retired}
    rows += [{"step": s, "committed": False, **({"retired": True} if s in retired else {})}
             for s in incomplete]
    rows.sort(key=lambda r: r["step"])
    return rows, usage


def _ls_line(row: dict[str, Any]) -> str:
    state = "committed" if row["committed"] else "retired" if row.get("retired") \
        else "incomplete"
    head = f"{row['step']:>12}  {state}"
    if "error" in row:
        return f"{head}  UNREADABLE: {row['error']}"
    if "bytes" not in row:
        return head
    only = row["exclusive_bytes"]
    return (f"{head}  {row['bytes']:>14} B  written {row['bytes_written']} B  "
            f"frees {'?' if only is None else only} B")


def cmd_latest(args: argparse.Namespace) -> int:
    store = open_from_args(args)
    info = store.latest(allow_rollback=args.allow_rollback)
    if info is None:
        hint = bucket_hint(args.url)
        emit(args, {"url": store.url, "latest": None, **({"hint": hint} if hint else {})},
             f"no committed checkpoint at {store.url}" + (f"\n{hint}" if hint else ""))
        return EXIT_FAILED
    emit(args, {"url": store.url, "latest": _info_dict(info)},
         f"step {info.step}  {info.url}  ({info.total_bytes} bytes, {info.created})")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from ckptfs.protocol.formats import verify_checkpoint

    store = open_from_args(args)
    info = store.latest() if args.step is None else store.info(args.step)
    if info is None:
        raise CheckpointNotFoundError(f"no committed checkpoint at {store.url}")
    if args.remote:
        return _verify_remote(args, store, info)
    report = verify_checkpoint(store.storage, info, quick=args.quick, threads=store.threads)
    refs = references_of(info.manifest)
    ref_bytes = sum(c.length for r in refs for c in r.chunks)
    own = f"{report.files} files, {report.bytes} bytes"
    if refs:  # an incremental step: what it uses of earlier checkpoints is checked too
        how = "present with their sizes" if args.quick else "re-read and re-hashed"
        own = (f"its own {own}; {len(refs)} referenced file(s) of earlier checkpoints, "
               f"{ref_bytes} bytes used of them, {how}")
    text = (f"OK: step {info.step} ({report.mode}: {own})"
            if report.ok else f"FAILED: step {info.step} ({report.mode}):\n  "
            + "\n  ".join(report.problems))
    emit(args, {**report.as_dict(), "referenced_files": len(refs),
                "referenced_bytes": ref_bytes}, text)
    return EXIT_OK if report.ok else EXIT_FAILED


def _verify_remote(args: argparse.Namespace, store: Any, info: Any) -> int:
    from ckptfs.errors import RemoteChecksumMismatchError
    from ckptfs.protocol.remote_verify import RemoteVerifyReport, verify_remote

    try:
        report = verify_remote(store.storage, info)
    except RemoteChecksumMismatchError as exc:
        if not isinstance(exc.report, RemoteVerifyReport):  # pragma: no cover
            raise
        report = exc.report
    lines = [f"  {f.status}: {f.path} ({f.detail})" for f in report.files]
    head = ("FAILED" if not report.ok else "OK" if report.complete else "INCOMPLETE")
    refs = references_of(info.manifest)
    ref_steps = sorted({r.step for r in refs})
    if refs:  # its own files only: a referenced file is checked with the step that holds it
        lines.append(f"  {len(refs)} referenced file(s) of earlier checkpoints not checked "
                     "here: run verify --remote --step N for step(s) "
                     + ", ".join(map(str, ref_steps)))
    text = (f"{head}: step {info.step} (remote: {report.count('match')} match, "
            f"{report.count('mismatch')} mismatch, {report.count('not available')} not "
            f"available; {report.requests} metadata requests, no data read)\n"
            + "\n".join(lines))
    emit(args, {**report.as_dict(), "referenced_files": len(refs),
                "referenced_steps": ref_steps}, text)
    return EXIT_FAILED if not report.ok else EXIT_OK if report.complete else EXIT_INCOMPLETE


class SuggestingParser(argparse.ArgumentParser):
    """An argument parser whose errors name the close matches of a mistyped verb or choice
    (``ckptfs lss`` -> did you mean 'ls'?); the verbs' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m and "did you mean" not in message and "maybe you meant" not in message:
            choices = [c.strip(" '\"") for c in m.group(2).split(",")]
            close = difflib.get_close_matches(m.group(1), choices, n=3, cutoff=0.6)
            if close:
                message += "; did you mean " + " or ".join(repr(c) for c in close) + "?"
        super().error(message)


def _suggest_options(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``unrecognized arguments: ...`` with the options of ``parser`` close to each one."""
    known = [o for a in parser._actions for o in a.option_strings]
    parts = []
    for extra in extras:
        close = (difflib.get_close_matches(extra.split("=", 1)[0], known, n=3, cutoff=0.6)
                 if extra.startswith("-") else [])
        parts.append(extra + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    return "unrecognized arguments: " + " ".join(parts)


def _chosen_parser(parser: argparse.ArgumentParser,
                   args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)verb ``args`` ran: ``ckptfs bench hash`` -> bench hash's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and action.dest:
            name = getattr(args, action.dest, None)
            chosen = action.choices.get(name) if isinstance(name, str) else None
            if isinstance(chosen, argparse.ArgumentParser):
                return _chosen_parser(chosen, args)
    return parser


def _missing_extra(sub: Any, verbs: Sequence[str], extra: str | None,
                   exc: ModuleNotFoundError) -> None:
    """The verbs of a plug-in that cannot be imported because a package it needs is not
    installed: each still exists (in ``ckptfs --help`` too) and says what to install."""
    need = (f'pip install "ckptfs[{extra}]"' if extra else f"pip install {exc.name}")
    why = f"it needs {exc.name}, which is not installed: {need}"

    def run(args: argparse.Namespace) -> int:
        raise UsageError(f"ckptfs {args.command}: {why}")

    for verb in verbs:
        p = sub.add_parser(verb, help=f"(not available: {why})", description=why,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=run, takes_anything=True)  # whatever follows: the same answer


def _add_stub(sub: Any, verb: str) -> None:
    """A plug-in's verb in ``ckptfs --help`` without importing the plug-in: if argparse ever
    picks it (`main` loads the plug-in of the verb it finds first in the arguments), `main`
    parses again with every plug-in loaded."""
    p = sub.add_parser(verb, help=VERB_HELP.get(verb, f"see ckptfs {verb} --help"),
                       add_help=False)
    p.set_defaults(stub=True, takes_anything=True)


def build_parser(load: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``ckptfs`` parser.  ``load``: the verbs whose plug-ins are imported (their verbs
    get their real parsers; the others are listed, `_add_stub`); None imports every plug-in
    (every verb's parser, as the tests enumerate them)."""
    parser = SuggestingParser(
        prog="ckptfs", description="Crash-consistent PyTorch checkpoints on any fsspec storage.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what ckptfs does")
    parser.add_argument("--version", action="version", version=f"ckptfs {ckptfs.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ls", help="list checkpoints (committed and incomplete)")
    add_store_args(p)
    p.add_argument("--remote", default=None, metavar="URL",
                   help="a two-tier run's remote tier: show, per step, where it is committed "
                   "(local, remote, both) and its size in each tier")
    p.add_argument("--remote-option", action="append", default=[], metavar="KEY=VALUE",
                   type=option_pair, help="storage option for --remote (repeatable)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("latest", help="show the newest committed checkpoint")
    add_store_args(p)
    p.add_argument("--allow-rollback", action="store_true",
                   help="skip a corrupt newest checkpoint instead of failing")
    p.set_defaults(func=cmd_latest)

    p = sub.add_parser("verify", help="check a checkpoint against its manifest")
    add_store_args(p)
    p.add_argument("--step", type=step_option, default=None,
                   help="step to verify (default: latest)")
    p.add_argument("--quick", action="store_true",
                   help="names and sizes from one listing instead of re-hashing every byte")
    p.add_argument("--remote", action="store_true",
                   help="compare each file with the object store's own stored checksum, from "
                   "metadata requests alone (no data read; docs/remote-verify.md)")
    p.set_defaults(func=cmd_verify)

    for module, verbs, extra in _PLUGINS:
        if load is not None and not set(verbs) & set(load):
            for verb in verbs:
                _add_stub(sub, verb)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] == "ckptfs":
                raise  # ckptfs's own module: a packaging bug, never hidden
            _missing_extra(sub, verbs, extra, exc)
            continue
        add: Callable[[Any], None] = mod.add_subcommands
        add(sub)
    return parser


def _verb_of(argv: Sequence[str]) -> str | None:
    """The verb of a command line: its first word that is not an option (the top-level
    options, ``-v``, ``--version``, ``-h``, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    named = _verb_of(argv)
    parser = build_parser(load=() if named is None else (named,))
    try:
        args, extras = parser.parse_known_args(argv)
        if getattr(args, "stub", False):  # argparse chose another verb than _verb_of
            parser = build_parser()
            args, extras = parser.parse_known_args(argv)
        # Reported by the verb's own parser, with its usage and close matches.
        if extras and not getattr(args, "takes_anything", False):
            verb = _chosen_parser(parser, args)
            verb.error(_suggest_options(verb, extras))
    except SystemExit as exc:  # usage error (argparse printed it, naming the option) or --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except CorruptCheckpointError as exc:
        _fail(args, exc)
        return EXIT_FAILED
    except CheckpointNotFoundError as exc:
        _fail(args, exc)
        return EXIT_FAILED
    except CkptfsError as exc:
        _fail(args, exc)
        return EXIT_USAGE


def _fail(args: argparse.Namespace, exc: Exception) -> None:
    hints = [h for u in (getattr(args, "url", None), getattr(args, "src", None))
             if isinstance(u, str) and isinstance(exc, (CheckpointNotFoundError,
                                                        StorageNotFoundError))
             for h in [bucket_hint(u)] if h]
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc),
                          **({"hint": hints[0]} if hints else {})}, indent=2))
    print(f"ckptfs: error: {exc}", file=sys.stderr)
    for hint in hints:
        print(f"ckptfs: {hint}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
