"""How long does a checkpoint block training with ``store.save_async``, against the synchronous
durable save, a plain ``clone()``, and ``torch.distributed.checkpoint.async_save``?

Usage: ``python -m benchmarks.async_save [options]`` (same as
``python -m ckptfs.bench.async_save [options]``; see ``--help``, and docs/async.md)."""

from __future__ import annotations

import sys

from ckptfs.bench.async_save import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
