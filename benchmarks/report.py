"""Regenerate docs/benchmarks.md and docs/img/ from the JSON in benchmarks/results/.

Usage: ``python -m benchmarks.report [options]`` (same as ``ckptfs bench report [options]``; see
``--help``)."""

from __future__ import annotations

import sys

from benchmarks import REPO_OUTPUTS
from ckptfs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["report", *REPO_OUTPUTS, *sys.argv[1:]]))
