"""What does a save/load to S3 (a moto server) cost next to raw s3fs pipe/cat of the same bytes?

Usage: ``python -m benchmarks.s3 [options]`` (same as ``ckptfs bench s3 [options]``; see
``--help``)."""

from __future__ import annotations

import sys

from benchmarks import REPO_OUTPUTS
from ckptfs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["s3", *REPO_OUTPUTS, *sys.argv[1:]]))
