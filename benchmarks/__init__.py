"""Benchmark scripts, one per question; each is a thin entry point to `ckptfs.bench.cli`
(also reachable as ``ckptfs bench ...``).  ``python -m benchmarks.run_all`` regenerates
everything: the JSON in ``benchmarks/results/``, ``docs/benchmarks.md`` and ``docs/img/``.

``ckptfs bench`` writes where ``--out`` says (default: the current directory); these scripts
pass this repository's paths explicitly (a later ``--results``/``--docs`` on the command line
still wins)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
#: ``--results benchmarks/results --docs docs`` of this checkout.
REPO_OUTPUTS = ("--results", str(HERE / "results"), "--docs", str(HERE.parent / "docs"))
