"""What does a checkpoint save/load cost on local disk next to torch.save, safetensors and DCP?

Usage: ``python -m benchmarks.save_load [options]`` (same as ``ckptfs bench save [options]``; see
``--help``)."""

from __future__ import annotations

import sys

from benchmarks import REPO_OUTPUTS
from ckptfs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["save", *REPO_OUTPUTS, *sys.argv[1:]]))
