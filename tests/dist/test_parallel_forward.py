"""The forward under tensor parallelism equals the one-process forward, in both holding modes."""

import pytest
import torch

import shardwise as sw
from shardwise.parallel import local_of
from harness import run_ranks
from models import make_model, tiny_plan, tokens


def _forward(degree: int, holding: str, embedding: str):
    backend = sw.init_backend("gloo")
    reference = make_model()(tokens())
    model = make_model()
    sw.parallelize(model, tiny_plan(embedding), backend.mesh(tp=degree), holding=holding)
    state = sw.get_shard_state(model)
    assert (state.degree, state.holding) == (degree, holding)
    # parameters really are sharded: a packed local shard is 1/degree of the canonical rows
    w = model.single[0].proj_in.weight
    local = w.to_local() if holding == "dtensor" else w
    assert local.shape[0] == 288 // degree
    assert (type(w).__name__ == "DTensor") == (holding == "dtensor")
    with torch.no_grad():
        out = model(tokens())
    torch.testing.assert_close(out, reference.detach(), rtol=1e-5, atol=1e-5)
    # one training step's gradients flow through the collectives in both modes
    model(tokens()).sum().backward()
    g = model.layers[0].attn.o.weight.grad
    assert g is not None and torch.isfinite(local_of(g)).all()
    return True


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_forward_matches_one_process(degree, holding):
    assert run_ranks(_forward, degree, degree, holding, "embedding_rowwise") == [True] * degree


@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_dim_parallel_embedding(holding):
    assert run_ranks(_forward, 2, 2, holding, "embedding_colwise") == [True] * 2


def _degree_one():
    backend = sw.init_backend("gloo")
    model = make_model()
    ref = model(tokens())
    sw.parallelize(model, tiny_plan(), backend.mesh(tp=1))
    torch.testing.assert_close(model(tokens()), ref, rtol=1e-6, atol=1e-6)
    return True


def test_degree_one_is_identity():
    assert run_ranks(_degree_one, 1) == [True]
