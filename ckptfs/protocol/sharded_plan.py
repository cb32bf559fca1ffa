"""The pickle-free DCP planners of format v2 and the merge of the ranks' state trees.

DCP's default planners decide who writes what and how a checkpoint is resharded; these keep
that and change three things: non-tensor values are ckptfs's tagged msgpack (never
``torch.save``/``torch.load``), every value is stored from the lowest rank that holds it (never
a key-by-key mix of ranks' copies), and a load refuses a target tensor of another dtype before
reading anything (never a silent conversion).
"""

from __future__ import annotations

import dataclasses
import io
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)

from ckptfs.errors import UnsupportedValueError
from ckptfs.format.serialize import build_tree, check_tensor
from ckptfs.format.sharded import decode_value, encode_value
from ckptfs.format.tiling import summary, tiling_errors
from ckptfs.protocol.collective import is_dtensor
from ckptfs.protocol.gcpause import paused_collector
from ckptfs.protocol.load_options import dtype_mismatch
from ckptfs.torch_compat import (
    EmptyStateDictLoadPlanner,
    dtensor_local,
    set_element,
    sharded_tensor_shards,
)

if TYPE_CHECKING:  # the save's planning modules, imported by a save only (not by a load)
    from ckptfs.protocol.global_plan import GlobalPlan
    from ckptfs.protocol.plan_table import LocalTable


def _several_ranks() -> bool:
    """Whether other ranks may hold copies of this rank's items (a world of more than one)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class SavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner`` (flattening, deduplication of replicated items), with every
    non-tensor value encoded by ckptfs (tagged msgpack) instead of ``torch.save``.  Values are
    encoded while the local plan is made, so a value the format cannot hold fails the save on
    every rank before any byte is written."""

    def __init__(self, *args: Any, deferred_error: BaseException | None = None,
                 tree: Any = None, tree_sink: Any = None, gather_small: bool = False,
                 divergent_keys: Iterable[str] | None = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Key prefixes whose copies may differ between ranks (the lowest rank's is stored);
        #: None: replicas are not compared at all (`ckptfs.protocol.replicas`).
        self._divergent = None if divergent_keys is None else tuple(divergent_keys)
        #: Format v5 (per-rank metadata): small replicated tensors are stored by the lowest
        #: rank holding them (`small_tensors_from_lowest_rank`), so a loading rank reads the
        #: index documents of few ranks besides its own.
        self._gather_small = gather_small
        self._deferred = deferred_error
        self._encoded: dict[str, bytes] = {}
        self._tree = tree            # this rank's skeleton (store.save), sent with its plan
        self._tree_sink = tree_sink  # the coordinator's writer: gets the merged skeleton
        #: The items this rank writes in part: each one's local item and first row (finish_plan).
        self._pieces: dict[MetadataIndex, tuple[WriteItem, int]] = {}
        #: Replica digests taken before planning, by name (`digest_replicas_now`).
        self._known: dict[str, int] | None = None

    def digest_replicas_now(self, places: Iterable[tuple[str, torch.Tensor, Any]]) -> None:
        """Take the replica digests now, from the caller's tensors at their ``places``
        (`ckptfs.protocol.replicas.digests_of`), instead of while planning: an async save
        streamed through its staging budget plans over copies not all staged yet."""
        if self._divergent is not None and _several_ranks():
            from ckptfs.protocol.replicas import digests_of

            self._known = digests_of(places, self._divergent)

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        if self._deferred is not None:
            raise self._deferred
        check_tensors(state_dict)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def _key_path(self, fqn: str) -> tuple[Any, ...]:
        """The value's key path in the state (DCP's flattening map), for error messages."""
        return tuple(getattr(self, "mappings", {}).get(fqn, (fqn,)))

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._encoded = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                fqn = item.index.fqn
                self._encoded[fqn] = encode_value(self.lookup_object(item.index), key=fqn,
                                                  path=self._key_path(fqn))
        if isinstance(plan.planner_data, dict):
            from ckptfs.protocol.plan_table import PlanMappings  # a save's modules

            mappings = PlanMappings(plan.planner_data)
            mappings.tree = self._tree
            if self._divergent is not None and _several_ranks():
                from ckptfs.protocol.replicas import replica_digests

                mappings.replicas = replica_digests(plan.items, self.state_dict,
                                                    self.lookup_object, self._divergent,
                                                    known=self._known)
            plan = dataclasses.replace(plan, planner_data=mappings)
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # DCP's hook (a plain ``dcp.save``): the global plan of the plans' tables
        # (`_create_global_plan`), through DCP's own bookkeeping (its plan caching's path too).
        with paused_collector():  # one write item and chunk per shard: gcpause's docstring
            return super().create_global_plan(all_plans)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        from ckptfs.protocol.plan_table import LocalTable

        tables = [LocalTable.of_plan(p) for p in all_plans]
        plan = self.create_global_table(tables)
        return plan.save_plans(tables), plan.metadata()

    def create_global_table(self, tables: list[LocalTable]) -> GlobalPlan:
        """The global plan of every rank's local plan (``tables``, rank order): the last one
        again when every rank's plan has the layout it had at the last save this process
        coordinated (`plan_table.layout_of`, of what each rank sent; `_PLAN_CACHE`), else made in
        columns (`ckptfs.protocol.global_plan.global_plan`: DCP's plan and metadata, every
        value from the lowest rank holding it, each replicated tensor written by the holder
        `balance_writers` picks; DCP's check that every tensor's chunks tile it, by sorting).
        Values only some ranks hold (rank-keyed entries, e.g. each rank's RNG state) are stored
        by those ranks: the skeleton of the full load is the union of every rank's (the tree
        sink gets it), not the coordinator's alone, or a full load would silently drop them."""
        with paused_collector():
            trees = [getattr(t.planner_data, "tree", None) for t in tables]
            if self._tree_sink is not None and any(t is not None for t in trees):
                self._tree_sink.tree = merge_trees(trees)
            layouts = tuple(t.layout for t in tables)
            key = (self.flatten_state_dict, self._gather_small, self._divergent, layouts) \
                if None not in layouts else None
            with _PLAN_CACHE.lock:
                cached: GlobalPlan | None = _PLAN_CACHE.plan \
                    if key is not None and _PLAN_CACHE.key == key else None
            if cached is not None:
                cached.check_replicas(tables)
                return cached
            from ckptfs.protocol import global_plan as planning

            plan = planning.global_plan(tables, gather_small=self._gather_small,
                                        merge_mappings=self.flatten_state_dict,
                                        divergent=self._divergent or ())
            plan.check_replicas(tables)
            if key is not None:
                with _PLAN_CACHE.lock:
                    _PLAN_CACHE.key, _PLAN_CACHE.plan = key, plan
            return plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        # The items this rank writes in part (a replicated tensor split between its holders,
        # `global_plan.piece_of`): each one's item of the local plan, and its first row there.
        local = getattr(self, "plan", None)
        items = local.items if local is not None else []
        self._pieces = {}
        # ckptfs's rounds hand each rank its own items (only a piece's data is new); DCP's own
        # scatter hands copies, each then looked up by its index.
        own = {id(i.tensor_data) for i in items if i.tensor_data is not None}
        suspects = [i for i in new_plan.items
                    if i.tensor_data is not None and id(i.tensor_data) not in own]
        mine = {item.index: item for item in items} if suspects else {}
        for item in suspects:
            td = item.tensor_data
            assert td is not None
            same = mine.get(item.index)
            if same is not None and same.tensor_data is not None \
                    and same.tensor_data.chunk == td.chunk:
                continue  # a whole item of its own
            for orig in (o for o in items if o.index.fqn == item.index.fqn):
                oc = orig.tensor_data.chunk if orig.tensor_data is not None else None
                if oc is not None and len(oc.offsets) == len(td.chunk.offsets) > 0 and \
                        oc.offsets[1:] == td.chunk.offsets[1:] and \
                        oc.sizes[1:] == td.chunk.sizes[1:] and \
                        oc.offsets[0] <= td.chunk.offsets[0] and \
                        td.chunk.offsets[0] + td.chunk.sizes[0] <= oc.offsets[0] + oc.sizes[0]:
                    self._pieces[item.index] = (orig, td.chunk.offsets[0] - oc.offsets[0])
                    break
        return super().finish_plan(new_plan)

    def resolve_data(self, write_item: WriteItem) -> Any:
        piece = self._pieces.get(write_item.index)
        if piece is None or write_item.tensor_data is None:
            return super().resolve_data(write_item)
        orig, start = piece
        whole = super().resolve_data(orig)
        if not isinstance(whole, torch.Tensor):
            raise UnsupportedValueError(f"{write_item.index.fqn!r}: a piece of a value")
        return whole.narrow(0, start, write_item.tensor_data.chunk.sizes[0])

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            fqn = write_item.index.fqn
            blob = self._encoded.get(fqn)
            if blob is None:
                blob = encode_value(object, key=fqn, path=self._key_path(fqn))
            return io.BytesIO(blob)
        return object


def check_tensors(state_dict: Mapping[str, Any]) -> None:
    """Every tensor DCP would plan (the leaves of dicts and lists of ``state_dict``; a DTensor
    by its local shard, a ``ShardedTensor`` (FSDP1) by its local shards' tensors) is one the
    format can store
    (`check_tensor`, the single-process save's own check), else
    `UnsupportedValueError` naming its key path, raised in the planner's set-up, so on
    every rank and before DCP's planning touches it (a nested or meta tensor, or a wrapper
    subclass, made DCP itself fail with an untyped error)."""
    todo: list[tuple[Any, tuple[Any, ...]]] = [(state_dict, ())]
    while todo:
        node, path = todo.pop()
        if isinstance(node, torch.Tensor):
            where = "/".join(str(p) for p in path) or "<root>"
            shards = sharded_tensor_shards(node)
            for t in shards if shards is not None else \
                    [dtensor_local(node) if is_dtensor(node) else node]:
                check_tensor(t, where)
        elif isinstance(node, Mapping):
            todo.extend(reversed([(v, (*path, k)) for k, v in node.items()]))
        elif isinstance(node, list):
            todo.extend(reversed([(v, (*path, i)) for i, v in enumerate(node)]))


def values_from_lowest_rank(plans: list[SavePlan]) -> list[SavePlan]:
    """Every non-tensor value is stored from the lowest rank that holds it (rank 0's copy of
    every value rank 0 holds), so values that differ between ranks are never mixed key by key.
    DCP's own deduplication would spread them over the ranks to balance the writes; replicated
    tensors still are (they must be equal on every rank)."""
    owner: dict[MetadataIndex, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                owner.setdefault(item.index, rank)
    return [dataclasses.replace(plan, items=[
        item for item in plan.items
        if item.type != WriteItemType.BYTE_IO or owner[item.index] == rank])
        for rank, plan in enumerate(plans)]


@dataclasses.dataclass
class _PlanCache:
    """The global plan of the last save this process coordinated, by the layouts of its
    ranks' local plans (`SavePlanner.create_global_table`).  One entry: a training job saves
    one layout over and over; a new layout replaces it."""

    key: Any = None
    plan: Any = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_PLAN_CACHE = _PlanCache()


def _key_id(encoded: Any) -> str:
    return repr(encoded)


def _describe(node: Any) -> str:
    kind = node[0] if isinstance(node, list) and node else ""
    return {"d": "a dict", "l": "a list", "t": "a tuple", "v": "a value"}.get(
        str(kind), "an unknown node")


def merge_trees(trees: list[Any]) -> Any:
    """The union of the ranks' skeletons (rank order: the coordinator's entries first).  Dicts
    merge by key, lists by index; a path that is a container on one rank and a value (or
    another kind of container) on another raises `UnsupportedValueError`."""
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

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is not None:
            check_dtypes(self.state_dict, self.metadata)
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_value(self, read_item, value)


def check_dtypes(state_dict: Mapping[str, Any], metadata: Metadata) -> None:
    """Every tensor (or DTensor) to load into has its stored dtype: checked before anything is
    read, so a mismatch leaves ``into`` untouched (ckptfs never converts dtypes on load)."""
    stored = metadata.state_dict_metadata
    for fqn, obj in state_dict.items():
        sm = stored.get(fqn)
        if isinstance(obj, torch.Tensor) and isinstance(sm, TensorStorageMetadata) and \
                obj.dtype != sm.properties.dtype:
            raise dtype_mismatch(fqn, sm.properties.dtype, obj.dtype, "")


class FullLoadPlanner(EmptyStateDictLoadPlanner):
    """Loads a whole checkpoint into an empty dict (full-size plain tensors), pickle-free."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_value(self, read_item, value)


# ----------------------------------------------------------------------------------------------
# The global plan's check


def check_global_plan(global_plan: list[SavePlan], metadata: Metadata) -> None:
    """DCP's check of a global save plan, with the same verdict and error (``ValueError``,
    "Failed to validate global plan: ..."), in O(n log n) for the chunk layouts sharding makes
    (DCP compares every pair of chunks whose extents along one dimension meet: quadratic in the
    ranks for an FSDP shard of a tensor wider than it is tall).  For every tensor of more than
    0 dimensions: every chunk lies within the tensor, no two chunks overlap, and (more than one
    plan) the chunks' volumes sum to the tensor's (`tiling_errors`, format/tiling.py)."""
    errors: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) or len(value.size) == 0:
            continue
        errors += tiling_errors(key, tuple(value.size), value.chunks,
                                check_volume=len(global_plan) > 1)
    if errors:
        raise ValueError(f"Failed to validate global plan: {summary(errors)}")
