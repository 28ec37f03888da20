"""Checks of known Hugging Face model families that a plan cannot see: what their forwards do
with the tensors a plan splits.

Registered with ``core.plan.register_model_check`` when this module is imported (the
Hugging Face adapter imports it, and ``import shardwise`` registers the adapter), so
``resolve_plan`` runs them at every degree it tries without knowing them: a forward that
takes statistics over split features (Gemma-3n's activation sparsity) and one that cuts a
fused gate/up tensor into halves (``.chunk(2``, read from the forward's source).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

from torch import nn

from shardwise.core.plan import register_model_check
from shardwise.errors import PlanError


@register_model_check
def check_statistics_over_shards(model: nn.Module, owned: Mapping, degrees: Mapping[str, int]) -> None:
    """Refuse a plan that splits the features a module takes statistics over: each rank would
    compute them over its own part, and the output would be wrong without an error. Known
    case: Gemma-3n's activation sparsity (a Gaussian top-k over the intermediate features of
    ``gate_proj``), which transformers' shipped plan shards colwise."""
    for path, module in model.named_modules():
        sparsity = getattr(module, "activation_sparsity", 0.0)
        gate = getattr(module, "gate_proj", None)
        if not (isinstance(sparsity, float) and sparsity > 0 and isinstance(gate, nn.Linear)):
            continue
        entry = owned.get(id(gate.weight))
        if entry is not None and not entry[0].replicated and degrees[entry[0].axis] > 1:
            raise PlanError(
                f"plan key {entry[2]!r} shards {entry[1]!r}, but {path!r} takes activation-sparsity "
                f"statistics (sparsity {sparsity}) over all of its intermediate features: every rank "
                "would see only its part and the output would be wrong. Keep this layer's MLP whole "
                "(drop its gate_proj/up_proj/down_proj keys) or set activation_sparsity_pattern to 0")


@register_model_check
def check_fused_halves(model: nn.Module, owned: Mapping, degrees: Mapping[str, int]) -> None:
    """Refuse a plain colwise split of a fused ``gate_up_proj`` ([..., 2 x intermediate,
    hidden]) whose module's forward cuts each projection into its gate and up halves
    (``.chunk(2, dim=-1)``): one rank would hold gate rows only and another up rows only, and
    the output would be wrong without an error. ``packed_colwise`` splits each half. Known case:
    Inkling's experts, which transformers' shipped plan shards "colwise"."""
    for module in model.modules():
        param = module._parameters.get("gate_up_proj")
        if param is None:
            continue
        entry = owned.get(id(param))
        if entry is None:
            continue
        spec = entry[0]
        if (spec.replicated or degrees[spec.axis] == 1 or len(spec.blocks) != 1
                or spec.dim != param.dim() - 2 or ".chunk(2" not in _forward_source(_class_of(module))):
            continue
        raise PlanError(
            f"plan key {entry[2]!r} splits {entry[1]!r} plainly along its fused gate/up dim, but "
            f"{type(module).__name__}.forward cuts that dim into gate and up halves, so each rank "
            "would get whole halves instead of part of each and the output would be wrong; use "
            "'packed_colwise' for it (each half split alike)")


def _class_of(module: nn.Module) -> type:
    # typed `type` for the cache key: mypy does not take a type[Module] as Hashable
    return type(module)


@functools.cache  # one read per class, not per layer of a deep MoE
def _forward_source(cls: type[nn.Module]) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source (built in, compiled): nothing to check
        return ""


__all__ = ["check_fused_halves", "check_statistics_over_shards"]
