"""``export_hf``: one committed step as Hugging Face sharded safetensors
(``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``, the layout of
`ckptfs.format.hf_shards`), streamed with bounded memory, from every layout ckptfs writes.

Design, in the order it runs:

1. **What is exported, without reading tensor data.**  The format table's check
   (`ckptfs.protocol.formats.check_checkpoint`, the one ``inspect`` and ``cp`` run) decodes
   the state's documents: format v1/v3 the tagged tree and its tensor slots (dtype, shape, the
   file holding each), sharded formats (v2/v4/v5) ``dcp.msgpack`` (every tensor's global dtype
   and shape) and the stored tree.  The ``key`` subtree is walked: every tensor gets the
   ``"."``-joined key path below ``key`` (the state-dict key Hugging Face expects:
   ``model.layers.0.self_attn.q_proj.weight``); other values are skipped and reported.
2. **The shards and their headers** are planned from those dtypes and shapes
   (`ckptfs.format.hf_shards.plan_shards`, Hugging Face's rule), so each shard's header is
   written before its data, which then follows one tensor at a time.
3. **The data is read by the load path** (no second reader): format v1/v3 by
   ``CheckpointStore.load_info(keys=...)``, one tensor file at a time (a v1 file's digest
   covers the whole file, so it is read and verified whole, then each of its tensors is
   written); sharded formats by `ckptfs.protocol.sharded.load_full` with DCP key filters, a
   few tensors at a time (at most `READ_BATCH_BYTES`, or one larger tensor), each assembled in
   full from every rank's chunks, every chunk checked against its digest as it is read.  So
   memory stays at one v1 tensor file (or one batch) plus the tensor being written, whatever
   the shard size; a byte that differs raises `CorruptCheckpointError` naming the file.
4. **Atomic files.**  Each shard is written under a hidden temporary name in ``out_dir``
   and fsynced; only when every shard is complete are they renamed into place, and the index
   last (with ``force``, an existing index is removed first, so a killed export never leaves an
   index over a mix of old and new shards).  A failure removes the temporary files; a killed
   process may leave hidden ``.model-*.tmp-*`` files, never a partial file under a final name.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptfs.errors import (
    CheckpointKeyError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ExportExistsError,
    UnsupportedValueError,
)
from ckptfs.format.hf_shards import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    OWNED_FILE,
    TensorSpec,
    data_order,
    index_document,
    parse_size,
    plan_shards,
    shard_header,
    shard_name,
)
from ckptfs.format.versions import SHARDED, features

if TYPE_CHECKING:
    import torch

    from ckptfs.protocol.resolve import CheckpointInfo
    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.storage.base import Storage

#: A sharded checkpoint is read a few tensors at a time: at most this many bytes of them per
#: load (one tensor larger than this is read alone).  Each load reads the listing and
#: ``dcp.msgpack`` again, so batching the small tensors (norms, biases) keeps those few.
READ_BATCH_BYTES = 64 * 1024 * 1024

Progress = Callable[[int], object]


@dataclass(frozen=True)
class HfExport:
    """What `export_hf` wrote: the shard files (names in ``out_dir``), the index, how many
    tensors and their bytes (``total_size``), and the key paths of the non-tensor values it
    skipped (Hugging Face weights are tensors only)."""

    step: int
    source: str
    out_dir: str
    key: str | None
    files: list[str]
    index: str
    tensors: int
    total_size: int
    max_shard_size: int
    skipped: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "source": self.source, "out": self.out_dir,
                "format": "hf", "key": self.key, "files": list(self.files),
                "index": self.index, "shards": len(self.files), "tensors": self.tensors,
                "total_size": self.total_size, "max_shard_size": self.max_shard_size,
                "skipped": list(self.skipped)}


@dataclass(frozen=True)
class _Entry:
    meta: TensorSpec
    path: tuple[Any, ...]   # from the state's root: dict keys (as stored), then list indices
    dict_depth: int         # how many leading components are dict keys
    file: str | None        # format v1/v3: the tensor file holding it


def export_hf(store: CheckpointStore | str, step: int | None, out_dir: str | os.PathLike[str],
              *, key: str | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
              force: bool = False, start: Progress | None = None,
              progress: Progress | None = None) -> HfExport:
    """Write committed ``step`` (the latest if None) of ``store`` (a store or a URL) into
    ``out_dir`` as Hugging Face sharded safetensors: ``model-0000k-of-0000n.safetensors`` and
    ``model.safetensors.index.json``.  Put the model's ``config.json`` beside them
    (``config.save_pretrained(out_dir)``) and ``from_pretrained(out_dir)`` loads the weights.

    ``key``: the subtree to export, ``/``-separated (``"model"``: the state's ``"model"``
    entry); tensor names are the ``"."``-joined key paths below it (a state dict's own keys).
    Non-tensor values there are skipped (listed in the result's ``skipped``).
    ``max_shard_size``: bytes of tensor data per shard (an int, or ``"5GB"``, ``"500MB"``,
    ``"2GiB"``; default ``"5GB"`` as ``save_pretrained``); a larger tensor gets a shard of
    its own.  ``force``: replace an earlier export's ``model*.safetensors`` files in
    ``out_dir`` (else `ExportExistsError`).  ``start``: called once with the bytes of tensor
    data to write, before the first; ``progress``: with each tensor's bytes as it is
    written.

    Every byte is verified as it is read (`CorruptCheckpointError` naming the file, and no
    file left under a final name); memory holds one tensor file (format v1) or a few tensors
    (sharded formats, `READ_BATCH_BYTES`), never a shard.  docs/cli.md "export"."""
    limit = parse_size(max_shard_size)
    out = Path(out_dir)
    existing = _owned_files(out)
    if existing and not force:
        raise ExportExistsError(
            f"{out} already holds an export ({', '.join(existing[:3])}"
            f"{', ...' if len(existing) > 3 else ''}); pass --force (force=True) to replace "
            "it, or choose an empty directory")
    if isinstance(store, str):
        from ckptfs.protocol.store import open as open_store

        store = open_store(store)
    if step is not None:
        info = store.info(step)
    else:
        latest = store.latest()
        if latest is None:
            raise CheckpointNotFoundError(f"no committed checkpoint at {store.url}")
        info = latest
    storage = store.tiers.storage_of(info)
    entries, skipped = _inventory(storage, info, key)
    specs = [e.meta for e in entries]
    shards = plan_shards(specs, limit)
    names = [shard_name(k, len(shards)) for k in range(1, len(shards) + 1)]
    orders = [data_order(specs, members) for members in shards]
    reader = _Reader(store, storage, info, entries, [i for o in orders for i in o])
    provenance = {"format": "pt", "producer": "ckptfs export", "ckptfs.step": str(info.step),
            "ckptfs.source": info.url}
    out.mkdir(parents=True, exist_ok=True)
    if force and (out / INDEX_NAME).exists():
        (out / INDEX_NAME).unlink()  # never an index over a mix of old and new shards
    tag = uuid.uuid4().hex[:8]
    if start is not None:
        start(sum(s.nbytes for s in specs))
    temps: list[Path] = []
    try:
        for name, order in zip(names, orders, strict=True):
            tmp = out / f".{name}.tmp-{tag}"
            temps.append(tmp)
            with open(tmp, "wb") as f:
                f.write(shard_header(specs, order, provenance))
                for i in order:
                    f.write(_bytes_of(reader.tensor(i), entries[i], info))
                    if progress is not None:
                        progress(entries[i].meta.nbytes)
                f.flush()
                os.fsync(f.fileno())
        reader.close()
        index_tmp = out / f".{INDEX_NAME}.tmp-{tag}"
        temps.append(index_tmp)
        with open(index_tmp, "wb") as f:
            f.write(index_document(specs, shards))
            f.flush()
            os.fsync(f.fileno())
        for tmp, name in zip(temps, names, strict=False):
            os.replace(tmp, out / name)
        os.replace(index_tmp, out / INDEX_NAME)  # last: the export is complete
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(out)
    for stale in set(existing) - {*names, INDEX_NAME}:
        (out / stale).unlink(missing_ok=True)
    return HfExport(step=info.step, source=info.url, out_dir=str(out), key=key, files=names,
                    index=INDEX_NAME, tensors=len(specs),
                    total_size=sum(s.nbytes for s in specs), max_shard_size=limit,
                    skipped=skipped)


def _owned_files(out: Path) -> list[str]:
    """The files of an earlier export in ``out`` (sorted); raises if ``out`` is not a
    directory."""
    if not out.exists():
        return []
    if not out.is_dir():
        raise ExportExistsError(f"{out} exists and is not a directory: a Hugging Face export "
                                "writes a directory of files; choose a directory")
    return sorted(p.name for p in out.iterdir() if OWNED_FILE.fullmatch(p.name))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # a platform without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _bytes_of(t: torch.Tensor, entry: _Entry, info: CheckpointInfo) -> memoryview:
    """``t``'s bytes, once its dtype and shape are those the header promised."""
    from ckptfs.format.serialize import dtype_code, tensor_memoryview

    if dtype_code(t.dtype) != entry.meta.dtype or tuple(t.shape) != entry.meta.shape:
        raise CorruptCheckpointError(
            f"{info.url}: tensor {entry.meta.name!r} loaded as {dtype_code(t.dtype)} "
            f"{list(t.shape)}, but the checkpoint's documents declare {entry.meta.dtype} "
            f"{list(entry.meta.shape)}", step=info.step)
    return tensor_memoryview(t.detach().cpu().contiguous().resolve_conj().resolve_neg())


# -- what is exported ----------------------------------------------------------------------------


class _Value:
    """A stored non-tensor value (a sharded checkpoint's tree leaf that is not a tensor)."""


_VALUE = _Value()


def _inventory(storage: Storage, info: CheckpointInfo, key: str | None
               ) -> tuple[list[_Entry], list[str]]:
    """The tensors under ``key`` (with dtype, shape and where they are read from) and the
    key paths of the other values there, from the checkpoint's documents alone."""
    import torch

    from ckptfs.format.extensions import FALLBACK_TYPE_KEY, unregistered_as_dict
    from ckptfs.format.serialize import CODE_DTYPES, build_tree
    from ckptfs.protocol.formats import check_checkpoint

    checked = check_checkpoint(storage, info)
    where = f"{info.url}"
    leaf: Callable[[Any], tuple[str, tuple[int, ...], str | None] | None]
    if SHARDED in features(info.manifest):
        tree = _sharded_tree(checked, where)

        def leaf(node: Any) -> tuple[str, tuple[int, ...], str | None] | None:
            return (node.dtype, node.shape, None) if isinstance(node, TensorSpec) else None
    else:
        slots = checked.slots
        holders = [torch.zeros((1,) * len(s.shape), dtype=CODE_DTYPES[s.dtype]).expand(s.shape)
                   for s in slots]
        slot_of = {id(t): s for t, s in zip(holders, slots, strict=True)}
        with unregistered_as_dict():
            tree = build_tree(checked.tree, holders, where=where)

        def leaf(node: Any) -> tuple[str, tuple[int, ...], str | None] | None:
            s = slot_of.get(id(node)) if isinstance(node, torch.Tensor) else None
            return None if s is None else (s.dtype, tuple(s.shape), s.file)

    node, prefix, depth = _select(tree, key, where)
    entries: list[_Entry] = []
    skipped: list[str] = []
    names: dict[str, str] = {}

    def walk(value: Any, path: tuple[Any, ...], dict_depth: int) -> None:
        found = leaf(value)
        rel = path[len(prefix):]
        if found is not None:
            name = ".".join(str(c) for c in rel)
            shown = "/".join(str(c) for c in path)
            if name in names:
                raise UnsupportedValueError(
                    f"{where}: key paths {names[name]!r} and {shown!r} both name the tensor "
                    f"{name!r} once joined with '.'; export with --key to select one of them")
            names[name] = shown
            entries.append(_Entry(TensorSpec(name, found[0], found[1]), path, dict_depth,
                                  found[2]))
        elif isinstance(value, dict) and FALLBACK_TYPE_KEY not in value:
            for k, v in value.items():
                walk(v, (*path, k), dict_depth + 1 if dict_depth == len(path) else dict_depth)
        elif isinstance(value, (list, tuple)) and value:
            for i, v in enumerate(value):
                walk(v, (*path, i), dict_depth)
        else:
            skipped.append("/".join(str(c) for c in path) or "<root>")

    if leaf(node) is not None:
        raise UnsupportedValueError(
            f"--key {key!r} selects one tensor: Hugging Face weights are a dict of named "
            "tensors; select the dict holding it (e.g. --key model)")
    walk(node, prefix, depth)
    if not entries:
        raise UnsupportedValueError(
            f"{where}: no tensor under {key or 'the state'!r} to export"
            + (f" (only values: {', '.join(skipped[:5])})" if skipped else ""))
    return entries, skipped


def _select(tree: Any, key: str | None, where: str) -> tuple[Any, tuple[Any, ...], int]:
    """The node ``key`` names (``/``-separated; each part a dict key as ``str()`` shows it,
    or a list index), its key path, and how many of its leading components are dict keys."""
    from ckptfs.format.extensions import FALLBACK_TYPE_KEY

    node: Any = tree
    path: tuple[Any, ...] = ()
    depth = 0
    for part in (key.split("/") if key else []):
        if isinstance(node, dict) and FALLBACK_TYPE_KEY not in node:
            match = [k for k in node if str(k) == part]
            if not match:
                shown = ", ".join(repr(str(k)) for k in list(node)[:20])
                raise CheckpointKeyError(
                    f"{where}: --key {key!r}: no {part!r} in the checkpoint's state; the keys "
                    f"there are: {shown}{', ...' if len(node) > 20 else ''}")
            node = node[match[0]]
            path = (*path, match[0])
            depth += 1 if depth == len(path) - 1 else 0
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            path = (*path, int(part))
        else:
            raise CheckpointKeyError(f"{where}: --key {key!r}: the state has no {part!r} at "
                                     f"{'/'.join(str(c) for c in path) or 'the root'}")
    return node, path, depth


def _sharded_tree(doc: Any, where: str) -> Any:
    """The user's tree of a sharded checkpoint with a `TensorSpec` (name unset) for each
    stored tensor and `_VALUE` for each other value: from the stored tree when the save kept
    one (``store.save``), else from DCP's flatten mapping (a plain ``dcp.save``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckptfs.format.serialize import build_tree, dtype_code

    md = doc.metadata

    def stored(fqn: str) -> Any:
        entry = md.state_dict_metadata.get(fqn)
        if isinstance(entry, TensorStorageMetadata):
            return TensorSpec("", dtype_code(entry.properties.dtype), tuple(entry.size))
        return _VALUE

    def rebuild(node: Any, fqn: str) -> Any:
        tag, payload = node
        if tag == "d":
            out: dict[Any, Any] = {}
            for k_node, child in payload:
                k = build_tree(k_node, [], where=where)
                out[k] = rebuild(child, f"{fqn}.{k}" if fqn else str(k))
            return out
        if tag in ("l", "t"):
            items = [rebuild(c, f"{fqn}.{i}" if fqn else str(i)) for i, c in enumerate(payload)]
            return items if tag == "l" else tuple(items)
        return stored(fqn)

    if doc.tree is not None:
        return rebuild(doc.tree, "")
    root: dict[Any, Any] = {}
    for fqn in md.state_dict_metadata:
        path = list((md.planner_data or {}).get(fqn) or [fqn])
        node = root
        for c in path[:-1]:
            node = node.setdefault(c, {})
        node[path[-1]] = stored(fqn)
    return root


# -- reading ---------------------------------------------------------------------------------------


class _Reader:
    """The tensors of ``entries``, read through the load path in groups, in ``order``: format
    v1/v3 a tensor file at a time (``load_info(keys=...)``), sharded formats a batch of at
    most `READ_BATCH_BYTES` (`load_full`).  One group is held at a time."""

    def __init__(self, store: CheckpointStore, storage: Storage, info: CheckpointInfo,
                 entries: list[_Entry], order: list[int]) -> None:
        self.store, self.storage, self.info, self.entries = store, storage, info, entries
        self.sharded = SHARDED in features(info.manifest)
        self.group_of: dict[int, int] = {}
        self.members: list[list[int]] = []
        size, last_file = 0, None
        for i in order:
            e = entries[i]
            if self.sharded:
                new = not self.members or size + e.meta.nbytes > READ_BATCH_BYTES
            else:
                new = not self.members or e.file != last_file
            if new:
                self.members.append([])
                size = 0
            self.members[-1].append(i)
            self.group_of[i] = len(self.members) - 1
            size += e.meta.nbytes
            last_file = e.file
        self.loaded: int | None = None
        self.state: Any = None

    def tensor(self, i: int) -> torch.Tensor:
        group = self.group_of[i]
        if group != self.loaded:
            self.state = None  # the previous group's memory goes first: a loaded tree is
            gc.collect()       # freed only by the cyclic collector (build_tree's closures)
            self.state = self._load(self.members[group])
            self.loaded = group
        node = self.state
        for c in self.entries[i].path:
            node = node[c]
        return node  # type: ignore[no-any-return]

    def close(self) -> None:
        self.state, self.loaded = None, None

    def _load(self, members: list[int]) -> Any:
        from ckptfs.format.extensions import unregistered_as_dict

        paths = list(dict.fromkeys(self.entries[i].path[:max(self.entries[i].dict_depth, 1)]
                                   for i in members))
        if not self.sharded:
            with unregistered_as_dict():
                return self.store.load_info(self.info, keys=paths)
        from ckptfs.protocol.resolve import check_still_committed
        from ckptfs.protocol.sharded import load_full

        keys = {".".join(str(c) for c in p) for p in paths}
        try:
            with unregistered_as_dict():
                return load_full(self.storage, self.info, threads=self.store.threads,
                                 keys=keys)
        except CorruptCheckpointError:
            check_still_committed(self.storage, self.info.step, self.info.dir_name,
                                  self.info.attempt)
            raise


__all__ = ["READ_BATCH_BYTES", "HfExport", "export_hf"]
