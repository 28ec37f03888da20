"""Shard specs and the region math every path shares (pure: shapes, degrees, ranks are ints).
A rank's local shard is its regions (boxes of the canonical tensor) concatenated along the shard dim."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.errors import PlanError, ShardingError

Shape = Sequence[int]
SHARD_AXES = ("tp", "ep")
Layout = list[tuple["Region", tuple[int, ...]]]


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Region:
    """A box of the canonical tensor: ``offsets`` and ``sizes`` per dim.

    >>> Region((4, 0), (4, 4)).slices()
    (slice(4, 8, None), slice(0, 4, None))
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(self.offsets))
        object.__setattr__(self, "sizes", tuple(self.sizes))
        if len(self.offsets) != len(self.sizes):
            raise PlanError(f"Region offsets {self.offsets} and sizes {self.sizes} differ in length")
        if not all(is_int(v) and v >= 0 for v in self.offsets + self.sizes):
            raise PlanError(f"Region offsets {self.offsets} and sizes {self.sizes} must be non-negative ints")

    def slices(self) -> tuple[slice, ...]:
        """Index of this region in the canonical tensor: ``canon[region.slices()]``."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, repr=False)
class ShardSpec:
    """How one tensor splits over the mesh ``axis`` (``"tp"`` or ``"ep"``): on ``dim`` (None:
    replicated), each packed block of ratios ``blocks`` on its own (gate|up rows stay apart).

    >>> ShardSpec(dim=0, blocks=(1, 1))
    ShardSpec(dim=0, blocks=(1, 1))
    >>> ShardSpec(dim=0, axis="ep")
    ShardSpec(dim=0, blocks=(1,), axis='ep')
    >>> ShardSpec()
    ShardSpec(replicated)
    """

    dim: int | None = None
    blocks: tuple[int, ...] = (1,)
    axis: str = "tp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if self.dim is not None and not (is_int(self.dim) and self.dim >= 0):
            raise PlanError(
                f"ShardSpec.dim must be None or a non-negative int, got {self.dim!r}; "
                "normalise a negative dim with the tensor's ndim first"
            )
        if not self.blocks or not all(is_int(b) and b > 0 for b in self.blocks):
            raise PlanError(f"ShardSpec.blocks must be positive ints, got {self.blocks!r}")
        if self.dim is None and self.blocks != (1,):
            raise PlanError(f"ShardSpec.blocks={self.blocks} needs a shard dim; pass dim= or drop blocks")
        if self.axis not in SHARD_AXES:
            raise PlanError(f"ShardSpec.axis must be one of {SHARD_AXES}, got {self.axis!r}")
        if self.dim is None and self.axis != "tp":  # one replicated spec, whatever the axis
            object.__setattr__(self, "axis", "tp")

    def __repr__(self) -> str:
        if self.replicated:
            return "ShardSpec(replicated)"
        axis = f", axis={self.axis!r}" if self.axis != "tp" else ""
        return f"ShardSpec(dim={self.dim}, blocks={self.blocks}{axis})"

    @property
    def replicated(self) -> bool:
        return self.dim is None

    @property
    def packed(self) -> bool:
        return len(self.blocks) > 1


def _check_dim(shape: Shape, dim: int, what: str) -> None:
    if not (is_int(dim) and 0 <= dim < len(shape)):
        raise PlanError(f"{what} dim {dim} is out of range for a tensor of shape {tuple(shape)}")


def check_degree(degree: int, rank: int | None = None, names=("degree", "rank")) -> None:
    """``PlanError`` unless ``degree`` is a positive int and ``rank`` (if given) in range."""
    if not (is_int(degree) and degree >= 1):
        raise PlanError(f"{names[0]} must be a positive int, got {degree!r}")
    if rank is not None and not (is_int(rank) and 0 <= rank < degree):
        raise PlanError(f"{names[1]} must be an int in [0, {degree}), got {rank!r}")


def block_sizes(shape: Shape, spec: ShardSpec) -> tuple[int, ...]:
    """Sizes of the packed blocks along ``spec.dim``: ``(36, 2)`` by blocks ``(1, 1, 1, 3, 3)``
    gives ``(4, 4, 4, 12, 12)``. ``PlanError`` for a replicated spec or a bad dim,
    ``ShardingError`` when the size is not a multiple of ``sum(spec.blocks)``."""
    if spec.dim is None:  # replicated
        raise PlanError("a replicated ShardSpec has no blocks")
    _check_dim(shape, spec.dim, "shard")
    size, total = shape[spec.dim], sum(spec.blocks)
    if size % total:
        raise ShardingError(
            f"dim {spec.dim} of size {size} cannot hold packed blocks with ratios {spec.blocks}: "
            f"{size} is not divisible by their sum {total}; check the block ratios against the shape"
        )
    unit = size // total
    return tuple(b * unit for b in spec.blocks)


def check_shardable(shape: Shape, spec: ShardSpec, degree: int) -> None:
    """``ShardingError`` unless every block along ``spec.dim`` splits into ``degree`` parts
    (replicated: always; a dim out of range: ``PlanError``)."""
    _check_shardable(tuple(shape), spec, degree)


# A model repeats a few (shape, spec) pairs over its layers, and a load asks each tensor's several
# times (the plan's degree check, each read's layout, the install check): each is checked once.
# A failure is not cached (it raises every time); typed: degree True is not degree 1.
@functools.lru_cache(maxsize=4096, typed=True)
def _check_shardable(shape: tuple[int, ...], spec: ShardSpec, degree: int) -> None:
    check_degree(degree)
    if spec.dim is None:  # replicated
        return
    sizes = block_sizes(shape, spec)
    bad = [(i, s) for i, s in enumerate(sizes) if s % degree]
    if not bad:
        return
    what = f"dim {spec.dim} of size {shape[spec.dim]}"
    if spec.packed:
        names = ", ".join(f"block {i} (size {s})" for i, s in bad)
        what += f" has packed blocks of sizes {sizes} (ratios {spec.blocks}); {names}"
    # Listing small divisors turns "not divisible" into a choice the user can make.
    g = math.gcd(*sizes)
    ok = ", ".join(str(k) for k in range(1, min(g, 64) + 1) if g % k == 0)
    raise ShardingError(f"{what} cannot be split over degree {degree}: not divisible by {degree}; "
                        f"choose a degree that divides {g} (for example {ok})")


def dividing_degrees(tensors: Sequence[tuple[Shape, ShardSpec]], *, limit: int = 64) -> list[int]:
    """Every degree up to ``limit`` that splits all ``(shape, spec)`` pairs."""
    sizes = [s for shape, spec in tensors if not spec.replicated for s in block_sizes(shape, spec)]
    return [d for d in range(1, limit + 1) if all(s % d == 0 for s in sizes)]


def local_shape(shape: Shape, spec: ShardSpec, degree: int) -> tuple[int, ...]:
    """Shape of each rank's local shard: ``local_shape((8, 4), ShardSpec(dim=1), 2) == (8, 2)``."""
    check_shardable(shape, spec, degree)
    out = tuple(int(s) for s in shape)
    if spec.dim is None:  # replicated
        return out
    return out[: spec.dim] + (out[spec.dim] // degree,) + out[spec.dim + 1 :]


def global_shape(local: Shape, spec: ShardSpec, degree: int) -> tuple[int, ...]:
    """The canonical shape whose shards have shape ``local`` (inverse of :func:`local_shape`)."""
    out = tuple(int(s) for s in local)
    if spec.dim is None:  # replicated
        return out
    check_degree(degree)
    _check_dim(out, spec.dim, "local shape")
    out = out[: spec.dim] + (out[spec.dim] * degree,) + out[spec.dim + 1 :]
    check_shardable(out, spec, degree)
    return out


def shard_regions(shape: Shape, spec: ShardSpec, degree: int, rank: int) -> list[Region]:
    """This rank's regions, in local order: the ``rank``-th of ``degree`` parts of each block,
    touching regions merged.

    >>> shard_regions((8, 4), ShardSpec(dim=0, blocks=(1, 1)), 2, 0)
    [Region(offsets=(0, 0), sizes=(2, 4)), Region(offsets=(4, 0), sizes=(2, 4))]
    """
    return [region for region, _ in local_layout(shape, spec, degree, rank)]


def local_layout(shape: Shape, spec: ShardSpec, degree: int, rank: int) -> Layout:
    """Each of the rank's regions (:func:`shard_regions`) with its offset inside the local shard.

    >>> local_layout((8, 4), ShardSpec(dim=0, blocks=(1, 1)), 2, 1)[1]
    (Region(offsets=(6, 0), sizes=(2, 4)), (2, 0))
    """
    return list(_local_layout(tuple(shape), spec, degree, rank))


@functools.lru_cache(maxsize=4096, typed=True)  # as _check_shardable: the same few per model
def _local_layout(shape: tuple[int, ...], spec: ShardSpec, degree: int, rank: int) -> tuple:
    check_degree(degree, rank)
    check_shardable(shape, spec, degree)
    shape = tuple(int(s) for s in shape)
    zeros = (0,) * len(shape)
    if spec.dim is None:  # replicated
        return ((Region(zeros, shape), zeros),)
    d = spec.dim
    spans: list[list[int]] = []  # [start, size] along d
    start = 0
    for size in block_sizes(shape, spec):
        part = size // degree
        lo = start + rank * part
        if spans and spans[-1][0] + spans[-1][1] == lo:
            spans[-1][1] += part
        else:
            spans.append([lo, part])
        start += size
    layout, pos = [], 0
    for lo, n in spans:
        region = Region(zeros[:d] + (lo,) + zeros[d + 1 :], shape[:d] + (n,) + shape[d + 1 :])
        layout.append((region, zeros[:d] + (pos,) + zeros[d + 1 :]))
        pos += n
    return tuple(layout)


def split(tensor: torch.Tensor, spec: ShardSpec, degree: int, rank: int) -> torch.Tensor:
    """The rank's local shard of ``tensor``: always a new tensor (the canonical one may be freed).

    >>> split(torch.arange(8).reshape(8, 1), ShardSpec(dim=0, blocks=(1, 1)), 2, 1).flatten()
    tensor([2, 3, 6, 7])
    """
    regions = shard_regions(tuple(tensor.shape), spec, degree, rank)
    if spec.dim is None:  # replicated
        return tensor.clone(memory_format=torch.contiguous_format)
    # cat copies even a single piece, so the result never aliases `tensor`.
    return torch.cat([tensor[r.slices()] for r in regions], dim=spec.dim)


def assemble(shards: Sequence[torch.Tensor], spec: ShardSpec, degree: int) -> torch.Tensor:
    """The canonical tensor from every rank's local shard (the inverse of :func:`split`)."""
    check_degree(degree)
    if len(shards) != degree:
        raise PlanError(f"assemble needs one shard per rank ({degree}), got {len(shards)}")
    first = shards[0]
    if spec.dim is None:  # replicated
        return first.clone(memory_format=torch.contiguous_format)
    _check_dim(first.shape, spec.dim, "shard")
    shape = list(first.shape)
    shape[spec.dim] *= degree
    expected = local_shape(shape, spec, degree)
    out = torch.empty(shape, dtype=first.dtype, device=first.device)
    for rank, shard in enumerate(shards):
        if tuple(shard.shape) != expected or shard.dtype != first.dtype:
            raise PlanError(
                f"shard of rank {rank} is {tuple(shard.shape)} {shard.dtype}, "
                f"expected {expected} {first.dtype} like rank 0"
            )
        for region, off in local_layout(shape, spec, degree, rank):
            local = Region(off, region.sizes)
            out[region.slices()] = shard[local.slices()]
    return out


def chunk_layout(layout: Layout, shape_local: Shape, dim: int, num_chunks: int, index: int) -> Layout:
    """The layout of chunk ``index`` of the local tensor, chunked as ``torch.chunk`` does along
    local ``dim`` (any dim); a layout again, so chunking composes (FSDP over TP).

    >>> layout = local_layout((8, 4), ShardSpec(dim=0, blocks=(1, 1)), 2, 0)
    >>> chunk_layout(layout, (4, 4), 0, 2, 1)
    [(Region(offsets=(4, 0), sizes=(2, 4)), (0, 0))]
    """
    _check_dim(shape_local, dim, "chunk")
    check_degree(num_chunks, index, names=("num_chunks", "index"))
    lo, hi = _chunk_span(shape_local[dim], num_chunks, index)
    out: Layout = []
    for region, off in layout:
        start = max(lo, off[dim])
        stop = min(hi, off[dim] + region.sizes[dim])
        if stop <= start or region.numel == 0:
            continue
        offsets = list(region.offsets)
        offsets[dim] += start - off[dim]
        sizes = list(region.sizes)
        sizes[dim] = stop - start
        chunk_off = list(off)
        chunk_off[dim] = start - lo
        out.append((Region(tuple(offsets), tuple(sizes)), tuple(chunk_off)))
    return out


def _chunk_span(n: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``index`` when ``torch.chunk`` cuts ``n`` into ``num_chunks``."""
    step = -(-n // num_chunks)
    lo = min(index * step, n)
    return lo, min(lo + step, n)


def chunked_layout(shape: Shape, spec: ShardSpec, degree: int, rank: int,
                   chunks: Sequence[tuple[int, int, int]] = ()) -> tuple[tuple[int, ...], Layout]:
    """The local shape and layout of rank ``rank``'s shard (:func:`local_layout`), then of its
    ``torch.chunk`` part along each ``(dim, num_chunks, index)`` of ``chunks`` in turn (FSDP2's
    shards over tp)."""
    layout = local_layout(shape, spec, degree, rank)
    have = local_shape(shape, spec, degree)
    for dim, num, index in chunks:
        layout = chunk_layout(layout, have, dim, num, index)
        lo, hi = _chunk_span(have[dim], num, index)
        have = have[:dim] + (hi - lo,) + have[dim + 1:]
    return have, layout


def intersect(a: Region, b: Region) -> Region | None:
    """The overlap of two boxes, or ``None`` when they share no element."""
    if len(a.offsets) != len(b.offsets):
        raise PlanError(f"cannot intersect regions of different ndim: {a} and {b}")
    starts = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True))
    stops = tuple(
        min(x + n, y + m) for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )
    if any(stop <= start for start, stop in zip(starts, stops, strict=True)):
        return None
    return Region(starts, tuple(stop - start for start, stop in zip(starts, stops, strict=True)))


def overlapping(regions: Sequence[Region]) -> tuple[int, int] | None:
    """Indices (in sweep order) of two non-empty ``regions`` that overlap, or ``None``: a sweep
    along the dim whose starts differ most, each region meeting only its open neighbours."""
    live = [i for i, r in enumerate(regions) if r.numel]
    if len(live) < 2:
        return None
    ndim = len(regions[live[0]].offsets)
    if ndim == 0:  # two chunks of one scalar
        return live[0], live[1]
    dim = max(range(ndim), key=lambda d: len({regions[i].offsets[d] for i in live}))
    open_: list[int] = []
    for i in sorted(live, key=lambda i: regions[i].offsets[dim]):
        start = regions[i].offsets[dim]
        open_ = [j for j in open_ if regions[j].offsets[dim] + regions[j].sizes[dim] > start]
        for j in open_:
            if intersect(regions[j], regions[i]) is not None:
                return j, i
        open_.append(i)
    return None
