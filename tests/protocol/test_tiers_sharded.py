"""Two tiers, sharded (docs/tiers.md "Sharded"): 2 gloo ranks, each
with its own local tier (its "node's disk": a directory of its own), one remote (a local
directory shared by both, as an object store would be).

Two W=2 jobs (a rank costs seconds on 2 cores):

* ``job_replicate``: three steps saved (formats v2, then v4 with ``incremental=True``),
  ``wait_replicated``; loads from the local copy spread over the nodes (rank 1 gets rank 0's
  stored-once items from rank 0); rank 1's node lost, then the load takes its files from the
  remote bit-exact; a corrupt local file: the remote copy, logged.  This process then checks the
  remote: every step verifies and loads 2 -> 1 bit-exact; and node 1's local tier never held a
  marker (its rank file is in the committed attempt's directory).
* ``job_failing_rank``: node 1 lists its rank file resized: the save fails on every rank, no
  commit (each rank checks its own file before reporting it).  Rank 1's uploads fail (an
  injected storage error, no retry): no remote commit for steps 2 and 3, step 1 stays the
  remote's latest on both ranks; step 3's files lost on node 1 before they reached the remote:
  the load takes step 2 (logged: a lost node is not corruption); the store opened again with a
  working remote replicates step 2 and names step 3's missing file.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks
from test_remote_verify import ComputedChecksums
from test_sharded import targets, to_plain

import ckptfs
from ckptfs.errors import (
    CorruptCheckpointError,
    ReplicationError,
    ShardedSaveError,
    StorageError,
)
from ckptfs.lifecycle.gc import collect
from ckptfs.storage.base import Entry, StorageWrapper
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal
from ckptfs.testing.reliability.tiers import LogRecords


def _model(world: int) -> tuple[Any, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3))
    model[0].requires_grad_(False)  # frozen: referenced by the incremental steps (v4)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, opt, mesh


def _train_state(model: Any, opt: Any, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "trainer": {"step": step, "name": "run"}}


def _frozen(value: Any) -> Any:
    """A deep copy of the full tensors (the optimizer's step counters change in place)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_frozen(v) for v in value)
    return value


def _placement(t: torch.Tensor) -> Any:
    from torch.distributed.tensor import Shard

    return Shard(0) if t.dim() >= 1 and t.shape[0] > 1 else None


def _load_into(store: Any, plain: Any, mesh: Any, **kw: Any) -> Any:
    into = targets(plain, mesh, _placement)
    assert store.load(into=into, **kw) is into
    return to_plain(into)


def _flip_last_byte(root: str, pattern: str) -> None:
    """The last byte of the one file under ``root`` matching ``pattern`` flipped (a file of the
    same size whose bytes are not the committed ones)."""
    f = next(Path(root).glob(pattern))
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))


def _load_logged(records: LogRecords, store: Any, plain: Any, mesh: Any,
                 expect: Any = None) -> list[str]:
    """``load(into=)`` of ``store`` bit-exact with ``expect`` (default ``plain``, the state
    whose shapes the targets take); what the load logged."""
    before = len(records.messages)
    assert_state_equal(_load_into(store, plain, mesh), plain if expect is None else expect)
    return records.messages[before:]


def job_replicate(rank: int, world: int, root: str) -> Any:
    import torch.distributed as dist

    records = LogRecords()
    logging.getLogger("ckptfs").addHandler(records)
    local, remote = f"{root}/node-{rank}", f"file://{root}/remote"
    model, opt, mesh = _model(world)
    # The remote keeps a CRC32 of every object (as S3 and GCS keep theirs): each rank compares
    # its uploads' stored checksums before the coordinator commits, and the replica's manifest
    # records them.
    remote_store = ckptfs.CheckpointStore(ComputedChecksums(ckptfs.open(remote).storage))
    store = ckptfs.tiered(local, remote_store, incremental=True)
    plains = {}
    for step in (1, 2, 3):
        state = _train_state(model, opt, step)
        info = store.save(step, state)
        assert info.step == step
        plains[step] = _frozen(to_plain(state))
    status = store.wait_replicated(timeout=60)
    assert status.lag_steps == 0 and sorted(status.steps) == [1, 2, 3], status
    assert store.tier_steps()["remote"] == [1, 2, 3]
    for step in (1, 2, 3):
        rep = status.steps[step]
        files = store.remote.info(step).manifest.files
        assert rep.server_verified == len(files) and rep.server_unverified == 0, rep
        assert all(dict(e.store_checksums).get("crc32") for e in files), files
    assert store.remote.verify(3, remote=True).complete

    # The local copy, spread over the nodes: with the remote out of reach (renamed away),
    # rank 1 gets rank 0's stored-once items (optimizer step counters, values) from rank 0.
    dist.barrier()
    if rank == 0:
        Path(f"{root}/remote").rename(f"{root}/remote-away")
    dist.barrier()
    assert_state_equal(_load_into(store, plains[3], mesh), plains[3])
    dist.barrier()
    if rank == 0:
        Path(f"{root}/remote-away").rename(f"{root}/remote")
    dist.barrier()
    for step in (3, 1):
        assert_state_equal(_load_step(store, plains[step], mesh, step), plains[step])
    assert_state_equal(_load_into(store, plains[3], mesh), plains[3])
    dist.barrier()
    assert not [m for m in records.messages if "fails" in m], records.messages

    # Node 1 lost (a replaced node): its files come from the remote copy, bit-exact.
    if rank == 1:
        shutil.rmtree(local)
    dist.barrier()
    assert_state_equal(_load_into(store, plains[3], mesh), plains[3])
    dist.barrier()

    # A corrupt local file (same size): the local copy fails its digest check, the remote copy
    # is loaded, and the log says so (on every rank).
    if rank == 0:
        _flip_last_byte(local, "checkpoints/step-*3/*/rank-00000/data-0.safetensors")
    dist.barrier()
    logged = _load_logged(records, store, plains[3], mesh)
    assert any("the local copy of step 3 at" in m and "fails" in m for m in logged), logged
    assert any("using the remote copy of step 3" in m for m in logged), logged

    # Another run's step 4 at the remote, then this run's step 4 (its replication fails: other
    # content) with a corrupt local file: the other checkpoint never stands in for it, on
    # every rank; allow_rollback: step 3 (its remote copy is the same checkpoint).
    ckptfs.open(remote).save(4, _train_state(model, opt, 99))  # collective, both ranks
    store.save(4, _train_state(model, opt, 4))
    with pytest.raises(ReplicationError, match="CheckpointExistsError"):
        store.wait_replicated(timeout=60)
    if rank == 0:
        _flip_last_byte(local, "checkpoints/step-*4/*/rank-00000/data-0.safetensors")
    dist.barrier()
    with pytest.raises(ckptfs.TierMismatchError, match="not the same checkpoint"):
        _load_into(store, plains[3], mesh)
    assert_state_equal(_load_into(store, plains[3], mesh, allow_rollback=True), plains[3])
    store.close()
    return plains if rank == 0 else None


def _load_step(store: Any, plain: Any, mesh: Any, step: int) -> Any:
    into = targets(plain, mesh, _placement)
    assert store.load(step, into=into) is into
    return to_plain(into)


def test_sharded_replication_and_resume(tmp_path: Path) -> None:
    root = str(tmp_path)
    plains = run_ranks(job_replicate, 2, root, timeout=240)[0]
    remote = ckptfs.open(f"{root}/remote")
    assert remote.steps() == [1, 2, 3, 4]  # 4: another run's
    for step in (1, 2, 3):
        info = remote.info(step)
        assert info.marker.writer.get("copied_from", "").startswith(f"{root}/node-0")
        assert remote.verify(step).ok
        # 2 -> 1: the whole checkpoint in one process, bit-exact.
        assert_state_equal(remote.load(step), plains[step])
    # v4 at the remote: the incremental steps reference the remote's own copy of step 1.
    m3 = remote.info(3).manifest
    assert m3.format_version == 4 and m3.references
    assert {(r.step, r.attempt) for r in m3.references} <= {(1, remote.info(1).attempt),
                                                              (2, remote.info(2).attempt)}
    # Node 1's local tier: its rank files in the committed attempts' directories, no marker
    # (the coordinator's node holds the commit).
    node1 = Path(root) / "node-1"
    assert not list(node1.glob("checkpoints/*/COMPLETE"))


class _Resizing(StorageWrapper):
    """A node's disk that lists its rank files one byte longer while ``on`` (a write that did
    not land as reported)."""

    on = False

    def outer_entry(self, entry: Entry) -> Entry:
        if self.on and "/rank-" in entry.name:
            return dataclasses.replace(entry, size=entry.size + 1)
        return entry


def job_failing_rank(rank: int, world: int, root: str) -> Any:
    import torch.distributed as dist

    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.testing.faults import FaultyStorage

    records = LogRecords()
    logging.getLogger("ckptfs").addHandler(records)
    local, remote_url = f"{root}/node-{rank}", f"file://{root}/remote"
    failing = {"on": False}

    def hook(op: str, path: str) -> None:
        if failing["on"] and rank == 1 and "/rank-" in path:
            raise StorageError(f"injected: rank 1 cannot upload {path}")

    remote = CheckpointStore(FaultyStorage(ckptfs.open(remote_url, retries=0).storage,
                                           hook=hook))
    model, opt, mesh = _model(world)
    node = _Resizing(ckptfs.open(local).storage)
    store = ckptfs.tiered(CheckpointStore(node), remote, max_attempts=1)
    # Each rank checks its own file on its own node before reporting it: node 1 listing its
    # rank file with another size fails the save on every rank, and nothing is committed.
    node.on = rank == 1
    try:
        store.save(0, _train_state(model, opt, 0))
        raise AssertionError("a sharded save committed with rank 1's file resized")
    except (CorruptCheckpointError, ShardedSaveError) as exc:
        assert "rank 1 sees" in str(exc), exc
    node.on = False
    assert store.tier_steps() == {"local": [], "remote": []}
    s1 = _train_state(model, opt, 1)
    store.save(1, s1)
    store.wait_replicated(timeout=60)
    failing["on"] = True
    plains = {1: _frozen(to_plain(s1))}
    for step in (2, 3):
        state = _train_state(model, opt, step)
        store.save(step, state)
        plains[step] = _frozen(to_plain(state))
    try:
        store.wait_replicated(timeout=60)
        raise AssertionError("replication succeeded with rank 1's uploads failing")
    except ReplicationError as exc:
        assert "rank(s) [1]" in str(exc), exc
    status = store.replication()
    assert status.state(1) == "replicated"
    assert status.state(2) == "failed" and status.state(3) == "failed", status
    # No remote commit for the steps rank 1 could not upload: step 1 stays the remote's latest.
    assert store.tier_steps()["remote"] == [1]
    remote_latest = ckptfs.open(remote_url).latest()
    assert remote_latest is not None and remote_latest.step == 1

    # Step 3's files on node 1 are lost before they reached the remote: the local copy cannot
    # serve it, the remote does not hold it: the newest step that can be read (2), logged.
    dist.barrier()
    if rank == 1:
        for d in Path(local).glob("checkpoints/step-*3"):
            shutil.rmtree(d)
    dist.barrier()
    logged = _load_logged(records, store, plains[3], mesh, expect=plains[2])
    assert any("step 3 cannot be loaded" in m for m in logged), logged
    store.close()
    dist.barrier()

    # The remote works again: a new open queues what is missing; step 2 is replicated, step 3
    # cannot be (node 1's files are gone) and fails, named.
    failing["on"] = False
    store = ckptfs.tiered(local, remote, max_attempts=1)
    try:
        store.wait_replicated(timeout=60)
    except ReplicationError as exc:
        assert "step 3" in str(exc) and "rank(s) [1]" in str(exc), exc
    assert store.tier_steps()["remote"] == [1, 2]
    store.close()
    return plains[2] if rank == 0 else None


def test_failing_rank_no_remote_commit(tmp_path: Path) -> None:
    root = str(tmp_path)
    plain2 = run_ranks(job_failing_rank, 2, root, timeout=240)[0]
    remote = ckptfs.open(f"{root}/remote")
    assert remote.steps() == [1, 2]
    assert remote.verify(2).ok
    assert_state_equal(remote.load(2), plain2)


KILLED = 17  # rank 1's exit code: killed while uploading
REPLICATE_TIMEOUT_S = 3
HUNG_S = 8


def job_lost_rank(rank: int, world: int, root: str, remote_url: str,
                  remote_opts: dict[str, Any], how: str) -> Any:
    """Rank 1 is lost as its replication thread starts uploading its file of step 2: killed
    (``how="killed"``: ``os._exit``, a lost node) or hung (``"hung"``: its upload stalls for
    longer than ``replicate_timeout``, then goes on).  No rank may commit step 2 at the remote
    or hang: rank 0's collectives on the replication group fail when the peer is gone, or after
    ``replicate_timeout``, and every surviving rank says its replicator died.  Step 1 stays the
    remote's latest."""
    import os
    import time

    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.testing.faults import FaultyStorage

    lose = {"on": False}

    def hook(op: str, path: str) -> None:
        if lose["on"] and "/rank-00001/" in path:
            if how == "killed":
                os._exit(KILLED)  # the node is gone: no cleanup, no answer to any collective
            lose["on"] = False
            time.sleep(HUNG_S)  # past the replication group's timeout, then the upload goes on

    remote = CheckpointStore(FaultyStorage(ckptfs.open(remote_url, **remote_opts).storage,
                                           hook=hook))
    model, opt, _mesh = _model(world)
    store = ckptfs.tiered(f"{root}/node-{rank}", remote, max_attempts=1,
                          replicate_timeout=timedelta(seconds=REPLICATE_TIMEOUT_S))
    s1 = _train_state(model, opt, 1)
    store.save(1, s1)
    plains = {1: _frozen(to_plain(s1))}  # collectives: while both ranks live
    store.wait_replicated(timeout=60)
    s2 = _train_state(model, opt, 2)
    plains[2] = _frozen(to_plain(s2))
    lose["on"] = rank == 1
    store.save(2, s2)  # the local commit: every rank's file on its node, the marker on node 0
    start = time.monotonic()
    try:
        store.wait_replicated(timeout=120)
        raise AssertionError("step 2 replicated with rank 1 lost")
    except ReplicationError as exc:
        error = str(exc)
    waited = time.monotonic() - start
    assert how == "hung" or rank == 0  # a killed rank 1 never gets here
    status = store.replication()
    out = {"error": error, "waited": waited, "dead": status.dead, "state2": status.state(2),
           "remote_steps": store.remote.steps(), "plains": plains}
    store.close()
    return out


def job_restart(rank: int, world: int, root: str, remote_url: str,
                remote_opts: dict[str, Any]) -> Any:
    """The job restarted on both nodes: the open queues step 2, which is replicated."""
    store = ckptfs.tiered(f"{root}/node-{rank}", ckptfs.open(remote_url, **remote_opts))
    status = store.wait_replicated(timeout=120)
    out = (status.state(1), status.state(2), store.tier_steps())
    store.close()
    return out


@pytest.mark.parametrize(("how", "where"), [("killed", "s3"), ("hung", "local"),
                                            pytest.param("killed", "local",
                                                         marks=pytest.mark.slow)])
def test_lost_rank_no_remote_commit_then_restart(how: str, where: str, tmp_path: Path,
                                                 request: pytest.FixtureRequest) -> None:
    """A rank really lost while replicating: rank 1's process exits (or its upload hangs past
    ``replicate_timeout``) as its replication thread starts its upload of step 2.  No remote
    commit for step 2 (step 1 stays the remote's latest); the surviving ranks report the dead
    replicator instead of hanging; a restart of the job replicates step 2 bit-exact, and gc of
    the remote then leaves each step's committed attempt alone.  The remote: a directory, or
    S3 (moto)."""
    if where == "s3":
        backend: Backend = request.getfixturevalue("s3_backend")
        remote_url, remote_opts = backend.url, dict(backend.options)
    else:
        remote_url, remote_opts = f"file://{tmp_path}/remote", {}
    root = str(tmp_path)
    results = run_ranks(job_lost_rank, 2, root, remote_url, remote_opts, how, timeout=240,
                        exits={1: KILLED} if how == "killed" else None)
    survivors = [r for r in results if r is not None]
    assert len(survivors) == (1 if how == "killed" else 2)
    for got in survivors:
        assert got["dead"] is not None and "died" in got["error"], got["error"]
        assert got["state2"] != "replicated" and got["remote_steps"] == [1], got
        assert got["waited"] < HUNG_S + 3 * REPLICATE_TIMEOUT_S, got["waited"]
    if how == "hung":  # rank 0 gave up on its own timeout, before rank 1's upload resumed
        assert results[0]["waited"] < HUNG_S, results[0]["waited"]
    remote = ckptfs.open(remote_url, **remote_opts)
    assert remote.steps() == [1] and remote.latest().step == 1  # type: ignore[union-attr]

    restarted = run_ranks(job_restart, 2, root, remote_url, remote_opts, timeout=240)
    for states in restarted:
        assert states[0] == "replicated" and states[1] == "replicated", states
    remote = ckptfs.open(remote_url, **remote_opts)
    assert remote.steps() == [1, 2]
    plains = survivors[0]["plains"]
    for step in (1, 2):
        assert remote.verify(step).ok
        assert_state_equal(remote.load(step), plains[step])
    # Whatever the lost attempt of step 2 left (rank 0 may have uploaded its file into it) is
    # collected; each step keeps exactly its committed attempt.
    collect(remote.storage, older_than=timedelta(0))
    for step in (1, 2):
        info = remote.info(step)
        names = {e.name.rsplit("/", 1)[-1] for e in remote.storage.list_dir(info.paths.dir)}
        assert names == {"COMPLETE", info.attempt}, names
        assert remote.verify(step).ok


def job_async(rank: int, world: int, root: str) -> Any:
    """Sharded ``save_async`` on a tiered store: every rank writes its file on its own node in
    the background, the parameters change right after each call returns (the snapshot holds),
    each node's files get their committed path when the save completes (the remote is held
    back meanwhile, so that the replicator, which also settles a node's files, cannot be the
    one that did it), and each step is replicated."""
    import threading

    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.testing.faults import FaultyStorage

    local = f"{root}/node-{rank}"
    held = {"on": False}
    gate = threading.Event()

    def hook(op: str, path: str) -> None:
        if held["on"]:
            assert gate.wait(60), "the remote was never released"

    remote = CheckpointStore(FaultyStorage(ckptfs.open(f"file://{root}/remote").storage,
                                           hook=hook))
    model, opt, mesh = _model(world)
    store = ckptfs.tiered(local, remote)
    held["on"] = True
    plains, futures = {}, []
    for step in (1, 2):
        state = _train_state(model, opt, step)
        plains[step] = _frozen(to_plain(state))  # collective: the values being saved
        futures.append(store.save_async(step, state))
        with torch.no_grad():  # right after the call returns: must not reach the checkpoint
            for p in model.parameters():
                p.add_(1.0)
    infos = [f.result(timeout=120) for f in futures]
    assert [i.step for i in infos] == [1, 2]
    assert not list(Path(local).glob("checkpoints/*/.tmp-*"))  # settled on every node
    assert sorted(p.name for p in Path(local).glob("checkpoints/*/a-*")) == sorted(
        i.attempt for i in infos)
    gate.set()
    status = store.wait_replicated(timeout=120)
    assert status.state(1) == status.state(2) == "replicated", status
    assert store.tier_steps()["remote"] == [1, 2]
    for step in (2, 1):  # the local copy, spread over the nodes
        assert_state_equal(_load_step(store, plains[step], mesh, step), plains[step])
    store.close()
    return plains if rank == 0 else None


def test_sharded_save_async_on_two_tiers(tmp_path: Path) -> None:
    root = str(tmp_path)
    plains = run_ranks(job_async, 2, root, timeout=240)[0]
    remote = ckptfs.open(f"{root}/remote")
    assert remote.steps() == [1, 2]
    for step in (1, 2):
        assert remote.verify(step).ok
        assert_state_equal(remote.load(step), plains[step])


def job_manager(rank: int, world: int, root: str, layout: str | None = None) -> Any:
    """A CheckpointManager on a sharded two-tier store (``layout``: its metadata layout, None
    or ``"per-rank"``, format v2 or v5): local retention works on every node
    (the coordinator's quick verify checks the files its node holds; the other nodes remove
    their files of the steps it deleted), after each save and in ``mgr.prune()`` on every
    rank.  A new job's manager restores bit-exact (its walk reads the remote tier, the one
    complete copy; the model and optimizer load from each node's files first): the step the
    last job saved while the remote was down is replicated by the restart first, then
    restored; also with node 1's disk lost."""
    import threading

    import torch.distributed as dist

    from ckptfs.protocol.resolve import list_step_dirs
    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.testing.faults import FaultyStorage

    local, remote = f"{root}/node-{rank}", f"file://{root}/remote"
    mode = {"now": ""}
    gate = threading.Event()

    def hook(op: str, path: str) -> None:
        if mode["now"] == "held":
            assert gate.wait(60), "the remote was never released"
        elif mode["now"] == "down":
            raise StorageError(f"{op} {path}: injected outage")

    model, opt, _mesh = _model(world)
    store = ckptfs.tiered(ckptfs.open(local, metadata_layout=layout),
                          CheckpointStore(FaultyStorage(ckptfs.open(remote).storage, hook=hook)),
                          retry_max_s=0.5)
    mgr = ckptfs.CheckpointManager(store, keep_last=1)
    errors = []

    def save(step: int) -> None:
        _train_state(model, opt, step)
        errors.extend(mgr.save(step, model=model, optimizer=opt,
                               metrics={"loss": 1.0 / step}).errors)

    for step in (1, 2, 3):
        save(step)
        store.wait_replicated(timeout=60)  # so that the next save's prune may delete it
    node_steps = [sorted(list_step_dirs(store.storage))]
    mode["now"] = "held"  # the remote held back: step 4 is not replicated at step 5's prune
    for step in (4, 5):
        save(step)
    node_steps.append(sorted(list_step_dirs(store.storage)))
    mode["now"] = ""
    gate.set()
    store.wait_replicated(timeout=60)
    report = mgr.prune()  # every rank: the writer prunes, every node follows
    node_steps.append(sorted(list_step_dirs(store.storage)))
    out: dict[str, Any] = {"errors": errors, "node_steps": node_steps,
                           "remote": store.remote.steps(), "pruned": report.deleted}
    mode["now"] = "down"  # step 6 is saved during an outage; the job ends before it is copied
    save(6)
    store.close()
    out["remote_before_restart"] = ckptfs.open(remote).steps()

    def restored() -> bool:
        model3, opt3, _ = _model(world)
        again = ckptfs.tiered(ckptfs.open(local, metadata_layout=layout), remote)
        nxt = ckptfs.CheckpointManager(again, keep_last=1).restore_latest(model=model3,
                                                                          optimizer=opt3)
        assert again.info(nxt - 1).manifest.format_version == (5 if layout else 2)
        again.close()
        return nxt == 7 and all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in
                                zip(model.parameters(), model3.parameters(), strict=True))

    out["restored"] = restored()  # the restart replicates step 6, then restores it
    dist.barrier()
    if rank == 1:
        shutil.rmtree(local)  # node 1 replaced: its files of step 6 come from the remote
    dist.barrier()
    out["restored_after_loss"] = restored()
    return out


@pytest.mark.parametrize("layout", [None, "per-rank"])
def test_manager_retention_and_restore_on_sharded_tiers(tmp_path: Path, layout: str | None
                                                        ) -> None:
    for rank, got in enumerate(run_ranks(job_manager, 2, str(tmp_path), layout, timeout=240)):
        assert got["errors"] == [], (rank, got["errors"])  # the prune was never refused
        assert got["node_steps"] == [[3], [4, 5], [5]], (rank, got)  # every node, not node 0
        assert got["pruned"] == [4], (rank, got)  # mgr.prune(): the same report on every rank
        assert got["remote"] == [1, 2, 3, 4, 5]
        assert got["remote_before_restart"] == [1, 2, 3, 4, 5]  # step 6: local only
        assert got["restored"] and got["restored_after_loss"], (rank, got)


def job_one_rank(rank: int, world: int, root: str) -> Any:
    """A world of one (a one-rank gloo group) with a DTensor state: a plain store saves it
    collectively, and so does a two-tier store opened with defaults (sync and async); both
    steps replicate, and ``load(into=)`` goes through the walk (the remote copy of a step whose
    local copy is corrupt, logged)."""
    records = LogRecords()
    logging.getLogger("ckptfs").addHandler(records)
    model, opt, mesh = _model(world)
    state = _train_state(model, opt, 1)
    plain1 = _frozen(to_plain(state))
    assert ckptfs.open(f"{root}/plain").save(1, state).manifest.format_version == 2
    store = ckptfs.tiered(f"{root}/local", f"{root}/remote")
    assert not store.sharded
    assert store.save(1, state).manifest.format_version == 2  # the plain store's answer
    state2 = _train_state(model, opt, 2)
    plain2 = _frozen(to_plain(state2))
    assert store.save_async(2, state2).result(timeout=120).manifest.format_version == 2
    status = store.wait_replicated(timeout=60)
    assert status.lag_steps == 0 and sorted(status.steps) == [1, 2], status
    assert_state_equal(_load_into(store, plain2, mesh), plain2)
    assert_state_equal(_load_step(store, plain1, mesh, 1), plain1)
    _flip_last_byte(f"{root}/local", "checkpoints/step-*2/*/rank-00000/data-0.safetensors")
    assert_state_equal(_load_into(store, plain2, mesh), plain2)  # the remote copy
    assert any("using the remote copy of step 2" in m for m in records.messages), \
        records.messages
    store.close()
    return plain1, plain2


def test_one_rank_group_saves_dtensors_on_two_tiers(tmp_path: Path) -> None:
    root = str(tmp_path)
    plain1, plain2 = run_ranks(job_one_rank, 1, root, timeout=240)[0]
    remote = ckptfs.open(f"{root}/remote")
    assert remote.steps() == [1, 2]
    assert remote.verify(2).ok
    assert_state_equal(remote.load(1), plain1)
    assert_state_equal(remote.load(2), plain2)


def job_per_rank(rank: int, world: int, root: str) -> Any:
    """Per-rank metadata (format v5) on node-local tiers: each node holds its rank file and
    its index document, the coordinator's node the spec, the table and the commit; the
    replica copies each node's files from that node (the ranks' indexes gathered to list them)
    and commits a v5 step at the remote; the local copy loads spread over the nodes, a lost
    node's index and rank file come from the remote copy; a quick verify checks each node's
    own part; a step whose node is lost before it reached the remote is skipped for the
    one before (logged, not corruption); a node's damaged index fails the load of the local
    copy, and the remote copy stands in (logged)."""
    import torch.distributed as dist

    records = LogRecords()
    logging.getLogger("ckptfs").addHandler(records)
    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.testing.faults import FaultyStorage

    local, remote = f"{root}/node-{rank}", f"{root}/remote"
    down = {"now": False}

    def hook(op: str, path: str) -> None:
        if down["now"]:
            raise StorageError(f"{op} {path}: injected outage")

    model, opt, mesh = _model(world)
    store = ckptfs.tiered(ckptfs.open(local, metadata_layout="per-rank"),
                          CheckpointStore(FaultyStorage(ckptfs.open(remote).storage, hook=hook)),
                          retry_max_s=0.5)
    assert store.node_local
    plains = {}
    for step in (1, 2):
        state = _train_state(model, opt, step)
        info = store.save(step, state)
        assert info.manifest.format_version == 5, info.manifest.format_version
        plains[step] = _frozen(to_plain(state))
    state = _train_state(model, opt, 3)
    assert store.save_async(3, state).result(timeout=120).manifest.format_version == 5
    plains[3] = _frozen(to_plain(state))
    status = store.wait_replicated(timeout=60)
    assert status.lag_steps == 0 and sorted(status.steps) == [1, 2, 3], status
    assert store.verify(3, quick=True).ok  # this node's part of the local copy
    mine = list(Path(local).glob(f"checkpoints/step-*3/*/rank-{rank:05d}/*"))
    assert len(mine) == 2, mine  # its rank file and its index document, on its own node

    # The local copy, spread over the nodes (the remote out of reach).
    dist.barrier()
    if rank == 0:
        Path(remote).rename(f"{remote}-away")
    dist.barrier()
    assert_state_equal(_load_into(store, plains[3], mesh), plains[3])
    assert_state_equal(_load_step(store, plains[1], mesh, 1), plains[1])
    dist.barrier()
    if rank == 0:
        Path(f"{remote}-away").rename(remote)
    dist.barrier()
    assert not [m for m in records.messages if "fails" in m], records.messages

    # Step 4 saved while the remote is down, then node 1's files of it lost: the local copy
    # cannot serve (its index is on no node, and the remote has no copy): not corruption, the
    # walk goes on to step 3 (logged).
    down["now"] = True
    store.save(4, _train_state(model, opt, 4))
    dist.barrier()
    if rank == 1:
        shutil.rmtree(next(Path(local).glob("checkpoints/step-*4")))
    dist.barrier()
    logged = _load_logged(records, store, plains[3], mesh)
    assert any("step 4" in m and "on no rank's node" in m for m in logged), logged
    if rank == 0:  # the walk's coordinator decides and says so
        assert any("trying the next older step" in m for m in logged), logged
    down["now"] = False
    dist.barrier()

    # Node 1 damaged: its index of step 3 flipped (the same size). The local copy fails its
    # check on every rank and the remote copy stands in, bit-exact.
    if rank == 1:
        _flip_last_byte(local, "checkpoints/step-*3/*/rank-00001/index.msgpack")
    dist.barrier()
    logged = _load_logged(records, store, plains[3], mesh)
    assert any("using the remote copy of step 3" in m for m in logged), logged

    # Node 1 lost (a replaced node): its index and rank file come from the remote copy.
    dist.barrier()
    if rank == 1:
        shutil.rmtree(local)
    dist.barrier()
    assert_state_equal(_load_step(store, plains[2], mesh, 2), plains[2])
    store.close()
    return plains if rank == 0 else None


def test_per_rank_metadata_on_node_local_tiers(tmp_path: Path) -> None:
    root = str(tmp_path)
    plains = run_ranks(job_per_rank, 2, root, timeout=240)[0]
    remote = ckptfs.open(f"{root}/remote")
    assert remote.steps() == [1, 2, 3]
    for step in (1, 2, 3):
        info = remote.info(step)
        assert info.manifest.format_version == 5
        assert info.marker.writer.get("copied_from", "").startswith(f"{root}/node-0")
        assert remote.verify(step).ok
        assert_state_equal(remote.load(step), plains[step])  # 2 -> 1, bit-exact
    assert not list((Path(root) / "node-0").glob("checkpoints/*/*/rank-00001"))
