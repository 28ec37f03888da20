"""A storage that reads once per job (``fetch_once = True``, as an object store declares) under
``sw.load`` on spawned gloo ranks: ``tests/memstore.py``'s store with the flag set, so the
exchange (``shardwise.io.read.exchange``) runs in the gloo suite too (tests/remote runs it against
S3). Every rank's shards are bit-identical to the split of the stored tensors at tp=2, tp=4 and
dp_replicate=2 x tp=2, the job reads each tensor byte once, each rank about its share; the
same store without the flag reads as local files do (replicated tensors on every rank)."""

from __future__ import annotations

import pytest
import torch

import memstore
import shardwise as sw
from harness import run_ranks
from models import assert_exact_shards, make_model, tiny_plan
from shardwise.core.spec import split
from shardwise.io.storage import register_storage, unregister_storage
from shardwise.parallel import get_shard_state, local_of

SCHEME = "memonce"


class OnceStore(memstore.MemStore):
    fetch_once = True


def _register(once: bool) -> None:
    cls = OnceStore if once else memstore.MemStore
    stores: dict = {}

    def factory(address, authkey: bytes):
        key = (tuple(address), authkey)
        if key not in stores:
            stores[key] = cls(address, authkey)
        return stores[key]

    register_storage(SCHEME, factory)


def _load(options: dict, axes: dict, holding: str, once: bool):
    _register(once)
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(**axes)
    with torch.device("meta"):
        model = make_model()
    result = sw.load(model, f"{SCHEME}://ckpt/src", plan=tiny_plan(), mesh=mesh, holding=holding,
                     storage_options=options)
    assert_exact_shards(model, mesh)  # bit-identical to the split of the stored tensor
    return result.bytes_read


@pytest.fixture
def served():
    manager, options = memstore.serve()
    _register(False)
    try:
        sw.save(make_model(), f"{SCHEME}://ckpt/src", max_shard_size=40_000, storage_options=options)
    finally:
        unregister_storage(SCHEME)
    yield options
    manager.shutdown()


def _total() -> int:
    return sum(t.numel() * t.element_size() for t in make_model().state_dict().values())


@pytest.mark.slow
@pytest.mark.parametrize("axes,holding", [({"tp": 2}, "dtensor"), ({"tp": 4}, "local"),
                                          ({"dp_replicate": 2, "tp": 2}, "dtensor")])
def test_a_fetch_once_storage_reads_each_byte_once(served, axes, holding):
    world = axes.get("dp_replicate", 1) * axes["tp"]
    read = run_ranks(_load, world, served, axes, holding, True, timeout=180)
    total = _total()
    assert sum(read) == total, (read, total)  # every tensor byte, once across the job
    assert all(r <= 1.05 * total / world for r in read), (read, total / world)  # each rank its share


@pytest.mark.slow
def test_without_the_flag_each_rank_reads_its_own_regions(served):
    read = run_ranks(_load, 2, served, {"tp": 2}, "dtensor", False, timeout=180)
    assert sum(read) > _total()  # the replicated tensors, read by both ranks
