"""Block-quantized tensors as tied regions: a weight and its scales (pure, like ``core/spec.py``).

A block-quantized weight is stored as a group of tensors: its quantized values and one scale
per block. Region math runs on the *logical* weight, one value per element (for MXFP4, the
unpacked values in the stored orientation ``(..., rows, K)``; gpt-oss's experts module holds
the transpose ``(E, K, rows)``, so swap the last two dims of a module region first). A region
of the logical weight names the boxes of the stored tensors a rank reads: the scale region
covers every block the weight region touches, so a shard boundary inside a block (576 rows
over 8 ranks in 128-row blocks: 72 rows each) gives both neighbouring ranks that block's scale.

Dequantization computes in float32 and casts once (``(q.float() * scale).to(dtype)``; MXFP4:
``ldexp(value, byte - 127)``; both as transformers does), element by element, so a rank's
dequantized shard equals the same slice of the full dequantization bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.core.spec import Region, Shape
from shardwise.errors import PlanError, ShardingError

Block = tuple[int | None, ...]
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # e2m1 values per e8m0 scale
MXFP4_GROUP_BYTES = MXFP4_GROUP // 2  # two values per byte: the low nibble first
E8M0_BIAS = 127
SCHEMES = ("fp8_block", "mxfp4")


@dataclass(frozen=True)
class QuantScheme:
    """How a weight is block-quantized: the scheme's ``name`` and its ``block`` shape, one entry
    per dim of the logical weight (1: a scale per element on that dim; ``None``: the scale
    tensor lacks that dim, one scale across it).

    ``"fp8_block"``: ``float8_e4m3fn`` values, float32 ``weight_scale_inv`` per block (DeepSeek-V3:
    128x128). ``"mxfp4"``: ``uint8`` ``*_blocks`` of shape ``(..., K/32, 16)`` with two e2m1 values
    a byte, ``uint8`` e8m0 ``*_scales`` of shape ``(..., K/32)``; block ``(1, ..., 1, 32)``.

    >>> QuantScheme.fp8_block((128, 128), ndim=3)
    QuantScheme(name='fp8_block', block=(1, 128, 128))
    >>> QuantScheme.mxfp4(ndim=3).stored_shapes((4, 64, 96))
    ((4, 64, 3, 16), (4, 64, 3))
    >>> QuantScheme.fp8_block().stored_keys("mlp.down_proj.weight")
    ('mlp.down_proj.weight', 'mlp.down_proj.weight_scale_inv')
    """

    name: str
    block: Block

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", tuple(self.block))
        if self.name not in SCHEMES:
            raise PlanError(f"QuantScheme.name must be one of {SCHEMES}, got {self.name!r}")
        _check_block(self.block)
        if self.name == "mxfp4" and (len(self.block) < 2 or self.block != _mxfp4_block(len(self.block))):
            raise PlanError(f"QuantScheme.block of mxfp4 must be (1, ..., 1, {MXFP4_GROUP}) with at least "
                            f"2 dims, got {self.block}; use QuantScheme.mxfp4(ndim=...)")

    @classmethod
    def fp8_block(cls, block: Sequence[int] = (128, 128), *, ndim: int = 2) -> QuantScheme:
        """FP8 with one scale per ``block`` of the last dims; leading dims (experts) get 1."""
        if ndim < len(block):
            raise PlanError(f"fp8_block with block {tuple(block)} needs ndim >= {len(block)}, got {ndim}")
        return cls("fp8_block", (1,) * (ndim - len(block)) + tuple(block))

    @classmethod
    def mxfp4(cls, *, ndim: int = 3) -> QuantScheme:
        """MXFP4 on a logical weight of ``ndim`` dims (gpt-oss experts: 3)."""
        return cls("mxfp4", _mxfp4_block(ndim))

    def stored_shapes(self, shape: Shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the stored (values, scales) tensors of a logical weight of ``shape``."""
        scales = scale_shape(shape, self.block)
        if self.name == "mxfp4":
            if shape[-1] % MXFP4_GROUP:
                raise PlanError(f"an MXFP4 weight of shape {tuple(shape)} needs its last dim to be a "
                                f"multiple of {MXFP4_GROUP}")
            return scales + (MXFP4_GROUP_BYTES,), scales
        return tuple(int(s) for s in shape), scales

    def stored_keys(self, name: str) -> tuple[str, str]:
        """Checkpoint keys of the (values, scales) tensors of the parameter ``name``, as the hub
        writes them (transformers' ``Fp8Quantize`` and gpt-oss's ``*_blocks``/``*_scales``)."""
        if self.name == "mxfp4":
            return f"{name}_blocks", f"{name}_scales"
        if name.endswith(".weight"):
            return name, name[: -len("weight")] + "weight_scale_inv"
        return name, f"{name}_scale_inv"


def _mxfp4_block(ndim: int) -> Block:
    return (1,) * (ndim - 1) + (MXFP4_GROUP,)


def _check_block(block: Block) -> None:
    if not all(b is None or (isinstance(b, int) and not isinstance(b, bool) and b > 0) for b in block):
        raise PlanError(f"a quantization block must hold positive ints or None, got {block!r}")


def _check_ndim(region: Region, block: Block) -> None:
    _check_block(block)
    if len(region.sizes) != len(block):
        raise PlanError(f"block {block} has {len(block)} dims but the weight region {region} has "
                        f"{len(region.sizes)}; give one block entry per weight dim (None for a dim "
                        "the scale lacks)")


def scale_shape(shape: Shape, block: Block) -> tuple[int, ...]:
    """Shape of the scale tensor of a weight of ``shape``: ``ceil(size / b)`` per dim the scale has.

    >>> scale_shape((576, 7168), (128, 128))
    (5, 56)
    >>> scale_shape((4, 300), (None, 128))
    (3,)
    """
    return scale_region(Region((0,) * len(shape), tuple(int(s) for s in shape)), block).sizes


def scale_region(weight_region: Region, block: Block) -> Region:
    """The region of the scale tensor holding the scale of every block ``weight_region`` touches:
    on each dim, ``[floor(a / b), ceil(end / b))`` for the weight's ``[a, end)``; a dim whose block
    is ``None`` is absent from the scale region. An empty weight dim gives an empty scale dim.

    >>> scale_region(Region((72, 0), (72, 256)), (128, 128))  # rank 1 of 576 rows at tp=8
    Region(offsets=(0, 0), sizes=(2, 2))
    >>> scale_region(Region((2, 0, 40), (1, 8, 24)), (None, 1, 32))
    Region(offsets=(0, 1), sizes=(8, 1))
    """
    _check_ndim(weight_region, block)
    offsets, sizes = [], []
    for a, n, b in zip(weight_region.offsets, weight_region.sizes, block, strict=True):
        if b is None:
            continue
        offsets.append(a // b)
        sizes.append(-(-(a + n) // b) - a // b if n else 0)
    return Region(tuple(offsets), tuple(sizes))


def offsets_in_block(weight_region: Region, block: Block) -> tuple[int | None, ...]:
    """Where ``weight_region`` starts inside its first block, per dim (``None`` where the scale
    lacks the dim): element ``i`` of the region on a dim takes scale ``(off + i) // b`` of the
    scale region.

    >>> offsets_in_block(Region((216, 130), (72, 10)), (128, 128))
    (88, 2)
    """
    _check_ndim(weight_region, block)
    return tuple(None if b is None else a % b for a, b in zip(weight_region.offsets, block, strict=True))


def is_block_aligned(shape: Shape, weight_region: Region, block: Block) -> bool:
    """Whether every boundary of ``weight_region`` is a block boundary or the tensor's edge, and
    the region is whole on every dim the scale lacks: then the scale regions of regions that tile
    the weight tile the scale tensor (no rank shares a block's scale).

    >>> is_block_aligned((576, 256), Region((72, 0), (72, 256)), (128, 128))
    False
    >>> is_block_aligned((576, 256), Region((512, 0), (64, 256)), (128, 128))
    True
    """
    _check_ndim(weight_region, block)
    return all(
        (a == 0 and n == size) if b is None else (a % b == 0 and ((a + n) % b == 0 or a + n == size))
        for a, n, b, size in zip(weight_region.offsets, weight_region.sizes, block, shape, strict=True)
    )


def decode_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: ``uint8`` is e8m0 (``2 ** (byte - 127)``, as MXFP4/MXFP8 store them; byte
    255, NaN in the OCP spec, gives 2 ** 128 = inf, like transformers' ``Fp8Dequantize``), any float
    dtype is converted exactly.

    >>> decode_scale(torch.tensor([127, 128, 120], dtype=torch.uint8))
    tensor([1.0000, 2.0000, 0.0078])
    """
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.int32) - E8M0_BIAS)
    if not scale.dtype.is_floating_point:
        raise PlanError(f"scales must be a float dtype or uint8 e8m0, got {scale.dtype}")
    return scale.float()


def expand_scale(scale: torch.Tensor, weight_region: Region, block: Block) -> torch.Tensor:
    """The scale of each element of ``weight_region``, shaped like it, from ``scale`` read at
    :func:`scale_region` (any dtype; dims the scale lacks are broadcast views).

    >>> expand_scale(torch.tensor([1.0, 2.0]), Region((2,), (4,)), (3,))
    tensor([1., 2., 2., 2.])
    """
    _check_scale(scale, weight_region, block)
    out = scale
    for d, (a, n, b) in enumerate(zip(weight_region.offsets, weight_region.sizes, block, strict=True)):
        if b is None:
            out = out.unsqueeze(d)
        elif b > 1:
            index = torch.arange(a, a + n, device=scale.device) // b - a // b
            out = out.index_select(d, index)
    return out.expand(weight_region.sizes)


def _check_scale(scale: torch.Tensor, weight_region: Region, block: Block) -> None:
    want = scale_region(weight_region, block).sizes
    if tuple(scale.shape) != want:
        raise PlanError(f"scale of shape {tuple(scale.shape)} does not fit weight region {weight_region} "
                        f"with block {block}: expected {want}; read it at scale_region(region, block)")


def _check_pair(q: torch.Tensor, scale: torch.Tensor, weight_region: Region, block: Block) -> None:
    """The guard of both FP8 dequantizations: values read at the region, scales at its scale region."""
    if tuple(q.shape) != weight_region.sizes:
        raise PlanError(f"quantized values of shape {tuple(q.shape)} do not fit weight region "
                        f"{weight_region}; read the weight at the region itself")
    _check_scale(scale, weight_region, block)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn values, float32 scales)`` of ``weight`` ``(..., rows, cols)``, one scale
    per ``block`` of the last two dims (leading dims, experts, get one per entry), as the hub's
    FP8 checkpoints store them (``weight_scale_inv``): a block's scale is ``1 / (448 / amax)``
    (1 for an all-zero block) and its values ``clamp(w * 448 / amax, +-448)`` rounded to e4m3,
    computed in float32 as transformers' ``Fp8Quantize`` does (bit for bit where its rules
    apply), partial last blocks included (zero padding changes no amax). The inverse of
    :func:`dequantize_region` up to e4m3 rounding.

    >>> q, s = quantize_fp8_blocks(torch.tensor([[1.0, -2.0, 0.0], [4.0, 0.0, 0.0]]), (1, 2))
    >>> q.float(), s
    (tensor([[ 224., -448.,    0.],
            [ 448.,    0.,    0.]]), tensor([[0.0045, 1.0000],
            [0.0089, 1.0000]]))
    """
    if weight.dim() < 2 or len(block) != 2 or None in block:
        raise PlanError(f"quantize_fp8_blocks takes a weight (..., rows, cols) and a block of 2 positive "
                        f"ints, got shape {tuple(weight.shape)} and block {tuple(block)}")
    _check_block(tuple(block))
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    *lead, rows, cols = weight.shape
    bm, bn = block
    grid = (-(-rows // bm), -(-cols // bn))
    padded = weight.new_zeros((*lead, grid[0] * bm, grid[1] * bn), dtype=torch.float32)
    padded[..., :rows, :cols] = weight
    tiles = padded.reshape(*lead, grid[0], bm, grid[1], bn)
    max_abs = tiles.abs().amax(dim=(-3, -1))
    safe = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = torch.where(max_abs > 0, fp8_max / safe, torch.ones_like(max_abs))
    q = torch.clamp(tiles * scales.unsqueeze(-1).unsqueeze(-3), min=-fp8_max, max=fp8_max)
    q = q.to(torch.float8_e4m3fn).reshape(padded.shape)[..., :rows, :cols]
    return q.clone(memory_format=torch.contiguous_format), (1.0 / scales).to(torch.float32)


def dequantize_region(q: torch.Tensor, scale: torch.Tensor, weight_region: Region, block: Block,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight_region`` of the dequantized weight, from its values ``q`` (the weight read at the
    region) and ``scale`` (the scales read at :func:`scale_region`): ``q.float() * scale`` in
    float32, cast once to ``dtype``. Equal bit for bit to the same slice of the full
    dequantization, boundaries inside a block and a partial last block included.

    >>> q = torch.ones(3, 2, dtype=torch.float8_e4m3fn)
    >>> dequantize_region(q, torch.tensor([[2.0], [3.0]]), Region((1, 0), (3, 2)), (2, 2), torch.float32)
    tensor([[2., 2.],
            [3., 3.],
            [3., 3.]])
    """
    _check_pair(q, scale, weight_region, block)
    return (q.float() * expand_scale(decode_scale(scale), weight_region, block)).to(dtype)


def dequantize_region_into(q: torch.Tensor, scale: torch.Tensor, weight_region: Region, block: Block,
                           out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize_region` in float32 into ``out`` (float32, shaped like ``weight_region``),
    using ``scratch`` (the same) for the expanded scale: no temporary the size of the region is
    allocated, so a caller that reuses both buffers across chunks keeps the heap flat. Equal bit
    for bit to ``dequantize_region(..., torch.float32)``; returns ``out``.

    >>> q = torch.ones(3, 2, dtype=torch.float8_e4m3fn)
    >>> dequantize_region_into(q, torch.tensor([[2.0], [3.0]]), Region((1, 0), (3, 2)), (2, 2),
    ...                        torch.empty(3, 2), torch.empty(3, 2))
    tensor([[2., 2.],
            [3., 3.],
            [3., 3.]])
    """
    _check_pair(q, scale, weight_region, block)
    out.copy_(q)
    s = decode_scale(scale)
    steps = list(enumerate(zip(weight_region.offsets, weight_region.sizes, block, strict=True)))
    last = max((d for d, (_, _, b) in steps if b is not None and b > 1), default=None)
    for d, (a, n, b) in steps:
        if b is None:
            s = s.unsqueeze(d)
        elif b > 1:
            index = torch.arange(a, a + n, device=s.device) // b - a // b
            shape = s.shape[:d] + (n,) + s.shape[d + 1:]
            if d == last and tuple(shape) == tuple(out.shape):  # the full-size expansion: into scratch
                s = torch.index_select(s, d, index, out=scratch)
            else:
                s = s.index_select(d, index)
    return out.mul_(s.expand(weight_region.sizes))


def mxfp4_regions(weight_region: Region, *, exact: bool = False) -> tuple[Region, Region]:
    """The (``*_blocks``, ``*_scales``) regions holding ``weight_region`` of an MXFP4 weight's
    logical values ``(..., rows, K)``.

    With ``exact=False`` (to dequantize) any column boundary is handled: the regions cover every
    32-group the weight region touches, and :func:`mxfp4_dequantize_region` cuts the columns out.
    With ``exact=True`` (to keep a shard quantized) the regions must hold exactly the weight
    region: a column boundary that is not a multiple of 32 (inside a group, or inside a byte)
    raises ``ShardingError``, since such a shard has no packed form of its own.

    >>> mxfp4_regions(Region((0, 8, 360), (2, 4, 360)))  # gpt-oss K=2880 at tp=8: inside a group
    (Region(offsets=(0, 8, 11, 0), sizes=(2, 4, 12, 16)), Region(offsets=(0, 8, 11), sizes=(2, 4, 12)))
    >>> mxfp4_regions(Region((0, 64), (4, 32)), exact=True)
    (Region(offsets=(0, 2, 0), sizes=(4, 1, 16)), Region(offsets=(0, 2), sizes=(4, 1)))
    """
    ndim = len(weight_region.sizes)
    if ndim < 2:
        raise PlanError(f"an MXFP4 weight has at least 2 dims (rows, K), got region {weight_region}")
    if exact:
        a, n = weight_region.offsets[-1], weight_region.sizes[-1]
        bad = [x for x in (a, a + n) if x % MXFP4_GROUP]
        if bad:
            raise ShardingError(
                f"MXFP4 weight region {weight_region} has its column boundary {bad[0]} inside a "
                f"{MXFP4_GROUP}-value scale group{' and inside a byte' if bad[0] % 2 else ''}: such a "
                f"shard cannot stay quantized; choose a degree that splits K into multiples of "
                f"{MXFP4_GROUP}, shard another dim, or load with dequantize=True")
    scales = scale_region(weight_region, _mxfp4_block(ndim))
    blocks = Region(scales.offsets + (0,), scales.sizes + (MXFP4_GROUP_BYTES,))
    return blocks, scales


def unpack_e2m1(blocks: torch.Tensor) -> torch.Tensor:
    """Float32 values of packed MXFP4 ``blocks`` ``(..., G, 16)``, shape ``(..., G * 32)``: value
    ``2j`` is the low nibble of byte ``j``, value ``2j + 1`` the high one (transformers' order).

    >>> unpack_e2m1(torch.tensor([[0x21, 0xF7]], dtype=torch.uint8))
    tensor([ 0.5000,  1.0000,  6.0000, -6.0000])
    """
    if blocks.dtype != torch.uint8:
        raise PlanError(f"MXFP4 blocks must be uint8, got {blocks.dtype}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    return values.reshape(*blocks.shape[:-2], math.prod(blocks.shape[-2:]) * 2)


def mxfp4_dequantize_region(blocks: torch.Tensor, scales: torch.Tensor, weight_region: Region,
                            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight_region`` of an MXFP4 weight's dequantized logical values ``(..., rows, K)``, from
    ``blocks`` and ``scales`` read at :func:`mxfp4_regions` (``exact=False``): any boundary, equal
    bit for bit to the same slice of the full dequantization (transformers'
    ``convert_moe_packed_tensors``, before its transpose to ``(E, K, rows)``). Values are scaled
    in float32 with ``ldexp(value, byte - 127)`` as transformers does, then cast once; a scale
    byte of 255 (NaN in the OCP MX spec) thus gives ``value * 2 ** 128``: 0 stays 0, 0.5 gives
    2 ** 127, larger values inf.

    >>> blocks = torch.full((1, 2, 16), 0x22, dtype=torch.uint8)  # every value 1.0
    >>> scales = torch.tensor([[127, 128]], dtype=torch.uint8)    # x1, then x2
    >>> mxfp4_dequantize_region(blocks, scales, Region((0, 30), (1, 4)), torch.float32)
    tensor([[1., 1., 2., 2.]])
    """
    want_blocks, want_scales = mxfp4_regions(weight_region)
    if tuple(blocks.shape) != want_blocks.sizes or tuple(scales.shape) != want_scales.sizes:
        raise PlanError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit "
                        f"weight region {weight_region}: expected {want_blocks.sizes} and "
                        f"{want_scales.sizes}; read them at mxfp4_regions(region)")
    values = unpack_e2m1(blocks)
    start = weight_region.offsets[-1] - want_scales.offsets[-1] * MXFP4_GROUP if values.shape[-1] else 0
    values = values.narrow(-1, start, weight_region.sizes[-1])
    # ldexp, not a multiply by exp2(byte - 127): 2 ** 128 is not a float32, yet 0.5 * 2 ** 128 is.
    block = _mxfp4_block(len(weight_region.sizes))
    exponents = expand_scale(scales.to(torch.int32) - E8M0_BIAS, weight_region, block)
    return torch.ldexp(values, exponents).to(dtype)


__all__ = [
    "E2M1_VALUES",
    "MXFP4_GROUP",
    "QuantScheme",
    "decode_scale",
    "dequantize_region",
    "dequantize_region_into",
    "expand_scale",
    "is_block_aligned",
    "mxfp4_dequantize_region",
    "mxfp4_regions",
    "offsets_in_block",
    "quantize_fp8_blocks",
    "scale_region",
    "scale_shape",
    "unpack_e2m1",
]
