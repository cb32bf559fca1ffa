"""What does an incremental save (format v3) write and cost next to a full save and DCP?
LoRA-like, RL-like and full fine-tuning states side by side, 100 saves with keep_last=5, the
LoRA case to S3 (moto), and a fresh process's first incremental save.

Usage: ``python -m benchmarks.incremental [--full] [options]`` (same as ``ckptfs bench
incremental``; see ``--help``).  The default sizes take a few minutes on 2 cores; ``--full``
runs the issue's sizes (1 GiB)."""

from __future__ import annotations

import sys

from benchmarks import REPO_OUTPUTS
from ckptfs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["incremental", *REPO_OUTPUTS, *sys.argv[1:]]))
