"""torch_xla SPMD: one process drives every device; the mesh counts devices, not processes.
Holding ``"spmd"``: a parameter is one global tensor tiled over tp (position ``p`` holds
canonical chunk ``p``); the XLA partitioner inserts the collectives. Multi-host is untested."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch

from shardwise.backends.base import Backend, mesh_axes, torchrun_env
from shardwise.backends.xla import import_torch_xla, spmd_enabled
from shardwise.errors import MeshError, ShardingError
from shardwise.holding import Holding

TP = "tp"


class XlaSpmdBackend(Backend):
    name = "xla_spmd"
    dist_backend = "gloo"
    device_type = "xla"
    supports_dtensor = False
    supports_gather = True

    @property
    def holding(self) -> Holding:
        return Holding.SPMD

    def local_shards(self, tensor: torch.Tensor) -> dict[tuple[int, ...], torch.Tensor]:
        """This process's distinct shards of a global SPMD tensor on the host, by canonical offsets."""
        import torch_xla

        out: dict[tuple[int, ...], torch.Tensor] = {}
        shards = torch_xla._XLAC._get_local_shards([tensor])[0]
        boxes = torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])[0]
        for (data, _), (_, index) in zip(shards, boxes, strict=True):
            box = _box(index, tensor.shape)
            if box[0] not in out:
                out[box[0]] = data[tuple(slice(0, n) for n in box[1])]
        return out

    def local_regions(self, tensor: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(offsets, sizes)`` of this process's distinct shards of a global SPMD tensor (no copy);
        an unsharded one is one whole box."""
        import torch_xla

        if not torch_xla._XLAC._get_xla_sharding_spec(tensor):  # no sharding: one whole copy
            return [((0,) * tensor.ndim, tuple(tensor.shape))]
        seen: dict[tuple[int, ...], tuple[int, ...]] = {}
        for _, index in torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])[0]:
            offsets, sizes = _box(index, tensor.shape)
            seen.setdefault(offsets, sizes)
        return sorted(seen.items())

    @classmethod
    def is_available(cls) -> bool:
        return spmd_enabled()  # the user opted in; never turned on by detection

    def start(self) -> None:
        import_torch_xla()
        import torch_xla.runtime as xr

        if not xr.is_spmd():
            xr.use_spmd()
        super().start()

    def _init_group(self) -> None:
        import torch.distributed as dist
        import torch_xla.runtime as xr

        if torchrun_env() is None and int(xr.process_count()) > 1:  # multi-host, no launcher
            dist.init_process_group("gloo", init_method="xla://", timeout=self.timeout)
        else:
            super()._init_group()

    def _device(self) -> torch.device:
        return torch.device(import_torch_xla().device())  # the one virtual SPMD device

    def mesh(self, **axes: int) -> SpmdMesh:
        """A mesh over every XLA device (not every process): ``mesh(tp=4)`` on 4 devices."""
        import torch_xla.runtime as xr

        names, shape = mesh_axes(axes, int(xr.global_runtime_device_count()), "the number of XLA devices")
        return SpmdMesh(names, shape)

    # The process group is gloo: device tensors travel through the host.
    def all_reduce(self, tensor, op="sum", **kwargs):
        return tensor.copy_(super().all_reduce(tensor.cpu(), op, **kwargs))

    def all_gather(self, tensor, **kwargs):
        return [t.to(tensor.device) for t in super().all_gather(tensor.cpu(), **kwargs)]

    def gather(self, tensor, dst=0, **kwargs):
        got = super().gather(tensor.cpu(), dst, **kwargs)
        return None if got is None else [t.to(tensor.device) for t in got]

    def broadcast(self, tensor, src=0, **kwargs):
        return tensor.copy_(super().broadcast(tensor.cpu(), src, **kwargs))


class SpmdMesh:
    """The devices of an SPMD program as an ``AxisMesh`` around torch_xla's ``xs.Mesh``, and how
    tensors get onto it (:meth:`from_chunks`, :meth:`distribute`). ``mesh[axis]`` is the same
    devices seen along one axis; ``get_local_rank()`` raises, ``get_group()`` is None.

    >>> mesh = sw.init_backend("xla_spmd").mesh(dp_shard=2, tp=2)     # doctest: +SKIP
    >>> mesh["tp"].size(), mesh.size()                                 # doctest: +SKIP
    (2, 4)
    """

    spmd = True
    device_type = "xla"

    def __init__(self, names: Sequence[str], shape: Sequence[int], *, axis: str | None = None):
        import numpy as np
        import torch_xla.distributed.spmd as xs

        self._names, self._shape = tuple(names), tuple(int(s) for s in shape)
        self.xla_mesh = xs.Mesh(np.arange(math.prod(self._shape)), self._shape, self._names)
        self._axis = axis
        self.mesh = torch.arange(math.prod(self._shape)).view(self._shape)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self._names if self._axis is None else (self._axis,)

    @property
    def ndim(self) -> int:
        return len(self.mesh_dim_names)

    def size(self, dim: int | str | None = None) -> int:
        if dim is None and self._axis is None:
            return math.prod(self._shape)
        name = self._axis if dim is None else dim if isinstance(dim, str) else self.mesh_dim_names[dim]
        return self._shape[self._names.index(name)]

    def __getitem__(self, name: str) -> SpmdMesh:
        if name not in self._names:
            raise MeshError(f"mesh has no axis {name!r}; its axes are {self._names}")
        view = object.__new__(SpmdMesh)
        view.__dict__.update(self.__dict__, _axis=name)
        return view

    def get_local_rank(self, dim=None) -> int:
        raise MeshError("an SPMD mesh has no local rank: one process drives every device; "
                        "load with holding='spmd' (the xla_spmd backend's default)")

    def get_group(self, dim=None):
        return None

    @property
    def _shard_axis(self) -> str:
        """The axis tensors are split over: this view's axis, else ``tp``, else the only one."""
        if self._axis is not None:
            return self._axis
        if TP in self._names or len(self._names) != 1:
            return TP
        return self._names[0]

    def _positions(self) -> list[int]:
        """The shard-axis position of each device this process addresses, in runtime order."""
        import torch_xla

        if self._shard_axis not in self._names:
            raise MeshError(f"mesh with axes {self._names} has no 'tp' axis; "
                            "build it with backend.mesh(tp=...)")
        axis = self._names.index(self._shard_axis)
        logical = self.mesh
        where = {int(d): int(torch.nonzero(logical == d)[0][axis]) for d in logical.flatten()}
        devices = torch_xla._XLAC._xla_get_runtime_devices()
        return [where[int(re.sub(r"^.*:", "", d))] for d in devices]

    def positions(self) -> list[int]:
        """The distinct tp positions (canonical chunks) this process's devices need."""
        return sorted(set(self._positions()))

    def from_chunks(self, chunks: Mapping[int, torch.Tensor], shape: Sequence[int], dim: int | None,
                    dtype: torch.dtype, *, name: str = "tensor") -> torch.Tensor:
        """The global tensor of ``shape`` from CPU ``chunks`` (tp position -> canonical chunk along
        ``dim``; ``dim=None``: ``chunks[0]`` replicated). Each chunk is checked here: torch_xla
        does not, and a wrong one corrupts the runtime's state."""
        import torch_xla

        shape = tuple(int(s) for s in shape)
        if not shape:
            return chunks[0].to(dtype).to(torch_xla.device())
        degree = 1 if dim is None else self.size(self._shard_axis)
        want = list(shape)
        if dim is not None:
            want[dim] //= degree
        positions = self._positions()
        for p in sorted(set(positions)):
            got = chunks.get(0 if dim is None else p)
            if (got is None or got.device.type != "cpu"
                    or got.dtype != dtype or tuple(got.shape) != tuple(want)):
                have = None if got is None else f"{tuple(got.shape)} {got.dtype} on {got.device}"
                raise ShardingError(f"{name}: chunk {p} of {degree} must be a CPU tensor {tuple(want)} "
                                    f"{dtype}, got {have}")
        spec = tuple(self._shard_axis if d == dim else None for d in range(len(shape)))
        shards = [chunks[0 if dim is None else p] for p in positions]
        return torch_xla._XLAC._global_tensor_from_cpu_shards(
            shards, self.xla_mesh.get_op_sharding(spec), list(shape))

    def distribute(self, tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
        """A CPU tensor placed on the devices: tiled along ``dim`` over tp, or replicated."""
        tensor = tensor.detach().cpu()
        parts = [tensor] if dim is None else tensor.chunk(self.size(self._shard_axis), dim)
        return self.from_chunks(dict(enumerate(parts)), tensor.shape, dim, tensor.dtype)

    def __repr__(self) -> str:
        return f"SpmdMesh({self.mesh.tolist()}, mesh_dim_names={self.mesh_dim_names})"


def _box(index, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if index is Ellipsis:  # replicated: the whole tensor
        return (0,) * len(shape), tuple(shape)
    starts = tuple(int(s.start) for s in index)
    return starts, tuple(min(int(s.stop), n) - a for s, a, n in zip(index, starts, shape, strict=True))


__all__ = ["SpmdMesh", "XlaSpmdBackend"]
