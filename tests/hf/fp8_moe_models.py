"""Tiny FP8 MoE checkpoints whose experts are transformers' ``FP8Experts`` (Qwen3-MoE-FP8,
DeepSeek-V3 layouts).

As ``fp8_models``: the model is built with transformers' FP8 quantizer's own module
replacement (``preprocess_model``: ``FP8Linear`` for the linears, ``FP8Experts`` for the
experts, each holding ``gate_up_proj`` ``(E, 2I, H)`` / ``down_proj`` ``(E, H, I)`` float8 with
``*_scale_inv`` per 128x128 block of each expert), the values come from
``core.quant.quantize_fp8_blocks`` and ``save_pretrained`` writes the files: the expert weights
per expert (``mlp.experts.3.gate_proj.weight``, transformers' conversion mapping reversed) and
their scales fused, as it holds them (``mlp.experts.gate_up_proj_scale_inv``). The hub's own
files (DeepSeek-V3, Qwen3-30B-A3B-FP8) hold the scales per expert too
(``mlp.experts.3.gate_proj.weight_scale_inv``): :func:`save_fp8_moe` writes that layout with
``layout="hub"``, the same tensors with the fused scales split per expert.

The moe intermediate sizes are multiples of 128 (so a fused ``gate_up_proj``'s blocks are its
halves' blocks, as transformers' own load assumes); the shard boundaries still cut blocks at
some degree (64 rows of each half at tp=2 for DeepSeek-V3, at tp=4 for Qwen3-MoE), and
DeepSeek-V3's ``kv_a_proj_with_mqa`` (160 rows) has a partial last block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from hf.fp8_models import BLOCK, FP8, stored_tensors
from shardwise.core.quant import dequantize_region, quantize_fp8_blocks, scale_key
from shardwise.core.spec import Region

SHARD_SIZE = "300KB"
EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


def _qwen3_moe():  # moe I = 256: whole blocks at tp=2, cut at tp=4 and 8
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=96, hidden_size=256, intermediate_size=384, moe_intermediate_size=256,
                          num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8, head_dim=32,
                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=64, tie_word_embeddings=False)


def _deepseek_v3():  # a dense first layer, then 8 experts of I = 128 and a shared expert; MLA attention
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=96, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                            topk_group=1, first_k_dense_replace=1, q_lora_rank=192, kv_lora_rank=128,
                            qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
                            max_position_embeddings=64, tie_word_embeddings=False)


KINDS = {"qwen3_moe": ("Qwen3MoeForCausalLM", _qwen3_moe),
         "deepseek_v3": ("DeepseekV3ForCausalLM", _deepseek_v3)}


def model_class(kind: str):
    import transformers

    return getattr(transformers, KINDS[kind][0])


def build_plain(kind: str, *, seed: int = 0) -> torch.nn.Module:
    """The unquantized model, in float32, seeded; rows vary in size so block scales differ."""
    model = model_class(kind)._from_config(KINDS[kind][1](), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            value = torch.randn(p.shape, generator=gen) * 0.2
            if p.dim() >= 2:
                value *= torch.logspace(-2, 1, p.shape[-2])[:, None]
            p.copy_(value)
    return model.eval()


def save_fp8_moe(kind: str, folder: str | Path, *, layout: str = "transformers", seed: int = 0) -> Path:
    """The FP8 checkpoint of ``build_plain(kind)`` written by transformers' ``save_pretrained``
    from its FP8 modules; ``layout="hub"`` then splits the fused expert scales per expert."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers import AutoHfQuantizer

    plain = build_plain(kind, seed=seed).state_dict()
    quantizer = AutoHfQuantizer.from_config(FineGrainedFP8Config(weight_block_size=list(BLOCK)),
                                            pre_quantized=True)
    with torch.device("meta"):
        model = model_class(kind)._from_config(KINDS[kind][1](), dtype=torch.bfloat16)
    quantizer.preprocess_model(model)  # FP8Linear and FP8Experts, as transformers' from_pretrained
    state = {}
    for name, meta in model.state_dict(keep_vars=True).items():
        if name.endswith("_scale_inv"):
            continue
        if meta.dtype == FP8:
            state[name], state[scale_key(name)] = quantize_fp8_blocks(plain[name], BLOCK)
        else:
            state[name] = plain[name].to(meta.dtype)
    model.load_state_dict(state, assign=True, strict=True)
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    model.save_pretrained(folder, max_shard_size=SHARD_SIZE)
    if layout == "hub":
        _split_expert_scales(Path(folder))
    return Path(folder)


def _split_expert_scales(folder: Path) -> None:
    """Rewrite ``folder`` in one file with each fused expert scale split per expert."""
    stored = stored_tensors(folder)
    out = {}
    for key, t in stored.items():
        m = re.match(r"^(.*\.experts)\.(gate_up_proj|down_proj)_scale_inv$", key)
        if m is None:
            out[key] = t
            continue
        for e in range(t.shape[0]):
            if m[2] == "down_proj":
                out[f"{m[1]}.{e}.down_proj.weight_scale_inv"] = t[e].clone()
            else:
                half = t.shape[1] // 2
                out[f"{m[1]}.{e}.gate_proj.weight_scale_inv"] = t[e, :half].clone()
                out[f"{m[1]}.{e}.up_proj.weight_scale_inv"] = t[e, half:].clone()
    for f in list(folder.glob("*.safetensors")) + list(folder.glob("*.index.json")):
        f.unlink()
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})


def model_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's names, as transformers assembles them:
    per-expert weights (and scales) stacked, ``gate_proj`` and ``up_proj`` concatenated."""
    groups: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for key, t in stored_tensors(folder).items():
        m = EXPERT.match(key)
        if m is None:
            out[key] = t
        else:
            groups.setdefault((m[1], m[3], m[4]), {})[int(m[2])] = t
    for (prefix, proj, kind), parts in groups.items():
        stacked = torch.stack([parts[e] for e in sorted(parts)])
        suffix = "" if kind == "weight" else "_scale_inv"
        if proj == "down_proj":
            out[f"{prefix}.down_proj{suffix}"] = stacked
        else:
            name = f"{prefix}.gate_up_proj{suffix}"
            out[name] = torch.cat([out[name], stacked], dim=1) if proj == "up_proj" else stacked
    return out


def dequantized_state(folder: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state dict dequantized in one process (``core.quant.dequantize_region`` on
    each whole assembled tensor: float32, cast once), the rest cast."""
    held = model_tensors(folder)
    out = {}
    for name, t in held.items():
        if name.endswith("_scale_inv"):
            continue
        scale = held.get(scale_key(name))
        if scale is None:
            out[name] = t.to(dtype)
            continue
        block = (1,) * (t.dim() - 2) + BLOCK
        out[name] = dequantize_region(t, scale, Region((0,) * t.dim(), tuple(t.shape)), block, dtype)
    return out


def transformers_dequantized(folder: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' own dequantized load (``FineGrainedFP8Config(dequantize=True)``, CPU)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=dtype).eval()


def quantization_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())["quantization_config"]


__all__ = ["KINDS", "SHARD_SIZE", "build_plain", "dequantized_state", "model_class", "model_tensors",
           "quantization_config", "save_fp8_moe", "transformers_dequantized"]
