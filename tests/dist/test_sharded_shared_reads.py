"""A sharded safetensors folder (``DCP_SHARDING_INFO`` headers) reads in the load's read mode,
as a safetensors file does (``io.read.modes``): on ``mesh(dp_replicate=2, tp=2)`` each chunk
region is read by one replica and broadcast, and from a storage read once per job
(``fetch_once``) the ranks read each byte once and exchange. Counted per rank on spawned gloo
ranks; every shard bit-identical to the split of the stored tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

import memstore
import shardwise as sw
from harness import run_ranks
from models import assert_exact_shards, make_model, tiny_plan
from shardwise.core.spec import split
from shardwise.io.formats.sharded.source import sharding_metadata
from shardwise.io.storage import register_storage
from shardwise.parallel import get_shard_state, local_of

SCHEME = "memsharded"


class OnceStore(memstore.MemStore):
    fetch_once = True


def _files() -> dict[str, bytes]:
    """Two rank files: every tensor of two rows or more split by rows between them, the rest
    (a bias, a norm) in the first."""
    parts: list[tuple[dict, dict]] = [({}, {}), ({}, {})]
    for name, t in make_model().state_dict().items():
        if t.dim() and t.shape[0] >= 2:
            half = t.shape[0] // 2
            for k, (rows, at) in enumerate(((t[:half], 0), (t[half:], half))):
                parts[k][0][name] = rows.contiguous()
                parts[k][1][name] = (at,) + (0,) * (t.dim() - 1)
        else:
            parts[0][0][name] = t.contiguous()
            parts[0][1][name] = (0,) * t.dim()
    return {f"shard-0000{k + 1}-model-00001-of-00001.safetensors":
            save(tensors, metadata=sharding_metadata(offsets)) for k, (tensors, offsets) in enumerate(parts)}


def _total() -> int:
    return sum(t.numel() * t.element_size() for t in make_model().state_dict().values())


def _load(path: str, axes: dict, options: dict | None) -> int:
    if options is not None:
        register_storage(SCHEME, lambda address, authkey: OnceStore(address, authkey))
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(**axes)
    with torch.device("meta"):
        model = make_model()
    result = sw.load(model, path, plan=tiny_plan(), mesh=mesh, storage_options=options, progress=False)
    assert_exact_shards(model, mesh)  # bit-identical to the split of the stored tensor
    return result.bytes_read


@pytest.mark.slow
def test_dp_replicas_read_each_chunk_region_once(tmp_path):
    for name, data in _files().items():
        (tmp_path / name).write_bytes(data)
    read = run_ranks(_load, 4, str(tmp_path), {"dp_replicate": 2, "tp": 2}, None, timeout=180)
    total = _total()
    assert sum(read) == total, (read, total)  # without the replicas: each tp half twice, and more
    assert all(0 < r < total / 2 for r in read), read  # spread over the four ranks


@pytest.mark.slow
def test_a_fetch_once_storage_reads_each_chunk_byte_once():
    manager, options = memstore.serve()
    try:
        store = memstore.MemStore(options["address"], options["authkey"])
        for name, data in _files().items():
            store.put(f"ckpt/sharded/{name}", data)
        read = run_ranks(_load, 2, f"{SCHEME}://ckpt/sharded", {"tp": 2}, options, timeout=180)
    finally:
        manager.shutdown()
    total = _total()
    assert sum(read) == total, (read, total)  # each rank reading its own: the replicated ones twice
    assert all(r <= 1.05 * total / 2 for r in read), (read, total / 2)  # each rank its share
