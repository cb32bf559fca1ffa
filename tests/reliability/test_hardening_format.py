"""Format and write side: values must come back with the values they had, a save must
never commit what a reader refuses, every value the format cannot hold is a typed error naming
its key path before anything is written, and the decoders are as strict as docs/protocol.md."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from functools import reduce
from typing import Any

import msgpack
import paths
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format import limits, manifest, serialize
from ckptfs.format.hashing import digest_bytes
from ckptfs.format.manifest import Manifest, Marker
from ckptfs.format.serialize import (
    build_tree,
    decode_state_doc,
    parse_safetensors_header,
    plan_state,
)
from ckptfs.protocol import reader
from ckptfs.testing.backend import Backend

ATTEMPT = "a-20260101T000000Z-0123456789abcdef"


def roundtrip(backend: Backend, state: dict[str, Any], step: int = 1) -> dict[Any, Any]:
    backend.open().save(step, state)
    return backend.open().load(step)


#: The write paths every "refused before writing" case runs through (tests/paths.py); the
#: ``cp`` cells are not among them: their source cannot hold these values (its hostile sources
#: are in tests/reliability/test_hostile.py).
_WRITER_NAMES = [n for n in paths.EVERY if not n.startswith("cp")]
WRITERS = paths.params(_WRITER_NAMES, slow=paths.REPLICAS)
#: The same, the two-tier remote copies included by default (a test of one case per path).
WRITERS_FEW = paths.params(_WRITER_NAMES)
def refused_before_writing(backend: Backend, state: dict[str, Any], where: str,
                           path: paths.WritePath = paths.V1, metadata: Any = None,
                           arm: Callable[[], None] | None = None) -> UnsupportedValueError:
    """``state`` saved through ``path`` is refused with :class:`UnsupportedValueError` naming
    ``where``, before anything is written: no marker, no file left, the previous checkpoint
    is still the latest and loads.  ``arm`` runs after the previous checkpoint is saved."""
    backend = path.at(backend)
    backend.open().save(0, {"previous": torch.ones(1)})
    if arm is not None:
        arm()
    before = backend.raw_files()
    with pytest.raises(UnsupportedValueError) as ei:
        path.save(backend.open(), 1, state, metadata=metadata)
    assert where in str(ei.value), str(ei.value)[:300]
    assert isinstance(ei.value, TypeError)
    paths.assert_not_committed(backend, 1, 0, before)
    return ei.value


# -- defect 1: the tied-tensor identity covers every property of a view ------------------------

def _z() -> torch.Tensor:
    return torch.complex(torch.arange(4.0), torch.arange(4.0) + 10)


@pytest.mark.parametrize("make", [
    lambda z: {"a": z, "b": z.conj()},
    lambda z: {"a": z.conj(), "b": z},
    lambda z: {"a": z.imag, "b": z.conj().imag},            # negative bit
    lambda z: {"a": z.conj().imag, "b": z.imag},
    lambda z: {"a": z.real, "b": z.imag},                   # same storage, other offset
    lambda z: {"a": torch.view_as_real(z), "b": z},         # other dtype over the storage
    lambda z: {"a": torch.arange(4, dtype=torch.int32),
               "b": torch.arange(4, dtype=torch.int32).view(torch.float32)},
    lambda z: {"a": torch.ones(1, 3).expand(4, 3), "b": torch.ones(1, 3)},  # zero stride
], ids=["conj", "conj-first", "neg", "neg-first", "offset", "view_as_real", "view-dtype",
        "expand"])
def test_views_come_back_with_their_own_values(local_backend: Backend, make: Any) -> None:
    state = make(_z())
    out = roundtrip(local_backend, state)
    for key, want in state.items():
        want = want.resolve_conj().resolve_neg()
        got = out[key]
        assert got.dtype == want.dtype and torch.equal(got, want), key
        assert not got.is_conj() and not got.is_neg()
    a, b = state.values()
    if not torch.equal(a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()):
        assert out["a"] is not out["b"]


def test_same_view_twice_is_still_tied(local_backend: Backend) -> None:
    z = _z()
    out = roundtrip(local_backend, {"a": z.conj(), "b": z.conj(), "c": z.imag, "d": z.imag})
    assert out["a"] is out["b"] and out["c"] is out["d"]
    assert torch.equal(out["a"], z.conj().resolve_conj())
    assert backend_tensor_count(local_backend) == 2


def test_distinct_empty_tensors_are_not_tied(local_backend: Backend) -> None:
    """Empty storages all have data pointer 0: identity must be the storage, not its address."""
    a, b = torch.empty(0), torch.empty(0)
    out = roundtrip(local_backend, {"a": a, "b": b})
    assert out["a"] is not out["b"]
    assert backend_tensor_count(local_backend) == 2


def backend_tensor_count(backend: Backend) -> int:
    return int(backend.open().info(1).manifest.metadata["tensor_count"])


class _Wrapper(torch.Tensor):
    """A minimal ``__torch_dispatch__`` wrapper subclass (what DTensor and FakeTensor are)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, dtype=inner.dtype, device=inner.device)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        raise NotImplementedError(func)


def _nested() -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def _quantized() -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)


@pytest.mark.parametrize("name,make,why", [
    ("nested", _nested, "nested"),
    ("jagged", lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                  layout=torch.jagged), "subclass"),
    ("wrapper", lambda: _Wrapper(torch.ones(2)), "subclass"),
    ("quantized", _quantized, "dtype"),
    ("sparse", lambda: torch.ones(2, 2).to_sparse_csr(), "layout"),
    ("meta", lambda: torch.ones(2, device="meta"), "meta"),
    ("complex128", lambda: torch.ones(2, dtype=torch.complex128), "dtype"),
], ids=["nested", "jagged", "wrapper", "quantized", "sparse", "meta", "complex128"])
@pytest.mark.parametrize("path", WRITERS)
def test_unstorable_tensors_are_typed_errors(local_backend: Backend, name: str, make: Any,
                                              why: str, path: paths.WritePath) -> None:
    err = refused_before_writing(local_backend, {"model": {"layer.w": make()}}, "model/layer.w",
                                 path)
    assert why in str(err)  # the serializer's own check, on every path


def test_dtensor_is_a_typed_error_for_the_plain_format() -> None:
    """A real DTensor (single-process gloo group, in a child so no process group leaks) given
    to the single-file planner is a typed error naming its key path, not torch's RuntimeError
    about an invalid storage.  (Sharded saves route DTensors elsewhere before this planner.)"""
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor, Shard
        from ckptfs.errors import UnsupportedValueError
        from ckptfs.format.serialize import plan_state
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        try:
            d = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
            try:
                plan_state({"m": {"w": d}})
            except UnsupportedValueError as exc:
                print("TYPED", exc)
        finally:
            dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert "TYPED" in done.stdout and "m/w" in done.stdout and "DTensor" in done.stdout, (
        done.stdout + done.stderr[-2000:])


# -- defect 2: whatever the reader refuses, the writer refuses first ---------------------------

@pytest.mark.parametrize("path", WRITERS_FEW)
def test_oversized_metadata_refused_before_writing(memory_backend: Backend,
                                                   path: paths.WritePath) -> None:
    err = refused_before_writing(memory_backend, {"w": torch.ones(2)}, "MANIFEST.json", path,
                                 metadata={"notes": "x" * (65 * 2**20)})
    assert str(limits.MAX_MANIFEST_BYTES) in str(err)


@pytest.mark.parametrize("path", paths.params(paths.EVERY, slow=[
    n for n in paths.EVERY if n not in ("v1", "v2", "v3", "v4")]))
def test_metadata_at_the_limit_commits_and_loads(memory_backend: Backend,
                                                 path: paths.WritePath) -> None:
    backend = path.at(memory_backend)
    store = backend.open()
    if path.references:  # the probe references what step 0 holds, as steps 2 and 3 will
        path.save(store, 0, {"w": torch.ones(2)})
    probe = path.save(store, 1, {"w": torch.ones(2)}, metadata={"notes": ""})
    room = limits.MAX_MANIFEST_BYTES - len(probe.manifest.to_bytes())
    path.save(store, 2, {"w": torch.ones(2)}, metadata={"notes": "x" * room})
    assert len(backend.open().info(2).manifest.to_bytes()) == limits.MAX_MANIFEST_BYTES
    assert torch.equal(backend.open().load()["w"], torch.ones(2))
    with pytest.raises(UnsupportedValueError):
        path.save(store, 3, {"w": torch.ones(2)}, metadata={"notes": "x" * (room + 1)})
    paths.assert_not_committed(backend, 3, 2)


@pytest.mark.parametrize("path", WRITERS)
def test_oversized_marker_refused_before_writing(local_backend: Backend,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 path: paths.WritePath) -> None:

    def long_host() -> None:
        monkeypatch.setattr("socket.gethostname", lambda: "h" * (limits.MAX_MARKER_BYTES + 1))

    refused_before_writing(local_backend, {"w": torch.ones(2)}, "COMPLETE", path,
                           arm=long_host)


@pytest.mark.parametrize("meta,where,why", [
    ({1: "int key"}, "<root>", "not a str"),
    ({"m": {"loss": float("inf")}}, "m/loss", "not finite"),
    ({"m": float("nan")}, "m", "not finite"),
    ({"big": 10**4300}, "big", "4300"),
    ({"s": "\ud800"}, "s", "Unicode"),
    ({"o": object()}, "o", "object"),
    ({"deep": reduce(lambda a, _: [a], range(limits.MAX_JSON_DEPTH), [])}, "deep", "deeper"),
])
@pytest.mark.parametrize("path", WRITERS)
def test_metadata_the_reader_would_refuse_or_change(local_backend: Backend, meta: Any,
                                                     where: str, why: str,
                                                     path: paths.WritePath) -> None:
    err = refused_before_writing(local_backend, {"w": torch.ones(1)}, where, path,
                                 metadata=meta)
    assert why in str(err)


@pytest.mark.parametrize("path", WRITERS)
def test_self_referencing_metadata(local_backend: Backend, path: paths.WritePath) -> None:
    loop: dict[str, Any] = {}
    loop["me"] = loop
    refused_before_writing(local_backend, {}, "me", path, metadata={"x": loop})


def test_metadata_nesting_limit_is_the_readers(memory_backend: Backend) -> None:
    deepest = reduce(lambda a, _: [a], range(limits.MAX_JSON_DEPTH - 3), [])  # manifest, meta
    memory_backend.open().save(1, {}, metadata={"deep": deepest})
    assert memory_backend.open().info(1).metadata["deep"] == deepest


def test_state_document_over_the_limit_names_the_largest_value(
        local_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serialize, "MAX_STATE_DOC_BYTES", 4096)
    err = refused_before_writing(local_backend, {"cfg": {"blob": b"x" * 5000}}, "cfg/blob")
    assert "4096" in str(err)


def test_limits_live_in_one_place() -> None:
    assert serialize.MAX_STATE_DOC_BYTES is limits.MAX_STATE_DOC_BYTES
    assert reader.MAX_STATE_DOC_BYTES is limits.MAX_STATE_DOC_BYTES
    assert serialize.MAX_DEPTH is limits.MAX_DEPTH
    assert serialize.MAX_HEADER_BYTES is limits.MAX_HEADER_BYTES
    assert manifest.MAX_MANIFEST_BYTES is limits.MAX_MANIFEST_BYTES
    assert manifest.MAX_MARKER_BYTES is limits.MAX_MARKER_BYTES
    assert limits.MAX_HEADER_BYTES == 100_000_000  # the safetensors library's own bound


def test_big_ints_up_to_the_digit_limit_commit_and_load(memory_backend: Backend) -> None:
    top = 10**limits.MAX_BIGINT_DIGITS - 1
    state = {"pos": top, "neg": -top, "key": {-top: "k"}}
    out = roundtrip(memory_backend, state)
    assert out == state
    for bad in (top + 1, -(top + 1)):
        with pytest.raises(UnsupportedValueError, match="4300"):
            plan_state({"v": {"x": bad}})


@pytest.mark.parametrize("kind", ["dict", "list", "tuple-key"])
def test_depth_limit_is_exact_and_shared(memory_backend: Backend, kind: str) -> None:
    def nest(levels: int) -> Any:
        if kind == "dict":
            return reduce(lambda a, _: {"k": a}, range(levels), 0)
        if kind == "list":
            return reduce(lambda a, _: [a], range(levels), 0)
        return {reduce(lambda a, _: (a,), range(levels - 1), 0): 1}  # the key is one deeper

    # The root dict is depth 0, its values depth 1: `levels` containers under "x" put the
    # innermost leaf at depth levels + 1.
    ok = {"x": nest(limits.MAX_DEPTH - 1)}
    assert roundtrip(memory_backend, ok) == ok
    with pytest.raises(UnsupportedValueError, match=f"deeper than {limits.MAX_DEPTH}"):
        plan_state({"x": nest(limits.MAX_DEPTH)})


def test_tensor_named_like_the_header_metadata(memory_backend: Backend) -> None:
    state = {"__metadata__": torch.arange(3.0), "x": torch.ones(2, dtype=torch.int8)}
    out = roundtrip(memory_backend, state)
    assert torch.equal(out["__metadata__"], state["__metadata__"])


def test_many_tensors_split_shards_by_header_size(memory_backend: Backend,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serialize, "SHARD_HEADER_BUDGET", 2000)
    state = {f"layer{i}": torch.full((2,), float(i)) for i in range(60)}
    info = memory_backend.open().save(1, state)
    assert len([f for f in info.manifest.files if f.path.endswith(".safetensors")]) > 2
    out = memory_backend.open().load(1)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_header_over_the_limit_is_refused(local_backend: Backend,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serialize, "MAX_HEADER_BYTES", 1000)
    refused_before_writing(local_backend, {"k" * 2000: torch.ones(1)}, "safetensors header")


# -- class audit: values the format cannot hold ------------------------------------------------

@pytest.mark.parametrize("name,state,where", [
    ("surrogate", {"s": {"x": "bad \ud800 surrogate"}}, "s/x"),
    ("tensor-in-key", {"s": {("a", torch.ones(1)): 1}}, "s/<key>"),
    ("bigint", {"s": {"x": 10**5000}}, "s/x"),
    ("bigint-key", {"s": {10**5000: "key"}}, "s/<key>"),
    ("bytearray", {"s": {"x": bytearray(b"ab")}}, "s/x"),
], ids=["surrogate", "tensor-in-key", "bigint", "bigint-key", "bytearray"])
@pytest.mark.parametrize("path", WRITERS)
def test_values_the_format_cannot_hold(local_backend: Backend, name: str,
                                       state: dict[str, Any], where: str,
                                       path: paths.WritePath) -> None:
    refused_before_writing(local_backend, state, where, path)


@pytest.mark.parametrize("path", WRITERS)
def test_self_referencing_state(local_backend: Backend, path: paths.WritePath) -> None:
    loop: dict[str, Any] = {}
    loop["again"] = {"x": loop}
    refused_before_writing(local_backend, {"a": loop}, "a/again/x", path)


def test_the_dtensor_search_survives_a_cycle_and_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the walk that looks for DTensors before a save (save_async's
    refusal of a sharded state without torch.distributed, and ``wants_sharded_save`` under a
    one-rank process group) recursed without a guard: a self-referencing state raised a raw
    RecursionError from save_async instead of the serializer's UnsupportedValueError."""
    from ckptfs.protocol import collective

    loop: dict[str, Any] = {}
    loop["again"] = {"x": loop}
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert collective.find_dtensor({"a": loop, "deep": deep}) is None
    assert not collective.has_dtensor({"a": loop, "deep": deep})
    monkeypatch.setattr(collective, "is_dtensor", lambda t: t.device.type == "meta")
    loop["w"] = [torch.ones(1), torch.ones(1, device="meta")]
    assert collective.find_dtensor({"a": loop}) == ("a", "w", 1)


# -- the decoders are as strict as the spec ----------------------------------------------------

def _state_doc(**over: Any) -> dict[str, Any]:
    doc = {"schema": "ckptfs.state", "format_version": 1, "tree": ["d", []], "tensors": []}
    doc.update(over)
    return doc


def test_newer_state_version_is_a_format_version_error() -> None:
    with pytest.raises(FormatVersionError):
        decode_state_doc(msgpack.packb(_state_doc(format_version=2)), where="s")
    for bad in (0, True, "1", None):
        with pytest.raises(CorruptCheckpointError) as ei:
            decode_state_doc(msgpack.packb(_state_doc(format_version=bad)), where="s")
        assert not isinstance(ei.value, FormatVersionError)


def test_duplicate_keys_in_the_state_document() -> None:
    good = msgpack.packb(_state_doc())
    # The same map with "tree" twice: 0x84 (4 entries) -> 0x85, the pair appended.
    dup = bytes([0x85]) + good[1:] + msgpack.packb("tree") + msgpack.packb(["d", [[1, 2]]])
    with pytest.raises(CorruptCheckpointError, match="duplicate"):
        decode_state_doc(dup, where="s")


@pytest.mark.parametrize("tree", [
    ["d", [["a", 1], ["a", 2]]],
    ["d", [[1, 1], [True, 2]]],           # equal keys as Python sees them
    ["d", [[["t", [1, ["T", 0]]], 1]]],   # tensor inside a key
    ["S", [2**63]],
    ["i", "+5"], ["i", " 5"], ["i", "1_000"], ["i", "\u0663"], ["i", "05"], ["i", "-"],
    ["i", "1" * (limits.MAX_BIGINT_DIGITS + 1)],
    ["dt", 5], ["dt", "Tensor"],
])
def test_malformed_trees(tree: Any) -> None:
    with pytest.raises(CorruptCheckpointError):
        build_tree(["d", [["k", tree]]], [torch.zeros(1)], where="s")


def test_tree_depth_limit_on_read() -> None:
    # "k"'s value is at depth 1; MAX_DEPTH - 1 lists around the leaf put it at MAX_DEPTH.
    deep = reduce(lambda a, _: ["l", [a]], range(limits.MAX_DEPTH - 1), 0)
    assert build_tree(["d", [["k", deep]]], [], where="s")
    too_deep = ["l", [deep]]
    with pytest.raises(UnsafeCheckpointError):
        build_tree(["d", [["k", too_deep]]], [], where="s")


def _manifest_doc() -> dict[str, Any]:
    entry = manifest.FileEntry("state.msgpack", 1, digest_bytes("sha256", b"x"))
    m = Manifest(5, ATTEMPT, (entry,), "2026-01-01T00:00:00+00:00", "sha256",
                 {"tensor_count": 0})
    return dict(json.loads(m.to_bytes()))


def _marker_doc() -> dict[str, Any]:
    return dict(json.loads(Marker(5, ATTEMPT, digest_bytes("sha256", b"m"), 10, "t").to_bytes()))


@pytest.mark.parametrize("key", sorted(manifest.MANIFEST_KEYS - {"schema", "format_version"}))
def test_manifest_requires_every_key(key: str) -> None:
    doc = _manifest_doc()
    del doc[key]
    with pytest.raises(CorruptCheckpointError, match=key):
        Manifest.from_bytes(json.dumps(doc).encode())


@pytest.mark.parametrize("key", sorted(manifest.FILE_KEYS))
def test_manifest_file_entry_requires_every_key(key: str) -> None:
    doc = _manifest_doc()
    del doc["files"][0][key]
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_bytes(json.dumps(doc).encode())


@pytest.mark.parametrize("key", sorted(manifest.MARKER_KEYS - {"schema", "format_version"}))
def test_marker_requires_every_key(key: str) -> None:
    doc = _marker_doc()
    del doc[key]
    with pytest.raises(CorruptCheckpointError, match=key):
        Marker.from_bytes(json.dumps(doc).encode())


def test_unknown_extra_keys_are_ignored() -> None:
    doc = _manifest_doc()
    doc["future"] = {"x": 1}
    doc["files"][0]["future"] = 1
    assert Manifest.from_bytes(json.dumps(doc).encode()).step == 5
    mdoc = _marker_doc()
    mdoc["future"] = [1]
    assert Marker.from_bytes(json.dumps(mdoc).encode()).step == 5


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(manifest="OTHER.json"),
    lambda d: d.update(manifest_size=True),
    lambda d: d.update(attempt=ATTEMPT + "\n"),
    lambda d: d.update(attempt=ATTEMPT.replace("2026", "\uff12\uff10\uff12\uff16")),
    lambda d: d.update(step=True),
    lambda d: d.update(writer=[]),
])
def test_marker_rejects(mutate: Any) -> None:
    doc = _marker_doc()
    mutate(doc)
    with pytest.raises(CorruptCheckpointError):
        Marker.from_bytes(json.dumps(doc).encode())


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(attempt=ATTEMPT + "\n"),
    lambda d: d.update(hash_algorithm="md5"),
    lambda d: d.update(created=5),
    lambda d: d["files"][0].update(algorithm="blake3"),
    lambda d: d["files"][0].update(size=True),
    lambda d: d.update(files=[5]),
])
def test_manifest_rejects_more(mutate: Any) -> None:
    doc = _manifest_doc()
    mutate(doc)
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_bytes(json.dumps(doc).encode())


def test_duplicate_json_keys_are_rejected() -> None:
    text = json.dumps(_manifest_doc())
    dup_top = text[:-1] + ', "step": 6}'
    with pytest.raises(CorruptCheckpointError, match="duplicate"):
        Manifest.from_bytes(dup_top.encode())
    mtext = json.dumps(_marker_doc())
    with pytest.raises(CorruptCheckpointError, match="duplicate"):
        Marker.from_bytes((mtext[:-1] + f', "attempt": "{ATTEMPT}"}}').encode())
    doc = _manifest_doc()
    doc["metadata"] = {"a": 1}
    nested = json.dumps(doc).replace('"metadata": {"a": 1}', '"metadata": {"a": 1, "a": 2}')
    with pytest.raises(CorruptCheckpointError, match="duplicate"):
        Manifest.from_bytes(nested.encode())


def test_json_depth_limit_on_read() -> None:
    doc = _manifest_doc()
    doc["metadata"] = {"d": reduce(lambda a, _: [a], range(limits.MAX_JSON_DEPTH - 3), [])}
    Manifest.from_bytes(json.dumps(doc).encode())  # exactly MAX_JSON_DEPTH
    doc["metadata"] = {"d": reduce(lambda a, _: [a], range(limits.MAX_JSON_DEPTH - 2), [])}
    with pytest.raises(UnsafeCheckpointError, match="deeper"):
        Manifest.from_bytes(json.dumps(doc).encode())


def _safetensors(header: str, data: bytes = b"\0" * 4) -> bytes:
    h = header.encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize("header", [
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
    '"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',                  # duplicate name
    '{"__metadata__":{"x":1},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
    '"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}',                     # overlap
    '{"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}',                    # gap
    '{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}',                    # trailing
])
def test_safetensors_header_strictness(header: str) -> None:
    with pytest.raises(CorruptCheckpointError):
        parse_safetensors_header(_safetensors(header), where="t")


def test_safetensors_header_length_bounds() -> None:
    ok = '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    assert parse_safetensors_header(_safetensors(ok), where="t")[1]["a"].end == 4
    blob = _safetensors(ok)
    for hlen in (len(blob) - 7, limits.MAX_HEADER_BYTES + 1, 2**64 - 1):
        with pytest.raises(UnsafeCheckpointError):
            parse_safetensors_header(struct.pack("<Q", hlen) + blob[8:], where="t")


# -- the writer's whole class: anything it accepts, the reader reads back equal ----------------

_scalars = (st.none() | st.booleans() | st.integers(-(10**4400), 10**4400) | st.floats()
            | st.text(max_size=8) | st.binary(max_size=8)
            | st.sampled_from([torch.float16, torch.bfloat16, torch.int8]))
_keys = st.none() | st.booleans() | st.integers(-(10**4400), 10**4400) | st.text(max_size=4) \
    | st.binary(max_size=4) | st.tuples(st.integers(), st.text(max_size=3))
_states = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
    | st.dictionaries(_keys, inner, max_size=3),
    max_leaves=12)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_states)
def test_writer_accepts_only_what_reads_back_equal(value: Any) -> None:
    state = {"v": value}
    try:
        plan = plan_state(state)
    except UnsupportedValueError as exc:
        assert "v" in str(exc)
        return
    blob = b"".join(bytes(c) for c in plan.files[0].chunks())
    tree, _ = decode_state_doc(blob, where="s")
    assert _same(build_tree(tree, [], where="s"), state)


# -- two ranks: the same refusals, on every rank, nothing committed ---------------------------

@pytest.mark.sharded
def test_two_ranks_refuse_what_one_process_refuses(local_backend: Backend) -> None:
    """One 2-rank gloo job (one launch: ranks are slow to start) saves a valid step, then
    steps the format cannot hold: every rank must get the UnsupportedValueError the
    single-process save raises (also when only rank 1 holds the bad value), no marker may be
    written, and the valid step stays the latest and loads."""
    from ckptfs.testing.reliability import state_for

    good = state_for(1)
    saves = [
        (1, good, None),
        (2, good, {"m": float("nan")}),                                   # metadata
        (3, [good, {**good, "bad": {"x": bytearray(b"ab")}}], None),      # rank 1 only
        (4, {**good, "c": torch.ones(2, dtype=torch.complex128)}, None),  # a tensor dtype
        (5, {**good, "k": {0: 1, "0": 2}}, None),                         # keys equal as str
    ]
    outcomes = paths.run_saves(local_backend.url, saves)
    assert outcomes[0] is None, outcomes[0]
    wrong = {step: outcome for (step, _, _), outcome in zip(saves[1:], outcomes[1:],
                                                            strict=True)
             if outcome is None or outcome[0] != "UnsupportedValueError"}
    assert wrong == {}, wrong
    for step in (2, 3, 4, 5):
        paths.assert_not_committed(local_backend, step, 1)
    assert local_backend.open().info(1).manifest.format_version == 2
