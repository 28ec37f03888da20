"""``inspect`` / ``verify`` / ``diff`` on FP8 block-scaled checkpoints (written by transformers,
``fp8_models``): inspect shows each weight's and scale's scheme and block; verify finds a
missing scale, a scale of the wrong shape, a wrong block size and a config without
quantization; diff compares byte for byte where both sides hold the same bytes, else in
dequantized units, with the largest difference equal to one computed here independently."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers")

import shardwise as sw  # noqa: E402
from hf import fp8_models as F  # noqa: E402
from shardwise.cli import main  # noqa: E402
from shardwise.errors import CheckpointError  # noqa: E402
from shardwise.io.check import inspect_checkpoint  # noqa: E402

UP = "model.layers.0.mlp.up_proj.weight"  # llama576: (576, 384), scales (5, 3)
DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    return F.save_fp8("llama576", tmp_path_factory.mktemp("quant") / "fp8")


def rewrite(src, dst, *, tensors=None, config=None):
    """A copy of the checkpoint ``src`` in one file, its tensors and config.json edited."""
    stored = F.stored_tensors(src)
    if tensors is not None:
        stored = tensors(stored)
    dst.mkdir(parents=True)
    save_file(stored, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if config is not None:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def max_diff(a: dict, b: dict, name: str) -> float:
    return float((a[name].double() - b[name].double()).abs().max())


def test_inspect_shows_scheme_and_block_per_tensor(fp8, capsys):
    assert main(["inspect", str(fp8)]) == 0
    out = capsys.readouterr().out
    assert "quantization: quant_method 'fp8', weight_block_size [128, 128]; 7 quantized weight(s)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("model.", "lm_head"))}
    assert rows[UP].split()[1:] == ["F8_E4M3", "576x384", str(576 * 384), "fp8_block", "128x128"]
    assert rows[UP + "_scale_inv"].split()[1:] == ["F32", "5x3", "60", "fp8_block", "128x128", "scales"]
    assert rows["lm_head.weight"].split()[1] == "BF16" and "fp8" not in rows["lm_head.weight"]
    report = inspect_checkpoint(fp8)
    assert report.quant[DOWN] == "fp8_block 128x128" and len(report.quant) == 14


def test_sw_inspect_is_the_python_twin_of_the_cli(fp8):
    """``sw.inspect`` (DESIGN.md's name) is the one public name of ``inspect_checkpoint``."""
    assert sw.inspect is inspect_checkpoint
    assert "inspect" in sw.__all__ and not hasattr(sw, "inspect_checkpoint")
    report = sw.inspect(fp8)
    assert report.quant[UP] == "fp8_block 128x128" and report.quant[UP + "_scale_inv"].endswith("scales")
    assert report.quant == inspect_checkpoint(fp8).quant and report.tensors == inspect_checkpoint(fp8).tensors
    with pytest.raises(CheckpointError):
        sw.inspect(fp8 / "no-such-file.safetensors")


def test_inspect_without_quantization_config(fp8, tmp_path):
    bare = rewrite(fp8, tmp_path / "bare", config=lambda c: c.pop("quantization_config"))
    report = inspect_checkpoint(bare)
    assert report.quant[UP] == "fp8_block block unknown"
    assert report.quantization.startswith("quantization: no quantization_config in config.json; 7")


def test_verify_accepts_the_checkpoint_transformers_wrote(fp8):
    report = sw.verify(fp8)
    assert report.ok, report.problems


BROKEN = {
    "missing scale": (dict(tensors=lambda t: {k: v for k, v in t.items() if k != UP + "_scale_inv"}),
                      f"FP8 weight '{UP}' has no scales"),
    "scale one row short": (dict(tensors=lambda t: {**t, UP + "_scale_inv": t[UP + "_scale_inv"][:4]}),
                            rf"have shape \(4, 3\), but weight '{UP}' \(576, 384\) in 128x128 blocks needs "
                            r"\(5, 3\)"),
    "scale without weight": (dict(tensors=lambda t: {**t, "extra.weight_scale_inv": torch.ones(1, 1)}),
                             "scales 'extra.weight_scale_inv' have no FP8 weight"),
    "fp8 scales": (dict(tensors=lambda t: {**t, UP + "_scale_inv": t[UP + "_scale_inv"].to(F.FP8)}),
                   "are F8_E4M3; FP8 block scales are float32"),
    "wrong block size": (dict(config=lambda c: c["quantization_config"].update(weight_block_size=[64, 64])),
                         r"in 64x64 blocks needs \(9, 6\)"),
    "config without quantization": (dict(config=lambda c: c.pop("quantization_config")),
                                    "no quantization_config with a weight_block_size"),
}


@pytest.mark.parametrize("fault", list(BROKEN))
def test_verify_finds_a_broken_quantized_checkpoint(fp8, tmp_path, fault, capsys):
    edit, message = BROKEN[fault]
    assert sw.verify(rewrite(fp8, tmp_path / "ok")).ok  # the same rewrite without the fault passes
    broken = rewrite(fp8, tmp_path / "broken", **edit)
    report = sw.verify(broken)
    assert not report.ok
    assert any(re.search(message, p) for p in report.problems), report.problems
    assert main(["verify", str(broken)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_diff_of_identical_fp8_checkpoints_is_byte_for_byte(fp8, tmp_path):
    copy = shutil.copytree(fp8, tmp_path / "copy")
    report = sw.diff(fp8, copy)
    assert report.identical and report.same == len(F.stored_tensors(fp8)) and not report.scales_a
    # the same bytes in one file, without a config: still byte for byte (no block size needed)
    bare = rewrite(fp8, tmp_path / "bare", config=lambda c: c.pop("quantization_config"))
    assert sw.diff(fp8, bare).identical


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_diff_of_fp8_against_its_dequantized_save(fp8, tmp_path, dtype, capsys):
    plain = tmp_path / "plain"
    deq = F.dequantized_state(fp8, dtype)
    rewrite(fp8, plain, tensors=lambda t: deq, config=lambda c: c.pop("quantization_config"))
    report = sw.diff(fp8, plain)
    assert not report.identical and not report.only_a and not report.only_b
    assert sorted(report.scales_a) == sorted(k for k in F.stored_tensors(fp8) if k.endswith("_scale_inv"))
    weights = {d.name: d for d in report.differ if d.dequantized}
    assert len(weights) == 7
    exact = F.dequantized_state(fp8, torch.float32)
    for name, d in weights.items():
        assert (d.dtype_a, d.dtype_b) == ("float8_e4m3fn", str(dtype).removeprefix("torch."))
        assert d.max_abs_diff == max_diff(exact, deq, name)  # the rounding to dtype, nothing else
        assert d.equal == (d.max_abs_diff == 0)
    assert (max(d.max_abs_diff for d in weights.values()) == 0) == (dtype == torch.float32)
    # the unquantized tensors are compared as they are: bf16 norms equal; cast to float32, not
    assert {d.name for d in report.differ if not d.dequantized} == (
        set() if dtype == torch.bfloat16 else {k for k in deq if k not in weights})
    assert main(["diff", str(fp8), str(plain)]) == 1
    out = capsys.readouterr().out
    assert f"differs: {UP}: dtype float8_e4m3fn vs" in out
    assert ("equal values once dequantized" if dtype == torch.float32 else "(dequantized)") in out


def test_diff_of_two_fp8_checkpoints_with_other_scales(fp8, tmp_path):
    def halve_values_double_scales(t):
        out = dict(t)
        for name in [k for k, v in t.items() if v.dtype == F.FP8]:
            out[name] = (t[name].float() / 2).to(F.FP8)
            out[name + "_scale_inv"] = t[name + "_scale_inv"] * 2
        return out

    def one_block_off(t):
        scales = t[DOWN + "_scale_inv"].clone()
        scales[:, 0] = 1.0
        return {**t, DOWN + "_scale_inv": scales}

    a = F.dequantized_state(fp8, torch.float32)
    for edit in (halve_values_double_scales, one_block_off):
        other = rewrite(fp8, tmp_path / edit.__name__, tensors=edit)
        b = F.dequantized_state(other, torch.float32)
        report = sw.diff(fp8, other)
        assert not report.identical and not report.scales_a and not report.scales_b
        weights = {d.name: d for d in report.differ if d.dequantized}
        changed = {n for n in weights if max_diff(a, b, n) > 0}
        assert changed and (edit is halve_values_double_scales or changed == {DOWN})
        for name, d in weights.items():
            assert d.max_abs_diff == max_diff(a, b, name) and d.equal == (d.max_abs_diff == 0)
        scales = {d.name for d in report.differ if not d.dequantized}
        assert scales == {n + "_scale_inv" for n in weights}  # the scales differ as stored


def test_diff_needs_the_block_size_to_dequantize(fp8, tmp_path, capsys):
    bare = rewrite(fp8, tmp_path / "bare", config=lambda c: c.pop("quantization_config"))
    plain = rewrite(fp8, tmp_path / "plain", tensors=lambda t: F.dequantized_state(fp8, torch.bfloat16),
                    config=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="no quantization_config in config.json says its weight_block"):
        sw.diff(bare, plain)
    assert main(["diff", str(bare), str(plain)]) == 2


def test_fp8_experts_with_fused_scales(tmp_path):
    """transformers' save of FP8Experts: each expert's weight stored per expert, its scales part of
    a fused tensor. verify pairs them (no "has no scales"), finds a fused scale of the wrong shape,
    and diff compares them with the hub's per-expert scales in dequantized units."""
    from hf import fp8_moe_models as MOE

    fused = MOE.save_fp8_moe("qwen3_moe", tmp_path / "fused")
    hub = MOE.save_fp8_moe("qwen3_moe", tmp_path / "hub", layout="hub")
    report = sw.verify(fused)
    assert report.ok, report.problems
    gate3 = "model.layers.0.mlp.experts.3.up_proj.weight"
    pair = sw.inspect(fused)
    assert pair.quant[gate3] == "fp8_block 128x128"
    diff = sw.diff(fused, hub)
    experts = [d for d in diff.differ if ".experts." in d.name]
    assert len(experts) == 12 and all(d.dequantized and d.max_abs_diff == 0.0 for d in experts)
    scale = "model.layers.0.mlp.experts.gate_up_proj_scale_inv"
    short = rewrite(fused, tmp_path / "short", tensors=lambda t: {**t, scale: t[scale][:, :3].clone()})
    problems = sw.verify(short).problems
    assert any(re.search(r"fused scales .* have shape \(4, 3, 2\), not \(experts, 4, 2\)", p)
               for p in problems), problems
