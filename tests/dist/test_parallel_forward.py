"""Forward and gradients under tensor parallelism equal one process, in both holding modes."""

import pytest
import torch

import shardwise as sw
from harness import run_ranks
from models import make_model, tiny_plan, tokens
from shardwise.core.spec import split
from shardwise.holding import Holding
from shardwise.parallel import get_shard_state


def _loss(out: torch.Tensor) -> torch.Tensor:
    # a non-uniform upstream gradient, so that a misplaced shard of it shows
    weights = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)
    return (out * weights).sum()


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    if type(g).__name__ == "DTensor":  # bring it to the parameter's own placement first
        g = g.redistribute(p.device_mesh, p.placements).to_local()
    return g


def _forward_and_grads(degree: int, holding: str, embedding: str):
    backend = sw.init_backend("gloo")
    plan = tiny_plan(embedding)
    reference = make_model()
    ref_out = reference(tokens())
    _loss(ref_out).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    model = make_model()
    sw.parallelize(model, plan, backend.mesh(tp=degree), holding=holding)
    state = get_shard_state(model)
    assert (state.degree, state.holding) == (degree, Holding.parse(holding))
    # parameters really are sharded: a packed local shard is 1/degree of the canonical rows
    w = model.single[0].proj_in.weight
    assert (type(w).__name__ == "DTensor") == (holding == "dtensor")
    assert (w.to_local() if holding == "dtensor" else w).shape[0] == 288 // degree

    out = model(tokens())
    torch.testing.assert_close(out, ref_out.detach(), rtol=1e-5, atol=1e-5)
    _loss(out).backward()
    rank = state.tp_rank
    for name, p in model.named_parameters():
        spec = state.specs[name]
        expected = ref_grads[name] if spec.replicated else split(ref_grads[name], spec, degree, rank)
        torch.testing.assert_close(_local_grad(p), expected, rtol=1e-4, atol=1e-5, msg=name)
    return True


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_forward_and_gradients_match_one_process(degree, holding):
    assert run_ranks(_forward_and_grads, degree, degree, holding, "embedding_rowwise") == [True] * degree


@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_dim_parallel_embedding(holding):
    assert run_ranks(_forward_and_grads, 2, 2, holding, "embedding_colwise") == [True] * 2


def _degree_one():
    backend = sw.init_backend("gloo")
    model = make_model()
    ref = model(tokens())
    sw.parallelize(model, tiny_plan(), backend.mesh(tp=1))
    torch.testing.assert_close(model(tokens()), ref, rtol=1e-6, atol=1e-6)
    return True


def test_degree_one_is_identity():
    assert run_ranks(_degree_one, 1) == [True]
