"""GroupMesh, the mesh of the xla/neuron backends: axis lines, coordinates and groups, with a
``new_group`` that records its calls instead of a process group."""

import pytest
import torch

from shardwise.backends.xla import GroupMesh
from shardwise.errors import MeshError


def _mesh(names, shape, rank):
    calls = []

    def new_group(ranks):
        calls.append(tuple(ranks))
        return tuple(ranks)

    return GroupMesh("xla", names, shape, rank=rank, new_group=new_group), calls


@pytest.mark.parametrize("rank, tp_line, dp_line", [(0, (0, 1), (0, 2)), (3, (2, 3), (1, 3)),
                                                    (2, (2, 3), (0, 2))])
def test_two_axes(rank, tp_line, dp_line):
    mesh, calls = _mesh(("dp_shard", "tp"), (2, 2), rank)
    # every rank joins every line's new_group, in one order (torch requires it)
    assert calls == [(0, 2), (1, 3), (0, 1), (2, 3)]
    assert mesh.size() == 4 and mesh.size("tp") == 2 and mesh.ndim == 2
    assert mesh.get_coordinate() == [rank // 2, rank % 2]
    tp = mesh["tp"]
    assert tp.mesh_dim_names == ("tp",) and tp.ndim == 1 and tp.device_type == "xla"
    assert tp.size() == 2 and tp.get_local_rank() == rank % 2
    assert tuple(tp.mesh.tolist()) == tp_line and tp.get_group() == tp_line
    assert mesh["dp_shard"].get_group() == dp_line and mesh.get_group("dp_shard") == dp_line
    assert torch.equal(mesh.mesh, torch.arange(4).view(2, 2))


def test_one_axis_spanning_the_world_uses_the_default_group():
    import torch.distributed as dist

    mesh, calls = _mesh(("tp",), (4,), 1)
    assert calls == [] and mesh.get_group() is dist.group.WORLD
    assert mesh.get_local_rank() == 1 and mesh.size() == 4


def test_errors_name_the_axes():
    mesh, _ = _mesh(("dp_shard", "tp"), (2, 2), 0)
    with pytest.raises(MeshError, match="has 2 dims"):
        mesh.get_local_rank()
    with pytest.raises(MeshError, match="no axis 'pp'"):
        mesh["pp"]
    with pytest.raises(MeshError, match="outside a mesh of 4"):
        _mesh(("dp_shard", "tp"), (2, 2), 4)
