"""Reads through memory maps: page-cache views of contiguous regions and strided copies of
column slices give exactly the split of the stored tensor, keep every guarantee of ``pread``
(truncation is an error, never a crash) and never write to the file."""

from __future__ import annotations

import io
import json
import math
import os
import struct
import sys

import pytest
import safetensors.torch as st
import torch

from shardwise.core.header import TensorEntry
from shardwise.core.spec import Region, ShardSpec, split
from shardwise.errors import CheckpointError
from shardwise.io.formats.safetensors.checkpoint import resolve_checkpoint
from shardwise.io.read.mapped import contiguous_span, copy_mapped
from shardwise.io.read.reader import RegionReader, cpu_views, plan_reads
from shardwise.io.storage import locate

TENSORS = {
    "rows": (torch.arange(96.0).reshape(24, 4), ShardSpec(dim=0)),
    "cols": (torch.arange(6 * 16, dtype=torch.int32).reshape(6, 16), ShardSpec(dim=1)),
    "bf16_cols": (torch.randn(10, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
                  ShardSpec(dim=1, blocks=(1, 3))),
    "cube": (torch.arange(4 * 8 * 4.0).reshape(4, 8, 4), ShardSpec(dim=1)),
    "packed_rows": (torch.arange(36 * 5, dtype=torch.float16).reshape(36, 5),
                    ShardSpec(dim=0, blocks=(1, 2))),
    "replicated": (torch.arange(15.0).reshape(5, 3), ShardSpec()),
    "scalar": (torch.tensor(7.0), ShardSpec()),
}


def _mapped_files() -> set[str]:
    """Paths of the files this process maps (Linux: /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}


def _mapping_of(t: torch.Tensor) -> str | None:
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= t.data_ptr() < hi:
                return fields[5].strip() if len(fields) == 6 else ""
    return None


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "model.safetensors"
    st.save_file({k: t for k, (t, _) in TENSORS.items()}, path)
    return resolve_checkpoint(path)


def _read(ckpt, degree, rank, viewable, **kwargs):
    specs = {k: spec for k, (_, spec) in TENSORS.items()}
    items = plan_reads({k: ckpt.entry(k) for k in TENSORS}, specs, degree, rank)
    with RegionReader(ckpt.headers, num_threads=2, viewable=viewable, **kwargs) as reader:
        return reader.read(items, finalize=lambda item, raw: raw), reader.bytes_read, items


@pytest.mark.parametrize("degree", [1, 2, 4])
@pytest.mark.parametrize("views", [True, False])
def test_views_and_strided_copies_equal_split(ckpt, degree, views):
    viewable = cpu_views(torch.device("cpu"), None) if views else None
    for rank in range(degree):
        got, nbytes, items = _read(ckpt, degree, rank, viewable, piece_bytes=64)
        for name, (canonical, spec) in TENSORS.items():
            assert torch.equal(got[name], split(canonical, spec, degree, rank)), (name, rank)
        assert nbytes == sum(i.nbytes for i in items)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_a_contiguous_region_is_a_private_view_of_the_file(ckpt):
    path = next(iter(ckpt.headers)).path  # the local file
    before = path.read_bytes()
    got, _, _ = _read(ckpt, 2, 1, cpu_views(torch.device("cpu"), None))
    # one run on disk, no cast: a view of the file; a column slice and a packed shard: copies
    assert _mapping_of(got["rows"]) == str(path) and _mapping_of(got["replicated"]) == str(path)
    assert _mapping_of(got["cols"]) != str(path) and _mapping_of(got["packed_rows"]) != str(path)
    # its storage is its own bytes (torch.save writes them, not the file)
    assert got["rows"].untyped_storage().nbytes() == got["rows"].numel() * got["rows"].element_size()
    buf = io.BytesIO()
    torch.save(got["rows"], buf)
    assert len(buf.getvalue()) < path.stat().st_size
    # a write copies the page into the process: the file is unchanged, the tensor changed
    got["rows"].add_(1)
    assert path.read_bytes() == before
    assert torch.equal(got["rows"], split(TENSORS["rows"][0], ShardSpec(dim=0), 2, 1) + 1)
    # the view outlives the reader and the file's name
    os.unlink(path)
    assert torch.equal(got["replicated"], TENSORS["replicated"][0])


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_a_column_slice_is_a_strided_view_of_the_file(ckpt):
    path = next(iter(ckpt.headers)).path  # the local file
    before = path.read_bytes()
    got, _, _ = _read(ckpt, 2, 1, cpu_views(torch.device("cpu"), None), strided_views=True)
    cols, cube = got["cols"], got["cube"]
    assert _mapping_of(cols) == str(path) and _mapping_of(cube) == str(path)
    assert _mapping_of(got["packed_rows"]) != str(path)  # two regions: a copy
    assert cols.stride() == (16, 1) and cube.stride() == (32, 4, 1)  # the file's own strides
    # its storage spans its first to its last element (other ranks' columns included)
    assert cols.untyped_storage().nbytes() == ((6 - 1) * 16 + 8) * 4
    # a matmul takes the strided weight as it is, and equals the one on the split
    x = torch.ones(3, 8)
    want = split(TENSORS["cols"][0], ShardSpec(dim=1), 2, 1)
    linear = torch.nn.functional.linear
    assert torch.equal(linear(x, cols.float()), linear(x, want.float()))
    # a write copies the pages into the process: the file is unchanged
    cols.add_(1)
    assert path.read_bytes() == before
    assert torch.equal(cols, want + 1)


def test_a_cast_or_another_device_reads_a_copy(ckpt):
    assert cpu_views(torch.device("meta"), None) is None
    viewable = cpu_views(torch.device("cpu"), torch.float16)
    items = {i.name: i for i in plan_reads({k: ckpt.entry(k) for k in TENSORS},
                                           {k: s for k, (_, s) in TENSORS.items()}, 1, 0)}
    assert not viewable(items["rows"])       # float32 stored, float16 wanted: cast after a copy
    assert viewable(items["packed_rows"])    # float16 stored
    assert viewable(items["cols"])           # int32 is never cast


def _misaligned_file(path, tensor: torch.Tensor) -> None:
    """A safetensors file whose data starts at an offset that is not a multiple of 4."""
    header = json.dumps({"w": {"dtype": "F32", "shape": list(tensor.shape),
                               "data_offsets": [0, tensor.numel() * 4]}}).encode()
    header += b" " * ((2 - (8 + len(header)) % 4) % 4)  # data start = 2 (mod 4)
    data = b"".join(struct.pack("<f", v) for v in tensor.reshape(-1).tolist())
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_misaligned_data_is_read_with_pread(tmp_path):
    path = tmp_path / "odd.safetensors"
    tensor = torch.arange(48.0).reshape(6, 8)
    _misaligned_file(path, tensor)
    ckpt = resolve_checkpoint(path)
    assert (ckpt.headers[locate(path)].data_start) % 4 == 2
    for spec in (ShardSpec(dim=0), ShardSpec(dim=1)):
        items = plan_reads({"w": ckpt.entry("w")}, {"w": spec}, 2, 1)
        with RegionReader(ckpt.headers, num_threads=1, viewable=cpu_views(torch.device("cpu"), None)) as r:
            got = r.read(items, finalize=lambda item, raw: raw)
        assert torch.equal(got["w"], split(tensor, spec, 2, 1)), spec


@pytest.mark.parametrize("spec", [ShardSpec(), ShardSpec(dim=1)])
def test_a_file_shortened_after_its_header_was_read_is_an_error(tmp_path, spec):
    path = tmp_path / "model.safetensors"
    st.save_file({"a": torch.ones(64, 64), "b": torch.ones(64, 64)}, path)
    ckpt = resolve_checkpoint(path)
    os.truncate(path, path.stat().st_size - 100)
    items = plan_reads({k: ckpt.entry(k) for k in ("a", "b")}, {"a": spec, "b": spec}, 2, 0)
    with RegionReader(ckpt.headers, num_threads=2, viewable=cpu_views(torch.device("cpu"), None)) as reader:
        with pytest.raises(CheckpointError, match="truncated"):
            reader.read(items, finalize=lambda item, raw: raw)


def test_copy_mapped_any_destination_strides(ckpt):
    path = next(iter(ckpt.headers)).path  # the local file
    header = ckpt.headers[locate(path)]
    fd = locate(path).open()
    try:
        canonical = TENSORS["cube"][0]
        region = Region((1, 2, 1), (3, 5, 2))
        dest = torch.zeros(3, 5, 4)[:, :, 1:3]  # a strided destination
        n = copy_mapped(fd, header, header.entries["cube"], region, dest)
        assert n == 3 * 5 * 2 * 4
        assert torch.equal(dest, canonical[1:4, 2:7, 1:3])
    finally:
        fd.close()


@pytest.mark.parametrize("shape,offsets,sizes,span", [
    ((4, 6), (1, 0), (2, 6), (6 * 2, 12 * 2)),       # full rows
    ((4, 6), (2, 1), (1, 4), (13 * 2, 4 * 2)),       # part of one row
    ((4, 6), (0, 2), (2, 3), None),                  # a column slice
    ((2, 3, 4), (1, 1, 0), (1, 2, 4), (16 * 2, 8 * 2)),
    ((2, 3, 4), (0, 1, 0), (2, 2, 4), None),
    ((5,), (1,), (3,), (2, 6)),
    ((), (), (), (0, 2)),
    ((4, 6), (0, 0), (0, 6), None),                  # empty
])
def test_contiguous_span(shape, offsets, sizes, span):
    entry = TensorEntry("w", "BF16", shape, 0, math.prod(shape) * 2)
    assert contiguous_span(entry, Region(offsets, sizes)) == span


def test_views_are_not_left_mapped_by_strided_copies(ckpt):
    if not os.path.exists("/proc/self/maps") or sys.platform != "linux":
        pytest.skip("needs /proc/self/maps")
    path = str(next(iter(ckpt.headers)))
    got, _, _ = _read(ckpt, 2, 0, None)  # no views: every mapping is dropped after its copy
    assert path not in _mapped_files()
    assert torch.equal(got["cols"], split(TENSORS["cols"][0], ShardSpec(dim=1), 2, 0))
