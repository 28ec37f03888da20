"""Where a block-quantized weight's scales live on each rank (pure, like ``core/spec.py``).

A module holding a block-quantized weight (transformers' ``FP8Linear``: a ``float8_e4m3fn``
``weight`` and a float32 ``weight_scale_inv`` with one scale per ``(bh, bw)`` block) is
sharded by its weight's spec; its scale tensor follows as region math (a :class:`QuantTie`):
for each region of its weight shard a rank holds the scale region covering it
(:func:`shardwise.core.quant.scale_region`), concatenated along the shard dim in the same
order (:func:`scale_layout`). Where every region starts on a block boundary and ends on one or
at the tensor's edge, that is exactly the scale split by the weight's spec, an ordinary shard
(:func:`tie_aligned`): it can be a DTensor, and an FP8 kernel reads the pair as it is. Where a
boundary cuts a block (576 rows over 8 ranks in 128-row blocks), both neighbouring ranks hold
that block's scale, local scales differ in size between ranks, and a gather takes each scale
once, from the rank holding the block's first row (:func:`scale_owned_layout`).

MXFP4 (packed values and scales both derived from the logical weight region,
``core.quant.mxfp4_regions``) would be a second kind of tie with its own layout function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.core.quant import dequantize_region, is_block_aligned, scale_region, scale_shape
from shardwise.core.spec import Layout, Region, ShardSpec, check_shardable, local_layout
from shardwise.errors import PlanError, ShardingError

FP8_SCALE_SUFFIX = "weight_scale_inv"
DEQUANT_CHUNK = 1 << 22  # weight elements dequantized at once: 16 MiB of float32 temporaries
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                              "float8_e5m2fnuz") if hasattr(torch, n))


@dataclass(frozen=True)
class QuantTie:
    """The scale tensor of a block-quantized weight: the model tensor ``weight`` of global
    ``weight_shape``, one scale per ``block`` (one positive int per weight dim).

    >>> QuantTie("mlp.down_proj.weight", (256, 576), (128, 128)).scale_shape
    (2, 5)
    """

    weight: str
    weight_shape: tuple[int, ...]
    block: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_shape", tuple(int(s) for s in self.weight_shape))
        object.__setattr__(self, "block", tuple(self.block))
        if len(self.block) != len(self.weight_shape) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in self.block):
            raise PlanError(f"QuantTie of {self.weight!r}: block {self.block} must hold one positive int "
                            f"per dim of the weight's shape {self.weight_shape}")

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return scale_shape(self.weight_shape, self.block)


def scale_layout(tie: QuantTie, spec: ShardSpec, degree: int, rank: int) -> Layout:
    """The scale regions rank ``rank`` of ``degree`` holds for its shard of ``tie.weight``
    (split by ``spec``), each with its offset in the rank's local scale tensor.

    >>> tie = QuantTie("w", (576, 256), (128, 128))
    >>> scale_layout(tie, ShardSpec(dim=0), 8, 1)  # rows 72..144 touch blocks 0 and 1
    [(Region(offsets=(0, 0), sizes=(2, 2)), (0, 0))]
    """
    out, pos = [], 0
    for region, _ in local_layout(tie.weight_shape, spec, degree, rank):
        scales = scale_region(region, tie.block)
        off = [0] * len(scales.sizes)
        if not spec.replicated:
            off[spec.dim] = pos
            pos += scales.sizes[spec.dim]
        out.append((scales, tuple(off)))
    return out


def scale_local_shape(tie: QuantTie, spec: ShardSpec, degree: int, rank: int) -> tuple[int, ...]:
    """Shape of rank ``rank``'s local scale tensor (ranks may differ where blocks are cut).

    >>> tie = QuantTie("w", (576, 256), (128, 128))
    >>> [scale_local_shape(tie, ShardSpec(dim=0), 8, r)[0] for r in range(8)]
    [1, 2, 1, 2, 1, 2, 1, 2]
    """
    layout = scale_layout(tie, spec, degree, rank)
    if spec.replicated:
        return layout[0][0].sizes
    shape = list(tie.scale_shape)
    shape[spec.dim] = sum(region.sizes[spec.dim] for region, _ in layout)
    return tuple(shape)


def scale_owned_layout(tie: QuantTie, spec: ShardSpec, degree: int, rank: int) -> Layout:
    """The scale regions rank ``rank`` contributes when the scale tensor is gathered: of the
    blocks it holds, those whose first element along the shard dim lies in its weight shard,
    each with its offset in the rank's local scale tensor. Over all ranks they tile the scale
    tensor exactly once (a replicated scale: rank 0 holds it all).

    >>> tie = QuantTie("w", (576, 256), (128, 128))
    >>> scale_owned_layout(tie, ShardSpec(dim=0), 8, 1)  # rows 72..144: block 1 starts at 128
    [(Region(offsets=(1, 0), sizes=(1, 2)), (1, 0))]
    >>> scale_owned_layout(tie, ShardSpec(dim=0), 8, 2)  # rows 144..216: no block starts there
    []
    """
    held = scale_layout(tie, spec, degree, rank)
    if spec.replicated:
        return held if rank == 0 else []
    d, b = spec.dim, tie.block[spec.dim]
    out = []
    weight = local_layout(tie.weight_shape, spec, degree, rank)
    for (region, _), (scales, off) in zip(weight, held, strict=True):
        a, n = region.offsets[d], region.sizes[d]
        first, stop = -(-a // b), -(-(a + n) // b)
        if n == 0 or stop <= first:
            continue
        offsets, sizes, where = list(scales.offsets), list(scales.sizes), list(off)
        where[d] += first - offsets[d]
        offsets[d], sizes[d] = first, stop - first
        out.append((Region(tuple(offsets), tuple(sizes)), tuple(where)))
    return out


def tie_aligned(tie: QuantTie, spec: ShardSpec, degree: int) -> bool:
    """Whether every rank's scales are the scale tensor split by ``spec`` and every weight
    region starts on a block boundary and ends on one or at the tensor's edge: then each rank's
    (weight, scale) pair is an ordinary shard (a DTensor, what an FP8 kernel reads as is).

    >>> tie_aligned(QuantTie("w", (512, 256), (128, 128)), ShardSpec(dim=0), 4)
    True
    >>> tie_aligned(QuantTie("w", (576, 256), (128, 128)), ShardSpec(dim=0), 2)
    False
    """
    if spec.replicated or degree == 1:
        return True
    try:
        check_shardable(tie.scale_shape, spec, degree)
    except ShardingError:
        return False
    for rank in range(degree):
        regions = local_layout(tie.weight_shape, spec, degree, rank)
        if not all(is_block_aligned(tie.weight_shape, r, tie.block) for r, _ in regions):
            return False
        if scale_layout(tie, spec, degree, rank) != local_layout(tie.scale_shape, spec, degree, rank):
            return False
    return True


def take_layout(tensor: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of ``shape`` holding each region of ``layout`` of the canonical ``tensor``
    at its offset (a rank's local scale, from the whole scale tensor)."""
    out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    for region, off in layout:
        out[Region(off, region.sizes).slices()] = tensor[region.slices()]
    return out


def dequantize_local(q: torch.Tensor, scale: torch.Tensor, tie: QuantTie, spec: ShardSpec, degree: int,
                     rank: int, dtype: torch.dtype, *, chunk_elements: int = DEQUANT_CHUNK) -> torch.Tensor:
    """Rank ``rank``'s dequantized shard of ``tie.weight`` in ``dtype``, from its local values
    ``q`` (the weight split by ``spec``) and its local ``scale`` (held as :func:`scale_layout`
    says): each region through :func:`shardwise.core.quant.dequantize_region` (float32, cast
    once), so it equals the same slice of the full dequantization bit for bit. Regions go in
    dim-0 chunks of about ``chunk_elements``, so the float32 temporaries stay small.

    >>> tie = QuantTie("w", (3, 2), (2, 2))               # 3 rows in blocks of 2: scales 2, 3
    >>> dequantize_local(torch.ones(3, 2, dtype=torch.float8_e4m3fn), torch.tensor([[2.0], [3.0]]),
    ...                  tie, ShardSpec(dim=0), 1, 0, torch.float32, chunk_elements=1)
    tensor([[2., 2.],
            [2., 2.],
            [3., 3.]])
    """
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    weight = local_layout(tie.weight_shape, spec, degree, rank)
    for (region, off), (scales, soff) in zip(weight, scale_layout(tie, spec, degree, rank), strict=True):
        if region.numel == 0:
            continue
        rows = region.sizes[0]
        step = max(1, chunk_elements // max(1, region.numel // rows))
        for lo in range(0, rows, step):
            n = min(step, rows - lo)
            part = Region((region.offsets[0] + lo,) + region.offsets[1:], (n,) + region.sizes[1:])
            local = Region((off[0] + lo,) + tuple(off[1:]), part.sizes)
            need = scale_region(part, tie.block)
            at = Region(tuple(o + a - b for o, a, b in zip(soff, need.offsets, scales.offsets, strict=True)),
                        need.sizes)
            values = q[local.slices()]
            out[local.slices()] = dequantize_region(values, scale[at.slices()], part, tie.block, dtype)
    return out


def fp8_block_of(module: nn.Module) -> tuple[int, int] | None:
    """The block shape of a block-scaled FP8 linear module (transformers' ``FP8Linear`` with a
    ``block_size``: a 2-D float8 ``weight`` next to a 2-D ``weight_scale_inv``), None for any
    other module. Reads attributes only (meta modules too)."""
    weight = module._parameters.get("weight")
    scale = module._parameters.get(FP8_SCALE_SUFFIX)
    block = getattr(module, "block_size", None)
    if weight is None or scale is None or weight.dtype not in _FLOAT8:
        return None
    if weight.dim() != 2 or scale.dim() != 2:
        return None
    if not isinstance(block, (tuple, list)) or len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        return None
    return int(block[0]), int(block[1])


def is_tied_scale(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is the scale tensor of a block-scaled FP8 linear module of ``model``."""
    path, _, leaf = name.rpartition(".")
    return leaf == FP8_SCALE_SUFFIX and fp8_block_of(model.get_submodule(path)) is not None


def quant_ties(model: nn.Module) -> dict[str, QuantTie]:
    """``{scale tensor name: QuantTie}`` for every block-scaled FP8 linear module of ``model``
    (:func:`fp8_block_of`). Raises ``PlanError`` for a scale whose shape does not fit its
    weight and block."""
    ties = {}
    for path, module in model.named_modules():
        block = fp8_block_of(module)
        if block is None:
            continue
        prefix = f"{path}." if path else ""
        tie = QuantTie(f"{prefix}weight", tuple(module.weight.shape), block)
        if tuple(module.weight_scale_inv.shape) != tie.scale_shape:
            raise PlanError(f"{prefix}{FP8_SCALE_SUFFIX} has shape {tuple(module.weight_scale_inv.shape)} "
                            f"but its weight {tie.weight_shape} in blocks {block} needs {tie.scale_shape}; "
                            "build the module with the block size of its checkpoint")
        ties[f"{prefix}{FP8_SCALE_SUFFIX}"] = tie
    return ties


def tie_scales(model: nn.Module, specs: dict, styles: dict, keys: dict) -> dict[str, QuantTie]:
    """``{scale: QuantTie}`` of ``model`` (:func:`quant_ties`), each scale given its weight's spec
    in ``specs`` (a plan key naming the scale itself, as transformers' quantizer adds them, is
    overridden: the scale follows its weight as region math). A sharded quantized module must
    be planned by a module key: its forward is wired as one (``shardwise.quant_tp``)."""
    ties = quant_ties(model)
    for scale, tie in ties.items():
        spec = specs[tie.weight]
        path = tie.weight.rpartition(".")[0]
        if not spec.replicated and path not in styles:
            raise PlanError(f"plan key {keys.get(tie.weight)!r} shards the FP8 weight {tie.weight!r} by "
                            f"a parameter key; plan its module {path!r} instead (colwise or rowwise), so "
                            "that its weight, scales and forward are sharded together")
        if scale in specs:
            specs[scale] = spec
    return ties


__all__ = [
    "DEQUANT_CHUNK", "FP8_SCALE_SUFFIX", "QuantTie", "dequantize_local", "fp8_block_of", "is_tied_scale",
    "quant_ties", "scale_layout", "scale_local_shape", "scale_owned_layout", "take_layout", "tie_aligned",
    "tie_scales",
]
