"""The invariant checked after every load or parallelize: each tensor of a model is what the
model declared (global shape, local shard size, dtype policy, ties), or a ``ShardingError``
names it. Cheap: shapes and identities only.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan
from shardwise.core.quant_layout import scale_local_shape
from shardwise.core.spec import local_shape
from shardwise.errors import ShardingError
from shardwise.holding import Holding, is_dtensor, local_of


def check_installed(model: nn.Module, specs: ResolvedPlan, declared: dict, *, holding: Holding,
                    dtype: torch.dtype | None, coords: dict | None = None) -> None:
    """Raise ``ShardingError`` naming the tensor unless every tensor of ``model`` has its
    declared global shape, a local shard of the spec's size, the dtype policy (floating
    tensors stay floating, and are ``dtype`` when given; others keep their declared dtype;
    quantized weights and their scales keep theirs) and every tie of the plan still shares
    one tensor. A quantized weight's scales are held as their tie says (``coords``: this
    rank's ``MeshDims.axis_coords``). Cheap: shapes and identities only.
    """
    state = model.state_dict(keep_vars=True)
    for name, spec in specs.items():
        shape, declared_dtype = declared[name]
        t = state[name]
        held_dtensor = is_dtensor(t)
        local = tuple(local_of(t).shape)
        if holding.one_process:  # a global tensor, placed over the devices
            want_local = shape
        elif name in specs.ties and coords is not None:  # an FP8 weight's scales, split along
            want_local = scale_local_shape(specs.ties[name], spec, *coords[spec.axis])
        else:
            want_local = local_shape(shape, spec, specs.degrees[spec.axis])
        if holding.one_process:
            local = tuple(t.shape)
        if (held_dtensor and tuple(t.shape) != shape) or local != want_local:
            held = f"a DTensor of global shape {tuple(t.shape)}" if held_dtensor else "a tensor"
            raise ShardingError(
                f"{name!r}: after sharding it is {held} with local shape {local}, but the model "
                f"declares {shape} sharded as {spec} (local {want_local}); this is a shardwise bug, "
                "please report it with the plan")
        cast = dtype if name not in specs.quantized else None
        if declared_dtype.is_floating_point != t.dtype.is_floating_point or (
                not t.dtype.is_floating_point and t.dtype != declared_dtype) or (
                name in specs.quantized and t.dtype != declared_dtype) or (
                cast is not None and t.dtype.is_floating_point and t.dtype != cast):
            want = cast if cast is not None and declared_dtype.is_floating_point else declared_dtype
            raise ShardingError(f"{name!r} is {t.dtype} after sharding but must be {want}")
    for alias, kept in specs.aliases.items():
        if state.get(alias) is not state.get(kept):
            raise ShardingError(f"{alias!r} and {kept!r} are tied in the model but no longer share one "
                                "tensor after sharding; this is a shardwise bug, please report it")


__all__ = ["check_installed", "local_of"]
