"""A rank that dies in the middle of ``plan.run()``: every survivor ends with one
``ShardwiseError`` within twice the backend's timeout, the destination's version has not
advanced, and its forward is refused (``TransferError``) instead of running half-updated
weights.

Three ranks: a trainer at tp=3 moves its weights into an inference model held whole on each
rank (three replicas, colocated). Rank 1 dies at its second bucket of the second run (after
a first run succeeded everywhere), by SIGKILL, ``os._exit`` or SIGSTOP (alive but silent).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dying_ranks import die, run_with_deaths
from torch import nn

import shardwise as sw

pytestmark = pytest.mark.stress
TIMEOUT = 8.0  # seconds: the backend's collective timeout


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 24))


PLAN = {"0": "colwise", "2": "rowwise"}


def _trial(death: str, victim: int):
    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    src = sw.parallelize(_model(0), PLAN, backend.mesh(tp=3))
    dst = sw.parallelize(_model(1), PLAN, backend.mesh(dp_replicate=3))
    plan = sw.transfer_plan(src, dst, bucket_bytes=512)
    assert len(plan.plan.buckets) > 2, "the trial needs a run of several buckets"
    plan.run()
    calls, real = [0], dist.batch_isend_irecv

    def dying(ops):
        calls[0] += 1
        if backend.rank == victim and calls[0] == 2:
            die(death)
        return real(ops)

    dist.batch_isend_irecv = dying
    start = time.monotonic()
    try:
        plan.run()
    except sw.ShardwiseError as e:
        seconds = time.monotonic() - start
        try:
            dst(torch.zeros(1, 24))
            refused = False
        except sw.errors.TransferError:
            refused = True
        return {"error": type(e).__name__, "seconds": seconds, "version": plan.version, "refused": refused}
    return {"error": None, "version": plan.version}


@pytest.mark.parametrize("death", ["kill", "exit", "stop"])
def test_survivors_of_a_rank_dead_mid_transfer_raise_and_refuse_the_destination(death):
    victim = 1
    out = run_with_deaths(_trial, 3, death, victim, timeout=120.0,
                          need=[r for r in range(3) if r != victim])
    for rank, outcome in out.items():
        if rank == victim:
            continue
        assert outcome.kind == "ok", (rank, outcome)
        got = outcome.value
        print(f"{death}: rank {rank} raised {got['error']} after {got.get('seconds', 0):.1f} s "
              f"(timeout {TIMEOUT:.0f} s), version {got['version']}, forward refused: {got.get('refused')}")
        assert got["error"] is not None, (rank, got)
        assert got["version"] == 1 and got["refused"], (rank, got)
        assert got["seconds"] < 2 * TIMEOUT, (rank, got)
