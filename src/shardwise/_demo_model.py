"""The transformer ``shardwise demo`` streams: a small decoder with every common TP style.

Each block has a fused q|k|v projection (packed colwise [1, 1, 1]), an attention output
(rowwise), a SwiGLU with fused gate|up (packed colwise [1, 1]) and a down projection
(rowwise); the embedding is split over the vocabulary and the head gathers its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.core.styles import PackedColwise


@dataclass(frozen=True)
class DemoConfig:
    vocab: int
    hidden: int
    heads: int
    ffn: int
    num_layers: int


# Head counts and widths divide by 1, 2, 4 and 8.
SIZES = {
    "tiny": DemoConfig(vocab=512, hidden=64, heads=8, ffn=128, num_layers=2),      # ~0.5 MB fp32
    "small": DemoConfig(vocab=8192, hidden=512, heads=8, ffn=1024, num_layers=4),  # ~76 MB fp32
    "medium": DemoConfig(vocab=16384, hidden=1024, heads=8, ffn=2816, num_layers=8),  # ~550 MB fp32
}

PLAN = {
    "embed": "embedding_rowwise",
    "layers.*.attn.qkv": PackedColwise([1, 1, 1]),
    "layers.*.attn.out": "rowwise",
    "layers.*.mlp.gate_up": PackedColwise([1, 1]),
    "layers.*.mlp.down": "rowwise",
    "head": "colwise_gather_output",
}


class _Attention(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.num_heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # local q|k|v: the packed blocks keep them apart
        # -1 heads: under tensor parallelism each rank holds heads / degree of them.
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class _SwiGLU(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class _Block(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden)
        self.attn = _Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden)
        self.mlp = _SwiGLU(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DemoTransformer(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm_out = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm_out(x))


def config_for(size: str) -> DemoConfig:
    try:
        return SIZES[size]
    except KeyError:
        raise ValueError(f"unknown demo size {size!r}; choose one of {', '.join(SIZES)}") from None


def build(size: str, *, seed: int | None = 0, device: str | torch.device | None = None) -> DemoTransformer:
    """The demo model; ``device="meta"`` builds it without memory (for ``sw.load``)."""
    cfg = config_for(size)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return DemoTransformer(cfg)


def demo_tokens(size: str, batch: int = 2, length: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, config_for(size).vocab, (batch, length), generator=g)
