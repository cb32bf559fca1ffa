"""What every save and load costs a user on top of the bytes: the fixed costs (a tiny state's
save and load, a verified 64 MiB load, a fresh process's verified 1 GiB load, the in-place
sharded load at 2 ranks, each against DCP and ``torch.save``/``torch.load``, interleaved).

The measuring code is `ckptfs.bench.fixed` (its docstring says what is measured and how); this
script prints its results and writes only ``--json``.  ``ckptfs bench fixed`` runs the same
and writes ``results/fixed.json`` (``--report``: the "Fixed costs" section of
``benchmarks.md`` and its plot).

Usage: ``python -m benchmarks.fixed_costs [--parts tiny,load,fresh,inplace] [--quick]
[--tiny-rounds 40] [--load-size 64MiB] [--load-rounds 15] [--fresh-size 1GiB]
[--fresh-rounds 3] [--inplace-size 1GiB] [--inplace-rounds 3] [--inplace-loads 3]
[--skip-fresh] [--workdir DIR] [--json PATH]``.  The default run takes two to three minutes.
Ratios read "other time / ckptfs time": above 1, ckptfs is faster.  Another checkout is
measured with ``PYTHONPATH=<checkout> python -m benchmarks.fixed_costs``.
"""

from __future__ import annotations

import sys

from ckptfs.bench.cli import main_fixed_costs

if __name__ == "__main__":
    sys.exit(main_fixed_costs(sys.argv[1:]))
