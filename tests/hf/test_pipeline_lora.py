"""A LoRA on a sharded pipeline's transformer: sw.load_adapter(pipe.transformer, lora) on a Flux2
pipeline loaded by sw.from_pretrained at tp=2 makes the image diffusers' one-process pipeline
makes with the same LoRA (``pipe.load_lora_weights``), within 1e-4."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("diffusers")

import torch  # noqa: E402
from pipeline_models import build_pipeline, generate, pipeline_class, save_pipeline  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402

TOLERANCE = 1e-4
# every projection of Flux2's blocks, the packed ones included
TARGETS = (r".*(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out|linear_in|linear_out"
           r"|to_qkv_mlp_proj|single_transformer_blocks\.\d+\.attn\.to_out)$")


def _with_lora(ckpt: str, lora: str) -> dict:
    backend = sw.init_backend("gloo")
    pipe = sw.from_pretrained(pipeline_class("flux2"), ckpt, mesh=backend.mesh(tp=backend.world_size))
    base = generate(pipe, "flux2").tolist()
    result = sw.load_adapter(pipe.transformer, lora)
    return {"base": base, "lora": generate(pipe, "flux2").tolist(), "tensors": result.tensors}


def test_lora_on_the_sharded_transformer_equals_diffusers_one_process(tmp_path):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    ckpt = save_pipeline("flux2", tmp_path / "pipe")
    source = build_pipeline("flux2")
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    source.transformer.add_adapter(config, adapter_name="style")
    with torch.no_grad():  # larger than its init, so the image moves well past the tolerance
        for name, p in source.transformer.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    pipe_cls = pipeline_class("flux2")
    pipe_cls.save_lora_weights(tmp_path / "lora", transformer_lora_layers=get_peft_model_state_dict(
        source.transformer, adapter_name="style"), transformer_lora_adapter_metadata=config.to_dict())
    base = generate(build_pipeline("flux2"), "flux2")
    reference_pipe = build_pipeline("flux2")
    reference_pipe.load_lora_weights(tmp_path / "lora")  # diffusers' own, one process
    reference = generate(reference_pipe, "flux2")
    assert (reference - base).abs().max().item() > 100 * TOLERANCE, "the LoRA changes the image"
    for rank, row in enumerate(run_ranks(_with_lora, 2, str(ckpt), str(tmp_path / "lora"), timeout=600)):
        assert row["tensors"] == 2 * 14, row["tensors"]  # 14 adapted projections, a pair each
        assert (torch.tensor(row["base"]) - base).abs().max().item() <= TOLERANCE, rank
        diff = (torch.tensor(row["lora"]) - reference).abs().max().item()
        assert diff <= TOLERANCE, (rank, diff)
