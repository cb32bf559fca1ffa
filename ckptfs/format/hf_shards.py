"""The Hugging Face sharded-weights layout that ``ckptfs export --format hf`` writes.  Pure: no
I/O, no torch.

Hugging Face stores large weights as ``model-00001-of-0000N.safetensors`` files plus
``model.safetensors.index.json``::

    {"metadata": {"total_size": <bytes of every tensor>},
     "weight_map": {"model.embed_tokens.weight": "model-00001-of-00003.safetensors", ...}}

and ``transformers``' ``from_pretrained`` reads that with the model's ``config.json``.  The
shards are planned as ``save_pretrained`` plans them (`plan_shards`): tensors in order, a
shard closed when the next tensor would take it over ``max_shard_size`` bytes of tensor data,
a tensor larger than the limit alone in a shard of its own.  Each shard's safetensors header is
computed from the tensors' dtypes and shapes (`shard_header`) before any of its data is read,
so a writer streams the data after it, one tensor at a time, never holding a shard.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

#: ``save_pretrained``'s default ``max_shard_size`` ("5GB": decimal, as Hugging Face counts).
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
INDEX_NAME = "model.safetensors.index.json"
#: Names of the files an export owns in its directory (the shards and the index): an existing
#: one makes the export refuse the directory unless forced.
OWNED_FILE = re.compile(r"model.*\.safetensors(\.index\.json)?")

#: Bytes per element of each safetensors dtype code.
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1,
            "F8_E5M2FNUZ": 1, "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "F32": 4, "I32": 4,
            "U32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*")


def parse_size(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a string as ``save_pretrained`` takes it
    (``"5GB"`` = 5 * 10**9, ``"500MB"``, ``"2GiB"`` = 2 * 2**30, ``"1048576"``; case does not
    matter).  Raises ``ValueError`` naming the value for anything else or a size below 1."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size={size!r}: give bytes (an int) or a size such as "
                         "'5GB', '500MB', '2GiB'")
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE.fullmatch(str(size).lower())
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(f"max_shard_size={size!r}: not a size; give bytes or a number "
                             "with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, "
                             "GiB, TiB (powers of 1024), e.g. '5GB', '500MB', '2GiB'")
        value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value < 1:
        raise ValueError(f"max_shard_size={size!r}: must be at least 1 byte")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to export: its Hugging Face name (the state-dict key), safetensors dtype
    code and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def plan_shards(specs: Sequence[TensorSpec], max_shard_size: int) -> list[list[int]]:
    """Indices of ``specs`` per shard, in order (Hugging Face's rule): a shard is closed when
    the next tensor would take its data over ``max_shard_size`` bytes; a tensor larger than
    ``max_shard_size`` gets a shard of its own.  Every shard holds at least one tensor."""
    shards: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, spec in enumerate(specs):
        n = spec.nbytes
        if n > max_shard_size:
            if current:
                shards.append(current)
                current, size = [], 0
            shards.append([i])
            continue
        if current and size + n > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        shards.append(current)
    return shards


def shard_name(k: int, n: int) -> str:
    """The file name of shard ``k`` (from 1) of ``n``, as ``save_pretrained`` names it."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def data_order(specs: Sequence[TensorSpec], members: Sequence[int]) -> list[int]:
    """The order a shard's tensors are stored in: by element size, largest first (stable), so
    every tensor starts at a multiple of its element size (the header is padded to 8 bytes)."""
    return sorted(members, key=lambda i: -ITEMSIZE[specs[i].dtype])


def shard_header(specs: Sequence[TensorSpec], order: Sequence[int],
                 metadata: dict[str, str]) -> bytes:
    """The header of a shard storing ``specs[i]`` for ``i`` in ``order``, back to back: the
    8-byte little-endian length, then the JSON padded with spaces to a multiple of 8.  The
    data that follows it is exactly ``sum(specs[i].nbytes)`` bytes, in ``order``."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for i in order:
        spec = specs[i]
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def index_document(specs: Sequence[TensorSpec], shards: Sequence[Sequence[int]]) -> bytes:
    """``model.safetensors.index.json`` for ``shards`` (`plan_shards`)."""
    n = len(shards)
    weight_map = {specs[i].name: shard_name(k, n) for k, members in enumerate(shards, 1)
                  for i in members}
    total = sum(s.nbytes for s in specs)
    doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    return (json.dumps(doc, indent=2) + "\n").encode()


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "INDEX_NAME", "ITEMSIZE", "OWNED_FILE", "TensorSpec",
           "data_order", "index_document", "parse_size", "plan_shards", "shard_header",
           "shard_name"]
