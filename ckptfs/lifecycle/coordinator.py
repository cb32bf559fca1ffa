"""Who does what when `CheckpointManager` saves and restores: the coordinator
under the one manager body.

Design decision: **one manager body, two coordinators.**  The manager
(`ckptfs.lifecycle.manager`) is written once, as the collective algorithm; a coordinator
says how its steps run.  `Solo` (one process, or a process of a job without
torch.distributed) is the identity: every step runs here, nothing is sent.
`ProcessGroup` (torch.distributed initialized with several ranks, or a model holding
DTensors) runs the same steps on every rank, agrees on their outcome (a failure on one rank
raises on every rank, before anything is written) and lets the writer rank (rank 0) decide
what only one rank may decide: which checkpoint a resume loads, the provenance check (one
diagnostic file), the bookkeeping after a commit.

The call sequence of a collective save (``CheckpointManager.save``, every rank, same step)::

    0) (all ranks)  an async save still pending: its future's outcome is agreed
                    (agree: ``result()`` on every rank), then 3) and 4) run for it
    1) (all ranks)  agree_gather: check the arguments (step, rank/world size, reserved names,
                    metrics), capture this rank's RNG state, build the state dicts
                    (``get_state_dict``: this rank's shards) -> every rank's recorded metrics
                    and RNG ranks.  Any failure raises on every rank; nothing is written.
                    The metrics are merged (the same on every rank) into the metadata.
    2) (all ranks)  ``store.save`` (collective: every rank writes its shards, the coordinator
                    rank of the store commits once), or ``store.save_async`` (collective
                    snapshot; the commit completes in the background, and 3)-4) wait for 0)
                    of the next save, ``restore_latest`` or ``wait``)
    3) (writer)     on_writer: the bookkeeping after the commit: side-output record, best
                    pool and record, prune
    4) (all ranks)  on_writer: the writer broadcasts its SaveResult (or its error): every rank
                    returns the same SaveResult, or raises the same error

The call sequence of a collective restore (``restore_latest``/``restore``, every rank)::

    1) (all ranks)  agree: check the arguments (map_location, names, rank/world size)
    2) (writer)     walk: run the one walk (``protocol.resolve.walk_tiers``: newest
                    committed first, roll back over a corrupt one only if allowed), or read
                    the one step asked for, led over the group as every collective read is
                    (``protocol.resolve.over_group``); for each candidate it tries:
       a) (writer -> all)  the candidate (its tier, manifest and marker)
       b) (writer -> all)  on_writer: the provenance check, its accepted changes
       c) (all ranks)      agree: read the manifest, load the small entries (trainer,
                           manager, this rank's RNG state, scheduler, stateful; map_location),
                           or a one-process checkpoint whole; build fresh state dicts of
                           today's placement for d)
       d) (all ranks)      agree: the collective load of model/optimizer into fresh tensors of
                           today's placement (every byte verified)
       e) (all ranks)      the outcome of b)-d) gathered: a failure on any rank is the
                           candidate's on every rank
       A failure in a)-e) raises on every rank; the writer's walk decides what follows: the
       next older candidate (``allow_rollback``) -> a), or the end.
    3) (writer -> all)  the walk's end: the candidate chosen, none, or the error; every rank
                    returns or raises the same
    4) (all ranks)  agree: apply the loaded state to the objects (only now touched), restore
                    this rank's RNG state; the writer runs the resume bookkeeping

With `Solo` the same sequence runs in this process: agree and on_writer call the
function, agree_gather returns this process's result, walk runs the walk here.  A non-writer
rank of a job without torch.distributed (``rank``/``world_size`` given) stops a save after 1):
it writes nothing, and its metrics are not recorded (logged).

The messages of `ProcessGroup` are the group's (``ckptfs.protocol.group``: JSON in uint8
tensors, no pickle, a few hundred bytes per rank; an error crosses ranks as
``group.describe``/``group.carried``) on ckptfs's dedicated gloo group
(``ckptfs.protocol.sharded.collective_group``, its timeout ``COLLECTIVE_TIMEOUT``);
``ckptfs.protocol.sharded`` (and so DCP, seconds to import) is imported only when a process
group coordinates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from ckptfs.errors import ShardedCheckpointError
from ckptfs.protocol.group import Default, Group, Outcomes, RankGroup, carried, describe
from ckptfs.protocol.resolve import CheckpointInfo, Tier, Walk, over_group

T = TypeVar("T")

#: What a coordinated step raises when ranks fail in different ways.
ErrorClass = type[ShardedCheckpointError]


def _identity(value: Any) -> Any:
    return value


class Coordinator(Protocol):
    """How the manager's steps run: see the module docstring for the call sequences."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def collective(self) -> bool:
        """True under a process group: the save and load are collective (format v2, DCP state
        dicts); False: one process saves and loads alone (format v1, ``state_dict()``)."""
        ...

    def agree(self, fn: Callable[[], T], what: str, error: ErrorClass) -> T:
        """Run ``fn`` on every rank; if it raised anywhere, raise on every rank."""
        ...

    def agree_gather(self, fn: Callable[[], Any], what: str,
                     error: ErrorClass) -> list[tuple[int, Any]]:
        """As `agree`, returning every rank's result (JSON), in rank order."""
        ...

    def on_writer(self, fn: Callable[[], T], what: str, error: ErrorClass, *,
                  encode: Callable[[T], Any] = _identity,
                  decode: Callable[[Any], T] = _identity) -> T:
        """Run ``fn`` on the writer rank only; every rank returns its result (the others
        ``decode(encode(result))``) or raises its error."""
        ...

    def walk(self, tiers: Sequence[Tier], walk: Walk[T], use: Callable[[CheckpointInfo], T],
             what: str, error: ErrorClass) -> tuple[CheckpointInfo, T] | None:
        """The one walk, led by the writer: it runs ``walk`` (which calls ``use`` on each
        checkpoint it tries, over ``tiers``); every rank runs ``use`` on each candidate, in
        the same order, and returns the one chosen with its own result, None if none, or
        raises the walk's error (`ckptfs.protocol.resolve.over_group`, the walk every
        collective read uses); a message that cannot cross (a rank died, the timeout passed)
        raises ``error`` naming ``what``."""
        ...


class Solo:
    """The identity coordinator: this process alone (no torch.distributed, or one rank of a
    job that coordinates without it: ``rank``/``world_size`` given, ``rng_gather``)."""

    collective = False

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self._rank = rank
        self._world_size = world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def agree(self, fn: Callable[[], T], what: str, error: ErrorClass) -> T:
        return fn()

    def agree_gather(self, fn: Callable[[], Any], what: str,
                     error: ErrorClass) -> list[tuple[int, Any]]:
        return [(self._rank, fn())]

    def on_writer(self, fn: Callable[[], T], what: str, error: ErrorClass, *,
                  encode: Callable[[T], Any] = _identity,
                  decode: Callable[[Any], T] = _identity) -> T:
        return fn()

    def walk(self, tiers: Sequence[Tier], walk: Walk[T], use: Callable[[CheckpointInfo], T],
             what: str, error: ErrorClass) -> tuple[CheckpointInfo, T] | None:
        return walk(use)


def check_ranks(coord: Coordinator, *, rank: int, world_size: int, writer_rank: int) -> None:
    """The rank arguments a manager was made with match the coordinator's (``ValueError``)."""
    if (rank, world_size) != (coord.rank, coord.world_size):
        raise ValueError(f"the manager was made for rank {rank} of {world_size}, but this "
                         f"process is rank {coord.rank} of {coord.world_size} in "
                         "torch.distributed: leave rank/world_size unset")
    if coord.collective and writer_rank != 0:
        raise ValueError(f"writer_rank={writer_rank}: in a distributed job rank 0 commits and "
                         "keeps the records; leave writer_rank at 0")


# ----------------------------------------------------------------------------------------------
# ProcessGroup: pickle-free messages (ckptfs.protocol.group), and one error class on every rank


class ProcessGroup:
    """Every rank of this torch.distributed job, on ckptfs's dedicated gloo group; rank 0
    writes (module docstring)."""

    collective = True
    writer = 0

    def __init__(self) -> None:
        import torch.distributed as dist

        from ckptfs.protocol import sharded  # lazily: DCP takes seconds to import
        self.group = sharded.collective_group(None)
        self._messages = RankGroup(self.group)
        self._rank = int(dist.get_rank())
        self._world_size = int(dist.get_world_size())
        self.ranks = self._messages.ranks

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    # -- messages ----------------------------------------------------------------------------

    def _collective(self, fn: Callable[[], T], what: str, error: ErrorClass) -> T:
        try:
            return fn()
        except Exception as exc:  # a peer died or the group broke
            raise error(f"{what}: a checkpoint collective failed ({type(exc).__name__}: "
                        f"{exc}); a rank died, hung past the timeout, or the process group "
                        "broke", failures={}) from exc

    def gather(self, doc: Any, what: str, error: ErrorClass) -> list[Any]:
        """Every rank's ``doc`` (JSON; a value JSON cannot hold is sent as its ``str``), in
        rank order."""
        return self._collective(lambda: self._messages.all_gather(doc, default=str), what,
                                error)

    def broadcast(self, doc: Any, what: str, error: ErrorClass) -> Any:
        """The writer's ``doc`` (JSON, as in `gather`) on every rank (``doc`` is ignored on
        the others)."""
        return self._collective(
            lambda: self._messages.broadcast(doc, self.ranks.index(self.writer), default=str),
            what, error)

    # -- the coordinator ---------------------------------------------------------------------

    def _outcomes(self, fn: Callable[[], T], what: str, error: ErrorClass, *,
                  share: bool = False) -> Outcomes[T]:
        """The group's one outcome round (`Group.outcomes`); any rank's failure raised on
        every rank (`_raise`)."""
        got = self._collective(
            lambda: self._messages.outcomes(fn, share=share, default=str), what, error)
        if got.failures:
            self._raise({self.ranks[r]: d for r, d in got.failures.items()}, got.own, what,
                        error)
        return got

    def agree(self, fn: Callable[[], T], what: str, error: ErrorClass) -> T:
        return self._outcomes(fn, what, error).value  # type: ignore[return-value]

    def agree_gather(self, fn: Callable[[], Any], what: str,
                     error: ErrorClass) -> list[tuple[int, Any]]:
        values = self._outcomes(fn, what, error, share=True).values
        assert values is not None
        return list(zip(self.ranks, values, strict=True))

    def on_writer(self, fn: Callable[[], T], what: str, error: ErrorClass, *,
                  encode: Callable[[T], Any] = _identity,
                  decode: Callable[[Any], T] = _identity) -> T:
        own: Exception | None = None
        out: T | None = None
        doc: dict[str, Any] = {}
        if self._rank == self.writer:
            try:
                out = fn()
                doc = {"ok": encode(out)}
            except Exception as exc:
                own = exc
                doc = {"error": describe(exc)}
        doc = self.broadcast(doc, what, error)
        if "error" in doc:
            self._raise({self.writer: doc["error"]}, own, what, error)
        if self._rank != self.writer:
            return decode(doc.get("ok"))
        return out  # type: ignore[return-value]

    def walk(self, tiers: Sequence[Tier], walk: Walk[T], use: Callable[[CheckpointInfo], T],
             what: str, error: ErrorClass) -> tuple[CheckpointInfo, T] | None:
        return over_group(_Reported(self, what, error), tiers, walk, use)

    def _raise(self, failures: dict[int, dict[str, Any]], own: Exception | None, what: str,
               error: ErrorClass) -> None:
        classes = {(d.get("module"), d.get("name")) for d in failures.values()}
        if own is not None and len(classes) == 1 and len(failures) == len(self.ranks):
            raise own  # every rank failed the same way: its own error, unchanged
        summary = {r: f"{d.get('name')}: {d.get('message')}" for r, d in failures.items()}
        msg = (f"{what} failed on rank(s) {sorted(failures)}: "
               + "; ".join(f"rank {r}: {summary[r]}" for r in sorted(summary)))

        def default(text: str) -> BaseException:
            return error(text, failures=summary)

        if len(classes) != 1:
            raise default(msg) from own
        # one class everywhere: that class, its message naming every failing rank
        raise carried(failures[min(failures)], default, message=msg) from own


class _Reported(Group):
    """``coord``'s messages, a failed collective raised as ``error`` naming ``what`` (as every
    message of `ProcessGroup`): the group the led walk runs on."""

    def __init__(self, coord: ProcessGroup, what: str, error: ErrorClass) -> None:
        self._coord, self._what, self._error = coord, what, error
        inner = coord._messages
        self.rank, self.world_size, self.ranks = inner.rank, inner.world_size, inner.ranks

    def broadcast(self, doc: Any, src: int = 0, *, default: Default = None) -> Any:
        inner = self._coord._messages
        return self._coord._collective(lambda: inner.broadcast(doc, src, default=default),
                                       self._what, self._error)

    def all_gather(self, doc: Any, *, default: Default = None) -> list[Any]:
        inner = self._coord._messages
        return self._coord._collective(lambda: inner.all_gather(doc, default=default),
                                       self._what, self._error)


__all__ = ["Coordinator", "ProcessGroup", "Solo", "check_ranks"]
