"""shardwise.testing, the public kit the benchmarks and tests share: a streaming checkpoint
written tensor by tensor reads back equal, the expected shard is the region math's, and the
checksum switch restores what it replaced."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import shardwise as sw
from shardwise import testing


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(8, 4, generator=g),
            "b.weight": torch.randn(16, 4, generator=g).bfloat16(),
            "c.bias": torch.arange(8, dtype=torch.int32)}


def test_write_checkpoint_streams_an_ordinary_checkpoint(tmp_path):
    ts = _tensors()
    shapes = {n: (t.shape, t.dtype) for n, t in ts.items()}
    files = testing.write_checkpoint(tmp_path, iter(ts.items()), shapes, max_shard_size=200,
                                     metadata={"who": "test"})
    assert len(files) > 1 and all(f.is_file() for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ts) and index["metadata"]["who"] == "test"
    back = {k: v for f in files for k, v in load_file(f).items()}
    assert all(torch.equal(back[n], t) and back[n].dtype == t.dtype for n, t in ts.items())
    read = testing.read_all(tmp_path)
    assert all(torch.equal(read[n], t) for n, t in ts.items())


def test_write_checkpoint_refuses_tensors_out_of_order(tmp_path):
    ts = _tensors()
    with pytest.raises(ValueError, match="'c.bias' given where 'a.weight'"):
        testing.write_checkpoint(tmp_path, reversed(list(ts.items())),
                                 {n: (t.shape, t.dtype) for n, t in ts.items()}, max_shard_size="1MB")


def test_expected_shard_and_plan_specs():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    specs = testing.plan_specs(model, {"0": "colwise", "1": "rowwise"}, 2)
    assert specs["0.weight"] == sw.ShardSpec(dim=0) and specs["1.weight"] == sw.ShardSpec(dim=1)
    w = torch.arange(32.0).view(8, 4)
    assert torch.equal(testing.expected_shard(w, specs["0.weight"], 2, 1), w[4:])
    with pytest.raises(sw.PlanError):
        testing.plan_specs(model, {"0": "colwise", "nothing": "rowwise"}, 2, strict=True)


def test_without_checksums_restores_the_digest():
    from shardwise.io import info

    real = info.DIGESTS[info.ALGORITHM]
    with testing.without_checksums():
        assert info.DIGESTS[info.ALGORITHM] != real
    assert info.DIGESTS[info.ALGORITHM] == real
