"""A diffusers-format LoRA (what ``save_lora_weights`` writes) on Flux2's transformer, sharded by its
own plan (packed colwise ``to_qkv_mlp_proj`` and gate|up ``linear_in``, packed rowwise single-stream
``to_out``): outputs equal diffusers' on one process, with diffusers' ``set_adapters`` weights, and
``fuse`` (merge) / unfuse on the shards, unmerge bit for bit."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("diffusers")

import torch  # noqa: E402
from hf_models import build_tiny, forward, model_class, save_tiny  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from shardwise.holding import local_of  # noqa: E402

TOLERANCE = 1e-5
TARGETS = (r".*(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out|linear_in|linear_out"
           r"|to_qkv_mlp_proj|single_transformer_blocks\.\d+\.attn\.to_out)$")


def _layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _attach(folder: str) -> dict:
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    model = sw.from_pretrained(model_class("flux2"), f"{folder}/ckpt", mesh=mesh)
    base = [(p, local_of(p).detach().clone()) for p in model.parameters()]
    first = forward(model, "flux2").tolist()
    result = sw.load_adapter(model, f"{folder}/lora", adapter_name="style")
    out = {"tensors": result.tensors, "lora": forward(model, "flux2").tolist(), "base": first}
    model.set_adapters(["style"], weights=[0.5])  # diffusers' own API on the sharded model
    out["half"] = forward(model, "flux2").tolist()
    model.set_adapters(["style"], weights=[1.0])
    for layer in _layers(model):
        layer.merge()
    out["merged"] = forward(model, "flux2").tolist()
    for layer in _layers(model):
        layer.unmerge()
    out["restored"] = all(torch.equal(local_of(p), kept) for p, kept in base)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_diffusers_lora_on_flux2_equals_one_process(tmp_path, tp):
    from diffusers import Flux2Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    save_tiny("flux2", tmp_path / "ckpt")
    base = forward(build_tiny("flux2"), "flux2")
    model = build_tiny("flux2")
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    model.add_adapter(config, adapter_name="style")
    Flux2Pipeline.save_lora_weights(tmp_path / "lora", transformer_lora_layers=get_peft_model_state_dict(
        model, adapter_name="style"), transformer_lora_adapter_metadata=config.to_dict())
    reference = forward(model, "flux2")
    model.set_adapters(["style"], weights=[0.5])
    half = forward(model, "flux2")
    assert (reference - base).abs().max() > 0.01  # the adapter changes the output
    rows = run_ranks(_attach, tp, str(tmp_path), timeout=240)
    for rank, row in enumerate(rows):
        assert row["tensors"] == 2 * 14  # 14 adapted projections, a pair each
        # 1e-5 of the output's scale: the base alone differs from one process by ~1e-5 at tp=2
        # (the sum of a split reduction in another order); the adapter adds nothing to that
        scale = max(1.0, reference.abs().max().item())
        for what, want in (("base", base), ("lora", reference), ("half", half), ("merged", reference)):
            diff = (torch.tensor(row[what]) - want).abs().max().item()
            assert diff <= TOLERANCE * scale, (tp, rank, what, diff, scale)
        assert row["restored"]
