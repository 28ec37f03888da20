"""Dequantizing on load: what a rank reads of a block-quantized tensor, and its shard (pure).

A model tensor stored quantized (FP8 with block scales, or MXFP4 ``x_blocks`` / ``x_scales``)
and loaded into a plain model: rank ``rank`` reads, for each region of its shard, the boxes of
the stored values and scales that region touches (``core.quant.scale_region`` /
``mxfp4_regions``), then dequantizes element by element in float32 and casts once, so its
shard equals the same slice of the full dequantization bit for bit, whatever the boundaries
(inside an FP8 block or a 32-value MXFP4 group included). gpt-oss's experts hold the
transpose of what is stored (``transposed``), as transformers' ``convert_moe_packed_tensors``
returns it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shardwise.core.pieces import Piece
from shardwise.core.quant import (
    QuantScheme,
    dequantize_region_into,
    mxfp4_dequantize_region,
    mxfp4_regions,
    scale_region,
)
from shardwise.core.spec import Layout, Region, ShardSpec, local_layout, local_shape
from shardwise.errors import PlanError

DEQUANT_CHUNK = 1 << 22  # weight elements dequantized at once: 16 MiB of float32 temporaries
# The workspace's floor (float32 elements): above glibc's largest dynamic mmap threshold (32 MiB),
# so it is always mmapped and freeing it never raises the threshold; the pages it leaves untouched
# cost no memory.
_WORK_FLOOR = (32 << 20) // 4 + 4096


def _stored_regions(scheme: QuantScheme, region: Region) -> tuple[Region, Region]:
    """The (values, scales) regions of the stored tensors holding ``region`` of the logical weight."""
    if scheme.name == "mxfp4":
        return mxfp4_regions(region)
    return region, scale_region(region, scheme.block)


def _swap(region: Region) -> Region:
    """``region`` with its last two dims swapped (gpt-oss's experts hold the transpose)."""
    o, n = region.offsets, region.sizes
    return Region(o[:-2] + (o[-1], o[-2]), n[:-2] + (n[-1], n[-2]))


def _stack(boxes: list[Region], dim: int | None) -> tuple[Layout, tuple[int, ...]]:
    """``boxes`` concatenated along ``dim`` into one local buffer (``None``: one box, replicated)."""
    if dim is None:
        return [(boxes[0], (0,) * len(boxes[0].sizes))], boxes[0].sizes
    layout, pos = [], 0
    for box in boxes:
        layout.append((box, tuple(pos if d == dim else 0 for d in range(len(box.sizes)))))
        pos += box.sizes[dim]
    return layout, tuple(pos if d == dim else n for d, n in enumerate(boxes[0].sizes))


def dequant_reads(scheme: QuantScheme, shape: tuple[int, ...], spec: ShardSpec, degree: int, rank: int, *,
                  transposed: bool = False) -> tuple[tuple[Layout, tuple], tuple[Layout, tuple]]:
    """What rank ``rank`` reads to dequantize its shard of a model tensor of ``shape`` split by
    ``spec``, stored quantized in ``scheme`` (``transposed``: the stored logical weight is the
    model tensor with its last two dims swapped, as gpt-oss's MXFP4 experts): ``((values
    layout, local shape), (scales layout, local shape))``, each layout the boxes of the stored
    tensor the rank's regions touch (``core.quant.scale_region`` / ``mxfp4_regions``), stacked
    along the shard dim in region order. Boundaries inside a block or a 32-group are fine: the
    box covers the whole block, and neighbouring ranks both read it.

    >>> (v, _), (s, _) = dequant_reads(QuantScheme.mxfp4(), (4, 96, 64), ShardSpec(dim=1), 2, 1,
    ...                                transposed=True)  # K = 96 at tp=2: rank 1 starts inside group 1
    >>> v[0][0], s[0][0]
    (Region(offsets=(0, 0, 1, 0), sizes=(4, 64, 2, 16)), Region(offsets=(0, 0, 1), sizes=(4, 64, 2)))
    """
    if len(scheme.block) != len(shape):
        raise PlanError(f"{scheme} does not fit a weight of {len(shape)} dims {tuple(shape)}")
    values, scales = [], []
    for region, _ in local_layout(shape, spec, degree, rank):
        v, s = _stored_regions(scheme, _swap(region) if transposed else region)
        values.append(v)
        scales.append(s)
    dim = None if spec.replicated else spec.dim
    if dim is not None and transposed and dim >= len(shape) - 2:
        dim = 2 * len(shape) - 3 - dim
    if dim is not None and scheme.block[dim] is None:
        raise PlanError(f"{scheme}: the scales lack dim {dim}, which the spec {spec} splits")
    scale_dim = None if dim is None else dim - sum(b is None for b in scheme.block[:dim])
    return _stack(values, dim), _stack(scales, scale_dim)


def dequantize_shard(values: torch.Tensor, scales: torch.Tensor, scheme: QuantScheme, shape: tuple[int, ...],
                     spec: ShardSpec, degree: int, rank: int, dtype: torch.dtype, *, transposed: bool = False,
                     chunk_elements: int = DEQUANT_CHUNK) -> torch.Tensor:
    """Rank ``rank``'s dequantized shard (in ``dtype``) of a model tensor of ``shape`` split by
    ``spec``, from ``values`` and ``scales`` read as :func:`dequant_reads` says: each region
    through ``core.quant.dequantize_region_into`` (FP8) or ``mxfp4_dequantize_region`` (then
    transposed back when ``transposed``), float32 then cast once, so it equals the same slice
    of the full dequantization bit for bit. Regions go in dim-0 chunks of about
    ``chunk_elements``, so the float32 temporaries stay small; FP8 chunks reuse one float32
    workspace allocated per call, so none are allocated and freed between the outputs."""
    out = torch.empty(local_shape(shape, spec, degree), dtype=dtype, device=values.device)
    (held_v, _), (held_s, _) = dequant_reads(scheme, shape, spec, degree, rank, transposed=transposed)
    regions = list(local_layout(shape, spec, degree, rank))
    steps = [max(1, chunk_elements // max(1, r.numel // r.sizes[0])) if r.numel else 0 for r, _ in regions]
    # FP8: one float32 workspace (values, then the expanded scales) for all chunks, so no chunk-sized
    # temporaries are allocated and freed between the outputs (glibc would keep that memory).
    cap = max((min(st, r.sizes[0]) * (r.numel // r.sizes[0])
               for st, (r, _) in zip(steps, regions, strict=True) if st), default=0)
    work = (torch.empty(max(2 * cap, _WORK_FLOOR), dtype=torch.float32, device=values.device)
            if cap and scheme.name != "mxfp4" else None)
    for step, (region, off), (vbox, voff), (sbox, soff) in zip(steps, regions, held_v, held_s, strict=True):
        if region.numel == 0:
            continue
        rows = region.sizes[0]
        for lo in range(0, rows, step):
            n = min(step, rows - lo)
            part = Region((region.offsets[0] + lo,) + region.offsets[1:], (n,) + region.sizes[1:])
            local = Region((off[0] + lo,) + tuple(off[1:]), part.sizes)
            logical = _swap(part) if transposed else part
            need_v, need_s = _stored_regions(scheme, logical)
            v, s = values[_within(need_v, vbox, voff).slices()], scales[_within(need_s, sbox, soff).slices()]
            if scheme.name == "mxfp4":
                piece = mxfp4_dequantize_region(v, s, logical, dtype)
            else:
                assert work is not None  # FP8 with a non-empty region: cap > 0
                numel = part.numel
                piece = dequantize_region_into(v, s, logical, scheme.block, work[:numel].view(logical.sizes),
                                               work[cap:cap + numel].view(logical.sizes))
            out[local.slices()].copy_(piece.transpose(-1, -2) if transposed else piece)  # cast once
    return out


def scale_pieces(pieces: Sequence[Piece], block: tuple[int | None, ...], key_of: Callable[[str], str]
                 ) -> tuple[Piece, ...]:
    """The pieces of a block-quantized tensor's scales, from the ``pieces`` of its values (an
    experts tensor stored per expert, each stored weight with its own scales ``key_of(key)``):
    each piece's scales land where its blocks lie in the assembled tensor, which needs every
    piece to start on a block boundary of the assembled tensor and of its stored tensor (else
    the assembled tensor's blocks are not the stored ones: ``PlanError``). Dims the stored
    tensors lack (``stacked``) have block 1 in ``block``.

    >>> p = [Piece("e.0.w", Region((0, 0), (128, 64)), (0, 0, 0), (0,)),
    ...      Piece("e.1.w", Region((0, 0), (128, 64)), (1, 0, 0), (0,))]
    >>> [(q.key, q.source.sizes, q.offsets) for q in scale_pieces(p, (1, 128, 128), lambda k: k + "_s")]
    [('e.0.w_s', (1, 1), (0, 0, 0)), ('e.1.w_s', (1, 1), (1, 0, 0))]
    """
    out = []
    for piece in pieces:
        kept = [d for d in range(len(piece.offsets)) if d not in piece.stacked]
        kept_block: dict[int, int] = {}  # block of each kept dim (checked not None below)
        for i, d in enumerate(kept):
            # a piece starting on block boundaries of both tensors keeps its blocks whole; as pieces
            # tile the tensor, a partial last block is then at the assembled tensor's end
            b = block[d]
            if b is None or piece.offsets[d] % b or piece.source.offsets[i] % b:
                raise PlanError(f"{piece.key!r} lands at {piece.offsets} of the assembled tensor, which "
                                f"cuts its {b}-wide blocks on dim {d}: its scales do not tile the assembled "
                                "scales")
            kept_block[d] = b
        scales = scale_region(piece.source, tuple(kept_block[d] for d in kept))
        offsets = tuple(o if d in piece.stacked else o // kept_block[d] for d, o in enumerate(piece.offsets))
        out.append(Piece(key_of(piece.key), scales, offsets, piece.stacked))
    return tuple(out)


def _within(need: Region, box: Region, at: tuple[int, ...]) -> Region:
    """Where ``need`` (inside ``box``) sits in a local buffer holding ``box`` at offset ``at``."""
    return Region(tuple(o + a - b for o, a, b in zip(at, need.offsets, box.offsets, strict=True)), need.sizes)


__all__ = ["DEQUANT_CHUNK", "dequant_reads", "dequantize_shard", "scale_pieces"]
