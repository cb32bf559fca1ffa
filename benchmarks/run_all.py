"""Run every benchmark and regenerate docs/benchmarks.md and docs/img/ (one command).

Usage: ``python -m benchmarks.run_all [options]`` (same as ``ckptfs bench all``).  The full run
(hashing on 512 MiB; 1 GiB and 4 GiB states on local disk, 3 runs each; 1 GiB on moto, 2 runs;
latest up to 10,000 checkpoints) takes about 15 minutes on 2 cores;
``--sizes 256MiB --s3-sizes 64MiB --counts 10,100,1000 --hash-size 128MiB`` is a quicker look.
Add ``--note "..."`` to record, e.g., that other work was running on the machine."""

from __future__ import annotations

import sys

from benchmarks import REPO_OUTPUTS
from ckptfs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["all", *REPO_OUTPUTS, *sys.argv[1:]]))
