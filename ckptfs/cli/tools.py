"""``ckptfs inspect``, ``ckptfs cp`` and ``ckptfs export`` (docs/cli.md).

* ``inspect`` shows what a checkpoint holds without reading tensor bytes: the marker and
  manifest, ``state.msgpack`` (digest-checked) and each safetensors *header* (two ranged reads
  per file).  Values of extension types are shown by type name and never decoded, so it works
  on checkpoints whose types this process has not registered.
* ``cp`` copies committed steps between any two URLs under the commit protocol
  (:mod:`ckptfs.cli.transfer`): verified while streamed, marker last.
* ``export`` writes one step as a single safetensors file (flat ``/``-joined keys, non-tensor
  values as JSON in ``__metadata__``) or, when asked for ``.pt``, with ``torch.save`` (pickle,
  on write only: ckptfs never unpickles).

Progress bars (tqdm, on stderr) appear only when stdout is a terminal and neither ``--quiet``
nor ``--json`` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch

from ckptfs.cli.core import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    add_store_args,
    emit,
    open_from_args,
    option_pair,
    parse_options,
    step_option,
)
from ckptfs.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from ckptfs.format.extensions import EXT_TAG, unregistered_as_dict
from ckptfs.format.layout import STATE_NAME
from ckptfs.format.limits import MAX_HEADER_BYTES, MAX_STATE_DOC_BYTES
from ckptfs.format.serialize import (
    HeaderEntry,
    TensorSlot,
    decode_state_doc,
    dtype_code,
    parse_safetensors_header,
    tensor_memoryview,
)
from ckptfs.format.sharded import SHARDED_FORMAT_VERSION
from ckptfs.protocol.formats import check_checkpoint
from ckptfs.protocol.reader import read_file_verified
from ckptfs.protocol.resolve import CheckpointInfo, storage_url
from ckptfs.protocol.store import CheckpointStore
from ckptfs.protocol.store import open as open_store
from ckptfs.storage.base import Storage, read_range

#: Largest JSON of non-tensor values ``export`` puts in the safetensors ``__metadata__``.
MAX_EXPORT_METADATA = 1024 * 1024
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1,
             "F8_E5M2FNUZ": 1, "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "F32": 4, "I32": 4,
             "U32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8}


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
# inspect


class _HeaderOnly:
    """The first bytes of a safetensors file posing as the whole file (its size known from the
    manifest), so :func:`parse_safetensors_header` checks the header without the data."""

    def __init__(self, head: bytes, size: int) -> None:
        self.head, self.size = head, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, item: slice) -> bytes:
        if item.stop is not None and item.stop > len(self.head):
            raise IndexError("beyond the header")
        return self.head[item]


def read_header(storage: Storage, info: CheckpointInfo, path: str, size: int
                ) -> dict[str, HeaderEntry]:
    """The entries of one safetensors file, from two ranged reads (length, then header)."""
    full = f"{info.path}/{path}"
    where = storage_url(storage, full)
    first = read_range(storage, full, 0, 8)
    if len(first) < 8 or size < 8:
        raise CorruptCheckpointError(f"{where}: too short for safetensors", step=info.step)
    (hlen,) = struct.unpack("<Q", first)
    if hlen > min(MAX_HEADER_BYTES, size - 8):
        raise UnsafeCheckpointError(f"{where}: safetensors header length {hlen} exceeds the "
                                    f"file or {MAX_HEADER_BYTES} B", step=info.step)
    head = first + read_range(storage, full, 8, hlen)
    _, entries = parse_safetensors_header(cast(Any, _HeaderOnly(head, size)), where=where)
    return entries


def _scalar_text(node: Any) -> str:
    if isinstance(node, bytes):
        return f"bytes[{len(node)}]"
    text = repr(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _key_text(node: Any) -> str:
    if isinstance(node, list) and len(node) == 2:
        tag, payload = node
        if tag in ("t", "S") and isinstance(payload, list):
            return "(" + ", ".join(_key_text(p) for p in payload) + ")"
        if tag == EXT_TAG and isinstance(payload, list) and len(payload) == 2:
            return f"<{payload[0]}:{_key_text(payload[1])}>"
        return str(payload)
    return str(node)


def tree_rows(tree: Any, slots: list[TensorSlot]) -> Iterator[dict[str, Any]]:
    """One row per node worth showing (containers, extension values, leaves), depth-first,
    from the *tagged* tree: nothing is decoded or constructed."""
    stack: list[tuple[Any, str, int]] = [(tree, "", 0)]
    while stack:
        node, key, depth = stack.pop()
        row: dict[str, Any] = {"key": key, "depth": depth}
        tag = node[0] if isinstance(node, list) and len(node) == 2 else None
        payload = node[1] if tag is not None else None
        children: list[tuple[str, Any]] = []
        if tag == "T" and isinstance(payload, int) and 0 <= payload < len(slots):
            s = slots[payload]
            row.update(kind="tensor", dtype=s.dtype, shape=list(s.shape), file=s.file,
                       bytes=math.prod(s.shape) * _ITEMSIZE.get(s.dtype, 0))
        elif tag == "d" and isinstance(payload, list):
            row.update(kind="dict", items=len(payload))
            children = [(_key_text(p[0]), p[1]) for p in payload
                        if isinstance(p, list) and len(p) == 2]
        elif tag in ("l", "t") and isinstance(payload, list):
            row.update(kind="list" if tag == "l" else "tuple", items=len(payload))
            children = [(str(i), v) for i, v in enumerate(payload)]
        elif tag == EXT_TAG and isinstance(payload, list) and len(payload) == 2:
            row.update(kind="extension", type=str(payload[0]))
            inner = payload[1]
            if isinstance(inner, list) and len(inner) == 2 and inner[0] in ("d", "l", "t"):
                children = ([(_key_text(p[0]), p[1]) for p in inner[1]] if inner[0] == "d"
                            else [(str(i), v) for i, v in enumerate(inner[1])])
            else:
                row["value"] = _scalar_text(inner[1] if isinstance(inner, list) else inner)
        elif tag == "S":
            row.update(kind="value", type="torch.Size", value=f"torch.Size({payload})")
        elif tag == "dt":
            row.update(kind="value", type="torch.dtype", value=f"torch.{payload}")
        elif tag == "i":
            row.update(kind="value", type="int", value=_scalar_text(payload))
        else:
            row.update(kind="value", type=type(node).__name__, value=_scalar_text(node))
        if depth > 0:
            yield row
        prefix = f"{key}/" if key else ""
        for k, child in reversed(children):
            stack.append((child, prefix + k, depth + 1))


def inspect_info(store: CheckpointStore, info: CheckpointInfo) -> dict[str, Any]:
    storage = store.storage
    check_checkpoint(storage, info)  # refuses what a load refuses (the same typed error)
    m = info.manifest
    out: dict[str, Any] = {
        "url": info.url, "step": info.step, "attempt": info.attempt, "created": info.created,
        "format_version": m.format_version, "hash_algorithm": m.hash_algorithm,
        "metadata": m.metadata, "total_bytes": m.total_bytes,
        "files": [{"path": e.path, "size": e.size, "digest": e.digest,
                   "algorithm": e.algorithm} for e in m.files]}
    if m.format_version == SHARDED_FORMAT_VERSION:
        out["tree"] = _sharded_rows(storage, info)
        out["tree_note"] = ("format v2 (sharded): the flat DCP keys from dcp.msgpack; see "
                            "docs/sharded.md")
        return out
    entry = m.file(STATE_NAME)
    if entry.size > MAX_STATE_DOC_BYTES:
        raise UnsafeCheckpointError(f"{info.url}/{STATE_NAME}: declared size {entry.size} B "
                                    f"exceeds {MAX_STATE_DOC_BYTES} B", step=info.step)
    doc = read_file_verified(storage, info, entry, verify=True)
    tree, slots = decode_state_doc(bytes(doc), where=f"{info.url}/{STATE_NAME}")
    sizes = {e.path: e.size for e in m.files}
    headers: dict[str, dict[str, HeaderEntry]] = {}
    for s in slots:
        if s.file not in sizes:
            raise CorruptCheckpointError(f"{info.url}: state references {s.file}, which is not "
                                         "in the manifest", step=info.step)
        if s.file not in headers:
            headers[s.file] = read_header(storage, info, s.file, sizes[s.file])
        h = headers[s.file].get(s.name)
        if h is None or h.dtype != s.dtype or h.shape != s.shape:
            raise CorruptCheckpointError(f"{info.url}/{s.file}: tensor {s.name!r} is missing or "
                                         "differs from the state document", step=info.step)
    out["tree"] = list(tree_rows(tree, slots))
    out["tensors"] = {"count": len(slots), "bytes": sum(
        r["bytes"] for r in out["tree"] if r["kind"] == "tensor")}
    return out


def _sharded_rows(storage: Storage, info: CheckpointInfo) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckptfs.protocol.sharded_read import read_document

    doc = read_document(storage, info, verify=True)
    rows = []
    for fqn, md in sorted(doc.metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            code = dtype_code(md.properties.dtype)
            shape = list(md.size)
            rows.append({"key": fqn, "depth": 1, "kind": "tensor", "dtype": code,
                         "shape": shape, "bytes": math.prod(shape) * _ITEMSIZE.get(code, 0),
                         "chunks": len(md.chunks)})
        else:
            rows.append({"key": fqn, "depth": 1, "kind": "value", "type": "encoded value"})
    return rows


def _row_text(r: dict[str, Any]) -> str:
    name = r["key"].rsplit("/", 1)[-1] if r["depth"] > 1 and "chunks" not in r else r["key"]
    pad = "  " * r["depth"]
    kind = r["kind"]
    if kind == "tensor":
        extra = f"  ({r['chunks']} chunks)" if "chunks" in r else f"  {r['file']}"
        return f"{pad}{name}: {r['dtype']} {r['shape']} {r['bytes']} B{extra}"
    if kind in ("dict", "list", "tuple"):
        return f"{pad}{name}: {kind} of {r['items']}"
    if kind == "extension":
        return f"{pad}{name}: <{r['type']}>" + (f" {r['value']}" if "value" in r else "")
    return f"{pad}{name}: {r.get('value', r.get('type'))}"


def cmd_inspect(args: argparse.Namespace) -> int:
    store = open_from_args(args)
    doc = inspect_info(store, resolve(store, args.step))
    lines = [f"step {doc['step']}  {doc['url']}",
             f"created {doc['created']}  format v{doc['format_version']}  "
             f"hash {doc['hash_algorithm']}  {doc['total_bytes']} B in {len(doc['files'])} files"]
    lines += [f"  {f['path']}  {f['size']} B  {f['digest'][:24]}..." for f in doc["files"]]
    lines.append("metadata: " + json.dumps(doc["metadata"], sort_keys=True, default=str)[:2000])
    if "tensors" in doc:
        lines.append(f"tree ({doc['tensors']['count']} tensors, {doc['tensors']['bytes']} B):")
    else:
        lines.append(doc.get("tree_note", "tree:"))
    lines += [_row_text(r) for r in doc["tree"]]
    emit(args, doc, "\n".join(lines))
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# cp


def cmd_cp(args: argparse.Namespace) -> int:
    from ckptfs.protocol.copy import copy_step

    shared = parse_options(args.option)
    src = open_store(args.src, **{**shared, **parse_options(args.src_option)})
    dst = open_store(args.dst, **{**shared, **parse_options(args.dst_option)})
    if args.all:
        infos = [src.info(s) for s in src.steps()]
        if not infos:
            raise CheckpointNotFoundError(f"no committed checkpoint at {src.url}")
    else:
        infos = [resolve(src, args.step)]
    rows: list[dict[str, Any]] = []
    failed = False
    with progress_bar(args, sum(i.total_bytes for i in infos), "cp") as bar:
        for info in infos:
            try:
                res = copy_step(src.storage, dst.storage, info.step, durable=dst.durable,
                                threads=dst.threads, progress=bar.update)
                rows.append(res.as_dict())
            except (CheckpointExistsError, CorruptCheckpointError,
                    CheckpointNotFoundError) as exc:
                failed = True
                rows.append({"step": info.step, "status": "failed",
                             "error": type(exc).__name__, "message": str(exc)})
                print(f"ckptfs: error: step {info.step}: {exc}", file=sys.stderr)
    text = "\n".join(
        f"step {r['step']}: {r['status']}"
        + (f" ({r['files']} files, {r['bytes']} B) -> {dst.url}" if r["status"] != "failed"
           else "") for r in rows)
    emit(args, {"src": src.url, "dst": dst.url, "ok": not failed, "steps": rows}, text)
    return EXIT_FAILED if failed else EXIT_OK


# ----------------------------------------------------------------------------------------------
# export


def _flatten(value: Any, prefix: str, tensors: dict[str, torch.Tensor],
             values: dict[str, Any]) -> None:
    def name_for(key: str) -> str:
        name, n = key or "<root>", 1
        while name in tensors or name in values or name == "__metadata__":
            n += 1
            name = f"{key}#{n}"
        return name

    if isinstance(value, dict) and "__ckptfs_type__" not in value:
        for k, v in value.items():
            _flatten(v, f"{prefix}/{k}" if prefix else str(k), tensors, values)
    elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}/{i}" if prefix else str(i), tensors, values)
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
    else:
        values[name_for(prefix)] = _jsonable(value)


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


def cmd_export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    kind = out.suffix.lower()
    if kind not in (".safetensors", ".pt"):
        raise UsageError(f"{out}: the output must end in .safetensors or .pt")
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
    p = sub.add_parser("inspect", help="show a checkpoint's keys, dtypes, shapes and sizes "
                       "without reading tensor bytes")
    add_store_args(p)
    p.add_argument("--step", type=step_option, default=None, help="step (default: latest)")
    p.set_defaults(func=cmd_inspect)

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
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("export", help="write one step as a .safetensors file (or a .pt file)")
    add_store_args(p)
    p.add_argument("out", help="output file: OUT.safetensors, or OUT.pt (torch.save: pickle)")
    p.add_argument("--step", type=step_option, default=None, help="step (default: latest)")
    p.add_argument("--key", default=None, metavar="PATH",
                   help="export only this subtree, e.g. --key model (keys then relative to it)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)

