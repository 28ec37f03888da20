"""Gradients under FSDP2 x tensor parallelism equal one process, parameter by parameter.

The validation model's plan has ``replicated_with_grad_allreduce`` norms (Qwen3's ``q_norm`` /
``k_norm``): each tp rank's gradient covers its own heads and must be summed over tp. That
sum once lived in a hook on the Parameter, which ``fully_shard`` replaces by its own, so under
mesh(dp_shard=2, tp=2) the norms' gradients were one tp rank's part (off by ~5e-3) while
every other parameter was right. The sum must also happen once per backward: accumulating
two micro-batches must not sum the first one over tp again.
"""

import pytest
import torch

import shardwise as sw
from harness import run_ranks
from shardwise.parallel import get_shard_state
from shardwise.validate.checks import expected_local, local_grad
from shardwise.testing.model import TP_PLAN, batch, build, loss_of

# The TP-only run differs from one process by ~3e-9; the bug by ~5e-3.
RTOL, ATOL = 1e-5, 1e-7


def _reference(rows: slice, steps: int) -> dict[str, torch.Tensor]:
    model = build()
    for step in range(steps):
        ids, targets = batch(step)
        loss_of(model(ids[rows]), targets[rows]).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _compare(model, want: dict[str, torch.Tensor]) -> list[str]:
    """Every parameter's gradient against this rank's part of the one-process gradient (its tp
    shard, then its FSDP2 chunk); the names of those that differ, with their largest difference."""
    state = get_shard_state(model)
    bad, seen = [], set()
    for name, p in model.named_parameters():
        seen.add(name)
        got = local_grad(p)
        assert got is not None, f"{name}: no gradient"
        full = expected_local(want[name], name, state, p)
        if got.shape != full.shape or not torch.allclose(got, full, rtol=RTOL, atol=ATOL):
            diff = (got - full).abs().max().item() if got.shape == full.shape else tuple(got.shape)
            bad.append(f"{name}: {diff}")
    assert seen == set(want), sorted(set(want) - seen)
    return bad


def _fsdp_tp_grads(holding: str):
    from torch.distributed.fsdp import fully_shard

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(dp_shard=2, tp=2)
    # each dp_shard rank trains on its own half of the batch; FSDP2 averages over dp_shard,
    # which is the gradient of the whole batch (the mean loss over equal halves)
    dp = mesh["dp_shard"].get_local_rank()
    want = _reference(slice(None), 1)
    model = sw.parallelize(build(), TP_PLAN, mesh, holding=holding)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    ids, targets = batch(0)
    rows = slice(2 * dp, 2 * dp + 2)
    loss_of(model(ids[rows]), targets[rows]).backward()
    q_norm = model.model.layers[0].self_attn.q_norm.weight
    assert type(q_norm).__name__ == "DTensor", "fully_shard did not take the norm"
    return _compare(model, want)


@pytest.mark.slow
@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_every_gradient_matches_one_process_under_fsdp_and_tp(holding):
    assert run_ranks(_fsdp_tp_grads, 4, holding, timeout=240) == [[]] * 4


def _accumulated_grads(holding: str):
    backend = sw.init_backend("gloo")
    want = _reference(slice(None), 2)
    model = sw.parallelize(build(), TP_PLAN, backend.mesh(tp=2), holding=holding)
    for step in range(2):  # two micro-batches, no zero_grad between them
        ids, targets = batch(step)
        loss_of(model(ids), targets).backward()
    return _compare(model, want)


@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_accumulated_gradients_match_one_process(holding):
    assert run_ranks(_accumulated_grads, 2, holding, timeout=120) == [[]] * 2


def _sequence_parallel_grads(holding: str):
    backend = sw.init_backend("gloo")
    want = _reference(slice(None), 1)
    # transformers' sequence_parallel style on the input norms: shardwise runs it on the whole
    # sequence, so its gradient is whole on every rank already (it was summed over tp: 2x)
    plan = dict(TP_PLAN, **{"model.layers.*.input_layernorm": "sequence_parallel"})
    model = sw.parallelize(build(), plan, backend.mesh(tp=2), holding=holding)
    ids, targets = batch(0)
    loss_of(model(ids), targets).backward()
    return _compare(model, want)


@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_sequence_parallel_norm_gradients_match_one_process(holding):
    assert run_ranks(_sequence_parallel_grads, 2, holding, timeout=120) == [[]] * 2
