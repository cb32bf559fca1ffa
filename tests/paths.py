"""The write and read paths every hardening test runs through (issue 16, part 7).

Write paths (:class:`WritePath`, ``path.save(store, step, state, metadata=)``): ``v1``
(``store.save``), ``v2`` (the collective save on one rank: ``dcp.save(no_dist=True)`` through
ckptfs's DCP writer), ``v2x2`` (the same on two gloo ranks, local disk only: slow, few cases),
``async`` (``save_async(...).result()``), ``cp`` / ``cp-v2`` (a save into a scratch root, then
``ckptfs cp``'s ``copy_step``), ``v3`` (an incremental store's save of a state whose model is
frozen: ``path.state(step)``; each save after the first has references), ``sub``
(``store.save`` through the sub-storage of artifacts and the Lightning integration;
``path.at(backend)`` is then the sub-storage view of the backend).
The in-process ones live in :mod:`ckptfs.testing.reliability.paths` (the sweeps use them too).

Read paths (:func:`read`): ``load``, ``load-unverified``, ``verify``, ``verify-quick``,
``inspect`` (``ckptfs inspect``'s reader) and ``cp`` (``copy_step`` into a fresh root, which
must commit nothing when it refuses: :func:`copy_into_scratch`).

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
    CP,
    CP_V2,
    SUB,
    V1,
    V2,
    V3,
    WRITE_PATHS,
    SubBackend,
    WritePath,
)

__all__ = ["ASYNC", "CP", "CP_V2", "PATHS", "SUB", "V1", "V2", "V2X2", "V3", "KnownDefect",
           "SubBackend", "WritePath", "assert_not_committed", "check_violations",
           "copy_into_scratch", "known_defect", "params", "read"]


# -- two ranks ---------------------------------------------------------------------------------


def rank_save(rank: int, world: int, url: str, saves: list[tuple[int, Any, Any]]
              ) -> list[tuple[str, str] | None]:
    """On each gloo rank: ``store.save(step, state, metadata=)`` (collective: format v2) for
    each ``(step, state, metadata)``; ``state`` may be a list with one state per rank.  Returns,
    per save, ``None`` or (error class, message)."""
    import ckptfs

    out: list[tuple[str, str] | None] = []
    store = ckptfs.open(url, retries=0)
    for step, state, metadata in saves:
        mine = state[rank] if isinstance(state, list) else state
        try:
            store.save(step, mine, metadata=metadata)
            out.append(None)
        except Exception as exc:
            out.append((type(exc).__name__, str(exc)))
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
              timeout: float = 240) -> list[tuple[str, str] | None]:
    """:func:`rank_save` on ``world`` ranks; per save, the outcome every rank agrees on (an
    :class:`AssertionError` when the ranks disagree about the error class)."""
    try:
        results = run_ranks(rank_save, world, url, saves, timeout=timeout)
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
    local disk only (``memory://`` is per process)."""

    world: int = 2

    def save(self, store: CheckpointStore, step: int, state: Mapping[str, Any], *,
             metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
        (outcome,) = run_saves(store.url, [(step, dict(state), metadata)], self.world)
        if outcome is not None:
            raise reraise(*outcome)
        return read_committed(store.storage, step)


V2X2 = RanksPath("v2x2", 2)

#: Every write path, by name.
PATHS: dict[str, WritePath] = {**WRITE_PATHS, V2X2.name: V2X2}


class KnownDefect(AssertionError):
    """Raised by a sweep test when every violation it saw is one of the known defects of its
    path (:func:`check_violations`); the xfail marks of those paths expect exactly this, so
    any other failure still fails the test."""


def known_defect(reason: str, *, sweep: bool = True) -> Any:
    """The strict xfail of a known defect (``sweep``: only a :class:`KnownDefect` counts)."""
    return pytest.mark.xfail(strict=True, raises=KnownDefect if sweep else None,
                             reason=f"issue 16: {reason}")


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
        if name in slow or name == V2X2.name:
            marks.append(pytest.mark.slow)
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


READS = ("load", "load-unverified", "verify", "verify-quick", "inspect", "cp")


def read(name: str, store: CheckpointStore, step: int) -> Any:
    """Read ``step`` of ``store`` through the read path ``name``."""
    if name == "load":
        return store.load(step)
    if name == "load-unverified":
        return store.load(step, verify=False)
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
