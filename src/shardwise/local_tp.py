"""Local holding: plain local shards, and module forwards that do their own collectives (xla,
neuron). The collectives are autograd functions in Megatron's conjugate pairs (``_CopyTo``,
``_ReduceFrom``, ``_GatherFrom``, ``_SplitTo``), so training gives the one-device gradients
(``torch.distributed.nn``'s all-reduce would double them)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardwise.comm as comm
from shardwise.core.plan import Style
from shardwise.core.plan_rules import HEAD_ATTRS
from shardwise.core.spec import ShardSpec, assemble, split
from shardwise.errors import ShardingError, UnsupportedModelError
from shardwise.holding import is_dtensor


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    return comm.all_reduce_inline(t.clone(), group=group)


def _gather_last(t: torch.Tensor, group, blocks, degree: int, rank: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(degree)]
    comm.all_gather_inline(parts, t.contiguous(), group=group)
    return assemble(parts, ShardSpec(dim=t.ndim - 1, blocks=blocks), degree)


def _split_last(t: torch.Tensor, group, blocks, degree: int, rank: int) -> torch.Tensor:
    return split(t, ShardSpec(dim=t.ndim - 1, blocks=blocks), degree, rank)


def _conjugate(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function ``forward(x, group, *args)`` whose gradient is ``backward(grad, group,
    *args)``; the extra arguments get no gradient."""

    def fwd(ctx, x, *args):
        ctx.args = args
        return forward(x, *args)

    def bwd(ctx, grad):
        return backward(grad, *ctx.args), *(None,) * len(ctx.args)

    methods = {"forward": staticmethod(fwd), "backward": staticmethod(bwd)}
    return type(name, (torch.autograd.Function,), methods)


# Megatron's pairs; the arguments after x: (group) or (group, blocks, degree, rank)
_CopyTo = _conjugate("_CopyTo", lambda x, group: x.view_as(x), _all_reduce)
_ReduceFrom = _conjugate("_ReduceFrom", _all_reduce, lambda grad, group: grad)
_GatherFrom = _conjugate("_GatherFrom", _gather_last, _split_last)
_SplitTo = _conjugate("_SplitTo", _split_last, _gather_last)


def wire_local(module: nn.Module, style: Style, state) -> None:
    """Replace ``module.forward`` by its local-shard version for ``style`` (state: ShardState)."""
    if isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward:
        _wire_embedding_subclass(module, style, state)
        return
    fwd: Callable[[Any, Any, Style, Any], Any]
    if isinstance(module, nn.Embedding):
        fwd = _vocab_embedding if style.kind == "rowwise" else _dim_embedding
    else:
        fwd = _colwise_linear if style.kind == "colwise" else _rowwise_linear
    set_forward(module, types.MethodType(lambda mod, x: fwd(mod, x, style, state), module))


def set_forward(module: nn.Module, forward: Callable) -> None:
    """``module.forward = forward``: nn.Module's ``__setattr__`` stores a function as an instance
    attribute after probing its parameter, module and buffer dicts (~5 µs; a wiring does it once or
    twice per module); here stored directly where the class keeps that ``__setattr__``."""
    if type(module).__setattr__ is nn.Module.__setattr__ and not any(
            "forward" in d for d in (module._parameters, module._buffers, module._modules)):
        module.__dict__["forward"] = forward
    else:
        module.forward = forward


def _colwise_linear(mod: nn.Linear, x, style: Style, state):
    y = F.linear(_CopyTo.apply(x, state.group), mod.weight, mod.bias)
    if style.gather_output:
        return _GatherFrom.apply(y, state.group, style.blocks or (1,), state.degree, state.tp_rank)
    return y


def _rowwise_linear(mod: nn.Linear, x, style: Style, state):
    if style.split_input:
        x = _SplitTo.apply(x, state.group, style.blocks or (1,), state.degree, state.tp_rank)
    y = _ReduceFrom.apply(F.linear(x, mod.weight), state.group)
    return y + mod.bias if mod.bias is not None else y  # the bias is added once, after the sum


def _vocab_embedding(mod: nn.Embedding, ids, style: Style, state):
    rows = mod.weight.shape[0]
    start = state.tp_rank * rows
    outside = (ids < start) | (ids >= start + rows)
    local_ids = (ids - start).masked_fill(outside, 0)
    y = F.embedding(local_ids, mod.weight, None, mod.max_norm, mod.norm_type,
                    mod.scale_grad_by_freq, mod.sparse)
    return _ReduceFrom.apply(y.masked_fill(outside.unsqueeze(-1), 0), state.group)


def _dim_embedding(mod: nn.Embedding, ids, style: Style, state):
    y = F.embedding(ids, mod.weight, mod.padding_idx, mod.max_norm, mod.norm_type,
                    mod.scale_grad_by_freq, mod.sparse)
    return _GatherFrom.apply(y, state.group, (1,), state.degree, state.tp_rank)


# -- nn.Embedding subclasses with a forward of their own ---------------------------
class _ShardedLookup(nn.Embedding):
    """A sharded embedding's lookup on its local shard, with its collective."""

    def forward(self, ids):
        style, state = self._shardwise_lookup
        self._shardwise_lookups += 1
        fwd = _vocab_embedding if style.kind == "rowwise" else _dim_embedding
        return fwd(self, ids, style, state)


_WIRED_CLASSES: dict[type, type] = {}


def _wire_embedding_subclass(module: nn.Embedding, style: Style, state) -> None:
    """Shard an nn.Embedding subclass whose forward adds to the lookup (a norm, a scale): its class
    gets :class:`_ShardedLookup` before nn.Embedding in the MRO (as ``fully_shard`` swaps
    classes), so ``super().forward(ids)`` is the sharded lookup. A forward that never calls it
    (reading ``self.weight`` itself) raises when it returns."""
    cls = type(module)
    wired = _WIRED_CLASSES.get(cls)
    if wired is None:
        wired = _WIRED_CLASSES[cls] = type(cls.__name__, (cls, _ShardedLookup),
                                           {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    module.__class__ = wired
    # (torch's stubs take only a Tensor or a Module for a Module attribute)
    module._shardwise_lookup = (style, state)  # type: ignore[assignment]
    inner = module.forward

    def forward(*args, **kwargs):
        module._shardwise_lookups = 0
        out = inner(*args, **kwargs)
        if module._shardwise_lookups == 0:
            raise UnsupportedModelError(
                f"{cls.__name__}.forward does not call nn.Embedding.forward (super().forward), so it "
                "reads the sharded weight itself with global ids; shardwise cannot shard it this way. "
                "Leave this embedding out of the plan (replicated), or plan the modules after it")
        return out

    module.forward = forward  # type: ignore[method-assign]  # wiring replaces this instance's forward


# -- module styles that wrap the module's own forward (both holdings) -------------------
def wire_forward(module: nn.Module, style: Style, state) -> None:
    """Wrap ``module.forward`` for a style whose module keeps its own code (``style.forward``
    other than ``"linear"``); activations are plain tensors in both holdings."""
    kind, group = style.forward, state.group
    if kind in ("none", "local_params"):  # local_params: see run_on_local_params
        return
    if kind == "grad_allreduce":
        _wire_grad_allreduce(module, group)
        return
    if kind == "ep_experts":
        _wire_ep_experts(module, style, state)
        return
    if kind == "local_heads":
        _localize_heads(module, state.degree)
        return
    inner = module.forward

    def forward(*args, **kwargs):
        if kind == "moe_experts":  # (hidden, top_k_index, top_k_weights, ...): inputs replicated
            args = tuple(_CopyTo.apply(a, group) if i in (0, 2) and _is_float(a) else a
                         for i, a in enumerate(args))
        elif kind == "divide_input":  # the experts' all-reduce would count an identity degree times
            args = (args[0] / state.degree, *args[1:])
        out = inner(*args, **kwargs)
        if kind in ("moe_experts", "reduce_output"):
            return _ReduceFrom.apply(out, group)
        if kind == "mla_kv_a" and style.rope_dim:
            passed, rope = out.split([out.shape[-1] - style.rope_dim, style.rope_dim], dim=-1)
            return torch.cat([passed, _CopyTo.apply(rope, group)], dim=-1)
        return out

    module.forward = forward


def _wire_grad_allreduce(module: nn.Module, group) -> None:
    """Sum the gradients of ``module``'s own parameters over the tp axis, once per backward, by
    passing them through ``_CopyTo`` (a Parameter hook never fires once FSDP2 swaps the
    parameters, and a post-accumulate hook would reduce accumulated gradients again)."""
    _with_params(module, lambda p: p.requires_grad, lambda p: _CopyTo.apply(p, group), grad_only=True)


def _wire_ep_experts(module: nn.Module, style: Style, state) -> None:
    """Expert parallel by all-reduce (the ep group shares one batch): rank ``r`` holds experts
    ``[r * n, (r + 1) * n)``, routes to other ranks' get local id ``n`` and weight 0 (transformers
    skips them), and the partial outputs are summed over the ep group."""
    n, group, rank = style.num_experts // state.ep_degree, state.ep_group, state.ep_rank
    if hasattr(module, "num_experts"):
        module.num_experts = n
    module._is_expert_parallel = True  # type: ignore[assignment]  # stubs: Module attrs are Tensor | Module
    inner = module.forward

    def forward(hidden, top_k_index, top_k_weights, *rest, **kwargs):
        hidden = _CopyTo.apply(hidden, group)
        top_k_weights = _CopyTo.apply(top_k_weights, group)
        off_rank = (top_k_index // n) != rank
        local_index = torch.where(off_rank, n, top_k_index % n)
        out = inner(hidden, local_index, top_k_weights.masked_fill(off_rank, 0.0), *rest, **kwargs)
        return _ReduceFrom.apply(out, group)

    module.forward = forward


def _localize_heads(module: nn.Module, degree: int) -> None:
    """Divide the module's own head counts (and ``inner_dim``, heads times head width) by the
    degree: its forward then shapes the local heads of its colwise projections (the resolve
    checked that the degree divides the head counts: ``head_counts``)."""
    for attr in (*HEAD_ATTRS, "inner_dim"):
        value = module.__dict__.get(attr)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            if value % degree:
                raise ShardingError(f"{type(module).__name__}.{attr} = {value} is not divisible by degree "
                                    f"{degree}; 'local_heads' needs whole heads per rank: pick a degree "
                                    "that divides it")
            setattr(module, attr, value // degree)


def _is_float(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def run_on_local_params(module: nn.Module) -> None:
    """DTensor holding: run ``module.forward`` on the local shards of its DTensor parameters (for
    forwards written for plain tensors); ``to_local`` is differentiable."""
    _with_params(module, is_dtensor, lambda p: p.to_local())


def _with_params(module: nn.Module, pick: Callable, swap: Callable, *, grad_only: bool = False) -> None:
    """Run ``module.forward`` with each of its own parameters ``pick`` selects replaced by
    ``swap(parameter)`` (``grad_only``: only while autograd records), restored afterwards."""
    inner = module.forward

    def forward(*args, **kwargs):
        if grad_only and not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        held = {n: p for n, p in module._parameters.items() if p is not None and pick(p)}
        module._parameters.update({n: swap(p) for n, p in held.items()})
        try:
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(held)

    set_forward(module, forward)
