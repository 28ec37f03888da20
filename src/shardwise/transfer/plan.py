"""The transfer plan, pure: which box of which source shard goes to which destination shard.

Input is, per tensor, its canonical shape, dtype and, for every rank that holds a part of
it, the layout of that part (``shardwise.core.spec``: each region of the canonical tensor
with its offset in the local shard), for the source and for the destination model. The
plan intersects every destination region with the source regions, picks one source rank per
overlap (the destination rank itself when it holds the bytes: a local copy; else the
least-loaded holder, so replicas share the sending) and packs the remote moves into buckets
in which no rank sends plus receives more than ``bucket_bytes``. Everything is plain ints:
a plan for a layout pair too big for this machine is computed offline from degrees
(``shardwise.transfer.offline``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardwise.core.header import str_to_dtype
from shardwise.core.pieces import Piece, check_tiling
from shardwise.core.spec import Layout, Region, intersect
from shardwise.errors import PlanError

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class Held:
    """One rank's part of one tensor: its local ``shape`` and ``layout`` (regions with their
    offsets in the local shard)."""

    rank: int
    shape: tuple[int, ...]
    layout: tuple[tuple[Region, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Holding:
    """A tensor of canonical ``shape`` and ``dtype`` (a safetensors dtype name: ``"F32"``) and
    the parts ranks hold of it."""

    shape: tuple[int, ...]
    dtype: str
    parts: tuple[Held, ...]

    @property
    def itemsize(self) -> int:
        return str_to_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Move:
    """A box of ``sizes`` from source tensor ``src`` on ``src_rank`` (at ``src_offsets`` in
    its local shard) to destination tensor ``dst`` on ``dst_rank`` (at ``dst_offsets``);
    ``nbytes`` in the destination's dtype (the cast happens before sending)."""

    dst: str
    dst_rank: int
    dst_offsets: tuple[int, ...]
    src: str
    src_rank: int
    src_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True, repr=False)
class Plan:
    """What one run moves: ``local`` copies and remote ``buckets``, for a world of
    ``world_size`` ranks whose nodes are ``nodes`` (node index per rank)."""

    local: tuple[Move, ...]
    buckets: tuple[tuple[Move, ...], ...]
    world_size: int
    nodes: tuple[int, ...]
    bucket_bytes: int
    dst_bytes: int  # every destination shard's bytes, local or not
    dtypes: Mapping[str, str]  # destination tensor -> its dtype (what the source is cast to)

    def __repr__(self) -> str:
        return (f"Plan(buckets={len(self.buckets)}, remote_bytes={self.remote_bytes}, "
                f"local_bytes={self.local_bytes})")

    @property
    def remote_bytes(self) -> int:
        return sum(m.nbytes for b in self.buckets for m in b)

    @property
    def local_bytes(self) -> int:
        return sum(m.nbytes for m in self.local)

    def link(self, src_rank: int, dst_rank: int) -> str:
        """``"local"`` (a copy), ``"intra-node"`` or ``"inter-node"``."""
        if src_rank == dst_rank:
            return "local"
        return "intra-node" if self.nodes[src_rank] == self.nodes[dst_rank] else "inter-node"

    def pairs(self) -> dict[tuple[int, int], int]:
        """Bytes per ``(source rank, destination rank)``, local copies included."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for m in (*self.local, *(m for b in self.buckets for m in b)):
            out[(m.src_rank, m.dst_rank)] += m.nbytes
        return dict(out)

    def sent_by(self, rank: int) -> int:
        """Bytes ``rank`` sends per run."""
        return sum(m.nbytes for b in self.buckets for m in b if m.src_rank == rank)

    def received_by(self, rank: int) -> int:
        """Bytes ``rank`` receives per run (not its local copies)."""
        return sum(m.nbytes for b in self.buckets for m in b if m.dst_rank == rank)

    def __str__(self) -> str:
        return describe(self)


def _shift(box: Region, by: Sequence[int]) -> Region:
    return Region(tuple(o + d for o, d in zip(box.offsets, by, strict=True)), box.sizes)


def _rel(box: Region, region: Region, off: Sequence[int]) -> tuple[int, ...]:
    """Where ``box`` (inside ``region``) sits in a local shard that holds ``region`` at ``off``."""
    return tuple(o + b - r for o, b, r in zip(off, box.offsets, region.offsets, strict=True))


class _Sources:
    """The distinct regions of one source tensor, each with every rank holding it."""

    def __init__(self, name: str, holding: Holding):
        by_region: dict[Region, list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
        for part in holding.parts:
            for region, off in part.layout:
                if region.numel:
                    by_region[region].append((part.rank, off))
        self.name, self.holding = name, holding
        self.regions = list(by_region.items())


def _whole(name: str, shape: tuple[int, ...]) -> tuple[Piece, ...]:
    zeros = (0,) * len(shape)
    return (Piece(name, Region(zeros, shape), zeros),)


def plan_moves(src: Mapping[str, Holding], dst: Mapping[str, Holding],
               pieces: Mapping[str, Sequence[Piece]] | None = None) -> list[Move]:
    """Every move that fills every destination part, in destination order.

    ``pieces`` maps a destination tensor to the boxes of source tensors it is made of
    (``Piece(key=source name, source=box of it, offsets=where it starts in the destination)``:
    a fused qkv split into q, k and v); a destination tensor not in it is the source tensor
    of its own name. Raises ``PlanError`` naming the tensor when a source is missing, the
    pieces do not tile the destination, or no source rank holds some of its bytes.
    """
    pieces = pieces or {}
    index: dict[str, _Sources] = {}
    load: dict[int, int] = defaultdict(int)
    moves: list[Move] = []
    for name, want in dst.items():
        parts = tuple(pieces.get(name) or _whole(name, want.shape))
        check_tiling(want.shape, parts, f"destination tensor {name!r}")
        for piece in parts:
            if piece.stacked:
                raise PlanError(f"destination tensor {name!r}: a piece with stacked dims {piece.stacked} "
                                "is not a box move; give one piece per source box")
            if piece.key not in src:
                raise PlanError(f"destination tensor {name!r} needs source tensor {piece.key!r}, which "
                                "the source model does not have; map it with names={dst: src}")
            if piece.key not in index:
                index[piece.key] = _Sources(piece.key, src[piece.key])
            whole = Region((0,) * len(src[piece.key].shape), src[piece.key].shape)
            if intersect(whole, piece.source) != piece.source:
                raise PlanError(f"destination tensor {name!r}: {piece.source} lies outside source "
                                f"{piece.key!r} of shape {whole.sizes}")
        for part in want.parts:
            for region, off in part.layout:
                for piece in parts:
                    moves += _fill(name, want, part.rank, region, off, piece, index[piece.key], load)
    return moves


def _fill(name: str, want: Holding, rank: int, region: Region, off: tuple[int, ...], piece: Piece,
          sources: _Sources, load: dict[int, int]) -> list[Move]:
    box = intersect(region, piece.box())
    if box is None:
        return []
    delta = [s - o for s, o in zip(piece.source.offsets, piece.offsets, strict=True)]
    wanted = _shift(box, delta)  # the box in the source tensor's coordinates
    out, covered = [], 0
    for sregion, holders in sources.regions:
        got = intersect(wanted, sregion)
        if got is None:
            continue
        covered += got.numel
        here = [h for h in holders if h[0] == rank]
        src_rank, src_off = here[0] if here else min(holders, key=lambda h: (load[h[0]], h[0]))
        nbytes = got.numel * want.itemsize
        if src_rank != rank:
            load[src_rank] += nbytes
        dst_box = _shift(got, [-d for d in delta])
        out.append(Move(name, rank, _rel(dst_box, region, off), sources.name, src_rank,
                        _rel(got, sregion, src_off), got.sizes, nbytes))
    if covered != wanted.numel:
        what = "no source rank holds" if covered < wanted.numel else "source ranks hold overlapping parts of"
        raise PlanError(f"destination tensor {name!r} on rank {rank}: {what} {wanted} of source "
                        f"{sources.name!r}; every byte must be held once by some source rank layout")
    return out


def _bump(offsets: tuple[int, ...], dim: int, by: int) -> tuple[int, ...]:
    return offsets[:dim] + (offsets[dim] + by,) + offsets[dim + 1:]


def split_move(move: Move, max_bytes: int) -> list[Move]:
    """``move`` cut along its first dims into moves of at most ``max_bytes`` each (one
    element at least: a single element bigger than ``max_bytes`` stays whole)."""
    if move.nbytes <= max_bytes:
        return [move]
    itemsize = move.nbytes // max(1, math.prod(move.sizes))
    dims = [d for d, n in enumerate(move.sizes) if n > 1]
    if not dims:
        return [move]
    d, n = dims[0], move.sizes[dims[0]]
    per = math.prod(move.sizes[d + 1:]) * itemsize  # bytes of one index along d
    step = max(1, max_bytes // per)
    out = []
    for lo in range(0, n, step):
        sizes = move.sizes[:d] + (min(step, n - lo),) + move.sizes[d + 1:]
        part = Move(move.dst, move.dst_rank, _bump(move.dst_offsets, d, lo), move.src, move.src_rank,
                    _bump(move.src_offsets, d, lo), sizes, math.prod(sizes) * itemsize)
        out += split_move(part, max_bytes)  # one index along d may still be too big: next dim
    return out


def pack_buckets(moves: Sequence[Move], bucket_bytes: int) -> list[list[Move]]:
    """Remote ``moves`` into buckets where each rank sends plus receives at most
    ``bucket_bytes`` (a bigger move is split first). Each move goes to the first bucket at
    or after its two ranks' current ones with room for it: O(1) per move, so a plan of
    hundreds of thousands of moves packs in seconds."""
    if bucket_bytes < 1:
        raise PlanError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    fill: dict[tuple[int, int], int] = defaultdict(int)  # (rank, bucket) -> bytes
    cur: dict[int, int] = defaultdict(int)
    buckets: list[list[Move]] = []
    for whole in moves:
        for m in split_move(whole, bucket_bytes):
            b = max(cur[m.src_rank], cur[m.dst_rank])
            while (fill[(m.src_rank, b)] + m.nbytes > bucket_bytes
                   or fill[(m.dst_rank, b)] + m.nbytes > bucket_bytes):
                b += 1
            fill[(m.src_rank, b)] += m.nbytes
            fill[(m.dst_rank, b)] += m.nbytes
            while len(buckets) <= b:
                buckets.append([])
            buckets[b].append(m)
            cur[m.src_rank], cur[m.dst_rank] = b, b
    return [b for b in buckets if b]


def make_plan(src: Mapping[str, Holding], dst: Mapping[str, Holding], *, world_size: int,
              nodes: Sequence[int] | None = None, pieces: Mapping[str, Sequence[Piece]] | None = None,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Plan:
    """The :class:`Plan` of moving ``src`` into ``dst`` (see :func:`plan_moves`)."""
    moves = plan_moves(src, dst, pieces)
    nodes = tuple(nodes) if nodes is not None else (0,) * world_size
    if len(nodes) != world_size:
        raise PlanError(f"nodes names {len(nodes)} ranks, the world has {world_size}")
    # local copies are cut like sends: a cast copy of a strided box may stage it whole
    local = tuple(part for m in moves if m.local for part in split_move(m, bucket_bytes))
    buckets = pack_buckets([m for m in moves if not m.local], bucket_bytes)
    dst_bytes = sum(math.prod(p.shape) * h.itemsize for h in dst.values() for p in h.parts)
    dtypes = {name: h.dtype for name, h in dst.items()}
    return Plan(local, tuple(tuple(b) for b in buckets), world_size, nodes, bucket_bytes, dst_bytes, dtypes)


def holding_of(shape: Sequence[int], dtype: str,
               parts: Mapping[int, tuple[Sequence[int], Layout]]) -> Holding:
    """A :class:`Holding` from ``{rank: (local shape, layout)}``."""
    held = tuple(Held(r, tuple(s), tuple((reg, tuple(o)) for reg, o in lay))
                 for r, (s, lay) in sorted(parts.items()))
    return Holding(tuple(shape), dtype, held)


# -- the plan as text: totals per link kind, the busiest rank pairs, the buckets ------------
def human(nbytes: float) -> str:
    """``nbytes`` in B / KiB / MiB / GiB / TiB, three significant digits.

    >>> human(3 << 30)
    '3.00 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} TiB"


def by_link(plan: Plan) -> dict[str, int]:
    """Bytes per run per link kind: ``local`` copies, ``intra-node`` and ``inter-node`` sends."""
    out = {"local": 0, "intra-node": 0, "inter-node": 0}
    for (s, d), n in plan.pairs().items():
        out[plan.link(s, d)] += n
    return out


def rank_loads(plan: Plan) -> tuple[dict[int, int], dict[int, int]]:
    """``(bytes sent, bytes received)`` per rank per run (local copies not counted)."""
    sent: dict[int, int] = defaultdict(int)
    got: dict[int, int] = defaultdict(int)
    for bucket in plan.buckets:
        for m in bucket:
            sent[m.src_rank] += m.nbytes
            got[m.dst_rank] += m.nbytes
    return dict(sent), dict(got)


def describe(plan: Plan, *, top: int = 8) -> str:
    """The plan in a few lines: what a run moves over which links, the busiest pairs of ranks,
    each rank's load and the buckets."""
    links = by_link(plan)
    lines = [f"transfer plan: {plan.world_size} ranks, {human(plan.dst_bytes)} of destination shards",
             f"  moved per run: {human(plan.remote_bytes)} sent, {human(plan.local_bytes)} copied "
             "locally"]
    lines += [f"  {kind:>10}: {human(n)}" for kind, n in links.items()]
    sent, got = rank_loads(plan)
    if sent:
        lines.append(f"  per rank: sends up to {human(max(sent.values()))} (rank "
                     f"{max(sent, key=lambda r: sent[r])}), receives up to {human(max(got.values()))} "
                     f"(rank {max(got, key=lambda r: got[r])})")
    pairs = sorted(((n, p) for p, n in plan.pairs().items() if p[0] != p[1]), reverse=True)
    if pairs:
        lines.append(f"  {len(pairs)} pairs of ranks exchange bytes; the busiest:")
        lines += [f"    {s:>5} -> {d:<5} {human(n):>12}  {plan.link(s, d)}" for n, (s, d) in pairs[:top]]
    sizes = [sum(m.nbytes for m in b) for b in plan.buckets]
    lines.append(f"  {len(plan.buckets)} buckets of at most {human(plan.bucket_bytes)} per rank "
                 "(sent + received)" + (f"; all ranks together {human(min(sizes))} .. "
                                        f"{human(max(sizes))} per bucket" if sizes else ""))
    for i, (b, n) in enumerate(zip(plan.buckets, sizes, strict=True)):
        if i >= top:
            lines.append(f"    ... {len(plan.buckets) - top} more")
            break
        lines.append(f"    bucket {i}: {len(b)} moves, {human(n)}")
    return "\n".join(lines)


__all__ = ["DEFAULT_BUCKET_BYTES", "Held", "Holding", "Move", "Plan", "by_link", "describe", "holding_of",
           "human", "make_plan", "pack_buckets", "plan_moves", "rank_loads", "split_move"]
