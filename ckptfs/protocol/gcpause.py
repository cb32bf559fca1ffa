"""`paused_collector`: Python's cyclic garbage collector paused around the sharded save
coordinator's heavy construction.

The coordinator of a save at thousands of ranks builds millions of small objects in one go
(DCP's write items of every rank, the global ``Metadata`` with one chunk per shard, the
manifest's chunk lists).  Each allocation counts towards the collector's thresholds, so the
construction sets off full (generation 2) collections, and every one of them walks the whole
heap, those millions of objects included: about half of the coordinator's time at 4,096
ranks.  None of these objects is part of a reference cycle, they are freed by reference
counting when the save drops them, so pausing the collector for the construction loses
nothing; the next collection after it runs as usual.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_collector"]


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """No cyclic garbage collection inside the block; the collector's previous state (enabled
    or not) is restored on leaving it, on an error too.  Nested blocks are fine (the innermost
    restores a paused collector, the outermost re-enables it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
