"""A canonical tensor assembled from boxes of stored tensors, and the boxes a rank reads (pure)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardwise.core.header import TensorEntry
from shardwise.core.spec import Layout, Region, Shape, intersect, overlapping
from shardwise.errors import ShardingError


@dataclass(frozen=True)
class Piece:
    """The box ``source`` of stored tensor ``key`` at ``offsets`` of a canonical tensor;
    ``stacked``: canonical dims the stored tensor lacks (size 1: an expert's index)."""

    key: str
    source: Region
    offsets: tuple[int, ...]
    stacked: tuple[int, ...] = ()

    def box(self) -> Region:
        """This piece's box in the canonical tensor."""
        sizes, it = [], iter(self.source.sizes)
        for d in range(len(self.offsets)):
            sizes.append(1 if d in self.stacked else next(it))
        return Region(self.offsets, tuple(sizes))


@dataclass(frozen=True)
class Composite:
    """A model tensor's shape and pieces, and ``stored``: {stored key: (file, entry)}."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    stored: dict

    @property
    def entry(self) -> TensorEntry:
        return next(iter(self.stored.values()))[1]


@dataclass(frozen=True)
class StoredPart:
    """A stored tensor assembled from ``fragments``: each ``(model tensor, piece)`` puts
    ``model_tensor[piece.box()]`` (``stacked`` dims squeezed) at ``piece.source``."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    fragments: tuple[tuple[str, Piece], ...]

    def assemble(self, tensor: Callable[[str], torch.Tensor | None]) -> torch.Tensor | None:
        """The stored tensor from ``tensor(name)``, called once per fragment in order (the callee
        may reuse its buffer); None where it gives None (a rank that does not write)."""
        # one box of one model tensor: that box, with no assembly buffer
        whole = len(self.fragments) == 1 and self.fragments[0][1].source.sizes == self.shape
        out = None
        for name, piece in self.fragments:
            full = tensor(name)
            if full is None:
                continue
            box = full[piece.box().slices()]
            for d in sorted(piece.stacked, reverse=True):
                box = box.squeeze(d)
            if whole:
                return box.contiguous()
            if out is None:
                out = torch.empty(self.shape, dtype=box.dtype, device=box.device)
            out[piece.source.slices()] = box
        return out


def piece_reads(layout: Layout, pieces: Sequence[Piece]) -> list[tuple[Piece, Region, tuple[int, ...]]]:
    """``(piece, region of its stored tensor, offset in the local shard)`` of every overlap of
    the rank's ``layout`` with ``pieces``: each byte of the shard read once.

    >>> p = [Piece("a", Region((0,), (2,)), (0,)), Piece("b", Region((0,), (2,)), (2,))]
    >>> [(x.key, r.offsets, off) for x, r, off in piece_reads([(Region((1,), (2,)), (0,))], p)]
    [('a', (1,), (0,)), ('b', (0,), (1,))]
    """
    out = []
    for region, local_off in layout:
        for piece in pieces:
            box = intersect(region, piece.box())
            if box is None:
                continue
            rel = [b - p for b, p in zip(box.offsets, piece.offsets, strict=True)]
            kept = [d for d in range(len(rel)) if d not in piece.stacked]
            src = Region(tuple(piece.source.offsets[i] + rel[d] for i, d in enumerate(kept)),
                         tuple(box.sizes[d] for d in kept))
            off = tuple(o + b - r for o, b, r in zip(local_off, box.offsets, region.offsets, strict=True))
            out.append((piece, src, off))
    return out


def check_tiling(shape: Shape, pieces: Sequence[Piece], what: str) -> None:
    """``ShardingError`` unless ``pieces`` cover ``shape`` exactly once (inside, disjoint, summing up)."""
    whole = Region((0,) * len(shape), tuple(shape))
    boxes = [p.box() for p in pieces]
    for p, b in zip(pieces, boxes, strict=True):
        if len(b.offsets) != len(shape) or intersect(whole, b) != b:
            raise ShardingError(f"{what}: {p.key!r} lands at {b} outside the tensor of shape {tuple(shape)}")
    pair = overlapping(boxes)
    if pair is not None:
        i, j = sorted(pair)
        raise ShardingError(f"{what}: {pieces[i].key!r} and {pieces[j].key!r} overlap at "
                            f"{intersect(boxes[i], boxes[j])}")
    if sum(b.numel for b in boxes) != math.prod(shape):
        raise ShardingError(f"{what}: the stored tensors cover {sum(b.numel for b in boxes)} of "
                            f"{math.prod(shape)} elements of shape {tuple(shape)}")


__all__ = ["Composite", "Piece", "StoredPart", "check_tiling", "piece_reads"]
