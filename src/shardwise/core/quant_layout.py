"""Where a quantized weight's scales live on each rank, and what a rank reads to dequantize
its shard (pure). A rank holds the scale of every block its weight shard touches; where a
boundary cuts a block both neighbours hold it, and a gather takes it once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from shardwise.core.pieces import Piece
from shardwise.core.quant import (
    MXFP4_BLOCK_DTYPES,
    MXFP4_GROUP,
    MXFP4_GROUP_BYTES,
    MXFP4_SCALE_DTYPES,
    MXFP4_SUFFIXES,
    SCHEMES,
    Block,
    QuantScheme,
    as_block,
    dequantize_region,
    is_block,
    is_block_aligned,
    mxfp4_dequantize_region,
    mxfp4_regions,
    pair_of,
    scale_region,
    scale_shape,
)
from shardwise.core.spec import (
    Layout,
    Region,
    ShardSpec,
    check_shardable,
    dividing_degrees,
    local_layout,
    local_shape,
)
from shardwise.core.walk import named_modules
from shardwise.errors import PlanError, ShardingError


@dataclass(frozen=True)
class QuantTie:
    """The scales of the model tensor ``weight`` of global ``weight_shape``: one per ``block``
    (None: the scales lack that dim), in ``scheme`` (``"mxfp4"``: the packed ``x_blocks``, block
    ``(1, ..., 1, None)``)."""

    weight: str
    weight_shape: tuple[int, ...]
    block: Block
    scheme: str = "fp8_block"

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_shape", tuple(int(s) for s in self.weight_shape))
        object.__setattr__(self, "block", tuple(self.block))
        if len(self.block) != len(self.weight_shape) or not is_block(self.block):
            raise PlanError(f"QuantTie of {self.weight!r}: block {self.block} must hold one positive int "
                            f"(or None) per dim of the weight's shape {self.weight_shape}")
        if self.scheme not in SCHEMES:
            raise PlanError(f"QuantTie of {self.weight!r}: scheme must be one of {SCHEMES}, got "
                            f"{self.scheme!r}")

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return scale_shape(self.weight_shape, self.block)


def _scale_dim(block: Block, dim: int, what: str) -> int:
    """The scale dim of weight dim ``dim``; ``PlanError`` naming ``what`` if the scales lack it."""
    if block[dim] is None:
        raise PlanError(f"{what}: its scale tensor has no dim for weight dim {dim} (block {block}), so a "
                        "shard of that dim has no scales of its own")
    return dim - sum(b is None for b in block[:dim])


def _held_scales(tie: QuantTie, spec: ShardSpec, degree: int, rank: int) -> tuple[Layout, tuple[int, ...]]:
    boxes = [scale_region(r, tie.block) for r, _ in local_layout(tie.weight_shape, spec, degree, rank)]
    return _stack(boxes, None if spec.dim is None else _scale_dim(tie.block, spec.dim, repr(tie.weight)))


def scale_layout(tie: QuantTie, spec: ShardSpec, degree: int, rank: int) -> Layout:
    """The scale regions rank ``rank`` holds for its shard of ``tie.weight``, with their offsets
    in its local scales (rank 1 of 576 rows at tp=8, 128-row blocks: scale rows 0 and 1)."""
    return _held_scales(tie, spec, degree, rank)[0]


def scale_local_shape(tie: QuantTie, spec: ShardSpec, degree: int, rank: int) -> tuple[int, ...]:
    """Shape of rank ``rank``'s local scales (ranks differ where blocks are cut)."""
    return _held_scales(tie, spec, degree, rank)[1]


def scale_owned_layout(tie: QuantTie, spec: ShardSpec, degree: int, rank: int) -> Layout:
    """The held scale regions whose block starts in rank ``rank``'s weight shard (replicated: all
    on rank 0), with local offsets: over all ranks they tile the scales exactly once."""
    held = scale_layout(tie, spec, degree, rank)
    if spec.dim is None:  # replicated
        return held if rank == 0 else []
    d, b, sd = spec.dim, tie.block[spec.dim], _scale_dim(tie.block, spec.dim, repr(tie.weight))
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
    """Whether every rank's scales are the scales split by ``spec`` with no block cut: then each
    rank's (weight, scale) pair is an ordinary shard (a DTensor an FP8 kernel reads as is)."""
    if spec.dim is None or degree == 1:  # replicated, or one rank
        return True
    if tie.block[spec.dim] is None:  # a split of a dim the scales lack: every shard cuts blocks
        return False
    on_scales = replace(spec, dim=_scale_dim(tie.block, spec.dim, repr(tie.weight)))
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


def fitting_degrees(shape: tuple[int, ...], spec: ShardSpec, fits: Callable[[int], bool]) -> list[int]:
    """The degrees from 2 to 64 that split ``shape`` by ``spec`` and that ``fits`` accepts."""
    return [d for d in dividing_degrees([(shape, spec)]) if d > 1 and fits(d)]


def take_layout(tensor: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of ``shape`` holding each region of ``layout`` of ``tensor`` at its offset."""
    out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    for region, off in layout:
        out[Region(off, region.sizes).slices()] = tensor[region.slices()]
    return out


def quant_pairs(module: nn.Module) -> list[tuple[str, str, Block, str]]:
    """``(values, scales, block, scheme)`` of each pair (:func:`pair_of`) of ``module``'s own
    parameters: an ``FP8Linear`` ``weight`` (block ``block_size``), a 3-D ``FP8Experts``
    projection (``(1, *block_size)``), an MXFP4 ``x_blocks`` (``(1, ..., 1, None)``)."""
    held = {n: p for n, p in module._parameters.items() if p is not None}
    out: list[tuple[str, str, Block, str]] = []
    block, read = None, False
    for name, values in held.items():
        found = pair_of(name, values.dtype, held)
        if found is None:
            continue
        if not read:  # read once a pair is found: a module without one raises inside torch's getattr
            block, read = as_block(getattr(module, "block_size", None)), True
        scales = held[found[0]]
        if (found[1] == "fp8_block" and block is not None and values.dim() == scales.dim()
                and (values.dim() == 3 or (values.dim() == 2 and name == "weight"))):
            out.append((name, found[0], (1,) * (values.dim() - 2) + block, "fp8_block"))
        elif (found[1] == "mxfp4" and values.dtype in MXFP4_BLOCK_DTYPES
              and scales.dtype in MXFP4_SCALE_DTYPES
              and values.dim() >= 3 and values.shape[-1] == MXFP4_GROUP_BYTES):
            out.append((name, found[0], (1,) * (values.dim() - 1) + (None,), "mxfp4"))
    return out


def is_tied_scale(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is the scales of a pair of ``model`` (:func:`quant_pairs`)."""
    path, _, leaf = name.rpartition(".")
    return any(scales == leaf for _, scales, _, _ in quant_pairs(model.get_submodule(path)))


def quant_ties(model: nn.Module) -> dict[str, QuantTie]:
    """``{scales: QuantTie}`` of every pair of ``model``; ``PlanError`` for a misfit scale shape."""
    ties = {}
    for path, module in named_modules(model):
        prefix = f"{path}." if path else ""
        for values, scales, block, scheme in quant_pairs(module):
            weight, scale = module._parameters[values], module._parameters[scales]
            assert weight is not None and scale is not None  # quant_pairs names set parameters only
            tie = QuantTie(f"{prefix}{values}", tuple(weight.shape), block, scheme)
            held = tuple(scale.shape)
            if held != tie.scale_shape:
                raise PlanError(f"{prefix}{scales} has shape {held} but its weight {tie.weight_shape} in "
                                f"blocks {block} needs {tie.scale_shape}; build the module with the block "
                                "size of its checkpoint")
            ties[f"{prefix}{scales}"] = tie
    return ties


def tie_scales(model: nn.Module, specs: dict, styles: dict, keys: dict,
               degrees: dict[str, int] | None = None) -> dict[str, QuantTie]:
    """:func:`quant_ties` of ``model``, each scale given its weight's spec in ``specs``. A sharded
    FP8 linear must be planned by its module key (``PlanError``); a sharded MXFP4 weight must keep
    every 32-group whole at its degree in ``degrees`` (``ShardingError``)."""
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
    """The error of the first MXFP4 ``x_blocks`` shard region cutting a 32-group, else None."""
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
    whole = fitting_degrees(tie.weight_shape, spec, lambda d: _cut_group(tie, spec, d) is None)
    hint = (f"degrees that keep every group whole: {', '.join(map(str, whole))}" if whole else
            f"no degree > 1 does on dim {spec.dim}; shard dim 0 (the experts: the ep plan), or keep it whole")
    raise ShardingError(f"plan key {key!r} splits the MXFP4 blocks {tie.weight!r} {tie.weight_shape} on dim "
                        f"{spec.dim} over {spec.axis}={degree}: {error} ({hint})") from error


DEQUANT_CHUNK = 1 << 22  # weight elements dequantized at once: 16 MiB of float32 temporaries
# float32 elements: above glibc's largest dynamic mmap threshold (32 MiB), so always mmapped and
# freeing it never raises the threshold
_WORK_FLOOR = (32 << 20) // 4 + 4096


def _swap(region: Region) -> Region:
    """``region`` with its last two dims swapped."""
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
    """``((values layout, local shape), (scales layout, local shape))``: the boxes of the stored
    tensors rank ``rank`` reads to dequantize its shard of a tensor of ``shape`` split by ``spec``,
    stored in ``scheme`` (``transposed``: stored with its last two dims swapped, gpt-oss)."""
    if len(scheme.block) != len(shape):
        raise PlanError(f"{scheme} does not fit a weight of {len(shape)} dims {tuple(shape)}")
    values, scales = [], []
    for region, _ in local_layout(shape, spec, degree, rank):
        v, s = scheme.stored_regions(_swap(region) if transposed else region)
        values.append(v)
        scales.append(s)
    dim = None if spec.replicated else spec.dim
    if dim is not None and transposed and dim >= len(shape) - 2:
        dim = 2 * len(shape) - 3 - dim
    scale_dim = None if dim is None else _scale_dim(scheme.block, dim, f"{scheme} split by {spec}")
    return _stack(values, dim), _stack(scales, scale_dim)


def dequantize_shard(values: torch.Tensor, scales: torch.Tensor, scheme: QuantScheme, shape: tuple[int, ...],
                     spec: ShardSpec, degree: int, rank: int, dtype: torch.dtype, *, transposed: bool = False,
                     chunk_elements: int = DEQUANT_CHUNK) -> torch.Tensor:
    """Rank ``rank``'s shard in ``dtype`` from ``values`` and ``scales`` read as
    :func:`dequant_reads` says, bit for bit the same slice of the whole; dim-0 chunks of about
    ``chunk_elements`` elements, FP8 ones in one float32 workspace."""
    out = torch.empty(local_shape(shape, spec, degree), dtype=dtype, device=values.device)
    (held_v, _), (held_s, _) = dequant_reads(scheme, shape, spec, degree, rank, transposed=transposed)
    regions = list(local_layout(shape, spec, degree, rank))
    steps = [max(1, chunk_elements // max(1, r.numel // r.sizes[0])) if r.numel else 0 for r, _ in regions]
    # one float32 workspace (values, scales) for all FP8 chunks: glibc would keep freed temporaries
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
            need_v, need_s = scheme.stored_regions(logical)
            v, s = values[_within(need_v, vbox, voff).slices()], scales[_within(need_s, sbox, soff).slices()]
            if scheme.name == "mxfp4":
                piece = mxfp4_dequantize_region(v, s, logical, dtype)
            else:
                assert work is not None  # FP8 with a non-empty region: cap > 0
                k = part.numel
                piece = dequantize_region(v, s, logical, scheme.block, out=work[:k].view(logical.sizes),
                                          scratch=work[cap:cap + k].view(logical.sizes))
            out[local.slices()].copy_(piece.transpose(-1, -2) if transposed else piece)  # cast once
    return out


def scale_pieces(pieces: Sequence[Piece], block: Block, key_of: Callable[[str], str]) -> tuple[Piece, ...]:
    """The pieces of the assembled scales from the ``pieces`` of the values (each stored tensor
    with its scales ``key_of(key)``; ``stacked`` dims have block 1); ``PlanError`` for a piece
    off a block boundary of the assembled or the stored tensor."""
    out = []
    for piece in pieces:
        kept = [d for d in range(len(piece.offsets)) if d not in piece.stacked]
        kept_block: dict[int, int] = {}  # block of each kept dim (checked not None below)
        for i, d in enumerate(kept):
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


__all__ = [
    "DEQUANT_CHUNK", "MXFP4_SUFFIXES", "QuantTie", "dequant_reads", "dequantize_shard", "fitting_degrees",
    "is_tied_scale", "quant_pairs", "quant_ties", "scale_layout", "scale_local_shape", "scale_owned_layout",
    "scale_pieces", "take_layout", "tie_aligned", "tie_scales",
]
