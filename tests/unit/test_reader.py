"""The threaded region reader, without a process group: every rank's local shard of every
layout, read with pieces and a window far smaller than the tensors, equals ``split``."""

from __future__ import annotations

import math
import os

import pytest
import safetensors.torch as st
import torch

from shardwise.core.spec import ShardSpec, split
from shardwise.errors import CheckpointError
from shardwise.io.formats.safetensors.checkpoint import resolve_checkpoint
from shardwise.io.read.reader import RegionReader, plan_reads


def _ar(*shape, dtype=torch.float32):
    return torch.arange(math.prod(shape), dtype=dtype).reshape(shape)


TENSORS = {
    "rows": (_ar(24, 10), ShardSpec(dim=0)),
    "packed_rows": (_ar(36, 5, dtype=torch.bfloat16), ShardSpec(dim=0, blocks=(1, 1, 1))),
    "cols": (_ar(6, 16, dtype=torch.int32), ShardSpec(dim=1)),
    "packed_cols": (_ar(7, 32, dtype=torch.float16), ShardSpec(dim=1, blocks=(1, 3))),
    "bias": (_ar(12, dtype=torch.float64), ShardSpec(dim=0, blocks=(1, 2))),
    "cube": (_ar(4, 8, 4), ShardSpec(dim=1, blocks=(1, 1))),
    "replicated": (_ar(5, 3), ShardSpec()),
    "scalar": (torch.tensor(7.0), ShardSpec()),
    "empty": (torch.zeros(0, 4), ShardSpec()),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader") / "model.safetensors"
    st.save_file({k: t for k, (t, _) in TENSORS.items()}, path)
    return resolve_checkpoint(path)


@pytest.mark.parametrize("degree", [1, 2, 4])
@pytest.mark.parametrize("piece_bytes,window_bytes,threads", [(1 << 20, 1 << 20, 1), (8, 64, 3)])
def test_local_shards_equal_split(ckpt, degree, piece_bytes, window_bytes, threads):
    specs = {k: spec for k, (_, spec) in TENSORS.items()}
    sources = {k: ckpt.entry(k) for k in TENSORS}
    for rank in range(degree):
        items = plan_reads(sources, specs, degree, rank)
        seen = []
        with RegionReader(ckpt.headers, num_threads=threads, piece_bytes=piece_bytes,
                          window_bytes=window_bytes, on_bytes=seen.append) as reader:
            got = reader.read(items, finalize=lambda item, raw: raw)
        for name, (canonical, spec) in TENSORS.items():
            expected = split(canonical, spec, degree, rank)
            assert got[name].dtype == canonical.dtype and torch.equal(got[name], expected), (name, rank)
        assert reader.bytes_read == sum(i.nbytes for i in items) == sum(seen)
        if piece_bytes == 8:  # small pieces really split the regions
            assert len(seen) > len(items)


def test_a_truncated_file_raises_without_hanging(tmp_path):
    path = tmp_path / "model.safetensors"
    st.save_file({"a": torch.ones(64, 64), "b": torch.ones(64, 64)}, path)
    ckpt = resolve_checkpoint(path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    specs = {"a": ShardSpec(), "b": ShardSpec(dim=1)}
    items = plan_reads({k: ckpt.entry(k) for k in specs}, specs, 2, 1)
    with RegionReader(ckpt.headers, num_threads=2, piece_bytes=256, window_bytes=512) as reader:
        with pytest.raises(CheckpointError, match="truncated"):
            reader.read(items, finalize=lambda item, raw: raw)


def test_num_threads_is_checked(ckpt):
    with pytest.raises(ValueError, match="num_threads must be a positive int"):
        RegionReader(ckpt.headers, num_threads=0)


def test_a_load_from_an_object_store_reads_with_its_requests_in_flight(monkeypatch):
    """Reader threads default to an object store's concurrency (its reads wait on the network),
    to cores elsewhere; an explicit num_threads wins."""
    from shardwise.io.load import reader_threads
    from shardwise.io.storage import locate
    from shardwise.io.storage.objects import ObjectStorage

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cores = max(1, min(8, os.cpu_count() or 1))
    assert reader_threads(None, ObjectStorage("s3", concurrency=24)) == 24
    assert reader_threads(None, locate("ckpt").storage) == cores
    assert reader_threads(3, ObjectStorage("s3")) == 3
