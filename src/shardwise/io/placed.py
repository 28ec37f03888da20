"""Where a live tensor sits in its canonical tensor (:func:`place`): a DTensor's placements (FSDP2
``_StridedShard`` over tp, ep), or a plain local shard and its spec, read once into a
:class:`Placed`; a model's tensors so (:func:`model_placed`), a quantized weight's scales each
block once (:func:`scale_placed`). What every distributed save writes and the transfer reads;
no torch DCP module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
from torch import nn

from shardwise.core.quant_layout import QuantTie, scale_local_shape, scale_owned_layout, tie_aligned
from shardwise.core.spec import Layout, Region, ShardSpec, chunked_layout, global_shape
from shardwise.errors import CheckpointError
from shardwise.holding import is_dtensor
from shardwise.mesh import get_shard_state

if TYPE_CHECKING:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class Placed:
    """This rank's part of one canonical tensor of ``shape``: the plain tensor ``local`` and its
    ``layout`` (each region it holds, with its offset in ``local``)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    layout: Layout

    def piece(self, offset: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The view of ``local`` holding the region at local ``offset`` with ``sizes``."""
        return self.local[Region(offset, sizes).slices()]


def _is_split(p: Placement) -> TypeGuard[Shard]:
    # torch 2.13's _StridedShard is not a Shard subclass and answers is_shard() False (it has
    # Shard's dim, all that is read of a split placement here)
    return p.is_shard() or type(p).__name__ == "_StridedShard"


def place(tensor: torch.Tensor, spec: ShardSpec | None, degree: int, tp_rank: int, *, name: str) -> Placed:
    """Where ``tensor`` (parameter, buffer or optimizer state) sits in its canonical tensor, split
    by ``spec`` over ``degree`` (``spec=None``: a DTensor's ``Shard(dim)`` on ``tp`` as unpacked,
    anything else replicated); FSDP2 shards over other axes are ``torch.chunk`` parts of the
    tp-local tensor, in mesh order."""
    local, base_shape = tensor, tuple(tensor.shape)
    chunks: list[tuple[int, int, int]] = []   # (dim, num_chunks, index)
    tp_in_mesh = False
    if is_dtensor(tensor):
        local = tensor.to_local()
        mesh = tensor.device_mesh
        names = mesh.mesh_dim_names or ()
        coord = mesh.get_coordinate()
        axis = spec.axis if spec is not None else "tp"  # the mesh axis the spec splits over
        tp_index = names.index(axis) if axis in names else None
        if spec is None and tp_index is not None:
            p = tensor.placements[tp_index]
            spec = ShardSpec(dim=cast("Shard", p).dim) if p.is_shard() else ShardSpec()
            assert coord is not None  # this rank holds a shard of the DTensor: it is on its mesh
            degree, tp_rank = mesh.size(tp_index), coord[tp_index]
        spec = spec or ShardSpec()
        for i, p in enumerate(tensor.placements):
            if i == tp_index:
                tp_in_mesh = True
                ok = p.is_replicate() if spec.replicated else (_is_split(p) and p.dim == spec.dim)
                if not ok:
                    raise CheckpointError(f"tensor {name!r}: placement {p} on the tp axis does not match "
                                          f"its shard spec {spec}")
            elif _is_split(p):
                # A plain Shard before tp on the tp shard dim splits first: another layout than
                # FSDP2's, except over a tp axis of size 1 (FSDP2 places (S(0), S(0)) there),
                # where it holds the same data as the _StridedShard layout.
                if (tp_index is not None and i < tp_index and p.dim == spec.dim and not spec.replicated
                        and type(p).__name__ != "_StridedShard" and mesh.size(tp_index) > 1):
                    raise CheckpointError(
                        f"tensor {name!r}: {p} on mesh axis {names[i]!r} splits the tp shard dim "
                        "before tp; shardwise supports FSDP2's layout (fully_shard applied after "
                        "tensor parallelism)")
                assert coord is not None  # as above
                chunks.append((p.dim, mesh.size(i), coord[i]))
            elif not p.is_replicate():
                raise CheckpointError(f"tensor {name!r} has a {p} placement (a pending reduction); "
                                      "finish the step (reduce the gradients) before saving")
    spec = spec or ShardSpec()
    local = local.detach()
    # a plain local shard (tp not in the DTensor's mesh): the canonical shape is degree x along dim
    shape = tuple(base_shape) if tp_in_mesh else global_shape(base_shape, spec, degree)
    have, layout = chunked_layout(shape, spec, degree, tp_rank, chunks)
    if have != tuple(local.shape):
        raise CheckpointError(f"tensor {name!r}: local shape {tuple(local.shape)} does not match the "
                              f"{have} its placements and shard spec {spec} imply")
    return Placed(local, shape, layout)


def scale_placed(tensor: torch.Tensor, tie: QuantTie, spec: ShardSpec, degree: int, rank: int, *,
                 name: str) -> Placed:
    """Where this rank's scales of ``tie`` go in the canonical scale tensor: the blocks it owns.
    Where every rank's blocks are whole they are split like any tensor (``place``); else they are
    a plain local tensor held as ``scale_layout`` says."""
    if tie_aligned(tie, spec, degree):
        return place(tensor, spec, degree, rank, name=name)
    local = tensor.to_local() if is_dtensor(tensor) else tensor
    want = scale_local_shape(tie, spec, degree, rank)
    if tuple(local.shape) != want:
        raise CheckpointError(f"tensor {name!r}: local scales of shape {tuple(local.shape)}, but rank {rank} "
                              f"of {degree} holding its shard of {tie.weight!r} holds {want}; load the model "
                              "with sw.load or sw.from_pretrained, which place the scales with their weight")
    return Placed(local.detach(), tie.scale_shape, scale_owned_layout(tie, spec, degree, rank))


def model_placed(model: nn.Module) -> dict[str, Placed]:
    """``{tensor name: Placed}`` for every parameter and persistent buffer of ``model``, in
    state-dict order; a tied tensor appears once, under its first name."""
    state = get_shard_state(model)
    tensors = model.state_dict(keep_vars=True)
    if state is not None:  # a quantized weight's scales: each block once (dcp.items.scale_placed)
        ties = state.specs.ties
        return {n: scale_placed(tensors[n], ties[n], spec, *state.coords(spec), name=n) if n in ties
                else place(tensors[n], spec, *state.coords(spec), name=n) for n, spec in state.specs.items()}
    seen: set[int] = set()
    out = {}
    for n, t in tensors.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[n] = place(t, None, 1, 0, name=n)
    return out


__all__ = ["Placed", "model_placed", "place", "scale_placed"]
