"""Hostile checkpoints (invariant 6: someone hands you a bucket).  Each planted with a valid
marker, as an attacker would: every one gives a typed error (UnsafeCheckpointError for paths,
links and extension types), no storage access outside the checkpoints, nothing written, nothing
executed, bounded memory.

Every hostile input goes through every reader: ``load`` (verified or not),
``ckptfs cp`` (which must refuse it with the same error and commit nothing at the destination)
and ``ckptfs inspect``; through the sub-storage of artifacts and the Lightning integration; and
restated for the sharded format (format v2), where it must get the error its v1 counterpart
gets, also from the in-place load (``load(into=...)``) on one rank and on two; and for the
incremental format (format v3), whose references to other attempts' files are the new attack
surface (paths, attempt names, chunk tables, sizes, the referenced header, the state's slots)."""

from __future__ import annotations

import tracemalloc
from typing import Any

import paths
import pytest

from ckptfs.errors import CorruptCheckpointError
from ckptfs.protocol.store import CheckpointStore
from ckptfs.testing.backend import Backend, unique_name
from ckptfs.testing.reliability import (
    HOSTILE_MEMORY_LIMIT,
    Planter,
    hostile_sweep,
    raw_storage,
    store_on,
)
from ckptfs.testing.reliability.hostile import REFUSING
from ckptfs.testing.reliability.hostile_v2 import (
    RANK_FILE,
    PlanterV2,
    hostile_v2_cases,
    hostile_v2_names,
)
from ckptfs.testing.reliability.hostile_v3 import (
    PlanterV3,
    hostile_v3_names,
    mismatched_v3_cases,
)


def _inspect(store: CheckpointStore, step: int) -> object:
    return paths.read("inspect", store, step)


def _into() -> dict[str, Any]:
    """A state dict shaped like the v2 donor's, to load into."""
    import torch

    from ckptfs.testing.reliability.hostile_v2 import donor_state

    into = donor_state()
    for group in ("model", "optimizer"):
        into[group] = {k: torch.zeros_like(v) for k, v in into[group].items()}
    return into


def _load_into(store: CheckpointStore, step: int) -> object:
    return store.load(step, into=_into())


#: Every reader that must refuse a hostile checkpoint (the sweep's own, and ckptfs inspect).
READERS = (*REFUSING, "inspect")
INSPECT = {"inspect": _inspect}
#: Format v2 also loads in place (``load(into=...)``, the collective load, on one rank).
V2_READERS = (*READERS, "load into")
V2_EXTRA = {**INSPECT, "load into": _load_into}


def _check(sweep: Any, *, cases: int) -> None:
    assert sweep.tried >= cases
    assert sweep.counters["UnsafeCheckpointError"] > 0
    assert sweep.counters["FormatVersionError"] > 0
    assert sweep.counters["peak_bytes_max"] < HOSTILE_MEMORY_LIMIT
    # every refusing reader ran on every case
    assert all(set(READERS) <= set(o) for o in sweep.outcomes.values())
    assert sweep.violations == []


@pytest.mark.parametrize("where", [
    "local", "memory",
    # the decoders are the same on every backend; the object stores add ~25 s each
    pytest.param("s3", marks=pytest.mark.slow), pytest.param("gcs", marks=pytest.mark.slow),
    pytest.param("azure", marks=pytest.mark.slow),
])
def test_hostile_checkpoints(where: str, request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    _check(hostile_sweep(backend, extra=INSPECT), cases=75)


@pytest.mark.parametrize("where", ["memory", pytest.param("local", marks=pytest.mark.slow)])
def test_hostile_checkpoints_through_a_sub_storage(where: str,
                                                   request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    _check(hostile_sweep(paths.SubBackend.of(backend), extra=INSPECT), cases=75)


# The planters here write format v1, v2 and v3 documents; format v5's (rank files, index
# documents, table blocks, the tensor spec, msgpack bombs, sizes beyond the limits) are planted
# by tests/reliability/test_hostile_v5.py on a two-rank save.


# -- format v2: one test per hostile input ----------------------------------------------------

_LOCAL_ONLY = {name for name, _ in hostile_v2_names(local=True)} - {
    name for name, _ in hostile_v2_names(local=False)}


def _v2_params() -> list[Any]:
    out = []
    for where in ("memory", "local"):
        for name, _ in hostile_v2_names(local=where == "local"):
            marks: list[Any] = []
            if where == "local" and name not in _LOCAL_ONLY:
                marks.append(pytest.mark.slow)  # the same decoders as on memory://
            out.append(pytest.param(where, name, id=f"{where}-{name}", marks=marks))
    return out


_PLANTERS: dict[str, PlanterV2] = {}


def _planter(where: str, tmp_path_factory: pytest.TempPathFactory) -> PlanterV2:
    """One donor (a v2 save) per backend for the whole module; each case plants its own step
    and the sweep deletes it afterwards."""
    if where not in _PLANTERS:
        url = (f"memory://{unique_name()}" if where == "memory"
               else f"file://{tmp_path_factory.mktemp('hostile-v2')}/{unique_name()}")
        _PLANTERS[where] = PlanterV2(Backend(where, url))
    return _PLANTERS[where]


@pytest.mark.sharded
@pytest.mark.parametrize(("where", "case"), _v2_params())
def test_hostile_sharded_checkpoint(where: str, case: str,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    pl = _planter(where, tmp_path_factory)
    sweep = hostile_sweep(pl.backend, fmt=2, only={case}, planter=pl, extra=V2_EXTRA)
    assert sweep.tried == 1 and set(V2_READERS) <= set(sweep.outcomes[case])
    assert sweep.violations == []


# -- format v3 (incremental): one test per hostile input -----------------------------------------

_LOCAL_ONLY_V3 = {name for name, _ in hostile_v3_names(local=True)} - {
    name for name, _ in hostile_v3_names(local=False)}


def _v3_params() -> list[Any]:
    out = []
    for where in ("memory", "local"):
        for name, _ in hostile_v3_names(local=where == "local"):
            marks: list[Any] = []
            if where == "local" and name not in _LOCAL_ONLY_V3:
                marks.append(pytest.mark.slow)  # the same decoders as on memory://
            out.append(pytest.param(where, name, id=f"{where}-{name}", marks=marks))
    return out


_PLANTERS_V3: dict[str, PlanterV3] = {}


def _planter_v3(where: str, tmp_path_factory: pytest.TempPathFactory) -> PlanterV3:
    """One donor run (step 0, and step 1 referencing it) per backend for the whole module."""
    if where not in _PLANTERS_V3:
        url = (f"memory://{unique_name()}" if where == "memory"
               else f"file://{tmp_path_factory.mktemp('hostile-v3')}/{unique_name()}")
        _PLANTERS_V3[where] = PlanterV3(Backend(where, url))
    return _PLANTERS_V3[where]


@pytest.mark.parametrize(("where", "case"), _v3_params())
def test_hostile_incremental_checkpoint(where: str, case: str,
                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    """load (verified or not), ``ckptfs cp`` and ``ckptfs inspect`` refuse it with the error
    of its kind, all the same class; full verify refuses it; nothing untyped, nothing read
    outside the checkpoints, nothing written, bounded memory."""
    pl = _planter_v3(where, tmp_path_factory)
    sweep = hostile_sweep(pl.backend, fmt=3, only={case}, planter=pl, extra=INSPECT)
    assert sweep.tried == 1 and set(READERS) <= set(sweep.outcomes[case])
    assert sweep.violations == []


@pytest.mark.slow  # the per-case test above runs each of these
def test_hostile_incremental_sweep_counts(memory_backend: Backend) -> None:
    """The whole v3 sweep in one run: both kinds of refusal occur, memory stays bounded."""
    sweep = hostile_sweep(memory_backend, fmt=3, extra=INSPECT)
    assert sweep.tried == len(hostile_v3_names(local=False)) >= 75
    assert sweep.counters["UnsafeCheckpointError"] > 0
    assert sweep.counters["CorruptCheckpointError"] > 0
    assert sweep.counters["peak_bytes_max"] < HOSTILE_MEMORY_LIMIT
    assert sweep.violations == []


_MISMATCHED = ["reference chunk digest is another chunk's",
               "reference header digest is another chunk's",
               "reference algorithm not the one its digests were made with"]


def _mismatch_params() -> list[Any]:
    """Every verifying reader on each case; ``ckptfs inspect`` checks headers, not tensor
    bytes (as for a v1 file), so only where the header or the algorithm is wrong."""
    out = []
    for case in _MISMATCHED:
        for reader in ("load", "verify", "cp", "inspect"):
            if reader == "inspect" and case == _MISMATCHED[0]:
                continue
            out.append(pytest.param(case, reader, id=f"{case}-{reader}"))
    return out


@pytest.mark.parametrize(("case", "reader"), _mismatch_params())
def test_incremental_reference_digest_mismatch(memory_backend: Backend, case: str,
                                               reader: str) -> None:
    """A reference whose digests do not match the bytes it binds: every verifying reader
    refuses it with CorruptCheckpointError (``load(verify=False)`` reads it as it reads a
    corrupted file: not a reader that checks digests)."""
    pl = PlanterV3(memory_backend)
    build = dict(mismatched_v3_cases(pl))[case]
    step = build()
    store = store_on(raw_storage(memory_backend))
    with pytest.raises(CorruptCheckpointError):
        paths.read(reader, store, step)


# -- sizes are checked before anything is allocated -------------------------------------------

def _declare(backend: Backend, fmt: int, declared: int) -> int:
    """A checkpoint whose tensor file is declared ``declared`` bytes (its digest, or its last
    chunk, consistent with that): only the size check can refuse it."""
    if fmt == 1:
        pl = Planter(backend)
        entries = pl.entries(pl.files)
        for e in entries:
            if e["path"].endswith(".safetensors"):
                e["size"] = declared
        return pl.plant(entries=entries)
    v2 = PlanterV2(backend)
    entries = v2.entries(v2.files)
    from ckptfs.format.sharded import Chunk, chunk_list_digest

    for e in entries:
        if e["path"] == RANK_FILE:
            e["chunks"][-1][1] += declared - e["size"]
            e["size"] = declared
            e["digest"] = chunk_list_digest(v2.algorithm, [Chunk(*c) for c in e["chunks"]])
    return v2.plant(entries=entries)


@pytest.mark.parametrize("reader", ["load", "cp"])
@pytest.mark.parametrize("fmt", [1, pytest.param(2, marks=pytest.mark.sharded)])
@pytest.mark.parametrize("declared", [1 << 30, 1 << 40, 1 << 50])
def test_declared_size_is_not_allocated(local_backend: Backend, declared: int, fmt: int,
                                        reader: str) -> None:
    """Regression: load allocated a buffer of the *declared* size before reading (8 GiB
    resident for a manifest declaring 8 GiB; a raw MemoryError for 1 TiB/1 PiB).  The copy and
    the sharded reader check the size from the listing first too."""
    step = _declare(local_backend, fmt, declared)
    store = store_on(raw_storage(local_backend))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="size differs from the manifest"):
            paths.read(reader, store, step)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024


@pytest.mark.sharded
@pytest.mark.parametrize("fmt", [1, 2, 3])
def test_a_refused_copy_commits_nothing_at_the_destination(memory_backend: Backend,
                                                           local_backend: Backend,
                                                           fmt: int) -> None:
    """ckptfs cp of a hostile source (a pickle where the state or value document belongs,
    digests valid; format v3: a referenced header declaring dtype PICKLE) into a run that has
    a checkpoint: the copy raises the error the load raises, the destination gets no marker
    for the step and no file, and its latest is still the previous checkpoint, which loads."""
    from ckptfs.protocol.copy import copy_step
    from ckptfs.testing.reliability import state_for
    from ckptfs.testing.reliability.hostile import hostile_cases
    from ckptfs.testing.reliability.hostile_v3 import hostile_v3_cases

    pl: Any = {1: Planter, 2: PlanterV2, 3: PlanterV3}[fmt](memory_backend)
    make: Any = {1: hostile_cases, 2: hostile_v2_cases, 3: hostile_v3_cases}[fmt]
    name = {1: "state.msgpack is a pickle", 2: "value document is a pickle",
            3: "referenced header dtype 'PICKLE' (digest valid)"}[fmt]
    build = next(b for n, b, _ in make(pl, "/nonexistent/sentinel", local=False) if n == name)
    step = build()
    src = memory_backend.open()
    with pytest.raises(CorruptCheckpointError) as loaded:
        src.load(step)
    dst = local_backend.open()
    dst.save(1, state_for(1))
    before = local_backend.raw_files()
    with pytest.raises(CorruptCheckpointError) as copied:
        copy_step(src.storage, dst.storage, step)
    assert type(copied.value) is type(loaded.value)
    paths.assert_not_committed(local_backend, step, 1, before)


# -- two ranks: a collective load of a hostile sharded checkpoint -----------------------------

def rank_load_into(rank: int, world: int, url: str, steps: dict[str, int]) -> dict[str, str]:
    """On each gloo rank: ``store.load(step, into=...)`` (collective) of each hostile step;
    the error class each raised, or "ok"."""
    import ckptfs

    store = ckptfs.open(url, retries=0)
    out = {}
    for name, step in steps.items():
        try:
            store.load(step, into=_into())
            out[name] = "ok"
        except Exception as exc:
            out[name] = type(exc).__name__
    return out


@pytest.mark.sharded
def test_two_ranks_refuse_hostile_sharded_checkpoints(local_backend: Backend,
                                                      tmp_path: Any) -> None:
    """One 2-rank gloo job loads (``load(into=...)``, collective) every hostile sharded
    checkpoint (local disk: the symbolic links included): every rank raises the error class a
    load in one process raises, which is the class the input's kind calls for."""
    from dist_util import run_ranks

    from ckptfs.testing.reliability.hostile import EXPECTED_ERRORS

    pl = PlanterV2(local_backend)
    cases = hostile_v2_cases(pl, str(tmp_path / "EXECUTED"), local=True)
    steps = {name: build() for name, build, _ in cases}
    store = store_on(raw_storage(local_backend))
    one: dict[str, str] = {}
    for name, _, expected in cases:
        with pytest.raises(EXPECTED_ERRORS[expected]) as raised:
            store.load(steps[name])
        one[name] = type(raised.value).__name__
    per_rank = run_ranks(rank_load_into, 2, local_backend.url, steps, timeout=400)
    wrong = [f"{name}: ranks raised {[r[name] for r in per_rank]}, one process raises "
             f"{want}" for name, want in one.items() if any(r[name] != want for r in per_rank)]
    assert wrong == [], "\n".join(wrong)
    assert not (tmp_path / "EXECUTED").exists()
