"""The corruption matrix (invariant 1): every file of a committed checkpoint damaged every way we
could think of; full verify and load(verify=True) detect all of it and name the file, quick
verify detects every size and inventory change.  On all six backends, and for a checkpoint
written by every write path (tests/paths.py): the sharded save on one rank and on two, the
async save, ``ckptfs cp``, the sub-storage, the incremental save (format v3: the damaged
checkpoint's model is read from a file of the older one, which is damaged too), and every other
cell of tests/paths.py (v4, the collective async saves, cp of v3 and v4, the remote copy of a
two-tier store for each layout, v4 on two ranks).  Each damage is also read through the
rollback reads (``load(allow_rollback=True)``, ``load(into=, allow_rollback=True)``, the
manager's ``restore_latest(allow_rollback=True)``): each must return the previous step."""

from __future__ import annotations

import paths
import pytest

from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability import Sweep, corruption_matrix
from ckptfs.testing.reliability.paths import rollback_reads

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
    # every damage of the newest step read through each rollback read (load, load(into=),
    # the manager's restore): the previous step, the newest unchanged where the damage is not
    # in what it reads (a stray file), a newer format refused; a typed error only when the
    # previous step is damaged too (the file the newest references)
    c = sweep.counters
    reads = len(rollback_reads(path or paths.V1))
    assert c["rollback_tried"] == reads * sweep.tried
    assert c["rollback_tried"] == sum(c.get(k, 0) for k in (
        "rollback_previous", "rollback_newest_intact", "rollback_newer_format",
        "rollback_raised"))
    assert c["rollback_previous"] >= c["rollback_tried"] // 2
    if path is None or not path.references:
        assert c.get("rollback_raised", 0) == 0
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


@pytest.mark.parametrize("path", paths.params(["v1", "v3"]))
def test_corruption_matrix_read_in_spans(local_backend: Backend, path: paths.WritePath,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The same matrix with every tensor file of more than 32 bytes read in spans of 16, 3 at
    a time (ckptfs/protocol/spans.py: a large file's spans are read by several threads and
    hashed in order; the sweeps' stores read on one thread): every damage detected and named
    as when a file is read in one stream."""
    from ckptfs.protocol import reader, spans

    reads: list[int] = []
    opened = spans.SpanReads.__enter__

    def counted(self: spans.SpanReads) -> spans.SpanReads:
        reads.append(len(self.spans))
        return opened(self)

    monkeypatch.setattr(spans, "SPAN_BYTES", 16)
    monkeypatch.setattr(reader, "windows_of", lambda sizes, threads: [3] * len(sizes))
    monkeypatch.setattr(spans.SpanReads, "__enter__", counted)
    check_matrix(corruption_matrix(local_backend, path=path), path.at(local_backend), path)
    assert reads and max(reads) > 2
