"""The write and read paths every hardening test runs through: the matrix's cells.

Write paths (:class:`WritePath`, ``path.save(store, step, state, metadata=)``), the matrix's
cells: ``v1`` (``store.save``), ``v2`` (the collective save on one rank:
``dcp.save(no_dist=True)`` through ckptfs's DCP writer), ``v3`` (an incremental store's save of
a state whose model is frozen: ``path.state(step)``; each save after the first has references),
``v4`` (the collective save on one rank of an incremental store, its reuse memory kept between
the saves of a run root), ``async`` (``save_async(...).result()``), ``async-v3`` (the same on
an incremental store: format v3), ``async-v2`` / ``async-v4``
(``save_async`` of DTensors on a one-rank mesh under a one-rank gloo group: the collective
async save, plain and incremental), ``async-v2s`` (``save_async`` of a store of
``layout="ranks"`` streamed through a staging budget the state exceeds: several rank files),
``async-v3s`` (``save_async`` of an incremental store through such a budget: its reuse decided
before the call returns, only the tensors it writes streamed), ``cp`` / ``cp-v2`` (a save into
a scratch root, then ``ckptfs cp``'s ``copy_step``), ``cp-v3`` / ``cp-v4`` (the same from an
incremental source kept for the run root, so that copies reference earlier copies),
``replica-v1`` / ``replica-v3`` (the remote copy of a two-tier store:
``ckptfs.tiered(local, store)``, ``save``, ``wait_replicated``; the store under test is the
remote tier), ``replica-v2`` / ``replica-v4``
(the same for the collective save under a one-rank process group: a sharded step replicated,
plain and incremental), ``sub`` (``store.save`` through
the sub-storage of artifacts and the Lightning integration; ``path.at(backend)`` is then the
sub-storage view of the backend), ``v5`` (the collective save on one rank of a store opened
with ``metadata_layout="per-rank"``: format v5, whose rank files and index documents are
found through the table, not listed in the manifest), ``async-v5`` / ``cp-v5`` /
``replica-v5`` (``save_async``, ``ckptfs cp`` and the two-tier remote copy of such a
checkpoint), ``v2x2`` / ``v4x2`` / ``v5x2`` (the collective
save on two gloo ranks, plain, incremental and with per-rank metadata, local disk only: slow),
``replica-v5x2`` (the remote copy of a two-tier store on two gloo ranks with per-rank metadata,
each rank's local tier its own directory, its "node's disk": the replica copies each node's
files from that node).
The in-process ones live in :mod:`ckptfs.testing.reliability.paths` (the sweeps use them too).
:data:`EVERY` names the in-process cells, :data:`RANKS` the two-rank ones.

Read paths (:func:`read`): ``load``, ``load-unverified``, ``load-into`` (``load(into=)`` of
zero tensors of the state's shapes), ``verify``, ``verify-quick``, ``inspect`` (``ckptfs
inspect``'s reader) and ``cp`` (``copy_step`` into a fresh root, which must commit nothing
when it refuses: :func:`copy_into_scratch`).  ``load(into=, allow_rollback=True)``, the
manager's restore of an incremental run: tests/reliability/test_hardening_read.py.  The
rollback reads (``load(allow_rollback=True)``, ``load(into=, allow_rollback=True)`` on the
sharded cells, the manager's ``restore_latest(allow_rollback=True)``:
:data:`ckptfs.testing.reliability.paths.ROLLBACK_READS`) run in the corruption matrix on every
cell (tests/reliability/test_corruption.py): each damage of the newest step rolls back to the
previous one.

Known defects (:data:`DEFECTS`): a cell that breaks a hardening test is marked there with
:func:`known_defect` (strict: the mark fails once the defect is fixed, and is then removed).

:func:`params` turns path names into pytest parameters, with the known defects of a path
marked ``xfail(strict=True)`` (each with the defect, for the engineer who owns that path) and
the slow ones marked ``slow`` (``--runslow``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from dist_util import RankFailure, run_ranks

import ckptfs.errors
from ckptfs.errors import CkptfsError
from ckptfs.format.layout import StepPaths
from ckptfs.protocol.resolve import CheckpointInfo, read_committed
from ckptfs.protocol.store import CheckpointStore
from ckptfs.storage.fsspec import FsspecStorage
from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability.paths import (
    ASYNC,
    ASYNC_V2,
    ASYNC_V2S,
    ASYNC_V3,
    ASYNC_V3S,
    ASYNC_V4,
    ASYNC_V5,
    CP,
    CP_V2,
    CP_V3,
    CP_V4,
    CP_V5,
    REPLICA_V1,
    REPLICA_V2,
    REPLICA_V3,
    REPLICA_V4,
    REPLICA_V5,
    SUB,
    V1,
    V2,
    V3,
    V4,
    V5,
    WRITE_PATHS,
    SubBackend,
    WritePath,
)

__all__ = [
    "ASYNC",
    "ASYNC_V2",
    "ASYNC_V2S",
    "ASYNC_V3",
    "ASYNC_V3S",
    "ASYNC_V4",
    "ASYNC_V5",
    "CP",
    "CP_V2",
    "CP_V3",
    "CP_V4",
    "CP_V5",
    "DEFECTS",
    "EVERY",
    "PATHS",
    "RANKS",
    "REPLICAS",
    "REPLICA_V1",
    "REPLICA_V2",
    "REPLICA_V3",
    "REPLICA_V4",
    "REPLICA_V5",
    "REPLICA_V5X2",
    "SUB",
    "V1",
    "V2",
    "V2X2",
    "V3",
    "V4",
    "V4X2",
    "V5",
    "V5X2",
    "KnownDefect",
    "SubBackend",
    "WritePath",
    "assert_not_committed",
    "check_violations",
    "copy_into_scratch",
    "every_file",
    "known_defect",
    "params",
    "read",
    "reads_of",
]


# -- two ranks ---------------------------------------------------------------------------------


def rank_save(rank: int, world: int, url: str, saves: list[tuple[int, Any, Any]],
              incremental: bool = False, per_rank: bool = False, nodes: str | None = None
              ) -> list[tuple[str, str] | None]:
    """On each gloo rank: ``store.save(step, state, metadata=)`` (collective: format v2; v4
    with ``incremental``; v5 with ``per_rank``) for each ``(step, state, metadata)``;
    ``state`` may be a list with one state per rank.  ``nodes``: the save goes to a two-tier
    store whose local tier is each rank's own directory under ``nodes`` (its "node's disk")
    and whose remote tier is ``url``, and is replicated there before the outcome.  Returns,
    per save, ``None`` or (error class, message)."""
    import ckptfs

    out: list[tuple[str, str] | None] = []
    layout = "per-rank" if per_rank else None
    if nodes is None:
        store = ckptfs.open(url, retries=0, incremental=incremental, metadata_layout=layout)
    else:
        store = ckptfs.tiered(ckptfs.open(f"{nodes}/node-{rank}", retries=0,
                                          incremental=incremental, metadata_layout=layout),
                              ckptfs.open(url, retries=0), max_attempts=1)
    try:
        for step, state, metadata in saves:
            mine = state[rank] if isinstance(state, list) else state
            try:
                store.save(step, mine, metadata=metadata)
                if nodes is not None:
                    store.wait_replicated(timeout=120)
                out.append(None)
            except Exception as exc:
                out.append((type(exc).__name__, str(exc)))
    finally:
        store.close()
    return out


def reraise(name: str, message: str) -> BaseException:
    """The ckptfs error ``name`` raised on the ranks, rebuilt here (message kept)."""
    cls = getattr(ckptfs.errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, CkptfsError)):
        return AssertionError(f"the ranks raised untyped {name}: {message}")
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    return exc


def run_saves(url: str, saves: list[tuple[int, Any, Any]], world: int = 2,
              timeout: float = 240, incremental: bool = False, per_rank: bool = False,
              nodes: str | None = None) -> list[tuple[str, str] | None]:
    """:func:`rank_save` on ``world`` ranks; per save, the outcome every rank agrees on (an
    :class:`AssertionError` when the ranks disagree about the error class)."""
    try:
        results = run_ranks(rank_save, world, url, saves, incremental, per_rank, nodes,
                            timeout=timeout)
    except RankFailure as exc:  # a rank died outside store.save
        raise AssertionError(str(exc)) from None
    agreed: list[tuple[str, str] | None] = []
    for i, per_rank in enumerate(zip(*results, strict=True)):
        kinds = {None if r is None else r[0] for r in per_rank}
        if len(kinds) != 1:
            raise AssertionError(f"save {i} (step {saves[i][0]}): the ranks disagree: "
                                 f"{list(per_rank)}")
        agreed.append(per_rank[0])
    return agreed


@dataclass(frozen=True)
class RanksPath(WritePath):
    """The collective save on ``world`` gloo ranks (processes), each opening the store's URL:
    local disk only (``memory://`` is per process).  Format v4 (``references``): the store is
    incremental; each save is a fresh pair of processes, so a save references what an earlier
    one wrote only as a resumed job's first save does."""

    world: int = 2
    #: The two-tier store's remote copy: each rank saves to its own node's directory (kept
    #: for the run root under test, so each save replicates after the earlier ones), the
    #: store under test is the remote tier.
    replica: bool = False

    def save(self, store: CheckpointStore, step: int, state: Mapping[str, Any], *,
             metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
        nodes = _nodes_for(store.url) if self.replica else None
        (outcome,) = run_saves(store.url, [(step, dict(state), metadata)], self.world,
                               incremental=self.references, per_rank=self.format_version == 5,
                               nodes=nodes)
        if outcome is not None:
            raise reraise(*outcome)
        return read_committed(store.storage, step)


_NODES: dict[str, str] = {}


def _nodes_for(url: str) -> str:
    """The directory holding each rank's local tier for the run root ``url`` (one per run
    root, kept for the session)."""
    import atexit
    import shutil
    import tempfile

    if url not in _NODES:
        _NODES[url] = tempfile.mkdtemp(prefix="ckptfs-nodes-")
        atexit.register(shutil.rmtree, _NODES[url], True)  # removed when the worker exits
    return _NODES[url]


V2X2 = RanksPath("v2x2", 2)
V4X2 = RanksPath("v4x2", 4, references=True)
V5X2 = RanksPath("v5x2", 5)
REPLICA_V5X2 = RanksPath("replica-v5x2", 5, replica=True)

#: Every write path, by name.
PATHS: dict[str, WritePath] = {**WRITE_PATHS, **{p.name: p for p in (V2X2, V4X2, V5X2,
                                                                        REPLICA_V5X2)}}
#: The in-process cells (every hardening test runs through these), the two-rank ones (slow:
#: local disk only) and the two-tier remote copies (few cases by default).
EVERY: list[str] = list(WRITE_PATHS)
RANKS: list[str] = [V2X2.name, V4X2.name, V5X2.name, REPLICA_V5X2.name]
REPLICAS: list[str] = [REPLICA_V1.name, REPLICA_V3.name, REPLICA_V2.name, REPLICA_V4.name,
                       REPLICA_V5.name]

#: The defects a cell shows in the hardening tests (known; the strict xfail marks name them).
DEFECTS = {
}


class KnownDefect(AssertionError):
    """Raised by a sweep test when every violation it saw is one of the known defects of its
    path (:func:`check_violations`); the xfail marks of those paths expect exactly this, so
    any other failure still fails the test."""


def known_defect(reason: str, *, sweep: bool = True, strict: bool = True) -> Any:
    """The strict xfail of a known defect (``sweep``: only a :class:`KnownDefect` counts).
    ``strict=False`` only for a defect another one hides today (the cell shows it once that
    one is fixed)."""
    return pytest.mark.xfail(strict=strict, raises=KnownDefect if sweep else None,
                             reason=f"known defect: {reason}")


def check_violations(violations: list[str], known: Iterable[str] = ()) -> None:
    """No violation but those containing one of the ``known`` phrases; those raise
    :class:`KnownDefect` (the test is marked with :func:`known_defect`)."""
    phrases = list(known)
    unknown = [v for v in violations if not any(k in v for k in phrases)]
    assert unknown == [], "\n".join(unknown)
    if violations:
        raise KnownDefect("\n".join(violations[:20]))


def params(names: Iterable[str], *, xfail: Mapping[str, str] | None = None,
           slow: Iterable[str] = (), sweep: bool = False) -> list[Any]:
    """pytest parameters for the write paths ``names`` (ids: the names): a name in ``xfail``
    is a known defect of that path (strict: the test fails once it is fixed, so the mark is
    removed; ``sweep``: only a :class:`KnownDefect` counts), a name in ``slow`` runs with
    ``--runslow``."""
    xfail = dict(xfail or {})
    slow = set(slow)
    out = []
    for name in names:
        marks: list[Any] = []
        if name in xfail:
            marks.append(known_defect(xfail[name], sweep=sweep))
        if name in slow or name in RANKS:
            marks.append(pytest.mark.slow)
        if PATHS[name].sharded:
            marks.append(pytest.mark.sharded)
        out.append(pytest.param(PATHS[name], id=name, marks=marks))
    return out


# -- reading -----------------------------------------------------------------------------------


def copy_into_scratch(store: CheckpointStore, step: int) -> CheckpointStore:
    """``ckptfs cp`` of ``step`` into a fresh ``memory://`` root; when it raises, the scratch
    root must hold no marker for the step and no file (the refused copy committed nothing,
    and left nothing behind)."""
    from ckptfs.protocol.copy import copy_step

    dst = CheckpointStore(FsspecStorage(f"memory://scratch-{uuid.uuid4().hex[:12]}"))
    try:
        copy_step(store.storage, dst.storage, step, threads=1)
    except BaseException:
        assert not dst.storage.exists(StepPaths(step).marker), "the refused copy committed"
        left = [e.name for e in dst.storage.list_tree("")] if dst.storage.exists("") else []
        assert left == [], f"the refused copy left files behind: {left}"
        raise
    return dst


READS = ("load", "load-unverified", "load-into", "verify", "verify-quick", "inspect", "cp")


def reads_of(path: WritePath) -> tuple[str, ...]:
    """The read paths of a checkpoint of ``path``: ``load-into`` fills a state from a sharded
    checkpoint only (format v2, v4, v5; a single-process one is refused: docs/sharded.md)."""
    from ckptfs.format.features import FEATURES, SHARDED

    return READS if SHARDED in FEATURES[path.format_version] else tuple(
        r for r in READS if r != "load-into")


def every_file(store: CheckpointStore, info: CheckpointInfo) -> CheckpointInfo:
    """``info`` with every file the checkpoint holds in its manifest's ``files``: a checkpoint
    with the ``rank-metadata`` feature (format v5) lists only its tensor spec and table
    blocks, its rank files and index documents are found through the table (read and
    checked: the checkpoint must be intact)."""
    from ckptfs.format.versions import has_rank_metadata
    from ckptfs.protocol.rank_metadata import expand

    return expand(store.storage, info) if has_rank_metadata(info.manifest) else info


def zeros_of(value: Any) -> Any:
    """``value`` with every tensor replaced by zeros of its dtype and shape (a load target)."""
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: zeros_of(v) for k, v in value.items()}
    return value


def into_target() -> dict[str, Any]:
    """The tensors of the sweeps' state (every step's have the same shapes), as zeros: what
    ``load(into=)`` fills."""
    from ckptfs.testing.reliability.common import state_for

    state = state_for(0)
    return {k: zeros_of(state[k]) for k in ("model", "optimizer")}


def read(name: str, store: CheckpointStore, step: int) -> Any:
    """Read ``step`` of ``store`` through the read path ``name``."""
    if name == "load":
        return store.load(step)
    if name == "load-unverified":
        return store.load(step, verify=False)
    if name == "load-into":
        into = into_target()
        store.load(step, into=into)
        return into
    if name == "verify":
        return store.verify(step)
    if name == "verify-quick":
        return store.verify(step, quick=True)
    if name == "inspect":
        from ckptfs.cli.inspection import inspect_info

        return inspect_info(store, store.info(step))
    if name == "cp":
        return copy_into_scratch(store, step)
    raise ValueError(name)


def assert_not_committed(backend: Backend, step: int, previous: int | None,
                         before: Mapping[str, int] | None = None) -> None:
    """After a refused save or copy: no marker for ``step``, the latest is ``previous`` and it
    loads, and (``before``: the backend's files before the refused save) nothing else was left
    on storage."""
    store = backend.open()
    assert not backend.raw_exists(StepPaths(step).marker), f"a marker exists for step {step}"
    latest = store.latest()
    assert (None if latest is None else latest.step) == previous
    if previous is not None:
        store.load(previous)
    if before is not None:
        left = sorted(set(backend.raw_files()) - set(before))
        assert left == [], f"the refused save left files behind: {left[:5]}"
