"""What does a new process pay for its first checkpoint save and load (import + first call), and
what does a save cost in the steady state, next to DCP and torch.save, and next to another
checkout of ckptfs (``--baseline PATH``, e.g. a worktree of the previous commit)?

Usage: ``python -m benchmarks.fresh_process [--fresh-size 1GiB] [--fresh-rounds 3]
[--baseline ../ckptfs-prev]`` (same as ``ckptfs bench fresh``)."""

from __future__ import annotations

import sys

from benchmarks import REPO_OUTPUTS
from ckptfs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["fresh", *REPO_OUTPUTS, *sys.argv[1:]]))
