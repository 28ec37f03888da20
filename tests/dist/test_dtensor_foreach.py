"""A DTensor-holding model steps with torch's foreach optimizers, the default on CUDA and on
PrivateUse1 devices (TorchNeuron): their ``_foreach_*`` ops refuse a list that mixes DTensor and
plain tensors, so every parameter of a model shardwise parallelised is a DTensor (replicated
ones ``Replicate()``)."""

import torch

import shardwise as sw
from harness import run_ranks
from models import make_model, tiny_plan, tokens


def _step(model, foreach: bool):
    # eps 1e-4: the key biases get only rounding noise as gradient (softmax ignores a shift),
    # which Adam's default eps would turn into steps of +-lr that differ between layouts
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, foreach=foreach)
    model(tokens()).square().mean().backward()
    optimizer.step()


def _foreach_step(world: int):
    from shardwise.validate.checks import expected_local, local_of

    reference = make_model()  # the one-process run, per-tensor loop
    _step(reference, foreach=False)
    backend = sw.init_backend("gloo")
    model = make_model()
    sw.parallelize(model, tiny_plan(), backend.mesh(tp=world))
    kinds = {type(p).__name__ for p in model.parameters()}
    _step(model, foreach=True)  # CUDA's default
    state, want = sw.get_shard_state(model), dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        got, ref = local_of(p), expected_local(want[name].detach(), name, state, p)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=name)
        worst = max(worst, (got - ref).abs().max().item())
    return kinds, worst


def test_adamw_foreach_steps_on_a_dtensor_holding_model():
    for kinds, worst in run_ranks(_foreach_step, 2, 2, timeout=300):
        assert kinds == {"DTensor"}, kinds
        assert worst < 1e-5
