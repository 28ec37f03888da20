"""The mesh, decoded once at the API boundary: :func:`decode_mesh` gives the frozen
:class:`MeshDims` everything below uses; an entry without a mesh resolves its backend once
with :func:`world_backend`. These two are the only readers of ``current_backend()``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol

import torch

import shardwise.comm as comm
from shardwise.backends import current_backend
from shardwise.core.spec import ShardSpec
from shardwise.errors import PlanError
from shardwise.holding import Holding

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup

    from shardwise.backends.base import Backend
    from shardwise.core.plan import ResolvedPlan


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


@dataclass(frozen=True, kw_only=True)
class MeshDims:
    """A mesh as shardwise uses it, every axis decoded (``None`` / degree 1 / rank 0 where the
    mesh has none; ranks are 0 under SPMD holding), how shards are held, and this process's
    device and backends. Built by :func:`decode_mesh`.

    >>> MeshDims(mesh=None, degree=2, tp_rank=1, holding="local", dp_replicate=2)
    MeshDims(degree=2, tp_rank=1, holding=local, ep_degree=1, ep_rank=0, dp=(2, 1), device=cpu)
    """

    mesh: AxisMesh | None = field(repr=False)   # the mesh passed in (may be 2-D)
    tp_mesh: AxisMesh | None = field(repr=False, default=None)
    degree: int = 1                    # of the tp axis
    tp_rank: int = 0
    holding: Holding = Holding.DTENSOR
    group: ProcessGroup | None = field(repr=False, default=None)  # process group of the tp axis
    ep_mesh: AxisMesh | None = field(repr=False, default=None)  # the ep axis (expert parallel)
    ep_degree: int = 1
    ep_rank: int = 0
    ep_group: ProcessGroup | None = field(repr=False, default=None)
    dp_replicate: int = 1              # replicas of the whole model
    dp_replicate_rank: int = 0
    dp_replicate_group: ProcessGroup | None = field(repr=False, default=None)
    dp_shard: int = 1                  # FSDP shards (fully_shard over the loaded model)
    dp_shard_rank: int = 0
    spans_world: bool = False          # the mesh holds every rank of the process group
    device: torch.device = torch.device("cpu")
    backend: Backend | None = field(repr=False, default=None)  # the Backend that made the mesh, if any
    # the backend of shardwise.comm's collectives (world_backend()); None without a process group
    comm_backend: Backend | None = field(repr=False, default=None)

    def __post_init__(self):
        # the public keyword takes strings; the value holds the strategy
        object.__setattr__(self, "holding", Holding.parse(self.holding))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(degree={self.degree}, tp_rank={self.tp_rank}, "
                f"holding={self.holding}, ep_degree={self.ep_degree}, ep_rank={self.ep_rank}, "
                f"dp=({self.dp_replicate}, {self.dp_shard}), device={self.device})")

    def coords(self, spec: ShardSpec) -> tuple[int, int]:
        """``(degree, rank)`` of this rank on the mesh axis ``spec`` shards over."""
        return (self.ep_degree, self.ep_rank) if spec.axis == "ep" else (self.degree, self.tp_rank)

    def axis_mesh(self, spec: ShardSpec) -> AxisMesh | None:
        """The sub-mesh of the axis ``spec`` shards over (``None``: the mesh has no such axis)."""
        return self.ep_mesh if spec.axis == "ep" else self.tp_mesh

    @property
    def axis_coords(self) -> dict[str, tuple[int, int]]:
        """:meth:`coords` per axis name: ``{"tp": (degree, rank), "ep": (degree, rank)}``."""
        return {"tp": (self.degree, self.tp_rank), "ep": (self.ep_degree, self.ep_rank)}

    @property
    def shares_reads(self) -> bool:
        """True when dp replicas split a load's reads: more than one, not under SPMD holding."""
        return self.dp_replicate > 1 and not self.holding.one_process


def decode_mesh(mesh: AxisMesh, holding: str | Holding | None = None) -> MeshDims:
    """``mesh`` (any ``AxisMesh``) decoded into :class:`MeshDims`; ``holding`` None is the active
    backend's (``"dtensor"`` without one). Raises ``UsageError`` for an unknown holding,
    ``PlanError`` for a mesh without a findable tp axis or of the wrong kind for the holding.
    No collective."""
    backend = current_backend()
    if holding is None:
        holding = backend.holding if backend is not None else Holding.DTENSOR
    holding = Holding.parse(holding)
    spmd = is_spmd_mesh(mesh)
    check_spmd(spmd, holding)
    tp_mesh = tp_axis(mesh, spmd=spmd)  # None: no tp axis, nothing tensor parallel (degree 1)
    names = getattr(mesh, "mesh_dim_names", None) or ()

    def on(name: str) -> tuple[AxisMesh | None, int, int, ProcessGroup | None]:  # (axis, degree, rank, group)
        axis = tp_mesh if name == "tp" else mesh[name] if name in names else None
        if axis is None:
            return None, 1, 0, None
        return axis, axis.size(), 0 if holding.one_process else axis.get_local_rank(), axis.get_group()

    _, degree, tp_rank, group = on("tp")
    ep_mesh, ep_degree, ep_rank, ep_group = on("ep")
    _, dp_replicate, dp_replicate_rank, dp_replicate_group = on("dp_replicate")
    _, dp_shard, dp_shard_rank, _ = on("dp_shard")
    device = torch.device(backend.device) if backend is not None else torch.device(mesh.device_type)
    spans_world = comm.is_distributed() and not spmd and int(mesh.size()) == comm.world_size()
    return MeshDims(mesh=mesh, tp_mesh=tp_mesh, degree=degree, tp_rank=tp_rank, holding=holding,
                    group=group, ep_mesh=ep_mesh, ep_degree=ep_degree, ep_rank=ep_rank,
                    ep_group=ep_group, dp_replicate=dp_replicate, dp_replicate_rank=dp_replicate_rank,
                    dp_replicate_group=dp_replicate_group, dp_shard=dp_shard, dp_shard_rank=dp_shard_rank,
                    spans_world=spans_world, device=device, backend=backend,
                    comm_backend=world_backend())


def world_backend() -> Backend | None:
    """The ``backend=`` of ``shardwise.comm``'s collectives: ``sw.init_backend``'s, else an
    ``AdoptedBackend`` over a process group shardwise did not start, None without one.

    >>> world_backend() is None   # one process, no process group
    True
    """
    if not comm.is_distributed():
        return None
    return current_backend() or comm.AdoptedBackend()


def is_spmd_mesh(mesh: AxisMesh) -> bool:
    """True for the mesh of ``sw.init_backend("xla_spmd")``: one process drives every device."""
    return bool(getattr(mesh, "spmd", False))


def tp_axis(mesh: AxisMesh, *, spmd: bool) -> AxisMesh | None:
    """``mesh["tp"]``, an unnamed 1-D mesh itself, or None when the named axes hold no "tp" (the
    model is then held whole, ready for ``fully_shard``)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" in names:
        return mesh["tp"] if len(names) > 1 else mesh
    if not names and mesh.ndim == 1:
        return mesh
    if not names:
        raise PlanError(f"a {mesh.ndim}-D mesh without axis names has no 'tp' axis; build it with "
                        "backend.mesh(tp=...)")
    if spmd:  # one global tensor per parameter needs an axis to place it on
        raise PlanError(f"the xla_spmd mesh with axes {names} has no 'tp' axis; add tp=1 to hold the "
                        "model whole: backend.mesh(..., tp=1)")
    return None


def check_spmd(spmd: bool, holding: Holding) -> None:
    """Raise ``PlanError`` unless ``holding`` is one-process exactly when the mesh is SPMD."""
    if spmd and not holding.one_process:
        raise PlanError(f"holding {holding.name!r} needs one process per device, but this mesh is an "
                        "SPMD mesh (one process drives every device); use holding='spmd' or leave it unset")
    if holding.one_process and not spmd:
        raise PlanError("holding 'spmd' needs the mesh of sw.init_backend('xla_spmd') (one process "
                        "driving every device); with one process per device use 'dtensor' or 'local'")


_STATE_ATTR = "_shardwise_state"


@dataclass(frozen=True, kw_only=True)
class ShardState(MeshDims):
    """A parallelised model's decoded mesh and resolved plan, kept on the model; built once by
    ``parallel.install``."""

    specs: ResolvedPlan

    @classmethod
    def of(cls, dims: MeshDims, specs: ResolvedPlan) -> ShardState:
        return cls(specs=specs, **{f.name: getattr(dims, f.name) for f in fields(MeshDims)})

    def gather_coords(self, spec: ShardSpec) -> tuple[int, int]:
        """``(degree, rank)`` of the shard this rank hands a gather save for ``spec`` (degree 1:
        whole here, as a global SPMD tensor is)."""
        return (1, 0) if self.holding.one_process else self.coords(spec)

    __repr__ = MeshDims.__repr__  # the dataclass's own repr would print the whole plan


def get_shard_state(model: nn.Module) -> ShardState | None:
    """The ``ShardState`` that ``parallelize`` / ``load`` left on ``model``, or None."""
    return model.__dict__.get(_STATE_ATTR)


def set_shard_state(model: nn.Module, state: ShardState) -> None:
    model.__dict__[_STATE_ATTR] = state


__all__ = ["AxisMesh", "MeshDims", "ShardState", "check_spmd", "decode_mesh", "get_shard_state",
           "is_spmd_mesh", "set_shard_state", "tp_axis", "world_backend"]
