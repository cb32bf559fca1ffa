"""Whether the chunks of a tensor tile it exactly once, by DCP's rule (``validate_global_plan``):
every chunk within the tensor, no two overlapping, their volumes summing to the tensor's, in
O(n log n) for the layouts sharding makes.  Pure: one check for the sharded save's global plan
(``protocol/sharded_plan.check_global_plan``) and for the chunks a format v5 tensor spec places
on the ranks (``format/rank_metadata.decode_spec``)."""

from __future__ import annotations

import math
import operator
from typing import Any

#: At most this many characters of findings in an error (DCP's own bound).
SUMMARY_CHARS = 500
#: At most this many findings are collected per tensor (a broken layout has many).
_MAX_FINDINGS = 8

_Box = tuple[int, Any]  # (index into the tensor's chunks, the chunk)


def summary(errors: list[str]) -> str:
    """``errors`` joined for an error message, cut at `SUMMARY_CHARS` (DCP's form)."""
    text = "; ".join(errors)
    if len(text) > SUMMARY_CHARS:
        text = text[:SUMMARY_CHARS] + "... (truncated)"
    return text


def tiling_errors(key: str, size: tuple[int, ...], chunks: list[Any], *,
                  check_volume: bool = True) -> list[str]:
    """What is wrong with ``chunks`` (DCP ``ChunkStorageMetadata``: ``offsets``, ``sizes``) as
    the stored pieces of the tensor ``key`` of shape ``size``: chunks outside it, overlapping
    chunks (boxes overlap when their half-open extents do along every dimension, DCP's rule,
    under which an empty chunk strictly inside another overlaps it) and, with
    ``check_volume``, volumes that do not sum to the tensor's."""
    if _cut_along_one_dim(size, chunks):
        return []
    errors: list[str] = []
    volume = 0
    inside: list[_Box] = []
    ndim = len(size)
    for i, chunk in enumerate(chunks):
        offsets, sizes = chunk.offsets[:ndim], chunk.sizes[:ndim]
        if len(offsets) == len(sizes) == ndim and min(offsets) >= 0 and min(sizes) >= 0 \
                and all(map(operator.le, map(operator.add, offsets, sizes), size)):
            inside.append((i, chunk))
        else:
            errors.append(f"key:{key} has out of bounds chunk: tensor-size:{size} "
                          f"chunk: {chunk}")
        volume += math.prod(chunk.sizes)
    if len(chunks) > 1:
        errors += [f"key:{key} has overlapping chunks: {a} {b}"
                   for a, b in _overlaps(inside, size)]
    tensor_volume = math.prod(size)
    if check_volume and volume != tensor_volume:
        errors.append(f"key:{key} invalid fill tensor-volume: {tensor_volume} "
                      f"chunks-volume: {volume}")
    return errors


def _cut_along_one_dim(size: tuple[int, ...], chunks: list[Any]) -> bool:
    """Whether ``chunks`` are a cut of the tensor along one dimension (an FSDP or TP shard's
    layout), every other extent the tensor's own (and positive), that tiles it: sorted by their
    start, the non-empty ones meet end to start from 0 to the end, and each empty one lies on
    one of their boundaries (inside none).  Such chunks pass every check of `tiling_errors`;
    any others (and a broken cut) go through the full check, for its findings."""
    ndim = len(size)
    if not chunks or ndim == 0 or min(size) <= 0:
        return False
    first = chunks[0].sizes
    d = next((e for e in range(ndim) if len(first) == ndim and first[e] != size[e]), 0)
    rest_sizes = size[:d] + size[d + 1:]
    rest_offsets = (0,) * (ndim - 1)
    full: list[tuple[int, int]] = []
    empty: list[int] = []
    for c in chunks:
        offsets, sizes = c.offsets, c.sizes
        if len(offsets) != ndim or len(sizes) != ndim:
            return False
        if d == 0:  # the common case, without building tuples
            if sizes[1:] != rest_sizes or offsets[1:] != rest_offsets:
                return False
        elif tuple(sizes[:d]) + tuple(sizes[d + 1:]) != rest_sizes or \
                tuple(offsets[:d]) + tuple(offsets[d + 1:]) != rest_offsets:
            return False
        if sizes[d] > 0:
            full.append((offsets[d], sizes[d]))
        elif sizes[d] == 0:
            empty.append(offsets[d])
        else:
            return False
    full.sort()
    reach = 0
    bounds = {0}
    for start, length in full:
        if start != reach:
            return False
        reach = start + length
        bounds.add(reach)
    return reach == size[d] and all(o in bounds for o in empty)


def _overlaps(boxes: list[_Box], size: tuple[int, ...]) -> list[tuple[Any, Any]]:
    """Pairs of overlapping chunks among ``boxes`` (all within the tensor), at most
    `_MAX_FINDINGS`.  Chunks of positive volume: `_sweep`.  An empty chunk overlaps another
    only where it lies strictly inside it along each dimension it is empty in, so one on the
    tensor's edge (an empty shard of an uneven cut sits at the end) overlaps none; the rare
    others are compared with every chunk."""
    found: list[tuple[Any, Any]] = []
    full: list[_Box] = []
    inner: list[_Box] = []
    for box in boxes:
        c = box[1]
        if min(c.sizes) > 0:
            full.append(box)
        elif all(0 < c.offsets[d] < size[d] for d in range(len(size)) if c.sizes[d] == 0):
            inner.append(box)
    _sweep(full, 0, len(size), found)
    for k, (_, a) in enumerate(inner):
        for _, b in full + inner[k + 1:]:
            if len(found) >= _MAX_FINDINGS:
                return found
            if _meet(a, b, len(size)):
                found.append((a, b))
    return found


def _meet(a: Any, b: Any, ndim: int) -> bool:
    return all(a.offsets[d] < b.offsets[d] + b.sizes[d]
               and b.offsets[d] < a.offsets[d] + a.sizes[d] for d in range(ndim))


def _sweep(boxes: list[_Box], dim: int, ndim: int, found: list[tuple[Any, Any]]) -> None:
    """Overlapping pairs among ``boxes`` (positive volume, pairwise overlapping along every
    dimension before ``dim``) into ``found``.  Sorted by their start along ``dim``, the boxes
    fall into runs whose extents there chain together (boxes of different runs are apart);
    a run of boxes with one and the same extent recurses into the next dimension at once
    (a grid's row), any other run is cut at every start and end of its boxes, and the boxes
    spanning each piece recurse (once per distinct set)."""
    if len(boxes) < 2 or len(found) >= _MAX_FINDINGS:
        return
    if dim == ndim:
        found.append((boxes[0][1], boxes[1][1]))
        return
    ordered = sorted(boxes, key=lambda b: (b[1].offsets[dim], b[1].sizes[dim]))
    run: list[_Box] = []
    reach = 0
    for box in ordered:
        start, end = box[1].offsets[dim], box[1].offsets[dim] + box[1].sizes[dim]
        if run and start >= reach:
            _run(run, dim, ndim, found)
            run = []
        reach = max(reach, end) if run else end
        run.append(box)
    _run(run, dim, ndim, found)


def _run(run: list[_Box], dim: int, ndim: int, found: list[tuple[Any, Any]]) -> None:
    if len(run) < 2:
        return
    first = run[0][1]
    if all(b.offsets[dim] == first.offsets[dim] and b.sizes[dim] == first.sizes[dim]
           for _, b in run):
        _sweep(run, dim + 1, ndim, found)
        return
    cuts = sorted({c for _, b in run for c in (b.offsets[dim], b.offsets[dim] + b.sizes[dim])})
    starting: dict[int, list[_Box]] = {}
    for box in run:
        starting.setdefault(box[1].offsets[dim], []).append(box)
    active: dict[int, _Box] = {}
    last: frozenset[int] = frozenset()
    for cut in cuts[:-1]:
        active = {i: b for i, b in active.items() if b[1].offsets[dim] + b[1].sizes[dim] > cut}
        for box in starting.get(cut, []):
            active[box[0]] = box
        ids = frozenset(active)
        if len(ids) > 1 and ids != last:
            _sweep(list(active.values()), dim + 1, ndim, found)
            if len(found) >= _MAX_FINDINGS:
                return
        last = ids
