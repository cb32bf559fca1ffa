"""Built-in extension types for numpy (docs/protocol.md, section 2.3.1): arrays and scalars.

An array is stored as ``{"dtype": <numpy dtype string>, "shape": [...], "data": <tensor>}``:
the data is a tensor of the same element type where safetensors has one (so the bytes sit in
the safetensors file, hashed and streamed like any tensor), else the array's raw little-endian
bytes as a flat ``uint8`` tensor (``complex128``, ``datetime64``, fixed-width strings...).
A scalar is ``(dtype string, raw bytes)``.  Object arrays, structured and sub-array dtypes are
refused on save; on load the dtype string is checked against the same rules before numpy
parses it, so a file can only ever make numpy build plain data.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from ckptfs.format.codec_errors import Malformed, Refused

#: Kinds of numpy dtypes that hold plain data: bool, ints, floats, complex, datetime/timedelta,
#: bytes and unicode strings.  Never ``O`` (objects) or ``V`` (structured / raw void).
_KINDS = frozenset("biufcmMSU")
_DTYPE_RE = re.compile(r"[<>|=]?[a-zA-Z][a-zA-Z0-9]{0,7}(\[[a-zA-Z0-9]{1,8}\])?")
_MAX_NDIM = 64  # numpy's own bound


#: numpy element types that safetensors stores as themselves (docs/protocol.md, section 2.4).
_SAME_IN_TORCH = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32",
                  "float64", "complex64", "uint16", "uint32", "uint64")


def numpy_types(np: Any, entry: Callable[..., Any]) -> list[tuple[type, Any]]:
    """(class, registration) pairs of the numpy built-ins: ``numpy.ndarray`` and
    ``numpy.generic`` (every concrete scalar type: ``np.float32``, ``np.int64``...)."""
    to_torch: dict[Any, torch.dtype] = {
        np.dtype(n): getattr(torch, n) for n in _SAME_IN_TORCH if hasattr(torch, n)}

    def plain_dtype(dt: Any, what: str) -> Any:
        if dt.kind not in _KINDS or dt.hasobject or dt.fields is not None or dt.subdtype:
            raise Refused(f"numpy {what} of dtype {dt} cannot be stored without pickle (object, "
                          "structured and sub-array dtypes are refused); convert it (e.g. "
                          "arr.astype(str), or one array per field)")
        return dt.newbyteorder("<") if dt.byteorder == ">" else dt

    def parse_dtype(text: Any) -> Any:
        if not isinstance(text, str) or not _DTYPE_RE.fullmatch(text):
            raise Malformed(f"dtype {text!r:.40}")
        try:
            dt = np.dtype(text)
        except (TypeError, ValueError):
            raise Malformed(f"dtype {text!r:.40}") from None
        if (dt.kind not in _KINDS or dt.hasobject or dt.fields is not None or dt.subdtype
                or dt.byteorder == ">"):
            raise Malformed(f"dtype {text!r:.40} is not a plain little-endian dtype")
        return dt

    def array_encode(arr: Any) -> dict[str, Any]:
        dt = plain_dtype(arr.dtype, "array")
        arr = np.asarray(arr, dtype=dt, order="C")  # (ascontiguousarray makes 0-d 1-d)
        tdt = to_torch.get(dt)
        data = (torch.from_numpy(arr) if tdt is not None
                else torch.from_numpy(arr.reshape(-1).view(np.uint8)))
        return {"dtype": dt.str, "shape": list(arr.shape), "data": data}

    def array_decode(d: Any) -> Any:
        if not isinstance(d, dict) or set(d) != {"dtype", "shape", "data"}:
            raise Malformed("an array payload is a dict of dtype, shape and data")
        dt = parse_dtype(d["dtype"])
        shape, data = d["shape"], d["data"]
        if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                           for n in shape)):
            raise Malformed(f"shape {shape!r:.60}")
        if not isinstance(data, torch.Tensor):
            raise Malformed("the array's data is not a tensor reference")
        count = 1
        for n in shape:
            count *= n
        host = data.detach().cpu()
        tdt = to_torch.get(dt)
        if tdt is not None:
            if host.dtype != tdt or host.numel() != count:
                raise Malformed(f"data {host.dtype}[{host.numel()}] does not hold {dt}{shape}")
            return host.reshape(shape).numpy()
        if host.dtype != torch.uint8 or host.dim() != 1 or host.numel() != count * dt.itemsize:
            raise Malformed(f"raw data of {host.numel()} bytes does not hold {dt}{shape}")
        return host.numpy().view(dt).reshape(shape)

    def scalar_encode(value: Any) -> tuple[str, bytes]:
        dt = plain_dtype(value.dtype, "scalar")
        return dt.str, np.asarray(value, dtype=dt).tobytes()

    def scalar_decode(v: Any) -> Any:
        if not isinstance(v, tuple) or len(v) != 2 or not isinstance(v[1], bytes):
            raise Malformed("a numpy scalar payload is (dtype, bytes)")
        dt = parse_dtype(v[0])
        if len(v[1]) != dt.itemsize:
            raise Malformed(f"{len(v[1])} bytes for a {dt} scalar")
        return np.frombuffer(v[1], dtype=dt)[0]

    scalar = entry(np.generic, "numpy.generic", scalar_encode, scalar_decode, builtin=True)
    out = [(np.ndarray, entry(np.ndarray, "numpy.ndarray", array_encode, array_decode,
                              builtin=True)), (np.generic, scalar)]
    concrete = {c for c in np.sctypeDict.values() if isinstance(c, type)}
    out += [(c, scalar) for c in sorted(concrete, key=str)
            if issubclass(c, np.generic) and c is not np.generic]
    return out
