"""The reliability sweeps behind tests/reliability/ (test_crash_points.py, test_power_cut.py,
test_concurrency.py, test_corruption.py, test_hostile.py) and tests/storage/test_transient.py,
and the command that publishes their figures in docs/reliability.md::

    python -m ckptfs.testing.reliability                # all backends, writes the JSON + table
    python -m ckptfs.testing.reliability --backends local memory

Each sweep returns a `Sweep`: how many scenarios it tried, and every *violation* of an
invariant of docs/protocol.md it saw, as a sentence naming the scenario.  The tests assert that
the list is empty; the command counts.  Sweeps never stop at the first violation, so one run
reports all of them.

One module per concern, all re-exported here:

- `.common`: `Sweep`, the state saved at each step, `check_store`.
- `.paths`: the write paths a sweep can run through (``store.save``, the sharded save on
  one rank, ``save_async``, ``ckptfs cp``, a sub-storage): ``sweep(backend, path=...)``.
- `.crash`: crash points of save, delete, prune and gc.
- `.power`: power cuts on local disk.
- `.races`: zombie writers, free-step races, reader during saves, prune during a save.
- `.corruption`: the corruption matrix.
- `.transient`: saves under transient faults through the retry layer.
- `.hostile`: hostile checkpoints (valid marker, malicious contents), read through load,
  verify, ``ckptfs cp`` (and any reader the caller adds); `.hostile_v2`: the same
  restated for the sharded format (``hostile_sweep(fmt=2)``).
- `.tiers`: two tiers (docs/tiers.md): the replicator killed or cut off at every mutating call
  it makes at the remote tier, a remote outage during saves, the local disk lost.
- `.report`: the figures command (docs/reliability.json and the table in
  docs/reliability.md); ``__main__`` runs it.  Imported from there, not re-exported here:
  it imports every sweep module, and the package re-exporting it made an import cycle.
"""

from ckptfs.testing.reliability.common import (
    SWEEP_SHARD_BYTES,
    Sweep,
    check_store,
    raw_storage,
    state_for,
    store_on,
)
from ckptfs.testing.reliability.corruption import corruption_matrix
from ckptfs.testing.reliability.crash import (
    count_calls,
    sweep_delete_crashes,
    sweep_gc_crashes,
    sweep_prune_crashes,
    sweep_save_crashes,
    sweep_shared_gc_crashes,
)
from ckptfs.testing.reliability.hostile import HOSTILE_MEMORY_LIMIT, hostile_cases, hostile_sweep
from ckptfs.testing.reliability.hostile import (
    Planter as Planter,  # used by tests/reliability/test_hostile.py
)
from ckptfs.testing.reliability.paths import WRITE_PATHS, SubBackend, WritePath
from ckptfs.testing.reliability.power import sweep_power_cut_delete, sweep_power_cuts
from ckptfs.testing.reliability.races import (
    all_race_sweeps,
    sweep_free_race,
    sweep_prune_during_save,
    sweep_reader_during_saves,
    sweep_zombie,
)
from ckptfs.testing.reliability.tiers import (
    replication_sweeps,
    sweep_local_loss,
    sweep_replication_crashes,
    sweep_replication_outage,
)
from ckptfs.testing.reliability.transient import sweep_transient

__all__ = [
    "HOSTILE_MEMORY_LIMIT",
    "SWEEP_SHARD_BYTES",
    "WRITE_PATHS",
    "SubBackend",
    "Sweep",
    "WritePath",
    "all_race_sweeps",
    "check_store",
    "corruption_matrix",
    "count_calls",
    "hostile_cases",
    "hostile_sweep",
    "raw_storage",
    "replication_sweeps",
    "state_for",
    "store_on",
    "sweep_delete_crashes",
    "sweep_free_race",
    "sweep_gc_crashes",
    "sweep_local_loss",
    "sweep_power_cut_delete",
    "sweep_power_cuts",
    "sweep_prune_crashes",
    "sweep_prune_during_save",
    "sweep_reader_during_saves",
    "sweep_replication_crashes",
    "sweep_replication_outage",
    "sweep_save_crashes",
    "sweep_shared_gc_crashes",
    "sweep_transient",
    "sweep_zombie",
]
