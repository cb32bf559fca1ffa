"""Property-based fuzzing of every decoder that reads bytes from storage: the manifest, the
commit marker, the state document and tree, and the safetensors header.  Whatever the bytes,
only typed errors (:class:`~ckptfs.errors.CkptfsError`) may escape."""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.errors import CkptfsError
from ckptfs.format.hashing import digest_bytes
from ckptfs.format.manifest import Manifest, Marker
from ckptfs.format.serialize import (
    build_tree,
    decode_state_doc,
    parse_safetensors_header,
    plan_state,
)

FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
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
