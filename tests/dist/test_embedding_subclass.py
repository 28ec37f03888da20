"""An nn.Embedding subclass whose forward adds to the lookup (Inkling's embedding norm, Gemma's
scale), sharded by vocab or by dim in both holdings: its own forward runs on the whole
embedding, and one that reads the sharded weight itself is refused, never silently wrong."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from harness import run_ranks
from shardwise.core.spec import split
from shardwise.parallel import get_shard_state


class NormedEmbedding(nn.Embedding):
    def __init__(self):
        super().__init__(64, 16)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, ids):
        x = super().forward(ids)  # a norm over the features: wrong on partial sums or on a slice
        return self.scale * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class OwnLookup(nn.Embedding):
    def __init__(self):
        super().__init__(64, 16)

    def forward(self, ids):  # reads the weight itself: with a vocab shard, wrong rows
        return F.embedding(ids, self.weight) * 2.0


def _model(cls, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict({"embed": cls(), "head": nn.Linear(16, 8)})


def _forward(model, ids):
    return model["head"](model["embed"](ids))


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if type(t).__name__ == "DTensor" else t


def _normed(holding: str, style: str) -> bool:
    backend = sw.init_backend("gloo")
    reference = _model(NormedEmbedding)
    want = _forward(reference, _ids())
    want.square().sum().backward()
    model = _model(NormedEmbedding)
    sw.parallelize(model, {"embed": style}, backend.mesh(tp=2), holding=holding)
    got = _forward(model, _ids())
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    state = get_shard_state(model)
    spec = state.specs["embed.weight"]
    want_grad = split(reference["embed"].weight.grad, spec, *state.coords(spec))
    torch.testing.assert_close(_local(model["embed"].weight.grad), want_grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_local(model["embed"].scale.grad), reference["embed"].scale.grad,
                               rtol=1e-4, atol=1e-5)
    assert isinstance(model["embed"], NormedEmbedding)  # still the model's own class for users
    return True


@pytest.mark.parametrize("holding", ["dtensor", "local"])
@pytest.mark.parametrize("style", ["embedding_rowwise", "embedding_colwise"])
def test_an_embedding_subclass_runs_its_forward_on_the_whole_embedding(holding, style):
    assert run_ranks(_normed, 2, holding, style) == [True, True]


def _own_lookup(holding: str) -> str:
    backend = sw.init_backend("gloo")
    model = _model(OwnLookup)
    sw.parallelize(model, {"embed": "embedding_rowwise"}, backend.mesh(tp=2), holding=holding)
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(5))  # in every shard's range
    try:
        _forward(model, ids)
    except sw.errors.UnsupportedModelError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_a_subclass_that_reads_the_sharded_weight_itself_is_refused(holding):
    for message in run_ranks(_own_lookup, 2, holding):
        assert "does not call nn.Embedding.forward" in message, message
