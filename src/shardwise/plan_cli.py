"""``shardwise check-plan``: :func:`shardwise.check_plan` on local gloo ranks for a transformers
or diffusers class built from a config file (seeded random weights and inputs) or a user's
model by import path."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a transformers or diffusers class (transformers:LlamaForCausalLM, "
                                      "diffusers:Flux2Transformer2DModel, with --config), or "
                                      "module:function returning (model, inputs): inputs a tuple of "
                                      "positional arguments or a dict of keyword ones")
    parser.add_argument("--config", default=None, metavar="CONFIG_JSON",
                        help="the config.json (or its folder) a transformers or diffusers class is "
                             "built from")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (default 1)")
    parser.add_argument("--plan", default="auto", metavar="auto|PLAN_JSON",
                        help="the model's own plan (auto, default) or a JSON file of path -> style")
    parser.add_argument("--rtol", type=float, default=None, help="tolerance (default: by dtype)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")


def build(model: str, config: str | None, seed: int):
    """``(model, positional inputs, keyword inputs)`` for ``model`` (see ``add_arguments``)."""
    import torch

    module, _, name = model.partition(":")
    if not name:
        raise SystemExit(f"shardwise check-plan: {model!r} is not LIBRARY:CLASS or module:function")
    torch.manual_seed(seed)
    if module in ("transformers", "diffusers"):
        from shardwise.hf.adapter import build_model

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
    import inspect

    import torch

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
    import shardwise as sw

    backend = sw.init_backend("gloo")
    built, args, kwargs = build(model, config, seed)
    axes = {"tp": tp} if ep == 1 else {"ep": ep} if tp == 1 else {"ep": ep, "tp": tp}
    report = sw.check_plan(built, args, kwargs=kwargs, plan=plan, mesh=backend.mesh(**axes), rtol=rtol)
    return str(report), report.ok


def run(args) -> int:
    from shardwise.testing import spawn

    plan = args.plan if args.plan == "auto" else json.loads(Path(args.plan).read_text())
    printed, ok = spawn(_rank, args.tp * args.ep, timeout=600.0,
                        args=(args.model, args.config, args.seed, args.tp, args.ep, plan, args.rtol))[0]
    print(printed)
    return 0 if ok else 1


__all__ = ["add_arguments", "build", "diffusers_inputs", "run"]
