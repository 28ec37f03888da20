"""Block-quantized tensors (pure): the one scale-naming rule, the one reading of a
``quantization_config``, the one pairing of values and scales, and the region math on the logical
weight (MXFP4: unpacked ``(..., rows, K)``). Dequantization computes in float32 and casts once."""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass

import torch

from shardwise.core.adapter import folder_quantization
from shardwise.core.spec import Region, Shape
from shardwise.errors import CheckpointError, PlanError, ShardingError

Block = tuple[int | None, ...]
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # e2m1 values per e8m0 scale
MXFP4_GROUP_BYTES = MXFP4_GROUP // 2  # two values per byte: the low nibble first
MXFP4_SUFFIXES = ("_blocks", "_scales")  # transformers' serialized names of an MXFP4 parameter
FP8_SCALE = "_scale_inv"  # x.weight -> x.weight_scale_inv (DeepSeek-V3, transformers' FP8Linear)
E8M0_BIAS = 127
SCHEMES = ("fp8_block", "mxfp4")
SUPPORTED_QUANT = ("FP8 with block scales (quant_method 'fp8', weight_block_size [128, 128] and others: "
                   "transformers' FP8Linear) and MXFP4 (quant_method 'mxfp4': gpt-oss's experts as "
                   "x_blocks / x_scales, one e8m0 scale per 32 e2m1 values)")
FLOAT8 = frozenset((torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz))
# MXFP4 as bytes: gpt-oss's U8, or safetensors 0.8's F4 (torch.float4_e2m1fn_x2, the same byte:
# two e2m1 values, the low nibble first) blocks and F8_E8M0 (torch.float8_e8m0fnu) scales
MXFP4_BLOCK_DTYPES = frozenset((torch.uint8, torch.float4_e2m1fn_x2))
MXFP4_SCALE_DTYPES = frozenset((torch.uint8, torch.float8_e8m0fnu))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An MXFP4 block or scale tensor as its uint8 bytes (a view; uint8 itself unchanged)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def scale_key(name: str, scheme: str = "fp8_block") -> str:
    """The scales of the values ``name``, stored or held (the one naming rule): ``x.weight`` ->
    ``x.weight_scale_inv`` (FP8), ``x_blocks`` -> ``x_scales`` (``"mxfp4"``)."""
    if scheme == "mxfp4":
        return name.removesuffix(MXFP4_SUFFIXES[0]) + MXFP4_SUFFIXES[1]
    return name + FP8_SCALE


def pair_of(name: str, dtype: torch.dtype, names: Container[str]) -> tuple[str, str] | None:
    """``(scales name, scheme)`` when ``name`` of ``dtype`` is the values of a pair among
    ``names`` (stored or held): float8 next to :func:`scale_key`, MXFP4 ``x_blocks`` next to
    ``x_scales`` (callers check dtypes and shapes); else None."""
    if dtype in FLOAT8:
        return (scale_key(name), "fp8_block") if scale_key(name) in names else None
    if name.endswith(MXFP4_SUFFIXES[0]) and scale_key(name, "mxfp4") in names:
        return scale_key(name, "mxfp4"), "mxfp4"
    return None


def _config_get(qc, name: str):
    return qc.get(name) if isinstance(qc, dict) else getattr(qc, name, None)


def is_block(block) -> bool:
    """Whether every entry is a positive int or None (a dim the scale lacks)."""
    return all(b is None or (isinstance(b, int) and not isinstance(b, bool) and b > 0) for b in block)


def as_block(value) -> tuple[int, int] | None:
    """``value`` as a 2-D block size (two positive ints), else None."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and None not in value and is_block(value):
        return int(value[0]), int(value[1])
    return None


def quant_scheme(qc) -> tuple[str | None, str | None]:
    """``(quant_method, None)`` for a ``quantization_config`` (dict, config object, or
    bitsandbytes' flag string) shardwise reads: block-scaled ``"fp8"`` or ``"mxfp4"``; else
    ``(quant_method, why not)`` ("": another scheme)."""
    if isinstance(qc, str):  # bitsandbytes' flags on the model
        return qc, ""
    method = _config_get(qc, "quant_method")
    method = str(getattr(method, "value", method)) if method is not None else None
    if method == "mxfp4":  # fixed layout: 32 values a scale (its dequantize flag is a load option)
        return method, None
    if method != "fp8":
        return method, ""
    block = _config_get(qc, "weight_block_size")
    if as_block(block) is None:
        return method, f"; weight_block_size is {block!r}: per-tensor FP8 scales are not supported yet"
    for name, ok in (("scale_fmt", ("float", None)), ("activation_scheme", ("dynamic", None)),
                     ("expert_dtype", ("fp8", None))):
        if _config_get(qc, name) not in ok:
            return method, f"; its {name} is {_config_get(qc, name)!r} (supported: {ok[0]!r})"
    return method, None


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's ``config`` (None: nothing says it), found in ``where``; ``has_file``: the
    checkpoint has a model config file."""

    config: object
    where: object
    has_file: bool

    @property
    def method(self) -> str | None:
        return None if self.config is None else quant_scheme(self.config)[0]

    @property
    def block(self) -> tuple[int, int] | None:
        """The FP8 ``weight_block_size``, else None."""
        return as_block(_config_get(self.config, "weight_block_size")) if self.method == "fp8" else None

    def fp8_block(self) -> tuple[int, int]:
        """The block of FP8 scales; ``CheckpointError`` where no supported config says it."""
        if self.config is None:
            raise CheckpointError(f"{self.where}: FP8 weights with scales, but no quantization_config (the "
                                  "model config next to the weights, or the model's config) says their "
                                  "weight_block_size; put the checkpoint's model config beside it")
        method, why = quant_scheme(self.config)
        if why is not None:
            raise CheckpointError(f"{self.where}: quantization {method!r}{why}; shardwise reads "
                                  f"{SUPPORTED_QUANT}")
        if method != "fp8" or self.block is None:
            raise CheckpointError(f"{self.where}: quant_method {method!r}, but the checkpoint holds FP8 "
                                  "weights with block scales; load a checkpoint whose model config "
                                  "describes its tensors")
        return self.block


def read_quantization(folder, model_config=None) -> QuantConfig:
    """The one reading of a checkpoint's ``quantization_config``: the model adapter's side file
    in ``folder``, else ``model_config.quantization_config``."""
    found = folder_quantization(folder)
    if found is not None and found[0] is not None:
        return QuantConfig(found[0], found[1], True)
    qc = getattr(model_config, "quantization_config", None)
    where = "model.config" if qc is not None else found[1] if found is not None else folder
    return QuantConfig(qc, where, found is not None)


@dataclass(frozen=True)
class QuantScheme:
    """How a stored weight is quantized: ``name`` in ``SCHEMES`` and ``block``, one entry per dim
    of the logical weight (None: the scales lack that dim). ``"mxfp4"``: uint8 ``*_blocks``
    ``(..., K/32, 16)`` and e8m0 ``*_scales`` ``(..., K/32)``, block ``(1, ..., 1, 32)``."""

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
        """Shapes of the stored (values, scales) of a logical weight of ``shape``."""
        scales = scale_shape(shape, self.block)
        if self.name == "mxfp4":
            if shape[-1] % MXFP4_GROUP:
                raise PlanError(f"an MXFP4 weight of shape {tuple(shape)} needs its last dim to be a "
                                f"multiple of {MXFP4_GROUP}")
            return scales + (MXFP4_GROUP_BYTES,), scales
        return tuple(int(s) for s in shape), scales

    def stored_regions(self, region: Region) -> tuple[Region, Region]:
        """The (values, scales) regions holding ``region`` of the logical weight."""
        return mxfp4_regions(region) if self.name == "mxfp4" else (region, scale_region(region, self.block))

    def stored_keys(self, name: str) -> tuple[str, str]:
        """The hub's keys of the (values, scales) of parameter ``name``."""
        values = name + MXFP4_SUFFIXES[0] if self.name == "mxfp4" else name
        return values, scale_key(values, self.name)


def _mxfp4_block(ndim: int) -> Block:
    return (1,) * (ndim - 1) + (MXFP4_GROUP,)


def _check_block(block: Block) -> None:
    if not is_block(block):
        raise PlanError(f"a quantization block must hold positive ints or None, got {block!r}")


def _check_ndim(region: Region, block: Block) -> None:
    _check_block(block)
    if len(region.sizes) != len(block):
        raise PlanError(f"block {block} has {len(block)} dims but the weight region {region} has "
                        f"{len(region.sizes)}; give one block entry per weight dim (None for a dim "
                        "the scale lacks)")


def scale_shape(shape: Shape, block: Block) -> tuple[int, ...]:
    """``ceil(size / b)`` per dim the scale has: ``scale_shape((576, 7168), (128, 128)) == (5, 56)``."""
    return scale_region(Region((0,) * len(shape), tuple(int(s) for s in shape)), block).sizes


def scale_region(weight_region: Region, block: Block) -> Region:
    """The scales of every block ``weight_region`` touches: ``[a // b, ceil(end / b))`` per dim
    (rows 72..144 in 128-row blocks: scale rows 0 and 1); a ``None`` dim is absent."""
    _check_ndim(weight_region, block)
    offsets, sizes = [], []
    for a, n, b in zip(weight_region.offsets, weight_region.sizes, block, strict=True):
        if b is None:
            continue
        offsets.append(a // b)
        sizes.append(-(-(a + n) // b) - a // b if n else 0)
    return Region(tuple(offsets), tuple(sizes))


def is_block_aligned(shape: Shape, weight_region: Region, block: Block) -> bool:
    """Whether every boundary of ``weight_region`` is a block boundary or the tensor's edge (whole
    on a ``None`` dim): then no two tiling regions share a block's scale."""
    _check_ndim(weight_region, block)
    return all(
        (a == 0 and n == size) if b is None else (a % b == 0 and ((a + n) % b == 0 or a + n == size))
        for a, n, b, size in zip(weight_region.offsets, weight_region.sizes, block, shape, strict=True)
    )


def decode_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: ``uint8`` is e8m0 (``2 ** (byte - 127)``, 255 gives inf, as transformers)."""
    if scale.dtype in MXFP4_SCALE_DTYPES:
        return torch.exp2(as_bytes(scale).to(torch.int32) - E8M0_BIAS)
    if not scale.dtype.is_floating_point:
        raise PlanError(f"scales must be a float dtype or uint8 e8m0, got {scale.dtype}")
    return scale.float()


def expand_scale(scale: torch.Tensor, weight_region: Region, block: Block,
                 scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The scale of each element of ``weight_region`` (shaped like it) from ``scale`` read at
    :func:`scale_region`; ``scratch`` (region-shaped) receives the full-size expansion, if any."""
    want = scale_region(weight_region, block).sizes
    if tuple(scale.shape) != want:
        raise PlanError(f"scale of shape {tuple(scale.shape)} does not fit weight region {weight_region} "
                        f"with block {block}: expected {want}; read it at scale_region(region, block)")
    out = scale
    steps = list(enumerate(zip(weight_region.offsets, weight_region.sizes, block, strict=True)))
    last = max((d for d, (_, _, b) in steps if b is not None and b > 1), default=None)
    for d, (a, n, b) in steps:
        if b is None:
            out = out.unsqueeze(d)
        elif b > 1:
            index = torch.arange(a, a + n, device=scale.device) // b - a // b
            shape = out.shape[:d] + (n,) + out.shape[d + 1:]
            into = scratch if scratch is not None and d == last and shape == scratch.shape else None
            out = torch.index_select(out, d, index, out=into)
    return out.expand(weight_region.sizes)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn values, float32 scales)`` of ``weight`` ``(..., rows, cols)``, one scale
    per ``block`` of the last two dims, as transformers' ``Fp8Quantize`` (partial blocks too)."""
    if weight.dim() < 2 or as_block(block) is None:
        raise PlanError(f"quantize_fp8_blocks takes a weight (..., rows, cols) and a block of 2 positive "
                        f"ints, got shape {tuple(weight.shape)} and block {tuple(block)}")
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
                      dtype: torch.dtype = torch.bfloat16, *, out: torch.Tensor | None = None,
                      scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``weight_region`` of the dequantized weight from ``q`` (read at the region) and ``scale``
    (read at :func:`scale_region`): ``q.float() * scale``, cast once to ``dtype``, equal bit for bit
    to the same slice of the whole. With ``out`` and ``scratch`` (float32, region-shaped) it
    computes into ``out`` (no cast), so a chunked caller allocates no temporaries."""
    if tuple(q.shape) != weight_region.sizes:
        raise PlanError(f"quantized values of shape {tuple(q.shape)} do not fit weight region "
                        f"{weight_region}; read the weight at the region itself")
    scales = expand_scale(decode_scale(scale), weight_region, block, scratch)
    return (q.float() * scales).to(dtype) if out is None else out.copy_(q).mul_(scales)


def mxfp4_regions(weight_region: Region, *, exact: bool = False) -> tuple[Region, Region]:
    """The (``*_blocks``, ``*_scales``) regions of every 32-group ``weight_region`` of the logical
    MXFP4 weight touches; ``exact``: ``ShardingError`` for a column boundary inside a group."""
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
    """Float32 values ``(..., G * 32)`` of ``blocks`` ``(..., G, 16)``, low nibble first."""
    if blocks.dtype not in MXFP4_BLOCK_DTYPES:
        raise PlanError(f"MXFP4 blocks must be uint8 or float4_e2m1fn_x2, got {blocks.dtype}")
    blocks = as_bytes(blocks)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    return values.reshape(*blocks.shape[:-2], math.prod(blocks.shape[-2:]) * 2)


def mxfp4_dequantize_region(blocks: torch.Tensor, scales: torch.Tensor, weight_region: Region,
                            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight_region`` of the dequantized MXFP4 weight from ``blocks`` and ``scales`` read at
    :func:`mxfp4_regions`: ``ldexp(value, byte - 127)`` in float32 (as transformers), cast once."""
    want_blocks, want_scales = mxfp4_regions(weight_region)
    if tuple(blocks.shape) != want_blocks.sizes or tuple(scales.shape) != want_scales.sizes:
        raise PlanError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit "
                        f"weight region {weight_region}: expected {want_blocks.sizes} and "
                        f"{want_scales.sizes}; read them at mxfp4_regions(region)")
    values = unpack_e2m1(blocks)
    start = weight_region.offsets[-1] - want_scales.offsets[-1] * MXFP4_GROUP if values.shape[-1] else 0
    values = values.narrow(-1, start, weight_region.sizes[-1])
    # ldexp, not a multiply by exp2(byte - 127): 2 ** 128 is not a float32, yet 0.5 * 2 ** 128 is.
    # In two halves: torch before 2.10 computes ldexp as a multiply by 2 ** e (inf at e = 128:
    # 0 * inf = NaN); each half's power is a float32 and the first multiply is exact, so the
    # result is rounded once, as a true ldexp rounds it.
    block = _mxfp4_block(len(weight_region.sizes))
    exponents = expand_scale(as_bytes(scales).to(torch.int32) - E8M0_BIAS, weight_region, block)
    half = exponents // 2
    return torch.ldexp(torch.ldexp(values, half), exponents - half).to(dtype)


__all__ = [
    "E2M1_VALUES", "FLOAT8", "FP8_SCALE", "MXFP4_BLOCK_DTYPES", "MXFP4_GROUP", "MXFP4_GROUP_BYTES",
    "MXFP4_SCALE_DTYPES", "MXFP4_SUFFIXES", "QuantConfig", "QuantScheme", "SUPPORTED_QUANT",
    "read_quantization",
    "as_block", "as_bytes", "decode_scale", "dequantize_region", "expand_scale",
    "is_block", "is_block_aligned", "mxfp4_dequantize_region", "mxfp4_regions", "pair_of",
    "quant_scheme", "quantize_fp8_blocks", "scale_key", "scale_region", "scale_shape", "unpack_e2m1",
]
