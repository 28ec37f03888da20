"""An optimizer over a dtensor-held model: replicated parameters stay plain tensors beside the
DTensor shards, and torch's foreach kernels (every optimizer's default on a GPU) refuse that mix.
Forced here on gloo ranks (the CPU default is the per-tensor loop, which hides it), as the H200
run of ``shardwise validate --backend nccl`` showed it: a plain ``step()`` raises, and a step under
torch's ``implicit_replication()`` (the recipe docs/guide.md gives) equals the per-tensor loop."""

import pytest
import torch
from torch.distributed.tensor.experimental import implicit_replication

import shardwise as sw
from harness import run_ranks
from shardwise.testing.model import batch, build, loss_of, tp_plan


def _train(folder: str, foreach: bool, implicit: bool) -> dict:
    backend = sw.init_backend("gloo")
    with torch.device("meta"):
        model = build(None)
    sw.load(model, folder, plan=tp_plan(), mesh=backend.mesh(tp=2))
    kinds = {type(p).__name__ for p in model.parameters()}
    assert kinds == {"DTensor", "Parameter"}, kinds  # the mix this test is about
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    for step in range(2):
        ids, targets = batch(step)
        loss_of(model(ids), targets).backward()
        if implicit:
            with implicit_replication():
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad()
    # numpy arrays: tensors would cross the spawn queue as shared memory the exiting rank frees
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()
            for n, p in model.named_parameters()}


def _plain_foreach_step(folder: str) -> str:
    try:
        _train(folder, foreach=True, implicit=False)
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("foreach") / "ckpt"
    sw.save(build(0), folder)
    return str(folder)


def test_a_plain_foreach_step_refuses_the_mix(checkpoint):
    errors = run_ranks(_plain_foreach_step, 2, checkpoint)
    assert all("mixed torch.Tensor and DTensor" in e for e in errors), errors


def test_foreach_under_implicit_replication_equals_the_loop(checkpoint):
    loop = run_ranks(_train, 2, checkpoint, False, False)[0]
    fused = run_ranks(_train, 2, checkpoint, True, True)[0]
    start = build(0).state_dict()
    assert loop.keys() == fused.keys()
    for name in loop:
        assert not torch.equal(torch.from_numpy(loop[name]), start[name]), f"{name} did not move"
        assert torch.equal(torch.from_numpy(loop[name]), torch.from_numpy(fused[name])), name


def _save_and_resume(folder: str, optim_folder: str) -> list[str]:
    """Step, save the optimizer, load it into a fresh foreach optimizer: torch initialises the
    fresh one's state by stepping it, which is where the H200 run failed inside load_optimizer."""
    backend = sw.init_backend("gloo")
    with torch.device("meta"):
        model = build(None)
    sw.load(model, folder, plan=tp_plan(), mesh=backend.mesh(tp=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ids, targets = batch(0)
    loss_of(model(ids), targets).backward()
    with implicit_replication():
        optimizer.step()
    sw.save_optimizer(model, optimizer, optim_folder)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    sw.load_optimizer(model, fresh, optim_folder)
    wrong = []
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = optimizer.state[p][key], fresh.state[p][key]
            a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (a, b))
            if not torch.equal(a, b):
                wrong.append(f"{name}.{key}")
        if float(fresh.state[p]["step"]) != 1.0:
            wrong.append(f"{name}.step")
    return wrong


def test_load_optimizer_into_a_fresh_foreach_optimizer(checkpoint, tmp_path):
    wrong = run_ranks(_save_and_resume, 2, checkpoint, str(tmp_path / "optim"))
    assert wrong == [[], []], wrong
