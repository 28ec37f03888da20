"""``dcp.blob.read_blob`` describes a chunk's ``torch.save`` blob without ``torch.load``: for every
plain tensor it must give what ``torch.load(map_location="meta")`` and torch's zip reader give
(dtype, shape, stride, storage offset and size, the data record's offset); for anything else None,
so that the caller asks torch.load."""

from __future__ import annotations

import io

import pytest
import torch

from shardwise.io.formats.dcp.blob import read_blob

PAD = 1234  # a blob lies inside a DCP data file, after others


def _tensors():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 70, generator=g)
    return {
        "bf16": base.to(torch.bfloat16),
        "f32 big (head and tail apart)": torch.randn(300, 300, generator=g),
        "transposed": base.t(),
        "a view with a storage offset": base[3:9, 5:],
        "int64 0-d": torch.tensor(7),
        "empty": torch.empty(0, 5),
        "bool": base > 0,
        "f8": base.to(torch.float8_e4m3fn),
        "complex": torch.randn(3, 4, dtype=torch.complex64, generator=g),
    }


def _blob(obj, **kwargs) -> tuple[io.BytesIO, int, int]:
    data = io.BytesIO()
    torch.save(obj, data, **kwargs)
    raw = data.getvalue()
    return io.BytesIO(b"x" * PAD + raw + b"y" * 99), PAD, len(raw)


@pytest.mark.parametrize("name", list(_tensors()))
def test_a_plain_tensor_is_described_as_torch_reads_it(name):
    t = _tensors()[name]
    f, offset, length = _blob(t)
    got = read_blob(f, offset, length)
    assert got is not None
    meta, at = got
    blob = f.getvalue()[offset:offset + length]
    ref = torch.load(io.BytesIO(blob), map_location="meta", weights_only=True)
    assert meta.device.type == "meta"
    assert (meta.dtype, meta.shape, meta.stride(), meta.storage_offset()) == (
        ref.dtype, ref.shape, ref.stride(), ref.storage_offset())
    assert meta.untyped_storage().nbytes() == ref.untyped_storage().nbytes()
    assert at == torch._C.PyTorchFileReader(io.BytesIO(blob)).get_record_offset("data/0")
    # the bytes at that offset are the tensor's storage, exactly
    nbytes = meta.untyped_storage().nbytes()
    stored = blob[at:at + nbytes]
    assert stored == bytes(t.untyped_storage())


@pytest.mark.parametrize("obj", [
    pytest.param(lambda: (torch.ones(2), torch.zeros(3)), id="two storages"),
    pytest.param(lambda: {"w": torch.ones(2)}, id="a dict"),
    pytest.param(lambda: [torch.ones(2)], id="a list"),
    pytest.param(lambda: 3, id="not a tensor"),
    pytest.param(lambda: torch.nn.Parameter(torch.ones(2)), id="a parameter (another rebuild)"),
])
def test_anything_but_one_plain_tensor_is_left_to_torch_load(obj):
    f, offset, length = _blob(obj())
    assert read_blob(f, offset, length) is None


def test_the_legacy_format_is_left_to_torch_load():
    f, offset, length = _blob(torch.ones(4), _use_new_zipfile_serialization=False)
    assert read_blob(f, offset, length) is None


@pytest.mark.parametrize("where", ["pickle", "byteorder", "directory", "end"])
def test_a_damaged_description_is_left_to_torch_load(where):
    # a flipped byte in the small records fails their CRC-32, in the directory its signature or
    # offsets: never a wrong description (torch.load then reads it, or says why it cannot)
    f, offset, length = _blob(torch.randn(64, 64))
    raw = bytearray(f.getvalue())
    blob = bytes(raw[offset:offset + length])
    at = {"pickle": blob.index(b"_rebuild_tensor_v2"), "byteorder": blob.index(b"little"),
          "directory": blob.rindex(b"PK\x01\x02"), "end": blob.rindex(b"PK\x05\x06") + 16}[where]
    raw[offset + at] ^= 0x01
    assert read_blob(io.BytesIO(bytes(raw)), offset, length) is None


def test_every_chunk_of_a_saved_dcp_checkpoint_is_described(tmp_path):
    # what sw.save(distributed=True) and torch's dcp.save write: read without torch.load, each
    # chunk as torch.load describes it (a fallback for all would pass the round trips unseen)
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    import shardwise as sw
    from shardwise.io.formats.dcp.metadata import read_metadata

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)).to(torch.bfloat16)
    sw.save(model, tmp_path / "sw", distributed=True)
    state = {"w": torch.randn(6, 4).t(), "i": torch.arange(10), "f8": torch.ones(4, 4).to(torch.float8_e5m2)}
    dcp.save(state, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    described = 0
    for folder in (tmp_path / "sw", tmp_path / "torch"):
        metadata = read_metadata(folder)
        for index, info in metadata.storage_data.items():
            if not isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
                continue
            with open(folder / info.relative_path, "rb") as f:
                meta, at = read_blob(f, info.offset, info.length)
                f.seek(info.offset)
                ref = torch.load(io.BytesIO(f.read(info.length)), map_location="meta", weights_only=True)
            assert (meta.dtype, meta.shape, meta.stride()) == (ref.dtype, ref.shape, ref.stride())
            described += 1
    assert described == 4 + 3
