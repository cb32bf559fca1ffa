"""Format v5 (``rank-metadata``, docs/protocol.md §9.7), the pure layer: the table blocks, the
rank index documents, the tensor spec and its layouts, each decoded strictly with typed
errors, and the v5 manifest."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from ckptfs.errors import CorruptCheckpointError, FormatVersionError
from ckptfs.format.entries import Chunk, RankTable, chunk_list_digest, make_entry
from ckptfs.format.features import RANK_METADATA, version_of
from ckptfs.format.hashing import digest_bytes
from ckptfs.format.manifest import Manifest
from ckptfs.format.rank_metadata import (
    Cell,
    IndexItem,
    RankIndex,
    RankRow,
    Spec,
    TensorSpec,
    block_name,
    build_document,
    decode_block,
    decode_index,
    decode_spec,
    encode_block,
    encode_index,
    encode_spec,
    layout_of,
    needed_cells,
    row_bytes,
)
from ckptfs.format.versions import decode_manifest

ALGO = "blake3"
HEX = digest_bytes(ALGO, b"x").split(":", 1)[1]


def _index(rank: int = 0) -> tuple[RankIndex, RankRow]:
    items = (IndexItem("w", (rank * 2, 0), "F32", (2, 3), 64, 24, HEX),
             IndexItem("step", None, "U8", (5,), 88, 5, HEX))
    index = RankIndex(rank, 93, ALGO, Chunk(0, 64, HEX), items)
    blob = encode_index(index)
    row = RankRow(rank, True, 93, chunk_list_digest(ALGO, index.chunks), len(blob),
                  digest_bytes(ALGO, blob))
    return index, row


def test_version_5_is_sharded_chunked_rank_metadata() -> None:
    assert version_of({"sharded", "chunked", RANK_METADATA}) == 5
    with pytest.raises(ValueError):
        version_of({"chunked", "references", RANK_METADATA})  # not yet with references


def test_block_round_trip_and_refusals() -> None:
    rows = [_index(0)[1], RankRow.empty(1, ALGO)]
    data = encode_block(rows, ALGO)
    assert len(data) == 2 * row_bytes(ALGO)
    assert decode_block(data, ALGO, 0, 2, where="b") == rows
    with pytest.raises(CorruptCheckpointError, match="expected 2 rows"):
        decode_block(data[:-1], ALGO, 0, 2, where="b")
    with pytest.raises(CorruptCheckpointError, match="expected rank 5"):
        decode_block(data, ALGO, 5, 2, where="b")  # rows of other ranks
    bad = bytearray(data)
    bad[4] = 7  # flags
    with pytest.raises(CorruptCheckpointError, match="flags"):
        decode_block(bytes(bad), ALGO, 0, 2, where="b")


def test_index_round_trip_binding_and_swap() -> None:
    index, row = _index(0)
    blob = encode_index(index)
    assert decode_index(blob, row, where="i") == index
    other, _ = _index(1)
    with pytest.raises(CorruptCheckpointError, match="another rank's index"):
        decode_index(encode_index(other), row, where="i")  # rank 1's index in rank 0's place
    tampered = RankRow(0, True, 93, digest_bytes(ALGO, b"other"), row.index_size,
                       row.index_digest)
    with pytest.raises(CorruptCheckpointError, match="does not match the digest of its row"):
        decode_index(blob, tampered, where="i")
    doc = msgpack.unpackb(blob)
    doc["format_version"] = 6
    with pytest.raises(FormatVersionError):
        decode_index(msgpack.packb(doc), row, where="i")
    doc["format_version"] = 5
    doc["items"][0][4] = 65  # not where the previous item ends
    with pytest.raises(CorruptCheckpointError, match="does not follow"):
        decode_index(msgpack.packb(doc), row, where="i")


def _spec(world: int = 4) -> Spec:
    cells = [Cell((2 * r, 0), (2, 3), r) for r in range(world)]
    grid, owners, chunks, empty = layout_of((2 * world, 3), cells)
    assert (grid, owners, chunks, empty) == ((2, 3), (0, 1), None, ())
    w = TensorSpec("float32", (2 * world, 3), False, "contiguous_format", False, grid, owners)
    odd = TensorSpec("float32", (3,), False, "contiguous_format", False,
                     *layout_of((3,), [Cell((0,), (1,), 1), Cell((1,), (2,), 0)]))
    assert odd.chunks is not None  # not a grid of equal blocks
    # ranks past the end of a tensor hold empty shards: DCP keeps one empty chunk, listed
    # besides the grid, and every chunk is still found
    past = [Cell((0,), (2,), 0), Cell((2,), (1,), 1), Cell((3,), (0,), 2)]
    assert layout_of((3,), past) == ((2,), (0, 1), None, (Cell((3,), (0,), 2),))
    return Spec(world, {"w": w, "b": odd}, {"step": 0}, None, None, None, None, {})


def test_spec_round_trip_and_overlap() -> None:
    spec = _spec()
    back = decode_spec(encode_spec(spec), 4, where="s")
    assert back.tensors == spec.tensors and back.values == spec.values
    w = back.tensors["w"]
    assert [c.rank for c in w.overlapping((3, 0), (2, 3))] == [1, 2]
    cells, values = needed_cells(back, {"w": [((3, 0), (2, 3))], "step": None})
    assert [c.rank for c in cells["w"]] == [1, 2] and values == {"step": 0}
    cells, _ = needed_cells(back, None)
    assert len(cells["w"]) == 4 and len(cells["b"]) == 2
    tail = dataclasses.replace(w, empty=(Cell((8, 0), (0, 3), 3),))
    again = decode_spec(encode_spec(dataclasses.replace(back, tensors={**back.tensors,
                                                                       "w": tail})), 4, where="s")
    assert list(again.tensors["w"].cells())[-1] == Cell((8, 0), (0, 3), 3)
    assert again.owned()[3] == 2  # the empty chunk is an item of rank 3's file too
    # a tensor without elements: its one (empty) chunk is explicit, and still a chunk
    z = TensorSpec("float32", (0, 5), False, "contiguous_format", False,
                   *layout_of((0, 5), [Cell((0, 0), (0, 5), 2)]))
    assert list(z.cells()) == [Cell((0, 0), (0, 5), 2)]


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["tensors"]["w"].update(owners=[2, 1]), "owners"),
    (lambda d: d["tensors"]["w"].update(grid=[0, 3]), "grid"),
    (lambda d: d["tensors"]["b"].update(chunks=[[[0], [1], 1]]), "gap"),
    (lambda d: d.update(world_size=8), "world_size"),
    (lambda d: d["values"].update(step=9), "value"),
    (lambda d: d["tensors"]["w"].update(empty=[[[9, 0], [0, 3], 1]]), "empty chunk"),
    (lambda d: d["tensors"]["w"].update(empty=[[[8, 0], [1, 3], 1]]), "empty chunk"),
    (lambda d: d["tensors"]["b"].update(empty=[[[3], [0], 1]]), "both a grid and chunks"),
])
def test_tampered_spec_is_refused(edit: object, match: str) -> None:
    doc = msgpack.unpackb(encode_spec(_spec()))
    edit(doc)  # type: ignore[operator]
    with pytest.raises(CorruptCheckpointError, match=match):
        decode_spec(msgpack.packb(doc), 4, where="s")


def _one_tensor(world: int = 4, **layout: Any) -> bytes:
    """A ``world``-rank spec of one float32 tensor ``w`` of ``layout`` (size, and grid and
    owners, empty, or chunks), encoded."""
    return _spec_doc({"w": layout}, world)


def _spec_doc(layouts: dict[str, dict[str, Any]], world: int = 4) -> bytes:
    """A ``world``-rank spec of float32 tensors, each of its ``layout``, encoded."""
    entries = {name: {"dtype": "float32", "requires_grad": False,
                      "memory_format": "contiguous_format", "pin_memory": False, "grid": None,
                      "owners": None, "chunks": None, "empty": [], **layout}
               for name, layout in layouts.items()}
    return msgpack.packb({"schema": "ckptfs.dcp-spec", "format_version": 5,
                          "world_size": world, "version": None, "tensors": entries,
                          "values": {}, "planner_data": None, "storage_meta": None,
                          "tree": None, "extra": {}})


GRID = {"size": [8, 5], "grid": [4, 5], "owners": [0, 1]}  # rank 0: rows 0-3, rank 1: 4-7


@pytest.mark.parametrize("layout, match", [
    # an empty chunk of rank 0 at the offsets of rank 1's cell: a full read would find both
    # under one name and offsets (a clash within one rank is also refused here)
    ({**GRID, "empty": [[[4, 0], [0, 5], 0]]}, r"two chunks at the same offsets: "
     r"Cell\(offsets=\(4, 0\), sizes=\(4, 5\), rank=1\) Cell\(offsets=\(4, 0\), sizes=\(0, 5\), "
     r"rank=0\)"),
    ({**GRID, "empty": [[[0, 0], [0, 5], 0]]}, "two chunks at the same offsets"),
    # an empty chunk strictly inside a cell (DCP's rule: they overlap), along either dimension
    ({**GRID, "empty": [[[2, 0], [0, 5], 2]]}, r"overlapping chunks: Cell\(offsets=\(2, 0\)"),
    ({**GRID, "empty": [[[0, 2], [4, 0], 2]]}, r"overlapping chunks: Cell\(offsets=\(0, 2\)"),
    # two empty chunks crossing each other on the cells' boundaries
    ({"size": [8, 6], "grid": [4, 3], "owners": [0, 1],
      "empty": [[[4, 1], [0, 3], 1], [[3, 3], [2, 0], 2]]}, "overlapping chunks"),
    ({**GRID, "empty": [[[8, 0], [0, 5], 2], [[8, 0], [0, 5], 3]]},
     "two empty chunks at the same offsets"),
    # explicit chunks: overlapping (an empty one inside another included), a gap, a 0-d
    # tensor without its chunk or of the wrong dimensions
    ({"size": [5], "chunks": [[[0], [3], 0], [[2], [3], 1]]}, "overlapping chunks"),
    ({"size": [5], "chunks": [[[0], [3], 0], [[1], [0], 1], [[3], [2], 1]]},
     "overlapping chunks"),
    ({"size": [5], "chunks": [[[0], [3], 0], [[4], [1], 1]]},
     "a gap: key:w invalid fill tensor-volume: 5 chunks-volume: 4"),
    ({"size": [5], "chunks": [[[0], [3], 0], [[3], [3], 1]]}, "out of bounds chunk"),
    ({"size": [], "chunks": []}, "tile it exactly once"),
    ({"size": [5], "chunks": [[[0, 0], [5, 1], 0]]}, "2/2 dimensions, the tensor 1"),
])
def test_spec_chunks_must_tile_each_tensor_once(layout: dict[str, Any], match: str) -> None:
    """Whatever its layout, the chunks the spec places on the ranks tile each tensor exactly
    once: the decoder refuses the spec, naming the file and the tensor."""
    with pytest.raises(CorruptCheckpointError, match=match) as err:
        decode_spec(_one_tensor(**layout), 4, where="dcp-spec.msgpack")
    assert str(err.value).startswith("dcp-spec.msgpack: malformed tensor spec (tensor 'w'")


@pytest.mark.parametrize("layout", [
    {**GRID, "empty": [[[8, 0], [0, 5], 2]]},              # past the end (DCP's empty shards)
    {**GRID, "empty": [[[4, 2], [0, 3], 2], [[8, 0], [0, 5], 3]]},   # on a cells' boundary
    {"size": [5], "chunks": [[[0], [3], 0], [[5], [0], 1], [[3], [2], 1]]},
    {"size": [], "chunks": [[[], [], 1]]},
    {"size": [0, 5], "chunks": [[[0, 0], [0, 5], 1]]},
])
def test_spec_chunks_that_tile_the_tensor_are_accepted(layout: dict[str, Any]) -> None:
    decode_spec(_one_tensor(**layout), 4, where="dcp-spec.msgpack")


def test_a_grid_is_checked_by_its_empty_chunks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid's cells tile the tensor by construction: the check sees only the empty chunks
    and the cells holding their offsets, so a spec of a million cells decodes in O(tensors)."""
    from ckptfs.format import rank_metadata

    seen: list[int] = []
    real = rank_metadata.tiling_errors

    def counting(key: str, size: tuple[int, ...], chunks: list[Any], **kw: Any) -> list[str]:
        seen.append(len(chunks))
        return real(key, size, chunks, **kw)

    monkeypatch.setattr(rank_metadata, "tiling_errors", counting)
    big = {"size": [1 << 12, 1 << 12], "grid": [4, 4], "owners": [0, 1]}  # 2^20 cells
    world = 1 << 20
    decode_spec(_one_tensor(world, **big, empty=[[[1 << 12, 0], [0, 1 << 12], 1],
                                                 [[8, 9], [0, 3], 2]]), world, where="s")
    assert seen == [3]  # the two empty chunks and the cell at (8, 8)
    with pytest.raises(CorruptCheckpointError, match="same offsets"):
        decode_spec(_one_tensor(world, **big, empty=[[[8, 8], [0, 3], 2]]), world, where="s")
    assert seen[-1] == 2


def test_a_small_hostile_spec_cannot_declare_millions_of_chunks() -> None:
    """A spec entry of ~100 bytes declaring a 2^24-cell grid (every cell on one rank) is
    refused at once, before any cell is built (it made load and verify allocate 3.9 GB); so
    are chunks of all tensors together past 2^24, counted, not enumerated."""
    import time

    t0 = time.perf_counter()
    hostile = _one_tensor(2, size=[1 << 12, 1 << 12], grid=[1, 1], owners=[0, 0], empty=[])
    assert len(hostile) < 400
    with pytest.raises(CorruptCheckpointError, match="all owned by rank 0"):
        decode_spec(hostile, 2, where="s")
    assert time.perf_counter() - t0 < 1.0
    many = _spec_doc({f"t{i}": {"size": [1 << 12, 1 << 12], "grid": [4, 4],
                                "owners": [0, 1], "empty": []} for i in range(17)}, 1 << 20)
    with pytest.raises(CorruptCheckpointError, match="more than 16777216 chunks"):
        decode_spec(many, 1 << 20, where="s")
    assert time.perf_counter() - t0 < 2.0


def test_the_writer_lists_one_ranks_several_chunks() -> None:
    """Two equal blocks of a tensor on one rank are not a grid (owners must be distinct)."""
    from ckptfs.format.rank_metadata import Cell, layout_of

    cells = [Cell((0, 0), (2, 3), 0), Cell((2, 0), (2, 3), 0)]
    grid, owners, chunks, _ = layout_of((4, 3), cells)
    assert grid is None and owners is None and chunks is not None and len(chunks) == 2
    grid, owners, chunks, _ = layout_of((4, 3), [Cell((0, 0), (2, 3), 0),
                                                 Cell((2, 0), (2, 3), 1)])
    assert grid == (2, 3) and owners == (0, 1) and chunks is None


@pytest.mark.sharded
def test_document_needs_the_owner_to_hold_the_chunk() -> None:
    spec = Spec(1, {"w": TensorSpec("float32", (2, 3), False, "contiguous_format", False,
                                    (2, 3), (0, 0))}, {"step": 0}, None, None, None, None, {})
    index, _ = _index(0)
    cells, values = needed_cells(spec, None)
    doc = build_document(spec, {0: index}, cells, values, where="x", full=True)
    assert {i.name for i in doc.items} == {"w@0,0", "step@bytes"}
    wrong = Spec(1, {"w": TensorSpec("float32", (2, 4), False, "contiguous_format", False,
                                     (2, 4), (0, 0))}, {"step": 0}, None, None, None, None, {})
    with pytest.raises(CorruptCheckpointError, match="does not hold it"):
        build_document(wrong, {0: index}, *needed_cells(wrong, None), where="x")


def _manifest(world: int = 3, rows: int = 2) -> Manifest:
    entries = [make_entry("dcp-spec.msgpack", 10, ALGO, [Chunk(0, 10, HEX)], None)]
    for b in range(2):
        n = min(rows, world - b * rows) * row_bytes(ALGO)
        entries.append(make_entry(block_name(b), n, ALGO, [Chunk(0, n, HEX)], None))
    return Manifest(1, "a-20260102T030405Z-0000000000000001", tuple(entries),
                    "2026-01-02T03:04:05+00:00", ALGO, {}, frozenset(
                        {"sharded", "chunked", RANK_METADATA}), world_size=world,
                    rank_table=RankTable(rows, 3, 1000))


def test_manifest_round_trip_and_block_sizes() -> None:
    m = _manifest()
    data = m.to_bytes()
    back = decode_manifest(data)
    assert back == m and back.format_version == 5 and back.total_bytes == 10 + 1000 + sum(
        e.size for e in m.files[1:])
    doc = msgpack.unpackb(msgpack.packb(__import__("json").loads(data)))
    doc["files"] = doc["files"][:2]  # a block missing
    with pytest.raises(CorruptCheckpointError, match="blocks of its rank table"):
        decode_manifest(__import__("json").dumps(doc).encode())
