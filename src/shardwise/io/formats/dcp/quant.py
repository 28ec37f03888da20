"""Block-quantized weights in distributed checkpoints: the scales follow their weight
(``core.quant_layout``). A save writes each scale once, from the rank owning its block
(``scale_owned_layout``), at its canonical offsets, so the checkpoint loads at any degree and
consolidates to the hub's safetensors; a load reads each rank's scale regions (``scale_layout``)
and keeps the stored dtypes of weights and scales, whatever ``sw.load``'s ``dtype``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardwise.core.quant import FLOAT8, pair_of
from shardwise.core.quant_layout import (
    QuantTie,
    scale_layout,
    scale_local_shape,
    scale_owned_layout,
    tie_aligned,
)
from shardwise.core.spec import Layout, ShardSpec, local_layout, local_shape
from shardwise.errors import CheckpointError
from shardwise.holding import is_dtensor
from shardwise.io.formats.dcp.items import Placed, place
from shardwise.io.source import Want
from shardwise.io.staging import loaded_dtype


def scale_placed(tensor: torch.Tensor, tie: QuantTie, spec: ShardSpec, degree: int, rank: int, *,
                 name: str) -> Placed:
    """Where this rank's scales of ``tie`` go in the canonical scale tensor: the blocks it owns.
    Where every rank's blocks are whole, the scales are split like any tensor (``place``: a
    DTensor, FSDP over it); else they are a plain local tensor held as ``scale_layout`` says."""
    if tie_aligned(tie, spec, degree):
        return place(tensor, spec, degree, rank, name=name)
    local = tensor.to_local() if is_dtensor(tensor) else tensor
    want = scale_local_shape(tie, spec, degree, rank)
    if tuple(local.shape) != want:
        raise CheckpointError(f"tensor {name!r}: local scales of shape {tuple(local.shape)}, but rank {rank} "
                              f"of {degree} holding its shard of {tie.weight!r} holds {want}; load the model "
                              "with sw.load or sw.from_pretrained, which place the scales with their weight")
    return Placed(local.detach(), tie.scale_shape, scale_owned_layout(tie, spec, degree, rank))


def want_layout(shape: tuple[int, ...], want: Want) -> tuple[tuple[int, ...], Layout]:
    """The local shape and layout of the wanted tensor of canonical ``shape``: split by its
    spec, or for a scale tensor, the scales of every block its weight shard touches."""
    at = (want.spec, want.degree, want.rank)
    if want.tie is None:
        return local_shape(shape, want.spec, want.degree), local_layout(shape, *at)
    return scale_local_shape(want.tie, *at), scale_layout(want.tie, *at)


def read_dtype(stored: torch.dtype, want: Want, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a wanted tensor is read in: FP8 weights and scales as stored, else ``loaded_dtype``."""
    if want.tie is not None or stored in FLOAT8:
        return stored
    return loaded_dtype(stored, dtype)


def check_fp8_match(root, stored: Mapping, keys: Mapping[str, str],
                    declared: Mapping[str, torch.dtype]) -> None:
    """Refuse a model tensor stored FP8 next to its block scales (``core.quant.pair_of``) that the
    model declares in another dtype: a cast would ignore the scales (DCP loads are not dequantized)."""
    for name, key in keys.items():
        dtype = getattr(getattr(stored.get(key), "properties", None), "dtype", None)
        paired = pair_of(key, dtype, stored) if dtype is not None and dtype in FLOAT8 else None
        if paired is not None and declared[name] not in FLOAT8:
            raise CheckpointError(
                f"{root}: {key!r} is stored as {dtype} with block scales {paired[0]!r}, but the model "
                f"declares {declared[name]}; a distributed checkpoint loads into the quantized model it was "
                "saved from (its FP8 modules: sw.from_pretrained builds them). To get it dequantized, "
                "sw.consolidate it to safetensors and load that with dequantize=True")


__all__ = ["check_fp8_match", "read_dtype", "scale_placed", "want_layout"]
