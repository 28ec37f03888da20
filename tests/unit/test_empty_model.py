"""sw.empty_model: parameters on meta, buffers real, ties kept, the patch undone on exit."""

import pytest
import torch
from torch import nn

import shardwise as sw


class Rotary(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("steps", torch.arange(4))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.rotary = Rotary(8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tied in __init__
        self.scale = nn.Parameter(torch.ones(8), requires_grad=False)
        self.scale.custom_flag = True  # an attribute a library set on its parameter


def test_parameters_meta_buffers_real_ties_kept():
    with sw.empty_model():
        model = Tied()
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.embed.weight
    assert sorted(n for n, _ in model.named_parameters()) == ["embed.weight", "scale"]  # tied: once
    assert not model.scale.requires_grad and model.scale.custom_flag is True
    reference = Rotary(8)
    assert torch.equal(model.rotary.inv_freq, reference.inv_freq)  # real values, on the CPU
    assert torch.equal(model.rotary.steps, torch.arange(4))
    assert Tied().embed.weight.device.type == "cpu"  # undone on exit


def test_patch_undone_when_the_block_raises():
    with pytest.raises(RuntimeError, match="boom"), sw.empty_model():
        raise RuntimeError("boom")
    assert not nn.Linear(2, 2).weight.is_meta


def test_shapes_and_dtypes_are_declared():
    with sw.empty_model():
        layer = nn.Linear(6, 4, dtype=torch.bfloat16)
    assert layer.weight.shape == (4, 6) and layer.weight.dtype == torch.bfloat16
    assert isinstance(layer.weight, nn.Parameter)


def test_import_brings_in_neither_library(tmp_path):
    import subprocess
    import sys

    code = ("import sys, torch, shardwise as sw; sw.from_pretrained; "
            "sw.save(torch.nn.Linear(2, 2), sys.argv[1]); "
            "print(sorted(m for m in ('transformers', 'diffusers', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
