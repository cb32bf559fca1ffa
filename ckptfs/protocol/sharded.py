"""Sharded checkpoints (format v2): collective save, load into any world size, full load in one
process, verification, and the collectives' failure handling.  The pickle-free DCP planners are
`ckptfs.protocol.sharded_plan`, the storage writer and reader
`sharded_io` and `sharded_read`, the format's
codecs `ckptfs.format.sharded` and `ckptfs.format.sharded_metadata`.

Design decision: **DCP plans, ckptfs stores and commits.**  torch.distributed.checkpoint's own
planners decide who writes what (DTensor shards by their owners, replicated values once) and how
a checkpoint is resharded on load; ckptfs's `ShardedWriter`
and `ShardedReader` put the bytes into one attempt, hash
every byte once, verify every byte read, and commit with the same marker as format v1.

A save is driven by ckptfs over its group (`ckptfs.protocol.save_rounds`: the planner and the
writer called as ``dcp.save`` calls them, every message a JSON document); a load by DCP's
``dcp.load``.  Every rank enters the collective even when its own input is bad: an error found
before planning (a key the format cannot hold) is raised inside the planning step, where it is
gathered, so all ranks fail together instead of leaving the others waiting.  Failures come as
DCP's ``CheckpointException`` (a ``BaseException``) from both; `map_failure` turns it into a
ckptfs error naming the failing ranks, raised on every rank.  The collectives run on a
dedicated gloo group (made by `ckptfs.protocol.group.gloo_group`) whose timeout
(`COLLECTIVE_TIMEOUT`) bounds how long a rank waits for a dead, hung or absent peer, the
group's own creation included; `Liveness` (``ckptfs.protocol.group``) names that peer.

A collective save, step by step (every rank calls ``store.save``: `ckptfs.protocol.prepare`)::

    every rank    sets its liveness key ("in"); ckptfs's gloo group (created at the first save)
    every rank    drive_save -> planner: the state's DCP view, values encoded (a bad value
                  raises here, gathered from every rank), the local plan (its items left out
                  when the coordinator has them: the same layout as the last save)
    coordinator   values from the lowest rank holding them; ShardedWriter.prepare_global_plan:
                  one attempt, the manifest checked against every reader limit; each rank
                  receives its own part of the global plan
    every rank    ShardedWriter.write_data: its rank file, hashed while written; key "done"
    coordinator   ShardedWriter.finish: dcp.msgpack, MANIFEST.json, COMPLETE (Attempt.commit)
    every rank    the same CheckpointInfo (sent as its manifest and marker), or the same typed
                  error

A collective load (`load_into`) runs the reader's sequence of
`ShardedReader`; the full load (`load_full`, one
process) lists the attempt and reads ``dcp.msgpack`` before DCP runs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ckptfs.errors import (
    CheckpointDeletedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    ExtensionTypeError,
    InvalidStepError,
    LoadOptionError,
    SaveDeadlineError,
    ShardedCheckpointError,
    ShardedLoadError,
    ShardedSaveDeadlineError,
    ShardedSaveError,
    UnsupportedValueError,
)
from ckptfs.format.extensions import unregistered_as_dict
from ckptfs.format.incremental import references_of
from ckptfs.format.layout import check_step
from ckptfs.format.manifest import check_metadata
from ckptfs.format.serialize import build_tree
from ckptfs.format.sharded import METADATA_NAME, ChunkedFileEntry, decode_value
from ckptfs.format.sharded_metadata import DcpDocument, check_rank_header, items_by_file
from ckptfs.format.sharded_tree import dcp_view, regions_of, restore, write_back
from ckptfs.format.versions import has_rank_metadata, is_sharded
from ckptfs.protocol.chunks import entry_location, read_chunks
from ckptfs.protocol.collective import is_distributed
from ckptfs.protocol.commit import write_again_if_gone
from ckptfs.protocol.group import (
    LIVENESS_WAIT,
    Liveness,
    bytes_group,
    collective_failure,
    gloo_group,
    group_of,
)
from ckptfs.protocol.incremental import ProtectorGoneError
from ckptfs.protocol.listing import check_listing
from ckptfs.protocol.load_options import KeyPath, TensorMap, select_and_map
from ckptfs.protocol.options import SaveOptions
from ckptfs.protocol.reader import VerifyReport
from ckptfs.protocol.resolve import CheckpointInfo, read_committed, storage_url, walk_latest
from ckptfs.protocol.sharded_io import ShardedWriter
from ckptfs.protocol.sharded_plan import (
    FullLoadPlanner,
    LoadPlanner,
    SavePlanner,
    merge_trees,
    values_from_lowest_rank,
)
from ckptfs.protocol.sharded_read import (
    MAX_RANGE,
    ShardedReader,
    read_document,
    sharded_manifest,
)
from ckptfs.storage.base import Storage
from ckptfs.torch_compat import group_timeout, load_state_dict

__all__ = ["COLLECTIVE_TIMEOUT", "LIVENESS_WAIT", "FullLoadPlanner", "Liveness", "LoadPlanner",
           "SavePlanner", "SavePrep", "collective_group", "failure", "liveness", "load_full",
           "load_into", "load_sharded", "map_failure", "merge_trees", "prepare_save",
           "save_prepared", "values_from_lowest_rank", "verify_sharded"]

log = logging.getLogger("ckptfs")

#: How long a rank waits in a checkpoint collective for its peers (a dead or hung rank) before
#: the save or load fails on every surviving rank.  Applies to the dedicated gloo group ckptfs
#: creates (its creation, at the first collective save or load, included); pass
#: ``process_group=`` to use a group (and timeout) of your own.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

#: ckptfs's dedicated gloo group of the current world (`collective_group`): ``[the default
#: group, its gloo group]``.  The default group is kept and compared by identity, never by
#: ``id()``: once a world is destroyed a new one may get the old one's id, and a group of the
#: old world would then be handed out (its collectives fail: "not initialized in the world
#: group map").
_GROUP: list[Any] = []


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


# ----------------------------------------------------------------------------------------------
# Collectives


def collective_group(process_group: Any = None, *, what: str = "a checkpoint collective",
                     default: type[ShardedCheckpointError] = ShardedCheckpointError,
                     live: Liveness | None = None) -> Any:
    """``process_group``, or ckptfs's dedicated gloo group (created once, collectively, with
    `COLLECTIVE_TIMEOUT`, which also bounds its creation: a rank that never joins fails
    it with ``default`` naming that rank, instead of falling back to the default group and its
    timeout), or ``None`` when not distributed."""
    if process_group is not None or not is_distributed():
        return process_group
    world = dist.group.WORLD
    if _GROUP and _GROUP[0] is world:
        return _GROUP[1]
    group = gloo_group(COLLECTIVE_TIMEOUT, what=f"{what}: creating ckptfs's gloo group",
                       default=default, live=live)
    _GROUP[:] = [world, group]
    return group


_PASS_THROUGH = (CheckpointExistsError, CheckpointNotFoundError, UnsupportedValueError,
                 InvalidStepError, CorruptCheckpointError, LoadOptionError, ExtensionTypeError,
                 ProtectorGoneError)


def map_failure(exc: CheckpointException, what: str,
                default: type[ShardedCheckpointError]) -> CkptfsError:
    """The ckptfs error for a DCP ``CheckpointException``: the failing ranks' own error class
    when they all failed the same documented way (an existing step, a corrupt file, a newer
    format, a bad value or target), else ``default``; the message names every failing rank
    and its error."""
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
        if issubclass(cls, default):  # a refinement of it (ReplicaMismatchError, say)
            return cls(msg, failures=summary)
    if default is ShardedSaveError and any(isinstance(e, SaveDeadlineError)
                                           for e in excs.values()):
        return ShardedSaveDeadlineError(msg, failures=summary)  # names the stalled rank(s)
    return default(msg, failures=summary)


def _timeout_of(process_group: Any) -> timedelta | None:
    """The timeout bounding a collective of ``process_group`` (the dedicated group's if None)."""
    if process_group is None:
        return COLLECTIVE_TIMEOUT
    return group_timeout(process_group)


def failure(exc: BaseException, what: str, default: type[ShardedCheckpointError],
            live: Liveness | None = None) -> BaseException:
    """The error to raise for ``exc`` raised by a DCP collective (``exc`` itself when it is a
    ckptfs error or not an ``Exception``): also used for async saves (their future's error)."""
    if isinstance(exc, CheckpointException):
        return map_failure(exc, what, default)
    if isinstance(exc, CkptfsError) or not isinstance(exc, Exception):
        return exc
    return collective_failure(exc, what, default, live)


def _run(fn: Any, what: str, default: type[ShardedCheckpointError],
         live: Liveness | None = None) -> Any:
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


def liveness(process_group: Any, kind: str, step: int | None) -> Liveness:
    """The liveness keys of one collective save or load on ``process_group`` (None: ckptfs's
    own group, whose ranks, before it exists, are the world's), set now, before its first
    collective (the creation of a group included), so that a rank that never comes is
    named."""
    return Liveness(_participants(process_group), kind, step,
                    timeout=_timeout_of(process_group))


def _participants(process_group: Any) -> Any:
    """The group whose ranks take part (before ckptfs's own group exists: the world)."""
    if process_group is not None:
        return process_group
    return dist.group.WORLD if is_distributed() else None


# ----------------------------------------------------------------------------------------------
# The operations behind CheckpointStore.save / load / verify


@dataclasses.dataclass
class SavePrep:
    """What one collective save hands to its driver (`drive_save`, on the caller's thread or
    an async save's)."""

    view: dict[str, Any]
    writer: ShardedWriter
    planner: SavePlanner
    live: Liveness
    what: str
    #: The same save prepared again over a (snapshot) view, with a fresh writer and planner
    #: (`in_full`); the liveness given, or a new one.
    remake: Callable[[dict[str, Any], Liveness | None], SavePrep]

    def info(self, md: Any) -> CheckpointInfo:
        """The committed checkpoint (every rank): ``md`` itself (`drive_save`'s outcome), or
        carried by DCP's returned metadata (``dcp.async_save``)."""
        info = md if isinstance(md, CheckpointInfo) else \
            getattr(md, "_ckptfs_info", None) or self.writer.info
        return info if isinstance(info, CheckpointInfo) else \
            read_committed(self.writer.storage, self.writer.step)

    def finished(self, md: Any) -> CheckpointInfo:
        """Every rank, once DCP returned: the committed checkpoint, whose items become this
        rank's reuse index of its next incremental save (`ShardedWriter.remember`)."""
        info = self.info(md)
        self.writer.remember(info)
        return info

    def in_full(self, live: Liveness | None = None) -> SavePrep:
        """The same save prepared again over its view, for the "write everything again"
        retry (`ckptfs.protocol.commit.write_again_if_gone`, which has forgotten this rank's
        reuse memory first, so it references nothing)."""
        again = self.remake(self.view, live)
        again.writer.hint = self.writer.hint
        return again


def prepare_save(storage: Storage, step: int, state: Mapping[str, Any], opts: SaveOptions, *,
                 group: Any, metadata: Mapping[str, Any] | None = None, kind: str = "save",
                 live: Liveness | None = None) -> SavePrep:
    """Writer, planner and DCP view of a collective save with the options ``opts``.  A bad
    state or metadata does not raise here: the planner raises it inside DCP, so every rank
    fails together.  ``opts.reuse``: an incremental save (format v4), each rank reusing its
    own unchanged items."""
    check_step(step)
    deferred: BaseException | None = None
    view: dict[str, Any] = {}
    skeleton: Any = None
    try:
        view, skeleton = dcp_view(state)
        check_metadata(dict(metadata or {}))
    except CkptfsError as exc:
        deferred = exc
    what = f"sharded save of step {step} at {storage.url}"
    world = dist.get_world_size(group) if is_distributed() else 1  # (None: the world)

    def make(v: dict[str, Any], live: Liveness | None) -> SavePrep:
        writer = ShardedWriter(storage, step, opts, metadata=metadata, tree=skeleton,
                               world=world)
        planner = SavePlanner(deferred_error=deferred, tree=skeleton, tree_sink=writer,
                              gather_small=writer.per_rank is not None,
                              divergent_keys=opts.divergent_keys)
        if live is None:
            live = Liveness(group, kind, step)
        live.wrap(writer, "write_data")
        return SavePrep(v, writer, planner, live, what, make)

    return make(view, live)


def _save_once(p: SavePrep, group: Any) -> CheckpointInfo:
    """One collective save of a prepared save on ``group`` (every rank), driven by ckptfs
    over its group (`ckptfs.protocol.save_rounds`: DCP's planner and the writer called as
    ``dcp.save`` calls them, the messages JSON, no whole plan sent to every rank)."""
    from ckptfs.protocol.save_rounds import drive_save  # a save's modules: not a load's

    info = _run(lambda: drive_save(p.view, p.writer, p.planner, group_of(group)),
                p.what, ShardedSaveError, p.live)
    return p.finished(info)


def save_prepared(p: SavePrep, group: Any, *,
                  renew: Callable[[], Liveness] | None = None) -> CheckpointInfo:
    """Run a prepared collective save with ``dcp.save`` on ``group`` (every rank, on whatever
    thread: ``store.save`` on the caller's, ``save_async`` on the store's own): the committed
    checkpoint, or the typed error of `failure` on every rank.  An incremental save whose
    protector went away (every rank got `ProtectorGoneError` from the coordinator's fence) is
    retried here, once, on every rank, writing every byte: the one retry of every incremental
    writer (`ckptfs.protocol.commit.write_again_if_gone`) over `SavePrep.in_full`, with the
    liveness keys ``renew()`` sets for the second collective."""
    if p.writer.memory is None:  # only an incremental save fences
        return _save_once(p, group)

    def save(reuse: bool) -> CheckpointInfo:
        if reuse:
            return _save_once(p, group)
        return _save_once(p.in_full(live=None if renew is None else renew()), group)

    return write_again_if_gone(p.what, save, p.writer.forget)


def load_into(storage: Storage, step: int | None, into: dict[str, Any], *,
              process_group: Any = None, verify: bool = True, threads: int | None = None,
              allow_rollback: bool = False, reader: ShardedReader | None = None
              ) -> dict[str, Any]:
    """Fill ``into`` in place from a sharded checkpoint (the latest if ``step`` is None):
    collective when distributed; its tensors and DTensors define the placement wanted.  A
    failure (a corrupt or newer ``dcp.msgpack``, a target of another dtype...) raises the same
    typed error on every rank.  ``reader``: a reader of its own (a two-tier store's, reading
    each file where this rank finds it: docs/tiers.md).

    ``allow_rollback`` (the latest step): the one walk (`walk_latest`), as ``store.load``
    does, with the collective load as its check: a step whose load fails as corrupt on any
    rank (DCP gathers the failure, so every rank sees the same error and takes the same
    decision) is logged and skipped, and the next older step is loaded into ``into``, whose
    objects are touched again by that load (its values only once a load succeeded)."""
    live = liveness(process_group, "load", step)
    where = f"sharded load of {'the latest step' if step is None else f'step {step}'} at " \
            f"{storage.url}"
    group = collective_group(process_group, what=where, default=ShardedLoadError, live=live)
    if step is not None or not allow_rollback or reader is not None:
        return _load_once(storage, step, into, group, live, where, verify=verify,
                          threads=threads, allow_rollback=allow_rollback, reader=reader)
    first: list[Liveness] = [live]

    def use(info: CheckpointInfo) -> dict[str, Any]:
        one = ShardedReader(storage, info.step, verify=verify, threads=threads,
                            regions=_regions(into))
        one.info = info
        keys = first.pop() if first else liveness(process_group, "load", info.step)
        try:
            return _load_once(storage, info.step, into, group, keys, where, verify=verify,
                              threads=threads, reader=one)
        except CheckpointDeletedError:
            raise  # the walk lists again
        except CheckpointNotFoundError as exc:  # a refusal, never "incomplete": not skipped
            raise _Refusal(exc) from exc

    skipped: list[str] = []
    try:
        found = walk_latest(storage, use, allow_rollback=True, skipped=skipped)
    except _Refusal as refusal:
        raise refusal.error from None
    if found is None:
        raise CheckpointNotFoundError(
            f"no committed checkpoint to load at {storage.url}"
            + (f" (skipped corrupt: {'; '.join(skipped)})" if skipped else ""))
    return into


def _regions(into: dict[str, Any]) -> Any:
    """The regions a load into ``into`` wants (None: everything, if it is not a state DCP can
    flatten: the load raises that error itself)."""
    try:
        return regions_of(dcp_view(into)[0])
    except CkptfsError:
        return None


class _Refusal(Exception):
    """Carries a `CheckpointNotFoundError` of a collective load through the walk, which
    would otherwise take it for an incomplete step and pass over it."""

    def __init__(self, error: CheckpointNotFoundError) -> None:
        super().__init__(str(error))
        self.error = error


def _load_once(storage: Storage, step: int | None, into: dict[str, Any], group: Any,
               live: Liveness, where: str, *, verify: bool, threads: int | None,
               allow_rollback: bool = False, reader: ShardedReader | None = None
               ) -> dict[str, Any]:
    """One collective load into ``into`` (`load_into`): every error found before DCP runs
    (a bad target, an unresolvable step) is raised inside DCP, on every rank together."""
    deferred: BaseException | None = None
    view: dict[str, Any] = {}
    skeleton: Any = None
    try:
        view, skeleton = dcp_view(into)
    except CkptfsError as exc:
        deferred = exc
    if reader is None:
        reader = ShardedReader(storage, step, verify=verify, threads=threads,
                               allow_rollback=allow_rollback, regions=regions_of(view))
    files_layout: CheckpointInfo | None = None
    if deferred is None:
        try:
            info = reader.resolve_any()
            if is_sharded(info.manifest) or not reader.reads_any_layout:
                reader.resolve()
            else:
                files_layout = info
        except CkptfsError as exc:  # raised on every rank through DCP, not before it
            deferred = exc
    if files_layout is not None:  # format v1/v3: each rank reads what its targets hold
        from ckptfs.protocol.files_into import load_files_into

        _run(lambda: load_files_into(storage, files_layout, into, group_of(group),
                                     verify=verify, threads=threads or 4),
             where, ShardedLoadError, live)
        return into
    if deferred is not None:
        reader.defer(deferred)
    if reader.peers is None:  # chunks several ranks need are read once (docs/sharded.md)
        reader.peers = bytes_group(group)
    planner = LoadPlanner()
    reader.on_progress = live.progress
    live.wrap(reader, "read_data")
    # Driven by ckptfs over its group (`ckptfs.protocol.load_rounds`: DCP's planner and the
    # reader called as dcp.load calls them; JSON messages, each rank receiving its own part).
    from ckptfs.protocol.load_rounds import drive_load  # a load's modules: not a save's

    cooperative = reader.cooperative and reader.peers is not None
    _run(lambda: drive_load(view, reader, planner, group_of(group), cooperative=cooperative),
         where, ShardedLoadError, live)
    write_back(into, skeleton, view)
    return into


def load_full(storage: Storage, info: CheckpointInfo, *, verify: bool = True,
              threads: int | None = None, keys: set[str] | None = None) -> dict[Any, Any]:
    """The whole checkpoint in this process, as plain full-size tensors, in the structure the
    user saved (no collectives, whatever the world size).  First the listing (§5: links
    refused, every size as declared), then ``dcp.msgpack`` (typed errors, raised here), then
    DCP's load.  ``keys``: only these entries (dotted paths of dict keys as DCP names them,
    e.g. ``{"trainer", "rng.ranks.1"}``); only their bytes are read."""
    if has_rank_metadata(info.manifest):  # format v5: every rank's rows and index, checked
        from ckptfs.protocol.rank_metadata import expand
        info = expand(storage, info)
    check_listing(storage, info)
    reader = ShardedReader(storage, info.step, verify=verify, threads=threads)
    reader.info = info
    reader.listing_checked = True
    document = reader.load_document()
    flat: dict[str, Any] = {}
    planner = FullLoadPlanner(keys=keys)  # type: ignore[no-untyped-call]
    _run(lambda: load_state_dict(flat, storage_reader=reader, planner=planner, no_dist=True),
         f"load of step {info.step} at {storage.url}", ShardedLoadError)
    where = storage_url(storage, info.path)
    tree = document.tree
    if tree is not None and keys is not None:
        tree = _select(tree, set(keys)) or ["d", []]
    state = restore(tree, flat, where=where) if tree is not None else flat
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where}: the state root is not a dict", step=info.step)
    return state


def load_sharded(storage: Storage, info: CheckpointInfo, *, verify: bool = True,
            mapper: TensorMap | None = None, threads: int | None = None,
            keys: list[KeyPath] | None = None, mmap: bool = False) -> dict[Any, Any]:
    """The format table's load of version 2 (`ckptfs.protocol.formats`):
    `load_full` (the shared listing checks first), then ``keys`` and
    ``map_location``."""
    state = load_full(storage, info, verify=verify, threads=threads)
    return select_and_map(state, info.url, keys, mapper)


def verify_sharded(storage: Storage, info: CheckpointInfo, report: VerifyReport, *,
              threads: int | None = None) -> None:
    """The format table's full verification of version 2, after the shared listing checks
    (files the listing already condemned are not read again): ``dcp.msgpack`` decoded with
    every rule of §8.4 (each tensor covered exactly once by its chunks, each item a chunk of a
    rank file), every chunk of every file re-read and its digest checked, every rank file's
    safetensors header checked against ``dcp.msgpack``, and every value document decoded
    (§8.5; extension type names are not looked up)."""
    condemned = {p.split(":", 1)[0] for p in report.problems}
    document: DcpDocument | None = None
    if METADATA_NAME not in condemned:
        try:
            document = read_document(storage, info)
        except CorruptCheckpointError as exc:
            report.problems.append(str(exc))
            condemned.add(METADATA_NAME)
    by_file = items_by_file(document) if document is not None else {}

    def check(entry: ChunkedFileEntry) -> str | None:
        where = storage_url(storage, entry_location(info, entry))
        values = {(i.offset, i.length): i.fqn for i in by_file.get(entry.path, [])
                  if i.offsets is None}
        try:
            for start, view in _runs(storage, info, entry):
                if start == 0 and entry.path.endswith(".safetensors") and document is not None:
                    check_rank_header(view[:entry.chunks[0].length], entry,
                                      by_file.get(entry.path, []), where=where)
                for (off, length), fqn in values.items():
                    if start <= off and off + length <= start + len(view):
                        with unregistered_as_dict():
                            decode_value(view[off - start:off - start + length],
                                         where=f"{where}: stored value {fqn!r}")
        except (CorruptCheckpointError, ExtensionTypeError) as exc:
            return f"{entry.path}: {exc}"
        return None

    manifest = sharded_manifest(info)
    todo = [e for e in manifest.files
            if isinstance(e, ChunkedFileEntry) and e.path not in condemned]
    todo += [manifest.chunked(r.path) for r in references_of(manifest)
             if r.path not in condemned]
    with ThreadPoolExecutor(max(1, min(threads or 4, len(todo) or 1)),
                            thread_name_prefix="ckptfs-verify") as pool:
        for problem in pool.map(check, todo):
            if problem:
                report.problems.append(problem)


def _runs(storage: Storage, info: CheckpointInfo, entry: ChunkedFileEntry) -> Any:
    """(offset, verified bytes) of ``entry``, in runs of adjacent whole chunks of at most
    `MAX_RANGE` (a larger chunk alone), in file order.  A reference's chunks (format
    v4) need not tile its file: a run ends where they leave a gap."""
    start, end = 0, 0
    for c in entry.chunks:
        if end > start and (c.offset != end or c.offset + c.length - start > MAX_RANGE):
            yield start, read_chunks(storage, info, entry, start, end - start)
            start = c.offset
        elif end == start:
            start = c.offset
        end = c.offset + c.length
    if end > start:
        yield start, read_chunks(storage, info, entry, start, end - start)
