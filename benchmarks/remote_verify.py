"""``verify --remote`` of a checkpoint against a full verify on S3 (moto) and GCS (fake-gcs):
requests made, bytes read and time, side by side.

Usage: ``python -m benchmarks.remote_verify [--size 1GiB] [--backends s3,gcs]`` (same as
``ckptfs bench remote-verify``; see ``--help`` and :mod:`ckptfs.bench.remote_verify`)."""

from __future__ import annotations

import sys

from benchmarks import REPO_OUTPUTS
from ckptfs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["remote-verify", *REPO_OUTPUTS, *sys.argv[1:]]))
