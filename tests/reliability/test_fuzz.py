"""Property-based fuzzing of every decoder that reads bytes from storage: the manifest (v1, v2
and v3, whose references are fuzzed field by field and round-trip), the commit marker, the
state document and tree, the safetensors header, ``dcp.msgpack`` and the value documents of
format v2.  Whatever the bytes, only typed errors
(:class:`~ckptfs.errors.CkptfsError`) may escape; and garbage is refused: a required field
deleted or mutated into a value it cannot hold is refused with CorruptCheckpointError (or
UnsafeCheckpointError / FormatVersionError), never accepted."""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.errors import CkptfsError, CorruptCheckpointError
from ckptfs.format.hashing import ALGORITHMS, digest_bytes, parse_digest
from ckptfs.format.layout import MAX_STEP, is_attempt_name
from ckptfs.format.limits import MAX_MANIFEST_BYTES
from ckptfs.format.manifest import FILE_KEYS, MANIFEST_SCHEMA, Manifest, Marker
from ckptfs.format.serialize import (
    build_tree,
    decode_state_doc,
    parse_safetensors_header,
    plan_state,
)
from ckptfs.format.sharded import (
    METADATA_NAME,
    V2_FILE_KEYS,
    Chunk,
    ChunkedFileEntry,
    chunk_list_digest,
    decode_value,
    encode_value,
)
from ckptfs.format.sharded_metadata import decode_metadata
from ckptfs.format.versions import CHUNKED, REFERENCES, SHARDED, decode_manifest

FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)
#: What a manifest's metadata may hold (JSON without the infinities a writer refuses).
finite_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=25)

TAGS = ["d", "l", "t", "T", "i", "S", "dt", "x", ""]
tagged = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=6),
    lambda inner: st.tuples(st.sampled_from(TAGS),
                            inner | st.lists(inner, max_size=3)
                            | st.lists(st.lists(inner, max_size=3), max_size=3)).map(list),
    max_leaves=20)


def only_typed(fn: Callable[[], Any]) -> None:
    """Run ``fn``: returning or raising a CkptfsError is fine; anything else fails the test."""
    with contextlib.suppress(CkptfsError):
        fn()


VALID_MANIFEST = Manifest(
    5, "a-20260101T000000Z-0123456789abcdef", (), "2026-01-01T00:00:00+00:00", "sha256",
    {"tensor_count": 0}).to_bytes()
VALID_MARKER = Marker(5, "a-20260101T000000Z-0123456789abcdef",
                      digest_bytes("sha256", VALID_MANIFEST), len(VALID_MANIFEST),
                      "2026-01-01T00:00:00+00:00").to_bytes()


def _mutated_doc(base: bytes, key: str, value: Any) -> bytes:
    doc = json.loads(base)
    doc[key] = value
    return json.dumps(doc).encode()


@FUZZ
@given(st.binary(max_size=300))
def test_manifest_from_random_bytes(data: bytes) -> None:
    only_typed(lambda: Manifest.from_bytes(data))


@FUZZ
@given(st.sampled_from(["schema", "format_version", "step", "attempt", "files", "metadata",
                        "created", "hash_algorithm"]), json_values)
def test_manifest_field_replaced(key: str, value: Any) -> None:
    only_typed(lambda: Manifest.from_bytes(_mutated_doc(VALID_MANIFEST, key, value)))


@FUZZ
@given(st.lists(st.dictionaries(st.sampled_from(["path", "size", "digest", "algorithm"]),
                                json_values, max_size=4), max_size=4))
def test_manifest_file_entries(files: list[dict[str, Any]]) -> None:
    only_typed(lambda: Manifest.from_bytes(_mutated_doc(VALID_MANIFEST, "files", files)))


@FUZZ
@given(st.binary(max_size=300))
def test_marker_from_random_bytes(data: bytes) -> None:
    only_typed(lambda: Marker.from_bytes(data))


@FUZZ
@given(st.sampled_from(["schema", "format_version", "step", "attempt", "manifest_digest",
                        "manifest_size", "created", "writer"]), json_values)
def test_marker_field_replaced(key: str, value: Any) -> None:
    def run() -> None:
        marker = Marker.from_bytes(_mutated_doc(VALID_MARKER, key, value))
        marker.check_manifest(VALID_MANIFEST, where="m")

    only_typed(run)


@FUZZ
@given(st.binary(max_size=300))
def test_state_doc_from_random_bytes(data: bytes) -> None:
    only_typed(lambda: decode_state_doc(data, where="s"))


@FUZZ
@given(msgpack_values)
def test_state_doc_from_random_msgpack(value: Any) -> None:
    only_typed(lambda: decode_state_doc(msgpack.packb(value, use_bin_type=True), where="s"))


@FUZZ
@given(tagged, st.lists(st.tuples(st.text(max_size=12), st.text(max_size=4),
                                  st.sampled_from(["F32", "I64", "X"]),
                                  st.lists(st.integers(-2, 3), max_size=3)).map(list),
                        max_size=2))
def test_state_doc_and_tree(tree: Any, slots: list[Any]) -> None:
    doc = msgpack.packb({"schema": "ckptfs.state", "format_version": 1, "tree": tree,
                         "tensors": slots}, use_bin_type=True)

    def run() -> None:
        t, parsed = decode_state_doc(doc, where="s")
        build_tree(t, [torch.zeros(1)] * len(parsed), where="s")

    only_typed(run)


@FUZZ
@given(st.binary(max_size=300))
def test_safetensors_header_random_bytes(data: bytes) -> None:
    only_typed(lambda: parse_safetensors_header(data, where="t"))


@FUZZ
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=4),
       st.binary(max_size=64), st.integers(-8, 8))
def test_safetensors_header_structured(header: dict[str, Any], data: bytes, skew: int) -> None:
    h = json.dumps(header).encode()
    blob = struct.pack("<Q", max(0, len(h) + skew)) + h + data
    only_typed(lambda: parse_safetensors_header(blob, where="t"))


@FUZZ
@given(st.integers(0, 200), st.integers(0, 7))
def test_real_state_doc_with_a_flipped_bit(pos: int, bit: int) -> None:
    """Real documents with one bit flipped: the closest thing to real corruption."""
    plan = plan_state({"w": torch.ones(2, 2), "meta": {"step": 3, "name": "x", 1: (2, 3)}})
    blob = bytearray(b"".join(bytes(c) for c in plan.files[0].chunks()))
    blob[pos % len(blob)] ^= 1 << bit

    def run() -> None:
        tree, slots = decode_state_doc(bytes(blob), where="s")
        build_tree(tree, [torch.ones(2, 2)] * len(slots), where="s")

    only_typed(run)


@FUZZ
@given(st.binary(max_size=300) | msgpack_values.map(
    lambda v: msgpack.packb(v, use_bin_type=True)))
def test_v2_documents_from_random_bytes(data: bytes) -> None:
    only_typed(lambda: decode_metadata(data, where="d"))
    only_typed(lambda: decode_value(data, where="k"))


# -- garbage is refused, not only typed -----------------------------------------------------------
#
# Each required field of each document a reader decodes, deleted or replaced by a value it cannot
# hold (drawn at random, minus the values a validity oracle written here from docs/protocol.md
# accepts): the reader must refuse the document with CorruptCheckpointError (or its subclasses
# UnsafeCheckpointError and FormatVersionError), never accept it.

DELETE = "<deleted>"
REFUSE = settings(max_examples=40, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.filter_too_much])
Valid = Callable[[Any], bool]


def _int_in(lo: int, hi: int) -> Valid:
    return lambda v: type(v) is int and lo <= v <= hi


def _equals(x: Any) -> Valid:
    return lambda v: type(v) is type(x) and v == x


def _is_digest(v: Any) -> bool:
    try:
        parse_digest(v)
    except (CkptfsError, TypeError, ValueError):
        return False
    return True


def _anything(v: Any) -> bool:
    return True


def _mutation(valid: Valid, values: Any) -> Any:
    """The field deleted, or a value the oracle ``valid`` does not accept."""
    if valid is _anything:
        return st.just(DELETE)
    return st.just(DELETE) | values.filter(lambda v: not valid(v))


#: Checked on every example besides the drawn value (those the oracle rejects), so that a
#: refusal that fails for a plain case fails every run, not only when the search finds it.
FIXED: list[Any] = [DELETE, None, "x", -1, MAX_STEP + 1, 2**64 - 1, [], {}, True, 1.5]


def _fixed(valid: Valid, *, binary: bool = False) -> list[Any]:
    return [v for v in FIXED + ([b"x"] if binary else [])
            if v == DELETE or not valid(v)]


def _with(doc: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = dict(doc)
    if value == DELETE:
        out.pop(key, None)
    else:
        out[key] = value
    return out


def _refused(fn: Callable[[], Any]) -> None:
    with pytest.raises(CorruptCheckpointError):
        fn()


_MANIFEST_COMMON: dict[str, Valid] = {
    "schema": _equals(MANIFEST_SCHEMA),
    "step": _int_in(0, MAX_STEP),
    "attempt": lambda v: isinstance(v, str) and is_attempt_name(v),
    "metadata": lambda v: isinstance(v, dict),
    "created": lambda v: isinstance(v, str),
    "hash_algorithm": lambda v: isinstance(v, str) and v in ALGORITHMS,
}
V1_MANIFEST_VALID: dict[str, Valid] = {
    **_MANIFEST_COMMON,
    "format_version": _equals(1),
    "files": lambda v: isinstance(v, list) and all(
        isinstance(e, dict) and set(e) >= FILE_KEYS for e in v),
}


@pytest.mark.parametrize("key", sorted(V1_MANIFEST_VALID))
@REFUSE
@given(data=st.data())
def test_manifest_refuses_a_mutated_field(key: str, data: st.DataObject) -> None:
    valid = V1_MANIFEST_VALID[key]
    for value in [*_fixed(valid), data.draw(_mutation(valid, json_values))]:
        doc = _with(json.loads(VALID_MANIFEST), key, value)
        _refused(lambda: decode_manifest(json.dumps(doc).encode()))  # noqa: B023


def _v2_manifest() -> bytes:
    """A valid v2 manifest: ``dcp.msgpack`` (required: exactly one) and one rank file."""
    meta = (Chunk(0, 16, "2" * 64),)
    chunks = (Chunk(0, 8, "0" * 64), Chunk(8, 4, "1" * 64))
    entries = (ChunkedFileEntry(METADATA_NAME, 16, chunk_list_digest("sha256", meta), meta,
                                None),
               ChunkedFileEntry("rank-00000/data-0.safetensors", 12,
                                chunk_list_digest("sha256", chunks), chunks, 0))
    return Manifest(5, "a-20260101T000000Z-0123456789abcdef", entries,
                    "2026-01-01T00:00:00+00:00", "sha256", {"tensor_count": 0},
                    frozenset({SHARDED, CHUNKED}), world_size=1).to_bytes()


VALID_V2_MANIFEST = _v2_manifest()
V2_MANIFEST_VALID: dict[str, Valid] = {
    **_MANIFEST_COMMON,
    "format_version": _equals(2),
    "layout": _equals("sharded"),
    "world_size": lambda v: type(v) is int and v >= 1,  # §8.2: an int >= 1, no upper bound
    "files": lambda v: isinstance(v, list) and all(
        isinstance(e, dict) and set(e) >= V2_FILE_KEYS for e in v),
}


@pytest.mark.parametrize("key", sorted(V2_MANIFEST_VALID))
@REFUSE
@given(data=st.data())
def test_v2_manifest_refuses_a_mutated_field(key: str, data: st.DataObject) -> None:
    valid = V2_MANIFEST_VALID[key]
    for value in [*_fixed(valid), data.draw(_mutation(valid, json_values))]:
        doc = _with(json.loads(VALID_V2_MANIFEST), key, value)
        _refused(lambda: decode_manifest(json.dumps(doc).encode()))  # noqa: B023


@pytest.mark.parametrize("value", [2.0, True, "2", [2], None])
def test_a_manifest_version_that_only_equals_an_int_is_refused(value: Any) -> None:
    """``format_version`` is an int: 2.0 and true compare equal to 2 and 1 in Python, and were
    once read as them (found by the fuzzer above)."""
    doc = _with(json.loads(VALID_V2_MANIFEST), "format_version", value)
    _refused(lambda: decode_manifest(json.dumps(doc).encode()))


# -- format v3 (incremental): the manifest and each field of a reference ---------------------------

V3_ATTEMPT = "a-20260101T000000Z-0123456789abcdef"
V3_REF_ATTEMPT = "a-20251231T000000Z-fedcba9876543210"
V3_REF_CHUNKS = [[0, 8, "3" * 64], [8, 4, "4" * 64]]


def _v3_manifest() -> bytes:
    """A valid v3 manifest: state.msgpack, one tensor file, one reference."""
    from ckptfs.format.incremental import Reference

    state = (Chunk(0, 16, "2" * 64),)
    chunks = (Chunk(0, 8, "0" * 64), Chunk(8, 4, "1" * 64))
    entries = (ChunkedFileEntry("state.msgpack", 16, chunk_list_digest("sha256", state), state,
                                None),
               ChunkedFileEntry("tensors-00000.safetensors", 12,
                                chunk_list_digest("sha256", chunks), chunks, None))
    ref = Reference("ref-00000.safetensors", 3, V3_REF_ATTEMPT, "tensors-00000.safetensors",
                    64, "sha256", tuple(Chunk(*c) for c in V3_REF_CHUNKS))
    return Manifest(5, V3_ATTEMPT, entries, "2026-01-01T00:00:00+00:00", "sha256",
                    {"tensor_count": 0}, frozenset({CHUNKED, REFERENCES}),
                    references=(ref,)).to_bytes()


VALID_V3_MANIFEST = _v3_manifest()
V3_MANIFEST_VALID: dict[str, Valid] = {
    **_MANIFEST_COMMON,
    "format_version": _equals(3),
    "layout": _equals("incremental"),
    "files": lambda v: isinstance(v, list) and all(
        isinstance(e, dict) and set(e) >= V2_FILE_KEYS - {"rank"} for e in v),
    "references": lambda v: isinstance(v, list) and v == [],  # [] is valid: no references
}


def _relpath_ok(v: Any, taken: set[str]) -> bool:
    from ckptfs.format.layout import check_relpath

    try:
        return check_relpath(v) not in taken
    except (CkptfsError, TypeError, ValueError):
        return False


def _ref_chunks_ok(v: Any) -> bool:
    """A chunk list a 64 B referenced file may have (§9.2): [offset, length, hex] triples,
    the first at offset 0, sorted, disjoint, inside the file."""
    if not isinstance(v, list) or not v:
        return False
    end = 0
    for c in v:
        if not (isinstance(c, list) and len(c) == 3 and type(c[0]) is int
                and type(c[1]) is int and _is_digest(f"sha256:{c[2]}")):
            return False
        if c[0] < end or c[1] < 0 or c[0] + c[1] > 64:
            return False
        end = c[0] + c[1]
    return bool(v[0][0] == 0)


REFERENCE_VALID: dict[str, Valid] = {
    "path": lambda v: _relpath_ok(v, {"MANIFEST.json", "COMPLETE", "state.msgpack",
                                      "tensors-00000.safetensors"}),
    "step": _int_in(0, MAX_STEP),
    "attempt": lambda v: isinstance(v, str) and is_attempt_name(v) and v != V3_ATTEMPT,
    "source": lambda v: _relpath_ok(v, {"MANIFEST.json", "COMPLETE", "state.msgpack"}),
    "size": _int_in(12, 1 << 50),
    "algorithm": lambda v: isinstance(v, str) and v in ALGORITHMS,
    "chunks": _ref_chunks_ok,
}


@pytest.mark.parametrize("key", sorted(V3_MANIFEST_VALID))
@REFUSE
@given(data=st.data())
def test_v3_manifest_refuses_a_mutated_field(key: str, data: st.DataObject) -> None:
    valid = V3_MANIFEST_VALID[key]
    for value in [*_fixed(valid), data.draw(_mutation(valid, json_values))]:
        doc = _with(json.loads(VALID_V3_MANIFEST), key, value)
        if key == "references" and isinstance(value, list) and value:
            continue  # a list of references: the reference fields are fuzzed below
        _refused(lambda: decode_manifest(json.dumps(doc).encode()))  # noqa: B023


ref_values = json_values | st.lists(st.lists(st.integers(-3, 80) | st.text("0123456789abcdef",
                                                                          max_size=4),
                                             min_size=2, max_size=4), max_size=3)


@pytest.mark.parametrize("key", sorted(REFERENCE_VALID))
@REFUSE
@given(data=st.data())
def test_v3_reference_refuses_a_mutated_field(key: str, data: st.DataObject) -> None:
    """Each field of a reference deleted or given a value it cannot hold (the oracle above,
    from docs/protocol.md §9.2): the manifest is refused."""
    valid = REFERENCE_VALID[key]
    drawn = data.draw(_mutation(valid, ref_values if key == "chunks" else json_values))
    for value in [*_fixed(valid), drawn]:
        doc = json.loads(VALID_V3_MANIFEST)
        doc["references"] = [_with(doc["references"][0], key, value)]
        _refused(lambda: decode_manifest(json.dumps(doc).encode()))  # noqa: B023


@FUZZ
@given(data=st.binary(max_size=4096) | st.integers(0, len(VALID_V3_MANIFEST) - 1).map(
    lambda i: VALID_V3_MANIFEST[:i] + bytes([VALID_V3_MANIFEST[i] ^ 0x21])
    + VALID_V3_MANIFEST[i + 1:]))
def test_v3_manifest_from_random_or_flipped_bytes(data: bytes) -> None:
    only_typed(lambda: decode_manifest(data))


@st.composite
def _v3_manifests(draw: st.DrawFn) -> Any:
    """Valid v3 manifests: own files tiled by chunks, references with sorted disjoint chunks
    (the header first) inside their files, no name twice."""
    from ckptfs.format.incremental import Reference, reference_name

    algo = draw(st.sampled_from(sorted(a for a in ALGORITHMS if ALGORITHMS[a].cryptographic)))
    hexd = st.text("0123456789abcdef", min_size=1, max_size=64)

    def tiling(size: int) -> tuple[Chunk, ...]:
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, size - 1)), max_size=4))))
        bounds = [0, *[c for c in cuts if c < size], size]
        return tuple(Chunk(a, b - a, draw(hexd)) for a, b in itertools.pairwise(bounds))

    files = []
    for i, path in enumerate(["state.msgpack", *[f"tensors-{k:05d}.safetensors"
                                                 for k in range(draw(st.integers(0, 3)))]]):
        size = draw(st.integers(1 if i else 0, 1 << 20))
        chunks = tiling(size) if size else ()
        files.append(ChunkedFileEntry(path, size, chunk_list_digest(algo, list(chunks)),
                                      chunks, None))
    refs = []
    for k in range(draw(st.integers(0, 4))):
        header = draw(st.integers(8, 1024))
        offsets = sorted(set(draw(st.lists(st.integers(header, 1 << 30), max_size=5))))
        chunks = [Chunk(0, header, draw(hexd))]
        for a, b in itertools.pairwise(offsets):
            if draw(st.booleans()):
                chunks.append(Chunk(a, draw(st.integers(0, b - a)), draw(hexd)))
        end = chunks[-1].offset + chunks[-1].length
        attempt = f"a-2025{draw(st.integers(10, 12))}01T000000Z-{draw(st.integers(0, 2**63)):016x}"
        refs.append(Reference(reference_name(k), draw(st.integers(0, MAX_STEP)), attempt,
                              draw(st.sampled_from(["tensors-00000.safetensors",
                                                    "rank-00001/data-0.safetensors"])),
                              end + draw(st.integers(0, 100)), algo, tuple(chunks)))
    return Manifest(draw(st.integers(0, MAX_STEP)), V3_ATTEMPT, tuple(files),
                    "2026-01-01T00:00:00+00:00", algo, {"k": draw(finite_json_values)},
                    frozenset({CHUNKED, REFERENCES}), references=tuple(refs))


@REFUSE
@given(manifest=_v3_manifests())
def test_a_valid_v3_manifest_round_trips(manifest: Any) -> None:
    """Encoded and decoded again: the same manifest (files, chunks, references)."""
    data = manifest.to_bytes()
    got = decode_manifest(data)
    assert got == manifest
    assert got.to_bytes() == data


MARKER_VALID: dict[str, Valid] = {
    "schema": _equals("ckptfs.commit"),
    "format_version": _equals(1),
    "step": _int_in(0, MAX_STEP),
    "attempt": lambda v: isinstance(v, str) and is_attempt_name(v),
    "manifest": _equals("MANIFEST.json"),
    "manifest_digest": _is_digest,
    "manifest_size": _int_in(1, MAX_MANIFEST_BYTES),
    "created": lambda v: isinstance(v, str),
    "writer": lambda v: isinstance(v, dict),
}


@pytest.mark.parametrize("key", sorted(MARKER_VALID))
@REFUSE
@given(data=st.data())
def test_marker_refuses_a_mutated_field(key: str, data: st.DataObject) -> None:
    valid = MARKER_VALID[key]
    for value in [*_fixed(valid), data.draw(_mutation(valid, json_values))]:
        doc = _with(json.loads(VALID_MARKER), key, value)
        _refused(lambda: Marker.from_bytes(json.dumps(doc).encode()))  # noqa: B023


def _state_doc_blob() -> bytes:
    plan = plan_state({"w": torch.ones(2, 2), "meta": {"step": 3}})
    return b"".join(bytes(c) for c in plan.files[0].chunks())


VALID_STATE_DOC = msgpack.unpackb(_state_doc_blob(), raw=False)
STATE_DOC_VALID: dict[str, Valid] = {
    "schema": _equals("ckptfs.state"),
    "format_version": _equals(1),
    # the root of a state is a dict node (what a load returns is a dict)
    "tree": lambda v: isinstance(v, list) and len(v) == 2 and v[0] == "d",
    "tensors": lambda v: isinstance(v, list) and all(
        isinstance(s, list) and len(s) == 4 for s in v),
}


def _load_state_doc(blob: bytes) -> None:
    """What a load does with state.msgpack (reader.load_single_process): decode, rebuild, a
    dict root."""
    tree, slots = decode_state_doc(blob, where="s")
    state = build_tree(tree, [torch.zeros(s.shape) for s in slots], where="s")
    if not isinstance(state, dict):
        raise CorruptCheckpointError("s: the state root is not a dict")


@pytest.mark.parametrize("key", sorted(STATE_DOC_VALID))
@REFUSE
@given(data=st.data())
def test_state_doc_refuses_a_mutated_field(key: str, data: st.DataObject) -> None:
    valid = STATE_DOC_VALID[key]
    for value in [*_fixed(valid, binary=True), data.draw(_mutation(valid, msgpack_values))]:
        doc = _with(VALID_STATE_DOC, key, value)
        _refused(lambda: _load_state_doc(msgpack.packb(doc, use_bin_type=True)))  # noqa: B023


VALID_VALUE_DOC = msgpack.unpackb(encode_value({"a": torch.ones(2), "b": (1, "x")}, key="k"),
                                  raw=False)
VALUE_DOC_VALID: dict[str, Valid] = {
    "schema": _equals("ckptfs.value"),
    "format_version": _equals(2),
    "tree": _anything,  # any value is a value: only a missing tree is garbage
    "tensors": lambda v: isinstance(v, list) and all(
        isinstance(t, list) and len(t) == 3 for t in v),
}


@pytest.mark.parametrize("key", sorted(VALUE_DOC_VALID))
@REFUSE
@given(data=st.data())
def test_value_doc_refuses_a_mutated_field(key: str, data: st.DataObject) -> None:
    valid = VALUE_DOC_VALID[key]
    for value in [*_fixed(valid, binary=True), data.draw(_mutation(valid, msgpack_values))]:
        doc = _with(VALID_VALUE_DOC, key, value)
        _refused(lambda: decode_value(msgpack.packb(doc, use_bin_type=True),  # noqa: B023
                                      where="k"))


VALID_DCP_DOC: dict[str, Any] = {
    "schema": "ckptfs.dcp", "format_version": 2, "version": None,
    "state_dict_metadata": {"w": {"kind": "tensor", "dtype": "float32", "size": [2],
                                  "requires_grad": False, "memory_format": "contiguous_format",
                                  "pin_memory": False, "chunks": [[[0], [2]]]},
                            "v": {"kind": "bytes"}},
    "planner_data": {"w": ["w"], "v": ["v"]},
    "storage_data": [["w", [0], "rank-00000/data-0.safetensors", 64, 8],
                     ["v", None, "rank-00000/data-0.safetensors", 72, 20]],
    "storage_meta": None, "tree": None, "extra": {}}
DCP_DOC_VALID: dict[str, Valid] = {
    "schema": _equals("ckptfs.dcp"),
    "format_version": _equals(2),
    "state_dict_metadata": lambda v: isinstance(v, dict) and all(
        isinstance(e, dict) and e.get("kind") in ("bytes", "tensor") for e in v.values()),
    "storage_data": lambda v: isinstance(v, list) and all(
        isinstance(r, list) and len(r) == 5 for r in v),
}


@pytest.mark.parametrize("key", sorted(DCP_DOC_VALID))
@REFUSE
@given(data=st.data())
def test_dcp_doc_refuses_a_mutated_field(key: str, data: st.DataObject) -> None:
    valid = DCP_DOC_VALID[key]
    for value in [*_fixed(valid, binary=True), data.draw(_mutation(valid, msgpack_values))]:
        doc = _with(VALID_DCP_DOC, key, value)
        _refused(lambda: decode_metadata(msgpack.packb(doc, use_bin_type=True),  # noqa: B023
                                         where="d"))


def _nested(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> bytes:
    """``doc`` (deep-copied) with ``value`` at the key path ``path``, as msgpack."""
    out = copy.deepcopy(doc)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return msgpack.packb(out, use_bin_type=True)  # type: ignore[no-any-return]


#: Every place a decoder looks a code or name read from storage up in a table: (what, decode).
TABLE_LOOKUPS: dict[str, Callable[[Any], Any]] = {
    "state document: a tensor slot's dtype code": lambda v: _load_state_doc(
        _nested(VALID_STATE_DOC, ("tensors", 0, 2), v)),
    "value document: an inline tensor's dtype code": lambda v: decode_value(
        _nested(VALID_VALUE_DOC, ("tensors", 0, 0), v), where="k"),
    "dcp.msgpack: a tensor's dtype name": lambda v: decode_metadata(
        _nested(VALID_DCP_DOC, ("state_dict_metadata", "w", "dtype"), v), where="d"),
    "dcp.msgpack: a tensor's memory_format": lambda v: decode_metadata(
        _nested(VALID_DCP_DOC, ("state_dict_metadata", "w", "memory_format"), v), where="d"),
}


@pytest.mark.parametrize("value", [[], ["F32"], {}, {"a": 1}], ids=repr)
@pytest.mark.parametrize("where", sorted(TABLE_LOOKUPS))
def test_an_unhashable_code_is_refused(where: str, value: Any) -> None:
    """Regression: a dtype code (or memory format) that is a msgpack array or map
    raised a raw ``TypeError: unhashable type`` from the table lookup (value documents, the v1
    state document, ``dcp.msgpack``'s memory_format), not CorruptCheckpointError."""
    _refused(lambda: TABLE_LOOKUPS[where](value))


@pytest.mark.parametrize("step", [-1, MAX_STEP + 1, 10**40, True, 1.0])
def test_steps_a_step_directory_cannot_name_are_refused(step: Any) -> None:
    """Regression: the v1 manifest and the marker accepted a step beyond
    10^12 - 1, which no step directory can name (docs/protocol.md section 1)."""
    _refused(lambda: decode_manifest(json.dumps(
        _with(json.loads(VALID_MANIFEST), "step", step)).encode()))
    _refused(lambda: Marker.from_bytes(json.dumps(
        _with(json.loads(VALID_MARKER), "step", step)).encode()))


@pytest.mark.sharded
def test_the_valid_documents_decode() -> None:
    """The documents the refusal tests mutate are themselves accepted (else they prove
    nothing)."""
    decode_manifest(VALID_MANIFEST)
    decode_manifest(VALID_V2_MANIFEST)
    decode_manifest(VALID_V3_MANIFEST)
    Marker.from_bytes(VALID_MARKER).check_manifest(VALID_MANIFEST, where="m")
    _load_state_doc(msgpack.packb(VALID_STATE_DOC, use_bin_type=True))
    assert decode_value(msgpack.packb(VALID_VALUE_DOC, use_bin_type=True), where="k")["b"] == (
        1, "x")
    assert "w" in decode_metadata(msgpack.packb(VALID_DCP_DOC, use_bin_type=True),
                                  where="d").metadata.state_dict_metadata
