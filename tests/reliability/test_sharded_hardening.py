"""Format v2 read path, hostile input: every defect of a sharded checkpoint that the
reader's own checks must catch, with the same typed error through ``store.load(step)``,
``store.load(into=...)`` and ``store.verify``, a rollback with ``allow_rollback=True``, and the
by-hand checker of docs/protocol.md rejecting the same checkpoint.  In one process (DCP without
collectives); tests/protocol/test_sharded_ranks.py runs the collective cases on 2 gloo ranks."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from dist_util import save_sharded
from sharded_tamper import (
    RANK_FILE,
    attempt_dir,
    edit_dcp,
    location,
    rank_header,
    reseal,
    sharded_state,
    write_run,
)
from test_format_spec import run_checker

import ckptfs
from ckptfs.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    LoadOptionError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format import versions
from ckptfs.format.sharded_metadata import check_cover
from ckptfs.format.versions import decode_manifest, is_sharded
from ckptfs.protocol import chunks as chunk_reader
from ckptfs.protocol.commit import Attempt
from ckptfs.testing.conformance import assert_state_equal

# ----------------------------------------------------------------------------------------------
# Tampered dcp.msgpack: (edit, error class, text the error must contain)


def _gap(doc: dict[str, Any]) -> None:  # "w" declared 8 long, its one chunk covers 6
    doc["state_dict_metadata"]["w"]["size"] = [8]


def _overlap(doc: dict[str, Any]) -> None:  # "w" as 0..2 and 2..4: 6 elements, 2 twice, 5 never
    doc["state_dict_metadata"]["w"]["chunks"] = [[[0], [3]], [[2], [3]]]
    doc["storage_data"] = [e for e in doc["storage_data"] if e[0] != "w"] + [
        ["w", [0], *location(doc, "v")[2:]], ["w", [2], *location(doc, "v")[2:]]]


def _no_chunks(doc: dict[str, Any]) -> None:  # a 4 GiB tensor with nothing stored
    doc["state_dict_metadata"]["huge"] = dict(doc["state_dict_metadata"]["w"], size=[2**30],
                                              chunks=[])
    doc["planner_data"]["huge"] = ["huge"]
    doc["tree"][1].append(["huge", ["v", None]])


def _newer(doc: dict[str, Any]) -> None:
    doc["format_version"] = 3


def _outside(doc: dict[str, Any]) -> None:  # an item one byte off its chunk
    location(doc, "w")[3] += 1


def _dotdot(doc: dict[str, Any]) -> None:
    location(doc, "w")[2] = "../" + RANK_FILE


def _duplicate(doc: dict[str, Any]) -> bytes:  # "extra" named twice (repacked by hand)
    packer = msgpack.Packer(use_bin_type=True)
    out = packer.pack_map_header(len(doc) + 1)
    for k, v in [*doc.items(), ("extra", {"x": 1})]:
        out += packer.pack(k) + packer.pack(v)
    return out


def _bomb(doc: dict[str, Any]) -> bytes:  # 100,000 nested arrays
    return b"\x91" * 100_000 + b"\xc0"


def _huge_array(doc: dict[str, Any]) -> bytes:  # an array declaring 2^32 - 1 items
    return b"\xdd\xff\xff\xff\xff\xc0"


def _missing_key(doc: dict[str, Any]) -> None:
    del doc["planner_data"]


def _size_key(doc: dict[str, Any]) -> None:  # a torch.Size as a dict key: str() is torch's
    item = next(i for i in doc["tree"][1] if i[0] == "w")
    item[0] = ["S", [6]]


def _bool_as_int(doc: dict[str, Any]) -> None:
    doc["state_dict_metadata"]["w"]["requires_grad"] = 0


TAMPERED = {
    "gap": (_gap, CorruptCheckpointError, "gap"),
    "overlap": (_overlap, CorruptCheckpointError, "overlap"),
    "no_chunks": (_no_chunks, CorruptCheckpointError, "none stored"),
    "newer": (_newer, FormatVersionError, "upgrade ckptfs"),
    "outside": (_outside, CorruptCheckpointError, "not a chunk"),
    "dotdot": (_dotdot, UnsafeCheckpointError, "not a safe relative path"),
    "duplicate": (_duplicate, CorruptCheckpointError, "duplicate key"),
    "bomb": (_bomb, CorruptCheckpointError, "not valid msgpack"),
    "huge_array": (_huge_array, CorruptCheckpointError, "not valid msgpack"),
    "missing_key": (_missing_key, CorruptCheckpointError, "planner_data"),
    "bool_as_int": (_bool_as_int, CorruptCheckpointError, "requires_grad"),
    "size_key": (_size_key, CorruptCheckpointError, "is not a str, int"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_metadata_is_refused_typed_everywhere(tmp_path: Path, case: str) -> None:
    edit, cls, text = TAMPERED[case]
    root = tmp_path / "run"
    store, attempt = write_run(root)
    edit_dcp(root, 20, attempt, edit)
    # store.load(step): the class, naming dcp.msgpack
    with pytest.raises(cls, match=text) as info:
        store.load(20)
    assert type(info.value) is cls and "dcp.msgpack" in str(info.value)
    # store.load(into=...): the same class (not ShardedLoadError wrapping "metadata is None")
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in sharded_state().items()}
    with pytest.raises(cls, match=text) as info2:
        store.load(20, into=into)
    assert type(info2.value) is cls
    assert torch.equal(into["w"], torch.zeros(6))  # nothing was loaded
    # verify reports it; the by-hand checker rejects it
    with pytest.raises(CorruptCheckpointError, match=r"dcp\.msgpack"):
        store.verify(20)
    assert run_checker(tmp_path, root).returncode != 0
    # allow_rollback: the previous step (a newer format is never rolled back over)
    if cls is FormatVersionError:
        with pytest.raises(FormatVersionError):
            store.load(allow_rollback=True)
    else:
        assert store.load(allow_rollback=True)["trainer"] == {"step": 10}
        with pytest.raises(CorruptCheckpointError, match="Refusing to fall back silently"):
            store.load()


def test_flipped_byte_in_metadata(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store, attempt = write_run(root)
    path = attempt_dir(root, 20, attempt) / "dcp.msgpack"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    for load in (lambda: store.load(20), lambda: store.load(20, into={"w": torch.zeros(6)})):
        with pytest.raises(CorruptCheckpointError, match=r"dcp\.msgpack.*differ from their digest"):
            load()
    assert store.load(allow_rollback=True)["trainer"] == {"step": 10}


def test_logged_without_traceback(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                  caplog: pytest.LogCaptureFixture) -> None:
    """DCP logs a warning with a traceback when read_metadata raises ("Global metadata is not
    found"): the reader never lets it raise.  (DCP's own event logger, which has a NullHandler
    and does not propagate, records every failure of ``load``: it prints nothing.)"""
    root = tmp_path / "run"
    store, attempt = write_run(root)
    edit_dcp(root, 20, attempt, _newer)
    caplog.clear()
    with pytest.raises(FormatVersionError):
        store.load(20, into={"w": torch.zeros(6)})
    out, err = capfd.readouterr()
    shown = [r for r in caplog.records if r.name != "c10d-NullHandler-dcp_logger"]
    assert "Traceback" not in out + err
    assert not [r for r in shown if r.exc_info or "metadata" in r.getMessage()], shown


# ----------------------------------------------------------------------------------------------
# Rank files: the safetensors header, value documents, links, sizes


def test_header_disagreeing_with_metadata(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store, attempt = write_run(root)
    path, _, header = rank_header(root, 20, attempt)
    assert header["w@0"]["dtype"] == "F32"
    data = path.read_bytes()
    start = data.index(b'"w@0":{"dtype":"F32"')
    path.write_bytes(data[:start] + data[start:start + 30].replace(b"F32", b"I32", 1)
                     + data[start + 30:])  # same length: only the dtype differs
    reseal(root, 20, attempt)
    for load in (lambda: store.load(20), lambda: store.load(20, into={"w": torch.zeros(6)})):
        with pytest.raises(CorruptCheckpointError, match=r"I32.*dcp\.msgpack says F32"):
            load()
    with pytest.raises(CorruptCheckpointError, match="must agree"):
        store.verify(20)
    done = run_checker(tmp_path, root)
    assert done.returncode != 0 and "w@0" in done.stderr


def test_value_holding_a_pickle(tmp_path: Path) -> None:
    """verify decodes every value document: a pickle there fails verify as it fails load."""
    root = tmp_path / "run"
    store, attempt = write_run(root)
    path = attempt_dir(root, 20, attempt) / RANK_FILE
    doc = msgpack.unpackb((attempt_dir(root, 20, attempt) / "dcp.msgpack").read_bytes())
    _, _, off, length = location(doc, "trainer.names")[1:]
    evil = pickle.dumps(["a", "b"])
    assert len(evil) <= length
    data = bytearray(path.read_bytes())
    data[off:off + length] = evil + b"\0" * (length - len(evil))
    path.write_bytes(bytes(data))
    reseal(root, 20, attempt)
    with pytest.raises(CorruptCheckpointError, match="never unpickles"):
        store.load(20)
    with pytest.raises(CorruptCheckpointError, match="never unpickles"):
        store.verify(20)
    assert run_checker(tmp_path, root).returncode != 0


def test_symlinked_rank_file(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store, attempt = write_run(root)
    path = attempt_dir(root, 20, attempt) / RANK_FILE
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(path.read_bytes())  # the same bytes: only the link is wrong
    path.unlink()
    os.symlink(elsewhere, path)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        store.load(20)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        store.load(20, into={"w": torch.zeros(6)})
    with pytest.raises(CorruptCheckpointError, match="symbolic link") as info:
        store.verify(20)
    assert "size" not in str(info.value)


def test_declared_chunk_of_2_45_bytes_is_never_requested(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last item of the rank file (a value) declared 2^45 bytes long, consistently in
    ``dcp.msgpack`` and the manifest: only the listing can tell, and it comes first (the full
    load's own, and the coordinator's before any rank reads data)."""
    import hashlib

    root = tmp_path / "run"
    store, attempt = write_run(root)
    manifest = json.loads((attempt_dir(root, 20, attempt) / "MANIFEST.json").read_bytes())
    last = next(f for f in manifest["files"] if f["path"] == RANK_FILE)["chunks"][-1]

    def grow_item(doc: dict[str, Any]) -> None:
        entry = next(e for e in doc["storage_data"] if e[3] == last[0] and e[1] is None)
        entry[4] = 2**45

    def grow_chunk(m: dict[str, Any]) -> None:
        f = next(f for f in m["files"] if f["path"] == RANK_FILE)
        f["size"] += 2**45 - f["chunks"][-1][1]
        f["chunks"][-1][1] = 2**45
        text = "".join(f"{c[0]} {c[1]} {c[2]}\n" for c in f["chunks"]).encode()
        f["digest"] = "sha256:" + hashlib.sha256(text).hexdigest()

    edit_dcp(root, 20, attempt, grow_item)
    reseal(root, 20, attempt, grow_chunk)
    asked: list[int] = []
    real = chunk_reader.read_range
    monkeypatch.setattr(chunk_reader, "read_range",
                        lambda s, p, start, n: asked.append(n) or real(s, p, start, n))
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
            for k, v in sharded_state().items()}
    for load in (lambda: store.load(20), lambda: store.load(20, into=into)):
        with pytest.raises(CorruptCheckpointError, match="size differs") as info:
            load()
        assert not isinstance(info.value, StorageError)
    assert asked and all(n < 2**40 for n in asked)  # dcp.msgpack only, never the 2^45


# ----------------------------------------------------------------------------------------------
# Chunk coverage, the v2 manifest, dtype conversion, key collisions, the manifest limit


@pytest.mark.parametrize("size,chunks,ok", [
    ([6], [([0], [6])], True),
    ([7, 3], [([0, 0], [4, 3]), ([4, 0], [3, 3])], True),
    ([4, 4], [([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [2, 2]), ([2, 2], [2, 2])], True),
    ([9], [([0], [3]), ([3], [3]), ([6], [3]), ([9], [0])], True),  # an empty shard at the end
    ([0, 3], [([0, 0], [0, 3])], True),
    ([], [([], [])], True),
    ([0], [], True),
    ([6], [([0], [3]), ([4], [2])], False),          # gap
    ([6], [([0], [4]), ([3], [3])], False),          # overlap (and a gap: same count)
    ([4, 4], [([0, 0], [4, 2]), ([0, 0], [2, 4]), ([2, 2], [2, 2])], False),
    ([6], [([0], [6]), ([2], [7])], False),          # outside
    ([], [([], []), ([], [])], False),               # a 0-d tensor stored twice
    ([2**30], [], False),                            # nothing stored
    ([6], [([0, 0], [6, 1])], False),                # another number of dimensions
])
def test_chunk_cover(size: list[int], chunks: list[Any], ok: bool) -> None:
    if ok:
        check_cover("t", size, chunks, "here")
    else:
        with pytest.raises(CorruptCheckpointError, match="here: the chunks of tensor 't'"):
            check_cover("t", size, chunks, "here")


def _mutations() -> dict[str, Any]:
    def drop(key: str) -> Any:
        return lambda m: m.pop(key)

    def file0(fn: Any) -> Any:
        return lambda m: fn(next(f for f in m["files"] if f["path"] != "dcp.msgpack"))

    return {
        **{f"no_{k}": drop(k) for k in ("world_size", "layout", "hash_algorithm", "created",
                                        "metadata", "files", "attempt")},
        "no_file_algorithm": file0(lambda f: f.pop("algorithm")),
        "no_file_rank": file0(lambda f: f.pop("rank")),
        "other_algorithm": file0(lambda f: f.update(algorithm="blake3")),
        "unknown_hash_algorithm": lambda m: m.update(hash_algorithm="md5"),
        "rank_not_its_path": file0(lambda f: f.update(rank=1)),
        "rank_over_world": lambda m: m.update(world_size=0),
        "metadata_with_rank": lambda m: next(f for f in m["files"]
                                             if f["path"] == "dcp.msgpack").update(rank=0),
        "no_dcp_msgpack": lambda m: m.update(files=[f for f in m["files"]
                                                    if f["path"] != "dcp.msgpack"]),
        "noncanonical_rank_path": file0(lambda f: f.update(path="rank-0/data-0.safetensors")),
        "other_file": lambda m: m["files"].append(dict(m["files"][0], path="notes.txt",
                                                       rank=None)),
        "world_size_bool": lambda m: m.update(world_size=True),
    }


@pytest.mark.parametrize("case", sorted(_mutations()))
def test_v2_manifest_decoder_is_strict(tmp_path: Path, case: str) -> None:
    store = ckptfs.open(str(tmp_path), algorithm="sha256")
    info = save_sharded(store.storage, 1, {"w": torch.ones(2), "n": 1}, algorithm="sha256")
    good = json.loads(info.manifest.to_bytes())
    assert is_sharded(decode_manifest(json.dumps(good).encode()))
    _mutations()[case](good)
    with pytest.raises(CorruptCheckpointError):
        decode_manifest(json.dumps(good).encode())


@pytest.mark.parametrize("wanted", [torch.bfloat16, torch.float64, torch.int8, torch.bool])
def test_load_into_never_converts_dtypes(tmp_path: Path, wanted: torch.dtype) -> None:
    store = ckptfs.open(str(tmp_path))
    save_sharded(store.storage, 1, {"w": torch.arange(6, dtype=torch.float32),
                                    "i": torch.arange(3), "n": 5})
    into = {"w": torch.zeros(6, dtype=wanted), "i": torch.zeros(3, dtype=torch.int64), "n": 0}
    with pytest.raises(LoadOptionError, match=rf"key 'w' is stored as torch.float32.*{wanted}"):
        store.load(1, into=into)
    assert not into["w"].any() and not into["i"].any() and into["n"] == 0  # untouched
    into["w"] = torch.zeros(6)
    assert store.load(1, into=into)["n"] == 5 and torch.equal(into["i"], torch.arange(3))


@pytest.mark.parametrize("state", [
    {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}},
    {"a": {"b.c": 1, "b": {"c": 2}}},
    {"x": [torch.ones(1), {"0": 1}], "x.0": 3},
    {0: torch.ones(1), "0": 2},
])
def test_keys_colliding_once_dotted(tmp_path: Path, state: dict[Any, Any]) -> None:
    store = ckptfs.open(str(tmp_path))
    with pytest.raises(UnsupportedValueError, match="rename one"):
        save_sharded(store.storage, 1, state)
    assert store.steps() == []


def test_manifest_over_the_reader_limit_fails_before_any_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "MAX_MANIFEST_BYTES", 4096)
    writes: list[str] = []
    real = Attempt.write_file
    monkeypatch.setattr(Attempt, "write_file",
                        lambda self, rel, *a, **k: writes.append(rel) or real(self, rel, *a, **k))
    store = ckptfs.open(str(tmp_path))
    state = {f"t{i}": torch.ones(1) for i in range(60)}
    with pytest.raises(UnsupportedValueError, match=r"MANIFEST\.json"):
        save_sharded(store.storage, 1, state)
    assert writes == [] and store.steps() == []
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # the attempt was discarded
    save_sharded(store.storage, 1, {"t": torch.ones(1)})  # a small one still fits


def test_dcp_reader_with_another_planner_refuses_conversion(tmp_path: Path) -> None:
    """The reader itself refuses too (plain dcp.load with a planner that is not ckptfs's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    import ckptfs.dcp

    store = ckptfs.open(str(tmp_path))
    save_sharded(store.storage, 1, {"w": torch.arange(4.0)})
    into = {"w": torch.zeros(4, dtype=torch.float16)}
    with pytest.raises(BaseException, match="never converts dtypes") as info:
        dcp.load(into, storage_reader=ckptfs.dcp.Reader(str(tmp_path), 1),
                 planner=DefaultLoadPlanner(), no_dist=True)
    assert "LoadOptionError" in str(info.value) or isinstance(info.value, LoadOptionError)
    assert not into["w"].any()


def test_value_document_rules() -> None:
    from ckptfs.format.sharded import decode_value, encode_value

    good = msgpack.unpackb(encode_value({"a": 1}, key="k"))
    for bad, cls in [({**good, "format_version": 3}, FormatVersionError),
                     ({**good, "format_version": 1}, CorruptCheckpointError),
                     ({k: v for k, v in good.items() if k != "tensors"},
                      CorruptCheckpointError)]:
        with pytest.raises(cls):
            decode_value(msgpack.packb(bad), where="k")
    packer = msgpack.Packer()
    dup = packer.pack_map_header(len(good) + 1) + b"".join(
        packer.pack(k) + packer.pack(v) for k, v in [*good.items(), ("tree", 1)])
    with pytest.raises(CorruptCheckpointError, match="duplicate key"):
        decode_value(dup, where="k")
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    with pytest.raises(CorruptCheckpointError, match="never unpickles"):
        decode_value(buf.getvalue(), where="k")
    assert_state_equal(decode_value(encode_value({"a": (1, 2)}, key="k"), where="k"),
                       {"a": (1, 2)})


def test_lazy_views_inside_values_are_stored_as_their_values(tmp_path: Path) -> None:
    """A conjugate or negative view inside a non-tensor value (a DCP byte item, encoded by
    ``encode_value``) is stored as its values, as every other writer stores it: the one
    ``cpu_contiguous`` of the serializer (it was stored as its base)."""
    import argparse

    z = torch.complex(torch.randn(5), torch.randn(5))
    state = {"args": argparse.Namespace(conj=z.conj(), neg=torch._neg_view(z))}
    store = ckptfs.open(str(tmp_path))
    save_sharded(store.storage, 1, state)
    got = store.load(1)["args"]
    assert torch.equal(got.conj, z.conj().resolve_conj())
    assert torch.equal(got.neg, -z)
