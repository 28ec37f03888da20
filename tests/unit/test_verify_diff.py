"""``sw.verify`` and ``sw.diff`` (and their commands) on checkpoints saved in one process;
the distributed saves are checked in tests/dist/test_reliability.py."""

from __future__ import annotations

import json
import zlib

import pytest
import torch
import xxhash
from safetensors.torch import save_file
from torch import nn

import shardwise as sw
from shardwise.cli import main
from shardwise.io.formats.dcp.metadata import open_blob, read_metadata
from shardwise.io.formats.safetensors.checkpoint import resolve_checkpoint
from shardwise.io.storage import locate


class Mixed(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(16, 8, generator=g))
        self.h = nn.Parameter(torch.randn(4, 4, generator=g).to(torch.bfloat16))
        self.register_buffer("ids", torch.arange(10, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("s", torch.tensor(1.5, dtype=torch.float64))


def _flip(path, offset: int) -> None:
    path = locate(path).local_path("the test's byte flip")
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _safetensors_offsets(folder):
    """{tensor name: (file, offset of one byte inside its data)} (middle of each tensor)."""
    ckpt = resolve_checkpoint(folder)
    out = {}
    for name in ckpt.names:
        file, entry = ckpt.entry(name)
        out[name] = (file, ckpt.headers[file].data_start + (entry.start + entry.end) // 2)
    return out


def _dcp_offsets(folder):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = read_metadata(folder)
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        for chunk in md.chunks:
            info = metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            with open(folder / info.relative_path, "rb") as f:
                meta, base = open_blob(f, info)
            key = ",".join(map(str, chunk.offsets))
            out[f"{fqn}@{key}"] = (folder / info.relative_path, base + meta.nbytes // 2)
    return out


@pytest.mark.parametrize("kind", ["one file", "sharded", "dcp"])
def test_verify_names_every_tensor_whose_byte_was_flipped(tmp_path, kind):
    model = Mixed()
    folder = tmp_path / "ckpt"
    if kind == "dcp":
        sw.save(model, folder, distributed=True)
        where = _dcp_offsets(folder)
    else:
        sw.save(model, folder, max_shard_size="5GB" if kind == "one file" else 100)
        where = _safetensors_offsets(folder)
    report = sw.verify(folder)
    assert report.ok and report.checksummed == len(where) == 5, report
    assert report.bytes_read == sum(t.nbytes for t in model.state_dict().values())
    for name, (file, offset) in where.items():
        _flip(file, offset)
        report = sw.verify(folder)
        assert not report.ok and report.mismatched == [name] and not report.problems, (name, report)
        _flip(file, offset)
    assert sw.verify(folder).ok


def test_verify_reports_structure_without_checksums_and_faults(tmp_path, capsys):
    save_file({"a": torch.ones(3)}, tmp_path / "plain.safetensors")
    report = sw.verify(tmp_path / "plain.safetensors")
    assert report.ok and report.checksummed == 0 and "no checksums" in report.notes[0]
    assert not report.verified and report.outcome == "UNVERIFIED"

    model = Mixed()
    sw.save(model, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    with open(file, "ab") as f:
        f.write(b"\0" * 8)  # trailing bytes: the data section is no longer tiled exactly
    assert main(["verify", str(tmp_path / "ckpt")]) == 1
    out = capsys.readouterr()
    assert out.out.startswith("FAILED") and "trailing bytes" in out.err
    assert main(["verify", str(tmp_path / "ckpt"), "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] is False and "trailing bytes" in got["problems"][0]
    assert main(["verify", str(tmp_path / "missing")]) == 4  # UNREADABLE (issue #44)


def test_verify_finds_a_stale_or_tampered_info_file(tmp_path):
    sw.save(Mixed(), tmp_path / "ckpt", max_shard_size=100)
    info_file = tmp_path / "ckpt" / "shardwise.json"
    info = json.loads(info_file.read_text())
    info["checksums"]["tensors"]["gone"] = "00000000"
    info_file.write_text(json.dumps(info))
    report = sw.verify(tmp_path / "ckpt")
    assert not report.ok and "'gone'" in report.problems[0]
    info_file.write_text('{"checksums": 3}')
    report = sw.verify(tmp_path / "ckpt")
    assert not report.ok and "'checksums'" in report.problems[0]


def test_verify_finds_a_header_whose_dtype_changed(tmp_path):
    sw.save(Mixed(), tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"ids":{"dtype":"I64"', b'"ids":{"dtype":"F64"')
    assert header != raw[8:8 + n]
    file.write_bytes(raw[:8] + header + raw[8 + n:])  # same bytes, read as other values
    report = sw.verify(tmp_path / "ckpt")
    assert not report.ok and "'ids' is F64 (10,)" in report.problems[0] and not report.mismatched


def test_recorded_checksum_is_xxh3_of_the_bytes(tmp_path):
    model = Mixed()
    sw.save(model, tmp_path / "ckpt")
    sums = json.loads((tmp_path / "ckpt" / "shardwise.json").read_text())["checksums"]
    assert sums["algorithm"] == "xxh3_64"
    for name, t in model.state_dict().items():
        raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
        assert sums["tensors"][name] == xxhash.xxh3_64_hexdigest(raw), name


def test_checkpoints_with_crc32_checksums_still_verify(tmp_path):
    # shardwise recorded CRC-32 before XXH3: such a checkpoint verifies, and a flipped byte shows
    model = Mixed()
    sw.save(model, tmp_path / "ckpt")
    info_file = tmp_path / "ckpt" / "shardwise.json"
    info = json.loads(info_file.read_text())
    info["checksums"] = {"algorithm": "crc32", "tensors": {
        name: f"{zlib.crc32(bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())):08x}"
        for name, t in model.state_dict().items()}}
    info_file.write_text(json.dumps(info))
    report = sw.verify(tmp_path / "ckpt")
    assert report.ok and report.checksummed == len(model.state_dict()), report.problems
    file = tmp_path / "ckpt" / "model.safetensors"
    raw = bytearray(file.read_bytes())
    raw[-1] ^= 0x01
    file.write_bytes(bytes(raw))
    report = sw.verify(tmp_path / "ckpt")
    assert not report.ok and len(report.mismatched) == 1


def test_diff_across_layouts_and_differences(tmp_path, capsys):
    a, b = Mixed(0), Mixed(0)
    sw.save(a, tmp_path / "st", max_shard_size=100)
    sw.save(b, tmp_path / "dcp", distributed=True)
    report = sw.diff(tmp_path / "st", tmp_path / "dcp")
    assert report.identical and report.same == 5
    assert main(["diff", str(tmp_path / "st"), str(tmp_path / "dcp")]) == 0
    assert capsys.readouterr().out.startswith("IDENTICAL: 5 identical")

    with torch.no_grad():
        b.w[3, 2] += 0.25
        b.h.copy_(b.h.float().to(torch.bfloat16))  # same values
    b.s = torch.tensor(float("nan"), dtype=torch.float64)
    b.register_buffer("extra", torch.zeros(2))
    del b.mask
    b.ids = b.ids.to(torch.int32)
    sw.save(b, tmp_path / "other", distributed=True)
    report = sw.diff(tmp_path / "st", tmp_path / "other", slab_bytes=32)  # many slabs per tensor
    assert report.only_a == ["mask"] and report.only_b == ["extra"]
    differ = {d.name: d for d in report.differ}
    assert set(differ) == {"w", "ids", "s"} and report.same == 1
    assert differ["w"].max_abs_diff == pytest.approx(0.25) and not differ["w"].equal
    assert differ["ids"].dtype_a == "int64" and differ["ids"].dtype_b == "int32"
    assert differ["ids"].max_abs_diff == 0 and not differ["ids"].equal
    assert differ["s"].max_abs_diff != differ["s"].max_abs_diff  # NaN on one side only
    assert main(["diff", str(tmp_path / "st"), str(tmp_path / "other"), "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["identical"] is False and len(got["differ"]) == 3
    assert main(["diff", str(tmp_path / "st"), str(tmp_path / "nope")]) == 2


def test_diff_of_shapes_and_of_row_slabs_through_chunks(tmp_path):
    big = nn.Linear(64, 48)
    sw.save(big, tmp_path / "a", distributed=True)
    changed = nn.Linear(64, 48)
    changed.load_state_dict(big.state_dict())
    with torch.no_grad():
        changed.weight[47, 63] = 100.0
    sw.save(changed, tmp_path / "b", max_shard_size=1000)
    report = sw.diff(tmp_path / "a", tmp_path / "b", slab_bytes=1000)
    (d,) = report.differ
    assert d.name == "weight" and d.max_abs_diff == pytest.approx(100.0 - float(big.weight[47, 63]))
    sw.save(nn.Linear(64, 40), tmp_path / "c")
    (d,) = sw.diff(tmp_path / "a", tmp_path / "c").differ[:1]
    assert d.shape_a == (48, 64) and d.shape_b == (40, 64) and d.max_abs_diff is None


def test_verify_of_a_folder_shardwise_did_not_write_is_unverified_not_ok(tmp_path, capsys):
    """Issue #32: no checksum recorded, so the outcome says so (text, JSON, exit status 3)."""
    folder = tmp_path / "foreign"
    folder.mkdir()
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(3)}, folder / "model.safetensors")
    assert main(["verify", str(folder)]) == 3
    out = capsys.readouterr().out
    assert out.startswith(f"UNVERIFIED {folder}: safetensors, 2 tensors in 2 chunks, 0 checksummed"), out
    assert "not written by shardwise" in out and "OK" not in out.split(":")[0]
    assert main(["verify", str(folder), "--json"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert (data["outcome"], data["verified"], data["ok"], data["chunks"]) == ("UNVERIFIED", False, True, 2)
    sw.save(Mixed(), tmp_path / "ours")                  # the same command on a shardwise save
    assert main(["verify", str(tmp_path / "ours")]) == 0
    assert capsys.readouterr().out.startswith("OK ")


def test_verify_of_a_missing_path_is_unreadable_not_failed(tmp_path, capsys):
    """Issue #44: nothing was read, so no verdict on a checkpoint: UNREADABLE, exit status 4."""
    assert main(["verify", str(tmp_path / "nothing")]) == 4
    out = capsys.readouterr().out
    nothing = tmp_path / "nothing"
    assert out.startswith(f"UNREADABLE {nothing}: {nothing}: no such checkpoint"), out
    assert main(["verify", str(tmp_path / "nothing"), "--json"]) == 4
    data = json.loads(capsys.readouterr().out)
    assert (data["outcome"], data["ok"]) == ("UNREADABLE", False) and "no such" in data["unreadable"]


def test_diff_with_a_cast_or_a_tolerance(tmp_path, capsys):
    """Issue #32: a bfloat16 save against its float32 source; byte for byte stays the default."""
    torch.manual_seed(0)
    source = {"w": torch.randn(300, 7), "b": torch.randn(5), "ids": torch.arange(4)}
    save_file(source, tmp_path / "fp32.safetensors")
    save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in source.items()},
              tmp_path / "bf16.safetensors")
    a, b = tmp_path / "bf16.safetensors", tmp_path / "fp32.safetensors"
    exact = sw.diff(a, b)
    assert not exact.equivalent and sorted(d.name for d in exact.differ) == ["b", "w"] and exact.same == 1
    cast = sw.diff(a, b, dtype="bfloat16", slab_bytes=1024)      # in slabs of a few rows
    assert cast.equivalent and not cast.identical and sorted(cast.close) == ["b", "w"], cast
    assert sw.diff(a, b, atol=1e-2, rtol=1e-2).equivalent
    tight = sw.diff(a, b, atol=1e-6)
    assert not tight.equivalent and sorted(d.name for d in tight.differ) == ["b", "w"]
    assert main(["diff", str(a), str(b), "--atol", "1e-2", "--rtol", "1e-2"]) == 0
    out = capsys.readouterr().out
    assert "differs" not in out and out.startswith("EQUIVALENT: 1 identical, 2 within tolerance, 0 differ")
    assert main(["diff", str(a), str(b), "--dtype", "bfloat16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["equivalent"] and not data["identical"] and data["tolerance"]["dtype"] == "bfloat16"
    assert main(["diff", str(a), str(b)]) == 1                 # the default: byte for byte
    out = capsys.readouterr().out                              # issue #44: which flag compares them
    assert "hint: only dtypes differ (2 tensors); to compare the values, cast both sides: --dtype bfloat16" \
        in out, out
    save_file({"w": source["w"].bfloat16()}, tmp_path / "fewer.safetensors")  # not only dtypes: no hint
    assert main(["diff", str(tmp_path / "fewer.safetensors"), str(b)]) == 1
    assert "hint" not in capsys.readouterr().out
    assert main(["diff", str(a), str(b), "--atol", "-1"]) == 2
    assert "atol must be a finite number >= 0" in capsys.readouterr().err
