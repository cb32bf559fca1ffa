"""Which tensors go into which ``tensors-NNNNN.safetensors`` file (format v1, docs/protocol.md
section 2.4, "Shard layout").

A v1 file is verified whole (its digest covers every byte), so a reader that wants only some of
the state (``store.load(keys=["model"])``, docs/loading.md) must read every file holding one of
the tensors it wants.  The plan therefore groups tensors by their **top-level key**: every
top-level key whose tensors total at least `OWN_FILES_BYTES` gets files of its own
(greedy in order of appearance, each closed at ``shard_bytes`` or at the header budget), so
loading ``"model"`` never reads a byte of ``"optimizer"``.  Smaller groups (a scheduler, a few
scalars as tensors, a flat state dict's biases) are packed together into shared files closed
at `OWN_FILES_BYTES`, so a state with many small top-level keys does not explode into as
many files, and loading one small key reads at most about that much besides.

The layout is a writer's choice: v1 readers find every tensor through ``state.msgpack``'s
slot table, whatever file holds it, so checkpoints written before this plan (one shard for
everything up to ``shard_bytes``) load unchanged, only less selectively.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

#: A top-level key whose tensors total at least this many bytes gets files of its own.
OWN_FILES_BYTES = 1024 * 1024


def plan_shards(sizes: Sequence[int], header_sizes: Sequence[int], groups: Sequence[Hashable],
                *, shard_bytes: int, header_budget: int) -> list[list[int]]:
    """Tensor indices per file, files in writing order.

    ``sizes[i]``: tensor *i*'s data bytes; ``header_sizes[i]``: an upper bound of its header
    entry; ``groups[i]``: its top-level key.  A file is closed when adding the next tensor would
    exceed ``shard_bytes`` bytes or ``header_budget`` header bytes (a file holds at least one
    tensor, so a tensor larger than ``shard_bytes`` gets a file alone)."""
    members: dict[Hashable, list[int]] = {}
    totals: dict[Hashable, int] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
        totals[g] = totals.get(g, 0) + sizes[i]

    shards: list[list[int]] = []

    def fill(indices: list[int], limit: int, current: list[int], acc: int, hacc: int
             ) -> tuple[list[int], int, int]:
        for i in indices:
            if current and (acc + sizes[i] > limit or hacc + header_sizes[i] > header_budget):
                shards.append(current)
                current, acc, hacc = [], 0, 0
            current.append(i)
            acc += sizes[i]
            hacc += header_sizes[i]
        return current, acc, hacc

    small: list[int] = []
    small_acc = small_hacc = 0
    for g, indices in members.items():
        if totals[g] >= OWN_FILES_BYTES:
            last, _, _ = fill(indices, shard_bytes, [], 0, 0)
            if last:
                shards.append(last)
            continue
        # A small group starts a new shared file rather than straddle two, when it fits one.
        hsum = sum(header_sizes[i] for i in indices)
        if small and (small_acc + totals[g] > min(OWN_FILES_BYTES, shard_bytes)
                      or small_hacc + hsum > header_budget):
            shards.append(small)
            small, small_acc, small_hacc = [], 0, 0
        small, small_acc, small_hacc = fill(indices, min(OWN_FILES_BYTES, shard_bytes), small,
                                            small_acc, small_hacc)
    if small:
        shards.append(small)
    return shards
