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

MXFP4 (gpt-oss experts) is the same tie on its packed tensor: a module holding
``x_blocks`` uint8 ``(..., rows, K/32, 16)`` and ``x_scales`` uint8 ``(..., rows, K/32)`` ties them
with block ``(1, ..., 1, None)``: one scale per 16 bytes (32 values), none across the bytes. A
kept MXFP4 shard must hold whole 32-groups (a packed shard with part of a group has no form of
its own), so such ties are always aligned, and a plan that cuts a group is refused
(:func:`tie_scales`). Loading dequantized, a rank reads the stored regions of its shard of the
logical weight and dequantizes them (``core.quant_dequant``), for either scheme and any
boundary, groups and blocks cut included.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from shardwise.core.quant import (
    MXFP4_GROUP,
    MXFP4_GROUP_BYTES,
    SCHEMES,
    QuantScheme,
    is_block_aligned,
    mxfp4_regions,
    scale_region,
    scale_shape,
)
from shardwise.core.quant_dequant import DEQUANT_CHUNK, dequantize_shard
from shardwise.core.spec import Layout, Region, ShardSpec, check_shardable, local_layout
from shardwise.errors import PlanError, ShardingError

FP8_SCALE_SUFFIX = "weight_scale_inv"
MXFP4_SUFFIXES = ("_blocks", "_scales")  # transformers' serialized names of an MXFP4 parameter
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                              "float8_e5m2fnuz") if hasattr(torch, n))


@dataclass(frozen=True)
class QuantTie:
    """The scale tensor of a block-quantized weight: the model tensor ``weight`` of global
    ``weight_shape``, one scale per ``block`` (per weight dim a positive int, or ``None``
    where the scale tensor lacks the dim), in ``scheme`` (``"fp8_block"``: the fp8 weight;
    ``"mxfp4"``: the packed ``x_blocks``, block ``(1, ..., 1, None)``).

    >>> QuantTie("mlp.down_proj.weight", (256, 576), (128, 128)).scale_shape
    (2, 5)
    >>> QuantTie("experts.down_proj_blocks", (4, 64, 3, 16), (1, 1, 1, None), "mxfp4").scale_shape
    (4, 64, 3)
    """

    weight: str
    weight_shape: tuple[int, ...]
    block: tuple[int | None, ...]
    scheme: str = "fp8_block"

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_shape", tuple(int(s) for s in self.weight_shape))
        object.__setattr__(self, "block", tuple(self.block))
        if len(self.block) != len(self.weight_shape) or not all(
                b is None or (isinstance(b, int) and not isinstance(b, bool) and b > 0) for b in self.block):
            raise PlanError(f"QuantTie of {self.weight!r}: block {self.block} must hold one positive int "
                            f"(or None) per dim of the weight's shape {self.weight_shape}")
        if self.scheme not in SCHEMES:
            raise PlanError(f"QuantTie of {self.weight!r}: scheme must be one of {SCHEMES}, got "
                            f"{self.scheme!r}")

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return scale_shape(self.weight_shape, self.block)

    def scale_dim(self, dim: int) -> int:
        """The dim of the scale tensor that weight dim ``dim`` becomes (dims whose block is
        ``None`` are absent from it); ``PlanError`` for such a dim."""
        if self.block[dim] is None:
            raise PlanError(f"{self.weight!r}: its scale tensor has no dim for weight dim {dim} (block "
                            f"{self.block}), so a shard of that dim has no scales of its own")
        return dim - sum(b is None for b in self.block[:dim])


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
        if spec.dim is not None:  # not replicated
            d = tie.scale_dim(spec.dim)
            off[d] = pos
            pos += scales.sizes[d]
        out.append((scales, tuple(off)))
    return out


def scale_local_shape(tie: QuantTie, spec: ShardSpec, degree: int, rank: int) -> tuple[int, ...]:
    """Shape of rank ``rank``'s local scale tensor (ranks may differ where blocks are cut).

    >>> tie = QuantTie("w", (576, 256), (128, 128))
    >>> [scale_local_shape(tie, ShardSpec(dim=0), 8, r)[0] for r in range(8)]
    [1, 2, 1, 2, 1, 2, 1, 2]
    """
    layout = scale_layout(tie, spec, degree, rank)
    if spec.dim is None:  # replicated
        return layout[0][0].sizes
    shape, d = list(tie.scale_shape), tie.scale_dim(spec.dim)
    shape[d] = sum(region.sizes[d] for region, _ in layout)
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
    if spec.dim is None:  # replicated
        return held if rank == 0 else []
    d, b, sd = spec.dim, tie.block[spec.dim], tie.scale_dim(spec.dim)
    out = []
    weight = local_layout(tie.weight_shape, spec, degree, rank)
    for (region, _), (scales, off) in zip(weight, held, strict=True):
        a, n = region.offsets[d], region.sizes[d]
        assert b is not None  # a weight split on a dim its scales lack owns no scale layout
        first, stop = -(-a // b), -(-(a + n) // b)
        if n == 0 or stop <= first:
            continue
        offsets, sizes, where = list(scales.offsets), list(scales.sizes), list(off)
        where[sd] += first - offsets[sd]
        offsets[sd], sizes[sd] = first, stop - first
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
    if spec.dim is None or degree == 1:  # replicated, or one rank
        return True
    if tie.block[spec.dim] is None:  # a split of a dim the scales lack: every shard cuts blocks
        return False
    on_scales = replace(spec, dim=tie.scale_dim(spec.dim))
    try:
        check_shardable(tie.scale_shape, on_scales, degree)
    except ShardingError:
        return False
    for rank in range(degree):
        regions = local_layout(tie.weight_shape, spec, degree, rank)
        if not all(is_block_aligned(tie.weight_shape, r, tie.block) for r, _ in regions):
            return False
        if scale_layout(tie, spec, degree, rank) != local_layout(tie.scale_shape, on_scales, degree, rank):
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
    """:func:`dequantize_shard` of an FP8 ``tie``'s local pair: ``q`` its weight split by
    ``spec``, ``scale`` held as :func:`scale_layout` says.

    >>> tie = QuantTie("w", (3, 2), (2, 2))               # 3 rows in blocks of 2: scales 2, 3
    >>> dequantize_local(torch.ones(3, 2, dtype=torch.float8_e4m3fn), torch.tensor([[2.0], [3.0]]),
    ...                  tie, ShardSpec(dim=0), 1, 0, torch.float32, chunk_elements=1)
    tensor([[2., 2.],
            [2., 2.],
            [3., 3.]])
    """
    if tie.scheme != "fp8_block":
        raise PlanError(f"dequantize_local takes an FP8 tie, got {tie.scheme!r}; use dequantize_shard")
    return dequantize_shard(q, scale, QuantScheme("fp8_block", tie.block), tie.weight_shape, spec, degree,
                            rank, dtype, chunk_elements=chunk_elements)


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


def fp8_expert_pairs(module: nn.Module) -> list[tuple[str, str, tuple[int, int, int]]]:
    """``(values, scales, block)`` of each FP8 expert projection of a block-scaled experts
    module (transformers' ``FP8Experts``: ``x`` float8 ``(E, rows, K)`` next to ``x_scale_inv``
    ``(E, ceil(rows / bh), ceil(K / bw))`` and a 2-entry ``block_size``), block ``(1, bh, bw)``:
    one scale per block of each expert. Attributes only (meta modules too)."""
    block = getattr(module, "block_size", None)
    if not isinstance(block, (tuple, list)) or len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        return []
    params, out = module._parameters, []
    for name, values in params.items():
        scales = params.get(name + "_scale_inv")
        if (values is not None and scales is not None and values.dtype in _FLOAT8 and values.dim() == 3
                and scales.dim() == 3):
            out.append((name, name + "_scale_inv", (1, int(block[0]), int(block[1]))))
    return out


def quant_pairs(module: nn.Module) -> list[tuple[str, str, tuple[int | None, ...], str]]:
    """``(values, scales, block, scheme)`` of each block-quantized pair of ``module``'s own
    parameters: an FP8 linear's ``weight`` and ``weight_scale_inv`` (:func:`fp8_block_of`), an
    FP8 experts module's projections (:func:`fp8_expert_pairs`), and every MXFP4 pair
    ``x_blocks`` (uint8, ``(..., K/32, 16)``) / ``x_scales`` (uint8), as transformers names them
    (its quantizers' ``serialized_names``). Attributes only."""
    out: list[tuple[str, str, tuple[int | None, ...], str]] = []
    block = fp8_block_of(module)
    if block is not None:
        out.append(("weight", FP8_SCALE_SUFFIX, block, "fp8_block"))
    out += [(values, scales, b, "fp8_block") for values, scales, b in fp8_expert_pairs(module)]
    params = module._parameters
    for name, blocks in params.items():
        base = name.removesuffix(MXFP4_SUFFIXES[0])
        scales = params.get(base + MXFP4_SUFFIXES[1]) if base != name else None
        if (blocks is None or scales is None or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8
                or blocks.dim() < 3 or blocks.shape[-1] != MXFP4_GROUP_BYTES):
            continue
        out.append((name, base + MXFP4_SUFFIXES[1], (1,) * (blocks.dim() - 1) + (None,), "mxfp4"))
    return out


def is_tied_scale(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is the scale tensor of a block-quantized pair of ``model`` (:func:`quant_pairs`)."""
    path, _, leaf = name.rpartition(".")
    return any(scales == leaf for _, scales, _, _ in quant_pairs(model.get_submodule(path)))


def quant_ties(model: nn.Module) -> dict[str, QuantTie]:
    """``{scale tensor name: QuantTie}`` for every block-quantized pair of ``model``
    (:func:`quant_pairs`). Raises ``PlanError`` for a scale whose shape does not fit its
    weight and block."""
    ties = {}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        for values, scales, block, scheme in quant_pairs(module):
            tie = QuantTie(f"{prefix}{values}", tuple(module._parameters[values].shape), block, scheme)
            held = tuple(module._parameters[scales].shape)
            if held != tie.scale_shape:
                raise PlanError(f"{prefix}{scales} has shape {held} but its weight {tie.weight_shape} in "
                                f"blocks {block} needs {tie.scale_shape}; build the module with the block "
                                "size of its checkpoint")
            ties[f"{prefix}{scales}"] = tie
    return ties


def tie_scales(model: nn.Module, specs: dict, styles: dict, keys: dict,
               degrees: dict[str, int] | None = None) -> dict[str, QuantTie]:
    """``{scale: QuantTie}`` of ``model`` (:func:`quant_ties`), each scale given its weight's spec
    in ``specs`` (a plan key naming the scale itself, as transformers' quantizer adds them, is
    overridden: the scale follows its weight as region math). A sharded FP8 linear must be
    planned by a module key: its forward is wired as one (``shardwise.quant_tp``); FP8 experts
    are planned by their parameters' keys, as their unquantized twins. A sharded
    MXFP4 weight must keep every 32-group whole on every rank at its axis's degree in
    ``degrees`` (``ShardingError`` naming the degrees that do)."""
    ties = quant_ties(model)
    for scale, tie in ties.items():
        spec = specs[tie.weight]
        path = tie.weight.rpartition(".")[0]
        if tie.scheme == "fp8_block" and len(tie.block) == 2 and not spec.replicated and path not in styles:
            raise PlanError(f"plan key {keys.get(tie.weight)!r} shards the FP8 weight {tie.weight!r} by "
                            f"a parameter key; plan its module {path!r} instead (colwise or rowwise), so "
                            "that its weight, scales and forward are sharded together")
        if tie.scheme == "mxfp4" and not spec.replicated and degrees is not None:
            _check_whole_groups(tie, spec, degrees[spec.axis], keys.get(tie.weight))
        if scale in specs:
            specs[scale] = spec
    return ties


def _cut_group(tie: QuantTie, spec: ShardSpec, degree: int) -> ShardingError | None:
    """The error of the first region of an MXFP4 ``x_blocks`` shard that is not whole 32-groups
    (``core.quant.mxfp4_regions(exact=True)`` on its logical columns), None if there is none."""
    for rank in range(degree):
        for region, _ in local_layout(tie.weight_shape, spec, degree, rank):
            g, b = region.offsets[-2:]
            ng, nb = region.sizes[-2:]
            start = g * MXFP4_GROUP + 2 * b
            stop = (g + ng - 1) * MXFP4_GROUP + 2 * (b + nb) if ng and nb else start
            logical = Region(region.offsets[:-2] + (start,), region.sizes[:-2] + (stop - start,))
            try:
                mxfp4_regions(logical, exact=True)
            except ShardingError as e:
                return e
    return None


def _check_whole_groups(tie: QuantTie, spec: ShardSpec, degree: int, key: str | None) -> None:
    error = _cut_group(tie, spec, degree)
    if error is None:
        return
    whole = []
    for d in range(2, 65):
        try:
            check_shardable(tie.weight_shape, spec, d)
        except ShardingError:
            continue
        if _cut_group(tie, spec, d) is None:
            whole.append(d)
    hint = (f"degrees that keep every group whole: {', '.join(map(str, whole))}" if whole else
            f"no degree > 1 does on dim {spec.dim}; shard dim 0 (the experts: the ep plan), or keep it whole")
    raise ShardingError(f"plan key {key!r} splits the MXFP4 blocks {tie.weight!r} {tie.weight_shape} on dim "
                        f"{spec.dim} over {spec.axis}={degree}: {error} ({hint})") from error


__all__ = [
    "DEQUANT_CHUNK", "FP8_SCALE_SUFFIX", "MXFP4_SUFFIXES", "QuantTie", "dequantize_local", "fp8_block_of",
    "fp8_expert_pairs",
    "is_tied_scale", "quant_pairs", "quant_ties", "scale_layout", "scale_local_shape", "scale_owned_layout",
    "take_layout", "tie_aligned", "tie_scales",
]
