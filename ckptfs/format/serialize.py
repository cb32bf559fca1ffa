"""Turning a state tree into files, and files back into the tree.  No pickle anywhere.

A state is a tree of dicts, lists and tuples whose leaves are tensors or plain values.  Saving
splits it in two:

* ``state.msgpack``: the tree with every tensor replaced by a reference, as *tagged* msgpack
  (every container is ``[tag, payload]``), so int keys, tuples, big ints and ``bytes`` survive
  exactly and a reader never has to guess;
* ``tensors-NNNNN.safetensors``: the tensor bytes, streamed straight from each tensor's memory
  (no intermediate copy of the state), in files the ``safetensors`` library opens itself.

Tensors that are the same view of the same storage (tied weights) are stored once and come back
as one tensor object in every place they appeared (`tensor_identity` is the one definition
of "the same tensor", used by every writer).  Other aliasing (overlapping but different views)
is not preserved: each view is stored and loaded as an independent tensor.

`plan_state` does all the work that reads the state, once: every non-tensor value
(extension types included) is encoded into the ``state.msgpack`` bytes, and the tensors are
collected in a `StatePlan`, whose files read only the plan's own tensors when written.
An asynchronous save copies exactly those tensors and rebinds the plan to the copies
(`StatePlan.rebind`), so nothing of the caller's state is read after it returns.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from ckptfs.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format.extensions import (
    EXT_TAG,
    IN_PAYLOAD,
    decode_extension,
    encoder_for,
    refusal,
    reporting_key_paths,
)
from ckptfs.format.layout import STATE_NAME, check_relpath, tensor_file_name
from ckptfs.format.limits import (
    MAX_BIGINT_DIGITS,
    MAX_DEPTH,
    MAX_FILE_SIZE,
    MAX_FILES,
    MAX_HEADER_BYTES,
    MAX_STATE_DOC_BYTES,
)
from ckptfs.format.manifest import bigint_text, unique_pairs
from ckptfs.format.sharding_plan import plan_shards

STATE_SCHEMA = "ckptfs.state"
STATE_FORMAT_VERSION = 1
DEFAULT_SHARD_BYTES = 512 * 1024 * 1024
#: A shard is closed once its estimated safetensors header reaches this, so many small tensors
#: never make a header the reader (and the safetensors library) would refuse.
SHARD_HEADER_BUDGET = MAX_HEADER_BYTES // 2

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
CODE_DTYPES: dict[str, torch.dtype] = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE: dict[str, int] = {code: torch.empty((), dtype=dt).element_size()
                             for code, dt in CODE_DTYPES.items()}

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


def key_str(path: tuple[Any, ...]) -> str:
    """A key path for messages: ``model/layers/0/weight``; very deep paths are abbreviated."""
    parts = [str(p) for p in path if p is not IN_PAYLOAD]
    if len(parts) > 12:
        parts = [*parts[:4], f"...({len(parts) - 8} more)...", *parts[-4:]]
    text = "/".join(p if len(p) <= 80 else f"{p[:77]}..." for p in parts)
    return text or "<root>"


_BIGINT_RE = re.compile(r"-?(?:0|[1-9][0-9]*)")


def tensor_identity(t: torch.Tensor) -> tuple[Any, ...]:
    """Everything that makes two tensor objects read the same values: the storage (by object,
    not address: empty storages all have address 0), the view's geometry, and the lazy
    conjugate/negative bits.  Two tensors with equal identities are one tensor to the format
    (stored once, loaded as one object); this is the only definition of it in ckptfs."""
    st = t.untyped_storage()
    return (t.device, st._cdata, st.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t.is_conj(), t.is_neg())


def _is_dispatch_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass with its own ``__torch_dispatch__`` (DTensor, FakeTensor, jagged
    nested tensors, float8/quantized wrappers...): its Python object does not own plain memory,
    so its bytes cannot be streamed.  Plain subclasses (``nn.Parameter``) are fine."""
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def check_tensor(t: torch.Tensor, where: str) -> None:
    """Raise `UnsupportedValueError` naming the key path ``where`` for a tensor the
    format cannot store (a wrapper subclass, nested, sparse, quantized or of a dtype safetensors
    lacks, on the meta device, with dimension names).  Every writer checks every tensor with
    this before anything is written: the single-process serializer, and the sharded save's
    planner (its DTensors by their local shards)."""
    if _is_dispatch_subclass(t) and type(t).__qualname__ == "ShardedTensor":
        raise UnsupportedValueError(  # FSDP1's: its shards are saved collectively
            f"tensor at {where!r} is a ShardedTensor (FSDP1's SHARDED_STATE_DICT), which only "
            "a collective save stores (each rank its shards): call store.save on every rank "
            "with torch.distributed initialized (a job of one rank: pass process_group=), or "
            "dcp.save with ckptfs.dcp.Writer")
    if _is_dispatch_subclass(t):
        raise UnsupportedValueError(
            f"tensor at {where!r} is a {type(t).__module__}.{type(t).__qualname__}, a tensor "
            "subclass that does not own plain memory; store plain tensors (a DTensor: "
            ".full_tensor() or .to_local(); other wrappers: their inner tensors)")
    if t.is_nested:
        raise UnsupportedValueError(
            f"tensor at {where!r} is a nested tensor; store its components "
            "(t.unbind()) or a padded tensor (t.to_padded_tensor(0))")
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedValueError(
            f"tensor at {where!r} has layout {t.layout}; convert with .to_dense()")
    if t.is_quantized or t.dtype not in _DTYPES:
        raise UnsupportedValueError(
            f"tensor at {where!r} has dtype {t.dtype}, which safetensors cannot "
            f"store; supported: {sorted(str(d) for d in _DTYPES)}"
        )
    if t.device.type == "meta":
        raise UnsupportedValueError(
            f"tensor at {where!r} is on the meta device (it has no data); materialize it "
            "first (e.g. model.to_empty(device=...) and initialise it)")
    names = tuple(getattr(t, "names", ()))  # named tensors (not in torch's stubs)
    if any(n is not None for n in names):
        raise UnsupportedValueError(
            f"tensor at {where!r} has dimension names {names}, which the format does not "
            "store; drop them with .rename(None)")


class Flattener:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self.tops: list[Any] = []  # each tensor's top-level key (its file group)
        self._ids: dict[tuple[Any, ...], int] = {}
        self._stack: set[int] = set()
        #: (size, key path) of the largest str/bytes value, for a too-large state.msgpack.
        self.largest: tuple[int, str] = (0, "")

    def encode(self, value: Any, path: tuple[Any, ...], in_key: bool = False) -> Any:
        if len(path) > MAX_DEPTH:
            raise UnsupportedValueError(
                f"state nested deeper than {MAX_DEPTH} levels at key path {key_str(path)!r} "
                f"(depth {len(path)}); flatten it or store the deep part as bytes")
        if (ext := encoder_for(value)) is not None:  # registered extension type (extensions.py)
            payload = ext.payload(value, lambda: key_str(path))
            return [EXT_TAG, [ext.name, self.encode(payload, (*path, IN_PAYLOAD), in_key)]]
        if isinstance(value, torch.Tensor):
            if in_key:
                raise UnsupportedValueError(
                    f"a dict key at {key_str(path)!r} contains a tensor; keys must be str, "
                    "int, float, bool, None, bytes or tuples of those")
            return [_TENSOR, self._add_tensor(value, path)]
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, (str, bytes)):
            if isinstance(value, str):
                try:
                    size = len(value.encode("utf-8"))
                except UnicodeEncodeError as exc:
                    raise UnsupportedValueError(
                        f"string at key path {key_str(path)!r} is not valid Unicode "
                        f"({exc.reason} at index {exc.start}); it cannot be stored as UTF-8. "
                        "Store it as bytes") from None
                value = str(value)
            else:
                size = len(value)
                value = bytes(value)
            if size > self.largest[0]:
                self.largest = (size, key_str(path))
            return value
        if isinstance(value, int):
            value = int(value)
            if _INT64_MIN <= value <= _UINT64_MAX:
                return value
            text = bigint_text(value)
            if text is None:
                raise UnsupportedValueError(
                    f"int at key path {key_str(path)!r} has more than {MAX_BIGINT_DIGITS} "
                    "decimal digits (the format's limit, Python's int/str conversion limit); "
                    "store it as bytes (value.to_bytes(...)) or as a tensor")
            return [_BIGINT, text]
        if isinstance(value, float):
            return float(value)
        if isinstance(value, torch.dtype):
            return [_DTYPE, str(value).removeprefix("torch.")]
        if isinstance(value, (Mapping, list, tuple)):
            if in_key and not isinstance(value, tuple):
                raise UnsupportedValueError(
                    f"a dict key at {key_str(path)!r} contains a {type(value).__name__}")
            if id(value) in self._stack:
                raise UnsupportedValueError(
                    f"state contains a reference cycle at key path {key_str(path)!r}: a "
                    "container that contains itself cannot be stored")
            self._stack.add(id(value))
            try:
                if isinstance(value, Mapping):
                    items = []
                    for k, v in value.items():
                        if not isinstance(k, (str, int, float, bool, type(None), bytes, tuple)
                                          ) and encoder_for(k) is None:
                            raise UnsupportedValueError(
                                f"state key {k!r:.80} at {key_str(path)!r} has type "
                                f"{type(k).__name__}; keys must be str, int, float, bool, None, "
                                "bytes or tuples of those"
                            )
                        items.append([self.encode(k, (*path, "<key>"), True),
                                      self.encode(v, (*path, k))])
                    return [_DICT, items]
                seq = [self.encode(v, (*path, i), in_key) for i, v in enumerate(value)]
                if isinstance(value, torch.Size):
                    return [_SIZE, seq]
                return [_TUPLE if isinstance(value, tuple) else _LIST, seq]
            finally:
                self._stack.discard(id(value))
        if in_key:
            raise UnsupportedValueError(
                f"a dict key at {key_str(path)!r} contains a {type(value).__name__}; keys must "
                "be str, int, float, bool, None, bytes or tuples of those")
        raise refusal(value, key_str(path))

    def _add_tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> int:
        where = key_str(path)
        check_tensor(t, where)
        try:
            ident = tensor_identity(t)
        except (RuntimeError, NotImplementedError) as exc:
            raise UnsupportedValueError(
                f"tensor at {where!r} ({type(t).__qualname__} on {t.device}) has no storage "
                f"ckptfs can read ({exc}); store a plain CPU or CUDA tensor") from None
        index = self._ids.get(ident)
        if index is None:
            index = len(self.tensors)
            self._ids[ident] = index
            self.tensors.append(t)
            self.names.append("/".join(str(p) for p in path if p is not IN_PAYLOAD))
            self.tops.append(path[0] if path else None)
        return index


@dataclass(frozen=True)
class TensorFile:
    """One planned safetensors file: its header (with the 8-byte length prefix), then the data
    of the plan's tensors ``members`` (indices into `StatePlan.tensors`), in order."""

    path: str
    prefix: bytes
    members: tuple[int, ...]
    size: int
    #: each member's (name in the file, dtype code, shape), in file order
    entries: tuple[tuple[str, str, tuple[int, ...]], ...] = ()

    @property
    def pieces(self) -> list[int]:
        """The file's chunks (format v2/v3): its header, then each tensor's bytes."""
        return [len(self.prefix)] + [math.prod(shape) * _ITEMSIZE[dtype]
                                     for _, dtype, shape in self.entries]


@dataclass(frozen=True, eq=False)
class StatePlan:
    """A validated state, ready to write: ``document`` (the bytes of ``state.msgpack``, every
    non-tensor value already encoded), the tensor files' layout, and ``tensors`` (one per
    distinct `tensor_identity`, index order), the only part of the state it still reads.

    `files` stream the tensors' bytes when written (nothing is copied at planning).
    `rebind` gives the same plan over other tensors of the same dtypes and shapes (an
    asynchronous save's staged copies)."""

    document: bytes
    tensor_files: tuple[TensorFile, ...]
    tensors: tuple[torch.Tensor, ...]
    #: What `relayout` needs to plan the files again over part of the tensors (an
    #: incremental save that references the others): the encoded tree, each tensor's name
    #: (its key path) and top-level key, and the slots of tensors stored elsewhere.
    tree: Any = None
    names: tuple[str, ...] = ()
    tops: tuple[Any, ...] = ()
    shard_bytes: int = DEFAULT_SHARD_BYTES
    external: dict[int, TensorSlot] = field(default_factory=dict)
    #: Each tensor's name in the files (``names`` with a ``#n`` suffix on a clash) and the
    #: caller's tensors' ``(data_ptr, _version)`` at planning (kept by `rebind`): what an
    #: incremental save takes as a hint of what did not change.
    versions: tuple[tuple[int, int], ...] = ()
    files: list[PlannedFile] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tensors = self.tensors
        doc = self.document
        files = [PlannedFile(STATE_NAME, len(doc), lambda: iter([memoryview(doc)]))]
        files += [PlannedFile(tf.path, tf.size, _tensor_chunks(tf, tensors))
                  for tf in self.tensor_files]
        object.__setattr__(self, "files", files)

    @property
    def tensor_count(self) -> int:
        return len(self.tensors)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the tensor files (headers included)."""
        return sum(tf.size for tf in self.tensor_files)

    def rebind(self, tensors: Sequence[torch.Tensor]) -> StatePlan:
        """This plan over ``tensors`` instead of `tensors`: the same document and files,
        the bytes read from ``tensors[i]`` in place of ``self.tensors[i]``.  Each must have the
        same dtype and shape (the layout depends on nothing else)."""
        if len(tensors) != len(self.tensors):
            raise ValueError(f"rebind: {len(tensors)} tensors for a plan of "
                             f"{len(self.tensors)}")
        for i, (new, old) in enumerate(zip(tensors, self.tensors, strict=True)):
            if new.dtype != old.dtype or new.shape != old.shape:
                raise ValueError(f"rebind: tensor {i} is {new.dtype}{list(new.shape)}, the "
                                 f"plan's is {old.dtype}{list(old.shape)}")
        return StatePlan(self.document, self.tensor_files, tuple(tensors), self.tree,
                         self.names, self.tops, self.shard_bytes, dict(self.external),
                         self.versions)

    def slots(self) -> list[TensorSlot]:
        """Where each tensor is stored (its file and name there), index order."""
        out: list[TensorSlot | None] = [None] * len(self.tensors)
        for i, slot in self.external.items():
            out[i] = slot
        for tf in self.tensor_files:
            for i, (name, dtype, shape) in zip(tf.members, tf.entries, strict=True):
                out[i] = TensorSlot(tf.path, name, dtype, shape)
        return [s for s in out if s is not None]


def plan_state(state: Any, *, shard_bytes: int = DEFAULT_SHARD_BYTES) -> StatePlan:
    """Validate ``state`` and plan its files.  Raises `UnsupportedValueError` naming the
    key path of the first value the format cannot hold, before any byte is written.  The state
    is traversed once; afterwards the plan reads only `StatePlan.tensors`."""
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(
            "state must be a dict (e.g. {'model': model.state_dict()}), got "
            f"{type(state).__name__}"
        )
    flat = Flattener()
    try:
        tree = flat.encode(state, ())
    except RecursionError:
        raise UnsupportedValueError(
            "state is nested too deeply for Python's stack (the format allows "
            f"{MAX_DEPTH} levels); flatten it") from None

    if flat.largest[0] > MAX_STATE_DOC_BYTES:
        raise _state_doc_too_large(flat.largest[0], flat)
    versions = tuple(version_of(t) for t in flat.tensors)
    plan = relayout(StatePlan(b"", (), tuple(flat.tensors), tree, tuple(flat.names),
                              tuple(flat.tops), shard_bytes, {}, versions), {})
    if len(plan.document) > MAX_STATE_DOC_BYTES:
        raise _state_doc_too_large(len(plan.document), flat)
    return plan


def version_of(t: torch.Tensor) -> tuple[int, int]:
    """The reuse hint of a tensor (incremental saves): its storage address and autograd version
    counter."""
    try:
        return t.data_ptr(), t._version
    except (RuntimeError, NotImplementedError, AttributeError):  # pragma: no cover
        return -1, -1


def relayout(plan: StatePlan, external: dict[int, TensorSlot]) -> StatePlan:
    """``plan`` with the tensors of ``external`` (index -> where another file already holds
    them) left out of its files, and its document naming them there.  The other tensors are
    sharded as `plan_state` shards them (by top-level key, then element size)."""
    tensors = plan.tensors
    shard_bytes = plan.shard_bytes
    todo = [i for i in range(len(tensors)) if i not in external]
    # Shards: by top-level key (format/sharding_plan.py: "model" alone is cheap to load), then
    # sorted inside a shard by element size so every tensor's offset is aligned to its element
    # size (safetensors forbids gaps).
    shards = plan_shards([tensors[i].numel() * tensors[i].element_size() for i in todo],
                         [_header_entry_estimate(plan.names[i], tensors[i]) for i in todo],
                         [plan.tops[i] for i in todo], shard_bytes=shard_bytes,
                         header_budget=SHARD_HEADER_BUDGET)
    shards = [[todo[j] for j in members] for members in shards]
    if len(shards) + len({s.file for s in external.values()}) + 1 > MAX_FILES:
        raise UnsupportedValueError(
            f"the state would need {len(shards) + 1} files, more than the format's {MAX_FILES}; "
            f"raise shard_bytes (now {shard_bytes})")

    slots: list[TensorSlot | None] = [None] * len(tensors)
    for i, slot in external.items():
        slots[i] = slot
    tensor_files: list[TensorFile] = []
    for sidx, members in enumerate(shards):
        fname = tensor_file_name(sidx)
        members = sorted(members, key=lambda i: -tensors[i].element_size())
        used: set[str] = {_HEADER_METADATA}  # a tensor may not shadow the metadata entry
        entries: list[tuple[str, torch.Tensor]] = []
        described: list[tuple[str, str, tuple[int, ...]]] = []
        for i in members:
            name = plan.names[i]
            n = 1
            while name in used:
                n += 1
                name = f"{plan.names[i]}#{n}"
            used.add(name)
            t = tensors[i]
            slots[i] = TensorSlot(fname, name, _DTYPES[t.dtype], tuple(t.shape))
            entries.append((name, t))
            described.append((name, _DTYPES[t.dtype], tuple(t.shape)))
        prefix, size = _safetensors_prefix(fname, entries)
        tensor_files.append(TensorFile(fname, prefix, tuple(members), size, tuple(described)))

    doc = {
        "schema": STATE_SCHEMA,
        "format_version": STATE_FORMAT_VERSION,
        "tree": plan.tree,
        "tensors": [[s.file, s.name, s.dtype, list(s.shape)] for s in slots if s is not None],
    }
    try:
        blob = msgpack.packb(doc, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as exc:  # pragma: no cover - encode() checks
        raise UnsupportedValueError(f"state cannot be encoded as msgpack: {exc}") from exc
    if len(blob) > MAX_STATE_DOC_BYTES:
        raise UnsupportedValueError(
            f"the state's non-tensor part (state.msgpack) would be {len(blob)} B, more than the "
            f"format's {MAX_STATE_DOC_BYTES} B limit")
    return StatePlan(blob, tuple(tensor_files), tensors, plan.tree, plan.names, plan.tops,
                     shard_bytes, dict(external), plan.versions)


_HEADER_METADATA = "__metadata__"


def _header_entry_estimate(name: str, t: torch.Tensor) -> int:
    """An upper bound of the bytes ``name``'s entry adds to a safetensors header (name as JSON,
    a ``#n`` suffix, dtype, shape and two offsets)."""
    return len(json.dumps(name)) + len(json.dumps(list(t.shape))) + 128


def _state_doc_too_large(size: int, flat: Flattener) -> UnsupportedValueError:
    biggest, where = flat.largest
    hint = (f"; its largest value is {biggest} B of str/bytes at key path {where!r}: store "
            "large blobs as uint8 tensors (torch.frombuffer)" if biggest else "")
    return UnsupportedValueError(
        f"the state's non-tensor part (state.msgpack) would be at least {size} B, more than the "
        f"format's {MAX_STATE_DOC_BYTES} B limit{hint}")


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` as a plain contiguous CPU tensor (copied only if it is on another
    device, strided, or a lazy conjugate/negative view): the one way every writer gets the
    bytes it stores."""
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


def _safetensors_prefix(fname: str, entries: list[tuple[str, torch.Tensor]]
                        ) -> tuple[bytes, int]:
    """The length prefix and header of a safetensors file holding ``entries`` in order, and
    the file's size."""
    header: dict[str, Any] = {_HEADER_METADATA: {"format": "pt", "producer": "ckptfs"}}
    offset = 0
    for name, t in entries:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    if len(hbytes) > MAX_HEADER_BYTES:
        longest = max((n for n, _ in entries), key=len)
        raise UnsupportedValueError(
            f"{fname}: its safetensors header would be {len(hbytes)} B, more than the "
            f"{MAX_HEADER_BYTES}-byte limit; the longest tensor key path is "
            f"{key_str(tuple(longest.split('/')))!r} ({len(longest)} characters): shorten keys")
    prefix = struct.pack("<Q", len(hbytes)) + hbytes
    size = len(prefix) + offset
    if size > MAX_FILE_SIZE:
        raise UnsupportedValueError(
            f"{fname} would be {size} B, more than the format's {MAX_FILE_SIZE}-byte file limit; "
            "lower shard_bytes or split the largest tensor")
    return prefix, size


def _tensor_chunks(tf: TensorFile, tensors: tuple[torch.Tensor, ...]
                   ) -> Callable[[], Iterator[memoryview]]:
    """The bytes of ``tf``, streamed from ``tensors`` (regenerated from the start on a retry)."""

    def chunks() -> Iterator[memoryview]:
        yield memoryview(tf.prefix)
        for i in tf.members:
            ct = cpu_contiguous(tensors[i])  # one at a time: copies only if non-contiguous/GPU
            view = tensor_memoryview(ct)
            step = 16 * 1024 * 1024
            for start in range(0, len(view), step):
                yield view[start:start + step]
            del view, ct

    return chunks


# ----------------------------------------------------------------------------------------------
# Loading


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def decode_state_doc(data: bytes, *, where: str) -> tuple[Any, list[TensorSlot]]:
    """Parse ``state.msgpack`` bytes into (tagged tree, tensor slots).  Typed errors only:
    `FormatVersionError` for a newer state format, `UnsafeCheckpointError` for
    extension types or a document over the size limit, `CorruptCheckpointError` else."""
    if len(data) > MAX_STATE_DOC_BYTES:
        raise UnsafeCheckpointError(
            f"{where}: {len(data)} bytes exceeds the {MAX_STATE_DOC_BYTES}-byte limit")

    def no_ext(code: int, payload: bytes) -> Any:
        raise UnsafeCheckpointError(f"{where}: msgpack extension type {code} is not allowed")

    try:
        doc = msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=no_ext, use_list=True,
            object_pairs_hook=unique_pairs)
    except UnsafeCheckpointError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError, RecursionError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{where}: not a valid state document ({exc!r})") from None
    if not isinstance(doc, dict) or doc.get("schema") != STATE_SCHEMA:
        raise CorruptCheckpointError(f"{where}: not a ckptfs state document")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptCheckpointError(f"{where}: bad state format_version {version!r:.40}")
    if version > STATE_FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: state written by format version {version}; this ckptfs reads up to "
            f"{STATE_FORMAT_VERSION}: upgrade ckptfs")
    if "tree" not in doc:
        raise CorruptCheckpointError(f"{where}: the state document has no 'tree'")
    raw_slots = doc.get("tensors")
    if not isinstance(raw_slots, list):
        raise CorruptCheckpointError(f"{where}: 'tensors' is not a list")
    slots = []
    for raw in raw_slots:
        if (not isinstance(raw, list) or len(raw) != 4 or not isinstance(raw[1], str)
                or raw[1] == _HEADER_METADATA or not isinstance(raw[2], str)
                or raw[2] not in CODE_DTYPES
                or not isinstance(raw[3], list)
                or not all(_is_int(d) and d >= 0 for d in raw[3])):
            raise CorruptCheckpointError(f"{where}: malformed tensor slot {raw!r:.200}")
        slots.append(TensorSlot(check_relpath(raw[0]), raw[1], raw[2], tuple(raw[3])))
    return doc["tree"], slots


def build_tree(tree: Any, tensors: list[torch.Tensor], *, where: str) -> Any:
    """Rebuild the user's tree from the tagged encoding."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: malformed state tree ({what})")

    def dec(node: Any, depth: int, in_key: bool = False) -> Any:
        if depth > MAX_DEPTH:
            raise UnsafeCheckpointError(f"{where}: state tree nested deeper than {MAX_DEPTH}")
        if node is None or isinstance(node, (bool, int, float, str, bytes)):
            return node
        if not isinstance(node, list) or len(node) != 2 or not isinstance(node[0], str):
            raise bad(f"unexpected node {node!r:.80}")
        tag, payload = node
        if tag == _TENSOR:
            if in_key:
                raise bad("tensor reference inside a dict key")
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
                key = dec(item[0], depth + 1, True)
                try:
                    if key in out:
                        raise bad(f"duplicate key {key!r:.80}")
                except TypeError:
                    raise bad(f"unhashable key {key!r:.80}") from None
                out[key] = dec(item[1], depth + 1)
            return out
        if tag in (_LIST, _TUPLE, _SIZE):
            if not isinstance(payload, list):
                raise bad("sequence payload")
            items = [dec(v, depth + 1, in_key) for v in payload]
            if tag == _LIST:
                return items
            if tag == _SIZE:
                if not all(_is_int(i) and _INT64_MIN <= i < 2**63 for i in items):
                    raise bad("torch.Size of non-ints")
                return torch.Size(items)
            return tuple(items)
        if tag == _BIGINT:
            if (not isinstance(payload, str) or len(payload.lstrip("-")) > MAX_BIGINT_DIGITS
                    or not _BIGINT_RE.fullmatch(payload)):
                raise bad("big int")
            try:
                return int(payload)
            except ValueError:  # the process lowered sys.set_int_max_str_digits
                raise bad(f"big int of {len(payload)} characters: this Python's int/str "
                          "conversion limit is lower than the format's") from None
        if tag == _DTYPE:
            dt = getattr(torch, payload, None) if isinstance(payload, str) else None
            if not isinstance(dt, torch.dtype):
                raise bad(f"dtype {payload!r:.40}")
            return dt
        if tag == EXT_TAG:  # an extension value: its type name must be registered here
            return decode_extension(payload, lambda p: dec(p, depth + 1, in_key), node)
        raise bad(f"unknown tag {tag!r:.20}")

    try:
        return reporting_key_paths(lambda: dec(tree, 0), tree, where)
    finally:
        # ``dec`` refers to itself through its closure: a reference cycle holding ``tensors``
        # until the cyclic collector runs (a load's whole state outliving it).  Broken here.
        dec = None  # type: ignore[assignment]


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
        header = json.loads(bytes(buf[8:8 + hlen]).decode("utf-8"),
                            object_pairs_hook=unique_pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: safetensors header is not an object")
    meta = header.get(_HEADER_METADATA, {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(
            f"{where}: safetensors __metadata__ is not an object of strings")
    start = 8 + hlen
    data_len = size - start
    entries: dict[str, HeaderEntry] = {}
    spans = []
    for name, info in header.items():
        if name == _HEADER_METADATA:
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if (dtype not in CODE_DTYPES or not all(_is_int(d) and d >= 0 for d in shape)
                    or not _is_int(begin) or not _is_int(end)
                    or not 0 <= begin <= end <= data_len):
                raise ValueError
            nelem = math.prod(shape)
            if nelem * torch.empty((), dtype=CODE_DTYPES[dtype]).element_size() != end - begin:
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
        dtype = CODE_DTYPES[e.dtype]
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
