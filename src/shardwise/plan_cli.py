"""``shardwise check-plan``: :func:`shardwise.check_plan` on local gloo ranks for a transformers
or diffusers class built from a config file (seeded random weights and inputs) or a user's
model by import path. Imported by ``cli`` only when the command runs (its arguments are
``cli``'s), so its imports of shardwise and torch sit at the top."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import torch

import shardwise as sw
from shardwise.hf.adapter import build_model
from shardwise.testing import spawn


def build(model: str, config: str | None, seed: int):
    """``(model, positional inputs, keyword inputs)`` for ``model`` (``cli``'s check-plan arguments)."""
    module, _, name = model.partition(":")
    if not name:
        raise SystemExit(f"shardwise check-plan: {model!r} is not LIBRARY:CLASS or module:function")
    torch.manual_seed(seed)
    if module in ("transformers", "diffusers"):
        if config is None:
            raise SystemExit(f"shardwise check-plan: {model} needs --config CONFIG_JSON (its config.json)")
        path = Path(config)
        cls = getattr(importlib.import_module(module), name)
        built = build_model(cls, path.parent if path.is_file() else path)
        if module == "diffusers":
            return built.eval(), (), diffusers_inputs(built, seed)
        config_of: Any = built.config  # a transformers PretrainedConfig
        ids = torch.randint(0, config_of.get_text_config().vocab_size, (2, 8))
        return built.eval(), (), {"input_ids": ids}
    sys.path.insert(0, ".")  # a user's module next to where the command runs
    built, inputs = getattr(importlib.import_module(module), name)()
    return (built, (), dict(inputs)) if isinstance(inputs, dict) else (built, tuple(inputs), {})


def diffusers_inputs(model, seed: int) -> dict:
    """Seeded keyword inputs for a Flux-family diffusers transformer (a forward that takes
    ``img_ids`` and ``txt_ids``): 6 image and 5 text tokens, shaped by its config."""
    names = inspect.signature(model.forward).parameters
    if not {"img_ids", "txt_ids", "hidden_states", "encoder_hidden_states"} <= set(names):
        raise SystemExit(f"shardwise check-plan: no inputs known for {type(model).__name__} (built for the "
                         "Flux-family transformers, whose forward takes img_ids and txt_ids); pass "
                         "module:function returning (model, inputs) instead")
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    flux1 = "pooled_projections" in names  # Flux.1 takes ids per token, Flux.2 per batch and token

    def ids(n: int) -> torch.Tensor:
        t = torch.zeros(n, len(config.axes_dims_rope))
        t[:, -1] = torch.arange(n)
        return t if flux1 else t[None]

    inputs = {"hidden_states": torch.randn(1, 6, config.in_channels, generator=gen),
              "encoder_hidden_states": torch.randn(1, 5, config.joint_attention_dim, generator=gen),
              "timestep": torch.tensor([0.5]), "img_ids": ids(6), "txt_ids": ids(5)}
    if config.get("guidance_embeds"):
        inputs["guidance"] = torch.tensor([3.5])
    if flux1:
        inputs["pooled_projections"] = torch.randn(1, config.pooled_projection_dim, generator=gen)
    return inputs


def _rank(model: str, config: str | None, seed: int, tp: int, ep: int, plan, rtol):
    backend = sw.init_backend("gloo")
    built, args, kwargs = build(model, config, seed)
    axes = {"tp": tp} if ep == 1 else {"ep": ep} if tp == 1 else {"ep": ep, "tp": tp}
    report = sw.check_plan(built, args, kwargs=kwargs, plan=plan, mesh=backend.mesh(**axes), rtol=rtol)
    return str(report), report.ok


def run(args) -> int:
    plan = args.plan if args.plan == "auto" else json.loads(Path(args.plan).read_text())
    printed, ok = spawn(_rank, args.tp * args.ep, timeout=600.0,
                        args=(args.model, args.config, args.seed, args.tp, args.ep, plan, args.rtol))[0]
    print(printed)
    return 0 if ok else 1


__all__ = ["build", "diffusers_inputs", "run"]
