"""The user's state tree in a sharded checkpoint.  Pure: no I/O.

DCP flattens a state dict by its own rules: dict keys become ``str(key)``, lists holding tensors
or dicts are walked (``model.layers.0.weight``), and everything else is one opaque leaf.  That
loses int keys (``{0: ...}`` comes back as ``{"0": ...}``) and cannot shard a tensor inside a
tuple.  ckptfs keeps DCP's naming (so a checkpoint written by ``store.save`` loads with plain
``dcp.load`` and the other way round) and stores the exact tree beside it:

* `dcp_view` turns the state into the dict DCP is given (str keys, tuples holding tensors
  as lists) and returns a *skeleton*: the tagged tree of v1 (``state.msgpack``'s tags), in
  which every value DCP stores is the node ``["v", null]``;
* `restore` rebuilds the user's types from the skeleton and DCP's unflattened result;
* `write_back` puts the non-tensor values DCP loaded into the caller's own containers
  (tensors are filled in place by DCP).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptfs.errors import CorruptCheckpointError, UnsupportedValueError
from ckptfs.format.limits import MAX_DEPTH
from ckptfs.format.serialize import Flattener, build_tree

_LEAF = "v"
_KEY_TYPES = (str, int, float, bool, type(None), bytes)


def _plain_key(key: Any) -> bool:
    """A key whose ``str()`` docs/protocol.md §8.4 defines: exactly str, int, float, bool,
    None, bytes, or a tuple of such keys (not a subclass: an Enum or ``torch.Size`` renders
    otherwise)."""
    if type(key) is tuple:
        return all(_plain_key(k) for k in key)
    return type(key) in _KEY_TYPES


def _walked(value: Any) -> bool:
    """Whether a list/tuple is a container in the view (DCP walks it): it holds a tensor, a
    dict, or a walked list/tuple.  Empty sequences and sequences of plain values are leaves."""
    if not isinstance(value, (list, tuple)) or isinstance(value, torch.Size):
        return False
    return any(isinstance(v, (torch.Tensor, Mapping)) or _walked(v) for v in value)


def _where(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def dcp_view(state: Mapping[Any, Any]) -> tuple[dict[str, Any], Any]:
    """(the dict handed to DCP, the skeleton).  The view shares every tensor and value with
    ``state`` (nothing is copied).  Raises `UnsupportedValueError` naming the key paths
    when two values would get the same DCP name (two keys of one dict that read the same as
    strings, ``0`` and ``"0"``; or keys that collide once joined with ``"."``, ``{"a.b": x}``
    and ``{"a": {"b": y}}``), for key types the format cannot hold, and for trees deeper than
    the format allows."""
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(
            f"state must be a dict (e.g. {{'model': ..., 'optimizer': ...}}), got "
            f"{type(state).__name__}")
    keys = Flattener()
    seen: set[int] = set()

    def walk(value: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
        if len(path) > MAX_DEPTH:
            raise UnsupportedValueError(f"state nested deeper than {MAX_DEPTH} at {_where(path)}")
        if isinstance(value, Mapping) or _walked(value):
            if id(value) in seen:
                raise UnsupportedValueError(f"state contains a reference cycle at "
                                            f"{_where(path)}")
            seen.add(id(value))
        if isinstance(value, Mapping):
            view: dict[str, Any] = {}
            items = []
            for k, v in value.items():
                if not _plain_key(k):
                    raise UnsupportedValueError(
                        f"state key {k!r:.80} at {_where((*path, '<key>'))} has type "
                        f"{type(k).__name__}; "
                        "keys of a sharded state must be str, int, float, bool, None, bytes "
                        "or tuples of those (exactly these types: DCP names a value by "
                        "str(key), docs/protocol.md §8.4)")
                encoded = keys.encode(k, (*path, "<key>"))  # before str(): an int of 5000 digits
                sk = str(k)
                if sk in view:
                    raise UnsupportedValueError(
                        f"two keys of the dict at {_where(path)} read {sk!r} as strings; DCP "
                        "names values by str(key), so a sharded checkpoint cannot hold both: "
                        "rename one")
                view[sk], child = walk(v, (*path, k))
                items.append([encoded, child])
            seen.discard(id(value))
            return view, ["d", items]
        if _walked(value):
            pairs = [walk(v, (*path, i)) for i, v in enumerate(value)]
            seen.discard(id(value))
            tag = "t" if isinstance(value, tuple) else "l"
            return [p[0] for p in pairs], [tag, [p[1] for p in pairs]]
        name = ".".join(str(p) for p in path)  # DCP's name of the value (its "fqn")
        other = names.setdefault(name, path)
        if other is not path:
            raise UnsupportedValueError(
                f"the values at {_where(other)} and {_where(path)} would both be stored as "
                f"{name!r}: DCP names a value by joining str(key)s with '.', so a sharded "
                "checkpoint cannot hold both; rename one (no '.' in keys)")
        return value, [_LEAF, None]

    names: dict[str, tuple[Any, ...]] = {}
    view, skeleton = walk(state, ())
    return view, skeleton


_MISSING = object()


def _plain_key_node(node: Any) -> bool:
    """A §2.3 key node of the key types a v2 tree may hold (§8.4): str, int (``i`` nodes too),
    float, bool, nil, bin, and ``t`` nodes of those."""
    if node is None or isinstance(node, (bool, int, float, str, bytes)):
        return True
    if not (isinstance(node, list) and len(node) == 2):
        return False
    if node[0] == "i":
        return True
    return node[0] == "t" and isinstance(node[1], list) and all(
        _plain_key_node(k) for k in node[1])


def check_skeleton(tree: Any, stored: set[str], *, where: str) -> None:
    """Raise `CorruptCheckpointError` unless ``tree`` is a well-formed skeleton (§8.4:
    ``d``/``l``/``t`` nodes and ``["v", nil]`` leaves, keys as in §2.3, at most
    `MAX_DEPTH` deep, the root a dict) whose leaves, named as DCP names them (the
    ``"."``-join of ``str(key)`` per dict and the index per list), are exactly ``stored``."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: malformed stored tree ({what})")

    leaves: list[str] = []

    def walk(node: Any, path: tuple[str, ...], depth: int) -> None:
        if depth > MAX_DEPTH:
            raise bad(f"nested deeper than {MAX_DEPTH}")
        if not isinstance(node, list) or len(node) != 2:
            raise bad(f"node {node!r:.60}")
        tag, payload = node
        if tag == _LEAF:
            if payload is not None or not path:
                raise bad(f"leaf {node!r:.60}")
            leaves.append(".".join(path))
            return
        if tag not in ("d", "l", "t") or not isinstance(payload, list):
            raise bad(f"tag {tag!r:.20}")
        if tag != "d":
            for i, child in enumerate(payload):
                walk(child, (*path, str(i)), depth + 1)
            return
        keys: set[Any] = set()
        for item in payload:
            if not isinstance(item, list) or len(item) != 2:
                raise bad("dict item")
            if not _plain_key_node(item[0]):
                raise bad(f"key {item[0]!r:.60} is not a str, int, float, bool, nil, bin or "
                          "tuple of those")
            key = build_tree(item[0], [], where=where)  # a key node of §2.3
            try:
                if key in keys:
                    raise bad(f"duplicate key {key!r:.60}")
                keys.add(key)
            except TypeError:
                raise bad(f"unhashable key {key!r:.60}") from None
            walk(item[1], (*path, str(key)), depth + 1)

    if not (isinstance(tree, list) and tree and tree[0] == "d"):
        raise bad("the root is not a dict")
    walk(tree, (), 0)
    named = set(leaves)
    if len(named) != len(leaves) or named != stored:
        odd = sorted((named ^ stored) or {n for n in leaves if leaves.count(n) > 1})[:3]
        raise bad(f"its values and the stored names differ: {odd}")


def restore(skeleton: Any, loaded: Any, *, where: str) -> Any:
    """The user's tree, from its skeleton and DCP's unflattened result (str keys, lists)."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: the stored tree does not match the stored "
                                      f"values ({what})")

    def dec(node: Any, value: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise bad("too deep")
        if not isinstance(node, list) or len(node) != 2:
            raise bad(f"node {node!r:.60}")
        tag, payload = node
        if tag == _LEAF:
            if value is _MISSING:
                raise bad("a stored value is missing")
            return value
        if not isinstance(payload, list):
            raise bad("payload")
        if tag == "d":
            out: dict[Any, Any] = {}
            src = value if isinstance(value, Mapping) else {}
            for item in payload:
                if not isinstance(item, list) or len(item) != 2:
                    raise bad("dict item")
                key = build_tree(item[0], [], where=where)
                try:
                    out[key] = dec(item[1], src.get(str(key), _MISSING), depth + 1)
                except TypeError:
                    raise bad(f"unhashable key {key!r:.40}") from None
            return out
        if tag in ("l", "t"):
            src_l = value if isinstance(value, list) else []
            items = [dec(c, src_l[i] if i < len(src_l) else _MISSING, depth + 1)
                     for i, c in enumerate(payload)]
            return items if tag == "l" else tuple(items)
        raise bad(f"tag {tag!r:.20}")

    return dec(skeleton, loaded, 0)


def write_back(target: Any, skeleton: Any, loaded: Any) -> Any:
    """Put the values DCP loaded into ``loaded`` (the view of ``target``) back into ``target``'s
    own containers; returns ``target`` (or, for a tuple, a new tuple).  Tensors are left alone:
    DCP filled them in place, and the view shares them with ``target``."""
    tag, payload = skeleton
    if tag == _LEAF:
        if isinstance(target, torch.Tensor):
            return target
        return loaded
    if tag == "d":
        for (_, child), (key, value) in zip(payload, list(target.items()), strict=True):
            new = write_back(value, child, loaded[str(key)])
            if new is not value:
                target[key] = new
        return target
    items = [write_back(v, c, loaded[i]) for i, (v, c) in enumerate(zip(target, payload,
                                                                        strict=True))]
    if isinstance(target, tuple):
        return tuple(items)
    for i, new in enumerate(items):
        if new is not target[i]:
            target[i] = new
    return target


def regions_of(view: Mapping[str, Any]) -> dict[str, Any]:
    """The regions a load into DCP's ``view`` (`ckptfs.format.sharded_tree.dcp_view`) wants,
    by DCP name (§8.4: dicts walked, and lists holding a tensor, a dict or such a list): a
    DTensor's local shard(s), a tensor whole, a value (None)."""
    out: dict[str, Any] = {}

    def walks(v: Any) -> bool:
        return isinstance(v, dict) or (isinstance(v, list) and any(
            isinstance(x, torch.Tensor) or walks(x) for x in v))

    def walk(value: Any, name: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(value, list) and walks(value):
            for i, v in enumerate(value):
                walk(v, f"{name}.{i}")
        elif hasattr(value, "__create_chunk_list__"):
            out[name] = [(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                         for c in value.__create_chunk_list__()]
        else:
            out[name] = None

    walk(dict(view), "")
    return out
