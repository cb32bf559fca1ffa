"""How a store's saves write, as one value: `SaveOptions`.

Design decision: **the options of a save travel whole.**  A store (``ckptfs.open``, ``tiered``)
takes its options as keyword arguments once and holds them as one frozen `SaveOptions`
(``store.options``); every stage of a save receives that value, not its fields one by one:
`ckptfs.protocol.prepare.prepare` takes it from the store, the single-process write
(`ckptfs.protocol.incremental.write_plan`, `ckptfs.protocol.commit.save_plan`) and the
collective one (`ckptfs.protocol.sharded.prepare_save`, `ckptfs.protocol.sharded_io.ShardedWriter`,
`ckptfs.protocol.rank_metadata.PerRankSave`) read the fields they need from it.  A new option
is one field here and the stage that uses it, not a parameter threaded through every signature
between the store and that stage.

What is not in it: what a save is *of* (the step, the state, its metadata, the process group)
and what the commit object itself takes (`ckptfs.protocol.commit.Attempt`: its storage, step,
hash algorithm and durability, the narrow interface every writer shares, copies included).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptfs.errors import SaveOptionError
from ckptfs.format.features import check_metadata_layout
from ckptfs.format.hashing import DEFAULT_ALGORITHM, new_hasher
from ckptfs.format.incremental import DEFAULT_LEASE_S

if TYPE_CHECKING:
    from ckptfs.protocol.incremental import ReuseMemory

__all__ = ["SaveOptions", "default_threads"]


def default_threads() -> int:
    """Files a save writes at once by default: the CPUs, between 2 and 8."""
    return max(2, min(8, (os.cpu_count() or 2)))


@dataclass(frozen=True)
class SaveOptions:
    """The options of a store's saves (module docstring).  Checked when made: an unknown hash
    algorithm raises `HashAlgorithmUnavailableError`, an unknown metadata layout
    `UnsupportedValueError`, any other value of the wrong type or range `SaveOptionError`
    naming the option; ``threads`` 0 or None is the default (`default_threads`)."""

    #: The content hash of every file and chunk (``"blake3"``, ``"sha256"``, ``"xxh3-128"``).
    algorithm: str = DEFAULT_ALGORITHM
    #: Every file, directory entry and the marker fsynced before the commit returns.
    durable: bool = True
    #: Files written (and hashed) at once.
    threads: int | None = None
    #: An incremental save's lease (docs/protocol.md §9.4), seconds.
    lease_s: float = DEFAULT_LEASE_S
    #: An incremental store's reuse memory (format v3/v4: unchanged bytes referenced, not
    #: written again); None: every byte written.
    reuse: ReuseMemory | None = None
    #: Sharded saves: ``"per-rank"`` (format v5), ``"auto"`` or None (one ``dcp.msgpack``).
    metadata_layout: str | None = None
    #: Each rank's storage is its own node's (a two-tier store's local tier, docs/tiers.md).
    node_local: bool = False
    #: Sharded saves: key prefixes of replicated tensors meant to differ between ranks.
    divergent_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        new_hasher(self.algorithm)
        check_metadata_layout(self.metadata_layout)
        if not isinstance(self.durable, bool):
            raise SaveOptionError(f"durable={self.durable!r:.40}: True or False")
        threads = self.threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 0):
            raise SaveOptionError(f"threads={threads!r:.40}: a positive int (files written "
                                  "at once), or None for the default")
        lease = self.lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or \
                not 0 <= lease < float("inf"):
            raise SaveOptionError(f"lease_s={lease!r:.40}: the seconds an incremental save "
                                  "may take, a number >= 0 (docs/protocol.md §9.4)")
        if not isinstance(self.node_local, bool):
            raise SaveOptionError(f"node_local={self.node_local!r:.40}: True or False")
        object.__setattr__(self, "threads", threads or default_threads())
        object.__setattr__(self, "divergent_keys", tuple(self.divergent_keys))

    @property
    def incremental(self) -> bool:
        """Saves reference unchanged bytes (a reuse memory is given)."""
        return self.reuse is not None

    @property
    def workers(self) -> int:
        """``threads`` as an int (always set once made)."""
        assert self.threads is not None
        return self.threads

    def but(self, **changes: Any) -> SaveOptions:
        """This value with ``changes`` (``dataclasses.replace``: checked again)."""
        return dataclasses.replace(self, **changes)
