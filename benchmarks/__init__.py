"""Benchmark scripts, one per question; each is a thin entry point to :mod:`ckptfs.bench.cli`
(also reachable as ``ckptfs bench ...``).  ``python -m benchmarks.run_all`` regenerates
everything: the JSON in ``benchmarks/results/``, ``docs/benchmarks.md`` and ``docs/img/``."""
