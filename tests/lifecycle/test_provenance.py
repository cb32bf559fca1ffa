"""Resume provenance: exact refusal with every differing key and a diagnostic record; declared
execution changes accepted and recorded (local and memory)."""

from __future__ import annotations

import json

import pytest
import torch

import ckptfs
from ckptfs.errors import ProvenanceMismatchError
from ckptfs.lifecycle.provenance import DIAGNOSTICS_DIR, Provenance, compare, fingerprint
from ckptfs.testing.backend import Backend

CONFIG = {"lr": 3e-4, "batch": 32, "layers": [4, 4]}
PROV = Provenance(config=CONFIG, fingerprints={"data": "sha256:d1", "code": "git:abc"},
                  execution={"hardware": "cpu"})


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def first_run(backend: Backend, world_size: int = 1) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    mgr = ckptfs.CheckpointManager(backend.open(), provenance=PROV, world_size=world_size)
    mgr.save(100, model=model)
    return model


def test_fingerprint_is_canonical() -> None:
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert fingerprint({"a": 1}).startswith("sha256:")


def test_recorded_in_metadata(backend: Backend) -> None:
    first_run(backend)
    rec = backend.open().info(100).metadata["provenance"]
    assert rec["config"] == fingerprint(CONFIG)
    assert rec["fingerprints"] == {"data": "sha256:d1", "code": "git:abc"}
    assert rec["execution"] == {"world_size": 1, "hardware": "cpu"}
    assert rec["changes"] == []


def test_exact_match_resumes(backend: Backend) -> None:
    model = first_run(backend)
    m2 = torch.nn.Linear(2, 2)
    same = Provenance(config=dict(CONFIG), fingerprints={"code": "git:abc", "data": "sha256:d1"},
                      execution={"hardware": "cpu"})
    assert ckptfs.CheckpointManager(backend.open()).restore_latest(model=m2, expect=same) == 101
    assert torch.equal(m2.weight, model.weight)


def test_exact_refuses_with_every_difference(backend: Backend) -> None:
    first_run(backend)
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    wrong = Provenance(config={**CONFIG, "lr": 1e-3},
                       fingerprints={"data": "sha256:d2", "tokenizer": "tok-v2"},
                       execution={"hardware": "cpu"})
    mgr = ckptfs.CheckpointManager(backend.open())
    with pytest.raises(ProvenanceMismatchError) as ei:
        mgr.restore_latest(model=model, expect=wrong)
    keys = [k for k, _, _ in ei.value.differences]
    assert keys == ["config", "fingerprints.code", "fingerprints.data", "fingerprints.tokenizer"]
    diffs = {k: (e, a) for k, e, a in ei.value.differences}
    assert diffs["fingerprints.data"] == ("sha256:d2", "sha256:d1")
    assert diffs["fingerprints.code"] == ("<absent>", "git:abc")
    msg = str(ei.value)
    assert "fingerprints.tokenizer: expected 'tok-v2'" in msg and "step 100" in msg
    assert torch.equal(model.weight, before)  # refused before loading anything
    assert ei.value.diagnostic is not None and ei.value.diagnostic.startswith(DIAGNOSTICS_DIR)
    doc = json.loads(backend.raw_read(ei.value.diagnostic))
    assert [d["key"] for d in doc["differences"]] == keys
    assert doc["step"] == 100 and doc["mode"] == "exact"


def test_world_size_change_refused_in_exact_mode(backend: Backend) -> None:
    first_run(backend, world_size=1)
    mgr = ckptfs.CheckpointManager(backend.open(), rank=0, world_size=2)
    with pytest.raises(ProvenanceMismatchError, match="execution_change") as ei:
        mgr.restore_latest(expect=PROV)
    assert ei.value.differences == [("execution.world_size", 2, 1)]


def test_execution_change_accepted_and_recorded(backend: Backend) -> None:
    first_run(backend, world_size=1)
    new = Provenance(config=CONFIG, fingerprints=PROV.fingerprints,
                     execution={"hardware": "8xH100"})
    mgr = ckptfs.CheckpointManager(backend.open(), rank=0, world_size=2)
    assert mgr.restore_latest(expect=new, mode="execution_change") == 101
    mgr.save(200)
    rec = backend.open().info(200).metadata["provenance"]
    changes = {c["key"]: (c["from"], c["to"], c["at_step"]) for c in rec["changes"]}
    assert changes == {"execution.hardware": ("cpu", "8xH100", 100),
                       "execution.world_size": (1, 2, 100)}
    assert rec["execution"] == {"world_size": 2, "hardware": "8xH100"}
    mgr.save(300)  # recorded once, in the next checkpoint only
    assert backend.open().info(300).metadata["provenance"]["changes"] == []
    assert backend.raw_files(DIAGNOSTICS_DIR) == {}


def test_execution_change_still_refuses_inputs(backend: Backend) -> None:
    first_run(backend)
    new = Provenance(config=CONFIG, fingerprints={**PROV.fingerprints, "data": "sha256:other"},
                     execution={"hardware": "gpu"})
    with pytest.raises(ProvenanceMismatchError) as ei:
        ckptfs.CheckpointManager(backend.open()).restore_latest(expect=new,
                                                                mode="execution_change")
    assert [k for k, _, _ in ei.value.differences] == ["fingerprints.data"]


def test_checkpoint_without_provenance(backend: Backend) -> None:
    backend.open().save(5, {"x": 1})
    with pytest.raises(ProvenanceMismatchError, match="records no provenance"):
        ckptfs.CheckpointManager(backend.open()).restore_latest(expect=PROV)


def test_compare_lists_absent_keys() -> None:
    diffs = compare(Provenance(fingerprints={"a": "1"}), {"fingerprints": {"b": "2"}})
    assert diffs == [("fingerprints.a", "1", "<absent>"), ("fingerprints.b", "<absent>", "2")]
    with pytest.raises(ValueError):
        ckptfs.lifecycle.provenance.check(None, PROV, {}, step=1, mode="loose")  # type: ignore
