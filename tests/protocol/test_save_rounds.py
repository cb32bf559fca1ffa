"""ckptfs's own collective save (``ckptfs.protocol.save_rounds``, ``plan_docs``): the plans,
parts, write results and outcome cross ranks as JSON documents that read back to what was sent;
a rank receives its own part of the global plan and the outcome, never the whole plan; nothing
is pickled; a malformed document is refused with ``ValueError``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from dist_util import run_ranks
from torch.distributed.checkpoint.api import CheckpointException

import ckptfs
from ckptfs.errors import CorruptCheckpointError
from ckptfs.format.sharded_tree import dcp_view
from ckptfs.protocol import plan_docs
from ckptfs.protocol.group import decode, decode_bytes, encode, encode_bytes
from ckptfs.protocol.options import SaveOptions
from ckptfs.protocol.plan_table import encode_numbers, layout_of
from ckptfs.protocol.save_rounds import RESEND, SaveRounds
from ckptfs.protocol.sharded_io import ItemReport, ShardedWriter
from ckptfs.protocol.sharded_plan import SavePlanner


def sent(doc: Any) -> Any:
    return decode(encode(doc))


@pytest.fixture(autouse=True)
def fresh_plan_memory() -> Any:
    """Each test starts as a new process: no rank has sent a plan, the coordinator has none."""
    from ckptfs.protocol import save_rounds

    save_rounds._CACHE.sent.clear()
    save_rounds._CACHE.tables.clear()
    yield


def state(rank: int) -> dict[str, Any]:
    return {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank,
                      "b": torch.ones(2, dtype=torch.bfloat16)},
            "opt": {"lr": 0.1, "betas": (0.9, 0.95), 3: b"raw", "step": torch.tensor(7)},
            "rank_only": {f"r{rank}": rank}}


def simulated(tmp_path: Path, world: int = 2, *, metadata_layout: str | None = None,
              step: int = 5, metadata: dict[str, Any] | None = None, rows: int = 3
              ) -> tuple[list[SaveRounds], list[Any], list[Any]]:
    """The rounds of ``world`` simulated ranks up to the plan: (rounds, plan docs, parts)."""
    store = ckptfs.open(str(tmp_path / "run"))
    rounds = []
    for rank in range(world):
        st = state(rank)
        st["model"]["w"] = torch.zeros(rows, 4)
        view, tree = dcp_view(st)
        writer = ShardedWriter(store.storage, step,
                               SaveOptions(threads=1, metadata_layout=metadata_layout),
                               tree=tree, metadata=metadata)
        rounds.append(SaveRounds(view, writer, SavePlanner(
            tree=tree, tree_sink=writer, gather_small=metadata_layout is not None), rank))
    docs = [sent(r.plan()) for r in rounds]
    parts = [sent(p) for p in rounds[0].plan_globally(docs)]
    return rounds, docs, parts


def test_a_local_plan_reads_back_as_sent(tmp_path: Path) -> None:
    rounds, docs, _ = simulated(tmp_path)
    for r, doc in zip(rounds, docs, strict=True):
        local = r.local
        assert local is not None
        back = plan_docs.local_plan_of(doc["plan"])
        assert back.items == local.items  # names, offsets, kinds, chunks, properties, sizes
        assert [i.index.index for i in back.items] == [i.index.index for i in local.items]
        assert back.storage_data == local.storage_data == 5
        assert dict(back.planner_data) == dict(local.planner_data)
        assert back.planner_data.tree == local.planner_data.tree  # bytes keys survive
        assert plan_docs.local_table_of(doc["plan"]).layout == doc["plan"]["layout"] == r.layout


def test_each_rank_receives_its_own_part_only(tmp_path: Path) -> None:
    _, docs, parts = simulated(tmp_path)
    plans = [plan_docs.local_plan_of(d["plan"]) for d in docs]
    # The coordinator's global plan, recomputed: each part rebuilds exactly its rank's plan.
    planner = SavePlanner()
    planner.set_up_planner({}, None, True)
    global_plans, _ = planner.create_global_plan(plans)
    for rank, (part, lp, gp) in enumerate(zip(parts, plans, global_plans, strict=True)):
        assert set(part) == {"part"} and set(part["part"]) == {"attempt", "rank", "items"}
        assert part["part"]["rank"] == rank
        mine = plan_docs.part_of(part["part"], lp)
        assert mine.items == gp.items
        assert [i.index.index for i in mine.items] == [i.index.index for i in gp.items]
        # A position list, not the items: the part is small whatever the plan holds.
        assert all(isinstance(p, list) and len(p) == 2 for p in part["part"]["items"])
    # The replicated items are written once over both ranks, the values by rank 0.
    written = [i.index for p in parts for i in plan_docs.part_of(
        p["part"], plans[p["part"]["rank"]]).items]
    assert len(written) == len(set(written))


def test_write_results_and_outcome_read_back(tmp_path: Path) -> None:
    rounds, _, parts = simulated(tmp_path)
    results = [sent(r.write(p)) for r, p in zip(rounds, parts, strict=True)]
    for rank, doc in enumerate(results):
        back = plan_docs.results_of(doc["results"], rank)
        assert back and all(isinstance(wr.storage_data, ItemReport) for wr in back)
        assert all(wr.storage_data.rank == rank for wr in back)
    outcome = sent(rounds[0].commit(results))
    infos = [r.result(outcome) for r in rounds]
    assert infos[0] is not None and infos[1] is not None
    assert infos[1].manifest == infos[0].manifest and infos[1].marker == infos[0].marker
    assert (infos[1].step, infos[1].attempt) == (5, infos[0].attempt)
    store = ckptfs.open(str(tmp_path / "run"))
    got = store.load(5)
    assert torch.equal(got["model"]["w"], torch.zeros(3, 4))
    assert torch.equal(got["model"]["b"], state(0)["model"]["b"])
    assert got["rank_only"] == {"r0": 0, "r1": 1}


def test_a_per_rank_save_sends_its_rank_report(tmp_path: Path) -> None:
    rounds, _, parts = simulated(tmp_path, metadata_layout="per-rank")
    results = [sent(r.write(p)) for r, p in zip(rounds, parts, strict=True)]
    assert all(len(d["results"]) == 1 and d["results"][0][4][0] == "rank" for d in results)
    outcome = sent(rounds[0].commit(results))
    info = rounds[1].result(outcome)
    assert info is not None and "rank-metadata" in info.manifest.features
    assert ckptfs.open(str(tmp_path / "run")).verify(5).ok


def test_a_tampered_outcome_is_refused(tmp_path: Path) -> None:
    rounds, _, parts = simulated(tmp_path)
    results = [sent(r.write(p)) for r, p in zip(rounds, parts, strict=True)]
    outcome = sent(rounds[0].commit(results))
    outcome["info"]["manifest"] = outcome["info"]["manifest"][:-2]  # cut short
    with pytest.raises(CorruptCheckpointError):
        rounds[1].result(outcome)


def _skeleton(damage: Any) -> Any:
    """A damage to a plan document's skeleton (decoded, changed, encoded again)."""
    def apply(d: dict[str, Any]) -> None:
        sk = msgpack.unpackb(decode_bytes(d["plan"]["skeleton"]), raw=False)
        damage(sk)
        d["plan"]["skeleton"] = encode_bytes(msgpack.packb(sk, use_bin_type=True))
    return apply


def _item(sk: list[Any]) -> list[Any]:
    return next(i for i in sk[1] if i[1] != "bytes")


@pytest.mark.parametrize("damage, match", [
    (_skeleton(lambda sk: sk[0][0].__setitem__(0, "os.system")), "not a torch name"),
    (_skeleton(lambda sk: sk[0][0].__setitem__(0, "torch.nn")), "not a dtype"),
    (_skeleton(lambda sk: sk[0][0].__setitem__(1, "torch.float32")), "not a layout"),
    (_skeleton(lambda sk: sk[0].__setitem__(0, ["torch.float32"])), "5 fields"),
    (_skeleton(lambda sk: _item(sk).__setitem__(1, "pickle")), "kind"),
    (_skeleton(lambda sk: _item(sk).__setitem__(2, 99)), "properties"),
    (_skeleton(lambda sk: _item(sk).__setitem__(3, ["0"])), "size"),
    (_skeleton(lambda sk: _item(sk).__setitem__(4, "0")), "index hint"),
    (_skeleton(lambda sk: _item(sk).__setitem__(6, 99)), "offsets"),
    (_skeleton(lambda sk: sk[1].append(["x"])), "a write item"),
    (_skeleton(lambda sk: sk.pop()), "properties, items"),
    (lambda d: d["plan"].__setitem__("skeleton", "%%"), "skeleton"),
    (lambda d: d["plan"].__setitem__("numbers", d["plan"]["numbers"][:-12]), "numbers"),
    (lambda d: d["plan"].__setitem__("numbers", 5), "numbers"),
    (lambda d: d["plan"].__setitem__("step", "5"), "step"),
    (lambda d: d["plan"].__setitem__("planner", encode_bytes(msgpack.packb(
        [[["k", [{"a": 1}]]], None]))), "flattening map"),
    (lambda d: d["plan"].__setitem__("planner", "%%"), "planner data"),
    (lambda d: d["plan"].__setitem__("layout", "0" * 64), "not that of its items"),
    (lambda d: d["plan"].pop("skeleton"), "a skeleton and numbers"),
])
def test_a_malformed_plan_is_refused(tmp_path: Path, damage: Any, match: str) -> None:
    rounds, docs, _ = simulated(tmp_path)
    damage(docs[1])
    with pytest.raises(ValueError, match=match):
        plan_docs.local_plan_of(docs[1]["plan"])
    # In the round: the coordinator refuses it, every rank gets the failure, nothing is made.
    parts = rounds[0].plan_globally(docs)
    assert all("failures" in p for p in parts) and match in str(parts[0])
    with pytest.raises(CheckpointException) as got:
        rounds[1].write(sent(parts[1]))
    exc = got.value.failures[0][0]
    assert type(exc) is ValueError and match in str(exc)
    assert not list((tmp_path / "run").rglob("*.safetensors"))


@pytest.mark.parametrize("damage", [
    lambda items: items.reverse(),          # out of order
    lambda items: items.append([99, None]),  # not one of its items
    lambda items: items[0].__setitem__(1, "1"),
])
def test_a_malformed_part_is_refused(tmp_path: Path, damage: Any) -> None:
    rounds, _, parts = simulated(tmp_path)
    items = parts[1]["part"]["items"]
    if len(items) < 2:
        items.append(list(items[0]))
    damage(items)
    with pytest.raises(ValueError, match="global plan part"):
        plan_docs.part_of(parts[1]["part"], rounds[1].local)


def test_a_plan_of_chunks_that_do_not_fit_is_refused(tmp_path: Path) -> None:
    """The global plan's checks (DCP's invariants, in columns): a rank whose copy of the whole
    tensor ``w`` is moved elsewhere (so not the same item as rank 0's) fails the round on
    every rank, nothing written."""
    rounds, docs, _ = simulated(tmp_path, rows=4)
    table = plan_docs.local_table_of(docs[1]["plan"])
    sk = table.skeleton
    row = next(r for r in sk.rows if r.fqn.endswith("w") and r.props >= 0)
    numbers = table.numbers.clone()
    numbers[row.start] = 5  # its offset along dim 0: past the tensor (4 rows)
    text = encode_numbers(numbers)
    docs[1]["plan"]["numbers"] = text
    # Signed again (a plan whose digest is not its content's is refused: the last test).
    docs[1]["plan"]["layout"] = layout_of(docs[1]["plan"]["skeleton"], text,
                                          docs[1]["plan"]["planner"])
    parts = rounds[0].plan_globally(docs)
    assert all("failures" in p for p in parts)
    assert "two write items of one value or whole tensor" in str(parts[0])
    assert not list((tmp_path / "run").rglob("*.safetensors"))


# ----------------------------------------------------------------------------------------------
# Two gloo ranks


def job_no_pickle(rank: int, world: int, root: str) -> dict[str, Any]:
    """A collective save and load with torch's object-collective pickler made to fail: nothing
    a rank sends or receives in the save is pickled.  The sizes of what each rank received."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptfs.protocol import group as grp

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    st = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 3, "b": torch.ones(4)}
    store = ckptfs.open(root)
    store.save(1, st)  # ckptfs's group made (its creation is a plain collective)

    class NoPickle:
        def __init__(self, *a: Any, **k: Any) -> None:
            raise AssertionError("a checkpoint message was pickled")

    received: list[int] = []
    real = grp.decode

    def counting(data: bytes) -> Any:
        received.append(len(data))
        return real(data)

    old = (c10d._pickler, c10d._unpickler)
    c10d._pickler, c10d._unpickler = NoPickle, NoPickle  # type: ignore[assignment]
    grp.decode = counting  # type: ignore[assignment]
    try:
        info = store.save(2, st)
    finally:
        c10d._pickler, c10d._unpickler = old
        grp.decode = real  # type: ignore[assignment]
    into = {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)]), "step": 0,
            "b": torch.zeros(4)}
    store.load(2, into=into)
    dist.barrier()
    return {"attempt": info.attempt, "received": received,
            "w": into["w"].full_tensor().tolist(), "step": into["step"]}


def test_a_collective_save_pickles_nothing_and_sends_each_rank_its_part(
        tmp_path: Path) -> None:
    r0, r1 = run_ranks(job_no_pickle, 2, str(tmp_path / "run"), timeout=240)
    assert r0["attempt"] == r1["attempt"]
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8).tolist()
    assert r0["w"] == r1["w"] == full and r0["step"] == r1["step"] == 3
    # Rank 1 receives two documents in the save: its part and the outcome; the coordinator
    # receives every rank's plan and results too (gathered), and the outcome (broadcast).
    assert len(r1["received"]) == 2, r1["received"]
    assert len(r0["received"]) == 2 * 2 + 2


@pytest.mark.parametrize("damage, match", [
    (lambda r: r[4].__setitem__(2, "0"), "an item report"),
    (lambda r: r[4].__setitem__(7, [0, "1", "ab"]), "a chunk"),
    (lambda r: r[4].__setitem__(8, [1, 2, 3]), "source"),
    (lambda r: r[4].__setitem__(9, ["1", "a"]), "protector"),
    (lambda r: r[4].__setitem__(10, [["crc32c"]]), "store checksums"),
    (lambda r: r[4].__setitem__(0, "pickle"), "a write report"),
    (lambda r: r.__setitem__(1, [0.5]), "a list of ints"),
    (lambda r: r.__setitem__(3, None), "write result"),
])
def test_malformed_write_results_are_refused(tmp_path: Path, damage: Any, match: str) -> None:
    rounds, _, parts = simulated(tmp_path)
    results = [sent(r.write(p)) for r, p in zip(rounds, parts, strict=True)]
    damage(results[1]["results"][0])
    with pytest.raises(ValueError, match=match):
        plan_docs.results_of(results[1]["results"], 1)
    outcome = rounds[0].commit(results)  # the coordinator commits nothing
    assert "failures" in outcome and match in str(outcome)
    assert not list((tmp_path / "run").rglob("COMPLETE"))


@pytest.mark.parametrize("damage", [
    lambda row: row.__setitem__("file_size", "12"),
    lambda row: row.__setitem__("has_file", 1),
    lambda row: row.pop("index_digest"),
    lambda row: row.__setitem__("extra", 0),
])
def test_a_malformed_rank_row_is_refused(tmp_path: Path, damage: Any) -> None:
    rounds, _, parts = simulated(tmp_path, metadata_layout="per-rank")
    results = [sent(r.write(p)) for r, p in zip(rounds, parts, strict=True)]
    damage(results[1]["results"][0][4][1])
    with pytest.raises(ValueError, match="a rank row"):
        plan_docs.results_of(results[1]["results"], 1)
    assert "failures" in rounds[0].commit(results)
    assert not list((tmp_path / "run").rglob("COMPLETE"))


def test_the_placeholder_check_is_skipped_only_for_a_layout_already_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator checks the manifest it will commit against every reader limit before a
    byte is written; a save whose ranks' layouts, metadata and algorithm are those of the last
    one checked skips it (the verdict is the same), any change checks again."""
    from ckptfs.protocol.commit import Attempt

    calls: list[int] = []
    real = Attempt.check

    def counted(self: Attempt, manifest: Any, **writer: Any) -> None:
        calls.append(self.step)
        real(self, manifest, **writer)

    monkeypatch.setattr(Attempt, "check", counted)

    def save(step: int, **kw: Any) -> None:
        rounds, _, parts = simulated(tmp_path, step=step, **kw)
        assert "part" in parts[0], parts[0]
        results = [sent(r.write(p)) for r, p in zip(rounds, parts, strict=True)]
        assert "info" in rounds[0].commit(results)

    save(10, rows=5)
    save(11, rows=5)
    assert calls == [10]  # the same layout: the verdict is known
    save(12, rows=6)      # another shape
    save(13, rows=6, metadata={"run": "b"})  # other metadata
    save(14, rows=6, metadata={"run": "b"})
    save(15, rows=6, metadata={"run": "b"}, metadata_layout="per-rank")  # another layout
    save(16, rows=6, metadata={"run": "b"}, metadata_layout="per-rank")  # its owners kept
    assert calls == [10, 12, 13, 15]
    store = ckptfs.open(str(tmp_path / "run"))
    assert store.verify(16).ok and store.verify(11).ok
    # The spec of the save that took the owners and the spec's layout from the last one is
    # that save's own, but for its ids.
    from ckptfs.format.rank_metadata import decode_spec

    def spec(step: int) -> Any:
        info = store.info(step)
        blob = (tmp_path / "run" / info.path / "dcp-spec.msgpack").read_bytes()
        return decode_spec(blob, 2, where="spec")

    a, b = spec(15), spec(16)
    assert a.tensors == b.tensors and a.values == b.values
    assert torch.equal(store.load(16)["model"]["w"], torch.zeros(6, 4))


def _commit_all(rounds: list[SaveRounds], parts: list[Any]) -> list[Any]:
    results = [sent(r.write(p)) for r, p in zip(rounds, parts, strict=True)]
    outcome = sent(rounds[0].commit(results))
    return [r.result(outcome) for r in rounds]


def test_a_layout_sent_before_is_sent_without_its_items(tmp_path: Path) -> None:
    """Every save of a training run but the first keeps its layout: its ranks leave their
    items out (the coordinator has them, checked by layout digest) and the checkpoint is the
    same as with every item sent."""
    rounds, docs, parts = simulated(tmp_path, step=20)
    assert all(isinstance(d["plan"]["skeleton"], str) for d in docs)  # the first: every item
    _commit_all(rounds, parts)
    rounds, docs, parts = simulated(tmp_path, step=21)
    assert all(plan_docs.items_left_out(d["plan"]) for d in docs)
    assert len(encode(docs[1])) < 1000
    _commit_all(rounds, parts)
    rounds, docs, parts = simulated(tmp_path, step=22, rows=7)  # another shape: sent again
    assert all(isinstance(d["plan"]["skeleton"], str) for d in docs)
    _commit_all(rounds, parts)
    store = ckptfs.open(str(tmp_path / "run"))
    first, second = store.info(20).manifest, store.info(21).manifest
    assert [(f.path, f.size) for f in first.files] == [(f.path, f.size) for f in second.files]
    assert torch.equal(store.load(21)["model"]["w"], torch.zeros(3, 4))
    assert torch.equal(store.load(22)["model"]["w"], torch.zeros(7, 4))


def test_a_coordinator_without_the_plan_asks_for_every_item(tmp_path: Path) -> None:
    from ckptfs.protocol import save_rounds

    rounds, _, parts = simulated(tmp_path, step=30)
    _commit_all(rounds, parts)
    save_rounds._CACHE.tables.clear()  # say, another save's plans replaced them
    store = ckptfs.open(str(tmp_path / "run"))
    rounds = []
    for rank in range(2):
        st = state(rank)
        st["model"]["w"] = torch.zeros(3, 4)
        view, tree = dcp_view(st)
        writer = ShardedWriter(store.storage, 31, SaveOptions(threads=1), tree=tree)
        rounds.append(SaveRounds(view, writer, SavePlanner(tree=tree, tree_sink=writer), rank))
    docs = [sent(r.plan()) for r in rounds]
    assert all(plan_docs.items_left_out(d["plan"]) for d in docs)
    assert rounds[0].plan_globally(docs) == [RESEND, RESEND]
    docs = [sent(r.plan_in_full()) for r in rounds]
    parts = [sent(p) for p in rounds[0].plan_globally(docs)]
    infos = _commit_all(rounds, parts)
    assert infos[1] is not None and infos[1].step == 31
    assert store.verify(31).ok


def test_a_plan_without_items_takes_none_of_another_layout(tmp_path: Path) -> None:
    """A document without items whose layout digest is not the coordinator's plan of that rank
    never gets that plan's items: every rank is asked again."""
    rounds, docs, parts = simulated(tmp_path, step=40)
    _commit_all(rounds, parts)
    rounds, docs, _ = simulated(tmp_path, step=41)
    docs[1]["plan"]["layout"] = "0" * 64
    assert rounds[0].plan_globally(docs) == [RESEND, RESEND]
    with pytest.raises(ValueError, match="no earlier plan of its layout"):
        plan_docs.local_table_of(docs[1]["plan"], None, None)
