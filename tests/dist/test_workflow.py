"""Issue 6's workflow end to end: train under FSDP x TP, save model and optimizer, resume
under plain TP at another degree, keep training, consolidate, load in one process; the
result equals an uninterrupted one-process run."""

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import shardwise as sw
from harness import run_ranks
from models import fsdp_blocks, make_model, tiny_plan, tokens

LR, WD, MAX_NORM, BATCH = 1e-2, 0.1, 0.5, 4
# The key biases get no gradient (softmax ignores a constant shift), only rounding noise
# (~1e-9) that differs between layouts; Adam's default eps (1e-8) would turn that noise
# into steps of +-lr. With 1e-4 it stays below the tolerance; real gradients are ~1e-3.
EPS = 1e-4


def _batch(step: int):
    return tokens(seed=step, batch=BATCH), tokens(seed=100 + step, batch=BATCH)


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)


def _train(model, optimizer, steps, rows: slice):
    norms = []
    for step in steps:
        x, y = _batch(step)
        _loss(model, x[rows], y[rows]).backward()
        norms.append(sw.clip_grad_norm_(model, MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _workflow(root: str):
    import torch.distributed as dist

    backend = sw.init_backend("gloo")
    # 1. five steps under (dp_shard=2, tp=2): each dp rank trains on its half of the batch
    mesh = backend.mesh(dp_shard=2, tp=2)
    model = make_model()
    sw.parallelize(model, tiny_plan(), mesh)
    fsdp_blocks(model, mesh)
    optimizer = _optimizer(model)
    half = BATCH // 2
    dp = mesh["dp_shard"].get_local_rank()
    norms = _train(model, optimizer, range(5), slice(dp * half, (dp + 1) * half))
    sw.save(model, f"{root}/model-5", distributed=True)
    sw.save_optimizer(model, optimizer, f"{root}/optim-5")

    # 2. resume under tp=4 from a meta model, five more steps on the whole batch
    with torch.device("meta"):
        model = make_model()
    sw.load(model, f"{root}/model-5", plan=tiny_plan(), mesh=backend.mesh(tp=4))
    optimizer = _optimizer(model)
    sw.load_optimizer(model, optimizer, f"{root}/optim-5")
    assert optimizer.param_groups[0]["lr"] == LR
    norms += _train(model, optimizer, range(5, 10), slice(None))
    sw.save(model, f"{root}/model-10", distributed=True)
    dist.barrier()
    if backend.rank == 0:  # one process, no collective
        sw.consolidate(f"{root}/model-10", f"{root}/merged")
    return norms


def test_fsdp_tp_to_tp4_resume_then_consolidate(tmp_path):
    norms = run_ranks(_workflow, 4, str(tmp_path), timeout=180)

    reference = make_model()
    optimizer = _optimizer(reference)
    expected = []
    for step in range(10):
        x, y = _batch(step)
        _loss(reference, x, y).backward()
        expected.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()

    assert min(expected) > MAX_NORM  # clipping is active at every step, so it is tested
    for rank_norms in norms:
        torch.testing.assert_close(rank_norms, expected, rtol=1e-5, atol=0)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    want = reference.state_dict()
    assert set(merged) == set(want)
    start = make_model().state_dict()
    for name, value in want.items():
        assert not torch.equal(value, start[name]), name  # it did train
        torch.testing.assert_close(merged[name], value, rtol=1e-4, atol=1e-5, msg=name)
