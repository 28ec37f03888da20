"""SPMD placement of DCP reads and saves (xla_spmd holding): a global tensor is read into a host
buffer holding only the canonical chunks this process's devices hold, then tiled over them; a
save takes each shard from the devices' local shards, never by slicing the global tensor."""

from __future__ import annotations

import threading

import torch
from torch import nn

from shardwise.core.spec import Region, ShardSpec, shard_regions
from shardwise.io.formats.dcp.items import CanonicalSavePlanner
from shardwise.io.placed import Placed
from shardwise.mesh import ShardState


def spmd_placed(model: nn.Module, state: ShardState) -> tuple[dict[str, Placed], SpmdSavePlanner]:
    """The placed global tensors of a DCP save of ``model`` under SPMD holding (local offsets are
    canonical offsets), each listing this process's distinct shards (DCP drops the copies other
    processes also write), and their save planner."""
    assert state.backend is not None  # an SPMD model, its mesh made by xla_spmd
    tensors = model.state_dict(keep_vars=True)
    state.backend.settle([tensors[name].detach() for name in state.specs])  # after a step: one program
    placed = {name: global_placed(tensors[name], state.backend, whole=spec.replicated)
              for name, spec in state.specs.items()}
    return placed, SpmdSavePlanner(placed, state.backend)


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


__all__ = ["SpmdSavePlanner", "chunks_to_devices", "global_placed", "host_placed", "spmd_placed"]
