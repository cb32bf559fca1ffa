"""Sharded saves and loads (format v2) against DCP's FileSystemWriter/Reader: a 2-rank durable
save of an FSDP2 model with AdamW states, a resharded 2 -> 1 load, 1/2/4 ranks, and the cost
figures behind the 1,000-rank estimate (docs/benchmarks.md, "Sharded checkpoints").

Usage: ``python -m benchmarks.sharded [--size 1GiB] [--reps 3] [--worlds 1,2,4] ...`` (see
``--help``)."""

from __future__ import annotations

import sys

from benchmarks import HERE
from ckptfs.bench.sharded import main

REPO_OUTPUTS = ("--json", str(HERE / "results" / "sharded.json"),
                "--plot", str(HERE.parent / "docs" / "img" / "sharded_save_load.png"))

if __name__ == "__main__":
    sys.exit(main([*REPO_OUTPUTS, *sys.argv[1:]]))
