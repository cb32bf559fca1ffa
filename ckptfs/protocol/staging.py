"""Host copies of a plan's tensors for asynchronous saves, and the buffers they are copied into.

`stage` copies a list of tensors (the tensors of the serializer's plan,
`ckptfs.format.serialize.StatePlan.tensors`, one per distinct tensor) into buffers of a
`StagingPool`, one buffer per tensor, and returns once every copy is complete: then the
caller may change or free its tensors.  Which tensors are "the same" (tied weights) is decided
by the serializer, not here: a caller stages each plan tensor once.

The pool keeps the buffers between saves, keyed by dtype, shape and pinning, so a run that saves
the same shapes allocates nothing after its first save (buffer identity, i.e. ``data_ptr``, is
stable).  After each staging the idle buffers it did not use are freed (`StagingPool.trim`),
so the pool never holds more than one copy of the state per save in flight.

CUDA tensors are copied into *pinned* buffers with non-blocking copies, queued on each device's
current stream (after the kernels that produced the tensors), and `stage` synchronizes
those streams once per device before returning.  Other devices copy synchronously; contiguous
CPU tensors with one ``memmove`` each (see `_copy_into`).  A copy is always a plain,
contiguous tensor holding the values the view reads (a conjugate or negative view's values,
resolved), which is what the serializer writes for that view.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass
class Staged:
    """The copies made by `stage` (``tensors[i]`` is the copy of the i-th tensor given)
    and the pool buffers they live in, to give back once the save no longer reads them."""

    tensors: list[torch.Tensor]
    buffers: list[tuple[PoolKey, torch.Tensor]]


def stage(pool: StagingPool, tensors: Sequence[torch.Tensor]) -> Staged:
    """Copy each of ``tensors`` into a buffer of ``pool`` and wait until every copy is complete
    (CUDA: one synchronize per device, after the last copy).  On failure the buffers taken so
    far go back to the pool."""
    buffers: list[tuple[PoolKey, torch.Tensor]] = []
    devices: set[torch.device] = set()
    try:
        try:
            for t in tensors:
                pinned = _needs_pinned(t)
                key: PoolKey = (t.dtype, tuple(t.shape), pinned)
                buf = pool.take(key)
                buffers.append((key, buf))
                if pinned:
                    devices.add(t.device)
                _copy_into(buf, t, non_blocking=pinned)
        finally:
            if devices:  # also on failure: no copy may still be writing into a buffer
                _synchronize(devices)
    except BaseException:
        pool.give_back(buffers)
        raise
    return Staged([b for _, b in buffers], buffers)
