"""The group (``ckptfs.protocol.group``): a world of one and a process group answer the same
documents the same way, messages are JSON (never pickle), and a typed error crosses ranks as
the same class with its message."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from dist_util import run_ranks

from ckptfs.errors import (
    CorruptCheckpointError,
    ProvenanceMismatchError,
    ReplicationError,
    ShardedSaveError,
    TierMismatchError,
)
from ckptfs.protocol import group as grp


@dataclasses.dataclass
class Payload:
    """A value pickle would send and JSON cannot hold: it must be sent as a document."""

    step: int


def test_world_of_one_is_the_identity_on_json_documents() -> None:
    one = grp.group_of(None)  # torch.distributed is not initialized in the test process
    assert isinstance(one, grp.WorldOfOne)
    assert (one.rank, one.world_size, one.ranks, one.coordinator) == (0, 1, [0], True)
    doc = {"step": 3, "files": ("a", "b"), "nested": {"x": [1.5, None, True]}}
    # As a process group would deliver it: a tuple comes back as a list, on every world size.
    assert one.broadcast(doc) == {"step": 3, "files": ["a", "b"],
                                  "nested": {"x": [1.5, None, True]}}
    assert one.all_gather(doc) == [one.broadcast(doc)] == one.gather(doc)
    with pytest.raises(ValueError, match="only rank 0"):
        one.broadcast(doc, src=1)


@pytest.mark.parametrize("payload", [Payload(3), {1, 2}, b"bytes", {"k": object()}])
def test_a_payload_json_cannot_hold_raises_typeerror_never_pickles(payload: Any) -> None:
    """Every one of these pickles fine: a TypeError shows there is no pickle fallback."""
    with pytest.raises(TypeError, match=r"JSON document .* never pickled"):
        grp.WorldOfOne().broadcast({"payload": payload})
    with pytest.raises(TypeError, match="never pickled"):
        grp.encode([payload])


def test_the_outcome_round_in_a_world_of_one() -> None:
    one = grp.group_of(None)
    got = one.outcomes(lambda: {"files": ("a",)}, share=True)
    assert (got.value, got.own, got.failures, got.values) == ({"files": ("a",)}, None, {},
                                                               [{"files": ["a"]}])

    def fails() -> None:
        raise CorruptCheckpointError("step 2: bad digest")

    bad = one.outcomes(fails)
    assert isinstance(bad.own, CorruptCheckpointError) and bad.value is None
    assert bad.failures[0]["name"] == "CorruptCheckpointError"
    assert isinstance(grp.carried(bad.failures[0], ReplicationError), CorruptCheckpointError)
    with pytest.raises(KeyboardInterrupt):  # not an outcome: it stops the process
        one.outcomes(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))


def test_bytes_travel_as_base64() -> None:
    data = bytes(range(256)) * 3
    assert grp.decode_bytes(grp.WorldOfOne().broadcast(grp.encode_bytes(data))) == data


def test_typed_errors_are_rebuilt_as_the_same_class() -> None:
    corrupt = TierMismatchError("step 3 differs", step=3, path="step-3/MANIFEST.json")
    back = grp.rebuild(grp.describe(corrupt))
    assert type(back) is TierMismatchError and str(back) == "step 3 differs"
    assert (back.step, back.path) == (3, "step-3/MANIFEST.json")
    failed = grp.rebuild(grp.describe(ShardedSaveError("no", failures={1: "gone"})))
    assert isinstance(failed, ShardedSaveError) and failed.failures == {1: "gone"}
    prov = grp.rebuild(grp.describe(ProvenanceMismatchError(
        "differs", differences=[("torch", "2.1", "2.2")], diagnostic="d.json")))
    assert isinstance(prov, ProvenanceMismatchError)
    assert prov.differences == [("torch", "'2.1'", "'2.2'")] and prov.diagnostic == "d.json"
    assert type(grp.rebuild(grp.describe(KeyError("k")))) is KeyError
    # Only ckptfs's own and builtin classes are rebuilt: anything else is the caller's default.
    alien = {"module": "os.path", "name": "join", "message": "m"}
    assert grp.rebuild(alien) is None
    err = grp.carried(alien, ReplicationError)
    assert type(err) is ReplicationError and str(err) == "join: m"
    # A message of the caller's (naming every failing rank, say), whichever class comes back.
    err = grp.carried(alien, ReplicationError, message="rank 0: m; rank 1: m")
    assert type(err) is ReplicationError and str(err) == "rank 0: m; rank 1: m"
    back = grp.carried(grp.describe(corrupt), ReplicationError, message="on rank(s) [0, 1]")
    assert type(back) is TierMismatchError and str(back) == "on rank(s) [0, 1]"
    assert back.step == 3


def test_importing_the_group_never_imports_dcp() -> None:
    """A world of one must not pay DCP's import (seconds)."""
    code = ("import sys, ckptfs.protocol.group as g; g.group_of(None).broadcast({'a': 1}); "
            "print('torch.distributed.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def job_messages(rank: int, world: int) -> dict[str, Any]:
    from ckptfs.protocol import group as g

    out: dict[str, Any] = {}
    default = g.group_of(None)
    own = g.RankGroup(g.gloo_group(timedelta(seconds=60)))  # a dedicated group, as ckptfs's
    out["kind"] = type(default).__name__
    out["ranks"] = (own.rank, own.world_size, own.ranks, own.coordinator)
    big = "x" * 100_000  # longer than any other rank's message: sizes travel first
    out["from0"] = own.broadcast({"step": 7, "tiers": ("local", "remote")} if rank == 0
                                 else None)
    out["from1"] = own.broadcast({"rank": rank, "big": big} if rank == 1 else None, src=1)
    out["gathered"] = default.all_gather({"rank": rank, "set": sorted({rank, 9})})
    out["uneven"] = [len(d) for d in own.all_gather("y" * (10 * rank))]
    # A payload JSON cannot hold fails on its sender, before anything is sent: the other rank
    # never enters that broadcast, and the next message still arrives whole.
    if rank == 0:
        try:
            own.broadcast({"payload": Payload(1)})
        except TypeError as exc:
            out["sender"] = str(exc)
    out["after"] = own.broadcast("still in step" if rank == 0 else None)
    # A typed error raised on rank 1 reaches rank 0 as the same class, with its message.
    error: dict[str, Any] | None = None
    if rank == 1:
        try:
            raise TierMismatchError("rank 1: step 3 is another run's", step=3)
        except TierMismatchError as exc:
            error = g.describe(exc)
    docs = own.all_gather(error)
    first = next(d for d in docs if d is not None)
    err = g.carried(first, ReplicationError)
    out["error"] = (type(err).__name__, str(err), getattr(err, "step", None))
    # The outcome round: rank 1's step fails; every rank learns it, with every result.
    def step() -> dict[str, int]:
        if rank == 1:
            raise TierMismatchError("rank 1 fails its step", step=5)
        return {"rank": rank}

    got = own.outcomes(step, share=True)
    out["outcomes"] = (got.value, type(got.own).__name__ if got.own else None,
                       {r: d["name"] for r, d in got.failures.items()}, got.values)
    ok = own.outcomes(lambda: rank * 10, share=True)
    quiet = own.outcomes(lambda: rank)  # not shared: each rank keeps its own value
    out["all_ok"] = (ok.failures, ok.values, quiet.value, quiet.values)
    return out


def test_json_messages_and_typed_errors_over_two_gloo_ranks() -> None:
    r0, r1 = run_ranks(job_messages, 2, timeout=180)
    assert r0["kind"] == r1["kind"] == "RankGroup"
    assert r0["ranks"] == (0, 2, [0, 1], True) and r1["ranks"] == (1, 2, [0, 1], False)
    for r in (r0, r1):
        assert r["from0"] == {"step": 7, "tiers": ["local", "remote"]}
        assert r["from1"] == {"rank": 1, "big": "x" * 100_000}
        assert r["gathered"] == [{"rank": 0, "set": [0, 9]}, {"rank": 1, "set": [1, 9]}]
        assert r["uneven"] == [0, 10]
        assert r["after"] == "still in step"
        assert r["error"] == ("TierMismatchError", "rank 1: step 3 is another run's", 3)
        assert r["outcomes"][2:] == ({1: "TierMismatchError"}, [{"rank": 0}, None])
    assert r0["outcomes"][:2] == ({"rank": 0}, None)
    assert r1["outcomes"][:2] == (None, "TierMismatchError")
    assert r0["all_ok"] == ({}, [0, 10], 0, None) and r1["all_ok"] == ({}, [0, 10], 1, None)
    assert "never pickled" in r0["sender"] and "sender" not in r1


def test_rebuilt_corrupt_error_keeps_its_class_hierarchy() -> None:
    """The class decides what a caller does next (retry, roll back): a rebuilt error is caught
    by the same ``except`` clauses as the original."""
    err = grp.rebuild(grp.describe(TierMismatchError("m", step=1)))
    assert isinstance(err, CorruptCheckpointError)


@pytest.mark.parametrize("backend, cuda, device", [
    ("gloo", True, "cpu"), ("cpu:gloo,cuda:nccl", True, "cpu"), ("nccl", True, "cuda:0"),
    ("nccl", False, "cpu"), ("custom", True, "cpu")])
def test_messages_cross_an_nccl_group_on_the_gpu(monkeypatch: pytest.MonkeyPatch, backend: str,
                                                 cuda: bool, device: str) -> None:
    """A CPU tensor cannot cross a group whose only backend is NCCL: its messages travel in
    tensors on the current CUDA device (torch's own choice for object collectives); every other
    group's on the CPU."""
    import torch

    monkeypatch.setattr(grp.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert str(grp.message_device(object())) == device
