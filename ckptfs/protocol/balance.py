"""Who reads what: pure, deterministic assignments of bytes to ranks, computed alike on every
rank from the same inputs (so no rank has to be told the outcome).

- `split_writers` (and `balance_writers`, its case of items written whole): a save.  Each
  replicated item (a tensor several ranks hold) is written by one of its holders, or split
  along its rows between several where it does not fit under a rank's share, so that every
  rank writes about the same bytes (replica-parallel save).
- `plan_reads`: a cooperative load.  Each rank lists the stored chunks it needs; a chunk
  needed by several ranks (data-parallel replicas loading the same shard) is read from
  storage by one of them and sent to the others (`ckptfs.protocol.sharded_read`), so each byte
  is read once per load instead of once per replica.  Readers are balanced by bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["SPLIT_MIN_BYTES", "Key", "ReadPlan", "Transfer", "balance_writers",
           "plan_group_reads", "plan_reads", "split_writers"]

Key = tuple[str, int, int]  # (path, offset, length): one stored chunk


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Chunk ``key`` is read from storage by rank ``reader`` and used by every rank of
    ``needers`` (the reader among them; the others receive it)."""

    reader: int
    key: Key
    needers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """A cooperative load's reads, the same on every rank.

    ``rounds``: each round, every rank reads its transfers' chunks, then the chunks cross in
    one exchange; the first round holds every file's first chunk (a rank file's header,
    checked before any other chunk of the file is used), the others at most ``round_bytes``
    read plus received per rank (a larger piece alone).  ``alone[r]``: the chunks rank ``r``
    alone needs, read after the rounds, with no exchange.  ``loads[r]``: bytes rank ``r``
    reads from storage."""

    rounds: list[list[Transfer]]
    alone: list[list[Key]]
    loads: list[int]


#: `plan_reads` reads alone when cooperating spares under 1/this of the bytes needed.
NEGLIGIBLE_SHARE = 32


def plan_reads(needs: Sequence[Sequence[Key]], *, max_piece: int, round_bytes: int,
               negligible: int = 0) -> ReadPlan | None:
    """The cooperative plan for ``needs`` (per rank, the chunks it needs), or ``None`` when no
    chunk is needed by two ranks (each rank then reads its own, as alone), or when the bytes
    cooperating would spare (every shared chunk's size times its needers but one) are at most
    ``negligible`` and under 1/`NEGLIGIBLE_SHARE` of every rank's needs together: an FSDP
    load's few replicated scalars cost each rank a small read, where the exchange rounds cost
    every rank three collectives.

    The chunks a set of ranks shares are cut into pieces (runs of adjacent chunks of one file,
    at most ``max_piece`` bytes and about an equal share of that set's bytes per rank, so
    replicas split a shard between them and each still reads in large ranged reads); pieces,
    largest first, go to the least loaded rank of their set (ties: the lowest rank), counting
    the bytes each rank reads alone."""
    return plan_group_reads([((rank,), keys) for rank, keys in enumerate(needs)], len(needs),
                            max_piece=max_piece, round_bytes=round_bytes, negligible=negligible)


def plan_group_reads(groups: Sequence[tuple[Sequence[int], Sequence[Key]]], world: int, *,
                     max_piece: int, round_bytes: int, negligible: int = 0,
                     alone_bytes: Sequence[int] | None = None) -> ReadPlan | None:
    """`plan_reads` of ``world`` ranks whose needs come in groups: (ranks, the chunks each of
    them needs); ranks with the same needs (the replicas of one shard) are one group, so the
    work grows with the distinct needs, not with every rank's (each rank in one group).
    ``alone_bytes[r]``: bytes rank ``r`` also reads of files no other rank needs a chunk of,
    left out of ``groups`` (counted in its load and in the bytes needed, never planned: it
    reads them after the rounds)."""
    needers: dict[Key, list[int]] = {}
    unsorted: set[Key] = set()
    for ranks, keys in groups:
        ranks = sorted(ranks)
        for key in keys:
            held = needers.get(key)
            if held is None:
                needers[key] = list(ranks)
            else:
                held.extend(ranks)
                unsorted.add(key)
    for key in unsorted:
        needers[key] = sorted(set(needers[key]))
    if all(len(v) == 1 for v in needers.values()):
        return None
    if negligible:
        spared = sum((len(v) - 1) * k[2] for k, v in needers.items())
        needed = sum(len(v) * k[2] for k, v in needers.items()) + sum(alone_bytes or ())
        if spared <= negligible and spared * NEGLIGIBLE_SHARE < needed:
            return None
    loads = list(alone_bytes) if alone_bytes is not None else [0] * world
    alone: list[list[Key]] = [[] for _ in range(world)]
    first: list[Transfer] = []
    shared: dict[tuple[int, ...], list[Key]] = {}
    for key in sorted(needers):
        who = tuple(needers[key])
        if len(who) == 1:
            loads[who[0]] += key[2]
            if key[1] == 0:
                first.append(Transfer(who[0], key, who))
            else:
                alone[who[0]].append(key)
        else:
            shared.setdefault(who, []).append(key)
    pieces: list[tuple[tuple[int, ...], list[Key]]] = []
    for who, keys in shared.items():
        share = min(max_piece, max(1, -(-sum(k[2] for k in keys) // len(who))))
        run: list[Key] = []
        size = 0
        for key in keys:
            last = run[-1] if run else None
            if last is not None and (key[1] == 0 or last[1] == 0 or last[0] != key[0]
                                     or last[1] + last[2] != key[1]
                                     or (size and size + key[2] > share)):
                pieces.append((who, run))
                run, size = [], 0
            run.append(key)
            size += key[2]
        if run:
            pieces.append((who, run))
    pieces.sort(key=lambda p: (-sum(k[2] for k in p[1]), p[1][0]))
    placed: list[tuple[int, tuple[int, ...], list[Key]]] = []
    for who, run in pieces:
        reader = min(who, key=loads.__getitem__)  # ties: the lowest rank (``who`` is sorted)
        loads[reader] += sum(k[2] for k in run)
        placed.append((reader, who, run))
    placed.sort(key=lambda p: p[2][0])
    for reader, who, run in placed:
        if run[0][1] == 0:
            first.append(Transfer(reader, run[0], who))
    first.sort(key=lambda t: t.key)
    rounds: list[list[Transfer]] = [first] if first else []
    # A rank's traffic in a round is the sum over the rank sets holding it (the needers of a
    # key; a few distinct sets: one per replica group, and the whole world for the values) of
    # what each set's pieces bring: counted per set, not per rank (thousands of ranks per
    # piece), and the busiest rank of a set found among its ranks' distinct memberships.
    member_of: dict[int, list[int]] = {}
    sets: dict[int, tuple[int, ...]] = {}
    for _, who, run in placed:
        if run[0][1] != 0 and id(who) not in sets:
            sets[id(who)] = who
            for r in who:
                member_of.setdefault(r, []).append(id(who))
    memberships = {s: list({tuple(member_of[r]) for r in who}) for s, who in sets.items()}
    current: list[Transfer] = []
    traffic = dict.fromkeys(sets, 0)
    for reader, who, run in placed:
        if run[0][1] == 0:
            continue
        size = sum(k[2] for k in run)
        if current and max(sum(map(traffic.__getitem__, m)) for m in memberships[id(who)]) \
                + size > round_bytes:
            rounds.append(current)
            current, traffic = [], dict.fromkeys(sets, 0)
        current += [Transfer(reader, k, who) for k in run]
        traffic[id(who)] += size
    if current:
        rounds.append(current)
    return ReadPlan(rounds, alone, loads)


#: A replicated tensor is split between its holders only into pieces of at least this many
#: bytes (a smaller one costs more in metadata and requests than it saves in balance).
SPLIT_MIN_BYTES = 256 << 10


def balance_writers(items: Sequence[tuple[int, Sequence[int]]], world: int, *,
                    fixed: Sequence[int] | None = None) -> list[int]:
    """The writer of each of ``items`` (``(bytes, the ranks holding it)``), each written whole:
    `split_writers` with no item split.  Returns the writers in ``items``' order."""
    return [pieces[0][0] for pieces in split_writers(
        [(size, holders, 1) for size, holders in items], world, fixed=fixed)]


def split_writers(items: Sequence[tuple[int, Sequence[int], int]], world: int, *,
                  fixed: Sequence[int] | None = None, min_piece: int = SPLIT_MIN_BYTES
                  ) -> list[list[tuple[int, int, int]]]:
    """Who writes each of ``items`` (``(bytes, the ranks holding it, its rows)``; an item
    several ranks hold is replicated, each copy equal), balancing the bytes each rank writes,
    counting ``fixed[r]`` bytes rank ``r`` writes anyway (its values, say).

    Largest items first, each to its least loaded holder (ties: the lowest rank); an item
    that does not fit under the mean (``share``: every byte over every rank) on that holder is
    split along its rows (replica-parallel save): the holder is filled up to the mean with a
    piece of it, the rest goes on to the next least loaded holder, and so on (McNaughton's
    wrap-around: at most one cut per holder filled, so few pieces; each at least
    ``min_piece`` bytes, a smaller remainder going whole to one holder).  HSDP's embedding
    shard over 32 replicas is 3.8 times the mean: written whole its writer writes 3.8 times
    what the others do; split, every rank writes within a few percent of the mean.
    Deterministic: the same on every rank.

    Returns per item its pieces ``(writer, first row, rows)`` in row order (one piece, all its
    rows, for an item written whole).  For items written whole the greedy "largest first"
    rule is within 4/3 of the best in the worst case (DCP's own deduplication assigns in the
    order items come, which on 4 or more replicas leaves ranks 10% to 100% above the mean:
    docs/sharded.md)."""
    loads = list(fixed) if fixed is not None else [0] * world
    share = (sum(loads) + sum(size for size, _, _ in items)) / max(world, 1)
    out: list[list[tuple[int, int, int]]] = [[] for _ in items]
    order = sorted(range(len(items)), key=lambda i: (-items[i][0], i))
    for i in order:
        size, holders, rows = items[i]
        if not holders:
            raise ValueError(f"item {i} is held by no rank")
        ranks = sorted(set(holders), key=lambda r: (loads[r], r))
        if rows < 2 or size < 2 * min_piece or len(ranks) < 2:
            loads[ranks[0]] += size
            out[i] = [(ranks[0], 0, rows)]
            continue
        per_row = size / rows
        pieces: list[tuple[int, int, int]] = []
        start, left = 0, rows
        for writer in ranks:  # fill the least loaded holders up to the mean
            n = min(left, int((share - loads[writer]) / per_row))
            if n * per_row < min_piece:
                break  # this holder and the more loaded ones are (nearly) full
            if (left - n) * per_row < min_piece:
                n = left  # a remainder too small to cut: this holder takes it
            pieces.append((writer, start, n))
            loads[writer] += int(n * per_row)
            start, left = start + n, left - n
            if not left:
                break
        if left:  # every holder is at the mean: the rest spread over those without a piece
            free = [r for r in ranks if r not in {w for w, _, _ in pieces}]
            free.sort(key=lambda r: (loads[r], r))
            rest = _water_fill(int(left * per_row), left, free, loads, min_piece) \
                if free else []
            if rest:
                for writer, first, n in rest:
                    pieces.append((writer, start + first, n))
                    loads[writer] += int(n * per_row)
            else:  # no holder left without one: the last piece takes the rest
                writer, first, n = pieces[-1]
                pieces[-1] = (writer, first, n + left)
                loads[writer] += int(left * per_row)
        out[i] = pieces
    return out


def _water_fill(size: int, rows: int, ranks: list[int], loads: list[int], min_piece: int
                ) -> list[tuple[int, int, int]]:
    """``size`` bytes (``rows`` rows) poured into the least loaded of ``ranks`` (sorted by
    load) up to one level: the pieces ``(writer, first row, rows)``, each of at least
    ``min_piece`` bytes (fewer writers where a piece would be smaller), rows shared as the
    bytes each writer takes."""
    per_row = size / rows
    chosen = ranks[:min(len(ranks), rows, max(1, size // max(min_piece, 1)))]
    while True:
        level = (size + sum(loads[r] for r in chosen)) / len(chosen)
        take = [level - loads[r] for r in chosen]
        if len(chosen) > 1 and (min(take) < min_piece or take[-1] <= 0):
            chosen = chosen[:-1]  # the most loaded one gets nothing, or too little
            continue
        break
    counts = [max(1, int(t / per_row)) for t in take]
    while sum(counts) > rows:  # rounding: the extra rows from the largest pieces
        counts[counts.index(max(counts))] -= 1
    k = 0
    while sum(counts) < rows:  # the rest to the least loaded first
        counts[k % len(counts)] += 1
        k += 1
    pieces, start = [], 0
    for writer, n in zip(chosen, counts, strict=True):
        if n:
            pieces.append((writer, start, n))
            start += n
    return pieces
