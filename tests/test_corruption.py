"""The corruption matrix (invariant 1): every file of a committed checkpoint damaged every way we
could think of; full verify and load(verify=True) detect all of it and name the file, quick
verify detects every size and inventory change.  On all six backends, and for a checkpoint
written by every write path (tests/paths.py): the sharded save on one rank and on two, the
async save, ``ckptfs cp``, the sub-storage, the incremental save (format v3: the damaged
checkpoint's model is read from a file of the older one, which is damaged too), and every other
cell of tests/paths.py (v4, the collective async saves, cp of v3 and v4, the remote copy of a
two-tier store, v4 on two ranks)."""

from __future__ import annotations

import paths
import pytest

from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability import Sweep, corruption_matrix

#: Per cell: (the known defect, the phrases of the violations it causes).  None now.
KNOWN: dict[str, tuple[str, list[str]]] = {}


def check_matrix(sweep: Sweep, backend: Backend, path: paths.WritePath | None = None) -> None:
    paths.check_violations(sweep.violations,
                           KNOWN[path.name][1] if path is not None and path.name in KNOWN
                           else ())
    if path is not None and path.references:  # and the file it references was damaged
        assert sweep.counters["referenced_files"] >= 1
    assert sweep.tried >= 35
    assert sweep.counters["detected"] == sweep.tried  # full verify: 100%, naming the file
    stray = sweep.counters["load_unaffected_by_stray"]
    assert sweep.counters["load_detected"] + stray == sweep.tried
    assert stray == 2  # a stray file does not change what load reads; verify reports it
    assert sweep.counters["quick_detected"] == sweep.counters["quick_tried"] >= 14
    assert sweep.counters["latest_raised"] + stray == sweep.tried  # no silent rollback
    if backend.protocol in ("file", "memory"):
        flips = sweep.counters["marker_flips"]
        assert flips == (sweep.counters["marker_flips_detected"]
                         + sweep.counters["marker_flips_harmless"])
    assert sweep.violations == []


def test_corruption_matrix(any_backend: Backend) -> None:
    sweep = corruption_matrix(any_backend)
    assert sweep.tried >= 50 and sweep.counters["quick_tried"] >= 20
    check_matrix(sweep, any_backend)


def _matrix_params() -> list[object]:
    """Every path on memory:// (local disk and S3 with --runslow); two ranks on local disk only
    (memory:// is per process)."""
    names = [n for n in paths.EVERY if n != "v1"]  # v1: test_corruption_matrix
    out: list[object] = []
    for where in ("memory", "local", "s3"):
        for p in paths.params(names + (paths.RANKS if where == "local" else []),
                              slow=[] if where == "memory" else names, sweep=True,
                              xfail={n: reason for n, (reason, _) in KNOWN.items()}):
            out.append(pytest.param(where, *p.values, marks=p.marks,
                                    id=f"{where}-{p.id}"))
    return out


@pytest.mark.parametrize(("where", "path"), _matrix_params())
def test_corruption_matrix_on_every_path(where: str, path: paths.WritePath,
                                         request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue(f"{where}_backend")
    check_matrix(corruption_matrix(backend, path=path), path.at(backend), path)
