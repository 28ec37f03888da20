"""FP8 modules under tensor parallelism: their scales' shards and their forward.

A block-quantized module (transformers' ``FP8Linear``: an fp8 ``weight`` and a float32
``weight_scale_inv``) is sharded by its weight's spec; its scales follow as region math
(``core.quant_layout``): a rank holds the scale of every block its weight shard touches.

Holding: under ``"dtensor"`` the weight (and bias) are DTensors; the scales are a DTensor too
where every rank's blocks are whole (``tie_aligned``: they are then the scale tensor split by
the weight's spec), and a plain local tensor where a shard boundary cuts a block (576 rows
over 8 ranks): neighbouring ranks then both hold that block's scale, local shapes differ
between ranks, and no DTensor placement describes overlapping shards. ``sw.save`` and the
checks read such a scale's layout from the tie, never from the tensor.

Forward: the module's own forward (its FP8 kernel) runs on the local shards, with the
collectives of its style around it: colwise, the input enters replicated and the output stays
split (or is gathered); rowwise, the partial sums are all-reduced and the bias is added once,
after. An FP8 kernel reads local row ``i`` with local scale row ``i // 128``, which is right
only where the shard starts on a block boundary: where a boundary cuts a block the forward
raises instead of returning wrong values.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan, Style
from shardwise.core.quant_layout import FP8_SCALE_SUFFIX, QuantTie, scale_layout, take_layout, tie_aligned
from shardwise.core.spec import ShardSpec, split
from shardwise.errors import ShardingError, UnsupportedModelError
from shardwise.holding import is_dtensor
from shardwise.local_tp import _CopyTo, _GatherFrom, _ReduceFrom, _SplitTo


def local_part(tensor: torch.Tensor, name: str, spec: ShardSpec, specs: ResolvedPlan,
               coords: tuple[int, int]) -> torch.Tensor:
    """This rank's local shard of the canonical ``tensor`` named ``name``: its split by ``spec``,
    or for a quantized weight's scales, the scales of every block its weight shard touches."""
    tie = specs.ties.get(name)
    if tie is None:
        return split(tensor, spec, *coords)
    layout = scale_layout(tie, spec, *coords)
    shape = list(tie.scale_shape)
    if spec.dim is not None:  # not replicated
        shape[spec.dim] = sum(r.sizes[spec.dim] for r, _ in layout)
    return take_layout(tensor, layout, tuple(shape))


def quantized_module(specs: ResolvedPlan, path: str) -> QuantTie | None:
    """The tie of the FP8 module at ``path``, None for any other module."""
    return specs.ties.get(f"{path}.{FP8_SCALE_SUFFIX}" if path else FP8_SCALE_SUFFIX)


def scale_is_local(specs: ResolvedPlan, name: str) -> bool:
    """Whether the scale tensor ``name`` is held as a plain local tensor under DTensor holding
    (a boundary cuts its blocks, so no DTensor placement describes it)."""
    tie = specs.ties.get(name)
    if tie is None:
        return False
    spec = specs[tie.weight]
    return not tie_aligned(tie, spec, specs.degrees[spec.axis])


def wire_quantized(module: nn.Module, path: str, style: Style, state) -> None:
    """Replace ``module.forward`` by its own forward on the local shards, with ``style``'s
    collectives (``state``: the ``ShardState``); its DTensor parameters, if any, are already
    converted. Where a shard boundary cuts a block the forward raises."""
    tie = quantized_module(state.specs, path)
    assert tie is not None  # called only for a module quantized_module finds (an FP8 one)
    spec = state.specs[tie.weight]
    aligned = tie_aligned(tie, spec, state.degree)
    inner = type(module).forward
    group = state.group

    def forward(x):
        if not aligned:
            raise _cut_error(path, tie, spec, state.degree)
        held = {n: p for n, p in module._parameters.items() if is_dtensor(p)}
        module._parameters.update({n: p.to_local() for n, p in held.items()})
        try:
            if style.kind == "colwise":
                y = inner(module, _CopyTo.apply(x, group))
                if style.gather_output:
                    y = _GatherFrom.apply(y, group, style.blocks or (1,), state.degree, state.tp_rank)
                return y
            if style.split_input:
                x = _SplitTo.apply(x, group, style.blocks or (1,), state.degree, state.tp_rank)
            bias = module._parameters.get("bias")
            module._parameters["bias"] = None  # added once, after the sum
            try:
                y = _ReduceFrom.apply(inner(module, x), group)
            finally:
                module._parameters["bias"] = bias
            return y + bias if bias is not None else y
        finally:
            module._parameters.update(held)

    module.forward = types.MethodType(lambda mod, x: forward(x), module)


def guard_cut_experts(model: nn.Module, specs: ResolvedPlan) -> None:
    """Make the forward of each FP8 experts module (transformers' ``FP8Experts``) whose shard
    boundaries cut a block raise: its kernels read local row ``i`` with local scale row
    ``i // 128``, wrong on such a shard (the shards themselves are held exactly)."""
    for tie in specs.ties.values():
        spec = specs[tie.weight]
        degree = specs.degrees[spec.axis]
        if tie.scheme != "fp8_block" or len(tie.block) != 3 or tie_aligned(tie, spec, degree):
            continue
        path = tie.weight.rpartition(".")[0]
        error = _cut_error(path, tie, spec, degree)

        def forward(*args, _error=error, **kwargs):
            raise _error

        model.get_submodule(path).forward = forward


def _cut_error(path: str, tie: QuantTie, spec: ShardSpec, degree: int) -> UnsupportedModelError:
    assert spec.dim is not None  # a cut block needs a split (tie_aligned is True when replicated)
    dim, block = spec.dim, tie.block[spec.dim]
    whole = []
    for d in range(2, 65):
        try:
            if tie_aligned(tie, spec, d):
                whole.append(d)
        except ShardingError:  # the weight does not split over d
            pass
    hint = (f"degrees where every shard holds whole blocks: {', '.join(map(str, whole))}" if whole
            else "no degree > 1 gives every shard whole blocks of this weight")
    return UnsupportedModelError(
        f"{path!r}: at tp={degree} its shard boundaries on dim {dim} cut {block}-wide FP8 blocks of "
        f"{tie.weight} {tie.weight_shape}, so its FP8 kernel would scale rows with their neighbour's "
        f"block scale. The shards and scales are held exactly (sw.save writes them back byte for byte); "
        f"to run the forward, load with dequantize=True, or use a degree that keeps blocks whole ({hint})")


__all__ = ["guard_cut_experts", "local_part", "quantized_module", "scale_is_local", "wire_quantized"]
