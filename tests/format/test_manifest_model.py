"""A writer's check of the chunked manifest it commits (`check_model`, through
`check_committable`) refuses exactly what the reader's decoder refuses in its bytes, with the
same error, without parsing them back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import reduce
from typing import Any

import pytest

from ckptfs.errors import CorruptCheckpointError, UnsupportedValueError
from ckptfs.format.entries import (
    Chunk,
    ChunkedFileEntry,
    RankTable,
    Reference,
    is_bound,
    make_entry,
    rank_row_bytes,
)
from ckptfs.format.features import CHUNKED, RANK_METADATA, REFERENCES, SHARDED
from ckptfs.format.layout import (
    METADATA_NAME,
    SPEC_NAME,
    STATE_NAME,
    new_attempt_name,
    rank_file_name,
    table_block_name,
)
from ckptfs.format.limits import MAX_JSON_DEPTH
from ckptfs.format.manifest import Manifest, check_model
from ckptfs.format.versions import check_committable, decode_manifest

ALGO = "sha256"
HEX = "ab" * 32
ATTEMPT = new_attempt_name()
OTHER = new_attempt_name()
V2 = frozenset({SHARDED, CHUNKED})
V3 = frozenset({CHUNKED, REFERENCES})
V4 = frozenset({SHARDED, CHUNKED, REFERENCES})
V5 = frozenset({SHARDED, CHUNKED, RANK_METADATA})


def rank_entry(rank: int, n: int = 3) -> ChunkedFileEntry:
    chunks = [Chunk(0, 40, HEX)] + [Chunk(40 + 8 * i, 8, f"{i:02x}" * 32) for i in range(n)]
    return make_entry(rank_file_name(rank), 40 + 8 * n, ALGO, chunks, rank,
                      store_checksums=(("crc32c", "0" * 8),))


def manifest(feats: frozenset[str] = V2, **change: Any) -> Manifest:
    if RANK_METADATA in feats:  # the spec first, then the table's one block (3 rows)
        width = 3 * rank_row_bytes(ALGO)
        fields: dict[str, Any] = dict(
            step=7, attempt=ATTEMPT, files=(
                make_entry(SPEC_NAME, 10, ALGO, [Chunk(0, 10, HEX)], None),
                make_entry(table_block_name(0), width, ALGO, [Chunk(0, width, HEX)], None)),
            created="2026-01-01T00:00:00Z", hash_algorithm=ALGO,
            metadata={"tensor_count": 0, "note": "x"}, features=feats, world_size=3,
            rank_table=RankTable(128, 2, 1000))
        fields.update(change)
        return Manifest(**fields)
    sharded = SHARDED in feats
    files: list[Any] = [rank_entry(r) for r in range(2)] if sharded else [
        make_entry("data-0.safetensors", 64, ALGO, [Chunk(0, 64, HEX)], None)]
    files.append(make_entry(METADATA_NAME if sharded else STATE_NAME, 10, ALGO,
                            [Chunk(0, 10, HEX)], None))
    refs = (Reference("rank-00002/data-0.safetensors" if sharded else "data-9.safetensors",
                      3, OTHER, "rank-00002/data-0.safetensors", 100, ALGO,
                      (Chunk(0, 40, HEX), Chunk(48, 8, HEX))),) if REFERENCES in feats else ()
    fields: dict[str, Any] = dict(step=7, attempt=ATTEMPT, files=tuple(files),
                                  created="2026-01-01T00:00:00Z", hash_algorithm=ALGO,
                                  metadata={"tensor_count": 0, "note": "x"}, features=feats,
                                  world_size=3 if sharded else 0, references=refs)
    fields.update(change)
    return Manifest(**fields)


def file_changed(i: int, **change: Any) -> Callable[[Manifest], dict[str, Any]]:
    def edit(m: Manifest) -> dict[str, Any]:
        files = list(m.files)
        files[i] = dataclasses.replace(files[i], **change)
        return {"files": tuple(files)}
    return edit


def ref_changed(**change: Any) -> Callable[[Manifest], dict[str, Any]]:
    return lambda m: {"references": (dataclasses.replace(m.references[0], **change),)}


def both(m: Manifest) -> tuple[str, str]:
    """(the decoder's verdict on the bytes, the model check's): "ok" or the error."""
    data = m.to_bytes()
    where = f"MANIFEST.json of step {m.step}"
    out = []
    for check in (lambda: decode_manifest(data, where=where),
                  lambda: check_model(m, where=where)):
        try:
            check()
            out.append("ok")
        except CorruptCheckpointError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out[0], out[1]


EDITS: list[tuple[str, Callable[[Manifest], dict[str, Any]]]] = [
    ("valid", lambda m: {}),
    ("step negative", lambda m: {"step": -1}),
    ("step too large", lambda m: {"step": 10**13}),
    ("step a bool", lambda m: {"step": True}),
    ("attempt not a name", lambda m: {"attempt": "a-1"}),
    ("unknown algorithm", lambda m: {"hash_algorithm": "md5"}),
    ("created not a string", lambda m: {"created": 5}),
    ("metadata too deep", lambda m: {"metadata": {"d": reduce(lambda a, _: [a],
                                                              range(MAX_JSON_DEPTH), [])}}),
    ("metadata at the depth limit", lambda m: {"metadata": {"d": reduce(
        lambda a, _: [a], range(MAX_JSON_DEPTH - 3), [])}}),
    ("no dcp.msgpack or state.msgpack", lambda m: {"files": m.files[:-1]}),
    ("a file twice", lambda m: {"files": (m.files[0], *m.files)}),
    ("an unsafe path", file_changed(0, path="../x")),
    ("a negative size", file_changed(0, size=-1)),
    ("a bool size", file_changed(0, size=True)),
    ("a digest of an unknown algorithm", file_changed(0, digest="md5:00")),
    ("an upper-case digest", file_changed(0, digest=f"{ALGO}:{HEX.upper()}")),
    ("a digest not of the chunk list", file_changed(0, digest=f"{ALGO}:{HEX}")),
    ("chunks leaving a gap", file_changed(0, chunks=(Chunk(0, 40, HEX), Chunk(41, 8, HEX)))),
    ("a chunk digest not hex", file_changed(0, chunks=(Chunk(0, 64, "xy"),))),
    ("an empty chunk digest", file_changed(0, chunks=(Chunk(0, 64, ""),))),
    ("a float chunk offset", file_changed(0, chunks=(Chunk(0.0, 64, HEX),))),  # type: ignore
    ("a bad store checksum", file_changed(0, store_checksums=(("crc32c", "0"),))),
    ("an unknown store checksum", file_changed(0, store_checksums=(("new", "?"),))),
]
SHARDED_EDITS: list[tuple[str, Callable[[Manifest], dict[str, Any]]]] = [
    ("world size 0", lambda m: {"world_size": 0, "features": m.features}),
    ("world size too small", lambda m: {"world_size": 1}),
    ("a rank file of another rank", file_changed(0, rank=1)),
    ("a rank for dcp.msgpack", file_changed(-1, rank=0)),
    ("a rank file with no rank", file_changed(0, rank=None)),
]
REFERENCE_EDITS: list[tuple[str, Callable[[Manifest], dict[str, Any]]]] = [
    ("a reference to this attempt", ref_changed(attempt=ATTEMPT)),
    ("a reference named like a file", ref_changed(path=rank_file_name(0))),
    ("a reference to a manifest", ref_changed(source="MANIFEST.json")),
    ("overlapping reference chunks", ref_changed(chunks=(Chunk(0, 40, HEX), Chunk(39, 8, HEX)))),
    ("a reference chunk digest not hex", ref_changed(chunks=(Chunk(0, 40, "zz"),))),
]


RANK_TABLE_EDITS: list[tuple[str, Callable[[Manifest], dict[str, Any]]]] = [
    ("a view's rank files (not encoded)", lambda m: {"files": (*m.files, rank_entry(0))}),
    ("no spec", lambda m: {"files": m.files[1:]}),
    ("a block of the wrong size", file_changed(
        1, size=7, chunks=(Chunk(0, 7, HEX),), digest=make_entry(
            "x", 7, ALGO, [Chunk(0, 7, HEX)], None).digest)),
    ("a rank for the spec", file_changed(0, rank=0)),
    ("a block too many", lambda m: {"files": (*m.files, make_entry(
        table_block_name(1), 10, ALGO, [Chunk(0, 10, HEX)], None))}),
    ("rows per block 0", lambda m: {"rank_table": RankTable(0, 2, 1000)}),
    ("more rank files than ranks", lambda m: {"rank_table": RankTable(128, 4, 1000)}),
    ("rank bytes negative", lambda m: {"rank_table": RankTable(128, 2, -1)}),
    ("rows per block 2: two blocks wanted", lambda m: {"rank_table": RankTable(2, 2, 1000)}),
]


def cases() -> list[Any]:
    out = []
    for name, feats in (("v2", V2), ("v3", V3), ("v4", V4), ("v5", V5)):
        edits = EDITS + (SHARDED_EDITS if SHARDED in feats else []) + (
            REFERENCE_EDITS if REFERENCES in feats else []) + (
            RANK_TABLE_EDITS if RANK_METADATA in feats else [])
        out += [pytest.param(feats, edit, id=f"{name}-{what}") for what, edit in edits]
    return out


@pytest.mark.parametrize("feats,edit", cases())
def test_the_model_check_is_the_decoders_verdict(feats: frozenset[str],
                                                 edit: Callable[[Manifest], Any]) -> None:
    base = manifest(feats)
    try:
        m = dataclasses.replace(base, **edit(base))
        m.to_bytes()
    except (TypeError, ValueError):
        pytest.skip("not a manifest the model can hold or encode")
    decoded, model = both(m)
    assert decoded == model


def test_check_committable_refuses_as_before() -> None:
    m = manifest(V4)
    check_committable(m, m.to_bytes(), where="m")
    bad = dataclasses.replace(m, **file_changed(0, digest=f"{ALGO}:{HEX}")(m))
    with pytest.raises(UnsupportedValueError, match=r"would not be readable.*does not match"):
        check_committable(bad, bad.to_bytes(), where="m")


def test_only_make_entry_marks_an_entry_bound() -> None:
    entry = rank_entry(0)
    assert is_bound(entry)
    assert not is_bound(dataclasses.replace(entry))
    assert not is_bound(ChunkedFileEntry(entry.path, entry.size, entry.digest, entry.chunks, 0))
