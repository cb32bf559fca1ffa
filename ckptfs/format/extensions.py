"""Extension types: values beyond the base tree (numpy arrays and scalars, ``pathlib`` paths,
``set``/``frozenset``, ``Enum`` members, dataclasses, ``argparse.Namespace``, ``torch.device``)
stored without pickle and restored as themselves.

Design decision: **a loader never turns a name read from a file into code.**  An extension
value is stored as ``["x", [type name, payload node]]`` (docs/protocol.md, section 2.3.1): the
payload is an ordinary node of the tree (tensors, dicts, strings... even other extension
values), and the type name is only ever a *key into this process's registry*.  A name that
nobody registered in this process is an `ExtensionTypeError` naming the
key path and how to register it; nothing is imported, looked up as an attribute or called by
name.  Registration is explicit, by the program that loads (`register_type`); the common
types are registered here, by ckptfs itself.

Encoding looks a value's *exact* type up (one dict lookup per value of the tree): a subclass of
a registered class is not that class, and is refused unless registered itself.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import pathlib
import re
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

from ckptfs.errors import CorruptCheckpointError, ExtensionTypeError, UnsupportedValueError
from ckptfs.format.codec_errors import Malformed, Refused

#: The tag of an extension node: ``["x", [name, payload]]``.
EXT_TAG = "x"
#: A key-path component the writer adds for an extension payload: it counts one level of depth
#: (as the reader counts the payload node) but is left out of key paths and tensor names.
IN_PAYLOAD = object()
#: Type names: 1-200 characters of ``[A-Za-z0-9_.<>-]`` (``module.QualName``, ``<locals>``).
NAME_RE = re.compile(r"[A-Za-z0-9_.<>-]{1,200}")
#: Key of the plain dict that `unregistered_as_dict` returns for an unregistered type.
FALLBACK_TYPE_KEY = "__ckptfs_type__"

C = TypeVar("C", bound=type)


@dataclasses.dataclass(frozen=True)
class ExtensionType:
    """One registration: values of exactly ``cls`` are stored as ``encode(value)`` under
    ``name``; a stored ``name`` is restored with ``decode(payload)``."""

    cls: type
    name: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    builtin: bool = False

    def payload(self, value: Any, where: Callable[[], str]) -> Any:
        """``encode(value)``, its failures reported as `UnsupportedValueError` naming the
        key path ``where()``."""
        try:
            out = self.encode(value)
        except Refused as exc:
            raise UnsupportedValueError(f"value at key path {where()!r}: {exc}") from None
        except Exception as exc:
            raise UnsupportedValueError(
                f"the encode function registered for {self.name!r} failed on the value at key "
                f"path {where()!r}: {type(exc).__name__}: {exc}") from exc
        if type(out) is type(value):
            raise UnsupportedValueError(
                f"the encode function registered for {self.name!r} returned a "
                f"{type(out).__qualname__} (the value itself) at key path {where()!r}; it must "
                "return a plain value (dict, list, str, tensor...)")
        return out


_lock = threading.Lock()
_BY_CLASS: dict[type, ExtensionType] = {}
_BY_NAME: dict[str, ExtensionType] = {}
#: Types stored natively by the tree encoding: registering them would be ambiguous.
_NATIVE = (dict, list, tuple, str, bytes, int, float, bool, type(None), torch.Tensor,
           torch.Size, torch.dtype)


def default_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_type(cls: C, encode: Callable[[Any], Any] | None = None,
                  decode: Callable[[Any], Any] | None = None, *, name: str | None = None,
                  replace: bool = False) -> C:
    """Store values of exactly ``cls`` as ``encode(value)`` (any value ckptfs can store:
    dicts, lists, strings, tensors, other registered types) and restore them on load with
    ``decode(that value)``, under the type name ``name`` (default ``"module.QualName"``).

    ``Enum`` subclasses and dataclasses need no functions: ``register_type(MyEnum)`` stores a
    member by name (a ``Flag`` by value), ``register_type(MyConfig)`` a dataclass as a dict of
    its fields (restored by calling the class with its ``init`` fields; stored fields the class
    no longer has are an error, missing ones take their defaults).  Returns ``cls``, so it also
    works as a class decorator.

    The loading process must register the same name: a checkpoint never names code to run.
    Registering a name again for the same class replaces its functions; for another class
    it is an `ExtensionTypeError` unless ``replace=True`` (a class
    redefined in a notebook, say)."""
    if not isinstance(cls, type):
        raise ExtensionTypeError(f"register_type() takes a class, got {cls!r:.80}")
    if cls in _NATIVE:
        raise ExtensionTypeError(f"{cls.__qualname__} is stored natively by ckptfs; it cannot be "
                                 "registered as an extension type")
    if encode is None and decode is None:
        encode, decode = _auto_codec(cls)
    elif encode is None or decode is None:
        raise ExtensionTypeError(f"register_type({cls.__qualname__}, ...) needs both encode "
                                 "and decode (or neither, for an Enum or a dataclass)")
    name = default_name(cls) if name is None else name
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ExtensionTypeError(f"type name {name!r:.80} must be 1-200 characters of "
                                 "letters, digits, '_', '.', '<', '>' or '-'")
    _add(ExtensionType(cls, name, encode, decode), replace=replace)
    return cls


def _add(entry: ExtensionType, *, replace: bool = False) -> None:
    with _lock:
        old = _BY_NAME.get(entry.name)
        if old is not None and old.cls is not entry.cls and not replace:
            raise ExtensionTypeError(
                f"type name {entry.name!r} is already registered for {default_name(old.cls)}; "
                "pass name=... to register another class, or replace=True to replace it")
        other = _BY_CLASS.get(entry.cls)
        if other is not None and other.name != entry.name and not replace:
            raise ExtensionTypeError(
                f"{default_name(entry.cls)} is already registered as {other.name!r}; a class "
                "has one type name (pass replace=True to rename it)")
        if other is not None and other.name != entry.name:
            _BY_NAME.pop(other.name, None)
        if old is not None and old.cls is not entry.cls:
            _BY_CLASS.pop(old.cls, None)
        _BY_CLASS[entry.cls] = entry
        _BY_NAME[entry.name] = entry


def unregister_type(cls_or_name: type | str) -> None:
    """Forget a registration (by class or by type name); unknown ones are ignored."""
    with _lock:
        entry = (_BY_NAME.get(cls_or_name) if isinstance(cls_or_name, str)
                 else _BY_CLASS.get(cls_or_name))
        if entry is None:
            return
        _BY_NAME.pop(entry.name, None)
        for cls in [c for c, e in _BY_CLASS.items() if e.name == entry.name]:
            del _BY_CLASS[cls]


def registered_types() -> dict[str, type]:
    """Type name -> class, of every registration in this process (built-ins included)."""
    return {n: e.cls for n, e in sorted(_BY_NAME.items())}


def encoder_for(value: Any) -> ExtensionType | None:
    """The registration of ``value``'s exact type, or ``None``."""
    return _BY_CLASS.get(type(value))


def refusal(value: Any, where: str) -> UnsupportedValueError:
    """The error for a value that is neither native nor registered, saying how to fix it."""
    cls = type(value)
    what = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(value, enum.Enum) or dataclasses.is_dataclass(value):
        fix = (f"register its class first: ckptfs.register_type({cls.__qualname__}) (in the "
               "program that saves and in the one that loads)")
    else:
        fix = (f"register it with ckptfs.register_type({cls.__qualname__}, encode, decode) "
               "(in the program that saves and in the one that loads), convert it, or store "
               "its state_dict()")
    return UnsupportedValueError(
        f"cannot store value of type {what} at key path {where!r}: ckptfs stores tensors, "
        "dicts, lists, tuples, int, float, bool, None, str, bytes and registered extension "
        f"types (no pickle); {fix}")


# ----------------------------------------------------------------------------------------------
# Decoding


_unregistered_as_dict: ContextVar[bool] = ContextVar("ckptfs_unregistered_as_dict",
                                                     default=False)


@contextlib.contextmanager
def unregistered_as_dict() -> Iterator[None]:
    """Within this block (this thread or task), a value of an unregistered type loads as the
    plain dict ``{"__ckptfs_type__": name, "value": payload}`` instead of raising (what
    ``ckptfs export`` does: it cannot know the program's classes)."""
    token = _unregistered_as_dict.set(True)
    try:
        yield
    finally:
        _unregistered_as_dict.reset(token)


class ExtensionNodeError(Exception):
    """Internal: an extension node that failed, to be reported with its key path by
    `reporting_key_paths`."""

    def __init__(self, node: Any, message: str, *, corrupt: bool) -> None:
        super().__init__(message)
        self.node = node
        self.corrupt = corrupt


def decode_extension(payload: Any, decode_child: Callable[[Any], Any], node: Any) -> Any:
    """Restore the extension node ``node`` (``["x", payload]``); ``decode_child`` decodes the
    payload node with the tree decoder (depth and key rules included)."""
    if (not isinstance(payload, list) or len(payload) != 2 or not isinstance(payload[0], str)
            or not NAME_RE.fullmatch(payload[0])):
        raise ExtensionNodeError(node, f"malformed extension node {payload!r:.80}", corrupt=True)
    name = payload[0]
    value = decode_child(payload[1])
    entry = _BY_NAME.get(name)
    if entry is None:
        if _unregistered_as_dict.get():
            return {FALLBACK_TYPE_KEY: name, "value": value}
        raise ExtensionNodeError(
            node, f"the value is of type {name!r}, which is not registered in this process. "
            f"Register it before loading: ckptfs.register_type(TheClass, encode, decode, "
            f"name={name!r}) (an Enum or dataclass: ckptfs.register_type(TheClass"
            + ("" if "<" in name else f", name={name!r}") + ")); ckptfs never imports a class "
            "named by a checkpoint", corrupt=False)
    try:
        return entry.decode(value)
    except ExtensionNodeError:
        raise
    except Malformed as exc:
        raise ExtensionNodeError(node, f"malformed {name!r} value: {exc}", corrupt=True) from None
    except Exception as exc:
        raise ExtensionNodeError(
            node, f"the decode function registered for {name!r} refused the stored value: "
            f"{type(exc).__name__}: {exc}", corrupt=False) from exc


def reporting_key_paths(decode: Callable[[], Any], tree: Any, where: str) -> Any:
    """Run ``decode()``; an `ExtensionNodeError` becomes a typed error naming the key
    path of its node (found again in ``tree`` only on failure, so success costs nothing)."""
    try:
        return decode()
    except ExtensionNodeError as exc:
        path = _locate(tree, exc.node)
        msg = f"{where}: at key path {path!r}: {exc}"
        if exc.corrupt:
            raise CorruptCheckpointError(msg) from exc.__cause__
        raise ExtensionTypeError(msg) from exc.__cause__


def _locate(tree: Any, target: Any) -> str:
    """The key path of ``target`` (by identity) in the tagged ``tree``; iterative, and tolerant
    of malformed parts (the tree may have failed anywhere)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if node is target:
            return key_path_text(path)
        if not (isinstance(node, list) and len(node) == 2 and isinstance(node[1], list)):
            continue
        tag, payload = node
        if tag == "d":
            for item in payload:
                if isinstance(item, list) and len(item) == 2:
                    stack.append((item[1], (*path, _key_text(item[0]))))
                    stack.append((item[0], (*path, "<key>")))
        elif tag in ("l", "t", "S"):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(payload))
        elif tag == EXT_TAG and len(payload) == 2:
            stack.append((payload[1], path))
    return "<unknown>"


def _key_text(node: Any) -> str:
    if isinstance(node, list) and len(node) == 2:
        return f"<{node[0]!s:.10} key>"
    return str(node)


def key_path_text(parts: tuple[str, ...]) -> str:
    if len(parts) > 12:
        parts = (*parts[:4], f"...({len(parts) - 8} more)...", *parts[-4:])
    return "/".join(p if len(p) <= 80 else f"{p[:77]}..." for p in parts) or "<root>"


# ----------------------------------------------------------------------------------------------
# Enum and dataclass classes: registration without functions


def _auto_codec(cls: type) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    if issubclass(cls, enum.Flag):
        flag: Any = cls
        return (lambda m: int(m.value)), (lambda v: flag(_check_int(v)))
    if issubclass(cls, enum.Enum):
        enum_cls: Any = cls

        def enum_decode(v: Any) -> Any:
            if not isinstance(v, str):
                raise Malformed(f"member name {v!r:.40} is not a str")
            try:
                return enum_cls[v]
            except KeyError:
                raise ValueError(f"{cls.__qualname__} has no member {v!r:.80}") from None

        return (lambda m: m.name), enum_decode
    if dataclasses.is_dataclass(cls):
        return _dataclass_codec(cls)
    raise ExtensionTypeError(
        f"register_type({cls.__qualname__}) without encode/decode works for Enum and dataclass "
        "classes only; pass encode (value -> storable value) and decode (the reverse)")


def _check_int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise Malformed(f"{v!r:.40} is not an int")
    return v


def _dataclass_codec(cls: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    fields = dataclasses.fields(cls)

    def encode(obj: Any) -> dict[str, Any]:
        return {f.name: getattr(obj, f.name) for f in fields}

    def decode(d: Any) -> Any:
        if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
            raise Malformed("a dataclass payload must be a dict with str keys")
        known = {f.name for f in fields}
        unknown = sorted(set(d) - known)
        missing = sorted(f.name for f in fields if f.name not in d and f.init
                         and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if unknown or missing:
            raise ValueError(
                f"stored fields differ from {cls.__qualname__}'s (unknown: {unknown}, missing: "
                f"{missing}); register a decode function that converts the old fields")
        obj = cls(**{f.name: d[f.name] for f in fields if f.init and f.name in d})
        for f in fields:
            if not f.init and f.name in d:
                object.__setattr__(obj, f.name, d[f.name])
        return obj

    return encode, decode


# ----------------------------------------------------------------------------------------------
# Built-in registrations


def _set_encode(value: Any) -> tuple[Any, ...]:
    try:
        return tuple(sorted(value))  # a stable order where the elements have one
    except TypeError:
        return tuple(value)


def _set_decoder(kind: type) -> Callable[[Any], Any]:
    def decode(items: Any) -> Any:
        if not isinstance(items, tuple):
            raise Malformed("a set payload must be a tuple")
        try:
            out = kind(items)
        except TypeError:
            raise Malformed("unhashable element") from None
        if len(out) != len(items):
            raise Malformed("an element is stored twice")
        return out

    return decode


def _str_decoder(make: Callable[[str], Any]) -> Callable[[Any], Any]:
    def decode(v: Any) -> Any:
        if not isinstance(v, str):
            raise Malformed(f"{v!r:.40} is not a str")
        return make(v)

    return decode


_DEVICE_RE = re.compile(r"[a-z_][a-z0-9_]{0,31}(:[0-9]{1,6})?")


def _device_decode(v: Any) -> torch.device:
    if not isinstance(v, str) or not _DEVICE_RE.fullmatch(v):
        raise Malformed(f"device {v!r:.40}")
    try:
        return torch.device(v)
    except (RuntimeError, ValueError) as exc:
        raise Malformed(f"device {v!r:.40}: {exc}") from None


def _namespace_decode(v: Any) -> argparse.Namespace:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise Malformed("a Namespace payload must be a dict with str keys")
    return argparse.Namespace(**v)


def _register_builtins() -> None:
    for kind in (set, frozenset):
        _add(ExtensionType(kind, f"builtins.{kind.__name__}", _set_encode, _set_decoder(kind),
                           builtin=True))
    _add(ExtensionType(pathlib.PurePosixPath, "pathlib.PurePosixPath", str,
                       _str_decoder(pathlib.PurePosixPath), builtin=True))
    _add(ExtensionType(pathlib.PureWindowsPath, "pathlib.PureWindowsPath", str,
                       _str_decoder(pathlib.PureWindowsPath), builtin=True))
    path_entry = ExtensionType(pathlib.Path, "pathlib.Path", str, _str_decoder(pathlib.Path),
                               builtin=True)
    _add(path_entry)
    for concrete in (pathlib.PosixPath, pathlib.WindowsPath):  # what Path() really returns
        _BY_CLASS[concrete] = path_entry
    _add(ExtensionType(torch.device, "torch.device", str, _device_decode, builtin=True))
    _add(ExtensionType(argparse.Namespace, "argparse.Namespace", lambda ns: dict(vars(ns)),
                       _namespace_decode, builtin=True))
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with every torch wheel we test
        return
    from ckptfs.format.extensions_numpy import numpy_types

    for cls, entry in numpy_types(numpy, ExtensionType):
        if cls is entry.cls:
            _add(entry)
        _BY_CLASS[cls] = entry


_register_builtins()
