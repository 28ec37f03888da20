"""Transfer plans from plain descriptions: shapes, shard specs and mesh degrees, no tensors.

A layout is a mesh as degrees, outer to inner as ``backend.mesh`` orders its axes
(``dp_replicate``, ``dp_shard``, ``ep``, ``tp``) on the global ranks ``first_rank ..``: each
tensor is split by its ``ShardSpec`` over the ``tp`` or ``ep`` axis, then, under FSDP2
(``dp_shard``), each rank holds a ``torch.chunk`` of dim 0 of that part (``_StridedShard``),
and ``dp_replicate`` ranks hold copies. The live plan reads the same layouts off the
models' tensors; this one lets a user see what a 671B sync would move without allocating it.

>>> from shardwise.core.spec import ShardSpec
>>> plan = offline_plan({"w": ((8, 4), ShardSpec(dim=0))}, MeshLayout(tp=2), MeshLayout(tp=1, first_rank=0))
>>> plan.remote_bytes, plan.local_bytes
(32, 32)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from shardwise.core.spec import Layout, ShardSpec, chunked_layout
from shardwise.errors import MeshError
from shardwise.transfer.plan import DEFAULT_BUCKET_BYTES, Holding, Plan, holding_of, make_plan

AXES = ("dp_replicate", "dp_shard", "ep", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """A mesh by its degrees on the global ranks ``first_rank .. first_rank + size - 1``."""

    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    tp: int = 1
    first_rank: int = 0
    axes: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self):
        sizes = tuple(getattr(self, a) for a in AXES)
        if not all(isinstance(s, int) and s >= 1 for s in sizes) or self.first_rank < 0:
            raise MeshError(f"mesh degrees must be positive ints and first_rank >= 0, got {self}")
        object.__setattr__(self, "axes", sizes)

    @property
    def size(self) -> int:
        return math.prod(self.axes)

    def coords(self) -> list[tuple[int, dict[str, int]]]:
        """``(global rank, {axis: coordinate})`` for every rank, in rank order."""
        return [(self.first_rank + i, dict(zip(AXES, c, strict=True)))
                for i, c in enumerate(itertools.product(*(range(s) for s in self.axes)))]


def parts_of(shape: tuple[int, ...], spec: ShardSpec,
             mesh: MeshLayout) -> dict[int, tuple[tuple[int, ...], Layout]]:
    """``{global rank: (local shape, layout)}`` of a tensor under ``mesh``."""
    out = {}
    for rank, c in mesh.coords():
        degree, index = (mesh.ep, c["ep"]) if spec.axis == "ep" else (mesh.tp, c["tp"])
        fsdp = [(0, mesh.dp_shard, c["dp_shard"])] if mesh.dp_shard > 1 else []
        out[rank] = chunked_layout(shape, spec, degree, index, fsdp)
    return out


def holdings(tensors: Mapping[str, tuple[tuple[int, ...], ShardSpec]], mesh: MeshLayout,
             dtype: str) -> dict[str, Holding]:
    """Every tensor of ``{name: (canonical shape, spec)}`` held under ``mesh`` in ``dtype``."""
    return {name: holding_of(shape, dtype, parts_of(tuple(shape), spec, mesh))
            for name, (shape, spec) in tensors.items()}


def offline_plan(tensors: Mapping[str, tuple[tuple[int, ...], ShardSpec]], src: MeshLayout,
                 dst: MeshLayout, *, src_dtype: str = "F32", dst_dtype: str = "BF16",
                 dst_specs: Mapping[str, ShardSpec] | None = None, ranks_per_node: int = 8,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Plan:
    """The plan of moving ``tensors`` from layout ``src`` to layout ``dst`` (``dst_specs``:
    the destination's specs where they differ from the source's), on nodes of
    ``ranks_per_node`` consecutive global ranks."""
    world = max(src.first_rank + src.size, dst.first_rank + dst.size)
    dst_tensors = {n: (shape, (dst_specs or {}).get(n, spec)) for n, (shape, spec) in tensors.items()}
    return make_plan(holdings(tensors, src, src_dtype), holdings(dst_tensors, dst, dst_dtype),
                     world_size=world, nodes=[r // ranks_per_node for r in range(world)],
                     bucket_bytes=bucket_bytes)


__all__ = ["MeshLayout", "holdings", "offline_plan", "parts_of"]
