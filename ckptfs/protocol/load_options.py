"""The options of ``store.load`` beyond the step: ``keys`` (selective load), ``map_location``
(every form ``torch.load`` accepts).  docs/loading.md is the user's page; the reader
(``ckptfs/protocol/reader.py``) applies them.

Key paths.  ``"model"`` is a top-level key; ``"model/layer.weight"`` descends through dicts,
one ``/``-separated component per level, each matching a **str** key.  For keys that are not
str (ints, tuples, bytes...) or that contain ``/``, give a tuple: ``("model", 0, "weight")``
matches each component against the dict's keys by equality (so ``0`` matches the int key
``0``, not the str ``"0"``); a tuple key itself is one component: ``(("a", "b"),)``.  Paths
descend through dicts only: a list or tuple is selected whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from ckptfs.errors import CheckpointKeyError, LoadOptionError

KeyPath = tuple[Any, ...]
#: ``map_location`` as ``torch.load`` takes it.
MapLocation = (str | torch.device | dict[str | torch.device, str | torch.device]
               | Callable[..., Any] | None)
#: The location every tensor of a ckptfs checkpoint is restored from: the format stores tensor
#: bytes, not the device they were saved from, so they load onto the CPU first.
SOURCE_LOCATION = "cpu"

_WHOLE = object()  # a selection trie node meaning "this value, entirely"


def parse_keys(keys: Iterable[str | KeyPath] | None) -> list[KeyPath] | None:
    """``keys`` as a list of key paths (tuples of components), or None (everything)."""
    if keys is None:
        return None
    if isinstance(keys, (str, bytes, tuple)):
        raise LoadOptionError(
            f"keys={keys!r:.80} must be a list of key paths, e.g. keys=['model'] or "
            "keys=[('model', 0)] (a str or tuple alone is ambiguous: wrap it in a list)")
    try:
        items = list(keys)
    except TypeError:
        raise LoadOptionError(f"keys must be a list of key paths, got {type(keys).__name__}"
                              ) from None
    out: list[KeyPath] = []
    for k in items:
        if isinstance(k, str):
            parts = tuple(k.split("/"))
            if not k or any(p == "" for p in parts):
                raise LoadOptionError(
                    f"key path {k!r}: empty component; write 'model/layer.weight' (for keys "
                    "containing '/' or not str, give a tuple path: ('model', 'a/b'))")
            out.append(parts)
        elif isinstance(k, tuple) and k:
            for c in k:
                try:
                    hash(c)
                except TypeError:
                    raise LoadOptionError(
                        f"key path {k!r:.80}: component {c!r:.40} is not hashable, so it "
                        "cannot be a dict key") from None
            out.append(k)
        else:
            raise LoadOptionError(
                f"key path {k!r:.80} must be a non-empty str ('model/layer.weight') or a "
                "non-empty tuple of keys (('model', 0))")
    if not out:
        raise LoadOptionError("keys=[] selects nothing; pass keys=None to load everything")
    return out


def selection(paths: list[KeyPath]) -> dict[Any, Any]:
    """A trie of ``paths``: component -> sub-trie, or the whole-value marker.  A path that is
    a prefix of another wins (it selects the value whole)."""
    root: dict[Any, Any] = {}
    for path in sorted(paths, key=len):
        node = root
        for i, c in enumerate(path):
            child = node.get(c)
            if child is _WHOLE:
                break
            if i == len(path) - 1:
                node[c] = _WHOLE
            else:
                node = node.setdefault(c, {})
    return root


def is_whole(node: Any) -> bool:
    return node is _WHOLE


def show_path(path: KeyPath) -> str:
    if all(isinstance(c, str) and c and "/" not in c for c in path):
        return "/".join(path)
    return repr(path)


def missing_key(url: str, path: KeyPath, wanted: Any, available: list[Any]) -> CheckpointKeyError:
    level = "top-level keys" if not path else f"keys under {show_path(path)!r}"
    shown = ", ".join(repr(k) for k in available[:50])
    more = f" (and {len(available) - 50} more)" if len(available) > 50 else ""
    return CheckpointKeyError(
        f"{url}: the checkpoint has no key path {show_path((*path, wanted))!r:.200}; "
        f"{level}: [{shown}]{more}")


def not_a_dict(url: str, path: KeyPath, kind: str) -> CheckpointKeyError:
    return CheckpointKeyError(
        f"{url}: key path {show_path(path)!r} is not a dict (it holds: {kind}); key paths "
        f"descend through dicts only: select {show_path(path)!r} whole")


def prune_state(state: Any, trie: dict[Any, Any], url: str, path: KeyPath = ()) -> Any:
    """The loaded ``state`` restricted to the selection (format v2: after a full load)."""
    if not isinstance(state, dict):
        raise not_a_dict(url, path, type(state).__name__)
    for wanted in trie:
        if wanted not in state:
            raise missing_key(url, path, wanted, list(state))
    out: dict[Any, Any] = {}
    for k, v in state.items():
        sub = trie.get(k)
        if sub is None:
            continue
        out[k] = v if is_whole(sub) else prune_state(v, sub, url, (*path, k))
    return out


_KINDS = {"l": "list", "t": "tuple", "S": "torch.Size", "T": "tensor", "x": "extension value",
          "i": "int", "dt": "torch.dtype"}


def prune_tagged(node: Any, trie: dict[Any, Any], decode_key: Callable[[Any], Any], url: str,
                 path: KeyPath = ()) -> Any:
    """The tagged tree of ``state.msgpack`` (docs/protocol.md section 2.3) restricted to the
    selection, without decoding anything but the dict keys on the way (so an unregistered
    extension type elsewhere in the state does not stop a selective load)."""
    if not (isinstance(node, list) and len(node) == 2 and node[0] == "d"
            and isinstance(node[1], list)):
        kind = (_KINDS.get(node[0], "value") if isinstance(node, list) and node
                and isinstance(node[0], str) else type(node).__name__)
        raise not_a_dict(url, path, kind)
    pairs = [(decode_key(item[0]), item) for item in node[1]
             if isinstance(item, list) and len(item) == 2]
    keys = [k for k, _ in pairs]
    for wanted in trie:
        if wanted not in keys:
            raise missing_key(url, path, wanted, keys)
    out = []
    for k, item in pairs:
        sub = trie.get(k)
        if sub is None:
            continue
        out.append(item if is_whole(sub)
                   else [item[0], prune_tagged(item[1], sub, decode_key, url, (*path, k))])
    return ["d", out]


def tensor_refs(node: Any, out: set[int]) -> set[int]:
    """Every tensor reference (``["T", i]``) in a tagged tree, walked by its structure (a dict
    pair ``["T", 5]`` for ``{"T": 5}`` is not a reference)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if not (isinstance(n, list) and len(n) == 2 and isinstance(n[0], str)):
            continue
        tag, payload = n
        if tag == "T" and isinstance(payload, int):
            out.add(payload)
        elif tag == "d" and isinstance(payload, list):
            for item in payload:
                if isinstance(item, list) and len(item) == 2:
                    stack.extend(item)
        elif tag in ("l", "t", "S") and isinstance(payload, list):
            stack.extend(payload)
        elif tag == "x" and isinstance(payload, list) and len(payload) == 2:
            stack.append(payload[1])
    return out


# -- map_location ------------------------------------------------------------------------------

TensorMap = Callable[[torch.Tensor], torch.Tensor]


def _device(value: Any, what: str) -> torch.device:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError as exc:
            raise LoadOptionError(f"{what}={value!r:.80} is not a device ({exc})") from None
    raise LoadOptionError(
        f"{what} must be a str or torch.device, got {type(value).__name__} {value!r:.80}")


def tensor_map(map_location: Any) -> TensorMap | None:
    """``map_location`` (as ``torch.load`` takes it) as a function of one loaded CPU tensor, or
    None when nothing is to be done.  Anything else raises `LoadOptionError` (a dtype
    included: ``map_location`` moves tensors, it never casts them)."""
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        dev = _device(map_location, "map_location")
        return lambda t: t.to(dev)
    if isinstance(map_location, dict):
        table: dict[str, torch.device] = {}
        for src, dst in map_location.items():
            table[str(_device(src, "a map_location key"))] = _device(dst, "a map_location value")
        target = table.get(SOURCE_LOCATION)
        if target is None:
            return None
        return lambda t: t.to(target)
    if isinstance(map_location, torch.dtype):
        raise LoadOptionError(
            f"map_location={map_location} is a dtype; map_location moves tensors, it does not "
            "cast them: load, then call .to(dtype) on what you need")
    if callable(map_location):
        fn = map_location
        return lambda t: _call_mapper(fn, t)
    raise LoadOptionError(
        f"map_location must be a str, torch.device, dict {{src: dst}} or callable(storage, "
        f"location), as for torch.load; got {type(map_location).__name__} "
        f"{map_location!r:.80}")


def _call_mapper(fn: Callable[..., Any], t: torch.Tensor) -> torch.Tensor:
    """torch.load's protocol: ``fn(storage, location)`` returns a storage (the tensor is rebuilt
    on it), or None (keep the default).  ckptfs also accepts a tensor of the same dtype and
    shape.  ``storage`` holds exactly this tensor's bytes."""
    if t.numel() and (t.storage_offset() != 0 or not t.is_contiguous()):
        t = t.contiguous()  # pragma: no cover - loaded tensors are contiguous views at offset 0
    storage = t.untyped_storage()
    out = fn(storage, SOURCE_LOCATION)
    if out is None:
        return t
    if isinstance(out, torch.TypedStorage):
        out = out.untyped()  # type: ignore[no-untyped-call]
    if isinstance(out, torch.UntypedStorage):
        if out.nbytes() < t.numel() * t.element_size():
            raise LoadOptionError(
                f"map_location callable returned a storage of {out.nbytes()} B for a tensor of "
                f"{t.numel() * t.element_size()} B")
        return torch.empty(0, dtype=t.dtype, device=out.device).set_(
            out, 0, t.shape, t.stride())
    if isinstance(out, torch.Tensor):
        if out.dtype != t.dtype or out.shape != t.shape:
            raise LoadOptionError(
                f"map_location callable returned a tensor of {out.dtype} {tuple(out.shape)} "
                f"for one of {t.dtype} {tuple(t.shape)}")
        return out
    raise LoadOptionError(
        f"map_location callable returned {type(out).__name__}; it must return a storage (e.g. "
        "storage.cuda()), a tensor of the same dtype and shape, or None")


def map_tensors(value: Any, fn: TensorMap, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``value`` with every tensor in dicts, lists and tuples mapped by ``fn``, one tensor
    object mapped once (ties survive)."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        got = memo.get(id(value))
        if got is None:
            got = memo[id(value)] = fn(value)
        return got
    if isinstance(value, dict):
        return {k: map_tensors(v, fn, memo) for k, v in value.items()}
    if isinstance(value, list):
        return [map_tensors(v, fn, memo) for v in value]
    if type(value) is tuple:
        return tuple(map_tensors(v, fn, memo) for v in value)
    return value


def select_and_map(state: dict[Any, Any], url: str, keys: list[KeyPath] | None,
                   mapper: TensorMap | None) -> dict[Any, Any]:
    """For a format whose loader returns the whole state: keep ``keys``, apply ``mapper``."""
    if keys is not None:
        state = prune_state(state, selection(keys), url)
    return cast(dict[Any, Any], map_tensors(state, mapper)) if mapper is not None else state


def dtype_mismatch(fqn: str, stored: torch.dtype, wanted: torch.dtype, url: str
                   ) -> LoadOptionError:
    """The error for a target tensor whose dtype is not the stored one: ckptfs never converts
    on load (a silent float32 -> bfloat16 or int64 -> int8 would lose data unnoticed)."""
    where = f"{url}: " if url else ""
    return LoadOptionError(
        f"{where}key {fqn!r} is stored as {stored}, the tensor given to load it into is "
        f"{wanted}; ckptfs never converts dtypes on load: give a {stored} tensor (and convert "
        "after loading)")
