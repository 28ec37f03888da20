"""Small real models for the tests: every style shardwise supports appears once or more.

``TinyTransformer`` has separate q/k/v/out projections with biases, a fused qkv (packed
[1, 1, 1]), SwiGLU MLPs with packed gate|up ([1, 1]), a single-stream block whose fused
projection is packed colwise [1, 1, 1, 3, 3] and whose output projection is packed rowwise
[1, 3] (block sizes set on the modules in ``__init__``, as diffusers does), a modulation
projection reading a replicated input (rowwise_split_input), layer norms, an embedding
and an untied head. Shapes divide by 1, 2 and 4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, fused: bool):
        super().__init__()
        self.num_heads = heads
        self.head_dim = hidden // heads
        self.fused = fused
        if fused:
            self.qkv = nn.Linear(hidden, 3 * hidden)
        else:
            self.q = nn.Linear(hidden, hidden)
            self.k = nn.Linear(hidden, hidden)
            self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, _ = x.shape
        if self.fused:
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # local q|k|v: packed blocks keep them apart
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        # -1 heads: under tensor parallelism each rank holds num_heads / degree of them
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, fused: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, fused)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = SwiGLU(hidden, ffn)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SingleStreamBlock(nn.Module):
    """Attention and MLP from one fused projection, merged by one output projection."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 3):
        super().__init__()
        self.num_heads, self.head_dim, self.hidden = heads, hidden // heads, hidden
        self.norm = nn.LayerNorm(hidden)
        self.modulation = nn.Linear(hidden, hidden)
        self.proj_in = nn.Linear(hidden, (3 + 2 * mlp_ratio) * hidden)
        self.proj_in._tp_packed_col_blocks = [1, 1, 1, mlp_ratio, mlp_ratio]
        self.proj_out = nn.Linear((1 + mlp_ratio) * hidden, hidden)
        self.proj_out._tp_packed_row_blocks = [1, mlp_ratio]
        self.mlp_ratio = mlp_ratio

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x) + self.modulation(x)
        fused = self.proj_in(h)
        local = fused.shape[-1] // (3 + 2 * self.mlp_ratio)
        q, k, v, gate, up = fused.split([local] * 3 + [self.mlp_ratio * local] * 2, dim=-1)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return x + self.proj_out(torch.cat([attn, F.silu(gate) * up], dim=-1))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, ffn: int = 64,
                 num_layers: int = 1, num_fused: int = 1, num_single: int = 1):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, ffn, fused=False) for _ in range(num_layers))
        self.fused = nn.ModuleList(Block(hidden, heads, ffn, fused=True) for _ in range(num_fused))
        self.single = nn.ModuleList(SingleStreamBlock(hidden, heads) for _ in range(num_single))
        self.norm_out = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in [*self.layers, *self.fused, *self.single]:
            x = block(x)
        return self.head(self.norm_out(x))


def tiny_plan(embedding: str = "embedding_rowwise") -> dict:
    """Every style once: ``embedding`` is "embedding_rowwise" (vocab) or "embedding_colwise" (dim)."""
    return {
        "embed": embedding,
        "layers.*.attn.q": "colwise",
        "layers.*.attn.k": "colwise",
        "layers.*.attn.v": "colwise",
        "layers.*.attn.o": "rowwise",
        "layers.*.mlp.gate_up": sw.PackedColwise([1, 1]),
        "layers.*.mlp.down": "rowwise",
        "fused.*.attn.qkv": sw.PackedColwise([1, 1, 1]),
        "fused.*.attn.o": "rowwise",
        "fused.*.mlp.gate_up": "packed_colwise",
        "fused.*.mlp.down": "rowwise",
        "single.*.modulation": "rowwise_split_input",
        "single.*.proj_in": sw.PackedColwise(),
        "single.*.proj_out": sw.PackedRowwise(),
        "head": "colwise_gather_output",
    }


def make_model(seed: int = 0, **kwargs) -> TinyTransformer:
    torch.manual_seed(seed)
    model = TinyTransformer(**kwargs)
    with torch.no_grad():  # non-trivial norms and biases, so that a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def fsdp_blocks(model: TinyTransformer, mesh) -> TinyTransformer:
    """FSDP2 over ``mesh["dp_shard"]``: each block, then the model (how users wrap it)."""
    from torch.distributed.fsdp import fully_shard

    for block in [*model.layers, *model.fused, *model.single]:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model


def tokens(seed: int = 1, batch: int = 2, length: int = 5, vocab: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def assert_exact_shards(model: nn.Module, mesh) -> None:
    """Every tensor of ``model`` (a :func:`make_model` loaded on ``mesh``'s tp axis) is bit for bit
    this rank's split of :func:`make_model`'s own tensor."""
    from shardwise.core.spec import split
    from shardwise.parallel import get_shard_state, local_of

    canonical, state = make_model().state_dict(), get_shard_state(model)
    tp, tp_rank = mesh["tp"].size(), mesh["tp"].get_local_rank()
    for name, t in model.state_dict().items():
        want, got = split(canonical[name], state.specs[name], tp, tp_rank), local_of(t)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
