"""Snapshots of a state tree for asynchronous saves, and the host buffers they are copied into.

A snapshot is a tree of the same shape as the state in which every tensor is replaced by a host
copy in a staging buffer and every container is rebuilt; the leaves the format accepts are
immutable and shared.  After :meth:`Snapshot.finish` the caller's tensors may change or be freed.

The :class:`StagingPool` keeps the buffers between saves, keyed by dtype, shape and pinning, so a
run that saves the same shapes allocates nothing after its first save (buffer identity, i.e.
``data_ptr``, is stable).  After each snapshot the idle buffers it did not use are freed, so the
pool never holds more than one copy of the state per save in flight.

CUDA tensors are copied into *pinned* buffers with non-blocking copies, queued on each device's
current stream (after the kernels that produced the tensors), and :meth:`Snapshot.finish`
synchronizes those streams once per device before returning.  Other devices copy synchronously;
contiguous CPU tensors with one ``memmove`` each (see :func:`_copy_into`).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
from collections.abc import Hashable, Mapping
from typing import Any

import torch

log = logging.getLogger("ckptfs")

PoolKey = tuple[torch.dtype, tuple[int, ...], bool]


def _needs_pinned(t: torch.Tensor) -> bool:
    """Whether ``t`` is staged through pinned memory with a non-blocking copy (CUDA)."""
    return t.device.type == "cuda"


def _alloc(key: PoolKey) -> torch.Tensor:
    dtype, shape, pinned = key
    if pinned:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:  # pragma: no cover - needs a GPU host short of pinned memory
            log.warning("could not pin %s staging buffer (%s): using pageable memory, the "
                        "device-to-host copies of async saves will block", shape, exc)
    return torch.empty(shape, dtype=dtype)


def _copy_into(buf: torch.Tensor, t: torch.Tensor, non_blocking: bool) -> None:
    """A contiguous CPU tensor is copied with one ``memmove`` (ctypes releases the GIL, so the
    background save keeps going): torch's copy splits a copy evenly over its intra-op threads,
    and on a loaded machine the copy waits for the slowest one (144 MiB in 96 tensors took
    77-300 ms that way, 33-38 ms with one memmove, on 2 shared cores).  Anything else (a
    device, a strided view, a conjugate or negative view) goes through ``copy_``."""
    if (not non_blocking and t.device.type == "cpu" and t.dtype == buf.dtype
            and t.is_contiguous() and not t.is_conj() and not t.is_neg()):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            ctypes.memmove(buf.data_ptr(), t.data_ptr(), nbytes)
        return
    with torch.no_grad():  # a copy of a tensor that requires grad must not join the graph
        buf.copy_(t.detach(), non_blocking=non_blocking)


def _synchronize(devices: set[torch.device]) -> None:
    """Wait for the non-blocking copies: they were queued on each device's current stream,
    after whatever produced the tensors there."""
    for d in devices:
        torch.cuda.current_stream(d).synchronize()


class StagingPool:
    """Host buffers for snapshots, reused across saves of the same shapes (see the module
    docstring).  Thread-safe: buffers come back from the background thread."""

    def __init__(self) -> None:
        self._free: dict[PoolKey, collections.deque[torch.Tensor]] = {}
        self._lock = threading.Lock()
        #: Bytes held now (in use and idle), buffers ever allocated, buffers reused.
        self.nbytes = 0
        self.allocations = 0
        self.reuses = 0

    def take(self, key: PoolKey) -> torch.Tensor:
        with self._lock:
            free = self._free.get(key)
            if free:
                self.reuses += 1
                return free.popleft()
        buf = _alloc(key)
        with self._lock:
            self.allocations += 1
            self.nbytes += buf.numel() * buf.element_size()
        return buf

    def give_back(self, buffers: list[tuple[PoolKey, torch.Tensor]]) -> None:
        with self._lock:
            for key, buf in buffers:
                self._free.setdefault(key, collections.deque()).append(buf)

    def trim(self) -> None:
        """Free the buffers no snapshot is using (called after each snapshot, and by close)."""
        with self._lock:
            for free in self._free.values():
                for buf in free:
                    self.nbytes -= buf.numel() * buf.element_size()
            self._free.clear()

    def free_buffers(self) -> list[torch.Tensor]:
        """The idle buffers, in the order the next snapshot will take them (for tests)."""
        with self._lock:
            return [b for free in self._free.values() for b in free]


class Snapshot:
    """Copies a state tree: tensors into staging buffers, containers rebuilt, immutable leaves
    shared.  The same view of the same storage (tied weights) maps to one buffer, as the
    serializer stores it once."""

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self.buffers: list[tuple[PoolKey, torch.Tensor]] = []
        self.devices: set[torch.device] = set()
        self._staged: dict[Hashable, torch.Tensor] = {}

    def copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._stage(value)
        if isinstance(value, Mapping):
            return {k: self.copy(v) for k, v in value.items()}
        if isinstance(value, torch.Size):
            return value
        if isinstance(value, list):
            return [self.copy(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.copy(v) for v in value)
        return value  # None, bool, int, float, str, bytes, torch.dtype: immutable (validated)

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                 t.stride(), t.dtype)
        buf = self._staged.get(ident)
        if buf is not None:
            return buf
        pinned = _needs_pinned(t)
        key: PoolKey = (t.dtype, tuple(t.shape), pinned)
        buf = self.pool.take(key)
        self.buffers.append((key, buf))
        if pinned:
            self.devices.add(t.device)
        _copy_into(buf, t, non_blocking=pinned)
        self._staged[ident] = buf
        return buf

    def finish(self) -> None:
        """Make every copy complete (CUDA) before the caller may touch its tensors again."""
        if self.devices:
            _synchronize(self.devices)
