"""Pieces: a canonical tensor assembled from boxes of stored tensors (hub key layouts,
distributed checkpoints' chunks), and which boxes of them a rank reads. Pure: plain ints.
"""

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
    """Where a box of a stored tensor sits in a canonical tensor: ``key`` names the stored
    tensor, ``source`` is the box of it used, ``offsets`` where that box starts in the
    canonical tensor, ``stacked`` the canonical dims the stored tensor lacks (size 1 in the
    canonical box: an expert's index)."""

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
    """One model tensor assembled from stored tensors: its canonical shape and pieces, and
    where each stored tensor lives (``{stored key: (file, entry)}``)."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    stored: dict

    @property
    def entry(self) -> TensorEntry:
        return next(iter(self.stored.values()))[1]


@dataclass(frozen=True)
class StoredPart:
    """One tensor of the hub layout, of ``shape`` and ``dtype``, assembled from boxes of model
    tensors: each ``(model tensor, piece)`` of ``fragments`` puts ``model_tensor[piece.box()]``
    (its ``piece.stacked`` dims squeezed) at ``piece.source`` of the stored tensor."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    fragments: tuple[tuple[str, Piece], ...]

    @property
    def whole(self) -> bool:
        """Whether the stored tensor is one box of one model tensor (no assembly buffer)."""
        return len(self.fragments) == 1 and self.fragments[0][1].source.sizes == self.shape

    def assemble(self, tensor: Callable[[str], torch.Tensor | None]) -> torch.Tensor | None:
        """The stored tensor, contiguous, from ``tensor(model name)`` (called once per fragment,
        in order; a box is copied out before the next call, so the callee may reuse its
        buffer). None when ``tensor`` gives None (a rank that does not write)."""
        out = None
        for name, piece in self.fragments:
            full = tensor(name)
            if full is None:
                continue
            box = full[piece.box().slices()]
            for d in sorted(piece.stacked, reverse=True):
                box = box.squeeze(d)
            if self.whole:
                return box.contiguous()
            if out is None:
                out = torch.empty(self.shape, dtype=box.dtype, device=box.device)
            out[piece.source.slices()] = box
        return out


def piece_reads(layout: Layout, pieces: Sequence[Piece]) -> list[tuple[Piece, Region, tuple[int, ...]]]:
    """For a rank's ``layout`` (from :func:`local_layout`) of a canonical tensor made of
    ``pieces``: ``(piece, region of the stored tensor to read, offset in the local shard)``
    for every overlap, so that each byte of the local shard is read once.

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
    """Raise ``ShardingError`` unless ``pieces`` cover every element of ``shape`` exactly once.

    Pieces are boxes, so exact tiling is: each inside the shape, no two overlapping, and
    their element counts summing to the whole.
    """
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
