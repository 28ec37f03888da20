"""The one toy transformer: what every backend validates on, what ``shardwise demo`` streams.
By default a small Qwen3-MoE-shaped causal LM (16 heads over 8 KV heads, q/k norms, one dense
and one 16-expert MoE layer) with transformers' plans; :func:`golden` is the CPU reference."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import UsageError


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 128
    hidden: int = 64
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 4
    inter: int = 64          # the dense layer's SwiGLU width
    expert_inter: int = 16   # each expert's SwiGLU width
    num_experts: int = 16
    top_k: int = 2
    moe_layers: tuple[bool, ...] = (False, True)  # per layer: an MoE layer (True) or dense SwiGLU
    tie: bool = False  # lm_head tied to the embedding
    qk_norm: bool = True  # q_norm / k_norm on the head dim (Qwen3); False: Llama-like
    fused_gate_up: bool = False  # the dense SwiGLU as one packed gate_up_proj (Phi-3), not gate|up

    def to_dict(self) -> dict:
        return asdict(self)


CONFIG = ModelConfig()
MAX_TP = CONFIG.kv_heads  # each rank must own whole KV heads

# The demo's sizes; their KV heads and widths divide by 1, 2, 4 and 8
SIZES = {
    "tiny": CONFIG,                                                                  # ~0.5 MB fp32
    "small": ModelConfig(vocab=8192, hidden=512, head_dim=32, inter=1024, expert_inter=128,
                         moe_layers=(False, True, False, True)),                     # ~80 MB fp32
    "medium": ModelConfig(vocab=16384, hidden=1024, head_dim=64, inter=2816, expert_inter=256,
                          moe_layers=(False, True) * 4),                              # ~0.6 GB fp32
}


def config_for(size: str) -> ModelConfig:
    try:
        return SIZES[size]
    except KeyError:
        raise UsageError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}") from None

TP_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts",
    "lm_head": "colwise_gather_output",
}
EP_PLAN = {
    "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
    "model.layers.*.mlp.experts": "ep_dispatch_experts",
}


def tp_plan(config: ModelConfig = CONFIG) -> dict:
    """:data:`TP_PLAN` for the modules a toy of ``config`` has."""
    absent: tuple[str, ...] = ()
    if not config.qk_norm:
        absent += (".q_norm", ".k_norm")
    if not any(config.moe_layers):
        absent += (".experts", ".experts.gate_up_proj", ".experts.down_proj")
    if config.fused_gate_up:
        absent += (".mlp.gate_proj", ".mlp.up_proj")
    plan = {k: v for k, v in TP_PLAN.items() if not k.endswith(absent)}
    return {**plan, "model.layers.*.mlp.gate_up_proj": "packed_colwise"} if config.fused_gate_up else plan


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_key_value_heads = cfg.heads, cfg.kv_heads  # read by the plan checks
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        norm = nn.RMSNorm if cfg.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(cfg.head_dim), norm(cfg.head_dim)

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / degree of them
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, hidden: int, inter: int, fused: bool = False):
        super().__init__()
        if fused:  # packed [gate; up]: a colwise shard holds its part of each
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=False)
            self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.fused = fused

    def forward(self, x):
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    """Fused expert weights as transformers holds them; every token goes through every local
    expert, weighted 0 where not routed (static shapes: one XLA graph)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(cfg.num_experts, 2 * cfg.expert_inter, cfg.hidden) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(cfg.num_experts, cfg.hidden, cfg.expert_inter) * 0.1)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            weight = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, self.down_proj[e]) * weight
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = torch.topk(self.gate(x).softmax(-1), self.top_k, dim=-1)
        return self.experts(x, index, weights / weights.sum(-1, keepdim=True)).view(shape)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden)
        self.mlp = MoE(cfg) if moe else Mlp(cfg.hidden, cfg.inter, cfg.fused_gate_up)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList([Layer(cfg, moe=moe) for moe in cfg.moe_layers])
        self.norm = nn.RMSNorm(cfg.hidden)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class ToyLM(nn.Module):
    base_model_prefix = "model"

    def __init__(self, cfg: ModelConfig = CONFIG):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tp_plan(self) -> dict:  # as a transformers causal LM exposes it, for plan="auto"
        return tp_plan(self.config)

    @property
    def ep_plan(self) -> dict:
        return dict(EP_PLAN)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def build(seed: int | None = 0, *, device: str | torch.device | None = None,
          config: ModelConfig = CONFIG) -> ToyLM:
    """The model with weights from ``seed`` (None: torch's random state; ``device="meta"``: no
    memory). Norm weights are moved off 1 so that a misplaced one shows."""
    if str(device) == "meta":
        with torch.device("meta"):
            return ToyLM(config)
    if seed is not None:
        torch.manual_seed(seed)
    model = ToyLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def canonical(seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's tensors as an ordinary checkpoint holds them."""
    return {k: v.detach().contiguous() for k, v in build(seed).state_dict().items()}


def tokens(config: ModelConfig = CONFIG, *, batch: int = 2, length: int = 16) -> torch.Tensor:
    """Token ids for a forward check (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, config.vocab, (batch, length), generator=g)


def batch(step: int, *, size: int = 4, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets of training step ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, CONFIG.vocab, (size, length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# AdamW as the suite steps it. eps 1e-4, not the default 1e-8: parameters whose true gradient
# is ~0 get rounding noise (~1e-9) that differs between layouts, which eps=1e-8 would turn into
# steps of +-lr; real gradients here are ~1e-3, far above it.
LR, WEIGHT_DECAY, EPS, MAX_NORM = 1e-2, 0.1, 1e-4, 0.5


def optimizer_for(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)


@dataclass
class Golden:
    """The one-process CPU run of two AdamW steps, and what the suite compares along the way."""

    logits: torch.Tensor
    loss: float
    grads: dict[str, torch.Tensor]
    norm: float
    clipped: dict[str, torch.Tensor]
    after_step: dict[str, torch.Tensor]
    optim_state: dict[str, dict[str, torch.Tensor]]
    after_two_steps: dict[str, torch.Tensor]


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # every parameter of this model takes part in the loss
    return p.grad.clone()


def golden() -> Golden:
    model = build()
    optimizer = optimizer_for(model.parameters())
    ids, targets = batch(0)
    logits = model(ids)
    loss = loss_of(logits, targets)
    loss.backward()
    grads = {n: _grad(p) for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    clipped = {n: _grad(p) for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items() if torch.is_tensor(v) and v.dim()}
             for p, s in optimizer.state.items()}
    ids, targets = batch(1)
    loss_of(model(ids), targets).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    two = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Golden(logits.detach(), loss.item(), grads, norm, clipped, after, state, two)
