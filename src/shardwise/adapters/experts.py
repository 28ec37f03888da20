"""LoRA on expert tensors: PEFT's ``ParamWrapper`` (``target_parameters``) on the 3-D expert
weights of a MoE under expert parallelism. Its LoRA pair folds into the weight it wraps (a
parametrization, ``W + scale * B @ A`` per expert), so a rank holding experts ``[k * n, (k + 1) * n)``
needs only those experts' rows of ``lora_A`` and columns of ``lora_B`` (see ``layout``) and no
collective: the experts' own ep forward does the rest. Each wrapper is told its local expert count;
under DTensor holding its target is swapped for its local shard while PEFT folds or merges."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from shardwise.holding import is_dtensor

_GLOBAL = "_shardwise_num_experts"  # a wired wrapper's global expert count (PEFT sizes new pairs by it)


def is_param_wrapper(layer: Any) -> bool:
    from peft.tuners.lora import ParamWrapper

    return isinstance(layer, ParamWrapper)


def owner_path(path: str) -> str:
    """The planned module a wrapper at ``path`` adapts: nested wrappers sit in ``base_layer``."""
    return ".".join(p for p in path.split(".") if p != "base_layer")


@contextmanager
def global_counts(model: nn.Module) -> Iterator[None]:
    """Every wired wrapper with its global expert count while PEFT injects another adapter (it
    sizes the new pair by ``num_experts``), its local count again afterwards."""
    wired = [(m, m.num_experts) for m in model.modules() if _GLOBAL in m.__dict__]
    for m, _ in wired:
        m.num_experts = m.__dict__[_GLOBAL]
    try:
        yield
    finally:
        for m, local in wired:
            m.num_experts = local


def wire_experts(layer: Any, degree: int) -> None:
    """``layer`` (a ``ParamWrapper`` holding ``1 / degree`` of its experts) computes its delta on
    the local experts; under DTensor holding, on the local shard. Once per layer."""
    if _GLOBAL in layer.__dict__:
        return
    layer.__dict__[_GLOBAL] = layer.num_experts
    layer.num_experts = layer.num_experts // degree
    if is_dtensor(layer.get_param()):
        for method in ("forward", "merge", "unmerge"):
            _on_local_target(layer, method)


def _on_local_target(layer: Any, method: str) -> None:
    inner = getattr(layer, method)

    def run(*args, **kwargs):
        with local_target(layer):
            return inner(*args, **kwargs)

    setattr(layer, method, run)


@contextmanager
def local_target(layer: Any) -> Iterator[None]:
    """``layer``'s target parameter as a Parameter over its DTensor's local shard (the same
    storage: a merge writes the shard) while PEFT parametrizes or merges it."""
    base, name = layer.get_base_layer(), layer.parameter_name
    held = base._parameters.get(name)
    if held is None or not is_dtensor(held):  # an outer wrapper swapped it already
        yield
        return
    base._parameters[name] = nn.Parameter(held.to_local(), requires_grad=held.requires_grad)
    try:
        yield
    finally:
        base._parameters[name] = held


__all__ = ["global_counts", "is_param_wrapper", "local_target", "owner_path", "wire_experts"]
