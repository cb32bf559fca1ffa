"""A rank's local save plan as columns: the table the coordinator of a collective save plans over.

Design decision: **the coordinator of a collective save plans in columns, never with one
object per write item.**  At 4,096 ranks a one-layer slice of a 70B model is 200,000 write
items; building DCP's ``WriteItem`` objects for them, deduplicating and checking them one by one
and deriving the metadata from them cost the coordinator 3-4 s before any rank wrote a byte
(docs/benchmarks.md).  Here a rank's local plan (`LocalTable`) is two parts:

* its **skeleton** (`Skeleton`): per write item its name, kind, tensor properties, global size,
  index hint and how its index offset is given.  It is the same on every rank of an SPMD job
  (every rank holds a shard of every parameter), so the coordinator decodes it once per
  distinct document (`ckptfs.protocol.plan_docs`), not once per rank;
* its **numbers**: per tensor item the chunk's offsets and sizes (and an index offset of its
  own where it is not the chunk's), int64 in one array.

Each part has its document here (the skeleton and the planner data as msgpack, the numbers as
int64 bytes, each as base64 text) and the plan its layout digest (`layout_of`), computed of
those documents by the rank that sends them and again by the coordinator that receives them.
`ckptfs.protocol.global_plan` makes the global plan of every rank's table.
"""

from __future__ import annotations

import array
import hashlib
import re
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ckptfs.protocol.group import decode_bytes, encode_bytes

__all__ = ["KEY_CHUNK", "KEY_NONE", "SMALL_REPLICATED_BYTES", "LocalTable", "PlanMappings", "Row",
           "Skeleton", "decode_numbers", "decode_planner_data", "decode_skeleton",
           "encode_numbers", "encode_planner_data", "layout_of"]

#: A row's index offset is its chunk's offsets (every item DCP's planner makes of a tensor).
KEY_CHUNK = -2
#: A row's index offset is None (a value).
KEY_NONE = -1
#: A replicated tensor at most this large is stored by the lowest rank holding it, with
#: ``gather_small`` (format v5; ``ckptfs.protocol.global_plan``).
SMALL_REPLICATED_BYTES = 1 << 20


@dataclass(frozen=True)
class Row:
    """One write item of a skeleton: ``props`` indexes `Skeleton.properties` (-1 for a value),
    ``size`` is the tensor's (``()`` for a value), ``nbytes`` a value's declared size (None:
    none declared), ``key`` how the index offset is given (`KEY_CHUNK`, `KEY_NONE`, or k >= 0:
    k numbers of its own), ``dims`` the chunk's dimensions (0 for a value) and ``start`` where
    the item's numbers begin in a rank's array: the index offset's k numbers, then the chunk's
    offsets, then its sizes."""

    fqn: str
    kind: WriteItemType
    props: int
    size: tuple[int, ...]
    hint: int | None
    nbytes: int | None
    key: int
    dims: int
    start: int

    @property
    def width(self) -> int:
        return max(self.key, 0) + 2 * self.dims


@dataclass(frozen=True)
class Skeleton:
    """What a local plan's items are but for their chunks (module docstring).  ``blob`` is its
    document (`ckptfs.protocol.plan_docs`): two skeletons with one blob are one."""

    properties: tuple[TensorProperties, ...]
    rows: tuple[Row, ...]
    width: int
    blob: str


class PlanMappings(dict):  # type: ignore[type-arg]
    """DCP's flattening map of one rank's save plan, carrying that rank's state skeleton
    (``tree``) to the coordinator, which merges the maps as DCP's ``ChainMap`` does."""

    tree: Any = None
    #: Per item of the plan, the digest of this rank's copy where other ranks may hold it
    #: too (0: not hashed; None: nothing hashed): `ckptfs.protocol.replicas`.
    replicas: list[int] | None = None


@dataclass(eq=False)
class LocalTable:
    """One rank's local save plan in columns: its skeleton, its numbers (int64, the
    skeleton's ``width``), the step it saves, DCP's ``usable`` and its planner data (the
    flattening map, with the rank's state skeleton ``tree``); ``texts``, the documents of the
    numbers and the planner data, and ``layout``, the digest of what the plan is made of (the
    skeleton's, the planner data's and the numbers' documents: `layout_of`).  ``items``: the
    plan's own write items where the table was made of a plan (`of_plan`)."""

    skeleton: Skeleton
    numbers: torch.Tensor
    step: Any
    usable: bool
    planner_data: Any
    texts: tuple[str, str | None]
    layout: str
    items: list[WriteItem] | None = None
    #: Per item, the digest of this rank's copy where other ranks may hold it too (0: not
    #: hashed); None: nothing hashed.  Not part of the layout: it changes with the values.
    replicas: torch.Tensor | None = None

    @classmethod
    def of_plan(cls, plan: SavePlan) -> LocalTable:
        """The table of ``plan`` (a rank's local save plan)."""
        props: list[TensorProperties] = []
        seen: dict[Any, int] = {}
        rows: list[Row] = []
        numbers: list[int] = []
        for item in plan.items:
            idx, td = item.index, item.tensor_data
            if td is None:
                key = KEY_NONE if idx.offset is None else len(idx.offset)
                if idx.offset is not None:
                    numbers += idx.offset
                nbytes = None if item.bytes_io_data is None else int(item.bytes_io_data.nbytes)
                rows.append(Row(idx.fqn, item.type, -1, (), idx.index, nbytes, key, 0,
                                len(numbers) - max(key, 0)))
                continue
            c, p = td.chunk, td.properties
            if len(c.offsets) != len(c.sizes):
                raise ValueError(f"write item {idx.fqn!r:.80}: a chunk of {len(c.offsets)} "
                                 f"offsets and {len(c.sizes)} sizes")
            pkey = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
            k = seen.get(pkey)
            if k is None:
                k = seen[pkey] = len(props)
                props.append(p)
            start = len(numbers)
            if idx.offset is None:
                key = KEY_NONE
            elif tuple(idx.offset) == tuple(c.offsets):
                key = KEY_CHUNK
            else:
                key = len(idx.offset)
                numbers += idx.offset
            numbers += c.offsets
            numbers += c.sizes
            rows.append(Row(idx.fqn, item.type, k, tuple(int(s) for s in td.size), idx.index,
                            None, key, len(c.offsets), start))
        blob = _encode_skeleton(props, rows)
        skeleton = Skeleton(tuple(props), tuple(rows), len(numbers), blob)
        nums = torch.tensor(numbers, dtype=torch.int64)
        numbers_text, planner_text = encode_numbers(nums), encode_planner_data(plan.planner_data)
        reps = getattr(plan.planner_data, "replicas", None)
        replicas = torch.tensor(reps, dtype=torch.int64) \
            if reps is not None and len(reps) == len(rows) else None
        return cls(skeleton, nums, plan.storage_data, bool(plan.usable), plan.planner_data,
                   (numbers_text, planner_text), layout_of(blob, numbers_text, planner_text),
                   list(plan.items), replicas)

    def write_items(self) -> list[WriteItem]:
        """DCP's write items of this table (the plan's own where it was made of one)."""
        if self.items is None:
            self.items = _materialize(self.skeleton, self.numbers.tolist())
        return self.items


def _materialize(sk: Skeleton, nums: list[int]) -> list[WriteItem]:
    out: list[WriteItem] = []
    for row in sk.rows:
        s = row.start
        k = max(row.key, 0)
        own = torch.Size(nums[s:s + k]) if row.key >= 0 else None
        if row.props < 0:
            out.append(WriteItem(index=MetadataIndex(row.fqn, own, row.hint), type=row.kind,
                                 bytes_io_data=None if row.nbytes is None
                                 else BytesIOWriteData(nbytes=row.nbytes)))
            continue
        d = row.dims
        offsets = torch.Size(nums[s + k:s + k + d])
        sizes = torch.Size(nums[s + k + d:s + k + 2 * d])
        at = offsets if row.key == KEY_CHUNK else own
        out.append(WriteItem(index=MetadataIndex(row.fqn, at, row.hint), type=row.kind,
                             tensor_data=TensorWriteData(
                                 chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                 properties=sk.properties[row.props],
                                 size=torch.Size(row.size))))
    return out


# ----------------------------------------------------------------------------------------------
# The skeleton's document and the numbers' bytes

_KINDS = {WriteItemType.TENSOR: "tensor", WriteItemType.SHARD: "shard",
          WriteItemType.BYTE_IO: "bytes"}
_KIND_OF = {v: k for k, v in _KINDS.items()}
_TORCH_NAME = re.compile(r"torch\.[A-Za-z0-9_]{1,64}")
#: At most this many dimensions per chunk and numbers per index offset (torch's own bound).
_MAX_DIMS = 64


def _torch_attr(name: Any, kind: type, what: str) -> Any:
    if not isinstance(name, str) or not _TORCH_NAME.fullmatch(name):
        raise ValueError(f"{what}: {name!r:.80} is not a torch name")
    value = getattr(torch, name[len("torch."):], None)
    if not isinstance(value, kind):
        raise ValueError(f"{what}: {name!r:.80} is not a {kind.__name__}")
    return value


def _properties_doc(p: TensorProperties) -> list[Any]:
    # str(): "torch.float32", "torch.strided", "torch.contiguous_format"
    return [str(p.dtype), str(p.layout), bool(p.requires_grad), str(p.memory_format),
            bool(p.pin_memory)]


def _properties_of(raw: Any) -> TensorProperties:
    if not isinstance(raw, list) or len(raw) != 5:
        raise ValueError(f"tensor properties: 5 fields wanted, got {raw!r:.80}")
    dtype = _torch_attr(raw[0], torch.dtype, "dtype")
    layout = _torch_attr(raw[1], torch.layout, "layout")
    memory_format = _torch_attr(raw[3], torch.memory_format, "memory format")
    if type(raw[2]) is not bool or type(raw[4]) is not bool:
        raise ValueError("tensor properties: requires_grad and pin_memory are bools")
    return TensorProperties(dtype=dtype, layout=layout, requires_grad=raw[2],
                            memory_format=memory_format, pin_memory=raw[4])


def _encode_skeleton(props: list[TensorProperties], rows: list[Row]) -> str:
    doc = [[_properties_doc(p) for p in props],
           [[r.fqn, _KINDS[r.kind], r.props, list(r.size), r.hint, r.nbytes, r.key, r.dims]
            for r in rows]]
    return encode_bytes(msgpack.packb(doc, use_bin_type=True))


def _pair(text: Any, what: str, shape: str) -> list[Any]:
    """A plan document's part: base64 text of a msgpack pair whose first is a list, else
    ``ValueError`` naming ``what`` and its ``shape``."""
    if not isinstance(text, str):
        raise ValueError(f"a local save plan's {what}: {shape} as text wanted")
    try:
        doc = msgpack.unpackb(decode_bytes(text), raw=False, use_list=True,
                              strict_map_key=True)
    except Exception as exc:  # not base64, not msgpack
        raise ValueError(f"a local save plan's {what}: {exc}") from exc
    if not (isinstance(doc, list) and len(doc) == 2 and isinstance(doc[0], list)):
        raise ValueError(f"a local save plan's {what}: {shape} wanted")
    return doc


def _is_int(v: Any) -> bool:
    return type(v) is int


def decode_skeleton(blob: Any) -> Skeleton:
    """The skeleton a rank sent (`LocalTable.of_plan`'s ``blob``), every field checked:
    ``ValueError`` naming what is wrong."""
    doc = _pair(blob, "skeleton", "[properties, items]")
    if not isinstance(doc[1], list):
        raise ValueError("a local save plan's skeleton: [properties, items] wanted")
    props = tuple(_properties_of(p) for p in doc[0])
    rows: list[Row] = []
    start = 0
    for raw in doc[1]:
        if not (isinstance(raw, list) and len(raw) == 8 and isinstance(raw[0], str)):
            raise ValueError(f"a write item: {raw!r:.80}")
        fqn, kind_name, k, size, hint, nbytes, key, dims = raw
        kind = _KIND_OF.get(kind_name) if isinstance(kind_name, str) else None
        if kind is None:
            raise ValueError(f"write item {fqn!r:.80}: kind {kind_name!r:.20}")
        if hint is not None and not (_is_int(hint) and hint >= 0):
            raise ValueError(f"write item {fqn!r:.80}: index hint {hint!r:.20}")
        if not (_is_int(key) and KEY_CHUNK <= key <= _MAX_DIMS) or \
                not (_is_int(dims) and 0 <= dims <= _MAX_DIMS):
            raise ValueError(f"write item {fqn!r:.80}: offsets {key!r:.20}/{dims!r:.20}")
        if not (isinstance(size, list) and len(size) <= _MAX_DIMS
                and all(_is_int(x) and x >= 0 for x in size)):
            raise ValueError(f"write item {fqn!r:.80}: size {size!r:.80}")
        if kind == WriteItemType.BYTE_IO:
            if k != -1 or size or dims or key == KEY_CHUNK or \
                    not (nbytes is None or (_is_int(nbytes) and nbytes >= 0)):
                raise ValueError(f"write item {fqn!r:.80}: a value with a tensor's fields")
        elif not (_is_int(k) and 0 <= k < len(props)) or nbytes is not None:
            raise ValueError(f"write item {fqn!r:.80}: properties {k!r:.20}")
        row = Row(fqn, kind, k, tuple(size), hint, nbytes, key, dims, start)
        start += row.width
        rows.append(row)
    return Skeleton(props, tuple(rows), start, blob)


def encode_planner_data(pd: Any) -> str | None:
    """A plan's planner data (ckptfs's planner: the flattening map, with the rank's state
    skeleton) as text: msgpack, base64.  None: none."""
    if pd is None:
        return None
    if not isinstance(pd, dict):
        raise TypeError(f"planner data of type {type(pd).__name__}: ckptfs's planner sends a "
                        "dict")
    tree = getattr(pd, "tree", None)
    blob = msgpack.packb([[[fqn, list(path)] for fqn, path in pd.items()], tree],
                         use_bin_type=True)
    return encode_bytes(blob)


def decode_planner_data(text: Any) -> PlanMappings:
    """`encode_planner_data`'s map, every entry checked: ``ValueError`` naming what is
    wrong."""
    raw = _pair(text, "planner data", "[mappings, tree]")
    mappings = PlanMappings()
    for pair in raw[0]:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], list)
                and all(type(k) in (str, int) for k in pair[1])):
            raise ValueError(f"a flattening map entry: {pair!r:.80}")
        mappings[pair[0]] = tuple(pair[1])
    mappings.tree = raw[1]
    return mappings


def _digest(text: str | None) -> str:
    return "-" if text is None else hashlib.sha256(text.encode()).hexdigest()


def layout_of(skeleton: str, numbers: str, planner: str | None,
              digests: dict[str | None, str] | None = None) -> str:
    """The digest of what a local plan is made of: its skeleton's, numbers' and planner
    data's documents (a changed shape, dtype or placement changes the skeleton or the
    numbers; a value added, removed or moved the skeleton and the flattening map; the values
    themselves do not take part).  Equal digests on every rank: the same global plan.  The
    rank computes it of what it sends, the coordinator of what it received (so a plan whose
    digest is not its content's is refused, never planned as another).  ``digests``: the
    digests of the skeleton and planner documents already made (every rank sends the same)."""
    digests = {} if digests is None else digests
    parts = []
    for text in (skeleton, planner):
        d = digests.get(text)
        if d is None:
            d = digests[text] = _digest(text)
        parts.append(d)
    return hashlib.sha256(f"{parts[0]}:{parts[1]}:{numbers}".encode()).hexdigest()


def encode_numbers(numbers: torch.Tensor) -> str:
    """A table's numbers as text: int64, little-endian, base64."""
    data = array.array("q", numbers.tolist())
    if sys.byteorder != "little":  # pragma: no cover - a big-endian machine
        data.byteswap()
    return encode_bytes(data.tobytes())


def decode_numbers(text: Any, width: int) -> torch.Tensor:
    """`encode_numbers`' numbers, exactly ``width`` of them, else ``ValueError``."""
    if not isinstance(text, str):
        raise ValueError("a local save plan's numbers: a string wanted")
    try:
        raw = decode_bytes(text)
    except Exception as exc:
        raise ValueError(f"a local save plan's numbers: {exc}") from exc
    if len(raw) != 8 * width:
        raise ValueError(f"a local save plan's numbers: {len(raw)} B, its skeleton wants "
                         f"{8 * width} B")
    if not width:
        return torch.zeros(0, dtype=torch.int64)
    data = array.array("q")
    data.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover - a big-endian machine
        data.byteswap()
    return torch.frombuffer(data, dtype=torch.int64)


