"""Every mesh layout FSDP2 and tensor parallelism produce on 4 ranks (issue 20, section 2):
train, save model and optimizer, resume in a fresh model and optimizer, keep training; the
resumed run equals the uninterrupted one exactly, both follow the one-process run, and the
checkpoint consolidates to the one-process weights. A mesh without a tp axis loads the model
whole (never the TP plan over another axis), ready for ``fully_shard``.

All layouts run in one spawn of 4 ranks (a spawn costs seconds on a small machine); each
layout's outcome is reported by its own parametrized test.
"""

import traceback

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import shardwise as sw
from harness import run_ranks
from models import make_model, tiny_plan, tokens
from shardwise.parallel import local_of

# name -> mesh axes on 4 ranks, and whether the resumed run holds gradients (its first step's
# backward already done) when load_optimizer runs: torch skips building a fresh optimizer's
# state when gradients exist, which load_optimizer must handle.
LAYOUTS = {
    "dp_shard4": ({"dp_shard": 4}, True),
    "dp_replicate2_dp_shard2": ({"dp_replicate": 2, "dp_shard": 2}, False),
    "dp_shard4_tp1": ({"dp_shard": 4, "tp": 1}, False),
    "dp_shard2_tp2": ({"dp_shard": 2, "tp": 2}, True),
    "dp_shard1_tp4": ({"dp_shard": 1, "tp": 4}, False),
}
LR, WD, BATCH, SAVE_AT, STEPS = 1e-2, 0.1, 4, 3, 5
EPS = 1e-4  # as in test_workflow: Adam's 1e-8 would turn rounding noise into steps of +-lr


def _batch(step: int):
    return tokens(seed=step, batch=BATCH), tokens(seed=100 + step, batch=BATCH)


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)


def _fsdp(model, mesh):
    """FSDP2 over the data-parallel axes: each block, then the model."""
    from torch.distributed.fsdp import fully_shard

    names = mesh.mesh_dim_names
    dp = mesh if "tp" not in names else mesh["dp_shard"]  # (dp_replicate, dp_shard): HSDP
    for block in [*model.layers, *model.fused, *model.single]:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _rows(mesh) -> slice:
    """This rank's rows of the batch: ranks that differ only in tp train on the same rows."""
    dp_axes = [a for a in mesh.mesh_dim_names if a != "tp"]
    index, num = 0, 1
    for axis in dp_axes:
        index, num = index * mesh[axis].size() + mesh[axis].get_local_rank(), num * mesh[axis].size()
    n = BATCH // num
    return slice(index * n, (index + 1) * n)


def _steps(model, optimizer, steps, rows: slice, *, first_loss=None) -> list[float]:
    """Train ``steps``; each returns the loss averaged over the world, which is the loss of
    the whole batch (every data-parallel group of ranks trains on as many rows).
    ``first_loss``: the first step's forward and backward are done already, with that loss."""
    import torch.distributed as dist

    losses = []
    for i, step in enumerate(steps):
        if i == 0 and first_loss is not None:
            loss = first_loss
        else:
            x, y = _batch(step)
            loss = _loss(model, x[rows], y[rows])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _local_params(model) -> dict[str, torch.Tensor]:
    return {n: local_of(p).detach().clone() for n, p in model.named_parameters()}


def _check_whole(model, axes: dict) -> None:
    """On a mesh without a tp axis nothing is tensor parallel: every parameter is whole, a
    plain tensor (never the TP plan over a data axis), so that fully_shard can take it."""
    if "tp" in axes:
        return
    whole = make_model().state_dict()
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and p.shape == whole[name].shape, name


def _layout(root: str, backend, axes: dict, grads_first: bool):
    mesh = backend.mesh(**axes)
    rows = _rows(mesh)
    model = sw.parallelize(make_model(), tiny_plan(), mesh)
    _check_whole(model, axes)
    _fsdp(model, mesh)
    if axes.get("tp") == 1:  # the layout at stake: FSDP2 places a plain S(0) before tp=1
        from torch.distributed.tensor import Shard

        assert any(tuple(p.placements) == (Shard(0), Shard(0)) for p in model.parameters())
    optimizer = _optimizer(model)
    losses = _steps(model, optimizer, range(SAVE_AT), rows)
    sw.save(model, f"{root}/model", distributed=True)
    sw.save_optimizer(model, optimizer, f"{root}/optim")
    uninterrupted = losses + _steps(model, optimizer, range(SAVE_AT, STEPS), rows)
    want = _local_params(model)

    with torch.device("meta"):
        resumed = make_model()
    sw.load(resumed, f"{root}/model", plan=tiny_plan(), mesh=mesh)
    _check_whole(resumed, axes)
    _fsdp(resumed, mesh)
    optimizer = _optimizer(resumed)
    first_loss = None
    if grads_first:  # the first resumed step's backward before the optimizer state is loaded
        x, y = _batch(SAVE_AT)
        first_loss = _loss(resumed, x[rows], y[rows])
        first_loss.backward()
    sw.load_optimizer(resumed, optimizer, f"{root}/optim")
    after = _steps(resumed, optimizer, range(SAVE_AT, STEPS), rows, first_loss=first_loss)
    got = _local_params(resumed)
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name}: the resumed run differs from the uninterrupted one"
    assert after == uninterrupted[SAVE_AT:], (after, uninterrupted)
    return uninterrupted


def _all_layouts(root: str):
    backend = sw.init_backend("gloo")
    out = {}
    for name, (axes, grads_first) in LAYOUTS.items():
        try:  # every rank fails alike (a refusal, a torch error): report it, go on to the next
            out[name] = _layout(f"{root}/{name}", backend, axes, grads_first)
        except Exception:
            out[name] = traceback.format_exc()
    return out


def _reference():
    """The one-process run: losses of every step, and the weights when the checkpoint was saved."""
    model = make_model()
    optimizer = _optimizer(model)
    losses, saved = [], None
    for step in range(STEPS):
        if step == SAVE_AT:
            saved = {n: t.clone() for n, t in model.state_dict().items()}
        x, y = _batch(step)
        loss = _loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, saved


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    results = run_ranks(_all_layouts, 4, str(root), timeout=300)
    return root, results, _reference()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_and_resume_equal_the_uninterrupted_run(runs, layout):
    root, results, (losses, saved) = runs
    for rank, result in enumerate(results):
        assert not isinstance(result[layout], str), f"rank {rank}:\n{result[layout]}"
        torch.testing.assert_close(result[layout], losses, rtol=1e-5, atol=0)
    assert losses[-1] < losses[0]  # it did train
    merged = sw.consolidate(root / layout / "model", root / f"merged-{layout}")  # one process
    merged = load_file(merged / "model.safetensors")
    assert set(merged) == set(saved)
    for name, value in saved.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-4, atol=1e-5, msg=name)
