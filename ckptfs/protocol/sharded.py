"""Sharded checkpoints (format v2): collective save, load into any world size, full load in one
process, verification, and the pickle-free DCP planners.

Design decision: **DCP plans, ckptfs stores and commits.**  torch.distributed.checkpoint's own
planners decide who writes what (DTensor shards by their owners, replicated values once) and how
a checkpoint is resharded on load; ckptfs's :class:`~ckptfs.protocol.sharded_io.ShardedWriter`
and :class:`~ckptfs.protocol.sharded_read.ShardedReader` put the bytes into one attempt, hash
every byte once, verify every byte read, and commit with the same marker as format v1.

Every rank enters the collective even when its own input is bad: an error found before DCP runs
(a key the format cannot hold) is raised inside DCP's planning step, where DCP gathers it, so
all ranks fail together instead of leaving the others waiting.  DCP reports failures as
``CheckpointException`` (a ``BaseException``); :func:`map_failure` turns it into a ckptfs error
naming the failing ranks, raised on every rank.  The collectives run on a dedicated gloo group
whose timeout (:data:`COLLECTIVE_TIMEOUT`) bounds how long a rank waits for a dead or hung peer.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
import time
import warnings
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ckptfs.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    FormatVersionError,
    InvalidStepError,
    ShardedCheckpointError,
    ShardedLoadError,
    ShardedSaveError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptfs.format.hashing import DEFAULT_ALGORITHM
from ckptfs.format.layout import check_step
from ckptfs.format.manifest import check_metadata
from ckptfs.format.serialize import build_tree
from ckptfs.format.sharded import ChunkedFileEntry, decode_value, encode_value
from ckptfs.format.sharded_tree import dcp_view, restore, write_back
from ckptfs.protocol.collective import is_distributed
from ckptfs.protocol.listing import check_listing
from ckptfs.protocol.load_options import KeyPath, TensorMap, select_and_map
from ckptfs.protocol.reader import VerifyReport
from ckptfs.protocol.resolve import CheckpointInfo, read_committed, storage_url
from ckptfs.protocol.sharded_io import MAX_RANGE, ShardedWriter
from ckptfs.protocol.sharded_read import ShardedReader, read_chunks, read_document
from ckptfs.storage.base import Storage

log = logging.getLogger("ckptfs")

#: How long a rank waits in a checkpoint collective for its peers (a dead or hung rank) before
#: the save or load fails on every surviving rank.  Applies to the dedicated gloo group ckptfs
#: creates; pass ``process_group=`` to use a group (and timeout) of your own.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

_GROUPS: dict[int, Any] = {}


# ----------------------------------------------------------------------------------------------
# Planners: DCP's defaults, with non-tensor values in ckptfs's tagged msgpack (never pickle)


class SavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner`` (flattening, deduplication of replicated items), with every
    non-tensor value encoded by ckptfs (tagged msgpack) instead of ``torch.save``.  Values are
    encoded while the local plan is made, so a value the format cannot hold fails the save on
    every rank before any byte is written."""

    def __init__(self, *args: Any, deferred_error: BaseException | None = None,
                 tree: Any = None, tree_sink: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred = deferred_error
        self._encoded: dict[str, bytes] = {}
        self._tree = tree            # this rank's skeleton (store.save), sent with its plan
        self._tree_sink = tree_sink  # the coordinator's writer: gets the merged skeleton

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        if self._deferred is not None:
            raise self._deferred
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._encoded = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                self._encoded[item.index.fqn] = encode_value(
                    self.lookup_object(item.index), key=item.index.fqn)
        if self._tree is not None and isinstance(plan.planner_data, dict):
            mappings = _Mappings(plan.planner_data)
            mappings.tree = self._tree
            plan = dataclasses.replace(plan, planner_data=mappings)
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # Values only some ranks hold (rank-keyed entries, e.g. each rank's RNG state) are
        # stored by those ranks: the skeleton of the full load must be the union of every
        # rank's, not the coordinator's alone, or a full load would silently drop them.
        trees = [getattr(p.planner_data, "tree", None) for p in all_plans]
        if self._tree_sink is not None and any(t is not None for t in trees):
            self._tree_sink.tree = merge_trees(trees)
        return super().create_global_plan(all_plans)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            blob = self._encoded.get(write_item.index.fqn)
            if blob is None:
                blob = encode_value(object, key=write_item.index.fqn)
            return io.BytesIO(blob)
        return object


class _Mappings(dict):  # type: ignore[type-arg]
    """DCP's flattening map of one rank's save plan, carrying that rank's skeleton to the
    coordinator (DCP gathers the plans; it merges the maps with ``ChainMap``)."""

    tree: Any = None


def _key_id(encoded: Any) -> str:
    return repr(encoded)


def _describe(node: Any) -> str:
    kind = node[0] if isinstance(node, list) and node else ""
    return {"d": "a dict", "l": "a list", "t": "a tuple", "v": "a value"}.get(
        str(kind), "an unknown node")


def merge_trees(trees: list[Any]) -> Any:
    """The union of the ranks' skeletons (rank order: the coordinator's entries first).  Dicts
    merge by key, lists by index; a path that is a container on one rank and a value (or
    another kind of container) on another raises :class:`UnsupportedValueError`."""
    merged: Any = None
    for rank, tree in enumerate(trees):
        if tree is None:
            continue
        merged = tree if merged is None else _merge(merged, tree, [], rank)
    return merged


def _merge(a: Any, b: Any, path: list[str], rank: int) -> Any:
    if a == b:
        return a
    kind_a, kind_b = a[0], b[0]
    if kind_a == kind_b == "d":
        items = [list(item) for item in a[1]]
        index = {_key_id(item[0]): i for i, item in enumerate(items)}
        for key, child in b[1]:
            i = index.get(_key_id(key))
            if i is None:
                index[_key_id(key)] = len(items)
                items.append([key, child])
            else:
                text = str(build_tree(key, [], where="the tree of a rank's state"))
                items[i][1] = _merge(items[i][1], child, [*path, text], rank)
        return ["d", items]
    if kind_a == kind_b and kind_a in ("l", "t"):
        la, lb = a[1], b[1]
        out = [_merge(x, y, [*path, str(i)], rank)
               for i, (x, y) in enumerate(zip(la, lb, strict=False))]
        return [kind_a, out + list(la[len(lb):]) + list(lb[len(la):])]
    if kind_a == kind_b == "v":
        return a
    raise UnsupportedValueError(
        f"the ranks' states differ in structure at {'/'.join(path) or '<root>'}: rank {rank} "
        f"holds {_describe(b)} where a lower rank holds {_describe(a)}; a sharded checkpoint "
        "holds one tree: give every rank the same structure there (rank-specific values under "
        "rank-specific keys)")


def _select(tree: Any, keys: set[str], prefix: str = "") -> Any:
    """The part of a skeleton that DCP's key filter ``keys`` (dotted paths of dict keys, as
    DCP names them: ``str(key)``) loads, or None when it selects nothing there."""
    if prefix in keys:
        return tree
    if not (isinstance(tree, list) and len(tree) == 2 and tree[0] == "d"):
        return None  # keys name dict paths: nothing below a value or a list is selected alone
    if prefix and not any(k.startswith(prefix + ".") for k in keys):
        return None
    items = []
    for item in tree[1]:
        key = str(build_tree(item[0], [], where="the stored tree"))
        child = _select(item[1], keys, f"{prefix}.{key}" if prefix else key)
        if child is not None:
            items.append([item[0], child])
    return ["d", items] if items or not prefix else None


def _load_value(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    fqn = read_item.dest_index.fqn
    obj = decode_value(value.getbuffer(), where=f"stored value {fqn!r}")
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], obj)
    else:
        planner.state_dict[fqn] = obj


class LoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` (resharding into the given state dict), decoding stored
    values with ckptfs's msgpack instead of ``torch.load(weights_only=False)``."""

    def __init__(self, *args: Any, deferred_error: BaseException | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred = deferred_error

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        if self._deferred is not None:
            raise self._deferred
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_value(self, read_item, value)


class FullLoadPlanner(_EmptyStateDictLoadPlanner):
    """Loads a whole checkpoint into an empty dict (full-size plain tensors), pickle-free."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_value(self, read_item, value)


# ----------------------------------------------------------------------------------------------
# Collectives


def collective_group(process_group: Any = None) -> Any:
    """``process_group``, or ckptfs's dedicated gloo group (created once, collectively, with
    :data:`COLLECTIVE_TIMEOUT`), or ``None`` when not distributed."""
    if process_group is not None or not is_distributed():
        return process_group
    key = id(dist.group.WORLD)
    group = _GROUPS.get(key)
    if group is None:
        try:
            group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        except Exception as exc:  # pragma: no cover - a build without gloo
            log.warning("ckptfs: no dedicated gloo group (%s); using the default group and its "
                        "timeout", exc)
            group = dist.group.WORLD
        _GROUPS[key] = group
    return group


_PASS_THROUGH = (CheckpointExistsError, CheckpointNotFoundError, UnsupportedValueError,
                 InvalidStepError, CorruptCheckpointError)


def map_failure(exc: CheckpointException, what: str,
                default: type[ShardedCheckpointError]) -> CkptfsError:
    """The ckptfs error for a DCP ``CheckpointException``: the failing ranks' own error class
    when they all failed the same documented way (an existing step, a corrupt file, a bad
    value), else ``default``; the message names every failing rank and its error."""
    excs: dict[int, BaseException] = {}
    for rank, pair in sorted(exc.failures.items()):
        excs[rank] = pair[0] if isinstance(pair, tuple) else pair
    parts = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in excs.items())
    msg = f"{what} failed on rank(s) {sorted(excs)}: {parts}"
    summary = {r: f"{type(e).__name__}: {e}" for r, e in excs.items()}
    classes = {type(e) for e in excs.values()}
    if len(classes) == 1:
        cls = classes.pop()
        first = next(iter(excs.values()))
        if issubclass(cls, CorruptCheckpointError) and (
                cls.__init__ is CorruptCheckpointError.__init__):
            return cls(msg, step=getattr(first, "step", None), path=getattr(first, "path", None))
        if issubclass(cls, _PASS_THROUGH):
            try:
                return cls(msg)
            except TypeError:  # pragma: no cover - a subclass with required arguments
                pass
    return default(msg, failures=summary)


def _quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn`` without DCP's warning that a process-local save or load is process-local."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


#: How long survivors of a failed collective wait for the peers' "finished" keys before they
#: name the ranks whose keys are missing (best effort; see :class:`_Liveness`).
LIVENESS_WAIT = timedelta(seconds=3)

_SEQ: dict[Any, int] = {}


class _Liveness:
    """Best effort: which ranks died (or hung) in a collective save or load.  Each rank sets a
    key in the default c10d store once its own I/O is done (right before DCP's final
    collective); when a collective then fails (gloo only says "Connection reset by peer"), the
    survivors look for the keys the others set, for up to :data:`LIVENESS_WAIT`, and name the
    ranks whose keys are missing.  Keys are named by a per-group counter of collective saves
    and loads (every rank runs the same sequence) and removed once the operation succeeded."""

    def __init__(self, group: Any, kind: str, step: int | None) -> None:
        self.ranks: list[int] = []
        self.store: Any = None
        self.prefix = ""
        self.key = ""
        if group is None:
            return
        try:
            self.ranks = [int(r) for r in dist.get_process_group_ranks(group)]
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # no default store (a custom backend): nothing to report
            self.store = None
            return
        seq = _SEQ[id(group)] = _SEQ.get(id(group), 0) + 1
        self.prefix = f"ckptfs/live/{kind}/{seq}/{'latest' if step is None else step}/"
        self.key = f"{self.prefix}{dist.get_rank()}"

    def wrap(self, obj: Any, method: str) -> None:
        """Set this rank's key once ``obj.method``'s future (its writes or reads) is done."""
        if self.store is None:
            return
        inner = getattr(obj, method)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            fut = inner(*args, **kwargs)
            fut.wait()
            self._set()
            return fut

        setattr(obj, method, wrapped)

    def _set(self) -> None:
        try:
            self.store.set(self.key, b"1")
        except Exception as exc:  # best effort
            log.debug("ckptfs: liveness key %s not set: %s", self.key, exc)

    def done(self) -> None:
        if self.store is None:
            return
        try:
            self.store.delete_key(self.key)
        except Exception as exc:  # best effort (a store without delete)
            log.debug("ckptfs: liveness key %s not removed: %s", self.key, exc)

    def missing(self) -> tuple[list[int] | None, str]:
        """(ranks whose key is missing, or None when unknown; a reason when unknown)."""
        if self.store is None:
            return None, "no c10d store to ask"
        found: dict[str, Any] = {}

        def look() -> None:
            try:
                deadline = time.monotonic() + LIVENESS_WAIT.total_seconds()
                while True:
                    gone = [r for r in self.ranks
                            if not self.store.check([f"{self.prefix}{r}"])]
                    if not gone or time.monotonic() >= deadline:
                        found["gone"] = gone
                        return
                    time.sleep(0.1)
            except Exception as exc:
                found["error"] = exc

        t = threading.Thread(target=look, daemon=True, name="ckptfs-liveness")
        t.start()
        t.join(LIVENESS_WAIT.total_seconds() + 5)
        if "gone" in found:
            return list(found["gone"]), ""
        why = found.get("error")
        return None, (f"the coordinator's store is unreachable ({type(why).__name__}: {why})"
                      if why is not None else "the coordinator's store did not answer")


def failure(exc: BaseException, what: str, default: type[ShardedCheckpointError],
            live: _Liveness | None = None) -> BaseException:
    """The error to raise for ``exc`` raised by a DCP collective (``exc`` itself when it is a
    ckptfs error or not an ``Exception``): also used for async saves (their future's error)."""
    if isinstance(exc, CheckpointException):
        return map_failure(exc, what, default)
    if isinstance(exc, CkptfsError) or not isinstance(exc, Exception):
        return exc
    # a collective itself failed: a peer died, timed out, or left
    failures: dict[int, str] = {}
    named = ""
    if live is not None:
        gone, why = live.missing()
        if gone:
            failures = {r: "did not finish its part (died or hung)" for r in gone}
            named = (f"rank(s) {gone} did not finish their part within "
                     f"{LIVENESS_WAIT.total_seconds():g} s (died or hung); ")
        elif gone is None:
            named = f"rank(s) unknown: {why}; "
        elif live.ranks:
            named = (f"every rank finished its part, so the coordinator (rank "
                     f"{live.ranks[0]}) most likely failed after it; ")
    outcome = ("Nothing was committed by this save" if default is not ShardedLoadError
               else "The state given to load is not fully loaded")
    return default(
        f"{what}: a checkpoint collective failed ({type(exc).__name__}: {exc}); {named}a "
        f"rank died, hung past the timeout ({COLLECTIVE_TIMEOUT}), or the process group "
        f"broke. {outcome}", failures=failures)


def _run(fn: Any, what: str, default: type[ShardedCheckpointError],
         live: _Liveness | None = None) -> Any:
    try:
        out = fn()
    except BaseException as exc:
        err = failure(exc, what, default, live)
        if err is exc:
            raise
        raise err from exc
    if live is not None:
        live.done()
    return out


# ----------------------------------------------------------------------------------------------
# The operations behind CheckpointStore.save / load / verify


@dataclasses.dataclass
class SavePrep:
    """What one collective save hands to DCP (``dcp.save`` or ``dcp.async_save``)."""

    view: dict[str, Any]
    writer: ShardedWriter
    planner: SavePlanner
    live: _Liveness
    what: str

    def info(self, md: Any) -> CheckpointInfo:
        """The committed checkpoint, from DCP's returned metadata (every rank)."""
        info = getattr(md, "_ckptfs_info", None) or self.writer.info
        return info if isinstance(info, CheckpointInfo) else \
            read_committed(self.writer.storage, self.writer.step)


def prepare_save(storage: Storage, step: int, state: Mapping[str, Any], *, group: Any,
                 algorithm: str = DEFAULT_ALGORITHM, durable: bool = True,
                 threads: int | None = None, metadata: Mapping[str, Any] | None = None,
                 kind: str = "save") -> SavePrep:
    """Writer, planner and DCP view of a collective save.  A bad state or metadata does not
    raise here: the planner raises it inside DCP, so every rank fails together."""
    check_step(step)
    deferred: BaseException | None = None
    view: dict[str, Any] = {}
    skeleton: Any = None
    try:
        view, skeleton = dcp_view(state)
        check_metadata(dict(metadata or {}))
    except CkptfsError as exc:
        deferred = exc
    writer = ShardedWriter(storage, step, algorithm=algorithm, durable=durable,
                           threads=threads, metadata=metadata, tree=skeleton)
    planner = SavePlanner(deferred_error=deferred, tree=skeleton, tree_sink=writer)
    live = _Liveness(group, kind, step)
    live.wrap(writer, "write_data")
    return SavePrep(view, writer, planner, live, f"sharded save of step {step} at {storage.url}")


def save_sharded(storage: Storage, step: int, state: Mapping[str, Any], *,
                 algorithm: str = DEFAULT_ALGORITHM, durable: bool = True,
                 threads: int | None = None, metadata: Mapping[str, Any] | None = None,
                 process_group: Any = None) -> CheckpointInfo:
    """Collective save of ``state`` (plain tensors, DTensors, values) as step ``step``; every
    rank of the group calls it and gets the same :class:`CheckpointInfo`."""
    check_step(step)
    group = collective_group(process_group)
    p = prepare_save(storage, step, state, group=group, algorithm=algorithm, durable=durable,
                     threads=threads, metadata=metadata)
    md = _run(lambda: _quiet(dcp_save, p.view, storage_writer=p.writer, planner=p.planner,
                             process_group=group, no_dist=group is None),
              p.what, ShardedSaveError, p.live)
    return p.info(md)


def load_into(storage: Storage, step: int | None, into: dict[str, Any], *,
              process_group: Any = None, verify: bool = True, threads: int | None = None,
              allow_rollback: bool = False) -> dict[str, Any]:
    """Fill ``into`` in place from a sharded checkpoint (the latest if ``step`` is None):
    collective when distributed; its tensors and DTensors define the placement wanted."""
    group = collective_group(process_group)
    deferred: BaseException | None = None
    view: dict[str, Any] = {}
    skeleton: Any = None
    try:
        view, skeleton = dcp_view(into)
    except CkptfsError as exc:
        deferred = exc
    reader = ShardedReader(storage, step, verify=verify, threads=threads,
                           allow_rollback=allow_rollback)
    if deferred is None:
        try:
            reader.resolve()
        except CkptfsError as exc:  # raised on every rank through DCP, not before it
            deferred = exc
    if deferred is not None:
        reader.defer(deferred)
    planner = LoadPlanner(deferred_error=deferred)
    where = f"sharded load of {'the latest step' if step is None else f'step {step}'} at " \
            f"{storage.url}"
    live = _Liveness(group, "load", step)
    live.wrap(reader, "read_data")
    _run(lambda: _quiet(dcp_load, view, storage_reader=reader, planner=planner,
                        process_group=group, no_dist=group is None), where, ShardedLoadError,
         live)
    write_back(into, skeleton, view)
    return into


def load_full(storage: Storage, info: CheckpointInfo, *, verify: bool = True,
              threads: int | None = None, keys: set[str] | None = None) -> dict[Any, Any]:
    """The whole checkpoint in this process, as plain full-size tensors, in the structure the
    user saved (no collectives, whatever the world size).  ``keys``: only these entries
    (dotted paths of dict keys as DCP names them, e.g. ``{"trainer", "rng.ranks.1"}``); only
    their bytes are read."""
    reader = ShardedReader(storage, info.step, verify=verify, threads=threads)
    reader.info = info
    flat: dict[str, Any] = {}
    planner = FullLoadPlanner(keys=keys)  # type: ignore[no-untyped-call]
    _run(lambda: _load_state_dict(flat, storage_reader=reader, planner=planner, no_dist=True),
         f"load of step {info.step} at {storage.url}", ShardedLoadError)
    where = storage_url(storage, info.path)
    tree = reader.document.tree if reader.document is not None else None
    if tree is not None and keys is not None:
        tree = _select(tree, set(keys)) or ["d", []]
    state = restore(tree, flat, where=where) if tree is not None else flat
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where}: the state root is not a dict", step=info.step)
    return state


def load_v2(storage: Storage, info: CheckpointInfo, *, verify: bool = True,
            mapper: TensorMap | None = None, threads: int | None = None,
            keys: list[KeyPath] | None = None, mmap: bool = False) -> dict[Any, Any]:
    """The format table's load of version 2 (:mod:`ckptfs.protocol.formats`): the listing
    checks, then :func:`load_full`, then ``keys`` and ``map_location``."""
    check_listing(storage, info)
    state = load_full(storage, info, verify=verify, threads=threads)
    return select_and_map(state, info.url, keys, mapper)


def verify_v2(storage: Storage, info: CheckpointInfo, report: VerifyReport, *,
              threads: int | None = None) -> None:
    """The format table's full verification of version 2, after the shared listing checks:
    ``dcp.msgpack`` decoded, every chunk of every file re-read and checked."""
    if report.problems:
        return
    try:
        read_document(storage, info)
    except (CorruptCheckpointError, FormatVersionError, UnsafeCheckpointError) as exc:
        report.problems.append(str(exc))
    for entry in info.manifest.files:
        chunks = entry.chunks if isinstance(entry, ChunkedFileEntry) else ()
        start, end = 0, 0
        try:
            for c in chunks:
                if end > start and c.offset + c.length - start > MAX_RANGE:
                    read_chunks(storage, info, entry, start, end - start)  # type: ignore[arg-type]
                    start = end
                end = c.offset + c.length
            if end > start:
                read_chunks(storage, info, entry, start, end - start)  # type: ignore[arg-type]
        except CorruptCheckpointError as exc:
            report.problems.append(f"{entry.path}: {exc}")
