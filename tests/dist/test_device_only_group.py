"""Replicas read once over a device-only process group, on spawned CPU ranks.

NCCL moves CUDA tensors only: a CPU tensor sent over an NCCL-only group fails with "No backend
type associated with device type cpu". The fake (tests/fakes/device) gives the CPU suite such a
group: a host-memory device ("fakedev", a real non-CPU device type) and a group registered for it
alone, with shardwise's nccl backend shape on top (``fake_nccl``: DTensor holding). First the fake
is shown to refuse exactly what torch's own device-only group (``cuda:gloo``) refuses, with the
same message; then a ``dp_replicate`` load over it, which broadcast CPU tensors before issue 22's
fix and failed with that message, reads each byte once and gives every rank its shards.
"""

from __future__ import annotations

import pytest
import safetensors.torch as st
import torch

import shardwise as sw
from fakes import device as fake_device
from harness import run_ranks
from models import TinyTransformer, make_model, tiny_plan, tokens
from shardwise.core.spec import split
from shardwise.parallel import get_shard_state


@pytest.fixture(scope="module")
def lib():
    return fake_device.require()


def _refusals(lib: str):
    import torch.distributed as dist

    from fakes.device import backend as fake_nccl

    fake_nccl.install(lib)
    backend = sw.init_backend(fake_nccl.NAME)
    messages = {}
    try:
        dist.broadcast(torch.ones(1), 0)
    except RuntimeError as e:
        messages["fake"] = str(e)
    real = dist.new_group(backend="cuda:gloo")  # torch's own group for one device type (as NCCL)
    try:
        dist.broadcast(torch.ones(1), 0, group=real)
    except RuntimeError as e:
        messages["cuda:gloo"] = str(e)
    t = torch.full((2,), float(backend.rank + 1), device=backend.device)
    backend.all_reduce(t)
    return messages, str(t.device), t.cpu().tolist()


def test_the_fake_group_refuses_cpu_tensors_as_a_device_only_group_does(lib):
    for messages, device, total in run_ranks(_refusals, 2, lib, timeout=120):
        assert messages["fake"] == messages["cuda:gloo"] == "No backend type associated with device type cpu"
        assert device == "fakedev:0" and total == [3.0, 3.0]  # its own device's tensors travel


def _replicas(lib: str, path: str):
    from fakes.device import backend as fake_nccl
    from shardwise.parallel import local_of

    fake_nccl.install(lib)
    backend = sw.init_backend(fake_nccl.NAME)
    mesh = backend.mesh(dp_replicate=2, tp=1)
    with torch.device("meta"):
        model = TinyTransformer()
    result = sw.load(model, path, plan=tiny_plan(), mesh=mesh, progress=False)
    canonical = make_model().state_dict()
    state = get_shard_state(model)
    for name, spec in state.specs.items():
        got = local_of(model.state_dict()[name])
        want = (canonical[name] if spec.replicated
                else split(canonical[name], spec, state.degree, state.tp_rank))
        assert got.device.type == "fakedev" and torch.equal(got.cpu(), want), name
    with torch.no_grad():
        out = model(tokens().to(backend.device)).cpu()
    torch.testing.assert_close(out, make_model()(tokens()), rtol=1e-5, atol=1e-5)
    return result.bytes_read


def test_replicas_read_once_over_a_device_only_group(tmp_path, lib):
    canonical = {k: v.contiguous() for k, v in make_model().state_dict().items()}
    st.save_file(canonical, tmp_path / "model.safetensors")
    got = run_ranks(_replicas, 2, lib, str(tmp_path / "model.safetensors"), timeout=120)
    total = sum(t.numel() * t.element_size() for t in canonical.values())
    assert sum(got) == total and all(0 < b < total for b in got), got  # each byte read by one replica
