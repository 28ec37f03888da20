"""Placing a load under torch_xla SPMD (holding ``"spmd"``: one process drives every device).

Each tensor is built on the devices from the chunks the devices hold, read off disk
(:meth:`SpmdMesh.from_chunks`): with the tp axis of degree ``d``, the device at tp position
``p`` holds the canonical chunk ``p`` of the tensor's shard dim (``ShardSpec(dim)`` at degree
``d``, whatever the packing: SPMD keeps tensors global, see ``backends/xla_spmd.py``), so a
chunk is read once however many devices replicate it, and no full tensor is assembled on the
host, only the chunks on their way to the devices. The chunks are ordinary
:class:`~shardwise.io.source.Want` s, so every format's source reads them; DCP a batch of
about ``WINDOW_BYTES`` at a time (its reads hold whole batches on the host).

An optimizer's state tensors load the same way, through a DCP read into host chunks
(:func:`host_placed`) that then go onto the devices split like their parameter
(:func:`chunks_to_devices`).

Saving is ``shardwise.io.spmd_save``.
"""

from __future__ import annotations

import threading
import typing

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan
from shardwise.core.spec import Region, ShardSpec, shard_regions
from shardwise.io.formats.dcp.items import Placed
from shardwise.io.formats.safetensors.reader import WINDOW_BYTES
from shardwise.io.source import Want
from shardwise.io.staging import cast
from shardwise.mesh import MeshDims
from shardwise.parallel import install

if typing.TYPE_CHECKING:
    from shardwise.backends.xla_spmd import SpmdMesh


class SpmdPlacement:
    """The wants of one process's devices (one per canonical chunk they hold), and the
    finalize that builds each tensor on the devices once its chunks are read."""

    device = None  # chunks stay on the host until from_chunks sends them
    window = WINDOW_BYTES

    def __init__(self, model: nn.Module, specs: ResolvedPlan, dims: MeshDims, dtype: torch.dtype | None):
        # typing.cast: staging's cast() converts dtypes; the SPMD holding's mesh (backends/xla_spmd)
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
    """A host buffer for a DCP read of a global SPMD tensor shaped like ``tensor``, laid out
    as its canonical tensor: its regions are the canonical chunks along ``spec.dim`` that this
    process's devices hold on ``axis_mesh`` (the whole tensor when ``spec`` is replicated,
    ``tensor`` is a scalar or there is no such axis). Only those regions are read."""
    shape = tuple(tensor.shape)
    buf = torch.empty(shape, dtype=tensor.dtype)
    if _whole(spec, shape, axis_mesh):
        return Placed(buf, shape, [(Region((0,) * len(shape), shape), (0,) * len(shape))])
    return Placed(buf, shape, [(r, r.offsets) for r in _chunk_regions(shape, spec, axis_mesh).values()])


def chunks_to_devices(placed: Placed, spec: ShardSpec, axis_mesh, device, *, name: str) -> torch.Tensor:
    """The global tensor on the devices from ``placed`` (a :func:`host_placed` read): tiled
    over ``axis_mesh`` along ``spec.dim`` like a parameter of that spec, else replicated
    (a plain copy to ``device`` without an axis, or for a scalar or a host ``device``)."""
    buf = placed.local
    if axis_mesh is None or not buf.ndim or torch.device(device).type != "xla":
        return buf.to(device)
    if _whole(spec, buf.shape, axis_mesh):
        return axis_mesh.from_chunks({0: buf}, buf.shape, None, buf.dtype, name=name)
    chunks = {p: buf[r.slices()].contiguous() for p, r in _chunk_regions(buf.shape, spec, axis_mesh).items()}
    return axis_mesh.from_chunks(chunks, buf.shape, spec.dim, buf.dtype, name=name)


__all__ = ["SpmdPlacement", "chunks_to_devices", "host_placed"]
