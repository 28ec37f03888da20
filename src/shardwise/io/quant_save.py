"""The gather of an FP8 weight's scales: each scale once, from the rank owning its block.

Where a shard boundary cuts a block, both neighbouring ranks hold that block's scale (and local
scales differ in size between ranks), so the gather of ``io.gather`` (equal shards, split by
the spec) does not apply. Each rank sends the boxes :func:`core.quant_layout.scale_owned_layout`
names (the blocks whose first row it holds), padded to the largest rank's, in one gather;
rank 0 puts every box at its place in the scale tensor. Scales are 1/16384 of their weight's
elements (128x128 blocks), so one gather without chunks is enough.
"""

from __future__ import annotations

import torch

from shardwise.core.quant_layout import QuantTie, scale_owned_layout
from shardwise.core.spec import Region, ShardSpec


def gather_scales_to_rank0(backend, local: torch.Tensor, tie: QuantTie, spec: ShardSpec, degree: int,
                           rank: int, group, *, keep: bool = True) -> torch.Tensor | None:
    """The whole scale tensor of ``tie`` on global rank 0 (None elsewhere, or when not ``keep``).

    Every rank of the group calls it with its ``local`` scales (held as ``scale_layout`` says)
    and its ``rank`` of ``degree`` on the spec's axis. Bytes travel raw, so any dtype goes."""
    owned = [scale_owned_layout(tie, spec, degree, r) for r in range(degree)]
    counts = [sum(region.numel for region, _ in boxes) for boxes in owned]
    itemsize = local.element_size()
    width = max(1, max(counts)) * itemsize
    send = torch.zeros(width, dtype=torch.uint8, device=local.device)
    if counts[rank]:
        data = torch.cat([local[Region(off, r.sizes).slices()].reshape(-1) for r, off in owned[rank]])
        send[: counts[rank] * itemsize] = data.contiguous().view(torch.uint8)
    receive = None
    if backend.rank == 0:
        receive = [torch.empty(width, dtype=torch.uint8, device=local.device) for _ in range(degree)]
    backend.gather_into(send, receive, dst=0, group=group)
    if receive is None or not keep:
        return None
    full = torch.empty(tie.scale_shape, dtype=local.dtype, device=local.device)
    for boxes, count, raw in zip(owned, counts, receive, strict=True):
        values, pos = raw[: count * itemsize].view(local.dtype), 0
        for region, _ in boxes:
            full[region.slices()] = values[pos : pos + region.numel].view(region.sizes)
            pos += region.numel
    return full


__all__ = ["gather_scales_to_rank0"]
