"""The holding strategies, the DTensor test and the frozen decoded mesh, without a process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise.backends.base import Backend
from shardwise.core.spec import ShardSpec
from shardwise.errors import BackendError, UsageError
from shardwise.holding import Holding, is_dtensor, local_of
from shardwise.mesh import MeshDims


@pytest.mark.parametrize("name", ["dtensor", "local", "spmd"])
def test_holding_parses_the_public_strings(name):
    h = Holding.parse(name)
    assert h is getattr(Holding, name.upper()) and str(h) == name and h.name == name
    assert h != name  # a strategy, never equal to the keyword's string
    assert Holding.parse(h) is h
    assert h.one_process == (name == "spmd") and h.plain_shards == (name == "local")


@pytest.mark.parametrize("bad", ["DTensor", "global", "", None])
def test_an_unknown_holding_is_a_usage_error(bad):
    with pytest.raises(UsageError, match="holding must be one of \\('dtensor', 'local', 'spmd'\\)"):
        Holding.parse(bad)


def test_is_dtensor_is_false_for_plain_tensors():
    t = torch.zeros(3)
    assert not is_dtensor(t) and not is_dtensor(torch.nn.Parameter(t)) and not is_dtensor(None)
    assert local_of(t) is t


def test_mesh_dims_is_frozen_and_gives_coordinates_per_axis():
    dims = MeshDims(mesh=None, degree=4, tp_rank=3, ep_degree=2, ep_rank=1, holding="local")
    assert dims.holding is Holding.LOCAL and (dims.dp_replicate, dims.dp_shard) == (1, 1)
    assert not dims.shares_reads
    assert dims.coords(ShardSpec(dim=0)) == (4, 3)
    assert dims.coords(ShardSpec(dim=0, axis="ep")) == (2, 1)
    assert dims.axis_coords == {"tp": (4, 3), "ep": (2, 1)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.tp_rank = 0
    with pytest.raises(UsageError):
        MeshDims(mesh=None, holding="spmd-ish")


def test_a_backend_without_global_tensors_refuses_spmd_shards():
    backend = Backend()
    assert backend.holding is Holding.DTENSOR
    with pytest.raises(BackendError, match="no global tensor"):
        backend.local_shards(torch.zeros(2))
    with pytest.raises(BackendError, match="no global tensor"):
        backend.local_regions(torch.zeros(2))
