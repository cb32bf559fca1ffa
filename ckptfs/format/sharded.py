"""Format v2, the sharded layout: the rank files' safetensors headers (as planned by the
writer) and the pickle-free encoding of non-tensor values.  The manifest is the one model
(`ckptfs.format.manifest.Manifest` with the ``"sharded"`` and ``"chunked"`` features), its
entries are `ckptfs.format.entries`, and the rank files' names `ckptfs.format.layout`;
their names are re-exported here for the sharded code.  ``dcp.msgpack`` (DCP's global
metadata) and the checks binding it to the manifest and to the headers are
`ckptfs.format.sharded_metadata`.  Pure: no I/O, no collectives.

A sharded checkpoint is written by several ranks into one attempt::

    step-000000001000/
      COMPLETE                            the v1 marker, unchanged: binds MANIFEST.json by sha256
      a-20261130T012500Z-3f9c2a1b.../
        MANIFEST.json                     format_version 2, layout "sharded": every file with
                                          its size, its chunk list and a digest of that list
        dcp.msgpack                       DCP's global Metadata (tensors, chunks, where each
                                          stored item lives), msgpack: never pickle
        rank-00000/data-0.safetensors     rank 0's write items: header chunk, then one chunk
        rank-00001/data-0.safetensors     per item (a tensor shard, or an encoded value)

Every file is tiled by *chunks* (offset, length, digest): the safetensors header is one chunk,
each write item's bytes another (`ckptfs.format.entries`).
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ckptfs.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format.entries import Chunk as Chunk
from ckptfs.format.entries import ChunkedFileEntry as ChunkedFileEntry
from ckptfs.format.entries import bound_entry as bound_entry
from ckptfs.format.entries import check_tiling as check_tiling
from ckptfs.format.entries import chunk_list_digest as chunk_list_digest
from ckptfs.format.entries import chunk_list_text as chunk_list_text
from ckptfs.format.entries import decode_chunks as decode_chunks
from ckptfs.format.entries import make_entry as make_entry
from ckptfs.format.features import SHARDED_FORMAT_VERSION as SHARDED_FORMAT_VERSION
from ckptfs.format.layout import METADATA_NAME as METADATA_NAME
from ckptfs.format.layout import rank_file_name as rank_file_name
from ckptfs.format.layout import rank_of_file as rank_of_file
from ckptfs.format.manifest import FILE_KEYS, MANIFEST_KEYS, unique_pairs
from ckptfs.format.manifest import SHARDED_LAYOUT as SHARDED_LAYOUT
from ckptfs.format.manifest import manifest_error as manifest_error
from ckptfs.format.serialize import (
    CODE_DTYPES,
    Flattener,
    build_tree,
    cpu_contiguous,
    dtype_code,
    tensor_memoryview,
)

METADATA_SCHEMA = "ckptfs.dcp"
VALUE_SCHEMA = "ckptfs.value"
#: Keys every v2 manifest and every v2 file entry must have (docs/protocol.md §8.2).
V2_MANIFEST_KEYS = MANIFEST_KEYS | {"layout", "world_size"}
V2_FILE_KEYS = FILE_KEYS | {"rank", "chunks"}
#: Keys every value document must have (§8.5).
VALUE_KEYS = frozenset({"schema", "format_version", "tree", "tensors"})


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ----------------------------------------------------------------------------------------------
# A rank's data file: a safetensors file whose header is known before any data is resolved


@dataclass(frozen=True)
class PlannedItem:
    """One entry of a rank's data file."""

    name: str        # safetensors entry name: "<fqn>@<offsets>" or "<fqn>@bytes"
    dtype: str       # safetensors dtype code
    shape: tuple[int, ...]
    nbytes: int


def item_name(fqn: str, offsets: Iterable[int] | None) -> str:
    """Entry name of a write item: unique per (fqn, offsets) because the suffix after the last
    ``@`` never contains ``@``."""
    if offsets is None:
        return f"{fqn}@bytes"
    return f"{fqn}@{','.join(map(str, map(int, offsets)))}"


def plan_header(items: list[PlannedItem], rank: int) -> tuple[bytes, list[int]]:
    """The file's first chunk (8-byte length + JSON header padded to 8 bytes) and each item's
    offset in the file, in the order given."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": "ckptfs",
                                               "rank": str(rank)}}
    pos = 0
    for it in items:
        header[it.name] = {"dtype": it.dtype, "shape": list(it.shape),
                           "data_offsets": [pos, pos + it.nbytes]}
        pos += it.nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    prefix = struct.pack("<Q", len(hbytes)) + hbytes
    offsets = []
    pos = len(prefix)
    for it in items:
        offsets.append(pos)
        pos += it.nbytes
    return prefix, offsets


@functools.cache
def element_size(code: str) -> int:
    return torch.empty((), dtype=CODE_DTYPES[code]).element_size()


def tensor_code(dtype: torch.dtype, where: str) -> str:
    """The safetensors code of ``dtype``, or `UnsupportedValueError` naming ``where``."""
    try:
        return dtype_code(dtype)
    except KeyError:
        raise UnsupportedValueError(
            f"tensor {where!r} has dtype {dtype}, which safetensors cannot store") from None


# ----------------------------------------------------------------------------------------------
# Non-tensor values (DCP BYTE_IO items): ckptfs's tagged msgpack, never torch.save/pickle


def encode_value(value: Any, *, key: str, path: tuple[Any, ...] | None = None) -> bytes:
    """Encode one non-tensor value of the state (an int, a list of param names, a tuple of
    betas...) with the v1 tagged tree; tensors inside it are stored inline.  Raises
    `UnsupportedValueError` naming its key path (``path``, the value's keys in the
    state; else ``key``, its DCP name) for what the format cannot hold."""
    flat = Flattener()
    tree = flat.encode(value, path or (key,))
    tensors = []
    for t in flat.tensors:
        code = dtype_code(t.dtype)
        ct = cpu_contiguous(t)
        tensors.append([code, list(ct.shape), bytes(tensor_memoryview(ct))])
    doc = {"schema": VALUE_SCHEMA, "format_version": SHARDED_FORMAT_VERSION, "tree": tree,
           "tensors": tensors}
    return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]


def decode_value(data: bytes | bytearray | memoryview, *, where: str) -> Any:
    """Decode a value document (§8.5): typed errors only, nothing is ever unpickled.  Every key
    of §8.5 is required, no map names a key twice, ``format_version`` is 2 (a newer one raises
    `FormatVersionError`), every inline tensor's bytes fit its dtype and shape."""
    try:
        doc = unpack_document(data, where)
    except UnsafeCheckpointError:
        raise
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{where}: not a ckptfs value document ({str(exc).removeprefix(where + ': ')}); "
            "written with torch.save/pickle by a planner that is not ckptfs's? ckptfs never "
            "unpickles") from None
    if not isinstance(doc, dict) or doc.get("schema") != VALUE_SCHEMA:
        raise CorruptCheckpointError(
            f"{where}: not a ckptfs value (written with torch.save/pickle by a planner that is "
            "not ckptfs's? ckptfs never unpickles)")
    missing = sorted(VALUE_KEYS - set(doc))
    if missing:
        raise CorruptCheckpointError(f"{where}: value document lacks {missing}")
    check_version(doc["format_version"], where, "value document")
    raw = doc["tensors"]
    if not isinstance(raw, list):
        raise CorruptCheckpointError(f"{where}: 'tensors' of the value is not a list")
    tensors = []
    for r in raw:
        if (not isinstance(r, list) or len(r) != 3 or not isinstance(r[0], str)
                or r[0] not in CODE_DTYPES
                or not isinstance(r[1], list) or not all(_is_int(d) and d >= 0 for d in r[1])
                or not isinstance(r[2], bytes)):
            raise CorruptCheckpointError(f"{where}: malformed tensor in value")
        dtype = CODE_DTYPES[r[0]]
        n = 1
        for d in r[1]:
            n *= d
        if n * element_size(r[0]) != len(r[2]):
            raise CorruptCheckpointError(f"{where}: tensor in value has the wrong byte length")
        t = torch.frombuffer(bytearray(r[2]), dtype=dtype) if r[2] else torch.empty(0, dtype=dtype)
        tensors.append(t.reshape(r[1]))
    return build_tree(doc["tree"], tensors, where=where)


def check_version(version: Any, where: str, what: str) -> None:
    """``format_version`` of a v2 document: 2; a newer int raises `FormatVersionError`
    (upgrade ckptfs), anything else `CorruptCheckpointError`."""
    if _is_int(version) and version > SHARDED_FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: {what} written by format version {version}; this ckptfs reads "
            f"{SHARDED_FORMAT_VERSION}: upgrade ckptfs")
    if version != SHARDED_FORMAT_VERSION or not _is_int(version):
        raise CorruptCheckpointError(f"{where}: {what} has format_version {version!r:.40}, "
                                     f"expected {SHARDED_FORMAT_VERSION}")


def unpack_document(data: bytes | bytearray | memoryview, where: str) -> Any:
    """A msgpack document of format v2 (``dcp.msgpack``, a value document): str or bin map
    keys only, no map naming a key twice, no extension types (`UnsafeCheckpointError`);
    anything else malformed is `CorruptCheckpointError` naming ``where``."""

    def no_ext(code: int, payload: bytes) -> Any:
        raise UnsafeCheckpointError(f"{where}: msgpack extension type {code} is not allowed")

    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, ext_hook=no_ext,
                               use_list=True, object_pairs_hook=unique_pairs)
    except UnsafeCheckpointError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            RecursionError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{where}: not valid msgpack ({type(exc).__name__}: {str(exc)[:120]})") from None
