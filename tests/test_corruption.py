"""The corruption matrix (invariant 1): every file of a committed checkpoint damaged every way we
could think of; full verify and load(verify=True) detect all of it and name the file, quick
verify detects every size and inventory change.  On all six backends."""

from __future__ import annotations

from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability import corruption_matrix


def test_corruption_matrix(any_backend: Backend) -> None:
    sweep = corruption_matrix(any_backend)
    assert sweep.tried >= 50
    assert sweep.counters["detected"] == sweep.tried  # full verify: 100%, naming the file
    stray = sweep.counters["load_unaffected_by_stray"]
    assert sweep.counters["load_detected"] + stray == sweep.tried
    assert stray == 2  # a stray file does not change what load reads; verify reports it
    assert sweep.counters["quick_detected"] == sweep.counters["quick_tried"] >= 20
    assert sweep.counters["latest_raised"] + stray == sweep.tried  # no silent rollback
    if any_backend.protocol in ("file", "memory"):
        flips = sweep.counters["marker_flips"]
        assert flips == (sweep.counters["marker_flips_detected"]
                         + sweep.counters["marker_flips_harmless"])
    assert sweep.violations == []
