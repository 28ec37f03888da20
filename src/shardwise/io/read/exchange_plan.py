"""The plan of a read once per job (:mod:`shardwise.io.read.exchange` runs it), pure: from every
rank's needs (the regions of each stored tensor that each of its reads covers), which tensors a
rank reads for itself and how the rest, the pool, is cut into slabs and exchanged.

A stored tensor whose needed regions are each one contiguous byte run, and no two of them
overlap (a colwise shard, a packed colwise one, an expert), is read by each rank for itself, as
a local load does. Every other tensor (a rowwise shard is a short run per row, a replicated
tensor is needed whole by every rank, a dp replica's shard by two) goes into the pool: its rows,
in file order, are cut into one contiguous slab per rank per round (``window`` bytes at most a
rank); each rank fetches its slab, and per round each rank sends every peer the boxes of its
needs that the slab holds (:func:`shardwise.core.spec.intersect`), in one order both ends know.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardwise.core.header import TensorEntry
from shardwise.core.spec import Region, intersect
from shardwise.io.read.fetch import Key, Piece
from shardwise.io.read.mapped import contiguous_span

ROUND_BYTES = 32 << 20  # the job's slabs per round
# MIN_ROUNDS: a pool under a round is still cut into rounds (a rank's slab at least MIN_SLAB),
# so that the first exchange starts soon and each overlaps the next fetch
MIN_ROUNDS, MIN_SLAB = 32, 256 << 10


@dataclass(frozen=True)
class Need:
    """What read ``item`` (its index in its rank's list) takes of stored tensor ``tensor``:
    each region of ``layout`` lands at its offset in the item's local tensor."""

    item: int
    tensor: Key
    layout: tuple[tuple[Region, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Move:
    """A box of a fetched piece that goes to a rank: ``peer`` (the receiver in a send, the
    sender in a receive), ``piece`` (its index in the sender's fetch), the receiver's ``item``,
    the ``box`` (of the stored tensor) and where it lands in that item's local tensor (``at``)."""

    peer: int
    piece: int
    item: int
    box: Region
    at: tuple[int, ...]


@dataclass(frozen=True)
class Round:
    """One rank's part of a round: its ``fetch``, its ``sends`` to the other ranks (by peer) and
    its ``receives`` (by peer, its own fetch included), each pair of ranks in the same order."""

    fetch: tuple[Piece, ...]
    sends: tuple[Move, ...]
    receives: tuple[Move, ...]


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's plan: the items it reads for itself (``direct``), then the ``rounds`` (the same
    number on every rank)."""

    direct: tuple[int, ...]
    rounds: tuple[Round, ...]


def _row_bytes(entry: TensorEntry) -> tuple[int, int]:
    """``(rows, bytes per row)``: a 0-d tensor is one row."""
    if not entry.shape:
        return 1, entry.itemsize
    return entry.shape[0], math.prod(entry.shape[1:]) * entry.itemsize


def _is_direct(entry: TensorEntry, needs: Sequence[Need]) -> bool:
    """Every needed region is one contiguous byte run and no two overlap: each rank reads its
    own runs itself, nothing is read twice."""
    spans = []
    for need in needs:
        for region, _ in need.layout:
            span = contiguous_span(entry, region)
            if span is None:
                return False
            spans.append(span)
    spans.sort()
    return all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))


def _slabs(pool: Sequence[Key], tensors: Mapping[Key, TensorEntry], num_chunks: int) -> list[list[Piece]]:
    """The pool's rows, in order, cut at row boundaries into ``num_chunks`` slabs of about equal
    bytes (each at most one row over its share)."""
    total = sum(tensors[k].nbytes for k in pool)
    chunks: list[list[Piece]] = [[] for _ in range(num_chunks)]
    base = 0
    for key in pool:
        entry = tensors[key]
        rows, step = _row_bytes(entry)
        row = 0
        while row < rows:
            k = min(num_chunks - 1, (base + row * step) * num_chunks // total)
            end = -(-(k + 1) * total // num_chunks)  # chunk k's end: its slab stops at the next row
            stop = rows if k == num_chunks - 1 else min(rows, -(-(end - base) // step))
            rest = entry.shape[1:]
            region = Region((row,) + (0,) * len(rest), (stop - row,) + tuple(rest)) if entry.shape \
                else Region((), ())
            chunks[k].append(Piece(key, region))
            row = stop
        base += rows * step
    return chunks


def _moves(piece_at: int, piece: Piece, peer: int, needs: Sequence[Need]) -> list[Move]:
    """The boxes of ``piece`` that ``needs`` take, as moves with ``peer``."""
    out = []
    for need in needs:
        if need.tensor != piece.tensor:
            continue
        for region, off in need.layout:
            box = intersect(piece.region, region)
            if box is not None:
                at = tuple(o + b - r for o, b, r in zip(off, box.offsets, region.offsets, strict=True))
                out.append(Move(peer, piece_at, need.item, box, at))
    return out


def plan_exchange(needs: Sequence[Sequence[Need]], tensors: Mapping[Key, TensorEntry], rank: int, *,
                  window: int = ROUND_BYTES) -> ExchangePlan:
    """Rank ``rank``'s plan, from ``needs[r]`` (every rank's needs, in its items' order) and the
    ``tensors`` they name (in file order: the pool keeps it). Pure and deterministic: every rank
    reaches the same slabs. Regions of a need must not overlap (a local tensor's regions never do).

    >>> e = TensorEntry("w", "F32", (4, 2), 0, 32)
    >>> rowwise = [[Need(0, ("f", "w"), ((Region((0, r), (4, 1)), (0, 0)),))] for r in (0, 1)]
    >>> p = plan_exchange(rowwise, {("f", "w"): e}, 1)
    >>> p.rounds[0].fetch, len(p.rounds[0].sends), len(p.rounds[0].receives)
    ((Piece(tensor=('f', 'w'), region=Region(offsets=(2, 0), sizes=(2, 2))),), 1, 2)
    """
    world = len(needs)
    by_tensor: dict[Key, list[list[Need]]] = {}
    for r, mine in enumerate(needs):
        for need in mine:
            layout = tuple((reg, off) for reg, off in need.layout if reg.numel)
            if layout:
                by_tensor.setdefault(need.tensor, [[] for _ in range(world)])[r].append(
                    Need(need.item, need.tensor, layout))
    pool = [k for k in tensors if k in by_tensor
            and not _is_direct(tensors[k], [n for ns in by_tensor[k] for n in ns])]
    pooled = {n.item for k in pool for n in by_tensor[k][rank]}
    direct = tuple(n.item for n in needs[rank] if n.item not in pooled)
    total = sum(tensors[k].nbytes for k in pool)
    if not total:
        return ExchangePlan(direct, ())
    num_rounds = max(1, -(-total // (world * max(1, window))), min(MIN_ROUNDS, total // (world * MIN_SLAB)))
    chunks = _slabs(pool, tensors, world * num_rounds)
    rounds = []
    for r in range(num_rounds):
        fetch = chunks[r * world + rank]
        sends = [m for i, p in enumerate(fetch) for peer in range(world) if peer != rank
                 for m in _moves(i, p, peer, by_tensor[p.tensor][peer])]
        sends.sort(key=lambda m: m.peer)  # stable: piece, need, region order within a peer
        receives = [m for src in range(world) for i, p in enumerate(chunks[r * world + src])
                    for m in _moves(i, p, src, by_tensor[p.tensor][rank])]
        rounds.append(Round(tuple(fetch), tuple(sends), tuple(receives)))
    return ExchangePlan(direct, tuple(rounds))


__all__ = ["ExchangePlan", "MIN_ROUNDS", "MIN_SLAB", "Move", "Need", "ROUND_BYTES", "Round", "plan_exchange"]
