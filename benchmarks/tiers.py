"""What does a second, remote tier cost a training job?  Blocking time of a tiered save
against a local-only one, replication against ``ckptfs cp``, and a training loop's throughput
and replication lag with no checkpoint, local-only and two tiers.

Usage: ``python -m benchmarks.tiers [--full] [options]`` (same as ``ckptfs bench tiers``; see
``--help``).  The default sizes take a few minutes on 2 cores; ``--full`` runs a 1 GiB
checkpoint."""

from __future__ import annotations

import sys

from benchmarks import REPO_OUTPUTS
from ckptfs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["tiers", *REPO_OUTPUTS, *sys.argv[1:]]))
