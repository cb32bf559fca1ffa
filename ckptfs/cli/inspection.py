"""``ckptfs inspect`` (docs/cli.md): what a checkpoint holds, without reading tensor bytes.

Everything is first checked by the format table's check
(`ckptfs.protocol.formats.check_checkpoint`, the one ``ckptfs cp`` runs before copying):
the listing (links, missing and resized files), ``state.msgpack`` (digest-checked) and its tree
with the loader's own decoder, each safetensors *header* (two ranged reads per file) against the
state document; format v2: ``dcp.msgpack``, every value document, the stored tree.  So inspect
refuses, with the loader's typed error, every checkpoint a load refuses for what it reads; only
the tensor bytes are left to ``verify``.  Values of extension types are shown by type name, so
it works on checkpoints whose types this process has not registered (they are checked as plain
dicts, as ``export`` loads them).

The rows are bounded: ``--max-items`` children per container and ``--max-rows`` rows in all,
the rest summarized (``kind: "more"``) with counts from one depth-first pass that builds no
rows.  What grows with the state is the decoded document, which a load holds too.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptfs.cli.core import EXIT_OK, add_store_args, emit, int_option, open_from_args, step_option
from ckptfs.format.incremental import references_of

# The modules that import torch are imported by the verb when it runs (`cmd_inspect`), not with
# this module: ``ckptfs inspect --help`` imports none of them.
if TYPE_CHECKING:
    from ckptfs.format.serialize import TensorSlot
    from ckptfs.protocol.resolve import CheckpointInfo
    from ckptfs.protocol.store import CheckpointStore

_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1,
             "F8_E5M2FNUZ": 1, "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "F32": 4, "I32": 4,
             "U32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8}

#: Children ``inspect`` shows per container (a dict, list or tuple, an extension value's payload,
#: the manifest's file list); the rest of the container is one summary row with its counts.
DEFAULT_MAX_ITEMS = 1000
#: Rows ``inspect`` shows in all (format v2: flat keys); what follows is one summary row.  With
#: the per-container bound, the rows (and the memory and time they take) do not grow with the
#: state: a 1M-element list costs a summary row, not a million rows.
DEFAULT_MAX_ROWS = 20_000
#: Characters of a value shown in a row, and of a key.
VALUE_CHARS = 60
KEY_CHARS = 1000


def _short(value: Any, room: int) -> str:
    """``str(value)`` in at most ``room`` characters (a long str or bytes is cut before it is
    converted: a 2 GiB string is never copied)."""
    if isinstance(value, (str, bytes)):
        value = value[:room + 1]
    text = str(value)
    return text if len(text) <= room else text[:room - 3] + "..."


def _scalar_text(node: Any) -> str:
    if isinstance(node, bytes):
        return f"bytes[{len(node)}]"
    if isinstance(node, str):
        node = node[:VALUE_CHARS]
    return _short(repr(node), VALUE_CHARS)


def _seq_text(items: list[Any], first: int = 16) -> str:
    shown = ", ".join(_short(x, 24) for x in items[:first])
    return f"[{shown}{', ...' if len(items) > first else ''}]"


def _key_text(node: Any, room: int = KEY_CHARS) -> str:
    """A dict key of the tagged tree as text (a tuple key as ``(a, b)``), in about ``room``
    characters."""
    from ckptfs.format.extensions import EXT_TAG  # imports torch: when inspect runs

    if isinstance(node, list) and len(node) == 2:
        tag, payload = node
        if tag in ("t", "S") and isinstance(payload, list):
            parts: list[str] = []
            for p in payload:
                used = sum(len(x) + 2 for x in parts)
                if used >= room:
                    parts.append("...")
                    break
                parts.append(_key_text(p, room - used))
            return "(" + ", ".join(parts) + ")"
        if tag == EXT_TAG and isinstance(payload, list) and len(payload) == 2:
            return f"<{_short(payload[0], 200)}:{_key_text(payload[1], room)}>"
        return _short(payload, room)
    return _short(node, room)


def _slot_bytes(s: TensorSlot) -> int:
    return math.prod(s.shape) * _ITEMSIZE.get(s.dtype, 0)


def _tensor_slot(node: Any, slots: list[TensorSlot]) -> TensorSlot | None:
    if (isinstance(node, list) and len(node) == 2 and node[0] == "T"
            and isinstance(node[1], int) and 0 <= node[1] < len(slots)):
        return slots[node[1]]
    return None


def _children(node: Any, *, keys: bool = True) -> tuple[Iterator[tuple[str, Any]], int] | None:
    """A container node's children, lazily, with their key text (``keys``), and how many; an
    extension value's children are those of its payload.  ``None`` for a leaf."""
    from ckptfs.format.extensions import EXT_TAG  # imports torch: when inspect runs

    if not (isinstance(node, list) and len(node) == 2):
        return None
    tag, payload = node
    if tag == EXT_TAG and isinstance(payload, list) and len(payload) == 2:
        inner = payload[1]
        if not (isinstance(inner, list) and len(inner) == 2 and inner[0] in ("d", "l", "t")):
            return None
        tag, payload = inner
    if not isinstance(payload, list):
        return None
    if tag == "d":
        pairs = (p for p in payload if isinstance(p, list) and len(p) == 2)
        return (((_key_text(p[0]) if keys else "", p[1]) for p in pairs), len(payload))
    if tag in ("l", "t"):
        return (((str(i) if keys else "", v) for i, v in enumerate(payload)), len(payload))
    return None


def _row(node: Any, slots: list[TensorSlot]) -> dict[str, Any]:
    """What one node shows (without its key): nothing is decoded or constructed."""
    from ckptfs.format.extensions import EXT_TAG  # imports torch: when inspect runs

    s = _tensor_slot(node, slots)
    if s is not None:
        return {"kind": "tensor", "dtype": s.dtype, "shape": list(s.shape), "file": s.file,
                "bytes": _slot_bytes(s)}
    tag = node[0] if isinstance(node, list) and len(node) == 2 else None
    payload = node[1] if tag is not None else None
    if tag == "d" and isinstance(payload, list):
        return {"kind": "dict", "items": len(payload)}
    if tag in ("l", "t") and isinstance(payload, list):
        return {"kind": "list" if tag == "l" else "tuple", "items": len(payload)}
    if tag == EXT_TAG and isinstance(payload, list) and len(payload) == 2:
        row: dict[str, Any] = {"kind": "extension", "type": _short(payload[0], 200)}
        kids = _children(node, keys=False)
        if kids is not None:
            row["items"] = kids[1]
        else:
            inner = payload[1]
            row["value"] = _scalar_text(inner[1] if isinstance(inner, list) and len(inner) == 2
                                        else inner)
        return row
    if tag == "S" and isinstance(payload, list):
        return {"kind": "value", "type": "torch.Size", "value": f"torch.Size({_seq_text(payload)})"}
    if tag == "dt":
        return {"kind": "value", "type": "torch.dtype", "value": f"torch.{_short(payload, 40)}"}
    if tag == "i":
        return {"kind": "value", "type": "int", "value": _scalar_text(payload)}
    return {"kind": "value", "type": type(node).__name__, "value": _scalar_text(node)}


def _kid_nodes(node: list[Any]) -> Iterator[Any] | None:
    """The child nodes of a container node (an extension value: of its payload), lazily."""
    from ckptfs.format.extensions import EXT_TAG  # imports torch: when inspect runs

    tag, payload = node
    if tag == EXT_TAG and type(payload) is list and len(payload) == 2:
        inner = payload[1]
        if not (type(inner) is list and len(inner) == 2):
            return None
        tag, payload = inner
    if type(payload) is not list:
        return None
    if tag == "d":
        return (p[1] for p in payload if type(p) is list and len(p) == 2)
    if tag in ("l", "t"):
        return iter(payload)
    return None


def _tally(nodes: Iterator[Any], slots: list[TensorSlot]) -> tuple[int, int, int]:
    """(rows, tensor references, their bytes) of ``nodes`` and everything under them: one
    depth-first pass over the tagged tree (memory: its depth), no rows built."""
    rows = tensors = nbytes = 0
    stack: list[Iterator[Any]] = [nodes]
    while stack:
        for node in stack[-1]:
            rows += 1
            if type(node) is list and len(node) == 2:
                s = _tensor_slot(node, slots)
                if s is not None:
                    tensors += 1
                    nbytes += _slot_bytes(s)
                    continue
                kids = _kid_nodes(node)
                if kids is not None:
                    stack.append(kids)
                    break
        else:
            stack.pop()
    return rows, tensors, nbytes


@dataclass
class _Level:
    children: Iterator[tuple[str, Any]]
    prefix: str
    depth: int
    total: int
    shown: int = 0


def _more(key: str, depth: int, counts: tuple[int, int, int], items: int | None = None
          ) -> dict[str, Any]:
    row: dict[str, Any] = {"key": key, "depth": depth, "kind": "more", "rows": counts[0],
                           "tensors": counts[1], "bytes": counts[2]}
    if items is not None:
        row["items"] = items
    return row


def tree_rows(tree: Any, slots: list[TensorSlot], *, max_items: int = DEFAULT_MAX_ITEMS,
              max_rows: int = DEFAULT_MAX_ROWS) -> Iterator[dict[str, Any]]:
    """One row per node (containers, extension values, leaves), depth-first, from the *tagged*
    tree: nothing is decoded or constructed.  At most ``max_items`` children of a container
    and ``max_rows`` rows in all; the rest is summarized by ``kind: "more"`` rows (``rows``,
    ``tensors`` and ``bytes`` not shown; ``items``: the container's children not shown)."""
    root = _children(tree)
    if root is None:
        return
    stack = [_Level(root[0], "", 1, root[1])]
    emitted = 0
    while stack:
        level = stack[-1]
        if emitted >= max_rows:
            rest = _tally((v for lv in stack for _, v in lv.children), slots)
            if rest[0]:
                yield _more("...", 1, rest)
            return
        if level.shown >= max_items:
            rest = _tally((v for _, v in level.children), slots)
            if rest[0]:
                yield _more(f"{level.prefix}...", level.depth, rest, level.total - level.shown)
            stack.pop()
            continue
        item = next(level.children, None)
        if item is None:
            stack.pop()
            continue
        level.shown += 1
        key, node = item
        row = {"key": level.prefix + key, "depth": level.depth, **_row(node, slots)}
        yield row
        emitted += 1
        kids = _children(node)
        if kids is not None:
            stack.append(_Level(kids[0], f"{row['key']}/", level.depth + 1, kids[1]))


def inspect_info(store: CheckpointStore, info: CheckpointInfo, *,
                 max_items: int = DEFAULT_MAX_ITEMS,
                 max_rows: int = DEFAULT_MAX_ROWS) -> dict[str, Any]:
    """What ``ckptfs inspect`` shows (docs/cli.md).  Everything is checked first by the format
    table's check (`ckptfs.protocol.formats.check_checkpoint`, the one ``ckptfs cp`` runs
    too), so inspect refuses what load refuses, with the same typed error, except what only
    the tensor bytes would show (``verify``); the rows are then rendered from what it decoded."""
    from ckptfs.protocol.formats import check_checkpoint
    from ckptfs.protocol.reader import CheckedSingleProcess

    m = info.manifest
    checked = check_checkpoint(store.storage, info)
    out: dict[str, Any] = {
        "url": info.url, "step": info.step, "attempt": info.attempt, "created": info.created,
        "format_version": m.format_version, "hash_algorithm": m.hash_algorithm,
        "metadata": m.metadata, "total_bytes": m.total_bytes,
        "files": [{"path": e.path, "size": e.size, "digest": e.digest,
                   "algorithm": e.algorithm} for e in m.files[:max_items]]}
    if len(m.files) > max_items:
        out["files_omitted"] = len(m.files) - max_items
    # An incremental checkpoint's references (formats v3, v4): files of earlier checkpoints,
    # checked as its own (listing, header) and, like them, without reading tensor data.
    refs = references_of(m)
    out["references"] = [{"path": r.path, "step": r.step, "attempt": r.attempt,
                          "source": r.source, "size": r.size,
                          "bytes": sum(c.length for c in r.chunks)} for r in refs[:max_items]]
    if len(refs) > max_items:
        out["references_omitted"] = len(refs) - max_items
    if isinstance(checked, CheckedSingleProcess):
        out["tree"] = list(tree_rows(checked.tree, checked.slots, max_items=max_items,
                                     max_rows=max_rows))
        out["tensors"] = {"count": len(checked.slots),
                          "bytes": sum(_slot_bytes(s) for s in checked.slots)}
        return out
    out["tree"] = _sharded_rows(checked.metadata.state_dict_metadata, max_rows)
    out["tree_note"] = ("format v2 (sharded): the flat DCP keys from dcp.msgpack; see "
                        "docs/sharded.md")
    return out


def _sharded_rows(entries: dict[str, Any], max_rows: int) -> list[dict[str, Any]]:
    """The first ``max_rows`` flat DCP keys (sorted), then one summary row for the rest."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckptfs.format.serialize import dtype_code

    shown = set(heapq.nsmallest(max_rows, entries))
    rows = []
    rest = [0, 0, 0]
    for fqn in sorted(shown):
        md = entries[fqn]
        if isinstance(md, TensorStorageMetadata):
            code = dtype_code(md.properties.dtype)
            shape = list(md.size)
            rows.append({"key": fqn, "depth": 1, "kind": "tensor", "dtype": code,
                         "shape": shape, "bytes": math.prod(shape) * _ITEMSIZE.get(code, 0),
                         "chunks": len(md.chunks)})
        else:
            rows.append({"key": fqn, "depth": 1, "kind": "value", "type": "encoded value"})
    if len(entries) > len(shown):
        for fqn, md in entries.items():
            if fqn in shown:
                continue
            rest[0] += 1
            if isinstance(md, TensorStorageMetadata):
                rest[1] += 1
                rest[2] += math.prod(md.size) * _ITEMSIZE.get(dtype_code(md.properties.dtype), 0)
        rows.append(_more("...", 1, (rest[0], rest[1], rest[2])))
    return rows


def _row_text(r: dict[str, Any]) -> str:
    pad = "  " * r["depth"]
    kind = r["kind"]
    if kind == "more":
        items = f"{r['items']} more items, " if "items" in r else ""
        return (f"{pad}... {items}{r['rows']} more rows ({r['tensors']} tensors, "
                f"{r['bytes']} B)")
    name = r["key"].rsplit("/", 1)[-1] if r["depth"] > 1 and "chunks" not in r else r["key"]
    if kind == "tensor":
        extra = f"  ({r['chunks']} chunks)" if "chunks" in r else f"  {r['file']}"
        return f"{pad}{name}: {r['dtype']} {r['shape']} {r['bytes']} B{extra}"
    if kind in ("dict", "list", "tuple"):
        return f"{pad}{name}: {kind} of {r['items']}"
    if kind == "extension":
        return f"{pad}{name}: <{r['type']}>" + (f" {r['value']}" if "value" in r else "")
    return f"{pad}{name}: {r.get('value', r.get('type'))}"


def cmd_inspect(args: argparse.Namespace) -> int:
    from ckptfs.cli.tools import resolve

    store = open_from_args(args)
    doc = inspect_info(store, resolve(store, args.step), max_items=args.max_items,
                       max_rows=args.max_rows)
    lines = [f"step {doc['step']}  {doc['url']}",
             f"created {doc['created']}  format v{doc['format_version']}  "
             f"hash {doc['hash_algorithm']}  {doc['total_bytes']} B in "
             f"{len(doc['files']) + doc.get('files_omitted', 0)} files"]
    lines += [f"  {f['path']}  {f['size']} B  {f['digest'][:24]}..." for f in doc["files"]]
    if doc.get("files_omitted"):
        lines.append(f"  ... {doc['files_omitted']} more files")
    if doc["references"]:
        n = len(doc["references"]) + doc.get("references_omitted", 0)
        lines.append(f"references: {n} file(s) of earlier checkpoints, checked like its own "
                     "(listing, header), tensor data not read:")
        lines += [f"  {r['path']}  step {r['step']} {r['source']}  {r['bytes']} B used"
                  for r in doc["references"]]
        if doc.get("references_omitted"):
            lines.append(f"  ... {doc['references_omitted']} more references")
    lines.append("metadata: " + json.dumps(doc["metadata"], sort_keys=True, default=str)[:2000])
    if "tensors" in doc:
        lines.append(f"tree ({doc['tensors']['count']} tensors, {doc['tensors']['bytes']} B):")
    else:
        lines.append(doc.get("tree_note", "tree:"))
    lines += [_row_text(r) for r in doc["tree"]]
    emit(args, doc, "\n".join(lines))
    return EXIT_OK


def add_subcommands(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show a checkpoint's keys, dtypes, shapes and sizes "
                       "without reading tensor bytes")
    add_store_args(p)
    p.add_argument("--step", type=step_option, default=None, help="step (default: latest)")
    p.add_argument("--max-items", type=int_option(1, 10**9), default=DEFAULT_MAX_ITEMS,
                   metavar="N", help="children shown per dict, list or tuple, and files "
                   f"listed; the rest summarized (default {DEFAULT_MAX_ITEMS})")
    p.add_argument("--max-rows", type=int_option(1, 10**9), default=DEFAULT_MAX_ROWS,
                   metavar="N", help=f"rows of the tree shown in all (default {DEFAULT_MAX_ROWS})")
    p.set_defaults(func=cmd_inspect)
