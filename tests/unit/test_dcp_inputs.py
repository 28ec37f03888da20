"""Distributed checkpoints as untrusted input (everything but the ``.metadata`` pickle):
``shardwise.json``, the data files and their chunk map are checked before they are used.
One process, no process group: ``inspect``, ``consolidate`` and the chunk checks."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import shardwise as sw
from shardwise.errors import CheckpointError
from shardwise.io.check import inspect_checkpoint
from shardwise.io.formats.dcp.metadata import check_chunks, read_metadata


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.register_buffer("ids", torch.arange(64, dtype=torch.int64).reshape(8, 8))


@pytest.fixture
def dcp_dir(tmp_path):
    sw.save(Small(), tmp_path / "dcp", distributed=True)
    return tmp_path / "dcp"


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (TimeoutError) instead of hanging the suite if the body blocks."""
    def expire(*_):
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _both_refuse(folder, out, *fault):
    for call in (lambda: inspect_checkpoint(folder), lambda: sw.consolidate(folder, out)):
        with deadline(20), pytest.raises(CheckpointError) as info:
            call()
        for word in fault:
            assert word in str(info.value), (word, str(info.value))
    assert not out.exists()


def test_info_file_that_is_a_fifo_is_refused_without_blocking(dcp_dir, tmp_path):
    (dcp_dir / "shardwise.json").unlink()
    os.mkfifo(dcp_dir / "shardwise.json")
    _both_refuse(dcp_dir, tmp_path / "out", "shardwise.json", "not a regular file")


@pytest.mark.parametrize("content, fault", [
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),          # RecursionError inside json
    ('{"mesh": 5}', "'mesh'"),
    ('{"metadata": ["a"]}', "'metadata'"),
    ('{"plan": {"a": 1}}', "'plan'"),
    ('{"checksums": {"algorithm": "crc32", "chunks": {"w": {"0": "xyz"}}}}', "'checksums'"),
    ('"just a string"', "must be a JSON object"),
])
def test_malformed_info_file_is_a_clean_error(dcp_dir, tmp_path, content, fault):
    (dcp_dir / "shardwise.json").write_text(content)
    _both_refuse(dcp_dir, tmp_path / "out", "shardwise.json", fault)


@pytest.mark.parametrize("victim", [".metadata", "__0_0.distcp", "shardwise.json"])
def test_files_symlinked_out_of_the_folder_are_refused(dcp_dir, tmp_path, victim):
    outside = tmp_path / f"outside-{victim}"
    (dcp_dir / victim).rename(outside)
    (dcp_dir / victim).symlink_to(outside)
    _both_refuse(dcp_dir, tmp_path / "out", "symlink", "outside")


def _rewrite_metadata(folder, change) -> None:
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def test_sizes_beyond_what_the_files_hold_are_refused_before_allocating(dcp_dir, tmp_path):
    # A tensor saved whole has one chunk; growing its size and its chunk together keeps the
    # volume check happy, so only the bound by the stored bytes stops a 40 GB allocation.
    def grow(metadata):
        md = metadata.state_dict_metadata["lin.weight"]
        md.size = torch.Size([100_000, 100_000])
        md.chunks[0].sizes = torch.Size([100_000, 100_000])

    _rewrite_metadata(dcp_dir, grow)
    _both_refuse(dcp_dir, tmp_path / "out", "'lin.weight'", "needs 40000000000 bytes")


def test_dtype_changed_in_the_metadata_is_refused(dcp_dir, tmp_path):
    def narrow(metadata):  # int64 -> int32: half the bytes, so the size bound alone passes
        metadata.state_dict_metadata["ids"].properties.dtype = torch.int32

    _rewrite_metadata(dcp_dir, narrow)
    read_metadata(dcp_dir)  # the map itself is consistent; the blob is not
    with pytest.raises(CheckpointError, match="holds torch.int64 data but the metadata says torch.int32"):
        sw.consolidate(dcp_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _meta(size, chunks, length=10_000) -> Metadata:
    props = TensorProperties(dtype=torch.float32)
    md = TensorStorageMetadata(props, torch.Size(size),
                               [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    storage = {MetadataIndex("w", o): _StorageInfo("__0_0.distcp", 0, length) for o, _ in chunks}
    return Metadata({"w": md}, storage_data=storage)


@pytest.mark.parametrize("chunks, fault", [
    ([((0, 0), (4, 8)), ((5, 0), (4, 8))], "outside shape"),            # a row offset moved down
    ([((0, 0), (4, 8)), ((3, 0), (5, 8))], "not covered"),              # ... and grown to fit
    ([((0, 0), (4, 8)), ((2, 0), (4, 8))], "overlap"),                  # moved up: volumes add up
    ([((0, 0), (8, 4)), ((0, 2), (8, 4)), ((0, 0), (0, 2))], "overlap"),  # columns, and an empty one
    ([((0, 0), (8, 8)), ((0, 0), (0, 0))], None),                      # an empty chunk is harmless
])
def test_chunk_maps_must_tile_each_tensor_exactly(tmp_path, chunks, fault):
    metadata = _meta((8, 8), chunks)
    if fault is None:
        check_chunks(tmp_path, metadata)
        return
    with pytest.raises(CheckpointError, match=fault):
        check_chunks(tmp_path, metadata)


def test_overlap_is_found_for_column_and_row_splits():
    # 4 column chunks + a row chunk over two of their rows: the volumes add up (a hole at the
    # bottom); the sweep runs along the columns and must still compare the chunks that overlap.
    cols = [((0, c), (8, 2)) for c in range(0, 8, 2)]
    with pytest.raises(CheckpointError, match="overlap"):
        check_chunks("mem", _meta((16, 8), cols + [((6, 0), (8, 8))]))
    check_chunks("mem", _meta((16, 8), cols + [((8, 0), (8, 8))]))


def test_a_chunk_without_stored_data_or_with_too_little_is_refused():
    metadata = _meta((4,), [((0,), (4,))], length=15)
    with pytest.raises(CheckpointError, match="needs 16 bytes"):
        check_chunks("mem", metadata)
    metadata = _meta((4,), [((0,), (4,))])
    metadata.storage_data.clear()
    with pytest.raises(CheckpointError, match="no stored data"):
        check_chunks("mem", metadata)


def test_wrong_types_in_the_metadata_are_a_clean_error(dcp_dir, tmp_path):
    def break_types(metadata):
        metadata.state_dict_metadata["lin.bias"].chunks = 5

    _rewrite_metadata(dcp_dir, break_types)
    _both_refuse(dcp_dir, tmp_path / "out", ".metadata", "malformed")


def test_info_file_still_describes_a_good_checkpoint(dcp_dir):
    report = inspect_checkpoint(dcp_dir)
    assert report.layout["checksums"]["algorithm"] == "xxh3_64"
    info = json.loads((dcp_dir / "shardwise.json").read_text())
    assert set(info["checksums"]["chunks"]) == {"lin.weight", "lin.bias", "ids"}


def _damage_data(folder, how: str) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from shardwise.io.formats.dcp.metadata import open_blob

    metadata = read_metadata(folder)
    md = metadata.state_dict_metadata["lin.weight"]
    info = metadata.storage_data[MetadataIndex("lin.weight", md.chunks[0].offsets)]
    path = folder / info.relative_path
    with open(path, "rb") as f:
        meta, base = open_blob(f, info)
    raw = bytearray(path.read_bytes())
    if how == "flip":
        raw[base + 5] ^= 0x04
    else:  # zero the last data bytes and the zip data descriptor after them (its CRC too)
        end = base + meta.nbytes
        raw[end - 4:end + 12] = bytes(16)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how, fault", [("flip", "CRC-32 its zip record holds"),
                                        ("zero", "no zip data descriptor")])
def test_damaged_data_fails_its_zip_crc_when_a_chunk_is_read_whole(dcp_dir, tmp_path, how, fault):
    # torch.load checks each record's CRC-32; shardwise reads the bytes itself, so it checks too
    (dcp_dir / "shardwise.json").unlink()  # not only shardwise's own checksums: any DCP checkpoint
    _damage_data(dcp_dir, how)
    with pytest.raises(CheckpointError, match=fault):
        sw.consolidate(dcp_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    report = sw.verify(dcp_dir)
    assert not report.ok and "zip record" in report.notes[0]
    assert report.mismatched == ["lin.weight@0,0"] if how == "flip" else fault in report.problems[0]


def test_metadata_missing_an_attribute_is_a_clean_error(dcp_dir, tmp_path):
    def rename(metadata):
        del metadata.__dict__["state_dict_metadata"]  # what a flipped byte in the name does

    _rewrite_metadata(dcp_dir, rename)
    _both_refuse(dcp_dir, tmp_path / "out", "not a DCP metadata file")


def test_a_chunk_record_is_read_in_a_few_storage_reads(dcp_dir, tmp_path, monkeypatch):
    # torch.load reads a chunk's zip record in many small reads, seeking backwards from its end:
    # unbuffered each was one storage read (a pread locally, a ranged GET on an object store: 63
    # here), through a BufferedReader still 15; from the record's held ends, one read a chunk
    # plus its CRC descriptor
    from shardwise.io.storage.local import LocalFile

    reads = []
    real = LocalFile.readinto

    def readinto(self, buf, pos):
        if str(self.name).endswith(".distcp"):
            reads.append((pos, len(buf)))
        return real(self, buf, pos)

    monkeypatch.setattr(LocalFile, "readinto", readinto)
    sw.consolidate(dcp_dir, tmp_path / "out")
    chunks = len(read_metadata(dcp_dir).storage_data)
    assert chunks == 3 and 0 < len(reads) <= 2 * chunks, (chunks, reads)
    assert sw.diff(dcp_dir, tmp_path / "out").identical
