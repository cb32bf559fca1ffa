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

**A staging budget** (``save_async(..., staging_bytes=B)``, docs/async.md section 5): the
copies then go into one flat host buffer of the pool, the *slab* (at most ``B`` bytes, kept
between saves like the buffers), used as a ring of regions, one region per file the save
writes.  A snapshot that fits takes one region (`stage_within`).  A state larger than ``B``
is *streamed* (`Stream`): its tensor files are laid out at most ``B/2`` bytes each (one
process: `fit_files`; a collective save, format v2: `fit_groups`, each rank writing one rank
file per group; a tensor larger than ``B`` is refused, `StagingBudgetError`), the
caller's thread copies file after file into their regions, waiting while a region still holds
bytes the writer has not written, and the writer (``Attempt.write_files``' gate) waits for a
file's region to be filled and gives it back once the file is written, retries included.  The
pool counts the bytes staged and not yet written (``live_bytes``) and their peak
(``peak_live_bytes``), and the peak of what it holds (``peak_bytes``): with a budget, neither
exceeds ``B``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ckptfs.errors import AsyncSaveError, StagingBudgetError
from ckptfs.format.serialize import StatePlan, relayout

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
        self._cond = threading.Condition(self._lock)
        #: Bytes held now (in use and idle), buffers ever allocated, buffers reused.
        self.nbytes = 0
        self.allocations = 0
        self.reuses = 0
        #: The most bytes held at once since the pool was made (buffers and slab).
        self.peak_bytes = 0
        #: The slab of budgeted saves (module docstring), its ring's next offset, and its
        #: regions holding staged bytes not yet written: id -> (offset, size).
        self._slab: torch.Tensor | None = None
        self._slab_pinned = False
        self._cursor = 0
        self._regions: dict[int, tuple[int, int]] = {}
        self._next_region = 0
        #: Bytes of the slab's regions in use now, and their peak.
        self.live_bytes = 0
        self.peak_live_bytes = 0

    def _held(self, delta: int) -> None:
        self.nbytes += delta
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def take(self, key: PoolKey) -> torch.Tensor:
        with self._lock:
            free = self._free.get(key)
            if free:
                self.reuses += 1
                return free.popleft()
        buf = _alloc(key)
        with self._lock:
            self.allocations += 1
            self._held(buf.numel() * buf.element_size())
        return buf

    def give_back(self, buffers: list[tuple[PoolKey, torch.Tensor]]) -> None:
        with self._lock:
            for key, buf in buffers:
                self._free.setdefault(key, collections.deque()).append(buf)

    def trim(self, slab: bool = False) -> None:
        """Free the buffers no snapshot is using (called after each snapshot, and by close;
        ``slab``: the slab too, when no region of it is in use)."""
        with self._lock:
            self._trim_free()
            if slab and not self._regions and self._slab is not None:
                self.nbytes -= self._slab.numel()
                self._slab = None
                self._cursor = 0

    def _trim_free(self) -> None:
        for free in self._free.values():
            for buf in free:
                self.nbytes -= buf.numel() * buf.element_size()
        self._free.clear()

    # -- the slab of budgeted saves ------------------------------------------------------------

    def slab(self, size: int, budget: int, pinned: bool) -> torch.Tensor:
        """The slab, at least ``size`` and at most ``budget`` bytes, pinned if asked: the one
        kept since the last save if it fits, else a new one, once no region of the old one is
        in use (an earlier save still writing: waited for).  Idle buffers of unbudgeted saves
        are freed first, so the pool stays within ``budget``."""
        with self._cond:
            self._trim_free()
            slab = self._slab
            if (slab is not None and size <= slab.numel() <= budget
                    and self._slab_pinned == pinned):
                return slab
            while self._regions:
                self._cond.wait()
            if self._slab is not None:
                self.nbytes -= self._slab.numel()
                self._slab = None
            self._cursor = 0
            slab = _alloc((torch.uint8, (size,), pinned))
            self._slab, self._slab_pinned = slab, pinned
            self.allocations += 1
            self._held(size)
            return slab

    def place(self, sizes: Sequence[int]) -> list[int]:
        """The slab offsets of regions of ``sizes`` bytes, one after the other in the ring
        from where the last placed region ended (a region that would cross the slab's end
        starts at 0).  Placing reserves nothing: `occupy` waits until the range is free."""
        with self._lock:
            assert self._slab is not None
            end = self._slab.numel()
            out = []
            for n in sizes:
                if self._cursor + n > end:
                    self._cursor = 0
                out.append(self._cursor)
                self._cursor += n
            return out

    def occupy(self, offset: int, size: int, stop: Callable[[], bool]) -> int | None:
        """Take the slab's range ``[offset, offset + size)`` once no region in use overlaps
        it (waiting for the writer to give them back); its region id, or None if ``stop()``
        became true meanwhile."""
        with self._cond:
            while not stop() and any(o < offset + size and offset < o + n
                                     for o, n in self._regions.values()):
                self._cond.wait()
            if stop():
                return None
            rid = self._next_region
            self._next_region += 1
            self._regions[rid] = (offset, size)
            self.live_bytes += size
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
            self.reuses += 1
            return rid

    def release(self, regions: Sequence[int]) -> None:
        """Give slab regions back (their bytes are written, or no longer needed)."""
        if not regions:
            return
        with self._cond:
            for rid in regions:
                _, n = self._regions.pop(rid)
                self.live_bytes -= n
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every thread waiting in `occupy` (to look at its ``stop`` again)."""
        with self._cond:
            self._cond.notify_all()

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
    #: The slab regions they live in (a budgeted snapshot, `stage_within`).
    regions: list[int] = field(default_factory=list)


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


# -- a staging budget --------------------------------------------------------------------------

#: Each copy in the slab starts at a multiple of this (any dtype's alignment; whole cache
#: lines for the ``memmove``).
ALIGN = 64


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def staged_size(tensors: Sequence[torch.Tensor]) -> int:
    """The slab bytes copies of ``tensors`` take (each aligned to `ALIGN`)."""
    return sum(_aligned(_nbytes(t)) for t in tensors)


def check_budget(budget: int | None) -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 1):
        raise ValueError(f"staging_bytes must be an int >= 1 or None, got {budget!r}")


def _view(slab: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``like``'s dtype and shape over the slab's bytes from
    ``offset`` (a multiple of `ALIGN`)."""
    if like.numel() == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    size = tuple(like.shape)
    stride, n = [], 1
    for d in reversed(size):
        stride.append(n)
        n *= d
    out = torch.empty(0, dtype=like.dtype)
    return out.set_(slab.untyped_storage(), offset // like.element_size(), size,
                    tuple(reversed(stride)))


def _copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(source, slab view)``, complete when it returns (CUDA: one synchronize per
    device, also on failure)."""
    devices: set[torch.device] = set()
    try:
        for t, buf in pairs:
            pinned = _needs_pinned(t)
            if pinned:
                devices.add(t.device)
            _copy_into(buf, t, non_blocking=pinned)
    finally:
        if devices:
            _synchronize(devices)


def stage_within(pool: StagingPool, tensors: Sequence[torch.Tensor], budget: int
                 ) -> Staged | None:
    """`stage` within a budget: every copy in one region of the pool's slab, or None (nothing
    copied) when they would take more than ``budget`` bytes."""
    size = staged_size(tensors)
    if size > budget:
        return None
    if size == 0:  # nothing but empty tensors: no slab
        return Staged([torch.empty(t.shape, dtype=t.dtype) for t in tensors], [])
    slab = pool.slab(size, budget, any(_needs_pinned(t) for t in tensors))
    [offset] = pool.place([size])
    rid = pool.occupy(offset, size, lambda: False)
    assert rid is not None
    try:
        views, at = [], offset
        for t in tensors:
            views.append(_view(slab, at, t))
            at += _aligned(_nbytes(t))
        _copy_all(list(zip(tensors, views, strict=True)))
    except BaseException:
        pool.release([rid])
        raise
    return Staged(views, [], [rid])


def _refuse_larger(tensors: Sequence[torch.Tensor], names: Sequence[str], budget: int) -> None:
    """`StagingBudgetError` naming the first tensor whose copy alone exceeds ``budget``."""
    for i, t in enumerate(tensors):
        if _aligned(_nbytes(t)) > budget:
            key = names[i] if i < len(names) else f"tensor {i}"
            raise StagingBudgetError(
                f"save_async: the tensor at key path {key!r} ({_nbytes(t)} bytes, "
                f"{t.dtype}{list(t.shape)}) is larger than the staging budget "
                f"(staging_bytes={budget}); a tensor is staged whole: raise staging_bytes to "
                f"at least {_aligned(_nbytes(t))}, or save without a budget",
                key=key, nbytes=_nbytes(t), budget=budget)


def fit_files(plan: StatePlan, budget: int) -> StatePlan:
    """``plan`` laid out for streaming through ``budget`` staging bytes: tensor files of at
    most ``budget // 2`` bytes (so one is staged while another is written; a tensor larger
    than that gets a file of its own).  Refuses, with `StagingBudgetError` naming its key
    path, a tensor whose copy alone exceeds the budget."""
    _refuse_larger(plan.tensors, plan.names, budget)
    shard = max(1, min(plan.shard_bytes, budget // 2))
    out = relayout(dataclasses.replace(plan, shard_bytes=shard), dict(plan.external))
    for tf in out.tensor_files:
        size = staged_size([plan.tensors[i] for i in tf.members])
        if size > budget:  # many tiny tensors: their alignment does not fit
            raise StagingBudgetError(
                f"save_async: {tf.path}'s {len(tf.members)} tensors take {size} staging bytes "
                f"(each copy aligned to {ALIGN}), more than staging_bytes={budget}; raise it",
                key=plan.names[tf.members[0]], nbytes=size, budget=budget)
    return out


def fit_groups(tensors: Sequence[torch.Tensor], names: Sequence[str], budget: int
               ) -> list[tuple[int, ...]]:
    """The indices of ``tensors`` in consecutive groups of at most ``budget // 2`` staged
    bytes each (a tensor larger than that is a group of its own), for a collective save
    streamed through ``budget`` (each rank writes one rank file per group,
    `ckptfs.protocol.sharded_io.ShardedWriter`).  Refuses a tensor whose copy alone exceeds
    the budget as `fit_files` does."""
    _refuse_larger(tensors, names, budget)
    half = max(1, budget // 2)
    groups: list[tuple[int, ...]] = []
    members: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        n = _aligned(_nbytes(t))
        if members and size + n > half:
            groups.append(tuple(members))
            members, size = [], 0
        members.append(i)
        size += n
    if members:
        groups.append(tuple(members))
    return groups


class Stream:
    """One single-process save streamed through the slab (module docstring).  ``files``: the
    plan tensors' indices of each file the save writes, in writing order (empty for
    ``state.msgpack``).  `views` are the staged tensors to rebind the plan to, `run` copies
    (the caller's thread), `gate` is the writer's ``Attempt.write_files`` gate, `close`
    gives back what is still held (the save ended)."""

    def __init__(self, pool: StagingPool, tensors: Sequence[torch.Tensor],
                 files: Sequence[Sequence[int]], budget: int) -> None:
        self.pool = pool
        self.tensors: list[torch.Tensor] | None = list(tensors)
        self.files = [tuple(f) for f in files]
        sizes = [staged_size([tensors[i] for i in f]) for f in self.files]
        slab = pool.slab(budget, budget, any(_needs_pinned(t) for t in tensors))
        self.offsets = pool.place(sizes)
        self.sizes = sizes
        # A tensor no file holds (an incremental save's reused ones: its stored copy is
        # referenced) is never read by the write: a placeholder of its dtype and shape, no
        # memory, nothing copied.
        views = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors]
        for members, at in zip(self.files, self.offsets, strict=True):
            for i in members:
                views[i] = _view(slab, at, tensors[i])
                at += _aligned(_nbytes(tensors[i]))
        self.views: list[torch.Tensor] = views
        self._cond = threading.Condition()
        self._staged = [not f for f in self.files]
        self._region: list[int | None] = [None] * len(self.files)
        self._closed = False
        self.failed: BaseException | None = None

    def run(self) -> bool:
        """Copy file after file into its region (each once the writer gave back the regions
        it overlaps).  True once every byte is staged; False if the save failed meanwhile
        (nothing more is staged).  Raises what a copy raised (after `fail`)."""
        assert self.tensors is not None
        try:
            for k, members in enumerate(self.files):
                if not members:
                    continue
                rid = self.pool.occupy(self.offsets[k], self.sizes[k],
                                       lambda: self.failed is not None)
                if rid is None:
                    return False
                with self._cond:
                    if self._closed:  # the save ended meanwhile: `close` gave back the rest
                        self.pool.release([rid])
                        return False
                    self._region[k] = rid
                _copy_all([(self.tensors[i], self.views[i]) for i in members])
                with self._cond:
                    self._staged[k] = True
                    self._cond.notify_all()
            return True
        except BaseException as exc:
            self.fail(exc)
            raise
        finally:
            self.tensors = None  # the caller's: not read again

    @contextlib.contextmanager
    def gate(self, k: int) -> Iterator[None]:
        """Around the writer's write of file ``k``: wait until it is staged; give its region
        back once written.  A failed write fails the stream (the caller stops staging)."""
        with self._cond:
            while not self._staged[k] and self.failed is None:
                self._cond.wait()
            if not self._staged[k]:
                raise AsyncSaveError(
                    "save_async: staging stopped before this file was copied "
                    f"({type(self.failed).__name__}: {self.failed})")
        try:
            yield
        except BaseException as exc:
            self.fail(exc)
            raise
        with self._cond:
            rid, self._region[k] = self._region[k], None
        if rid is not None:
            self.pool.release([rid])

    def fail(self, exc: BaseException) -> None:
        """Stop: the caller stages nothing more, the writer's waits raise."""
        with self._cond:
            if self.failed is None:
                self.failed = exc
            self._cond.notify_all()
        self.pool.wake()

    def close(self) -> None:
        """The save ended: stage nothing more, give back the regions still held (its files
        written or not)."""
        self.fail(AsyncSaveError("save_async: the save ended before its state was staged"))
        with self._cond:
            self._closed = True
            held = [r for r in self._region if r is not None]
            self._region = [None] * len(self.files)
        self.pool.release(held)
