"""What shardwise reads of a mesh (:class:`AxisMesh`), and :class:`GroupMesh`, named axes over
process-group ranks where torch's DeviceMesh cannot be built (torch_xla registers no device
handle), so those backends hold local shards."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from shardwise.errors import MeshError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

NewGroup = Callable[[list[int]], object]


class AxisMesh(Protocol):
    """What shardwise reads of a mesh: torch's ``DeviceMesh``, :class:`GroupMesh` (xla,
    neuron_xla) and ``xla_spmd``'s ``SpmdMesh`` answer it. Reading it is never a collective."""

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None: ...  # outer to inner; None: unnamed

    @property
    def ndim(self) -> int: ...

    @property
    def device_type(self) -> str: ...  # "cpu", "cuda", "xla", ...

    @property
    def mesh(self) -> torch.Tensor: ...  # the global ranks (SPMD: device ids) in the mesh's shape

    def size(self, dim: int | None = None, /) -> int: ...

    # this rank's position along ``dim`` (an SPMD mesh raises: one process drives every position)
    def get_local_rank(self, dim: int | str | None = None, /) -> int: ...

    # the process group of this rank's line along ``dim`` (None: an SPMD mesh)
    def get_group(self, dim: int | str | None = None, /) -> ProcessGroup | None: ...

    def __getitem__(self, name: str, /) -> AxisMesh: ...  # the 1-D mesh along axis ``name``


class GroupMesh:
    """Ranks ``0 .. prod(shape) - 1`` laid out row-major in ``shape``, one process group per axis
    line. Collective: every rank of the world constructs it with the same names and shape (each
    ``new_group`` is joined by every rank, in order); a line spanning the world reuses the
    default group.

    >>> mesh = GroupMesh("xla", ("dp_shard", "tp"), (2, 2), rank=3,
    ...                  new_group=dist.new_group)                     # doctest: +SKIP
    >>> mesh["tp"].get_local_rank(), mesh["tp"].mesh.tolist()        # doctest: +SKIP
    (1, [2, 3])"""

    def __init__(self, device_type: str, names: Sequence[str], shape: Sequence[int], *, rank: int,
                 new_group: NewGroup):
        names, shape = tuple(names), tuple(int(s) for s in shape)
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise MeshError(f"mesh axis names {names} must be distinct, one per dim of shape {shape}")
        ranks = torch.arange(math.prod(shape)).view(shape)
        if not 0 <= rank < ranks.numel():
            raise MeshError(f"rank {rank} is outside a mesh of {ranks.numel()} ranks {shape}")
        coordinate = tuple(int(c) for c in torch.nonzero(ranks == rank)[0])
        groups = tuple(_axis_group(ranks, dim, rank, new_group) for dim in range(len(shape)))
        self._init(device_type, names, ranks, coordinate, groups)

    def _init(self, device_type, names, ranks, coordinate, groups) -> None:
        self.device_type = device_type
        self.mesh_dim_names = names
        self.mesh = ranks
        self._coordinate = coordinate
        self._groups = groups

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    def _dim(self, dim: int | str | None) -> int:
        if dim is None:
            if self.ndim != 1:
                raise MeshError(f"mesh with axes {self.mesh_dim_names} has {self.ndim} dims; name one")
            return 0
        if isinstance(dim, str):
            if dim not in self.mesh_dim_names:
                raise MeshError(f"mesh has no axis {dim!r}; its axes are {self.mesh_dim_names}")
            return self.mesh_dim_names.index(dim)
        return dim

    def size(self, dim: int | str | None = None) -> int:
        return self.mesh.numel() if dim is None else self.mesh.shape[self._dim(dim)]

    def get_local_rank(self, dim: int | str | None = None) -> int:
        return self._coordinate[self._dim(dim)]

    def get_group(self, dim: int | str | None = None):
        return self._groups[self._dim(dim)]

    def get_coordinate(self) -> list[int]:
        return list(self._coordinate)

    def __getitem__(self, name: str) -> GroupMesh:
        dim = self._dim(name)
        index = list(self._coordinate)
        index[dim] = slice(None)
        sub = object.__new__(GroupMesh)
        sub._init(self.device_type, (name,), self.mesh[tuple(index)], (self._coordinate[dim],),
                  (self._groups[dim],))
        return sub

    def __repr__(self) -> str:
        return f"GroupMesh({self.device_type!r}, {self.mesh.tolist()}, mesh_dim_names={self.mesh_dim_names})"


def _axis_group(ranks: torch.Tensor, dim: int, rank: int, new_group: NewGroup):
    if ranks.shape[dim] == ranks.numel():
        return dist.group.WORLD
    mine = None
    for line in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
        group = new_group(line)
        if rank in line:
            mine = group
    return mine


__all__ = ["AxisMesh", "GroupMesh"]
