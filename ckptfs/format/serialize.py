"""Turning a state tree into files, and files back into the tree.  No pickle anywhere.

A state is a tree of dicts, lists and tuples whose leaves are tensors or plain values.  Saving
splits it in two:

* ``state.msgpack``: the tree with every tensor replaced by a reference, as *tagged* msgpack
  (every container is ``[tag, payload]``), so int keys, tuples, big ints and ``bytes`` survive
  exactly and a reader never has to guess;
* ``tensors-NNNNN.safetensors``: the tensor bytes, streamed straight from each tensor's memory
  (no intermediate copy of the state), in files the ``safetensors`` library opens itself.

Tensors that are the same view of the same storage (tied weights) are stored once and come back
as one tensor object in every place they appeared.  Other aliasing (overlapping but different
views) is not preserved: each view is stored and loaded as an independent tensor.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ckptfs.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError
from ckptfs.format.layout import STATE_NAME, check_relpath, tensor_file_name

STATE_SCHEMA = "ckptfs.state"
MAX_DEPTH = 256
MAX_HEADER_BYTES = 100 * 1024 * 1024
DEFAULT_SHARD_BYTES = 512 * 1024 * 1024

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("ckptfs format v1 stores little-endian tensors; big-endian hosts are "
                      "not supported")

# torch dtype <-> safetensors dtype string (the names the safetensors library uses).
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in [
    ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
]:
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_CODES: dict[str, torch.dtype] = {v: k for k, v in _DTYPES.items()}

# Tags of the tree encoding (docs/protocol.md, "state.msgpack").
_DICT, _LIST, _TUPLE, _TENSOR, _BIGINT, _SIZE, _DTYPE = "d", "l", "t", "T", "i", "S", "dt"
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class TensorSlot:
    """Where tensor number ``index`` lives: file and name inside that safetensors file."""

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class PlannedFile:
    """A file to write: its relative path, exact size, and a generator of its bytes."""

    path: str
    size: int
    chunks: Callable[[], Iterator[memoryview]]


def _key_str(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def _tensor_identity(t: torch.Tensor) -> tuple[Any, ...]:
    st = t.untyped_storage()
    return (t.device, st.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class _Flattener:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self._ids: dict[tuple[Any, ...], int] = {}
        self._stack: set[int] = set()

    def encode(self, value: Any, path: tuple[Any, ...]) -> Any:
        if len(path) > MAX_DEPTH:
            raise UnsupportedValueError(f"state nested deeper than {MAX_DEPTH} at {_key_str(path)}")
        if isinstance(value, torch.Tensor):
            return [_TENSOR, self._add_tensor(value, path)]
        if value is None or isinstance(value, (bool, str, bytes)):
            return value
        if isinstance(value, int):
            if _INT64_MIN <= value <= _UINT64_MAX:
                return int(value)
            return [_BIGINT, str(int(value))]
        if isinstance(value, float):
            return float(value)
        if isinstance(value, torch.dtype):
            return [_DTYPE, str(value).removeprefix("torch.")]
        if isinstance(value, (Mapping, list, tuple)):
            if id(value) in self._stack:
                raise UnsupportedValueError(f"state contains a reference cycle at {_key_str(path)}")
            self._stack.add(id(value))
            try:
                if isinstance(value, Mapping):
                    items = []
                    for k, v in value.items():
                        if not isinstance(k, (str, int, float, bool, type(None), bytes, tuple)):
                            raise UnsupportedValueError(
                                f"state key {k!r} at {_key_str(path)} has type "
                                f"{type(k).__name__}; keys must be str, int, float, bool, None, "
                                "bytes or tuples of those"
                            )
                        items.append([self.encode(k, (*path, "<key>")), self.encode(v, (*path, k))])
                    return [_DICT, items]
                seq = [self.encode(v, (*path, i)) for i, v in enumerate(value)]
                if isinstance(value, torch.Size):
                    return [_SIZE, seq]
                return [_TUPLE if isinstance(value, tuple) else _LIST, seq]
            finally:
                self._stack.discard(id(value))
        raise UnsupportedValueError(
            f"cannot store value of type {type(value).__module__}.{type(value).__qualname__} at "
            f"key path {_key_str(path)!r}: ckptfs stores tensors, dicts, lists, tuples, int, "
            "float, bool, None, str and bytes (no pickle). Convert it (e.g. numpy scalars with "
            ".item(), arrays with torch.from_numpy) or store its state_dict()"
        )

    def _add_tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> int:
        if t.dtype not in _DTYPES:
            raise UnsupportedValueError(
                f"tensor at {_key_str(path)!r} has dtype {t.dtype}, which safetensors cannot "
                f"store; supported: {sorted(str(d) for d in _DTYPES)}"
            )
        if t.is_sparse or t.layout != torch.strided:
            raise UnsupportedValueError(
                f"tensor at {_key_str(path)!r} has layout {t.layout}; convert with .to_dense()"
            )
        if t.device.type == "meta":
            raise UnsupportedValueError(f"tensor at {_key_str(path)!r} is on the meta device")
        ident = _tensor_identity(t)
        index = self._ids.get(ident)
        if index is None:
            index = len(self.tensors)
            self._ids[ident] = index
            self.tensors.append(t)
            self.names.append(_key_str(path))
        return index


@dataclass
class StatePlan:
    files: list[PlannedFile]
    tensor_count: int
    tensor_bytes: int


def plan_state(state: Any, *, shard_bytes: int = DEFAULT_SHARD_BYTES) -> StatePlan:
    """Validate ``state`` and plan its files.  Raises :class:`UnsupportedValueError` naming the
    key path of the first value the format cannot hold, before any byte is written."""
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(
            "state must be a dict (e.g. {'model': model.state_dict()}), got "
            f"{type(state).__name__}"
        )
    flat = _Flattener()
    tree = flat.encode(state, ())

    # Shards: greedy by order of appearance, then sorted inside a shard by element size so every
    # tensor's offset is aligned to its element size (safetensors forbids gaps between tensors).
    shards: list[list[int]] = [[]]
    acc = 0
    for i, t in enumerate(flat.tensors):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and acc + nbytes > shard_bytes:
            shards.append([])
            acc = 0
        shards[-1].append(i)
        acc += nbytes
    if not shards[-1]:
        shards.pop()

    slots: list[TensorSlot | None] = [None] * len(flat.tensors)
    files: list[PlannedFile] = []
    total = 0
    for sidx, members in enumerate(shards):
        fname = tensor_file_name(sidx)
        members = sorted(members, key=lambda i: -flat.tensors[i].element_size())
        used: set[str] = set()
        entries: list[tuple[str, torch.Tensor]] = []
        for i in members:
            name = flat.names[i]
            n = 1
            while name in used:
                n += 1
                name = f"{flat.names[i]}#{n}"
            used.add(name)
            t = flat.tensors[i]
            slots[i] = TensorSlot(fname, name, _DTYPES[t.dtype], tuple(t.shape))
            entries.append((name, t))
        pf = _plan_safetensors(fname, entries)
        total += pf.size
        files.append(pf)

    doc = {
        "schema": STATE_SCHEMA,
        "format_version": 1,
        "tree": tree,
        "tensors": [[s.file, s.name, s.dtype, list(s.shape)] for s in slots if s is not None],
    }
    try:
        blob = msgpack.packb(doc, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as exc:  # pragma: no cover - encode() checks
        raise UnsupportedValueError(f"state cannot be encoded as msgpack: {exc}") from exc
    files.insert(0, PlannedFile(STATE_NAME, len(blob), lambda: iter([memoryview(blob)])))
    return StatePlan(files, len(flat.tensors), total)


def _cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU contiguous tensor, without a copy.  The view (and every slice of it)
    keeps ``t`` alive, so a chunk still queued for writing or hashing never outlives a
    temporary copy made for a GPU or non-contiguous tensor."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buf = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    buf._ckptfs_owner = t  # type: ignore[attr-defined]
    return memoryview(buf).cast("B")


def _plan_safetensors(fname: str, entries: list[tuple[str, torch.Tensor]]) -> PlannedFile:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": "ckptfs"}}
    offset = 0
    for name, t in entries:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    prefix = struct.pack("<Q", len(hbytes)) + hbytes
    size = len(prefix) + offset

    def chunks() -> Iterator[memoryview]:
        yield memoryview(prefix)
        for _, t in entries:
            ct = _cpu_contiguous(t)  # one tensor at a time: copies only if non-contiguous/GPU
            view = tensor_memoryview(ct)
            step = 16 * 1024 * 1024
            for start in range(0, len(view), step):
                yield view[start:start + step]
            del view, ct

    return PlannedFile(fname, size, chunks)


# ----------------------------------------------------------------------------------------------
# Loading


def decode_state_doc(data: bytes, *, where: str) -> tuple[Any, list[TensorSlot]]:
    """Parse ``state.msgpack`` bytes into (tagged tree, tensor slots).  Typed errors only."""

    def no_ext(code: int, payload: bytes) -> Any:
        raise UnsafeCheckpointError(f"{where}: msgpack extension type {code} is not allowed")

    try:
        doc = msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=no_ext, use_list=True)
    except UnsafeCheckpointError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError, RecursionError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{where}: not a valid state document ({exc!r})") from None
    if not isinstance(doc, dict) or doc.get("schema") != STATE_SCHEMA:
        raise CorruptCheckpointError(f"{where}: not a ckptfs state document")
    if doc.get("format_version") != 1:
        raise CorruptCheckpointError(
            f"{where}: unsupported state format {doc.get('format_version')!r}")
    raw_slots = doc.get("tensors")
    if not isinstance(raw_slots, list):
        raise CorruptCheckpointError(f"{where}: 'tensors' is not a list")
    slots = []
    for raw in raw_slots:
        if (not isinstance(raw, list) or len(raw) != 4 or not isinstance(raw[1], str)
                or raw[2] not in _CODES or not isinstance(raw[3], list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                           for d in raw[3])):
            raise CorruptCheckpointError(f"{where}: malformed tensor slot {raw!r:.200}")
        slots.append(TensorSlot(check_relpath(raw[0]), raw[1], raw[2], tuple(raw[3])))
    return doc.get("tree"), slots


def build_tree(tree: Any, tensors: list[torch.Tensor], *, where: str) -> Any:
    """Rebuild the user's tree from the tagged encoding."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: malformed state tree ({what})")

    def dec(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsafeCheckpointError(f"{where}: state tree nested deeper than {MAX_DEPTH}")
        if node is None or isinstance(node, (bool, int, float, str, bytes)):
            return node
        if not isinstance(node, list) or len(node) != 2 or not isinstance(node[0], str):
            raise bad(f"unexpected node {node!r:.80}")
        tag, payload = node
        if tag == _TENSOR:
            if not isinstance(payload, int) or isinstance(payload, bool) or not (
                0 <= payload < len(tensors)
            ):
                raise bad(f"tensor reference {payload!r}")
            return tensors[payload]
        if tag == _DICT:
            if not isinstance(payload, list):
                raise bad("dict payload")
            out: dict[Any, Any] = {}
            for item in payload:
                if not isinstance(item, list) or len(item) != 2:
                    raise bad("dict item")
                key = dec(item[0], depth + 1)
                try:
                    out[key] = dec(item[1], depth + 1)
                except TypeError:
                    raise bad(f"unhashable key {key!r:.80}") from None
            return out
        if tag in (_LIST, _TUPLE, _SIZE):
            if not isinstance(payload, list):
                raise bad("sequence payload")
            items = [dec(v, depth + 1) for v in payload]
            if tag == _LIST:
                return items
            if tag == _SIZE:
                if not all(isinstance(i, int) for i in items):
                    raise bad("torch.Size of non-ints")
                return torch.Size(items)
            return tuple(items)
        if tag == _BIGINT:
            if not isinstance(payload, str) or len(payload) > 4300:
                raise bad("big int")
            try:
                return int(payload)
            except ValueError:
                raise bad("big int") from None
        if tag == _DTYPE:
            dt = getattr(torch, str(payload), None)
            if not isinstance(dt, torch.dtype):
                raise bad(f"dtype {payload!r:.40}")
            return dt
        raise bad(f"unknown tag {tag!r:.20}")

    return dec(tree, 0)


@dataclass(frozen=True)
class HeaderEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def parse_safetensors_header(buf: bytes | bytearray | memoryview, *, where: str
                             ) -> tuple[int, dict[str, HeaderEntry]]:
    """Parse and bound-check a safetensors header held at the start of ``buf`` (the whole file).

    Returns (data start offset, entries).  The header length is checked against the file size
    before it is read; offsets must tile the data region exactly, as the format requires."""
    size = len(buf)
    if size < 8:
        raise CorruptCheckpointError(f"{where}: {size} bytes is too short for safetensors")
    (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
    if hlen > min(MAX_HEADER_BYTES, size - 8):
        raise UnsafeCheckpointError(
            f"{where}: safetensors header length {hlen} exceeds the file ({size} B) or the "
            f"{MAX_HEADER_BYTES}-byte limit"
        )
    try:
        header = json.loads(bytes(buf[8:8 + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: safetensors header is not an object")
    start = 8 + hlen
    data_len = size - start
    entries: dict[str, HeaderEntry] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if (dtype not in _CODES or not all(isinstance(d, int) and d >= 0 for d in shape)
                    or not isinstance(begin, int) or not isinstance(end, int)
                    or not 0 <= begin <= end <= data_len):
                raise ValueError
            nelem = math.prod(shape)
            if nelem * torch.empty((), dtype=_CODES[dtype]).element_size() != end - begin:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(
                f"{where}: safetensors entry {name!r:.80} is malformed or out of bounds"
            ) from None
        entries[name] = HeaderEntry(dtype, shape, begin, end)
        spans.append((begin, end))
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise CorruptCheckpointError(f"{where}: safetensors data has a gap or overlap")
        pos = end
    if pos != data_len:
        raise CorruptCheckpointError(f"{where}: safetensors data region has trailing bytes")
    return start, entries


def tensors_from_buffer(buf: bytearray | memoryview, *, where: str) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buf`` (a whole safetensors file) without copying."""
    start, entries = parse_safetensors_header(buf, where=where)
    out = {}
    for name, e in entries.items():
        dtype = _CODES[e.dtype]
        if e.end == e.begin:
            out[name] = torch.empty(e.shape, dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=torch.uint8, count=e.end - e.begin,
                                 offset=start + e.begin)
            out[name] = t.view(dtype).reshape(e.shape)
    return out


def dtype_code(dtype: torch.dtype) -> str:
    return _DTYPES[dtype]


def supported_dtypes() -> list[torch.dtype]:
    return list(_DTYPES)
