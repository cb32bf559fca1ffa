"""How many storage requests and how long does resolving latest take with 10 to 10,000 checkpoints?

Usage: ``python -m benchmarks.latest [options]`` (same as ``ckptfs bench latest [options]``; see
``--help``)."""

from __future__ import annotations

import sys

from benchmarks import REPO_OUTPUTS
from ckptfs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["latest", *REPO_OUTPUTS, *sys.argv[1:]]))
