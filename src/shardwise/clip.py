"""Gradient clipping by the true global norm of a model split over several meshes.

``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms, which fails (or counts
replicated tensors once per rank) when gradients are DTensors on different meshes (tp
only, FSDP x TP, replicated) or plain local shards with the collectives in the forward
(``"local"`` holding). Here every rank sums ``|g|^p`` over its local gradients, each
divided by the number of ranks that hold an identical copy of that shard, and one
all-reduce over the world gives the sum over distinct elements: the one-process norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

import shardwise.comm as comm
from shardwise.errors import NonFiniteError
from shardwise.holding import is_dtensor
from shardwise.mesh import world_backend
from shardwise.parallel import get_shard_state

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _grads(model_or_params) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``(local grad to scale, local grad to measure, copies)`` for every parameter with a
    gradient; ``copies`` is how many ranks hold the same elements."""
    world = comm.world_size()
    if isinstance(model_or_params, nn.Module):
        state = get_shard_state(model_or_params)
        named = list(model_or_params.named_parameters())
    else:
        state = None
        if isinstance(model_or_params, torch.Tensor):
            model_or_params = [model_or_params]
        named = [("", p) for p in model_or_params]
    out = []
    for name, p in named:
        g = p.grad
        if g is None:
            continue
        spec = state.specs.get(name) if state is not None else None
        # a tp shard the mesh does not show: a plain local shard, or FSDP over "local" holding
        hidden_tp = 1
        if (state is not None and spec is not None and not spec.replicated
                and state.holding.plain_shards):
            hidden_tp = state.coords(spec)[0]
        if is_dtensor(g):
            dg = g
            mesh = dg.device_mesh
            if {"tp", "ep"} & set(mesh.mesh_dim_names or ()):
                hidden_tp = 1
            if any(pl.is_partial() for pl in dg.placements):
                from torch.distributed.tensor import Replicate

                with comm.guarded("redistribute", group=mesh, purpose=f"the gradient of {name!r}"):
                    dg = dg.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                                     for pl in dg.placements])
            split = math.prod(mesh.size(i) for i, pl in enumerate(dg.placements) if not pl.is_replicate())
            out.append((cast("DTensor", p.grad).to_local(), dg.to_local(), world // (split * hidden_tp)))
        else:
            out.append((g, g, world // hidden_tp))
    return out


def clip_grad_norm_(model_or_params: nn.Module | Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, *, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients in place so that their global ``norm_type`` norm is at most
    ``max_norm``; return that norm (before clipping), the same on every rank.

    Pass the model (needed for ``"local"`` holding, whose plain local shards do not say
    they are shards) or its parameters (DTensors describe themselves; plain tensors are
    taken as replicated). Every rank calls it: it runs one all-reduce over the world.
    Parameters outside a mesh must be identical on every rank.

    >>> total = sw.clip_grad_norm_(model, 1.0)   # doctest: +SKIP
    """
    norm_type = float(norm_type)
    backend = world_backend()  # the API boundary: the backend of the all-reduce below
    grads = _grads(model_or_params)
    device = grads[0][1].device if grads else torch.device("cpu")
    if norm_type == math.inf:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for _, local, _ in grads:
            if local.numel():
                total = torch.maximum(total, local.detach().abs().max().double())
        comm.all_reduce(total, "max", backend=backend, purpose="clip_grad_norm_")
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for _, local, copies in grads:
            norm = torch.linalg.vector_norm(local.detach(), norm_type, dtype=torch.float64)
            total += norm ** norm_type / copies
        comm.all_reduce(total, backend=backend, purpose="clip_grad_norm_")
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise NonFiniteError(f"the total norm of order {norm_type} of the gradients is {total.item()}; "
                           "pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for target, _, _ in grads:
        target.mul_(coef.to(target.dtype))
    return total.to(torch.float32)


__all__ = ["clip_grad_norm_"]
