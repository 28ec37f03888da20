"""Safetensors headers, box reads, the streaming writer and checkpoint resolution.

Reference files come from ``safetensors.torch.save_file``; results are checked
against ``safetensors.torch.load_file`` / ``safe_open``. Malformed files are
written by hand, byte by byte.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardwise.core.header import (
    MAX_HEADER_SIZE,
    TensorEntry,
    dtype_to_str,
    layout_header,
    parse_header,
    region_runs,
    str_to_dtype,
)
from shardwise.errors import CheckpointError
from shardwise.io.formats.safetensors.checkpoint import Checkpoint, resolve_checkpoint
from shardwise.io.formats.safetensors.files import (
    StreamingWriter,
    index_json,
    parse_size,
    plan_files,
    read_header,
)
from shardwise.io.read.mapped import read_region
from shardwise.io.storage import locate
from shardwise.io.storage.posix import Writeback

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


def read_tensor(handle, file_header, entry) -> torch.Tensor:
    """The whole tensor ``entry`` as a fresh CPU tensor (read_region of its every element)."""
    out = torch.empty(entry.shape, dtype=entry.torch_dtype)
    read_region(handle, file_header, entry, (0,) * len(entry.shape), entry.shape, out)
    return out


def make_tensor(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    # small integers are exact in every dtype, including bf16 and the float8s
    return torch.randint(0, 7, shape, generator=g).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (works for dtypes torch.equal does not know)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def raw_file(path: Path, header: bytes | dict, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + raw + data)
    return path


def raises_naming(path: Path, *fault: str):
    """pytest.raises(CheckpointError) whose message names the file and the fault words."""
    pattern = re.escape(path.name) + "".join(f"(?s:.*){re.escape(f)}" for f in fault)
    return pytest.raises(CheckpointError, match=pattern)


# --- dtypes and headers ----------------------------------------------------------------------

def test_dtype_table_round_trips_and_refuses_unknown():
    for dtype in DTYPES + [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]:
        assert str_to_dtype(dtype_to_str(dtype)) is dtype
    assert dtype_to_str(torch.bfloat16) == "BF16" and dtype_to_str(torch.float8_e4m3fn) == "F8_E4M3"
    with pytest.raises(CheckpointError, match="F7"):
        str_to_dtype("F7")
    with pytest.raises(CheckpointError):
        dtype_to_str(torch.qint8)


def test_read_header_matches_safe_open(tmp_path):
    tensors = {"a": torch.zeros(3, 5), "b": torch.zeros(2, dtype=torch.bfloat16),
               "c": torch.tensor(True), "d": torch.zeros(0, 4, dtype=torch.int64)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path, metadata={"k": "v"})
    header = read_header(path)
    assert header.metadata == {"k": "v"}
    assert header.source == str(path)
    assert header.data_start == 8 + int.from_bytes(path.read_bytes()[:8], "little")
    with safe_open(path, "pt") as f:
        assert sorted(header.entries) == sorted(f.keys())
        for name, entry in header.entries.items():
            assert entry.name == name
            assert list(entry.shape) == f.get_slice(name).get_shape()
            assert entry.dtype == f.get_slice(name).get_dtype()
            assert entry.nbytes == tensors[name].numel() * tensors[name].element_size()
            assert entry.torch_dtype == tensors[name].dtype


def test_layout_header_loads_in_safetensors(tmp_path):
    specs = [("w", "F32", (2, 3)), ("é", "BOOL", (5,)), ("s", "I64", ())]
    prefix, offsets = layout_header(specs)
    assert len(prefix) % 8 == 0
    assert offsets == {"w": (0, 24), "é": (24, 29), "s": (29, 37)}
    path = tmp_path / "h.safetensors"
    path.write_bytes(prefix + bytes(37))
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("s").shape == ()
    assert layout_header([("x", "F16", (1,))], {"a": "b"})[0].find(b'"format"') == -1


@pytest.mark.parametrize("specs, metadata", [
    ([("a", "F32", (1,)), ("a", "F32", (1,))], None),
    ([("__metadata__", "F32", (1,))], None),
    ([("a", "F7", (1,))], None),
    ([("a", "F32", (-1,))], None),
    ([("a", "F32", (1,))], {"k": 1}),
])
def test_layout_header_refuses_bad_specs(specs, metadata):
    with pytest.raises(CheckpointError):
        layout_header(specs, metadata)


# --- region runs -----------------------------------------------------------------------------

def test_region_runs_merges_full_trailing_dims():
    assert region_runs((), 4, (), ()) == [(0, 4)]
    assert region_runs((4, 6), 2, (0, 0), (4, 6)) == [(0, 48)]
    assert region_runs((4, 6), 2, (1, 0), (2, 6)) == [(12, 24)]
    assert region_runs((4, 6), 2, (0, 2), (2, 3)) == [(4, 6), (16, 6)]
    assert region_runs((3, 4, 5), 1, (1, 0, 0), (2, 4, 5)) == [(20, 40)]
    assert region_runs((3, 1, 5), 1, (0, 0, 1), (1, 1, 2)) == [(1, 2)]
    assert region_runs((3, 4, 5), 1, (0, 0, 0), (2, 2, 5)) == [(0, 10), (20, 10)]
    assert region_runs((3, 4), 4, (1, 1), (0, 2)) == []
    with pytest.raises(ValueError):
        region_runs((3, 4), 4, (2, 0), (2, 4))
    with pytest.raises(ValueError):
        region_runs((3, 4), 4, (0,), (3,))


def test_region_runs_column_slice_of_large_tensor_is_one_run_per_row():
    runs = region_runs((4096, 16384), 2, (0, 4096), (4096, 4096))
    assert len(runs) == 4096
    assert runs[0] == (4096 * 2, 4096 * 2)
    assert runs[-1] == (4095 * 16384 * 2 + 4096 * 2, 4096 * 2)


@st.composite
def shape_and_box(draw, max_ndim=4, max_dim=5):
    shape = tuple(draw(st.lists(st.integers(0, max_dim), max_size=max_ndim)))
    offsets, sizes = [], []
    for d in shape:
        o = draw(st.integers(0, d))
        offsets.append(o)
        sizes.append(draw(st.integers(0, d - o)))
    return shape, tuple(offsets), tuple(sizes)


@settings(max_examples=200, deadline=None)
@given(shape_and_box(), st.sampled_from([1, 2, 4, 8]))
def test_region_runs_cover_exactly_the_box_in_order(box, itemsize):
    shape, offsets, sizes = box
    runs = region_runs(shape, itemsize, offsets, sizes)
    index = torch.arange(math.prod(shape)).reshape(shape)
    expected = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
    covered = [b // itemsize for start, length in runs for b in range(start, start + length, itemsize)]
    assert covered == expected.tolist()
    assert all(length > 0 and start % itemsize == 0 for start, length in runs)
    # maximal: no run ends where the next one begins
    assert all(a[0] + a[1] != b[0] for a, b in zip(runs, runs[1:], strict=False))


# --- reading boxes ---------------------------------------------------------------------------

@settings(max_examples=120, deadline=None)
@given(shape_and_box(), st.sampled_from(DTYPES), st.integers(0, 2**16))
def test_read_region_matches_safetensors_slicing(box, dtype, seed):
    shape, offsets, sizes = box
    tensor = make_tensor(shape, dtype, seed)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.safetensors"
        # a neighbour of another dtype, so the entry starts mid-data
        save_file({"t": tensor, "a_pad": torch.ones(3, dtype=torch.int8)}, path)
        loaded = load_file(path)["t"]
        header = read_header(path)
        entry = header.entries["t"]
        out = torch.full(sizes, 1, dtype=dtype)
        fd = locate(path).open()
        try:
            nbytes = read_region(fd, header, entry, offsets, sizes, out)
            whole = read_tensor(fd, header, entry)
        finally:
            fd.close()
    box_slices = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    assert same(out, loaded[box_slices])
    assert nbytes == math.prod(sizes) * tensor.element_size()
    assert same(whole, loaded)


def test_read_region_reads_only_the_box(tmp_path, monkeypatch):
    tensor = make_tensor((64, 96), torch.bfloat16)
    path = tmp_path / "w.safetensors"
    save_file({"w": tensor}, path)
    header = read_header(path)
    entry = header.entries["w"]
    reads = []
    real_preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        reads.append((offset, sum(len(b) for b in buffers)))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    local = torch.empty(64, 2 * 32, dtype=torch.bfloat16).view(2, 64, 32)  # two regions, one buffer
    with closing(locate(path).open()) as f:
        read_region(f, header, entry, (0, 32), (64, 32), local[1])
        read_region(f, header, entry, (0, 0), (64, 32), local[0])
    assert same(local[1], tensor[:, 32:64]) and same(local[0], tensor[:, :32])
    assert sum(n for _, n in reads) == 2 * 64 * 32 * 2
    lo, hi = header.data_start + entry.start, header.data_start + entry.end
    assert all(lo <= off and off + n <= hi for off, n in reads)


def test_read_region_refuses_bad_out(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(4, 6)}, path)
    header = read_header(path)
    entry = header.entries["w"]
    with closing(locate(path).open()) as f:
        for out in (torch.empty(4, 6).t(), torch.empty(4, 3, dtype=torch.float16), torch.empty(2, 3)):
            with pytest.raises(ValueError):
                read_region(f, header, entry, (0, 0), (4, 3), out)
        other = TensorEntry("v", "F32", (4, 6), 0, 96)
        with pytest.raises(ValueError):
            read_region(f, header, other, (0, 0), (4, 6), torch.empty(4, 6))


def test_read_region_on_file_truncated_after_header_read(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file({"w": torch.ones(8, 8)}, path)
    header = read_header(path)
    os.truncate(path, path.stat().st_size - 20)
    with closing(locate(path).open()) as f, raises_naming(path, "'w'", "truncated"):
        read_tensor(f, header, header.entries["w"])


# --- malformed files -------------------------------------------------------------------------

def good_entry(**over):
    return {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16], **over}


@pytest.mark.parametrize("case, header, data, length, fault", [
    ("header_beyond_file", {"w": good_entry()}, bytes(16), 4096, "past the end"),
    ("huge_length", {"w": good_entry()}, bytes(16), MAX_HEADER_SIZE + 1, "cap"),
    ("zero_length", b"", b"", 0, "not positive"),
    ("not_json", b"{not json", bytes(16), None, "not valid JSON"),
    ("not_utf8", b'{"\xff":1}', b"", None, "UTF-8"),
    ("not_object", b"[1, 2]", b"", None, "object"),
    ("unknown_dtype", {"w": good_entry(dtype="F7")}, bytes(16), None, "unknown dtype"),
    ("offsets_out_of_range", {"w": good_entry()}, bytes(8), None, "outside"),
    ("negative_offset", {"w": good_entry(data_offsets=[-4, 12])}, bytes(16), None, "outside"),
    ("offsets_not_ints", {"w": good_entry(data_offsets=[0.0, 16])}, bytes(16), None, "two ints"),
    ("size_mismatch", {"w": good_entry(data_offsets=[0, 12])}, bytes(16), None, "needs 16"),
    ("negative_shape", {"w": good_entry(shape=[-2, -2])}, bytes(16), None, "non-negative"),
    ("bool_in_shape", {"w": good_entry(shape=[True, 4], data_offsets=[0, 16])}, bytes(16), None, "shape"),
    ("missing_key", {"w": {"dtype": "F32", "shape": [1]}}, bytes(4), None, "data_offsets"),
    ("overlap", {"a": good_entry(), "b": good_entry(data_offsets=[8, 24])}, bytes(24), None, "overlap"),
    ("bad_metadata", {"__metadata__": {"k": 1}, "w": good_entry()}, bytes(16), None, "__metadata__"),
    ("duplicate_tensor", b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                         b'"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', bytes(2), None, "repeats"),
])
def test_malformed_header_is_refused_naming_the_file(tmp_path, case, header, data, length, fault):
    path = raw_file(tmp_path / f"{case}.safetensors", header, data, length)
    with raises_naming(path, fault):
        read_header(path)
    with raises_naming(path, fault):
        resolve_checkpoint(path)


def test_truncated_files_are_refused(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x10\x00\x00")
    with raises_naming(short, "truncated"):
        read_header(short)
    cut = tmp_path / "cut.safetensors"
    save_file({"w": torch.ones(16)}, cut)
    os.truncate(cut, cut.stat().st_size - 4)
    with raises_naming(cut, "'w'", "outside"):
        read_header(cut)


def test_parse_header_accepts_empty_tensors_tiling_the_data():
    raw = json.dumps({"a": {"dtype": "U8", "shape": [0], "data_offsets": [4, 4]},
                      "c": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                      "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}}).encode()
    header = parse_header(raw, data_size=6, source="mem")
    assert header.entries["b"] == TensorEntry("b", "U8", (2,), 4, 6)
    assert header.data_start == 8 + len(raw)


@pytest.mark.parametrize("offsets, data_size, fault", [
    ({"a": [0, 2], "b": [4, 6]}, 6, "bytes [2, 4)"),       # a hole between tensors
    ({"a": [2, 4], "b": [4, 6]}, 6, "bytes [0, 2)"),       # a hole at the start
    ({"a": [0, 2], "b": [2, 4]}, 6, "2 trailing bytes"),   # bytes after the last tensor
])
def test_parse_header_refuses_data_not_tiled_exactly(offsets, data_size, fault):
    raw = json.dumps({n: {"dtype": "U8", "shape": [2], "data_offsets": o} for n, o in offsets.items()})
    with pytest.raises(CheckpointError, match=re.escape(fault)):
        parse_header(raw.encode(), data_size=data_size, source="mem")


def test_header_length_shortened_into_its_padding_is_refused(tmp_path):
    # The length prefix moved back into the space padding shifts the data section: the JSON
    # still parses, every offset still fits, and only the tiling check sees the fault.
    path = tmp_path / "short.safetensors"
    save_file({"w": torch.tensor([1.0, 2.0, 3.0, 4.0])}, path)
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    assert raw[8 + n - 1:8 + n] == b" "  # the JSON ends in padding
    raw[:8] = (n - 1).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(Exception):  # noqa: B017 - the reference reader refuses it too
        load_file(path)
    with raises_naming(path, "trailing bytes"):
        read_header(path)


def test_lone_surrogate_in_a_name_is_refused(tmp_path):
    path = raw_file(tmp_path / "s.safetensors",
                    b'{"w\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x01")
    with raises_naming(path, "surrogate"):
        read_header(path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"\\udfff": "s.safetensors"}}')
    with raises_naming(index, "surrogate"):
        resolve_checkpoint(index)


def test_cli_inspect_prints_any_name_on_an_ascii_terminal(tmp_path, monkeypatch, capsys):
    import io
    import sys

    from shardwise.cli import main

    save_file({"poids_é_重み": torch.ones(2)}, tmp_path / "model.safetensors")
    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    assert main(["inspect", str(tmp_path)]) == 0
    ascii_out.seek(0)
    assert "poids_\\xe9_\\u91cd\\u307f" in ascii_out.read()


# --- streaming writer ------------------------------------------------------------------------

def all_dtype_tensors() -> dict[str, torch.Tensor]:
    tensors = {f"t_{dtype_to_str(d)}": make_tensor((3, 5), d, i) for i, d in enumerate(DTYPES)}
    for d in (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2):
        tensors[f"t_{dtype_to_str(d)}"] = make_tensor((7,), torch.uint8).to(d)
    tensors["scalar_i64"] = torch.tensor(-3, dtype=torch.int64)
    tensors["scalar_bool"] = torch.tensor(True)
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    tensors["transposed"] = make_tensor((4, 6), torch.float32).t()
    return tensors


def specs_of(tensors, order):
    return [(n, dtype_to_str(tensors[n].dtype), tuple(tensors[n].shape)) for n in order]


def test_streaming_writer_is_byte_identical_to_save_file(tmp_path):
    tensors = all_dtype_tensors()
    ref = tmp_path / "ref.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, ref, metadata={"format": "pt"})
    order = list(read_header(ref).entries)  # save_file's order: by dtype alignment, then name
    out = tmp_path / "out.safetensors"
    with StreamingWriter(out, specs_of(tensors, order)) as w:
        for name in order:
            w.write(name, tensors[name])
    # identical, header and data, when given save_file's order and metadata
    assert out.read_bytes() == ref.read_bytes()
    loaded = load_file(out)
    assert loaded.keys() == tensors.keys()
    assert all(same(loaded[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("name_len", range(1, 9))  # every header length mod 8
def test_header_padding_matches_save_file(tmp_path, name_len):
    name = "x" * name_len
    ref, out = tmp_path / "ref.safetensors", tmp_path / "out.safetensors"
    save_file({name: torch.ones(1)}, ref, metadata={"format": "pt"})
    with StreamingWriter(out, [(name, "F32", (1,))]) as w:
        w.write(name, torch.ones(1))
    assert out.read_bytes() == ref.read_bytes()


def test_streaming_writer_any_order_loads_in_safetensors(tmp_path):
    tensors = all_dtype_tensors()
    order = sorted(tensors, reverse=True)
    out = tmp_path / "any.safetensors"
    with StreamingWriter(out, specs_of(tensors, order), metadata={"who": "test"}) as w:
        for name in order:
            w.write(name, tensors[name])
    with safe_open(out, "pt") as f:
        assert f.metadata() == {"who": "test"}
        assert all(same(f.get_tensor(k), v) for k, v in tensors.items())
    assert list(read_header(out).entries) == order
    assert [p.name for p in tmp_path.iterdir()] == ["any.safetensors"]


def test_streaming_writer_checksums_what_it_writes(tmp_path):
    from shardwise.io.info import collect_checksums

    tensors = {"big": torch.arange(1_300_000, dtype=torch.float32).reshape(1300, 1000),  # 3 blocks
               "col": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),          # not contiguous
               "empty": torch.zeros(0, 3)}
    path = tmp_path / "c.safetensors"
    with collect_checksums() as sums:
        with StreamingWriter(path, specs_of(tensors, list(tensors))) as w:
            for name, t in tensors.items():
                w.write(name, t)
        unfinished = tmp_path / "x.safetensors"
        with pytest.raises(RuntimeError), StreamingWriter(unfinished, [("z", "F32", (1,))]) as w:
            w.write("z", torch.ones(1))
            raise RuntimeError("a file that is not completed reports nothing")
    data = path.read_bytes()
    header = read_header(path)
    for name, entry in header.entries.items():
        raw = data[header.data_start + entry.start:header.data_start + entry.end]
        assert w is not None and sums[name] == xxhash.xxh3_64_hexdigest(raw), name
    assert set(sums) == set(tensors)
    with StreamingWriter(tmp_path / "n.safetensors", [("a", "F32", (1,))], checksums=False) as w:
        w.write("a", torch.ones(1))
    assert w.checksums == {}


def test_streaming_writer_misuse(tmp_path):
    path = tmp_path / "m.safetensors"
    specs = [("a", "F32", (2,)), ("b", "I64", (3,))]
    w = StreamingWriter(path, specs)
    with pytest.raises(CheckpointError, match="expected 'a'"):
        w.write("b", torch.zeros(3, dtype=torch.int64))
    with pytest.raises(CheckpointError, match="must be torch.float32"):
        w.write("a", torch.zeros(2, dtype=torch.float64))
    with pytest.raises(CheckpointError, match=re.escape("(2,)")):
        w.write("a", torch.zeros(3))
    w.write("a", torch.zeros(2))
    with pytest.raises(CheckpointError, match="unwritten"):
        w.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="closed"):
        w.write("b", torch.zeros(3, dtype=torch.int64))
    with StreamingWriter(path, specs[:1]) as w:
        w.write("a", torch.zeros(2))
        with pytest.raises(CheckpointError, match="all 1 tensors"):
            w.write("b", torch.zeros(3, dtype=torch.int64))
    assert same(load_file(path)["a"], torch.zeros(2))


def test_exception_inside_writer_leaves_no_file_and_keeps_the_old_one(tmp_path):
    fresh = tmp_path / "fresh.safetensors"
    with pytest.raises(RuntimeError, match="boom"):
        with StreamingWriter(fresh, [("a", "F32", (1000,))]) as w:
            w.write("a", torch.ones(1000))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old.safetensors"
    save_file({"x": torch.ones(1)}, old)
    before = old.read_bytes()
    with pytest.raises(RuntimeError):
        with StreamingWriter(old, [("a", "F32", (1,))]):
            raise RuntimeError("boom")
    assert old.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["old.safetensors"]


# --- checkpoint folders ----------------------------------------------------------------------

def write_sharded(folder: Path, tensors, max_shard_size, prefix="model") -> list:
    folder.mkdir(parents=True, exist_ok=True)
    specs = specs_of(tensors, list(tensors))
    plan = plan_files(specs, max_shard_size, prefix)
    for fname, group in plan:
        with StreamingWriter(folder / fname, group) as w:
            for name, _, _ in group:
                w.write(name, tensors[name])
    if len(plan) > 1:
        total = sum(tensors[n].numel() * tensors[n].element_size() for n in tensors)
        (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps(index_json(plan, total)))
    return plan


def load_all(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    result = {}
    for name in ckpt.names:
        path, entry = ckpt.entry(name)
        with closing(locate(path).open()) as f:
            result[name] = read_tensor(f, ckpt.headers[path], entry)
    return result


def test_resolve_sharded_single_and_index_paths(tmp_path):
    tensors = {f"blocks.{i}.w": make_tensor((8, 8), torch.float32, i) for i in range(5)}
    folder = tmp_path / "dit"
    plan = write_sharded(folder, tensors, "600B", prefix="diffusion_pytorch_model")
    names = [f"diffusion_pytorch_model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [f for f, _ in plan] == names
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    for where in (folder, index):
        ckpt = resolve_checkpoint(where)
        assert ckpt.root == locate(folder) and len(ckpt.files) == 3
        assert ckpt.names == list(tensors) and ckpt.total_size == 5 * 256
        assert all(same(load_all(ckpt)[k], v) for k, v in tensors.items())
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        ckpt.entry("nope")
    single = tmp_path / "single"
    write_sharded(single, tensors, "1GB")
    for where in (single, single / "model.safetensors"):
        ckpt = resolve_checkpoint(where)
        assert ckpt.files == [locate(single / "model.safetensors")]
        assert all(same(load_all(ckpt)[k], v) for k, v in tensors.items())


def sharded_with_index(folder: Path, weight_map: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"a": torch.ones(2)}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(2)}, folder / "model-00002-of-00002.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 16}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("weight_map, fault", [
    ({"a": "../evil.safetensors"}, "outside"),
    ({"a": "/abs/evil.safetensors"}, "outside"),
    ({"a": "model-00009-of-00009.safetensors"}, "does not exist"),
    ({"a": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}, "'c'"),
    ({"a": "pytorch_model.bin"}, "not safetensors"),
])
def test_bad_index_is_refused_naming_the_index(tmp_path, weight_map, fault):
    save_file({"a": torch.ones(2)}, tmp_path / "evil.safetensors")
    index = sharded_with_index(tmp_path / "ckpt", weight_map)
    with raises_naming(index, fault):
        resolve_checkpoint(index.parent)


def test_index_naming_a_file_longer_than_the_os_allows_is_refused(tmp_path):
    index = sharded_with_index(tmp_path, {"a": "x" * 5000 + ".safetensors"})
    with raises_naming(index, "cannot be looked up"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="cannot read"):
        resolve_checkpoint(tmp_path / ("y" * 5000))


def test_index_symlinked_out_of_the_folder_is_refused(tmp_path):
    elsewhere = sharded_with_index(tmp_path / "elsewhere", {"a": "model-00001-of-00002.safetensors",
                                                            "b": "model-00002-of-00002.safetensors"})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in elsewhere.parent.glob("*.safetensors"):  # the shards are real files in the folder
        (ckpt / f.name).write_bytes(f.read_bytes())
    (ckpt / elsewhere.name).symlink_to(elsewhere)
    with raises_naming(ckpt / elsewhere.name, "symlink", "outside"):
        resolve_checkpoint(ckpt)
    with raises_naming(ckpt / elsewhere.name, "symlink", "outside"):
        resolve_checkpoint(ckpt / elsewhere.name)
    assert resolve_checkpoint(elsewhere.parent).names == ["a", "b"]


@pytest.mark.parametrize("content, fault", [
    ("not json", "not valid JSON"),
    ('{"weight_map": {"a": 1}}', "weight_map"),
    ('{"metadata": {}}', "weight_map"),
])
def test_malformed_index_is_refused(tmp_path, content, fault):
    index = sharded_with_index(tmp_path, {})
    index.write_text(content)
    with raises_naming(index, fault):
        resolve_checkpoint(index)


def test_tensor_in_two_files_is_refused(tmp_path):
    index = sharded_with_index(tmp_path, {"a": "model-00001-of-00002.safetensors",
                                          "b": "model-00002-of-00002.safetensors"})
    save_file({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "model-00002-of-00002.safetensors")
    with raises_naming(index, "'a'", "both"):
        resolve_checkpoint(tmp_path)


def test_symlink_escaping_the_folder_is_refused_but_hub_cache_is_not(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "outside.safetensors")
    ckpt = tmp_path / "ckpt"
    index = sharded_with_index(ckpt, {"a": "model-00001-of-00002.safetensors",
                                      "b": "model-00002-of-00002.safetensors"})
    shard = ckpt / "model-00001-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to(tmp_path / "outside.safetensors")
    with raises_naming(index, "symlink", "outside"):
        resolve_checkpoint(ckpt)
    # huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    save_file({"a": torch.ones(2)}, repo / "blobs" / "deadbeef")
    (snap / "model.safetensors").symlink_to(Path("../../blobs/deadbeef"))
    assert resolve_checkpoint(snap).names == ["a"]


def test_pickle_and_missing_checkpoints_are_refused(tmp_path):
    binfile = tmp_path / "model.bin"
    binfile.write_bytes(b"\x80\x04not really a pickle")
    with raises_naming(binfile, "never unpickles", "save_file"):
        resolve_checkpoint(binfile)
    only_bin = tmp_path / "hf"
    only_bin.mkdir()
    (only_bin / "pytorch_model.bin").write_bytes(b"\x80\x04")
    (only_bin / "config.json").write_text("{}")
    with raises_naming(only_bin / "pytorch_model.bin", "never unpickles", "save_file"):
        resolve_checkpoint(only_bin)
    two = tmp_path / "two"
    two.mkdir()
    save_file({"a": torch.ones(1)}, two / "x.safetensors")
    save_file({"b": torch.ones(1)}, two / "y.safetensors")
    with raises_naming(two, "no", "index"):
        resolve_checkpoint(two)
    empty = tmp_path / "empty"
    empty.mkdir()
    with raises_naming(empty, "no .safetensors"):
        resolve_checkpoint(empty)
    with raises_naming(tmp_path / "missing", "no such"):
        resolve_checkpoint(tmp_path / "missing")
    other = tmp_path / "notes.txt"
    other.write_text("hi")
    with raises_naming(other, "not a .safetensors"):
        resolve_checkpoint(other)


# --- sizes and file plans --------------------------------------------------------------------

def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1GiB") == 2**30
    assert parse_size(" 2 KiB ") == 2048
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == parse_size(4096) == 4096
    for bad in ("5Gb", "5 XB", "GB", "", "-1GB", "0", 0, -5, True, None, 1.5):
        with pytest.raises(CheckpointError, match="size"):
            parse_size(bad)


def test_plan_files_and_index_json():
    specs = [("a", "F32", (100,)), ("b", "F32", (100,)), ("big", "F32", (1000,)), ("c", "BF16", (10,))]
    plan = plan_files(specs, "800B", "model")
    # huggingface_hub's rule (save_pretrained's): an oversized tensor's file comes when the
    # tensor is met, while the file being filled goes on (tests/hf compares with the hub).
    assert [(f, [s[0] for s in g]) for f, g in plan] == [
        ("model-00001-of-00003.safetensors", ["big"]),
        ("model-00002-of-00003.safetensors", ["a", "b"]),
        ("model-00003-of-00003.safetensors", ["c"]),
    ]
    assert plan_files(specs, "1GB", "m") == [("m.safetensors", specs)]
    assert plan_files([], 10, "m") == [("m.safetensors", [])]
    index = index_json(plan, 4820, {"format": "pt"})
    assert index["metadata"] == {"total_size": 4820, "format": "pt"}
    assert index["weight_map"] == {"a": plan[1][0], "b": plan[1][0], "big": plan[0][0], "c": plan[2][0]}
    with pytest.raises(CheckpointError, match="twice"):
        plan_files(specs + specs[:1], "1GB", "m")
    with pytest.raises(CheckpointError, match="prefix"):
        plan_files(specs, "1GB", "../m")


def test_read_region_completes_short_reads(tmp_path, monkeypatch):
    # The kernel may return fewer bytes than asked (signals, network filesystems): the
    # remainder of every run must still be read, at the right offset.
    import shardwise.io.storage.posix as sio  # where the byte-level reads live

    t = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    path = tmp_path / "m.safetensors"
    save_file({"w": t}, str(path))
    real = sio._pread_some
    calls = []

    def short(fd, buf, pos):
        calls.append(len(buf))
        return real(fd, buf[: max(1, len(buf) // 3)], pos)  # at most a third each time

    monkeypatch.setattr(sio, "_pread_some", short)
    header = read_header(path)
    out = torch.empty(64, 12)
    with closing(locate(path).open()) as f:
        n = read_region(f, header, header.entries["w"], (0, 24), (64, 12), out)
    assert n == out.numel() * 4
    assert torch.equal(out, t[:, 24:36])
    assert len(calls) > 64  # every row run needed more than one read


def test_reading_and_writing_need_no_numpy(tmp_path):
    # numpy is not a dependency of torch's CPU wheels nor of shardwise: a fresh install has none.
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["numpy"] = None  # any import of numpy now fails
import torch
from shardwise.io.formats.safetensors.files import StreamingWriter, read_header
from shardwise.io.read.mapped import read_region
t = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
path = {str(tmp_path / "m.safetensors")!r}
with StreamingWriter(path, [("w", "BF16", (4, 6))]) as w:
    w.write("w", t)
h = read_header(path)
out = torch.empty(4, 3, dtype=torch.bfloat16)
from shardwise.io.storage import locate
read_region(locate(path).open(), h, h.entries["w"], (0, 3), (4, 3), out)
assert torch.equal(out, t[:, 3:]), out
"""
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(sys.platform != "linux", reason="sync_file_range is Linux's; elsewhere fsync does it all")
@pytest.mark.parametrize("sequential", [True, False])
def test_writeback_starts_every_stretch_and_keeps_the_bytes(tmp_path, sequential):
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * (14 << 10)  # 3.5 MiB
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        writeback = Writeback(fd, sequential=sequential, every=1 << 20)
        for start in range(0, len(data), 512 << 10):
            os.write(fd, data[start:start + (512 << 10)])
            writeback.wrote(512 << 10)
        assert writeback.started == 3 << 20  # told at 1, 2 and 3 MiB; the last half is fsync's
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data


@pytest.mark.skipif(sys.platform != "linux", reason="sync_file_range is Linux's")
def test_writeback_on_a_pipe_gives_up_quietly():
    read, write = os.pipe()
    try:
        writeback = Writeback(write, sequential=True, every=4)
        os.write(write, b"12345678")
        writeback.wrote(8)  # ESPIPE: nothing started, and no error
        writeback.wrote(8)
        assert writeback.started == 0 and os.read(read, 8) == b"12345678"
    finally:
        os.close(read)
        os.close(write)
