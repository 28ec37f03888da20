"""Small models shaped like transformers' (names, tied head, q_norm, 3-D expert weights),
with the plans transformers ships for them, for the gloo suite (no transformers needed).

The model is the validation suite's (``shardwise.testing.model``: a Qwen3 / Qwen3-MoE
causal LM) at other sizes: every layer dense SwiGLU, or every layer MoE with fused 3-D
``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` experts, and a head tied to the
embedding by default.
"""

from __future__ import annotations

import torch

from shardwise.testing.model import EP_PLAN, TP_PLAN, ModelConfig, ToyLM


class HFShapedLM(ToyLM):
    def __init__(self, *, vocab=64, hidden=32, heads=4, kv_heads=4, head_dim=8, inter=32, layers=2,
                 num_experts=0, tie=True):
        super().__init__(ModelConfig(vocab=vocab, hidden=hidden, heads=heads, kv_heads=kv_heads,
                                     head_dim=head_dim, inter=inter, expert_inter=inter,
                                     num_experts=num_experts, moe_layers=(num_experts > 0,) * layers,
                                     tie=tie))


def lm_plan() -> dict:
    """The model-level plan, as ``model.tp_plan`` of a transformers causal LM is."""
    return dict(TP_PLAN)


def make_lm(seed: int = 0, **kwargs) -> HFShapedLM:
    torch.manual_seed(seed)
    model = HFShapedLM(**kwargs)
    with torch.no_grad():  # non-trivial norms, so that a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


__all__ = ["EP_PLAN", "HFShapedLM", "lm_plan", "make_lm"]
