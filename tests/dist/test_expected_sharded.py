"""``expected_tensors`` of a sharded model names the global tensors: a DTensor's own shape, a
local shard's from its spec and degree, FSDP's DTensors too; ``sw.save`` calls it on models
held in every way, so it must not depend on how they are held."""

from __future__ import annotations

import torch

import shardwise as sw
from harness import run_ranks
from models import TinyTransformer, make_model, tiny_plan
from shardwise.io.check.against import expected_tensors


def _held_every_way(folder: str):
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=2)
    with torch.device("meta"):
        want = expected_tensors(TinyTransformer())
    got = {}
    for holding in ("dtensor", "local"):
        got[f"parallelize-{holding}"] = sw.parallelize(make_model(), tiny_plan(), mesh, holding=holding)
        with torch.device("meta"):
            model = TinyTransformer()
        sw.load(model, folder, plan=tiny_plan("embedding_colwise"), mesh=mesh, holding=holding)
        got[f"load-{holding}"] = model
    from torch.distributed.fsdp import fully_shard

    got["fsdp"] = fully_shard(make_model(), mesh=backend.mesh(dp_shard=2))
    out = {}
    for how, model in got.items():
        local = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()
                 if type(t).__name__ != "DTensor"}
        out[how] = (expected_tensors(model) == want, local != {n: s for n, (s, _) in want.items()})
    return out


def test_global_shapes_however_held(tmp_path):
    folder = tmp_path / "ckpt"
    sw.save(make_model(), folder)
    for result in run_ranks(_held_every_way, 2, str(folder)):
        # every holding gives the canonical tensors; the local holding's own shapes differ
        assert all(same for same, _ in result.values()), result
        assert result["parallelize-local"][1] and result["load-local"][1], result
