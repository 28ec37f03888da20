"""transformers weight conversions that only move values, as geometry over stored pieces: each
model tensor row becomes a piece of a stored row, so a rank's share is still read as boxes.
Used by :mod:`shardwise.hf.hub_layout`, which refuses any conversion that changes values."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.core.pieces import Piece
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError


@dataclass
class Virtual:  # a tensor in the middle of a chain of operations
    shape: tuple[int, ...]
    pieces: list[Piece]


def cut(box: Region, dim: int, start: int, size: int) -> Region:  # size rows of box on dim from start
    return Region(box.offsets[:dim] + (box.offsets[dim] + start,) + box.offsets[dim + 1:],
                  box.sizes[:dim] + (size,) + box.sizes[dim + 1:])


def interleave(v: Virtual, dim: int, inverse: bool, what: str) -> Virtual:
    """transformers' ``Interleave(dim)``: rows ``2i + j`` of ``dim`` go to ``j * n/2 + i`` (the
    evens, then the odds); ``inverse`` undoes it."""
    n = v.shape[dim]
    if n % 2:
        raise CheckpointError(f"{what}: Interleave(dim={dim}) of {n} rows, an odd count")
    half = n // 2

    def moved(r: int) -> int:
        return r // 2 + (r % 2) * half if not inverse else (r % half) * 2 + r // half

    pieces = []
    for q in v.pieces:
        if dim in q.stacked:  # one row of a stacked expert: it moves whole
            at = q.offsets[:dim] + (moved(q.offsets[dim]),) + q.offsets[dim + 1:]
            pieces.append(Piece(q.key, q.source, at, q.stacked))
            continue
        sdim = dim - sum(1 for d in q.stacked if d < dim)  # that dim in the stored tensor
        for t in range(q.source.sizes[sdim]):
            src = cut(q.source, sdim, t, 1)
            at = q.offsets[:dim] + (moved(q.offsets[dim] + t),) + q.offsets[dim + 1:]
            pieces.append(Piece(q.key, src, at, q.stacked))
    return Virtual(v.shape, pieces)


def merge_loop_queries(queries: Virtual, kv_queries: Virtual, what: str) -> Virtual:
    """transformers' ``Inkling2LoopMergeMessageQueries``: the stored ``(2L, H)`` queries (the
    query and MLP queries of each loop layer) and kv queries (its key and value queries) as one
    ``(L, 4, H)`` tensor holding each layer's query, key, value and MLP queries, in that order.
    Row ``2l + j`` of the queries goes to ``[l, (0, 3)[j]]``, of the kv queries to ``[l, 1 + j]``."""
    shapes = (queries.shape, kv_queries.shape)
    if len(set(shapes)) != 1 or len(queries.shape) != 2 or queries.shape[0] % 2:
        raise CheckpointError(f"{what}: Inkling2LoopMergeMessageQueries takes two (2 * loop layers, "
                              f"hidden) tensors of one shape, got {list(shapes)}")
    pieces = []
    for v, slots in ((queries, (0, 3)), (kv_queries, (1, 2))):
        for q in v.pieces:
            if q.stacked:  # the stored tensors come whole (one key each): never stacked here
                raise CheckpointError(f"{what}: Inkling2LoopMergeMessageQueries of stacked tensors")
            for t in range(q.source.sizes[0]):
                row = q.offsets[0] + t
                pieces.append(Piece(q.key, cut(q.source, 0, t, 1), (row // 2, slots[row % 2], q.offsets[1]),
                                    (1,)))
    return Virtual((queries.shape[0] // 2, 4, queries.shape[1]), pieces)


__all__ = ["Virtual", "cut", "interleave", "merge_loop_queries"]
