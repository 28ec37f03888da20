"""``expected_tensors`` on a plain module (no transformers): the state dict without
non-persistent buffers, tied weights once under the name ``sw.save`` keeps, global shapes and
dtypes, read from meta tensors; and ``sw.verify(path, against=module)`` with it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import shardwise as sw
from shardwise.core.header import dtype_to_str
from shardwise.io.check.against import expected_tensors


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 6).to(torch.bfloat16)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two names
        self.register_buffer("steps", torch.zeros(2, 3, dtype=torch.int64))
        self.register_buffer("rotary", torch.ones(8), persistent=False)  # never stored


WANT = {  # in state-dict order: the root's own buffers first
    "steps": ((2, 3), "I64"),
    "embed.weight": ((10, 4), "F32"),
    "proj.weight": ((6, 4), "BF16"),
    "proj.bias": ((6,), "BF16"),
}


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_state_dict_once_per_tensor(device):
    with torch.device(device):
        model = Tied()
    assert expected_tensors(model) == WANT
    assert list(expected_tensors(model, layout="module")) == list(WANT)  # state-dict order


def test_what_sw_save_writes(tmp_path):
    sw.save(Tied(), tmp_path / "ckpt")
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert {n: (tuple(t.shape), dtype_to_str(t.dtype)) for n, t in stored.items()} == WANT


def test_dtype_casts_floating_point_tensors_only():
    with torch.device("meta"):
        model = Tied()
    got = expected_tensors(model, dtype="float16")
    assert got["embed.weight"][1] == got["proj.bias"][1] == "F16" and got["steps"][1] == "I64"
    assert expected_tensors(model, dtype=torch.float16) == expected_tensors(model, dtype="F16") == got


def test_tensors_given_stand_for_the_model():
    with torch.device("meta"):
        model = Tied()
    given = {"embed.weight": ((10, 4), torch.float32), "steps": ([2, 3], "I64")}
    want = {"embed.weight": ((10, 4), "F32"), "steps": ((2, 3), "I64")}
    assert expected_tensors(model, tensors=given) == want


def test_bad_arguments():
    with pytest.raises(sw.UsageError, match="layout"):
        expected_tensors(Tied(), layout="flat")
    with pytest.raises(sw.UsageError, match="dtype"):
        expected_tensors(Tied(), dtype="float17")
    with pytest.raises(sw.UsageError, match="no config.json"):
        expected_tensors("/nonexistent/folder")
    with pytest.raises(sw.UsageError, match="against"):
        sw.verify("/nonexistent/ckpt", dtype="bfloat16")  # compares with nothing
    with pytest.raises(sw.UsageError, match=r"\(shape, dtype\)"):
        expected_tensors(Tied(), tensors={"embed.weight": (10, 4)})


def test_verify_against_a_module(tmp_path):
    sw.save(Tied(), tmp_path / "ckpt")
    with torch.device("meta"):
        model = Tied()
    report = sw.verify(tmp_path / "ckpt", against=model)
    assert report.ok and report.against.dtypes_compared and report.against.expected == 4, report.problems
    assert report.against.layout == "module"  # no hub layout of its own: its names
    assert "matches Tied (module layout: names, shapes and dtypes)" in report.summary()
    assert sw.verify(tmp_path / "ckpt", against=model, layout="module").ok
    # the same names, one of another shape and the integer buffer of another dtype
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    stored["proj.weight"] = torch.zeros(4, 6, dtype=torch.bfloat16)
    stored["steps"] = torch.zeros(2, 3, dtype=torch.int32)
    save_file(stored, tmp_path / "other.safetensors")
    report = sw.verify(tmp_path / "other.safetensors", against=model)
    assert not report.ok and not report.against.missing and not report.against.unexpected
    assert sorted(report.against.wrong) == [
        "'proj.weight' is BF16 (4, 6) in the checkpoint, but Tied expects BF16 (6, 4)",
        "'steps' is I32 (2, 3) in the checkpoint, but Tied expects I64 (2, 3)",
    ]
    # a tied tensor may be stored under its other name
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    stored["head.weight"] = stored.pop("embed.weight")
    save_file(stored, tmp_path / "head.safetensors")
    report = sw.verify(tmp_path / "head.safetensors", against=model)
    assert report.ok, report.problems
