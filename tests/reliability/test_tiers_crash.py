"""Two tiers (docs/tiers.md): the replicator killed, or the remote cut off, at every mutating
call it makes at the remote tier; a remote outage while training saves; the local disk lost.
The sweeps live in :mod:`ckptfs.testing.reliability.tiers` (the figures command runs them:
docs/reliability.md, *Two tiers*).  Local disk and memory:// as the remote by default (S3 at a
few calls); every call on S3, GCS, Azure and ministack with ``--runslow``."""

from __future__ import annotations

import paths
import pytest
import torch

from ckptfs.errors import ReplicationError, UnreplicatedCheckpointError
from ckptfs.protocol.tiers import tiered
from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability.tiers import (
    FAST,
    sweep_local_loss,
    sweep_replication_crashes,
    sweep_replication_outage,
)

SERVERS = ["s3", "gcs", "azure", "ministack"]


def _params(default: set[tuple[str, str]]) -> list[object]:
    out: list[object] = []
    for where in ["memory", "local", *SERVERS]:
        for path in (paths.V1, paths.V3):
            slow = [] if (where, path.name) in default else [pytest.mark.slow]
            out.append(pytest.param(where, path, id=f"{where}-{path.name}", marks=slow))
    return out


@pytest.mark.parametrize(("where", "path"), _params({("memory", "v1"), ("memory", "v3"),
                                                     ("local", "v1"), ("local", "v3")}))
def test_replication_crash_and_outage_at_every_call(where: str, path: paths.WritePath,
                                                    local_backend: Backend,
                                                    request: pytest.FixtureRequest) -> None:
    """At every mutating call of one replication (v1; or an incremental step that references
    its replicated predecessor): killed, then a restart replicates it; the remote down from
    that call (before it, or after it took effect) for three attempts while a save goes on,
    then back; one lost answer.  The remote never holds a committed copy that differs or does
    not verify, a marker only after every byte, gc leaves exactly the committed files, and the
    replicator makes no mutating call on the local tier."""
    remote: Backend = request.getfixturevalue(f"{where}_backend")
    sweep = sweep_replication_crashes(remote, path=path, local=local_backend)
    assert sweep.violations == []
    n = sweep.counters["calls_per_replication"]
    assert n >= 5
    assert sweep.tried == 4 * n + 1  # crash, outage, outage-after, lost answer; crash-after
    assert sweep.counters["crash_points"] == n + 1
    assert sweep.counters["recovered"] == sweep.tried
    assert sweep.counters["local_calls_per_replication"] == 0
    assert sweep.counters["committed_at_fault"] >= 2  # crash-after and outage-after the marker
    assert sweep.counters["leaked_attempts_collected"] >= n
    assert "leaked_files_left" not in sweep.counters
    if path.references:
        assert sweep.counters["references_per_copy"] >= 1
        assert sweep.counters["with_references"] >= sweep.tried


def test_replication_crash_on_s3_at_a_few_calls(s3_backend: Backend,
                                                local_backend: Backend) -> None:
    """The default run's S3 sample: the first call, the marker and just after it (every call:
    the ``s3-*`` cases with --runslow)."""
    sweep = sweep_replication_crashes(s3_backend, local=local_backend, outages=False,
                                      points=lambda n, marker: [1, marker])
    assert sweep.violations == []
    assert sweep.tried == 3 and sweep.counters["recovered"] == 3
    assert sweep.counters["committed_at_fault"] == 1


@pytest.mark.parametrize("where", ["memory", "local"])
def test_replication_crash_with_parallel_copies(where: str, local_backend: Backend,
                                                request: pytest.FixtureRequest) -> None:
    """Two files copied at once: the kill hits whichever thread makes the k-th call."""
    remote: Backend = request.getfixturevalue(f"{where}_backend")
    sweep = sweep_replication_crashes(remote, threads=2, outages=False, local=local_backend)
    assert sweep.violations == []
    assert sweep.tried == sweep.counters["calls_per_replication"] + 1


@pytest.mark.parametrize("where", ["memory", "local", pytest.param("s3", marks=pytest.mark.slow),
                                   pytest.param("gcs", marks=pytest.mark.slow),
                                   pytest.param("azure", marks=pytest.mark.slow)])
def test_remote_outage_while_training(where: str, local_backend: Backend,
                                      request: pytest.FixtureRequest) -> None:
    """Five incremental saves with keep_last=2 while the remote is down: each save returns,
    the lag grows and is logged, retention holds all five; after recovery catch-up is oldest
    first (each step referencing the previous one at the remote), then retention prunes to
    two.  With delete_unreplicated=True retention wins and only the last two reach the
    remote."""
    remote: Backend = request.getfixturevalue(f"{where}_backend")
    sweep = sweep_replication_outage(remote, local=local_backend)
    assert sweep.violations == []
    assert sweep.tried == 2 and sweep.counters["caught_up"] == 5
    assert sweep.counters["remote_calls_refused"] >= 1
    assert sweep.counters["lag_warnings"] >= 5


@pytest.mark.parametrize("where", ["memory", "local", pytest.param("s3", marks=pytest.mark.slow),
                                   pytest.param("gcs", marks=pytest.mark.slow),
                                   pytest.param("azure", marks=pytest.mark.slow)])
def test_local_disk_loss_then_resume_from_remote(where: str, local_backend: Backend,
                                                 request: pytest.FixtureRequest) -> None:
    """The local directory removed: an incremental chain resumes from the remote bit-exactly
    (its copies reference the remote's own attempts) and the next save is replicated with
    references; steps that never reached the remote are gone with the disk and the newest
    replicated one is resumed; a replicator killed before its marker leaves an attempt that
    gc collects."""
    remote: Backend = request.getfixturevalue(f"{where}_backend")
    sweep = sweep_local_loss(remote, local=local_backend)
    assert sweep.violations == []
    assert sweep.tried == sweep.counters["resumed"] == 3
    assert sweep.counters["remote_references"] >= 3
    assert sweep.counters["leaked_attempts_collected"] >= 1


def test_a_remote_step_with_other_content_is_not_replicated(local_backend: Backend,
                                                            memory_backend: Backend) -> None:
    """Opening a tiered store must not count a local step as replicated because the remote has
    a marker for that step number: the remote's step may be another checkpoint (another run,
    or this run before a rollback).  It was marked ``replicated`` at open, so ``delete`` and
    retention removed the local copy, the only one of that checkpoint."""
    local_backend.open().save(1, {"mine": torch.ones(3)})
    memory_backend.open().save(1, {"other": torch.zeros(3)})
    store = tiered(local_backend.open(), memory_backend.open(), max_attempts=1, **FAST)
    assert 1 in store.holds
    with pytest.raises(UnreplicatedCheckpointError):
        store.delete(1)
    with pytest.raises(ReplicationError, match="step 1: CheckpointExistsError"):
        store.wait_replicated(timeout=60)
    assert store.replication().state(1) == "failed"
    assert local_backend.open().steps() == [1]
    store.close()
    # the same content at the remote (a copy): replicated at open, without copying again
    other = local_backend.sibling()
    other.open().save(1, {"other": torch.zeros(3)})
    again = tiered(other.open(), memory_backend.open(), **FAST)
    status = again.replication()
    assert status.state(1) == "replicated" and status.steps[1].attempts == 0
    again.close()
