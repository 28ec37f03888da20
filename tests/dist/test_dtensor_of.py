"""``parallel.dtensor_of`` builds a DTensor parameter without ``from_local``'s autograd Function;
it must be the DTensor ``from_local`` builds: same placements, global shape, stride, dtype, local
storage, and a leaf that gradients reach."""

from __future__ import annotations

import torch

from harness import run_ranks


def _compare() -> int:
    import shardwise as sw
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from shardwise.parallel import _as_parameter, dtensor_of

    sw.init_backend("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    locals_ = [torch.randn(6, 4, generator=gen), torch.randn(3, 5, 2, generator=gen).to(torch.bfloat16),
               torch.randn(8, generator=gen), torch.randn(4, 6, generator=gen).t(),  # not contiguous
               torch.arange(6, dtype=torch.int64).reshape(2, 3)]
    checked = 0
    for local in locals_:
        for placement in [Replicate()] + [Shard(d) for d in range(local.dim())]:
            ours, torchs = dtensor_of(local, mesh, placement), DTensor.from_local(local, mesh, [placement],
                                                                                 run_check=False)
            assert type(ours) is type(torchs)
            assert ours.placements == torchs.placements and ours.device_mesh == torchs.device_mesh
            assert ours.shape == torchs.shape and ours.stride() == torchs.stride()
            assert ours.dtype == torchs.dtype and not ours.requires_grad
            assert ours.to_local().data_ptr() == local.data_ptr() == torchs.to_local().data_ptr()
            assert ours._spec == torchs._spec
            checked += 1
    # a shared spec: shards of one shape and placement get one spec object, and stay apart
    specs: dict = {}
    a, b = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    da, db = dtensor_of(a, mesh, Shard(0), specs), dtensor_of(b, mesh, Shard(0), specs)
    assert da._spec is db._spec and len(specs) == 1 and da._spec == DTensor.from_local(a, mesh, [Shard(0)])._spec
    assert torch.equal(da.to_local(), a) and torch.equal(db.to_local(), b)
    assert dtensor_of(a, mesh, Shard(1), specs)._spec is not da._spec
    # as a parameter: a leaf whose gradient arrives, as with from_local
    w = _as_parameter(dtensor_of(torch.randn(3, 4, generator=gen), mesh, Shard(0)), True)
    assert isinstance(w, torch.nn.Parameter) and w.is_leaf and w.requires_grad
    (w.to_local() * 2).sum().backward()
    assert torch.equal(w.grad.to_local(), torch.full((3, 4), 2.0))
    # a local that needs a gradient goes the public way (a non-leaf DTensor)
    x = torch.randn(2, 2, requires_grad=True)
    assert dtensor_of(x, mesh, Shard(0)).grad_fn is not None
    return checked


def test_dtensor_of_is_from_local():
    assert run_ranks(_compare, 2) == [15, 15]


def _hooked() -> list:
    import shardwise as sw
    from torch import nn

    backend = sw.init_backend("gloo")
    seen = []
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    handle = nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, param: seen.append((name, type(param).__name__)))
    try:
        sw.parallelize(model, {"0": "colwise", "1": "rowwise"}, backend.mesh(tp=2), holding="dtensor")
    finally:
        handle.remove()
    return sorted(seen)


def test_a_global_parameter_registration_hook_sees_the_wired_dtensor_parameters():
    # wiring stores DTensor parameters into _parameters directly only while no such hook is set
    names = [("bias", "DTensor"), ("bias", "DTensor"), ("weight", "DTensor"), ("weight", "DTensor")]
    assert run_ranks(_hooked, 2) == [names, names]
