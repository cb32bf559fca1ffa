"""Incremental saves (format v3, incremental.md) on every single-process path: what is written, what
is referenced, that every step loads bit-exact and verifies, that reuse is decided by digest
only (the data_ptr/_version hint never decides), the fence before the marker, tampering with
referenced bytes, and old readers refusing v3."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.cli.core import main
from ckptfs.errors import CorruptCheckpointError, FormatVersionError, UnsafeCheckpointError
from ckptfs.format import versions
from ckptfs.format.hashing import digest_bytes
from ckptfs.format.layout import MANIFEST_NAME, STATE_NAME
from ckptfs.format.versions import MAX_READ_VERSION
from ckptfs.protocol import commit
from ckptfs.protocol.formats import verify_checkpoint
from ckptfs.protocol.reader import local_header, reference_chunks
from ckptfs.protocol.resolve import CheckpointInfo
from ckptfs.protocol.store import CheckpointStore
from ckptfs.testing.backend import Backend

KiB = 1024


@pytest.fixture(params=["memory", "local"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def _lora(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A frozen base (~1 MiB) and a small adapter (~32 KiB)."""
    g = torch.Generator().manual_seed(seed)
    base = {f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(4)}
    base["embed"] = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    adapter = {"lora_A": torch.randn(16, 256, generator=g),
               "lora_B": torch.zeros(256, 16)}
    return base, adapter


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _state(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], step: int
           ) -> dict[str, Any]:
    return {"model": {**base, **adapter}, "step": step, "note": f"step {step}"}


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in state["model"].items()},
            "step": state["step"], "note": state["note"]}


def _assert_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    assert set(got["model"]) == set(want["model"])
    for k, v in want["model"].items():
        g = got["model"][k]
        assert g.dtype == v.dtype and g.shape == v.shape, k
        assert torch.equal(g.view(torch.uint8) if g.dtype == torch.bfloat16 else g,
                           v.view(torch.uint8) if v.dtype == torch.bfloat16 else v), k
    assert got["step"] == want["step"] and got["note"] == want["note"]


def _split(store: CheckpointStore, info: CheckpointInfo) -> tuple[set[str], dict[str, int]]:
    """(tensors written in this checkpoint's own files, tensor -> step whose file holds it for
    each referenced tensor)."""
    m = info.manifest
    assert m.format_version == 3
    written: set[str] = set()
    for e in m.files:
        if e.path != STATE_NAME:
            written |= set(local_header(store.storage, info, m.chunked(e.path))[1])
    referenced: dict[str, int] = {}
    for ref in m.references:
        for name in reference_chunks(store.storage, info, ref, None):
            referenced[name] = ref.step
    assert not written & set(referenced)
    return written, referenced


def _state_doc_bytes(info: CheckpointInfo) -> int:
    return info.manifest.file(STATE_NAME).size


# -- LoRA-like: a frozen base and a changing adapter -------------------------------------------


@pytest.mark.parametrize("where", ["memory", "local", "s3"])
def test_lora_run_writes_the_adapter_and_loads_every_step(request: pytest.FixtureRequest,
                                                          where: str) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    store = backend.open(incremental=True)
    base, adapter = _lora()
    adapter_bytes, full = _nbytes(adapter), _nbytes(base) + _nbytes(adapter)
    saved: dict[int, dict[str, Any]] = {}
    for step in range(1, 5):
        with torch.no_grad():
            adapter["lora_B"].add_(0.01 * step)  # in place: data_ptr kept, _version bumped
            adapter["lora_A"].mul_(1.001)
        state = _state(base, adapter, step)
        info = store.save(step, state)
        saved[step] = _snapshot(state)
        assert info.manifest.format_version == 3
        assert info.bytes >= full
        written, referenced = _split(store, info)
        if step == 1:  # nothing stored yet: everything written
            assert info.bytes_written == info.bytes
            assert written == {f"model/{k}" for k in {**base, **adapter}}
        else:
            assert written == {"model/lora_A", "model/lora_B"}
            # Every base tensor referenced where it physically lies (step 1), never through
            # another reference.
            assert referenced == {f"model/{k}": 1 for k in base}
            overhead = info.bytes_written - adapter_bytes - _state_doc_bytes(info)
            assert 0 < overhead < 2 * KiB, overhead  # the adapter file's safetensors header
            assert info.bytes_written < 0.05 * info.bytes
        reread = store.info(step)
        assert (reread.bytes, reread.bytes_written) == (info.bytes, info.bytes_written)
        for s, want in saved.items():  # every step so far loads bit-exact
            _assert_equal(store.load(s), want)

    other = backend.open()  # a reader with no memory of the saves, not incremental itself
    calls: list[str] = []

    def mapper(storage: Any, loc: str) -> Any:
        calls.append(loc)
        return storage

    for s, want in saved.items():
        _assert_equal(other.load(s), want)
        assert other.verify(s).ok, other.verify(s).problems
        assert other.verify(s, quick=True).ok
        part = other.load(s, keys=["model/layer1.weight", "model/lora_B"])
        assert set(part["model"]) == {"layer1.weight", "lora_B"}
        assert torch.equal(part["model"]["layer1.weight"], want["model"]["layer1.weight"])
        assert torch.equal(part["model"]["lora_B"], want["model"]["lora_B"])
        calls.clear()
        _assert_equal(other.load(s, map_location=mapper), want)
        assert len(calls) == len(want["model"])  # referenced tensors mapped too
        _assert_equal(other.load(s, map_location="cpu"), want)
        if where == "local":
            mapped = other.load(s, mmap=True)
            _assert_equal(mapped, want)
        _assert_equal(other.load(s, verify=False), want)
    env_ok = where != "s3"  # the CLI takes a URL; S3 needs the endpoint options
    if env_ok:
        for s in saved:
            assert main(["verify", backend.url, "--step", str(s)]) == 0
            assert main(["verify", backend.url, "--step", str(s), "--quick"]) == 0


# -- the hint (data_ptr, _version) guides, the digest decides ----------------------------------


def test_in_place_change_is_written_and_an_equal_copy_is_reused(backend: Backend) -> None:
    store = backend.open(incremental=True)
    base, adapter = _lora(1)
    store.save(1, _state(base, adapter, 1))

    with torch.no_grad():
        base["layer0.weight"][0, 0] += 1  # in place: same data_ptr, _version bumped
    info = store.save(2, _state(base, adapter, 2))
    written, referenced = _split(store, info)
    assert written == {"model/layer0.weight"}
    assert set(referenced) == {f"model/{k}" for k in {**base, **adapter}} - written

    # Equal copies (other data_ptr): hashed, found equal, referenced.
    copies = {k: v.clone() for k, v in base.items()}
    adapter_copy = {k: v.clone() for k, v in adapter.items()}
    info = store.save(3, _state(copies, adapter_copy, 3))
    written, referenced = _split(store, info)
    assert written == set()
    assert referenced["model/layer0.weight"] == 2 and referenced["model/layer1.weight"] == 1
    assert info.bytes_written == _state_doc_bytes(info)
    _assert_equal(store.load(3), _state(base, adapter, 3))


def test_bytes_changed_behind_the_version_counter_are_written(backend: Backend) -> None:
    """The hint lies (same data_ptr, same _version, other bytes): the digest decides."""
    store = backend.open(incremental=True)
    base, adapter = _lora(2)
    store.save(1, _state(base, adapter, 1))
    w, e = base["layer2.weight"], base["embed"]
    versions = (w._version, e._version)
    w.data[3].fill_(7.0)  # through .data: the parameter's _version does not move
    a = adapter["lora_A"]
    a.numpy()[0, :4] = 42.0  # through a numpy view
    assert (w._version, e._version) == versions
    info = store.save(2, _state(base, adapter, 2))
    written, _ = _split(store, info)
    assert written == {"model/layer2.weight", "model/lora_A"}
    want = _snapshot(_state(base, adapter, 2))
    _assert_equal(store.load(2), want)
    assert store.verify(2).ok


def test_fresh_store_has_no_hint_and_the_digest_decides(backend: Backend) -> None:
    """A new store instance (a new process) holds no hint: every tensor is a candidate; the
    changed ones are written, the others referenced from the latest committed v3 step."""
    base, adapter = _lora(3)
    backend.open(incremental=True).save(1, _state(base, adapter, 1))
    base["embed"].view(torch.int16)[0, 0] ^= 1  # one bit of a frozen tensor
    with torch.no_grad():
        adapter["lora_B"] += 1
    info = backend.open(incremental=True).save(2, _state(base, adapter, 2))
    written, referenced = _split(store := backend.open(), info)
    assert written == {"model/embed", "model/lora_B"}
    assert set(referenced.values()) == {1}
    _assert_equal(store.load(2), _snapshot(_state(base, adapter, 2)))
    # A third process reuses from step 2 (the latest), flattened: step 1's file for what step 2
    # references there, step 2's file for what step 2 wrote.
    info = backend.open(incremental=True, threads=1).save(3, _state(base, adapter, 3))
    written, referenced = _split(store, info)
    assert written == set()
    assert referenced["model/embed"] == 2 and referenced["model/lora_B"] == 2
    assert referenced["model/layer0.weight"] == 1
    _assert_equal(store.load(3), _snapshot(_state(base, adapter, 3)))


def test_v1_is_never_a_source_and_a_mixed_run_loads_every_step(backend: Backend) -> None:
    base, adapter = _lora(4)
    plain = backend.open()
    info = plain.save(1, _state(base, adapter, 1))
    assert info.manifest.format_version == 1
    info = backend.open(incremental=True).save(2, _state(base, adapter, 2))
    assert info.manifest.format_version == 3
    assert not info.manifest.references and info.bytes_written == info.bytes  # not from v1
    info = backend.open(incremental=True).save(3, _state(base, adapter, 3))
    assert {r.step for r in info.manifest.references} == {2}
    plain.save(4, _state(base, adapter, 4))  # v1 again
    info = backend.open(incremental=True).save(5, _state(base, adapter, 5))
    assert all(r.step in (2, 3) for r in info.manifest.references)  # never step 1 or 4
    reader = backend.open()
    for step in range(1, 6):
        _assert_equal(reader.load(step), _state(base, adapter, step))
        assert reader.verify(step).ok


@pytest.mark.parametrize("algorithm", ["xxh3-128", "crc32c"])
def test_non_cryptographic_algorithm_reuses_nothing(backend: Backend, algorithm: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    store = backend.open(incremental=True, algorithm=algorithm)
    base, adapter = _lora(5)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        for step in (1, 2, 3):
            info = store.save(step, _state(base, adapter, step))
            assert info.manifest.format_version == 3
            assert not info.manifest.references
            assert info.bytes_written == info.bytes
            assert info.manifest.hash_algorithm == algorithm
    said = [r.getMessage() for r in caplog.records if "cryptographic" in r.getMessage()]
    assert len(said) == 1 and algorithm in said[0], said  # once per store, naming it
    for step in (1, 2, 3):
        _assert_equal(store.load(step), _state(base, adapter, step))
        assert store.verify(step).ok


# -- save_async and the manager ----------------------------------------------------------------


def test_save_async_takes_the_values_at_the_call(backend: Backend) -> None:
    store = backend.open(incremental=True)
    base, adapter = _lora(6)
    store.save_async(1, _state(base, adapter, 1)).result()
    wanted: dict[int, dict[str, Any]] = {}
    futures = []
    for step in (2, 3, 4):
        with torch.no_grad():
            adapter["lora_B"].add_(1.0)
        state = _state(base, adapter, step)
        wanted[step] = _snapshot(state)
        futures.append(store.save_async(step, state))
        with torch.no_grad():  # mutated right after the call returned
            adapter["lora_B"].mul_(3.0)
            adapter["lora_A"].zero_()
    infos = [f.result() for f in futures]
    for info in infos:
        written, referenced = _split(store, info)
        # lora_B changes at each save; lora_A only by the zero_() after the first call
        assert written == ({"model/lora_B"} if info.step == 2
                           else {"model/lora_A", "model/lora_B"})
        assert set(referenced) == {f"model/{k}" for k in base} | (
            {"model/lora_A"} if info.step == 2 else set())
        assert info.bytes_written < _nbytes(adapter) + _state_doc_bytes(info) + 2 * KiB
    for step, want in wanted.items():
        _assert_equal(store.load(step), want)
        assert store.verify(step).ok


def _train_step(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("head"):
                p.add_(torch.randn(p.shape, generator=g))


def test_manager_retention_keeps_every_retained_step_loadable(backend: Backend) -> None:
    store = backend.open(incremental=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("body", torch.nn.Linear(128, 128))
    model.add_module("head", torch.nn.Linear(128, 4))
    mgr = ckptfs.CheckpointManager(store, keep_last=2)
    wanted: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(1, 7):
        _train_step(model, step)
        assert not mgr.save(step, model=model).errors  # prune included
        wanted[step] = {k: v.clone() for k, v in model.state_dict().items()}
        if step > 1:
            assert store.info(step).bytes_written < store.info(step).bytes / 4
    assert store.steps() == [5, 6]
    for step in (5, 6):
        got = backend.open().load(step)["model"]
        assert set(got) == set(wanted[step])
        for k, v in wanted[step].items():
            assert torch.equal(got[k], v), (step, k)
        assert backend.open().verify(step).ok


# -- the fence ---------------------------------------------------------------------------------


def test_protector_deleted_before_the_marker_rewrites_every_byte(
        backend: Backend, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    store = backend.open(incremental=True)
    base, adapter = _lora(7)
    store.save(1, _state(base, adapter, 1))
    store.save(2, _state(base, adapter, 2))  # the protector of step 3's references
    real = commit.read_marker
    fenced: list[int] = []

    def delete_then_read(storage: Any, step: int) -> Any:
        if not fenced:  # the protector is deleted (marker first) after the plan
            fenced.append(step)
            backend.open().delete(step)
        return real(storage, step)

    monkeypatch.setattr(commit, "read_marker", delete_then_read)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        info = store.save(3, _state(base, adapter, 3))
    assert fenced == [2]
    assert any("writing every byte" in r.getMessage() for r in caplog.records)
    assert not info.manifest.references
    assert info.bytes_written == info.bytes
    reader = backend.open()
    assert reader.steps() == [1, 3]
    assert len(backend.raw_files("checkpoints/step-000000000003")) == 4  # one attempt only
    _assert_equal(reader.load(3), _state(base, adapter, 3))
    assert reader.verify(3).ok
    # The next save references step 3 again (the memory of the failed plan is gone).
    info = store.save(4, _state(base, adapter, 4))
    assert {r.step for r in info.manifest.references} == {3}
    _assert_equal(reader.load(4), _state(base, adapter, 4))


def test_protector_replaced_by_another_attempt_fails_the_fence(
        backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The protector's step committed again under another attempt: not the same bytes' owner;
    the save writes every byte."""
    store = backend.open(incremental=True)
    base, adapter = _lora(8)
    store.save(1, _state(base, adapter, 1))
    real = commit.read_marker

    def other_attempt(storage: Any, step: int) -> Any:
        marker = real(storage, step)
        return None if marker is None else type(marker)(
            marker.step, "a-20200101T000000Z-0000000000000000", marker.manifest_digest,
            marker.manifest_size, marker.created, marker.writer)

    monkeypatch.setattr(commit, "read_marker", other_attempt)
    info = store.save(2, _state(base, adapter, 2))
    assert not info.manifest.references and info.bytes_written == info.bytes
    _assert_equal(backend.open().load(2), _state(base, adapter, 2))


def test_lease_exceeded_rewrites_every_byte(backend: Backend,
                                            caplog: pytest.LogCaptureFixture) -> None:
    base, adapter = _lora(9)
    backend.open(incremental=True).save(1, _state(base, adapter, 1))
    store = backend.open(incremental=True, lease_s=0)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        info = store.save(2, _state(base, adapter, 2))
    assert any("lease" in r.getMessage() for r in caplog.records)
    assert not info.manifest.references and info.bytes_written == info.bytes
    _assert_equal(backend.open().load(2), _state(base, adapter, 2))
    assert backend.open().steps() == [1, 2]


# -- tampering with referenced bytes -----------------------------------------------------------


def _lora_pair(backend: Backend) -> tuple[str, int]:
    """Step 1 (full) and step 2 (referencing step 1's base); returns the referenced file (path
    from the run root) and the offset of a byte of a tensor step 2 references there."""
    store = backend.open(incremental=True)
    base, adapter = _lora(10)
    store.save(1, _state(base, adapter, 1))
    with torch.no_grad():
        adapter["lora_B"] += 1
    info = store.save(2, _state(base, adapter, 2))
    m = info.manifest
    assert m.format_version == 3 and len(m.references) == 1
    ref = m.references[0]
    chunk = ref.chunks[-1]  # a tensor's bytes (chunk 0 is the header)
    return ref.location, chunk.offset + chunk.length // 2


def test_flipped_referenced_byte_is_named_by_load_and_verify(backend: Backend) -> None:
    location, offset = _lora_pair(backend)
    data = bytearray(backend.raw_read(location))
    data[offset] ^= 0x40
    backend.raw_write(location, bytes(data))
    reader = backend.open()
    with pytest.raises(CorruptCheckpointError) as ei:
        reader.load(2)
    assert location in str(ei.value) and "step 2" in str(ei.value)
    with pytest.raises(CorruptCheckpointError) as ei:
        reader.verify(2)
    assert location in str(ei.value) and "full verification" in str(ei.value)
    report = verify_checkpoint(reader.storage, reader.info(2))
    assert not report.ok and any(location in p for p in report.problems), report.problems
    assert verify_checkpoint(reader.storage, reader.info(2), quick=True).ok  # sizes unchanged
    assert main(["verify", backend.url, "--step", "2"]) == 1
    # Tensors stored elsewhere still load alone; the damaged one does not.
    assert reader.load(2, keys=["model/lora_B"])["model"]["lora_B"].shape == (256, 16)
    with pytest.raises(CorruptCheckpointError):
        reader.load(1)


def test_flipped_referenced_header_byte_is_refused(backend: Backend) -> None:
    location, _ = _lora_pair(backend)
    data = bytearray(backend.raw_read(location))
    data[20] ^= 0x01  # inside the JSON header
    backend.raw_write(location, bytes(data))
    reader = backend.open()
    for keys in (None, ["model/layer0.weight"]):
        with pytest.raises(CorruptCheckpointError) as ei:
            reader.load(2, keys=keys)
        assert location in str(ei.value)
    assert not verify_checkpoint(reader.storage, reader.info(2)).ok


@pytest.mark.parametrize("what", ["file", "attempt", "step"])
def test_deleted_referenced_bytes_are_a_corrupt_checkpoint(backend: Backend, what: str) -> None:
    location, _ = _lora_pair(backend)
    target = {"file": location, "attempt": location.rsplit("/", 1)[0],
              "step": location.rsplit("/", 2)[0]}[what]
    backend.raw_delete(target)
    reader = backend.open()
    with pytest.raises(CorruptCheckpointError) as ei:
        reader.load(2)
    assert not isinstance(ei.value, UnsafeCheckpointError)
    assert location in str(ei.value) or target in str(ei.value)
    with pytest.raises(CorruptCheckpointError):
        reader.load(2, keys=["model/layer3.weight"])
    for quick in (False, True):
        report = verify_checkpoint(reader.storage, reader.info(2), quick=quick)
        assert not report.ok and not report.unsafe, report.problems
        with pytest.raises(CorruptCheckpointError):
            reader.verify(2, quick=quick)
    # A new process's save indexes the latest (step 2), cannot, and writes every byte.
    base, adapter = _lora(10)
    info = backend.open(incremental=True).save(3, _state(base, adapter, 3))
    assert not info.manifest.references and info.bytes_written == info.bytes
    _assert_equal(reader.load(3), _state(base, adapter, 3))


def test_referenced_file_replaced_by_a_symlink_is_unsafe(local_backend: Backend) -> None:
    location, _ = _lora_pair(local_backend)
    root = Path(local_backend.raw_root)
    real = root / location
    outside = root.parent / f"{root.name}-outside.safetensors"
    os.replace(real, outside)
    os.symlink(outside, real)
    reader = local_backend.open()
    with pytest.raises(UnsafeCheckpointError) as ei:
        reader.load(2)
    assert location in str(ei.value)
    with pytest.raises(UnsafeCheckpointError):
        reader.load(2, keys=["model/layer0.weight"])
    with pytest.raises(UnsafeCheckpointError):
        reader.load(2, mmap=True)
    report = verify_checkpoint(reader.storage, reader.info(2))
    assert not report.ok and report.unsafe, report.problems
    with pytest.raises(UnsafeCheckpointError):
        reader.verify(2, quick=True)


def test_referenced_attempt_dir_replaced_by_a_symlink_is_unsafe(local_backend: Backend
                                                                ) -> None:
    location, _ = _lora_pair(local_backend)
    root = Path(local_backend.raw_root)
    attempt = root / location.rsplit("/", 1)[0]
    outside = root.parent / f"{root.name}-outside-attempt"
    os.replace(attempt, outside)
    os.symlink(outside, attempt)
    with pytest.raises(UnsafeCheckpointError):
        local_backend.open().load(2)


# -- old readers -------------------------------------------------------------------------------


def _recommit(backend: Backend, info: CheckpointInfo, doc: dict[str, Any]) -> None:
    """Rewrite the manifest of ``info`` and its marker (so only the content differs)."""
    data = (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()
    backend.raw_write(f"{info.path}/{MANIFEST_NAME}", data)
    marker = json.loads(backend.raw_read(info.paths.marker))
    marker["manifest_digest"] = digest_bytes("sha256", data)
    marker["manifest_size"] = len(data)
    backend.raw_write(info.paths.marker, (json.dumps(marker, sort_keys=True) + "\n").encode())


def test_newer_format_version_is_refused(backend: Backend) -> None:
    store = backend.open(incremental=True)
    base, adapter = _lora(11)
    store.save(1, _state(base, adapter, 1))
    info = store.save(2, _state(base, adapter, 2))
    doc = json.loads(backend.raw_read(f"{info.path}/{MANIFEST_NAME}"))
    doc["format_version"] = MAX_READ_VERSION + 1
    _recommit(backend, info, doc)
    reader = backend.open()
    with pytest.raises(FormatVersionError):
        reader.load(2)
    with pytest.raises(FormatVersionError):
        reader.info(2)


def test_pre_v3_reader_refuses_v3(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ckptfs before v3 (READ_VERSIONS (1, 2), MAX_READ_VERSION 2: the table at the commit
    before format v3) refuses a v3 manifest with FormatVersionError through decode_manifest's
    version check, not with a confusing decode error."""
    store = backend.open(incremental=True)
    base, adapter = _lora(12)
    info = store.save(1, _state(base, adapter, 1))
    data = backend.raw_read(f"{info.path}/{MANIFEST_NAME}")
    assert versions.decode_manifest(data).format_version == 3
    monkeypatch.setattr(versions, "READ_VERSIONS", (1, 2))
    monkeypatch.setattr(versions, "MAX_READ_VERSION", 2)
    with pytest.raises(FormatVersionError) as ei:
        versions.decode_manifest(data, where="MANIFEST.json")
    assert "format version 3" in str(ei.value) and "upgrade ckptfs" in str(ei.value)
    with pytest.raises(FormatVersionError):
        backend.open().load(1)


# -- odd states --------------------------------------------------------------------------------


def _odd_state(g: torch.Generator) -> dict[str, Any]:
    big = torch.randn(64, 48, generator=g)
    tied = torch.randn(32, generator=g)
    return {
        "model": {
            "fp16": torch.randn(40, generator=g).half(),
            "bf16": torch.randn(3, 5, generator=g).bfloat16(),
            "int8": torch.randint(-100, 100, (17,), generator=g, dtype=torch.int8),
            "bool": torch.rand(9, generator=g) > 0.5,
            "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "empty2": torch.empty(0, dtype=torch.int64),
            "transposed": big.t(),  # not contiguous
            "slice": big[10:20, 3],  # a view with an offset and a stride
            "tied_a": tied, "tied_b": tied,
        },
        "a/b": torch.arange(6),  # the same key path text as ["a"]["b"]
        "a": {"b": torch.arange(6) * 2},
        "opt": [torch.ones(3), {"m": torch.zeros(2)}, 7, "text", None],
    }


def _assert_tree_equal(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, path
        assert got.shape == want.shape, path
        assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                           want.contiguous().reshape(-1).view(torch.uint8)), path  # bit-exact
    elif isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            _assert_tree_equal(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_tree_equal(a, b, f"{path}/{i}")
    else:
        assert got == want, path


def test_odd_tensors_round_trip_through_references(backend: Backend) -> None:
    """dtypes, 0-d, empty, non-contiguous, views, ties and key paths that print alike, over
    saves that change some of them: each step loads what it saved."""
    store = backend.open(incremental=True)
    g = torch.Generator().manual_seed(13)
    state = _odd_state(g)
    saved = {}
    for step in (1, 2, 3):
        if step == 2:
            state["model"]["fp16"].add_(1)
            state["a/b"].add_(1)  # one of the two tensors named 'a/b' in the files
        if step == 3:
            state["a"]["b"].add_(1)
            state["model"]["empty"] = torch.empty(0, 4)  # a new, still empty, tensor
        info = store.save(step, state)
        saved[step] = {
            "model": {k: v.clone() for k, v in state["model"].items()},
            "a/b": state["a/b"].clone(), "a": {"b": state["a"]["b"].clone()},
            "opt": [state["opt"][0].clone(), {"m": state["opt"][1]["m"].clone()}, 7, "text",
                    None]}
        if step > 1:
            assert info.manifest.references and info.bytes_written < info.bytes
        reader = backend.open()
        for s, want in saved.items():
            got = reader.load(s)
            _assert_tree_equal(got, want)
            assert got["model"]["tied_a"] is got["model"]["tied_b"]  # the tie survives
            assert reader.verify(s).ok


def test_a_state_without_tensors_and_one_all_reused(backend: Backend) -> None:
    store = backend.open(incremental=True)
    info = store.save(1, {"n": 1, "text": "x"})
    assert info.manifest.format_version == 3 and not info.manifest.references
    assert store.load(1) == {"n": 1, "text": "x"}
    w = torch.randn(100)
    store.save(2, {"w": w})
    info = store.save(3, {"w": w, "n": 3})
    assert [f.path for f in info.manifest.files] == [STATE_NAME]
    assert torch.equal(backend.open().load(3)["w"], w)
    assert backend.open().verify(3).ok


def test_damage_outside_the_referenced_chunks_only_hurts_its_owner(backend: Backend) -> None:
    """Step 2 binds only the chunks it uses: a flipped byte in a tensor of step 1's file that
    step 2 does not use fails step 1, not step 2."""
    store = backend.open(incremental=True)
    base, adapter = _lora(14)
    info1 = store.save(1, _state(base, adapter, 1))
    with torch.no_grad():
        adapter["lora_A"] += 1
    info2 = store.save(2, _state(base, adapter, 2))
    (ref,) = info2.manifest.references  # type: ignore[attr-defined]
    start, entries = local_header(store.storage, info1, info1.manifest.chunked(ref.source))  # type: ignore[attr-defined]
    e = entries["model/lora_A"]
    assert ref.chunk_at(start + e.begin, e.end - e.begin) is None  # not used by step 2
    data = bytearray(backend.raw_read(ref.location))
    data[start + e.begin + 1] ^= 0xFF
    backend.raw_write(ref.location, bytes(data))
    reader = backend.open()
    _assert_equal(reader.load(2), _state(base, adapter, 2))
    assert reader.verify(2).ok
    with pytest.raises(CorruptCheckpointError):
        reader.load(1)


def test_load_into_reads_format_v3(backend: Backend) -> None:
    """load(into=) fills a state from a v3 checkpoint (references followed, every byte
    verified) as from any layout (it was refused as not sharded)."""
    store = backend.open(incremental=True)
    store.save(1, {"w": torch.ones(3), "frozen": torch.arange(4.0)})
    store.save(2, {"w": torch.full((3,), 2.0), "frozen": torch.arange(4.0)})
    assert store.info(2).manifest.references  # step 2 references step 1's frozen tensor
    into = {"w": torch.zeros(3), "frozen": torch.zeros(4)}
    assert store.load(2, into=into) is into
    assert torch.equal(into["w"], torch.full((3,), 2.0))
    assert torch.equal(into["frozen"], torch.arange(4.0))


class _Clock:
    """``time.monotonic`` for :mod:`ckptfs.protocol.commit` (the lease): each call advances by the
    next step given (the last one repeated)."""

    def __init__(self, steps: list[float], on_call: dict[int, Any] | None = None) -> None:
        self.now, self.steps, self.calls = 1000.0, steps, 0
        self.on_call = on_call or {}

    def monotonic(self) -> float:
        self.now += self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        hook = self.on_call.get(self.calls)
        if hook is not None:
            hook()
        return self.now


def test_marker_after_the_lease_keeps_a_commit_whose_references_are_there(
        backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    store = backend.open(incremental=True, lease_s=60)
    base, adapter = _lora(15)
    store.save(1, _state(base, adapter, 1))
    # opened, fence (within the lease), after the marker (past it)
    monkeypatch.setattr(commit, "time", _Clock([0.0, 1.0, 120.0]))
    info = store.save(2, _state(base, adapter, 2))
    assert info.manifest.references
    monkeypatch.undo()
    _assert_equal(backend.open().load(2), _state(base, adapter, 2))


def test_marker_after_the_lease_uncommits_when_a_reference_is_gone(
        backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector judged the save abandoned (past its lease) and removed what it references
    between the fence and the marker: the save uncommits itself and says so."""
    store = backend.open(incremental=True, lease_s=60)
    base, adapter = _lora(16)
    info1 = store.save(1, _state(base, adapter, 1))

    def collector() -> None:  # the protector deleted (marker first), then its bytes, by a
        # collector that judged this save abandoned (a delete would have kept what the young
        # save's manifest references, §9.5: so the files go the way such a collector's do)
        other = backend.open()
        other.storage.delete(info1.paths.marker)
        other.storage.delete_tree(info1.path)
        assert not backend.raw_exists(info1.path)

    monkeypatch.setattr(commit, "time", _Clock([0.0, 1.0, 120.0], {3: collector}))
    with pytest.raises(CorruptCheckpointError, match="outlived its lease") as ei:
        store.save(2, _state(base, adapter, 2))
    assert ei.value.step == 2  # type: ignore[attr-defined]
    monkeypatch.undo()
    reader = backend.open()
    assert 2 not in reader.steps()
    # The next save of this store does not reuse the lost bytes: it writes everything or
    # references only what is there; it loads.
    info = store.save(3, _state(base, adapter, 3))
    _assert_equal(reader.load(3), _state(base, adapter, 3))
    assert info.bytes_written == info.bytes


def test_two_stores_of_one_run_interleave(backend: Backend) -> None:
    """Two stores (two processes) alternate saves of one run: each reuses from its own last
    save or the latest; every step loads what was saved."""
    a, b = backend.open(incremental=True), backend.open(incremental=True)
    base, adapter = _lora(17)
    saved = {}
    for step in range(1, 7):
        with torch.no_grad():
            adapter["lora_B"].add_(1.0)
        state = _state(base, adapter, step)
        info = (a if step % 2 else b).save(step, state)
        saved[step] = _snapshot(state)
        if step > 1:
            written, referenced = _split(backend.open(), info)
            assert "model/lora_B" in written and set(referenced) >= {f"model/{k}" for k in base}
    reader = backend.open()
    for step, want in saved.items():
        _assert_equal(reader.load(step), want)
        assert reader.verify(step).ok


def test_rot_in_a_stored_chunk_is_never_carried_into_a_new_checkpoint(
        backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    """A chunk of the newest checkpoint's files rotted after its commit; a new process saves
    the same (correct, in memory) tensors: the chunk is read and checked before its first
    reuse, so the new checkpoint writes that tensor again and is whole; the others are still
    referenced (each checked once per process, then trusted)."""
    location, offset = _lora_pair(backend)
    data = bytearray(backend.raw_read(location))
    data[offset] ^= 0x40
    backend.raw_write(location, bytes(data))
    base, adapter = _lora(10)
    with torch.no_grad():
        adapter["lora_B"] += 1
    store = backend.open(incremental=True)
    with caplog.at_level("WARNING", logger="ckptfs"):
        info = store.save(3, _state(base, adapter, 3))
    assert "written again instead of referenced" in caplog.text and location in caplog.text
    m = info.manifest
    assert m.format_version == 3 and m.references  # the intact tensors reused
    assert info.bytes_written < info.bytes
    got = backend.open().load(3)
    _assert_equal(got, _state(base, adapter, 3))
    assert backend.open().verify(3).ok
    # the next save of this process trusts what it checked or wrote: no further reads
    caplog.clear()
    with caplog.at_level("WARNING", logger="ckptfs"):
        store.save(4, _state(base, adapter, 4))
    assert "written again" not in caplog.text
    _assert_equal(backend.open().load(4), _state(base, adapter, 4))
