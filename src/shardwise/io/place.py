"""The last step of ``sw.load``: what each rank wants read, and placing what was read, per
holding. ``"dtensor"`` and ``"local"`` (one process per device) are :class:`InstallPlacement`;
``"spmd"`` (one process driving every device) is :class:`~shardwise.io.spmd.SpmdPlacement`.

A placement has ``device`` and ``window`` (for :class:`~shardwise.io.source.ReadOptions`),
``wants(names)``, the ``finalize`` a source calls per read local tensor (on reader threads),
and ``install(model, tensors, missing)``, which wires the model as ``parallelize`` does.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan
from shardwise.io.source import Want
from shardwise.io.spmd import SpmdPlacement
from shardwise.io.staging import finalizer
from shardwise.mesh import MeshDims
from shardwise.parallel import install, local_part


class InstallPlacement:
    """One process per device: each rank wants its own regions (its coordinates on each
    tensor's axis, tp or ep), cast and moved to its device as they are read, then installed
    with :func:`shardwise.parallel.install`."""

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


def placement(model: nn.Module, specs: ResolvedPlan, dims: MeshDims, dtype: torch.dtype | None):
    """The placement of ``dims.holding``."""
    if dims.holding.one_process:
        return SpmdPlacement(model, specs, dims, dtype)
    return InstallPlacement(specs, dims, dtype)


__all__ = ["InstallPlacement", "placement"]
