"""``ckptfs cp`` and ``ckptfs export`` (docs/cli.md); ``ckptfs inspect`` is
`ckptfs.cli.inspection`.

* ``cp`` copies committed steps between any two URLs under the commit protocol
  (`ckptfs.protocol.copy`): verified while streamed, marker last.
* ``export`` writes one step as a single safetensors file (flat ``/``-joined keys for every
  tensor, wherever it sits, extension values included; non-tensor values as JSON in
  ``__metadata__``; a tensor is never written as text) or, when asked for ``.pt``, with
  ``torch.save`` (pickle, on write only: ckptfs never unpickles).

Progress bars (tqdm, on stderr) appear only when stdout is a terminal and neither ``--quiet``
nor ``--json`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import struct
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptfs.cli.core import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    add_store_args,
    emit,
    open_from_args,
    option_pair,
    parse_options,
    seconds_option,
    step_option,
)
from ckptfs.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    HashAlgorithmUnavailableError,
    UnsupportedValueError,
)
from ckptfs.format.limits import MAX_DEPTH

if TYPE_CHECKING:  # torch and the protocol load when a verb runs, not for its --help
    import torch

    from ckptfs.protocol.resolve import CheckpointInfo
    from ckptfs.protocol.store import CheckpointStore

#: What makes one step of ``cp`` fail without stopping the others (an unreachable store, bad
#: usage, stop the command: exit 2).
_STEP_ERRORS = (CheckpointExistsError, CorruptCheckpointError, CheckpointNotFoundError,
                HashAlgorithmUnavailableError)

#: Largest JSON of non-tensor values ``export`` puts in the safetensors ``__metadata__``.
MAX_EXPORT_METADATA = 1024 * 1024


def show_progress(args: argparse.Namespace) -> bool:
    return not (getattr(args, "quiet", False) or getattr(args, "json", False)) and \
        sys.stdout.isatty()


def progress_bar(args: argparse.Namespace, total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=not show_progress(args), file=sys.stderr, leave=False)


def resolve(store: CheckpointStore, step: int | None) -> CheckpointInfo:
    if step is not None:
        return store.info(step)
    info = store.latest()
    if info is None:
        raise CheckpointNotFoundError(f"no committed checkpoint at {store.url}")
    return info


# ----------------------------------------------------------------------------------------------
# cp


def cmd_cp(args: argparse.Namespace) -> int:
    from ckptfs.protocol.copy import copy_step
    from ckptfs.protocol.resolve import CheckpointInfo
    from ckptfs.protocol.store import open as open_store

    shared = parse_options(args.option)
    src = open_store(args.src, **{**shared, **parse_options(args.src_option)})
    dst = open_store(args.dst, **{**shared, **parse_options(args.dst_option)})
    # Each step is resolved and copied on its own: with --all, a step that cannot be read (a
    # corrupt marker or manifest, a hash this process lacks), conflicts or fails its copy is
    # reported and the others are still copied (exit 1).
    targets: list[tuple[int, CheckpointInfo | CkptfsError]] = []
    if args.all:
        steps = src.steps()
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint at {src.url}")
        for step in steps:
            try:
                targets.append((step, src.info(step)))
            except _STEP_ERRORS as exc:
                targets.append((step, exc))
    else:
        info = resolve(src, args.step)
        targets.append((info.step, info))
    rows: list[dict[str, Any]] = []
    total = sum(t.bytes for _, t in targets if isinstance(t, CheckpointInfo))
    with progress_bar(args, total, "cp") as bar:
        for step, target in targets:
            if isinstance(target, CkptfsError):
                rows.append(_failed_step(step, target))
                continue
            try:
                res = copy_step(src.storage, dst.storage, step, durable=dst.durable,
                                threads=dst.threads, progress=bar.update,
                                check_stored=args.verify_remote, deadline_s=args.deadline)
            except _STEP_ERRORS as exc:
                rows.append(_failed_step(step, exc))
            else:
                rows.append(res.as_dict())
    failed = [r["step"] for r in rows if r["status"] == "failed"]
    text = "\n".join(
        f"step {r['step']}: {r['status']}"
        + (f" ({r['files']} files, {r['bytes']} B) -> {dst.url}" if r["status"] != "failed"
           else f" ({r['error']})")
        + (f"; {r['server_verified']} files matched the store's own checksum, "
           f"{r['server_unverified']} not available" if args.verify_remote
           and r["status"] == "copied" else "") for r in rows)
    if failed and len(rows) > 1:
        text += (f"\nFAILED: {len(failed)} of {len(rows)} step(s) not copied: "
                 + ", ".join(map(str, failed)))
    emit(args, {"src": src.url, "dst": dst.url, "ok": not failed, "steps": rows,
                "failed": failed}, text)
    return EXIT_FAILED if failed else EXIT_OK


def _failed_step(step: int, exc: Exception) -> dict[str, Any]:
    print(f"ckptfs: error: step {step}: {exc}", file=sys.stderr)
    return {"step": step, "status": "failed", "error": type(exc).__name__, "message": str(exc)}


# ----------------------------------------------------------------------------------------------
# export


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    """Whether a tensor is reachable from ``value`` through containers, a ``Namespace``'s or
    other object's attributes, or a dataclass's fields (numpy arrays are data, not tensors)."""
    import torch
    if depth > MAX_DEPTH + 8:
        return False
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(k, depth + 1) or _holds_tensor(v, depth + 1)
                   for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_holds_tensor(getattr(value, f.name, None), depth + 1)
                   for f in dataclasses.fields(value))
    attrs = getattr(value, "__dict__", None)
    return isinstance(attrs, dict) and _holds_tensor(attrs, depth + 1)


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _flatten(value: Any, prefix: str, tensors: dict[str, torch.Tensor],
             values: dict[str, Any]) -> None:
    """Every tensor of ``value`` under its ``/``-joined key path, wherever it sits (inside an
    extension value too: a ``Namespace``, a dataclass, a value of a type this process has not
    registered); the other leaves as JSON values.  A tensor that has no stable key path (in a
    set, or in an object of another kind) is refused, naming the key path: it is never written
    as text."""
    import torch

    from ckptfs.format.extensions import FALLBACK_TYPE_KEY
    from ckptfs.format.serialize import dtype_code
    def name_for(key: str) -> str:
        name, n = key or "<root>", 1
        while name in tensors or name in values or name == "__metadata__":
            n += 1
            name = f"{key}#{n}"
        return name

    def join(k: Any) -> str:
        return f"{prefix}/{k}" if prefix else str(k)

    if isinstance(value, dict) and FALLBACK_TYPE_KEY in value:
        if not _holds_tensor(value):
            values[name_for(prefix)] = _jsonable(value)
            return
        # A value of a type this process has not registered, holding tensors: its payload is
        # exported in place, its type recorded under its own key path.
        values[name_for(prefix)] = {FALLBACK_TYPE_KEY: value[FALLBACK_TYPE_KEY]}
        _flatten(value.get("value"), prefix, tensors, values)
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, join(k), tensors, values)
    elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        for i, v in enumerate(value):
            _flatten(v, join(i), tensors, values)
    elif isinstance(value, torch.Tensor):
        tensors[name_for(prefix)] = value
    elif type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        try:
            t = torch.from_numpy(value)
            dtype_code(t.dtype)
        except (TypeError, KeyError):
            values[name_for(prefix)] = _jsonable(value)
        else:
            tensors[name_for(prefix)] = t
    elif not _holds_tensor(value):
        values[name_for(prefix)] = _jsonable(value)
    elif isinstance(value, argparse.Namespace) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)):
        values[name_for(prefix)] = {FALLBACK_TYPE_KEY: _type_name(value)}
        fields = (vars(value).items() if isinstance(value, argparse.Namespace)
                  else ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value)))
        for k, v in fields:
            _flatten(v, join(k), tensors, values)
    else:
        raise UnsupportedValueError(
            f"key path {prefix or '<root>'!r}: a {_type_name(value)} holding tensors has no "
            "stable key path for each of them in a safetensors file; export to .pt, or select "
            "the other values with --key")


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int) and type(v) is int:
        return v if abs(v) < 2**63 else str(v)
    if isinstance(v, float) and type(v) is float:
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    text = repr(v)
    return {"__repr__": text if len(text) <= 1000 else text[:997] + "..."}


def _select(state: dict[Any, Any], key: str | None) -> Any:
    if not key:
        return state
    node: Any = state
    for part in key.split("/"):
        index = int(part) if part.lstrip("-").isdigit() else None
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif index is not None and ((isinstance(node, dict) and index in node) or (isinstance(
                node, (list, tuple)) and 0 <= index < len(node))):
            node = node[index]
        else:
            raise UsageError(f"--key {key!r}: no {part!r} in the checkpoint's state")
    return node


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                      progress: Any) -> int:
    """Stream ``tensors`` into one safetensors file (ordered by element size, so each tensor is
    aligned); tensors sharing memory are written separately."""
    from ckptfs.format.serialize import dtype_code, tensor_memoryview
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_code(t.dtype), "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)) + hbytes)
        for name in order:
            t = tensors[name].detach().cpu().contiguous().resolve_conj().resolve_neg()
            view = tensor_memoryview(t)
            f.write(view)
            progress.update(len(view))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(hbytes) + offset


def cmd_export_hf(args: argparse.Namespace) -> int:
    """``export --format hf``: a directory of Hugging Face sharded safetensors
    (`ckptfs.protocol.hf_export`)."""
    from ckptfs.format.hf_shards import DEFAULT_MAX_SHARD_SIZE, parse_size
    from ckptfs.protocol.hf_export import export_hf

    try:
        limit = parse_size(args.max_shard_size if args.max_shard_size is not None
                           else DEFAULT_MAX_SHARD_SIZE)
    except ValueError as exc:
        raise UsageError(f"--max-shard-size: {exc}") from None
    store = open_from_args(args)
    info = resolve(store, args.step)
    bar: Any = None

    def start(total: int) -> None:
        nonlocal bar
        bar = progress_bar(args, total, "export")

    try:
        result = export_hf(store, info.step, args.out, key=args.key, max_shard_size=limit,
                           force=args.force, start=start,
                           progress=lambda n: bar.update(n))
    except OSError as exc:
        if isinstance(exc, CkptfsError):
            raise
        raise UsageError(f"cannot write {args.out}: {exc}") from None
    finally:
        if bar is not None:
            bar.close()
    if result.skipped:
        shown = ", ".join(result.skipped[:10]) + (", ..." if len(result.skipped) > 10 else "")
        print(f"ckptfs: note: skipped {len(result.skipped)} non-tensor value(s) (Hugging Face "
              f"weights are tensors only): {shown}", file=sys.stderr)
    emit(args, result.as_dict(),
         f"exported step {info.step} to {args.out}: {len(result.files)} shard(s), "
         f"{result.tensors} tensors, {result.total_size} B, index {result.index}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from ckptfs.format.extensions import unregistered_as_dict
    out = Path(args.out)
    kind = out.suffix.lower()
    fmt = args.format or ("hf" if kind not in (".safetensors", ".pt") and out.is_dir()
                          else kind[1:])
    if fmt == "hf":
        return cmd_export_hf(args)
    if args.max_shard_size is not None:
        raise UsageError("--max-shard-size applies to --format hf only")
    if fmt != kind[1:]:
        raise UsageError(f"{out}: --format {fmt} writes a .{fmt} file: name it OUT.{fmt}")
    if kind not in (".safetensors", ".pt"):
        raise UsageError(f"{out}: the output must end in .safetensors or .pt (or pass "
                         "--format hf for a directory of Hugging Face sharded safetensors)")
    if out.exists() and not args.force:
        raise UsageError(f"{out} exists; pass --force to replace it")
    store = open_from_args(args)
    info = resolve(store, args.step)
    with unregistered_as_dict():  # this process cannot know the program's own classes
        state = store.load(info.step)
    selected = _select(state, args.key)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    summary: dict[str, Any] = {"step": info.step, "source": info.url, "out": str(out),
                               "format": kind[1:], "key": args.key}
    try:
        if kind == ".pt":
            torch.save(selected, tmp)  # pickle: the user's explicit choice (docs/cli.md)
        else:
            tensors: dict[str, torch.Tensor] = {}
            values: dict[str, Any] = {}
            _flatten(selected, "", tensors, values)
            meta = {"format": "pt", "producer": "ckptfs export", "ckptfs.step": str(info.step),
                    "ckptfs.source": info.url,
                    "ckptfs.metadata": json.dumps(info.metadata, sort_keys=True, default=str)}
            text = json.dumps(values, sort_keys=True, default=str)
            if len(text) <= MAX_EXPORT_METADATA:
                meta["ckptfs.values"] = text
            else:
                summary["values_omitted"] = f"{len(text)} B of non-tensor values exceed " \
                    f"{MAX_EXPORT_METADATA} B"
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            with progress_bar(args, total, "export") as bar:
                write_safetensors(tmp, tensors, meta, bar)
            summary.update(tensors=len(tensors), values=len(values))
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write {out}: {exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    summary["bytes"] = out.stat().st_size
    emit(args, summary, f"exported step {info.step} to {out} ({summary['bytes']} B)")
    return EXIT_OK


# ----------------------------------------------------------------------------------------------


def add_subcommands(sub: Any) -> None:
    p = sub.add_parser("cp", help="copy committed checkpoints to another URL (verified, "
                       "marker last)")
    p.add_argument("src", help="source run root URL")
    p.add_argument("dst", help="destination run root URL")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=step_option, default=None,
                       help="step to copy (default: the latest)")
    which.add_argument("--all", action="store_true", help="copy every committed step")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   type=option_pair, help="storage option for both sides (repeatable)")
    p.add_argument("--src-option", action="append", default=[], metavar="KEY=VALUE",
                   type=option_pair, help="storage option for the source only")
    p.add_argument("--dst-option", action="append", default=[], metavar="KEY=VALUE",
                   type=option_pair, help="storage option for the destination only")
    p.add_argument("--verify-remote", action="store_true",
                   help="before committing, compare each file written with the checksum the "
                   "destination object store keeps (one metadata request per file; "
                   "docs/remote-verify.md)")
    p.add_argument("--deadline", type=seconds_option, default=None, metavar="SECONDS",
                   help="each step's copy commits or fails (SaveDeadlineError, nothing "
                   "committed) within this many seconds, a stalled upload included "
                   "(docs/reliability.md 'Bounded saves'); default: no deadline")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("export", help="write one step as a .safetensors file, a .pt file, or "
                       "Hugging Face sharded safetensors (--format hf)")
    add_store_args(p)
    p.add_argument("out", help="output: OUT.safetensors, OUT.pt (torch.save: pickle), or a "
                   "directory with --format hf")
    p.add_argument("--format", choices=("safetensors", "pt", "hf"), default=None,
                   help="safetensors or pt (default: from OUT's suffix), or hf: "
                   "model-0000k-of-0000n.safetensors and model.safetensors.index.json in OUT")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="--format hf: tensor bytes per shard, e.g. 500MB, 2GiB or bytes "
                   "(default 5GB, as save_pretrained)")
    p.add_argument("--step", type=step_option, default=None, help="step (default: latest)")
    p.add_argument("--key", default=None, metavar="PATH",
                   help="export only this subtree, e.g. --key model (keys then relative to it)")
    p.add_argument("--force", action="store_true", help="replace an existing output file "
                   "(--format hf: an earlier export's model*.safetensors files)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)

