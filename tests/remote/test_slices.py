"""A tensor-parallel rank's slices read from an object store through the same safetensors
writer and region reader as a local load (``sw.load``'s path below its entry point), each
rank's bytes counted at the proxy: colwise slices cost the share, rowwise slices a range per
row, coalesced where the gaps allow, never more than 1.05x the share."""

from __future__ import annotations

import pytest
import torch
from located import at

from shardwise.core.spec import ShardSpec, split
from shardwise.io.formats.safetensors.files import StreamingWriter, read_header
from shardwise.io.formats.safetensors.reader import RegionReader, plan_reads

TENSORS = {"rows": torch.randn(512, 256), "cols": torch.randn(256, 512), "bias": torch.randn(512)}


def _write(path) -> None:
    specs = [(n, "F32", tuple(t.shape)) for n, t in TENSORS.items()]
    with StreamingWriter(path, specs) as writer:
        for name, t in TENSORS.items():
            writer.write(name, t)


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_each_rank_fetches_only_its_slice(remote, degree, dim):
    storage = remote.storage()
    path = at(storage, remote.loc("ckpt/model.safetensors"))
    _write(path)
    header = read_header(path)
    plan = {"rows": ShardSpec(dim=dim), "cols": ShardSpec(dim=dim), "bias": ShardSpec(dim=0)}
    share = sum(t.numel() * 4 for t in TENSORS.values()) // degree
    requests = []
    for rank in range(degree):
        remote.proxy.clear()
        items = plan_reads({n: (path, header.entries[n]) for n in TENSORS}, plan, degree, rank)
        with RegionReader({path: header}, num_threads=4) as reader:
            got = reader.read(items, finalize=lambda item, raw: raw)
        for name, t in TENSORS.items():
            assert torch.equal(got[name], split(t, plan[name], degree, rank)), (name, rank)
        fetched = remote.proxy.sent("GET")
        assert fetched <= 1.05 * share, (rank, fetched, share)
        requests.append(remote.proxy.count("GET"))
    if dim == 0:  # a rank's rows are one contiguous range per tensor
        assert max(requests) <= len(TENSORS), requests
    print(f"{remote.scheme} dim={dim} degree={degree}: GETs per rank {requests}, share {share} bytes")
