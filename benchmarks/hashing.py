"""How fast is each hash algorithm, through ckptfs's hasher and the raw library?

Usage: ``python -m benchmarks.hashing [options]`` (same as ``ckptfs bench hash [options]``; see
``--help``)."""

from __future__ import annotations

import sys

from benchmarks import REPO_OUTPUTS
from ckptfs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["hash", *REPO_OUTPUTS, *sys.argv[1:]]))
