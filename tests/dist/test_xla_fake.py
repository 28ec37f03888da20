"""The xla backend against the fake torch_xla 2.9 (tests/fakes/xla) on spawned CPU ranks: what
the probe of issue 22 found on real torch_xla, each shown to fail on the fake before its fix.

- An adopted ``env://`` "xla" group on PJRT CPU (the runtime is one process, the group two):
  its all_reduce is a no-op, so loads and forwards were silently wrong; ``init_backend`` now
  refuses it after a one-element all_reduce that must sum to the world size.
- Timeouts: torch_xla's work refuses a finite wait and its collectives cannot be bounded;
  ``init_backend("xla", timeout=...)`` warns, ``backend.timeout_limit`` says why, and the
  validation suite's timeout scenario reports UNSUPPORTED with that reason.
"""

from __future__ import annotations

import datetime as dt
import os
import sys

import pytest
import torch

import shardwise as sw
from fakes import XLA
from fakes import device as fake_device
from harness import run_ranks


@pytest.fixture(scope="module")
def lib():
    return fake_device.require()


def _xla_host(lib: str, *, runtime_sees_job: bool) -> None:
    """This rank on fake torch_xla: PJRT CPU (each process a world of one), or a runtime that
    sees every process of the job (a TPU pod)."""
    sys.path.insert(0, XLA)
    os.environ.update({"PJRT_DEVICE": "CPU", fake_device.LIB_ENV: lib})
    if runtime_sees_job:
        os.environ.update(FAKE_PJRT_WORLD_SIZE=os.environ["WORLD_SIZE"], FAKE_PJRT_ORDINAL=os.environ["RANK"],
                          FAKE_PJRT_LOCAL_ORDINAL=os.environ["LOCAL_RANK"])


def _group_behaviour(lib: str):
    import torch.distributed as dist

    _xla_host(lib, runtime_sees_job=True)
    import torch_xla
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla" and xla://)

    dist.init_process_group("xla", init_method="xla://")
    me = float(dist.get_rank() + 1)
    host = torch.tensor([me])
    dist.all_reduce(host)  # CPU tensor: silently nothing
    on_device = torch.tensor([me], device=torch_xla.device())
    dist.all_reduce(on_device)
    try:
        dist.broadcast(torch.ones(1), 0)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    return host.item(), on_device.cpu().item(), refused


def test_the_fake_xla_group_accepts_what_torch_xla_accepts(lib):
    for rank, (host, on_device, refused) in enumerate(run_ranks(_group_behaviour, 2, lib, timeout=120)):
        assert host == rank + 1.0 and on_device == 3.0  # CPU all_reduce a no-op; XLA tensors summed
        assert refused.startswith("Check failed: device.type() == at::kXLA")


def _adopt(lib: str, runtime_sees_job: bool):
    import torch.distributed as dist

    _xla_host(lib, runtime_sees_job=runtime_sees_job)
    import torch_xla
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla")

    # the user's own group, as in the probe: env:// (torchrun's RANK/WORLD_SIZE), backend "xla"
    dist.init_process_group("xla", init_method="env://", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    ones = torch.ones(1, device=torch_xla.device())
    dist.all_reduce(ones)  # what every collective of a load and a forward does over this group
    try:
        backend = sw.init_backend("xla")
    except sw.errors.BackendError as e:
        return ones.item(), str(e), dist.is_initialized()
    return ones.item(), f"adopted: world {backend.world_size}", dist.is_initialized()


def test_an_adopted_xla_group_whose_collectives_reach_no_one_is_refused(lib):
    got = run_ranks(_adopt, 2, lib, False, timeout=120)
    for ones, message, still in got:
        assert ones == 1.0  # the fake is faithful: the group's all_reduce reaches no other rank
        assert "does not reach the other ranks" in message, message
        assert "'xla'" in message and "summed to 1, not 2" in message and "Fix:" in message
        assert still  # the user's group is theirs: left as it was


def test_an_adopted_xla_group_that_reaches_every_rank_is_kept(lib):
    got = run_ranks(_adopt, 2, lib, True, timeout=120)
    assert got == [(2.0, "adopted: world 2", True)] * 2


def _timeouts(lib: str):
    import warnings

    import torch.distributed as dist

    _xla_host(lib, runtime_sees_job=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = sw.init_backend("xla", timeout=30)
    asked = [str(w.message) for w in caught if "timeout" in str(w.message)]
    t = torch.ones(1, device=backend.device)
    work = dist.all_reduce(t, async_op=True)
    try:
        work.wait(dt.timedelta(seconds=5))
        refused = None
    except RuntimeError as e:  # the fake's work is torch's FutureWrappingWork, as torch_xla's
        refused = str(e)
    backend.all_reduce(t, timeout=1e-6)  # returns: the limit is stated, not silently pretended
    sw.shutdown_backend()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sw.init_backend("xla")  # the default timeout: nothing asked, nothing to warn about
    quiet = [str(w.message) for w in caught if "timeout" in str(w.message)]
    return asked, refused, backend.timeout_limit, quiet


def test_xla_states_at_init_that_it_cannot_honour_timeouts(lib):
    (asked, refused, limit, quiet), = run_ranks(_timeouts, 1, lib, timeout=120)
    assert "finite timeout not implemented" in refused
    assert limit and "lazy graph" in limit
    assert len(asked) == 1 and "cannot honour timeout=30" in asked[0] and limit in asked[0]
    assert quiet == []
    from shardwise.backends import get_backend_class

    assert get_backend_class("gloo").timeout_limit is None


def _timeout_scenario(lib: str):
    from types import SimpleNamespace

    from shardwise.validate.runner import collective_timeout
    from shardwise.validate.scenarios import Unsupported

    _xla_host(lib, runtime_sees_job=True)
    backend = sw.init_backend("xla")
    try:
        return collective_timeout(SimpleNamespace(backend=backend))
    except Unsupported as e:
        return f"UNSUPPORTED: {e}"


@pytest.mark.slow
def test_the_validation_suite_reports_the_timeout_scenario_unsupported_on_xla(lib):
    early, late = run_ranks(_timeout_scenario, 2, lib, timeout=120)
    assert early.startswith("UNSUPPORTED: backend 'xla' does not honour collective timeouts"), early
    assert late["late_rank"] == 1  # the late rank's own record
