"""Sharded safetensors checkpoints (DCP_SHARDING_INFO headers), pure: the chunk map and its
validation, region reads of only the overlapping chunk bytes, the writer's chunk plan. Files
are written with safetensors' own save_file, independent of shardwise's writer."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardwise as sw
from shardwise.core.spec import Region, ShardSpec, local_layout
from shardwise.errors import CheckpointError
from shardwise.io.formats.sharded.source import (
    is_sharded_safetensors,
    read_local,
    read_sharded,
    sharding_metadata,
)
from shardwise.io.formats.sharded.write import assign_chunks, num_files, rank_files
from shardwise.io.read.reader import RegionReader, piece_items

W = torch.arange(32, dtype=torch.float32).reshape(8, 4)   # rows split 2 | 3 | 3 over three files
B = torch.tensor([1.5, -2.0, 3.0, 4.0], dtype=torch.bfloat16)  # replicated, in file 1 only
C = torch.arange(12, dtype=torch.int64).reshape(2, 6)      # columns split 3 | 3


def _file(path: Path, tensors: dict, offsets: dict, **meta) -> None:
    metadata = sharding_metadata(offsets)
    metadata.update(meta)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)


def _folder(root: Path, *, w2=None, w2_offsets=(2, 0), f2_extra=None) -> Path:
    """Three rank files holding W, B and C; the keyword arguments mutate file 2."""
    root.mkdir()
    _file(root / "shard-00001-model-00001-of-00001.safetensors",
          {"w": W[0:2], "b": B, "c": C[:, 0:3]}, {"w": (0, 0), "b": (0,), "c": (0, 0)})
    w2 = W[2:5] if w2 is None else w2
    _file(root / "shard-00002-model-00001-of-00001.safetensors",
          {"w": w2, "c": C[:, 3:6]}, {"w": w2_offsets, "c": (0, 3)}, **(f2_extra or {}))
    _file(root / "shard-00003-model-00001-of-00001.safetensors", {"w": W[5:8]}, {"w": (5, 0)})
    return root


@pytest.fixture
def no_reads(monkeypatch):
    """Fail the test if any tensor byte is read."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor byte was read")
    monkeypatch.setattr("shardwise.io.read.reader.read_region", refuse)


def test_chunk_map_and_detection(tmp_path):
    folder = _folder(tmp_path / "ckpt")
    ckpt = read_sharded(folder)
    assert {n: (t.dtype, t.shape, len(t.chunks)) for n, t in ckpt.tensors.items()} == {
        "w": ("F32", (8, 4), 3), "b": ("BF16", (4,), 1), "c": ("I64", (2, 6), 2)}
    assert is_sharded_safetensors(folder)
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"w": W}, plain / "model.safetensors", metadata={"format": "pt"})
    assert not is_sharded_safetensors(plain)
    # an index names an ordinary checkpoint (torch's consolidation into the same folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "x.safetensors"}}))
    assert not is_sharded_safetensors(folder)


def _whole(reader, ckpt, name):
    t = ckpt.tensors[name]
    zeros = (0,) * len(t.shape)
    return read_local(reader, {name: (t, [(Region(zeros, t.shape), zeros)])}, finalize=lambda k, x: x)[name]


def test_reads_only_overlapping_chunk_bytes(tmp_path):
    ckpt = read_sharded(_folder(tmp_path / "ckpt"))
    with RegionReader(ckpt.headers, num_threads=2) as reader:
        # rows 4..6 of w: the last row of chunk 2 and the first of chunk 3, nothing of chunk 1
        layout = [(Region((4, 0), (2, 4)), (0, 0))]
        got = read_local(reader, {"w": (ckpt.tensors["w"], layout)}, finalize=lambda k, t: t)["w"]
        assert torch.equal(got, W[4:6]) and reader.bytes_read == 2 * 4 * 4
        # a packed-style local tensor: two regions concatenated along dim 0
        spec = ShardSpec(dim=0, blocks=(1, 1))
        layout = local_layout((8, 4), spec, 2, 1)
        got = read_local(reader, {"w": (ckpt.tensors["w"], layout)}, finalize=lambda k, t: t)["w"]
        assert torch.equal(got, torch.cat([W[2:4], W[6:8]]))
        # columns across two files, every dtype byte-exact
        layout = [(Region((0, 2), (2, 3)), (0, 0))]
        got = read_local(reader, {"c": (ckpt.tensors["c"], layout)}, finalize=lambda k, t: t)["c"]
        assert torch.equal(got, C[:, 2:5])
        assert torch.equal(_whole(reader, ckpt, "b"), B) and _whole(reader, ckpt, "b").dtype == torch.bfloat16
    reads = piece_items("w", ckpt.tensors["w"].composite, [(Region((0, 0), (2, 4)), (0, 0))])
    assert [i.path.name for i, _ in reads] == ["shard-00001-model-00001-of-00001.safetensors"]


def test_consolidate_and_inspect(tmp_path):
    import shardwise as sw
    from shardwise.io.check import format_report, inspect_checkpoint

    folder = _folder(tmp_path / "ckpt")
    out = sw.consolidate(folder, tmp_path / "merged")  # dispatched on the headers
    plain = tmp_path / "plain.safetensors"
    save_file({"w": W, "b": B, "c": C}, plain, metadata={"format": "pt"})
    assert (out / "model.safetensors").read_bytes() == plain.read_bytes()
    report = inspect_checkpoint(folder)
    assert "DCP_SHARDING_INFO" in report.kind and len(report.files) == 3
    assert sorted(report.tensors) == [("b", "BF16", (4,), 1), ("c", "I64", (2, 6), 2),
                                      ("w", "F32", (8, 4), 3)]
    text = format_report(report)
    assert "3 tensors" in text and "chunks" in text


@pytest.mark.parametrize("mutation, match", [
    ({"w2_offsets": (1, 0)}, r"shard-00001.* and .*shard-00002.*: tensor 'w': chunks .* overlap"),
    ({"w2": W[2:4]}, r"tensor 'w': its chunks in .*shard-00001.* cover 28 of the 32 elements"),
    ({"w2": torch.zeros(3, 5)}, r"tensor 'w': its chunks in .*shard-00001.* cover 35 of the 40"),
    ({"w2": W[2:5].half()}, r"tensor 'w': its chunk in .*shard-00002.* is F16 .* but .* F32"),
    ({"w2": W[2:5].reshape(3, 2, 2), "w2_offsets": (2, 0, 0)}, r"tensor 'w'.*shape \(3, 2, 2\)"),
    ({"f2_extra": {"DCP_VERSION": "2.0"}}, r"shard-00002.*DCP_VERSION is '2.0'"),
])
def test_mutated_headers_refused_before_any_read(tmp_path, no_reads, mutation, match):
    folder = _folder(tmp_path / "ckpt", **mutation)
    with pytest.raises(CheckpointError, match=match):
        read_sharded(folder)
    with pytest.raises(CheckpointError, match=match):
        sw.consolidate(folder, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def _rewrite_info(path: Path, edit) -> None:
    """Rewrite the DCP_SHARDING_INFO of ``path`` through ``edit`` (same tensors and bytes)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    info = json.loads(meta["DCP_SHARDING_INFO"])
    edit(info)
    meta["DCP_SHARDING_INFO"] = json.dumps(info)
    save_file(tensors, path, metadata=meta)


@pytest.mark.parametrize("edit, match", [
    (lambda i: i.pop("c"), r"shard-00002.*: tensor 'c' has no entry in DCP_SHARDING_INFO"),
    (lambda i: i.update(x={"saved_offsets": [0]}), r"shard-00002.*lists tensor 'x'"),
    (lambda i: i.update(c={"saved_offsets": [0]}), r"shard-00002.*tensor 'c'.*2 non-negative ints"),
    (lambda i: i.update(c={"saved_offsets": [0, -3]}), r"shard-00002.*tensor 'c'"),
])
def test_sharding_info_must_match_the_entries(tmp_path, no_reads, edit, match):
    folder = _folder(tmp_path / "ckpt")
    _rewrite_info(folder / "shard-00002-model-00001-of-00001.safetensors", edit)
    with pytest.raises(CheckpointError, match=match):
        read_sharded(folder)


def test_a_missing_file_is_named(tmp_path, no_reads):
    folder = _folder(tmp_path / "ckpt")
    (folder / "shard-00002-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"tensor 'w': its chunks .* cover 20 of the 32"):
        read_sharded(folder)
    # the last rows missing leave a smaller tensor that tiles: shardwise.json's shapes catch it
    folder = _folder(tmp_path / "ckpt2")
    (folder / "shardwise.json").write_text(json.dumps(
        {"tensors": {"w": {"dtype": "F32", "shape": [8, 4]}, "b": {"dtype": "BF16", "shape": [4]},
                     "c": {"dtype": "I64", "shape": [2, 6]}}}))
    read_sharded(folder)
    (folder / "shard-00003-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"tensor 'w': shardwise.json records shape \(8, 4\) "
                                              r"but its chunks make \(5, 4\)"):
        read_sharded(folder)
    # an ordinary file among the shards
    save_file({"w": W}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.safetensors: its header has no DCP_SHARDING_INFO"):
        read_sharded(folder)


# --- the writer's plan ------------------------------------------------------------------------

def _held(name, shape, regions, dtype="F32"):
    return [(name, dtype, shape, r) for r in regions]


def test_assign_chunks_writes_replicated_once_and_balances():
    spec = ShardSpec(dim=0, blocks=(1, 1))  # a packed weight: two regions per rank
    held = [_held("w", (8, 4), [r for r, _ in local_layout((8, 4), spec, 2, rank)])
            + _held("norm", (4,), [Region((0,), (4,))]) + _held("bias", (6,), [Region((0,), (6,))])
            for rank in range(2)]
    assigned = assign_chunks(held)
    assert sorted(c[0] for rank in assigned for c in rank) == ["bias", "norm", "w", "w", "w", "w"]
    assert {c[0] for c in assigned[0] if c[0] != "w"} != {c[0] for c in assigned[1] if c[0] != "w"}
    assert num_files(assigned) == 2
    files = rank_files(assigned[1], 1, 2)
    assert [f for f, _ in files] == ["shard-00002-model-00001-of-00002.safetensors",
                                     "shard-00002-model-00002-of-00002.safetensors"]
    assert [[c[3] for c in group if c[0] == "w"] for _, group in files] == [
        [Region((2, 0), (2, 4))], [Region((6, 0), (2, 4))]]


def test_assign_chunks_refuses_what_would_not_load():
    with pytest.raises(CheckpointError, match=r"tensor 'w' is F32 of shape \(8, 4\) on rank 1 but "
                                              r"F32 of shape \(6, 4\) on rank 0"):
        assign_chunks([_held("w", (6, 4), [Region((0, 0), (3, 4))]),
                       _held("w", (8, 4), [Region((4, 0), (4, 4))])])
    with pytest.raises(CheckpointError, match=r"tensor 'w': its chunks in rank 0, rank 1 cover 24 of the 32"):
        assign_chunks([_held("w", (8, 4), [Region((0, 0), (2, 4))]),
                       _held("w", (8, 4), [Region((4, 0), (4, 4))])])


def test_single_process_save_round_trip(tmp_path):
    import shardwise as sw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)
    model.register_buffer("steps", torch.arange(5))
    sw.save(model, tmp_path / "ckpt", distributed=True, format="safetensors")
    ckpt = read_sharded(tmp_path / "ckpt")
    assert [f.name for f in ckpt.files] == ["shard-00001-model-00001-of-00001.safetensors"]
    with RegionReader(ckpt.headers, num_threads=1) as reader:
        for name, t in model.state_dict().items():
            got = _whole(reader, ckpt, name)
            assert torch.equal(got, t) and got.dtype == t.dtype, name
    with pytest.raises(ValueError, match="no checkpoint format named 'npz'; known formats: dcp, sharded"):
        sw.save(model, tmp_path / "other", distributed=True, format="npz")
    with pytest.raises(ValueError, match="async_save=True is not supported with format='safetensors'"):
        sw.save(model, tmp_path / "other", distributed=True, format="safetensors", async_save=True)
    with pytest.raises(CheckpointError, match="already exists"):
        sw.save(model, tmp_path / "ckpt", distributed=True, format="safetensors")
