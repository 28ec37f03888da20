"""The plans a Hugging Face model ships, and the prefix its base-model keys match under.

transformers keeps a model's tensor-parallel plan in three places: the class's ``_tp_plan``
(the head: ``lm_head``), the config's ``base_model_tp_plan`` (keys written for the base
model, ``layers.*.self_attn.q_proj``), and the merged ``model.tp_plan`` a loaded model
exposes; its expert-parallel plan likewise (``ep_plan``, ``base_model_ep_plan``). diffusers
keeps one class attribute, ``_tp_plan``. A key written for the base model also matches under
the model's ``base_model_prefix`` (``model.``). Read by attribute only: a model that follows
these conventions without subclassing the libraries' classes (the validation suite's model)
gets the same answers.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

_SHIPPED = {"tp": (("tp_plan", "_tp_plan"), "base_model_tp_plan"),
            "ep": (("ep_plan",), "base_model_ep_plan")}


def base_prefix(model: nn.Module) -> str:
    """``model.base_model_prefix`` when it names a submodule other than the model, else ""."""
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    return prefix if isinstance(inner, nn.Module) and inner is not model else ""


def speaks_plans(model: nn.Module) -> bool:
    """Whether ``model`` follows the libraries' plan conventions (a prefix or a shipped plan)."""
    return bool(base_prefix(model)) or any(shipped_plan(model, axis) for axis in _SHIPPED)


def shipped_plan(model: nn.Module, axis: str) -> dict:
    """The first non-empty plan among the model's attributes for ``axis`` ("tp": ``tp_plan``,
    ``_tp_plan``; "ep": ``ep_plan``), else its config's ``base_model_{axis}_plan`` with each
    key under the base-model prefix; ``{}`` when none."""
    attrs, config_attr = _SHIPPED[axis]
    for attr in attrs:
        plan = getattr(model, attr, None)
        if isinstance(plan, Mapping) and plan:
            return dict(plan)
    base = getattr(getattr(model, "config", None), config_attr, None)
    if isinstance(base, Mapping) and base:
        prefix = base_prefix(model)
        return {f"{prefix}.{k}" if prefix else k: v for k, v in base.items()}
    return {}


__all__ = ["base_prefix", "shipped_plan", "speaks_plans"]
