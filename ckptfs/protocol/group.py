"""Messages between the ranks of a job: the group.

Design decision: **the world size is a value.**  Code that runs on every rank is written once,
over a `Group`; a single process is `WorldOfOne` (rank 0 of 1: a broadcast returns the
document, a gather the one-element list, nothing is sent and DCP is never imported), and a
torch.distributed job is `RankGroup` over a process group.  Both return the same values for
the same documents, so a path is tested once whatever the world size.

Messages are JSON documents carried in uint8 tensors, never pickle: no rank ever unpickles
what another sent (as no load ever unpickles what a save wrote).  A payload JSON cannot hold
raises `TypeError` on the sender, before anything is sent; types with structure travel as
documents of their own (``to_doc``/``from_doc``), bytes as base64 (`encode_bytes`).  Bulk
bytes (a cooperative load's chunks) travel raw, by `Group.exchange_bytes`, in a schedule both
sides computed from documents exchanged first: they are data the receiver checks itself (a
load checks every chunk against its digest), never decoded into objects.

A typed error crosses ranks one way: `describe` (on the rank that raised it: its class, its
message and the attributes ckptfs's errors carry) and `rebuild` / `carried` (on every other
rank: the same class with the same message, or with one the caller gives; only ckptfs's own
and builtin classes are rebuilt, anything else becomes the caller's default class).

ckptfs's own dedicated gloo groups (one per purpose: collective saves and loads, async saves,
replication) are created by one factory, `gloo_group`, whose timeout bounds the creation too;
a rank that never joins fails the creation on the others with a typed error that names it,
from the `Liveness` keys each rank set before the first collective.
"""

from __future__ import annotations

import base64
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from ckptfs.errors import (
    CorruptCheckpointError,
    ProvenanceMismatchError,
    ShardedCheckpointError,
    ShardedLoadError,
)
from ckptfs.format.serialize import tensor_memoryview
from ckptfs.protocol.collective import is_distributed

__all__ = ["LIVENESS_WAIT", "Group", "Liveness", "RankGroup", "WorldOfOne", "bytes_group",
           "carried", "collective_failure", "decode", "decode_bytes", "describe", "encode",
           "encode_bytes", "encode_each", "gloo_group", "group_of", "message_device", "rebuild"]

log = logging.getLogger("ckptfs")

#: How long, at most, survivors of a failed collective look for the peers' keys before they
#: name the ranks whose keys are missing (best effort; see `Liveness`); never past the
#: collective timeout.
LIVENESS_WAIT = timedelta(seconds=3)

_SEQ: dict[Any, int] = {}

#: How a value JSON cannot hold is written (``json.dumps``'s ``default``); None: `TypeError`.
Default = Callable[[Any], Any] | None
T = TypeVar("T")


@dataclass
class Outcomes(Generic[T]):
    """Every rank's outcome of one step (`Group.outcomes`): this rank's ``value`` or its own
    exception ``own``; ``failures``, every failing group rank's `describe` document; and,
    when shared, ``values``, every rank's result (None for a failing rank), in group-rank
    order."""

    value: T | None
    own: Exception | None
    failures: dict[int, dict[str, Any]]
    values: list[Any] | None = None


# ----------------------------------------------------------------------------------------------
# Documents


def encode(doc: Any, *, default: Default = None) -> bytes:
    """``doc`` as the JSON bytes of a message; `TypeError` naming the value JSON cannot hold
    (unless ``default`` writes it), raised before anything is sent."""
    try:
        return json.dumps(doc, default=default).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a message between ranks must be a JSON document (dicts with str "
                        f"keys, lists, str, int, float, bool, None), never pickled: {exc}; "
                        "send a dataclass as its to_doc(), bytes with encode_bytes") from exc


def encode_each(docs: Sequence[Any], *, default: Default = None) -> list[bytes]:
    """`encode` of each of ``docs``, a document given several times (one object, as a part
    several ranks receive) encoded once."""
    memo: dict[int, bytes] = {}
    return [memo[id(d)] if id(d) in memo else memo.setdefault(id(d), encode(d, default=default))
            for d in docs]


def decode(data: bytes) -> Any:
    """A message's document."""
    return json.loads(data)


def encode_bytes(data: bytes | bytearray | memoryview) -> str:
    """Bytes as a JSON string (base64), for a message."""
    return base64.b64encode(bytes(data)).decode("ascii")


def decode_bytes(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


# ----------------------------------------------------------------------------------------------
# The group


class Group:
    """The ranks taking part, and the messages between them (module docstring).  ``rank`` is
    this process's rank in the group; rank 0 of the group is its coordinator."""

    rank: int = 0
    world_size: int = 1
    #: Global ranks of the members, in group-rank order.
    ranks: list[int]

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def broadcast(self, doc: Any, src: int = 0, *, default: Default = None) -> Any:
        """Group rank ``src``'s ``doc`` on every rank (``doc`` is ignored on the others)."""
        raise NotImplementedError

    def all_gather(self, doc: Any, *, default: Default = None) -> list[Any]:
        """Every rank's ``doc``, in group-rank order, on every rank."""
        raise NotImplementedError

    def gather(self, doc: Any, *, default: Default = None) -> list[Any]:
        """Every rank's ``doc``, in group-rank order (every rank gets them: `all_gather`)."""
        return self.all_gather(doc, default=default)

    def outcomes(self, fn: Callable[[], T], *, share: bool = False,
                 default: Default = None) -> Outcomes[T]:
        """``fn()`` on this rank, then every rank's outcome gathered in one `all_gather`: the
        round in which the ranks learn whether a step succeeded everywhere (a failure is
        its `describe` document; ``share``: every rank's result too, JSON, ``default`` for
        what JSON cannot hold).  Never raises ``fn``'s exception: the caller decides, from
        the same facts on every rank, what each rank raises."""
        own: Exception | None = None
        value: T | None = None
        try:
            value = fn()
        except Exception as exc:
            own = exc
        if own is not None:
            doc: Any = {"error": describe(own)}
        else:
            doc = {"ok": value} if share else None
        docs = self.all_gather(doc, default=default)
        failures = {r: d["error"] for r, d in enumerate(docs)
                    if isinstance(d, dict) and "error" in d}
        values = [d.get("ok") if isinstance(d, dict) else None for d in docs] if share \
            else None
        return Outcomes(value, own, failures, values)

    def gather_at_coordinator(self, doc: Any, *, default: Default = None) -> list[Any] | None:
        """Every rank's ``doc``, in group-rank order, on the coordinator only (None on the
        others): each rank's message crosses once, to rank 0 (`all_gather` sends every
        message to every rank)."""
        raise NotImplementedError

    def scatter_from_coordinator(self, docs: Sequence[Any] | None, *,
                                 default: Default = None) -> Any:
        """The coordinator's ``docs[r]`` on group rank ``r`` (``docs``, one per rank, is read
        on the coordinator only): each rank receives its own document, no other."""
        raise NotImplementedError

    def exchange_bytes(self, send: Sequence[Sequence[memoryview]], sizes: Sequence[int]
                       ) -> list[memoryview]:
        """Raw bytes between every pair of ranks, in one collective every rank calls:
        ``send[d]`` the buffers this rank sends to group rank ``d`` (concatenated, in order;
        nothing to itself), ``sizes[s]`` how many bytes group rank ``s`` sends to this one.
        Both sides know every size beforehand (a schedule each rank computed alike from
        documents exchanged first); the result is, per source rank, the bytes it sent (a
        writable view), never decoded here: the receiver checks them itself (a cooperative load
        checks each chunk's digest before using it).  A world of one sends nothing."""
        if any(len(b) for b in send[self.rank]) or sizes[self.rank]:
            raise ValueError("exchange_bytes: a rank sends nothing to itself")
        if self.world_size == 1:
            return [memoryview(bytearray(0))]
        return self._exchange(send, sizes)

    def _exchange(self, send: Sequence[Sequence[memoryview]], sizes: Sequence[int]
                  ) -> list[memoryview]:
        raise NotImplementedError


class WorldOfOne(Group):
    """This process alone: every collective is the identity (the document as a process group
    would deliver it: JSON in, JSON out, so tuples come back as lists here too)."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.ranks = 0, 1, [0]

    def broadcast(self, doc: Any, src: int = 0, *, default: Default = None) -> Any:
        if src != 0:
            raise ValueError(f"src={src}: a world of one has only rank 0")
        return decode(encode(doc, default=default))

    def all_gather(self, doc: Any, *, default: Default = None) -> list[Any]:
        return [decode(encode(doc, default=default))]

    def gather_at_coordinator(self, doc: Any, *, default: Default = None) -> list[Any] | None:
        return self.all_gather(doc, default=default)

    def scatter_from_coordinator(self, docs: Sequence[Any] | None, *,
                                 default: Default = None) -> Any:
        if docs is None or len(docs) != 1:
            raise ValueError("scatter_from_coordinator: a world of one takes one document")
        return decode(encode(docs[0], default=default))


class RankGroup(Group):
    """The ranks of a torch.distributed process group (``None``: the default group).  A
    collective that fails (a peer died, the timeout passed) raises the process group's own
    error: the caller says what it means for its operation."""

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        #: Where the message tensors live: the CPU, but on a group whose one backend is NCCL
        #: (a CPU tensor cannot cross it) the current CUDA device, as torch's object
        #: collectives choose.
        self.device = message_device(process_group)
        self.rank = int(dist.get_rank(process_group))
        self.world_size = int(dist.get_world_size(process_group))
        self.ranks = [int(r) for r in dist.get_process_group_ranks(
            process_group if process_group is not None else dist.group.WORLD)]

    def broadcast(self, doc: Any, src: int = 0, *, default: Default = None) -> Any:
        group = self.process_group
        data = encode(doc, default=default) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, group=group, group_src=src)
        buf = self._buffer(data if self.rank == src else b"", int(size.item()))
        dist.broadcast(buf, group=group, group_src=src)
        return decode(_bytes(buf, int(size.item())))

    def all_gather(self, doc: Any, *, default: Default = None) -> list[Any]:
        group, data = self.process_group, encode(doc, default=default)
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=group)
        buf = self._buffer(data, max(int(s.item()) for s in sizes))
        bufs = [torch.zeros_like(buf) for _ in range(self.world_size)]
        dist.all_gather(bufs, buf, group=group)
        return [decode(_bytes(b, int(n.item()))) for b, n in zip(bufs, sizes, strict=True)]

    def _buffer(self, data: bytes, width: int) -> torch.Tensor:
        """A uint8 message tensor of ``width`` bytes (at least 1) on the group's device,
        ``data`` at its start."""
        buf = torch.zeros(max(1, width), dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return buf if self.device.type == "cpu" else buf.to(self.device)

    def gather_at_coordinator(self, doc: Any, *, default: Default = None) -> list[Any] | None:
        # The sizes to every rank (one int each), then one gather of buffers padded to the
        # largest: gloo's gather takes tensors of one size.
        group, data = self.process_group, encode(doc, default=default)
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=group)
        buf = self._buffer(data, max(int(s.item()) for s in sizes))
        bufs = [torch.zeros_like(buf) for _ in range(self.world_size)] if self.coordinator \
            else None
        dist.gather(buf, bufs, group=group, group_dst=0)
        if bufs is None:
            return None
        return [decode(_bytes(b, int(n.item()))) for b, n in zip(bufs, sizes, strict=True)]

    def scatter_from_coordinator(self, docs: Sequence[Any] | None, *,
                                 default: Default = None) -> Any:
        # The sizes from the coordinator (one int per rank), then one scatter of buffers
        # padded to the largest.
        group = self.process_group
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        blobs: list[bytes] = []
        if self.coordinator:
            if docs is None or len(docs) != self.world_size:
                raise ValueError(f"scatter_from_coordinator: {self.world_size} documents "
                                 "wanted, one per rank")
            blobs = encode_each(docs, default=default)
            sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64,
                                 device=self.device)
        dist.broadcast(sizes, group=group, group_src=0)
        width = int(sizes.max().item())
        out = self._buffer(b"", width)
        parts = [self._buffer(b, width) for b in blobs] if self.coordinator else None
        dist.scatter(out, parts, group=group, group_src=0)
        return decode(_bytes(out, int(sizes[self.rank].item())))

    def _exchange(self, send: Sequence[Sequence[memoryview]], sizes: Sequence[int]
                  ) -> list[memoryview]:
        # One all_to_all of uint8 tensors (uneven splits): the send buffers are copied once,
        # into the one input tensor; what arrives is sliced, not copied.
        splits = [sum(len(b) for b in bufs) for bufs in send]
        inp = torch.empty(sum(splits), dtype=torch.uint8)
        flat = tensor_memoryview(inp)
        pos = 0
        for bufs in send:
            for b in bufs:
                flat[pos:pos + len(b)] = memoryview(b).cast("B")
                pos += len(b)
        out = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.all_to_all_single(out, inp, [int(n) for n in sizes], splits,
                               group=self.process_group)
        got = tensor_memoryview(out)
        views, pos = [], 0
        for n in sizes:
            views.append(got[pos:pos + n])
            pos += n
        return views


def _bytes(buf: torch.Tensor, n: int) -> bytes:
    return buf[:n].cpu().numpy().tobytes()


def message_device(process_group: Any = None) -> torch.device:
    """The device of ``process_group``'s message tensors: the CPU unless the group's only
    backend is NCCL (then the current CUDA device: a CPU tensor cannot cross it); a group of
    gloo, of ``"cpu:gloo,cuda:nccl"``, or of a custom backend sends CPU tensors."""
    try:
        backend = str(dist.get_backend(process_group)).lower()
    except Exception:  # a custom backend object
        return torch.device("cpu")
    if "nccl" in backend and "gloo" not in backend and "cpu" not in backend \
            and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_of(process_group: Any = None) -> Group:
    """The group of ``process_group`` (None: the default group), or `WorldOfOne` when
    torch.distributed is not initialized."""
    if process_group is None and not is_distributed():
        return WorldOfOne()
    return RankGroup(process_group)


def bytes_group(process_group: Any) -> Group | None:
    """The group of ``process_group`` for `Group.exchange_bytes` (CPU tensors): a
    `RankGroup` when it is a gloo group of more than one rank (ckptfs's own groups are),
    ``None`` otherwise (not distributed, a world of one, or a group of another backend,
    whose bytes would have to cross through its device)."""
    if not is_distributed():
        return None
    try:
        if dist.get_backend(process_group) != "gloo":
            return None
    except Exception:  # a group of a custom backend
        return None
    group = RankGroup(process_group)
    return group if group.world_size > 1 else None


# ----------------------------------------------------------------------------------------------
# Typed errors between ranks


def describe(exc: BaseException) -> dict[str, Any]:
    """An exception as JSON: its class, message and the attributes ckptfs's errors carry."""
    doc: dict[str, Any] = {"module": type(exc).__module__, "name": type(exc).__qualname__,
                           "message": str(exc)}
    for attr in ("step", "path", "diagnostic"):
        value = getattr(exc, attr, None)
        if isinstance(value, (int, str)):
            doc[attr] = value
    if isinstance(exc, ProvenanceMismatchError):
        doc["differences"] = [[str(k), repr(a), repr(b)] for k, a, b in exc.differences]
    if isinstance(exc, ShardedCheckpointError):
        doc["failures"] = {str(r): str(v) for r, v in exc.failures.items()}
    return doc


def rebuild(doc: Mapping[str, Any], message: str | None = None) -> BaseException | None:
    """An exception of the class ``doc`` names (ckptfs's or a builtin) with ``message``
    (default: its own), or None."""
    module, name = str(doc.get("module")), str(doc.get("name"))
    if message is None:
        message = str(doc.get("message"))
    if not (module == "builtins" or module == "ckptfs" or module.startswith("ckptfs.")):
        return None
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return None
    try:
        if issubclass(cls, ProvenanceMismatchError):
            return cls(message, differences=[tuple(d) for d in doc.get("differences", [])],
                       diagnostic=doc.get("diagnostic"))
        if issubclass(cls, CorruptCheckpointError):
            return cls(message, step=doc.get("step"), path=doc.get("path"))
        if issubclass(cls, ShardedCheckpointError):
            return cls(message, failures={int(r): v for r, v in
                                          (doc.get("failures") or {}).items()})
        return cls(message)
    except Exception:  # a class with other required arguments
        return None


def carried(doc: Mapping[str, Any], default: Callable[[str], BaseException], *,
            message: str | None = None) -> BaseException:
    """The error another rank described (`describe`), as the same class here, or
    ``default(its class name: its message)`` when that class cannot be rebuilt.  With
    ``message`` (one that names every failing rank, say), the error has that message instead,
    whichever class it is."""
    err = rebuild(doc, message)
    if err is not None:
        return err
    return default(message if message is not None else
                   f"{doc.get('name')}: {doc.get('message')}")


# ----------------------------------------------------------------------------------------------
# Liveness, and the dedicated gloo groups


class Liveness:
    """Best effort: which ranks never came, died or hung in a collective save or load.

    Each rank sets its key in the default c10d store when it enters (``in``), before the first
    collective (the creation of ckptfs's group included), and again once its own I/O is done
    (``done``, right before DCP's final collective).  When a collective fails (gloo only says
    "Connection reset by peer" or "Timed out"), a survivor reads the others' keys and names the
    ranks that never entered or, if it finished its own part, those that did not finish theirs;
    never itself.  It looks again for up to `LIVENESS_WAIT` while the collective timeout
    has time left (a live peer may be about to set its key), so the whole wait stays within the
    timeout given.  Keys are named by a per-group counter of collective saves and loads (every
    rank runs the same sequence) and removed once the operation succeeded."""

    def __init__(self, group: Any, kind: str, step: int | None, *,
                 timeout: timedelta | None = None) -> None:
        self.ranks: list[int] = []
        self.store: Any = None
        self.prefix = ""
        self.key = ""
        self.kind = kind
        self.me = -1
        self.finished = False
        #: How far this rank got in the exchanges of a cooperative load (`progress`).
        self.mark = 0
        self.started = time.monotonic()
        self.timeout = timeout
        if group is None:
            return
        from ckptfs.torch_compat import default_store, group_timeout  # imports DCP
        if self.timeout is None:
            self.timeout = group_timeout(group)
        try:
            self.ranks = [int(r) for r in dist.get_process_group_ranks(group)]
            self.me = int(dist.get_rank())
            self.store = default_store()
        except Exception:  # no default store (a custom backend): nothing to report
            self.store = None
            return
        seq = _SEQ[id(group)] = _SEQ.get(id(group), 0) + 1
        self.prefix = f"ckptfs/live/{kind}/{seq}/{'latest' if step is None else step}/"
        self.key = f"{self.prefix}{self.me}"
        self._set(b"in")

    def wrap(self, obj: Any, method: str) -> None:
        """Mark this rank done once ``obj.method``'s future (its writes or reads) is done."""
        if self.store is None:
            return
        inner = getattr(obj, method)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            fut = inner(*args, **kwargs)
            fut.wait()
            self.finished = True
            self._set(b"done")
            return fut

        setattr(obj, method, wrapped)

    def progress(self, mark: int) -> None:
        """This rank reached exchange ``mark`` (>= 1, in the order every rank runs them) of
        the operation: a survivor of a failed exchange names the ranks that did not reach it
        (`report`), where it could otherwise only say that every rank entered."""
        if self.store is None or mark <= self.mark:
            return
        self.mark = mark
        self._set(f"at {mark}".encode())

    @staticmethod
    def _mark_of(state: bytes | None) -> int:
        if state is None:
            return -1
        if state == b"done":
            return 1 << 62
        if state.startswith(b"at "):
            try:
                return int(state[3:])
            except ValueError:
                return 0
        return 0

    def _set(self, value: bytes) -> None:
        try:
            self.store.set(self.key, value)
        except Exception as exc:  # best effort
            log.debug("ckptfs: liveness key %s not set: %s", self.key, exc)

    def done(self) -> None:
        if self.store is None:
            return
        try:
            self.store.delete_key(self.key)
        except Exception as exc:  # best effort (a store without delete)
            log.debug("ckptfs: liveness key %s not removed: %s", self.key, exc)

    def _state(self, rank: int) -> bytes | None:
        key = f"{self.prefix}{rank}"
        if not self.store.check([key]):
            return None
        value: bytes = self.store.get(key)
        return value

    def wait_seconds(self) -> float:
        """How long a survivor still looks for keys: `LIVENESS_WAIT`, cut to what is left
        of the collective timeout (nothing when the collective itself timed out)."""
        limit = LIVENESS_WAIT.total_seconds()
        if self.timeout is not None:
            left = self.timeout.total_seconds() - (time.monotonic() - self.started)
            limit = max(0.0, min(limit, left))
        return limit

    def report(self) -> tuple[list[int] | None, list[int] | None, str]:
        """(ranks that never entered, ranks that entered but did not finish (None when this
        rank did not finish its own part either and reached no exchange: then nobody's keys
        say who is to blame; when it reached exchange ``mark``, the ranks that did not), a
        reason when the store could not be asked)."""
        if self.store is None:
            return None, None, "no c10d store to ask"
        found: dict[str, Any] = {}
        limit = self.wait_seconds()
        mark = (1 << 62) if self.finished else self.mark

        def look() -> None:
            try:
                deadline = time.monotonic() + limit
                while True:
                    states = {r: self._state(r) for r in self.ranks if r != self.me}
                    absent = [r for r, s in states.items() if s is None]
                    behind = [r for r, s in states.items() if self._mark_of(s) < mark]
                    if (not absent and (not mark or not behind)) or \
                            time.monotonic() >= deadline:
                        found["states"] = absent, behind
                        return
                    time.sleep(0.1)
            except Exception as exc:
                found["error"] = exc

        t = threading.Thread(target=look, daemon=True, name="ckptfs-liveness")
        t.start()
        t.join(limit + 5)
        if "states" in found:
            absent, behind = found["states"]
            return absent, (behind if mark else None), ""
        why = found.get("error")
        return None, None, (f"the coordinator's store is unreachable ({type(why).__name__}: "
                            f"{why})" if why is not None else "the coordinator's store did not "
                            "answer")


def collective_failure(exc: BaseException, what: str, default: type[ShardedCheckpointError],
                       live: Liveness | None = None) -> ShardedCheckpointError:
    """``default`` for a collective that itself failed (a peer died, timed out, never came, or
    left), naming the ranks to blame from ``live``'s keys where they say."""
    failures: dict[int, str] = {}
    named = ""
    timeout = live.timeout if live is not None and live.timeout is not None else None
    if live is not None:
        waited = live.wait_seconds()
        absent, unfinished, why = live.report()
        if absent:
            failures = {r: f"did not enter this {live.kind} (not called there, or died or hung "
                        "before it)" for r in absent}
            named = (f"rank(s) {absent} did not enter this {live.kind} (not called there, or "
                     "died or hung before it); ")
        elif unfinished and not live.finished:
            failures = {r: f"did not reach exchange {live.mark} of this {live.kind} (died or "
                        "hung)" for r in unfinished}
            named = (f"rank(s) {unfinished} did not reach exchange {live.mark} of this "
                     f"{live.kind} within {waited:.3g} s (died or hung); ")
        elif unfinished:
            failures = {r: "did not finish its part (died or hung)" for r in unfinished}
            named = (f"rank(s) {unfinished} did not finish their part within {waited:.3g} s "
                     "(died or hung); ")
        elif unfinished == [] and live.ranks and live.finished:
            named = (f"every rank finished its part, so the coordinator (rank "
                     f"{live.ranks[0]}) most likely failed after it; ")
        elif unfinished == [] and live.ranks:
            named = (f"rank(s) unknown: every rank reached exchange {live.mark} of this "
                     f"{live.kind}, and it failed; ")
        elif why:
            named = f"rank(s) unknown: {why}; "
        else:
            named = ("rank(s) unknown: every rank entered, and the collective failed before this "
                     "rank finished its own part; ")
    outcome = ("Nothing was committed by this save" if default is not ShardedLoadError
               else "The state given to load is not fully loaded")
    limit = timeout if timeout is not None else "the process group's"
    return default(
        f"{what}: a checkpoint collective failed ({type(exc).__name__}: {exc}); {named}a "
        f"rank died, hung past the timeout ({limit}), or the process group broke. {outcome}",
        failures=failures)


def gloo_group(timeout: timedelta, *, what: str = "creating ckptfs's gloo group",
               default: type[ShardedCheckpointError] | None = None,
               live: Liveness | None = None) -> Any:
    """A new dedicated gloo group of every rank of the world (every rank calls it, in the same
    order: it is collective), bounded by ``timeout``, its creation included.  A rank that
    never joins fails the creation on the others: with ``default`` (its message begins with
    ``what``) naming that rank (``live``), or the process group's own error when ``default``
    is None.  Without gloo (no torch build
    lacks it), the default group, with its timeout (logged)."""
    if not dist.is_gloo_available():  # pragma: no cover - every torch build has gloo
        log.warning("ckptfs: this torch has no gloo backend; %s runs on the default process "
                    "group, with its timeout, not %s", what, timeout)
        return dist.group.WORLD
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    except Exception as exc:  # a rank did not join within the timeout
        if default is None:
            raise
        raise collective_failure(exc, what, default, live) from exc

