"""TPU (and other PJRT devices) through torch_xla, one process per device; ``neuron_xla`` builds
on it. Process group ``xla`` plus a gloo ``coordination_group``; a :class:`GroupMesh` (named axes
over process-group ranks: torch's DeviceMesh needs a device handle torch_xla does not register);
local holding; collective timeouts are not honoured (``timeout=`` bounds only the start)."""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardwise.backends.base import Backend
from shardwise.backends.launch import torchrun_env
from shardwise.errors import BackendError, BackendUnavailableError, CollectiveError, MeshError

XLA_HINT = "pip install 'shardwise[xla]' (torch-xla must match your torch version)"
TIMEOUT_LIMIT = (
    "torch_xla's 'xla' process group finishes a collective when it is issued (it is an op of the lazy "
    "graph, run later on the device) and its work objects refuse a finite wait, so no collective "
    "can be bounded: a peer that never comes blocks the graph's execution until the runtime's own "
    "limits end the job"
)


def import_torch_xla():
    """torch_xla, or BackendUnavailableError with the install hint."""
    try:
        import torch_xla
        import torch_xla.runtime  # noqa: F401
    except ImportError as e:
        raise BackendUnavailableError(
            f"backend 'xla' needs torch_xla, which is not importable ({e}); {XLA_HINT}"
        ) from e
    return torch_xla


def spmd_enabled() -> bool:
    """True when this process already imported torch_xla and called ``xr.use_spmd()``."""
    if sys.modules.get("torch_xla") is None:
        return False
    try:
        import torch_xla.runtime as xr

        return bool(xr.is_spmd())
    except Exception:  # a torch_xla that cannot answer has no SPMD turned on
        return False


class XlaBackend(Backend):
    name = "xla"
    dist_backend = "xla"
    device_type = "xla"
    supports_dtensor = False
    supports_gather = False
    supports_p2p = False  # torch_xla's process group implements no isend / irecv
    supports_all_to_all = False  # nor an all_to_all with uneven splits

    timeout_limit = TIMEOUT_LIMIT

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._side_group = None
        if kwargs.get("timeout") is not None:
            warnings.warn(
                f"backend {self.name!r} cannot honour timeout={kwargs['timeout']!r} for collectives: "
                f"{TIMEOUT_LIMIT}. It still bounds joining the process group and the gloo side group "
                "(DCP, object collectives)", stacklevel=3)

    @classmethod
    def is_available(cls) -> bool:
        try:
            import torch_xla.runtime as xr

            # device_type() only reads PJRT_DEVICE: asking for a device count here would start
            # the PJRT client before torch_xla's rendezvous assigns this process its device.
            # NeuronCores are the neuron backend's to claim.
            return xr.device_type() not in (None, "", "NEURON")
        except Exception:  # any failure to reach a PJRT device means "not here"
            return False

    def start(self) -> None:
        import_torch_xla()
        if spmd_enabled():
            raise BackendError(
                "torch_xla SPMD mode is on in this process (xr.use_spmd() was called), where one "
                "process drives every device and the 'xla' process group cannot run; use "
                "sw.init_backend('xla_spmd')"
            )
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla" and xla://)

        super().start()
        env = torchrun_env()
        if env is None:
            import torch_xla.runtime as xr

            self.local_rank = int(xr.local_ordinal())
        # Every rank creates it, right after the default group: new_group is collective.
        self._side_group = dist.new_group(backend="gloo")

    def _init_group(self) -> None:
        import torch_xla.runtime as xr

        try:
            if torchrun_env() is None and int(xr.world_size()) == 1:
                # xla:// starts a TCPStore on MASTER_PORT (default 12355) and holds it, so two
                # single-device processes on one host would collide; a world of one needs none.
                dist.init_process_group("xla", store=dist.HashStore(), rank=0, world_size=1,
                                        timeout=self.timeout)
            else:
                dist.init_process_group("xla", init_method="xla://", timeout=self.timeout)
        except Exception as e:
            raise BackendError(f"could not start the xla process group: {e}; is PJRT_DEVICE set "
                               "(TPU, CPU, NEURON) and does every process see its device?") from e

    def _device(self) -> torch.device:
        return torch.device(import_torch_xla().device())

    def _make_mesh(self, names, shape) -> GroupMesh:
        from torch_xla.distributed.xla_backend import new_xla_process_group

        return GroupMesh(self.device_type, names, shape, rank=self.rank, new_group=new_xla_process_group)

    @property
    def coordination_group(self):
        return self._side_group

    def wait(self, work, what: str, *, timeout=None) -> None:
        # torch_xla's work objects refuse a finite wait timeout (TIMEOUT_LIMIT)
        try:
            work.wait()
        except Exception as e:  # torch raises RuntimeError subclasses
            raise CollectiveError(f"{what} on rank {self.rank} failed: {e}") from e

    def shutdown(self) -> None:
        self._side_group = None  # destroy_process_group() in super() ends every group
        super().shutdown()


NewGroup = Callable[[list[int]], object]


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
