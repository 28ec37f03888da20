"""The proxy's faults (503, a reset mid-body, a truncated body) thrown at the public verbs run
by two gloo ranks at tp=2: ``sw.load`` of a distributed (DCP) checkpoint from the store and
``sw.save(..., distributed=True)`` into it. A few faults are retried and the result is right;
a fault that persists on one rank's file ends in an error on every rank (none hangs: each rank
reports its error as its result, and the launcher bounds the run), and a failed save publishes
nothing: the previous checkpoint stays, whole, and nothing staged is left."""

from __future__ import annotations

import os

import torch
from test_optimizer_remote import _same
from test_publish import _left

import shardwise as sw
from models import make_model, tiny_plan
from shardwise.core.spec import split
from shardwise.errors import ShardwiseError
from shardwise.parallel import get_shard_state, local_of
from shardwise.testing import spawn

TIMEOUT = 30.0  # the ranks' collective timeout: far past the store's bounded retries


def _loaded(url: str, options: dict, mesh, seed: int) -> bool:
    """Whether the checkpoint at ``url`` loads at tp=2 as ``seed``'s model, shard for shard."""
    with torch.device("meta"):
        model = make_model()
    sw.load(model, url, plan=tiny_plan(), mesh=mesh, holding="local", storage_options=options)
    state = get_shard_state(model)
    want = make_model(seed).state_dict()
    return all(_same(local_of(t).detach(), split(want[n], state.specs[n], 2, state.tp_rank)
                     if n in state.specs else want[n])
               for n, t in model.state_dict(keep_vars=True).items())


def _outcome(fn) -> tuple:
    """``("ok", fn())`` or ``("error", class name, message)`` for a ShardwiseError, so that
    every rank reports how it ended (the launcher stops the others at the first raise)."""
    try:
        return ("ok", fn())
    except ShardwiseError as e:
        return ("error", type(e).__name__, str(e))


def saving_then_loading(url: str, options: dict) -> tuple:
    """Save seed 1 at tp=2 (no faults match a save), then load it back under the faults."""
    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    mesh = backend.mesh(tp=2)
    model = make_model(1)
    sw.parallelize(model, tiny_plan(), mesh, holding="local")
    sw.save(model, url, distributed=True, storage_options=options)
    backend.barrier()
    return _outcome(lambda: _loaded(url, options, mesh, 1))


def saving(url: str, options: dict, seed: int) -> tuple:
    """Save ``seed`` at tp=2 over what the prefix holds (under the faults), then load it back."""
    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    mesh = backend.mesh(tp=2)
    model = make_model(seed)
    sw.parallelize(model, tiny_plan(), mesh, holding="local")
    outcome = _outcome(lambda: sw.save(model, url, distributed=True, overwrite=True, storage_options=options))
    if outcome[0] == "error":
        return outcome
    return _outcome(lambda: _loaded(url, options, mesh, seed))


def loading(url: str, options: dict, seed: int) -> tuple:
    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    return _outcome(lambda: _loaded(url, options, backend.mesh(tp=2), seed))


def _spawn(remote, fn, *args) -> list:
    env = {k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST",) if k in os.environ}
    return spawn(fn, 2, args=(remote.url("dcp").rstrip("/"), remote.options, *args), env=env, timeout=300)


def _errors(results: list) -> list[str]:
    assert all(r[0] == "error" for r in results), results  # every rank, none left waiting
    return [r[2] for r in results]


def test_faults_during_a_two_rank_dcp_load_are_retried(remote):
    for kind in ("503", "reset", "truncate"):  # taken in this order, one each
        remote.proxy.fault(kind, method="GET", path="dcp/__1_0.distcp")
    assert _spawn(remote, saving_then_loading) == [("ok", True), ("ok", True)]
    assert remote.proxy.taken == ["503", "reset", "truncate"] and remote.proxy.pending() == 0


def test_a_fault_that_persists_during_a_two_rank_dcp_load_fails_every_rank(remote):
    remote.proxy.fault("reset", method="GET", path="dcp/__1_0.distcp", times=10_000)
    messages = _errors(_spawn(remote, saving_then_loading))
    # the rank whose read failed names the object, and the other learns of it, not of a timeout
    assert any("__1_0.distcp" in m for m in messages), messages
    assert not any("timed out" in m.lower() for m in messages), messages


def test_faults_during_a_two_rank_distributed_save_are_retried(remote):
    remote.proxy.fault("503", method="PUT", path="__1_0.distcp")
    remote.proxy.fault("reset", method="PUT", path="__0_0.distcp")
    assert _spawn(remote, saving, 2) == [("ok", True), ("ok", True)]
    assert sorted(remote.proxy.taken) == ["503", "reset"] and remote.proxy.pending() == 0
    assert all(n.startswith("dcp/") for n in _left(remote)), _left(remote)


def test_a_fault_that_persists_during_a_distributed_save_fails_every_rank_and_publishes_nothing(remote):
    assert _spawn(remote, saving, 1) == [("ok", True), ("ok", True)]  # the previous checkpoint
    before = _left(remote)
    remote.proxy.fault("503", method="PUT", path="__1_0.distcp", times=10_000)
    messages = _errors(_spawn(remote, saving, 2))
    assert any("__1_0.distcp" in m for m in messages), messages
    assert not any("timed out" in m.lower() for m in messages), messages
    remote.proxy.clear()
    assert _left(remote) == before  # nothing published, nothing staged left beside it
    assert _spawn(remote, loading, 1) == [("ok", True), ("ok", True)]  # the previous one, whole
