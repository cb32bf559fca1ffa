"""What the collective rounds share (`ckptfs.protocol.save_rounds`, `ckptfs.protocol.load_rounds`):
one rank's failure carried to every rank, and raised everywhere as DCP's ``CheckpointException``.

A rank's method never raises: a failure becomes the document it sends (`Rounds.failed`, which
keeps the exception as `Rounds.own`); the coordinator collects every rank's failure
(`failures_in`) into one document (`failures_doc`); every rank, given it, raises
``CheckpointException`` naming every failing rank (`Rounds.raise_failures`: its own exception
object on this rank, the one `group.carried` rebuilds elsewhere), so
``ckptfs.protocol.sharded.failure`` maps it exactly as it maps DCP's.
"""

from __future__ import annotations

import traceback
from typing import Any, ClassVar

from torch.distributed.checkpoint.api import CheckpointException

from ckptfs.errors import ShardedCheckpointError
from ckptfs.protocol.group import carried, describe

__all__ = ["Rounds", "failures_doc", "failures_in"]


class Rounds:
    """One rank's side of a collective operation's rounds (subclassed by the save's and the
    load's): its rank and the failure it raised itself, if any."""

    #: The class a failure sent by another rank is rebuilt as when its own is not known.
    error_class: ClassVar[type[ShardedCheckpointError]] = ShardedCheckpointError

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.own: BaseException | None = None

    def failed(self, exc: BaseException) -> dict[str, Any]:
        """The document a rank sends for its failure ``exc`` (kept to raise here)."""
        self.own = exc
        return {"error": describe(exc)}

    def raise_failures(self, round_name: str, got: Any) -> None:
        """DCP's ``CheckpointException`` if ``got`` reports failures: every failing rank's
        error (this rank's own object; the others' as `group.carried` rebuilds them)."""
        if not (isinstance(got, dict) and "failures" in got):
            return
        excs: dict[int, tuple[BaseException, traceback.StackSummary]] = {}
        for key, doc in got["failures"].items():
            rank = int(key)
            exc = self.own if rank == self.rank and self.own is not None \
                else carried(doc, self.error_class)
            excs[rank] = (exc, traceback.extract_tb(exc.__traceback__))
        raise CheckpointException(round_name, excs) from self.own


def failures_in(docs: list[Any]) -> dict[int, Any]:
    """Every failing rank's error document among the documents ``docs`` (by group rank)."""
    return {r: d["error"] for r, d in enumerate(docs) if isinstance(d, dict) and "error" in d}


def failures_doc(failures: dict[int, Any]) -> dict[str, Any]:
    """The document telling every rank of ``failures`` (`failures_in`)."""
    return {"failures": {str(r): f for r, f in failures.items()}}
