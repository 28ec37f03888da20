"""``sw.save_optimizer`` / ``sw.load_optimizer`` over a real object store (``s3://`` on
SeaweedFS, ``gs://`` on fake-gcs-server, behind the tests' proxy): Adam's state after a step on
two gloo ranks at tp=2 (local holding), saved into the store and into a local folder, reloaded at tp=2 and at
tp=1 (two replicas) from both; the states equal each other and the state that was saved.

(The model's distributed checkpoint reloading at another degree from either store is
test_end_to_end's, which the ``remote`` fixture runs over both.)"""

from __future__ import annotations

import os

import torch

import shardwise as sw
from models import make_model, tiny_plan
from shardwise.core.spec import split
from shardwise.parallel import get_shard_state, local_of
from shardwise.testing import spawn


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _state(optimizer) -> dict:
    """Every state tensor by (parameter index, name), as this rank holds it (its shard)."""
    return {(i, k): local_of(v).detach().clone() for i, s in enumerate(optimizer.state.values())
            for k, v in s.items()}


def _stepped(model, tp: int, tp_rank: int, seed: int = 5, lr: float = 0.01) -> torch.optim.Optimizer:
    """Adam after one step of fixed gradients (``seed``'s model as the canonical gradients)."""
    grads = make_model(seed=seed).state_dict()
    specs = get_shard_state(model).specs
    for name, p in model.named_parameters():
        p.grad = split(grads[name], specs[name], tp, tp_rank) if name in specs else grads[name].clone()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.8, 0.9))
    optimizer.step()
    return optimizer


def _resumed(mesh, where: str, options: dict | None) -> dict:
    model = make_model()
    sw.parallelize(model, tiny_plan(), mesh, holding="local")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    sw.load_optimizer(model, optimizer, where, storage_options=options)
    assert optimizer.param_groups[0]["lr"] == 0.01 and optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert all(float(s["step"]) == 1.0 for s in optimizer.state.values())
    return _state(optimizer)


def _ranks(url: str, root: str, options: dict) -> bool:
    backend = sw.init_backend("gloo")
    tp2 = backend.mesh(tp=2)
    model = make_model()
    sw.parallelize(model, tiny_plan(), tp2, holding="local")
    optimizer = _stepped(model, 2, get_shard_state(model).tp_rank)
    saved = _state(optimizer)
    assert any(t.abs().sum() > 0 for (_, k), t in saved.items() if k == "exp_avg")  # a real state
    sw.save_optimizer(model, optimizer, f"{url}/optim", storage_options=options)
    sw.save_optimizer(model, optimizer, f"{root}/optim")

    # at tp=2: what was saved, from the store as from the folder
    remote, local = _resumed(tp2, f"{url}/optim", options), _resumed(tp2, f"{root}/optim", None)
    assert remote.keys() == local.keys() == saved.keys()
    assert all(_same(remote[k], saved[k]) and _same(local[k], saved[k]) for k in saved)

    # at tp=1 (two replicas): whole tensors, the same from both
    tp1 = backend.mesh(dp_replicate=2, tp=1)
    remote, local = _resumed(tp1, f"{url}/optim", options), _resumed(tp1, f"{root}/optim", None)
    assert remote.keys() == local.keys() and all(_same(remote[k], local[k]) for k in local)
    # the whole exp_avg of a colwise weight holds this rank's tp=2 shard where the spec puts it
    specs = get_shard_state(model).specs
    names = [n for n, _ in model.named_parameters()]
    checked = 0
    for (i, k), t in remote.items():
        if k == "exp_avg" and names[i] in specs:
            shard = split(t, specs[names[i]], 2, get_shard_state(model).tp_rank)
            assert _same(shard, saved[(i, k)]), names[i]
            checked += 1
    assert checked > 0
    return True


def test_optimizer_state_over_an_object_store(remote, tmp_path):
    url = remote.url().rstrip("/")
    env = {k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST",) if k in os.environ}
    assert spawn(_ranks, 2, args=(url, str(tmp_path), remote.options), env=env, timeout=240) == [True, True]
    # the store holds a whole DCP checkpoint and nothing staged beside it
    names = remote.storage().list(remote.loc("optim"))
    assert ".metadata" in names and sum(n.endswith(".distcp") for n in names) >= 1, names
    assert remote.proxy.count("PUT", ".metadata") >= 1
