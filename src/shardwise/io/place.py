"""The three holdings behind ``shardwise.holding.Holding``: how ``parallelize`` wires a model,
the placement that ends ``sw.load``, and what a rank hands a gather or DCP save. Under SPMD the
device at tp position ``p`` holds canonical chunk ``p``, built on the devices, never whole on
the host."""

from __future__ import annotations

import threading
import typing

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan
from shardwise.core.spec import Region, ShardSpec, shard_regions
from shardwise.io.formats.dcp.checkpoint import model_placed
from shardwise.io.formats.dcp.items import CanonicalSavePlanner, Placed
from shardwise.io.formats.safetensors.reader import WINDOW_BYTES
from shardwise.io.source import Want
from shardwise.io.staging import cast, finalizer
from shardwise.mesh import MeshDims
from shardwise.parallel import ShardState, check_local_wiring, install, wire
from shardwise.quant import local_part

if typing.TYPE_CHECKING:
    from shardwise.backends.xla_spmd import SpmdMesh


class DTensorHolding:
    """Each parameter a DTensor over its mesh axis (gloo, nccl, TorchNeuron); the base class."""

    def check_wiring(self, model: nn.Module, specs: ResolvedPlan) -> None:
        pass  # torch's styles and the explicit-collective forwards take every planned module

    def shard(self, full: torch.Tensor, name: str, spec: ShardSpec, specs: ResolvedPlan,
              dims: MeshDims, device: torch.device | None) -> torch.Tensor:
        t = full.detach()
        local = t if spec.replicated else local_part(t, name, spec, specs, dims.coords(spec))
        return local.to(device) if device is not None and local.device != device else local

    def wire(self, model: nn.Module, specs: ResolvedPlan, state: ShardState) -> None:
        wire(model, specs, state, dtensor=True)

    def placement(self, model: nn.Module, specs: ResolvedPlan, dims: MeshDims, dtype: torch.dtype | None):
        return InstallPlacement(specs, dims, dtype)

    def gather_coords(self, state: ShardState, spec: ShardSpec) -> tuple[int, int]:
        return state.coords(spec)

    def dcp_placed(self, model: nn.Module, state: ShardState) -> tuple[dict[str, Placed], None]:
        return model_placed(model), None


class LocalHolding(DTensorHolding):
    """Each parameter a plain local shard; the forward of each planned module does its own
    collectives (xla, neuron_xla)."""

    def check_wiring(self, model: nn.Module, specs: ResolvedPlan) -> None:
        check_local_wiring(model, specs)

    def wire(self, model: nn.Module, specs: ResolvedPlan, state: ShardState) -> None:
        wire(model, specs, state, dtensor=False)


class SpmdHolding(DTensorHolding):
    """One process drives every device (xla_spmd): each parameter stays one global tensor
    placed over the devices, and the model's own forward is correct (the XLA partitioner
    inserts the collectives)."""

    def shard(self, full, name, spec, specs, dims, device):
        return typing.cast("SpmdMesh", dims.tp_mesh).distribute(full, spec.dim)

    def wire(self, model, specs, state):
        pass  # the model's own forward: the partitioner adds the collectives

    def placement(self, model, specs, dims, dtype):
        return SpmdPlacement(model, specs, dims, dtype)

    def gather_coords(self, state, spec):
        return 1, 0  # a global tensor: .cpu() is the canonical tensor, nothing to gather

    def dcp_placed(self, model, state):
        """The global tensors (local offsets are canonical offsets), each listing this process's
        distinct shards; DCP drops the copies other processes also write."""
        assert state.backend is not None  # an SPMD model, its mesh made by xla_spmd
        tensors = model.state_dict(keep_vars=True)
        state.backend.settle([tensors[name].detach() for name in state.specs])  # after a step: one program
        placed = {name: global_placed(tensors[name], state.backend, whole=spec.replicated)
                  for name, spec in state.specs.items()}
        return placed, SpmdSavePlanner(placed, state.backend)


class InstallPlacement:
    """One process per device: each rank reads its own regions, cast and moved to its device
    as they arrive, then installed (``parallel.install``)."""

    window = None  # the reads stream: no batching

    def __init__(self, specs: ResolvedPlan, dims: MeshDims, dtype: torch.dtype | None):
        self.specs, self.dims, self.dtype = specs, dims, dtype
        self.coords = dims.axis_coords  # per mesh axis: a spec's ranks are on spec.axis
        self.device = dims.device
        self._finalize = finalizer(dtype, self.device)  # cast after slicing, then to the device
        self._keep = finalizer(None, self.device)  # FP8 weights and their scales keep their dtypes
        self._quantized = specs.quantized

    def wants(self, names: list[str]) -> dict[str, Want]:
        return {n: Want(n, self.specs[n], *self.coords[self.specs[n].axis], tie=self.specs.ties.get(n))
                for n in names}

    def finalize(self, key: str, raw: torch.Tensor) -> torch.Tensor:
        return (self._keep if key in self._quantized else self._finalize)(raw)

    def install(self, model: nn.Module, tensors: dict, missing: list[str]) -> None:
        own = model.state_dict(keep_vars=True) if missing else {}

        def local_tensor(name, spec):
            if name in tensors:
                return tensors.pop(name)  # install owns it now; our reference goes
            return self.finalize(name, local_part(own[name].detach().cpu(), name, spec, self.specs,
                                                  self.coords[spec.axis]))  # own

        install(model, self.specs, self.dims, local_tensor=local_tensor, dtype=self.dtype)


class SpmdPlacement:
    """One want per canonical chunk this process's devices hold; each tensor is built on the
    devices once its chunks are read."""

    device = None  # chunks stay on the host until from_chunks sends them
    window = WINDOW_BYTES

    def __init__(self, model: nn.Module, specs: ResolvedPlan, dims: MeshDims, dtype: torch.dtype | None):
        self.tp_mesh = typing.cast("SpmdMesh", dims.tp_mesh)
        self.specs, self.dtype = specs, dtype
        self._dims = dims
        self._shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
        self._keys: dict[str, tuple[str, int]] = {}
        self._needed: dict[str, int] = {}
        self._pending: dict[str, dict[int, torch.Tensor]] = {}
        self._built: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def wants(self, names: list[str]) -> dict[str, Want]:
        """A replicated tensor is one whole-tensor chunk at position 0."""
        degree, positions = self.tp_mesh.size(), self.tp_mesh.positions()
        out = {}
        for name in names:
            spec = self.specs[name]
            for p in [0] if spec.replicated else positions:
                key = f"{name}@{p}"
                self._keys[key] = (name, p)
                out[key] = (Want(name, ShardSpec(), 1, 0) if spec.replicated
                            else Want(name, ShardSpec(dim=spec.dim), degree, p))
            self._needed[name] = 1 if spec.replicated else len(positions)
        return out

    def finalize(self, key: str, raw: torch.Tensor) -> None:
        name, position = self._keys[key]
        raw = cast(raw, self.dtype)
        with self._lock:  # one transfer at a time; the reads go on meanwhile
            parts = self._pending.setdefault(name, {})
            parts[position] = raw
            if len(parts) < self._needed[name]:
                return
            del self._pending[name]
            self._built[name] = self.tp_mesh.from_chunks(parts, self._shapes[name], self.specs[name].dim,
                                                         raw.dtype, name=name)

    def install(self, model: nn.Module, tensors: dict, missing: list[str]) -> None:
        own = model.state_dict(keep_vars=True) if missing else {}

        def local_tensor(name, spec):
            if name in self._built:
                return self._built.pop(name)
            # strict=False: the model's own value
            return self.tp_mesh.distribute(cast(own[name].detach().cpu(), self.dtype), spec.dim)

        install(model, self.specs, self._dims, local_tensor=local_tensor)


def _chunk_regions(shape, spec: ShardSpec, axis_mesh) -> dict[int, Region]:
    """{tp position: its canonical chunk along ``spec.dim``} for this process's devices."""
    chunk, degree = ShardSpec(dim=spec.dim), axis_mesh.size()
    return {p: shard_regions(shape, chunk, degree, p)[0] for p in axis_mesh.positions()}


def _whole(spec: ShardSpec, shape, axis_mesh) -> bool:
    return spec.replicated or not shape or axis_mesh is None


def host_placed(tensor: torch.Tensor, spec: ShardSpec, axis_mesh) -> Placed:
    """A host buffer for a DCP read of a global SPMD tensor like ``tensor``: only the canonical
    chunks along ``spec.dim`` this process's devices hold on ``axis_mesh`` are read (the whole
    tensor when replicated, a scalar or without an axis)."""
    shape = tuple(tensor.shape)
    buf = torch.empty(shape, dtype=tensor.dtype)
    if _whole(spec, shape, axis_mesh):
        return Placed(buf, shape, [(Region((0,) * len(shape), shape), (0,) * len(shape))])
    return Placed(buf, shape, [(r, r.offsets) for r in _chunk_regions(shape, spec, axis_mesh).values()])


def chunks_to_devices(placed: Placed, spec: ShardSpec, axis_mesh, device, *, name: str) -> torch.Tensor:
    """The global tensor on the devices from a :func:`host_placed` read: tiled over
    ``axis_mesh`` along ``spec.dim``, else replicated (a plain copy without an axis, for a
    scalar or to a host ``device``)."""
    buf = placed.local
    if axis_mesh is None or not buf.ndim or torch.device(device).type != "xla":
        return buf.to(device)
    if _whole(spec, buf.shape, axis_mesh):
        return axis_mesh.from_chunks({0: buf}, buf.shape, None, buf.dtype, name=name)
    chunks = {p: buf[r.slices()].contiguous() for p, r in _chunk_regions(buf.shape, spec, axis_mesh).items()}
    return axis_mesh.from_chunks(chunks, buf.shape, spec.dim, buf.dtype, name=name)


def global_placed(tensor: torch.Tensor, backend, *, whole: bool = False) -> Placed:
    """A global SPMD tensor as a :class:`Placed` of itself, listing this process's distinct
    shards (``backend.local_regions``); ``whole`` or a host tensor: one region."""
    t = tensor.detach()
    if whole or t.ndim == 0 or t.device.type != "xla":
        boxes = [((0,) * t.ndim, tuple(t.shape))]
    else:
        boxes = backend.local_regions(t)
    return Placed(t, tuple(t.shape), [(Region(o, s), tuple(o)) for o, s in boxes])


class SpmdSavePlanner(CanonicalSavePlanner):
    """The canonical save planner taking each shard of an SPMD tensor from its local shards on
    the host (fetched once per tensor by ``backend``), not by slicing the global tensor, which
    would compile one XLA program per slice."""

    def __init__(self, placed, backend):
        super().__init__(placed)
        self._backend = backend
        self._shards: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
        self._lock = threading.Lock()

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        p = self._placed.get(fqn)
        if p is None or p.local.device.type != "xla":
            return super().resolve_data(write_item)
        if len(p.layout) == 1 and p.layout[0][0].sizes == p.shape:  # whole (replicated): one copy
            return self.state_dict[fqn].cpu()
        with self._lock:
            if fqn not in self._shards:
                self._shards[fqn] = self._backend.local_shards(self.state_dict[fqn])
            shards = self._shards[fqn]
            data = shards.pop(tuple(write_item.index.offset))
            if not shards:
                del self._shards[fqn]
        return data


__all__ = ["DTensorHolding", "InstallPlacement", "LocalHolding", "SpmdHolding", "SpmdPlacement",
           "SpmdSavePlanner", "chunks_to_devices", "global_placed", "host_placed"]
