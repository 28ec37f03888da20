"""The mesh decoded once (``shardwise.mesh.decode_mesh``) on real gloo meshes: degrees, ranks,
groups, device and holding of every axis, and the frozen ``ShardState`` a model keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from harness import run_ranks
from models import make_model, tiny_plan, tokens
from shardwise.holding import Holding, is_dtensor
from shardwise.mesh import decode_mesh
from shardwise.parallel import get_shard_state

# (mesh axes, expected (tp degree, tp rank), (ep degree, ep rank), (dp_replicate degree, rank,
# dp_shard degree, rank)) at world size 4, rank r; axes outer to inner, so tp is the
# fastest-moving coordinate
LAYOUTS = [
    ({"tp": 4}, lambda r: (4, r), lambda r: (1, 0), lambda r: (1, 0, 1, 0)),
    ({"dp_shard": 2, "tp": 2}, lambda r: (2, r % 2), lambda r: (1, 0), lambda r: (1, 0, 2, r // 2)),
    ({"dp_replicate": 2, "tp": 2}, lambda r: (2, r % 2), lambda r: (1, 0), lambda r: (2, r // 2, 1, 0)),
    ({"ep": 2, "tp": 2}, lambda r: (2, r % 2), lambda r: (2, r // 2), lambda r: (1, 0, 1, 0)),
    ({"ep": 4}, lambda r: (1, 0), lambda r: (4, r), lambda r: (1, 0, 1, 0)),  # backend.mesh adds tp=1
    ({"dp_shard": 4}, lambda r: (1, 0), lambda r: (1, 0), lambda r: (1, 0, 4, r)),
    ({"dp_replicate": 2, "dp_shard": 2}, lambda r: (1, 0), lambda r: (1, 0), lambda r: (2, r // 2, 2, r % 2)),
]


def _decode_every_layout():
    backend = sw.init_backend("gloo")
    r = backend.rank
    for axes, tp, ep, dp in LAYOUTS:
        mesh = backend.mesh(**axes)
        dims = decode_mesh(mesh)
        assert (dims.degree, dims.tp_rank) == tp(r), (axes, dims)
        assert (dims.ep_degree, dims.ep_rank) == ep(r), (axes, dims)
        assert (dims.dp_replicate, dims.dp_replicate_rank, dims.dp_shard, dims.dp_shard_rank) == dp(r), (axes, dims)
        assert dims.spans_world and dims.shares_reads == (dims.dp_replicate > 1)
        if dims.dp_replicate > 1:  # the replicas' group: the ranks with this rank's other coordinates
            assert dist.get_world_size(dims.dp_replicate_group) == dims.dp_replicate
        else:
            assert dims.dp_replicate_group is None
        assert dims.holding is Holding.DTENSOR and dims.device == torch.device("cpu")
        assert dims.backend is backend and dims.mesh is mesh
        if "tp" in mesh.mesh_dim_names:  # (an ep mesh gets tp=1) the axis's group has its ranks
            assert dist.get_world_size(dims.group) == dims.degree
        else:
            assert dims.tp_mesh is None and dims.group is None
        if "ep" in axes:
            assert dist.get_world_size(dims.ep_group) == dims.ep_degree
        with pytest.raises(dataclasses.FrozenInstanceError):
            dims.degree = 7
    assert decode_mesh(backend.mesh(tp=4), "local").holding is Holding.LOCAL
    with pytest.raises(sw.errors.UsageError, match="holding must be one of"):
        decode_mesh(backend.mesh(tp=4), "global")
    with pytest.raises(sw.errors.PlanError, match="holding 'spmd' needs the mesh"):
        decode_mesh(backend.mesh(tp=4), "spmd")
    return True


def test_decode_mesh_on_every_layout():
    assert run_ranks(_decode_every_layout, 4) == [True] * 4


def _state_after_parallelize(holding: str):
    backend = sw.init_backend("gloo")
    model = make_model()
    sw.parallelize(model, tiny_plan(), backend.mesh(tp=2), holding=holding)
    state = get_shard_state(model)
    assert state.holding is Holding.parse(holding) and str(state.holding) == holding
    assert (state.degree, state.tp_rank, state.ep_degree) == (2, backend.rank, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.ep_degree = 2
    w = model.single[0].proj_in.weight
    assert is_dtensor(w) == (holding == "dtensor")
    assert not is_dtensor(w.to_local() if is_dtensor(w) else w)
    model(tokens())  # the wiring read the frozen state
    return True


@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_shard_state_is_the_decoded_mesh_frozen(holding):
    assert run_ranks(_state_after_parallelize, 2, holding) == [True] * 2
