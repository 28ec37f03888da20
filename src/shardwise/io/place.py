"""The placement that ends ``sw.load``, picked by the mesh's holding (:func:`placement`): one
process per device installs each rank's regions (``parallel.install``); under SPMD the device at
tp position ``p`` holds canonical chunk ``p``, built on the devices, never whole on the host."""

from __future__ import annotations

import threading
import typing

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan
from shardwise.core.spec import ShardSpec
from shardwise.core.walk import state_tensors
from shardwise.io.read.reader import WINDOW_BYTES
from shardwise.io.source import Want
from shardwise.io.staging import cast, finalizer, host_to_device
from shardwise.mesh import MeshDims
from shardwise.parallel import install
from shardwise.quant import local_part

if typing.TYPE_CHECKING:
    from shardwise.backends.xla_spmd import SpmdMesh


def placement(model: nn.Module, specs: ResolvedPlan, dims: MeshDims,
              dtype: torch.dtype | None) -> InstallPlacement | SpmdPlacement:
    """The last step of ``sw.load``: this rank's wants, each read's finalize, the install."""
    if dims.holding.one_process:
        return SpmdPlacement(model, specs, dims, dtype)
    return InstallPlacement(specs, dims, dtype)


class InstallPlacement:
    """One process per device: each rank reads its own regions, cast and moved to its device
    as they arrive, then installed (``parallel.install``)."""

    window = None  # the reads stream: no batching

    def __init__(self, specs: ResolvedPlan, dims: MeshDims, dtype: torch.dtype | None):
        self.specs, self.dims, self.dtype = specs, dims, dtype
        self.coords = dims.axis_coords  # per mesh axis: a spec's ranks are on spec.axis
        self.device = dims.device
        self._to_device = host_to_device(self.device)  # one stager (its pinned buffers) for both
        self._finalize = finalizer(dtype, self.device, self._to_device)  # cast after slicing, then move
        self._keep = finalizer(None, self.device, self._to_device)  # FP8 weights and scales keep dtypes
        self._quantized = specs.quantized

    def wants(self, names: list[str]) -> dict[str, Want]:
        return {n: Want(n, self.specs[n], *self.coords[self.specs[n].axis], tie=self.specs.ties.get(n))
                for n in names}

    def finalize(self, key: str, raw: torch.Tensor) -> torch.Tensor:
        return (self._keep if key in self._quantized else self._finalize)(raw)

    def install(self, model: nn.Module, tensors: dict, missing: list[str]) -> None:
        self._to_device.join()  # the copies still in flight land before anything reads them
        own = state_tensors(model) if missing else {}

        def local_tensor(name, spec):
            if name in tensors:
                return tensors.pop(name)  # install owns it now; our reference goes
            return self.finalize(name, local_part(own[name].detach().cpu(), name, spec, self.specs,
                                                  self.coords[spec.axis]))  # own

        install(model, self.specs, self.dims, local_tensor=local_tensor, dtype=self.dtype)
        self._to_device.join()  # and the model's own values (strict=False) moved meanwhile


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


__all__ = ["InstallPlacement", "SpmdPlacement", "placement"]
