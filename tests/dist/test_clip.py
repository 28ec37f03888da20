"""``sw.clip_grad_norm_`` gives the one-process norm whatever the layout: tp only (DTensor
or plain local shards), FSDP x TP, replicated copies counted once."""

import math

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from harness import run_ranks
from models import fsdp_blocks, make_model, tiny_plan, tokens
from shardwise.core.spec import split
from shardwise.parallel import get_shard_state, local_of

MAX_NORM = 0.05
CASES = [  # (mesh axes on 4 ranks, holding, fsdp, gradients from a backward pass)
    ({"dp_replicate": 2, "tp": 2}, "dtensor", False, True),
    ({"dp_shard": 2, "tp": 2}, "dtensor", True, True),
    ({"dp_replicate": 2, "tp": 2}, "local", False, False),
    ({"tp": 4}, "local", False, False),
    ({"dp_shard": 2, "tp": 2}, "local", True, False),
]


def _loss(model, rows=slice(None)):
    x, y = tokens(seed=3, batch=4), tokens(seed=4, batch=4)
    return F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())


def _set_grads(model, ref_grads):
    """Each parameter's part of the one-process gradient, laid out like the parameter
    (core's split, then torch.chunk for FSDP2's dp shards)."""
    from torch.distributed.tensor import DTensor

    state = get_shard_state(model)
    for name, p in model.named_parameters():
        local = split(ref_grads[name], state.specs[name], state.degree, state.tp_rank)
        if type(p).__name__ == "DTensor":
            if "dp_shard" in (p.device_mesh.mesh_dim_names or ()):
                dp = p.device_mesh["dp_shard"]
                local = torch.chunk(local, dp.size(), dim=0)[dp.get_local_rank()].clone()
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        else:
            p.grad = local


def _clip_everywhere(norm_type: float):
    backend = sw.init_backend("gloo")
    reference = make_model()
    _loss(reference).backward()
    unclipped = {n: p.grad.clone() for n, p in reference.named_parameters()}
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type)
    assert want > MAX_NORM  # so clipping scales the gradients
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    results = []
    for axes, holding, fsdp, backward in CASES:
        mesh = backend.mesh(**axes)
        model = make_model()
        sw.parallelize(model, tiny_plan(), mesh, holding=holding)
        rows = slice(None)
        if fsdp:
            fsdp_blocks(model, mesh)
            dp = mesh["dp_shard"].get_local_rank()
            rows = slice(2 * dp, 2 * dp + 2)  # FSDP averages the two halves' gradients
        if backward:
            _loss(model, rows).backward()
        else:
            _set_grads(model, unclipped)
        got = sw.clip_grad_norm_(model, MAX_NORM, norm_type)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=str((axes, holding)))
        again = sw.clip_grad_norm_(list(model.parameters()) if holding == "dtensor" else model,
                                   MAX_NORM, norm_type)
        torch.testing.assert_close(again, torch.tensor(MAX_NORM), rtol=1e-4, atol=0)
        if not fsdp:  # the clipped shard is the clipped one-process gradient's part
            state = get_shard_state(model)
            name = "single.0.proj_in.weight"
            p = dict(model.named_parameters())[name]
            expected = split(ref_grads[name], state.specs[name], state.degree, state.tp_rank)
            torch.testing.assert_close(local_of(p.grad), expected, rtol=1e-4, atol=1e-7)
        results.append(got.item())
    return results


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_global_norm_equals_one_process(norm_type):
    results = run_ranks(_clip_everywhere, 4, norm_type, timeout=120)
    assert all(r == results[0] for r in results)  # the same norm on every rank
