#!/usr/bin/env bash
# The demo, from nothing: set-up (idempotent), then a small training run that checkpoints with
# ckptfs, is killed in the middle of a save, and resumes from the latest committed checkpoint.
# Extra arguments go to the demo (e.g. --root s3://bucket/demo -o endpoint_url=...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m ckptfs.cli.demo "$@"
