"""Small models shaped like transformers' (names, tied head, q_norm, 3-D expert weights),
with the plans transformers ships for them, for the gloo suite (no transformers needed).

``HFShapedLM`` mirrors a Qwen3 / Qwen3-MoE causal LM: ``model.embed_tokens``, per-layer
``self_attn.{q,k,v,o}_proj`` with ``q_norm`` / ``k_norm`` on the head dim, and either a
SwiGLU ``mlp.{gate,up,down}_proj`` or an MoE ``mlp.gate`` router with ``mlp.experts``
holding fused 3-D ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` parameters, a
``model.norm`` and an ``lm_head`` that may be tied to the embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = nn.RMSNorm(head_dim)
        self.k_norm = nn.RMSNorm(head_dim)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Fused expert weights as transformers 5 holds them; called with the router's choice."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inter) * 0.1)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            hit = (top_k_index == e)
            rows = hit.any(-1)
            if not rows.any():
                continue
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out[rows] += y * (top_k_weights * hit)[rows].sum(-1, keepdim=True)
        return out


class MoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inter)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = torch.topk(self.gate(x).softmax(-1), self.top_k, dim=-1)
        return self.experts(x, index, weights / weights.sum(-1, keepdim=True)).view(shape)


class Layer(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, inter, num_experts):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.mlp = MoE(hidden, inter, num_experts) if num_experts else Mlp(hidden, inter)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, vocab, hidden, heads, kv_heads, head_dim, inter, layers, num_experts):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, kv_heads, head_dim, inter, num_experts)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class HFShapedLM(nn.Module):
    base_model_prefix = "model"

    def __init__(self, *, vocab=64, hidden=32, heads=4, kv_heads=4, head_dim=8, inter=32, layers=2,
                 num_experts=0, tie=True):
        super().__init__()
        self.model = Body(vocab, hidden, heads, kv_heads, head_dim, inter, layers, num_experts)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tp_plan(self) -> dict:  # what a transformers model exposes, for plan="auto"
        return lm_plan()

    @property
    def ep_plan(self) -> dict:
        return {f"model.{k}": v for k, v in BASE_EP_PLAN.items()}

    def forward(self, ids):
        return self.lm_head(self.model(ids))


# The plans transformers 5 ships for Qwen3 / Qwen3-MoE (base_model_tp_plan), and its
# causal-LM head and embedding entries.
BASE_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
BASE_EP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "ep_dispatch_experts",
}
LM_PLAN = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}


def lm_plan() -> dict:
    """The model-level plan, as ``model.tp_plan`` of a transformers causal LM is."""
    return {**LM_PLAN, **{f"model.{k}": v for k, v in BASE_TP_PLAN.items()}}


def make_lm(seed: int = 0, **kwargs) -> HFShapedLM:
    torch.manual_seed(seed)
    model = HFShapedLM(**kwargs)
    with torch.no_grad():  # non-trivial norms, so that a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model
