"""Tiny gpt-oss MXFP4 checkpoints, laid out as the hub's are (openai/gpt-oss-20b, -120b).

The experts' ``gate_up_proj`` and ``down_proj`` are stored as transformers' MXFP4 integration
reads them: ``*.mlp.experts.gate_up_proj_blocks`` uint8 ``(E, 2I, H/32, 16)`` (two e2m1 values
a byte, the low nibble first) with ``*_scales`` uint8 ``(E, 2I, H/32)`` (one e8m0 exponent per 32
values), and ``down_proj_blocks`` ``(E, H, I/32, 16)`` / ``down_proj_scales`` ``(E, H, I/32)``:
the *transpose* of the module's ``(E, H, 2I)`` / ``(E, I, H)`` parameters (transformers'
``convert_moe_packed_tensors`` transposes back). Everything else, the experts' biases too, is
bf16; ``config.json`` carries the hub's ``quantization_config`` (``quant_method: mxfp4``, its
``modules_to_not_convert``).

transformers cannot write this checkpoint on CPU (its MXFP4 quantizer needs the Triton kernels
from the hub), so :func:`quantize_mxfp4` does (OCP MX rules: the shared exponent is
``floor(log2(amax)) - 2``, each value rounded to the nearest e2m1), and ``save_pretrained``
writes the files, given that state dict. The tiny config is chosen so that the groups are cut
somewhere: ``hidden_size`` 64 (2 groups), ``intermediate_size`` 96 (3 groups), 4 experts.

    folder = save_mxfp4(tmp_path / "ckpt")
    full = dequantized_state(folder, torch.bfloat16)   # transformers' own dequantization
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf.fp8_models import inputs, logits, stored_tensors  # the same prompt and logits

SHARD_SIZE = "40KB"  # several files: the index is exercised
EXPERTS = ("gate_up_proj", "down_proj")
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# what the hub's gpt-oss config.json says
QUANTIZATION_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                  "model.embed_tokens", "lm_head"],
                       "quant_method": "mxfp4"}


def config():
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=8, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        tie_word_embeddings=False)


def model_class():
    from transformers import GptOssForCausalLM

    return GptOssForCausalLM


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of ``weight`` ``(..., rows, K)``, quantized along K in groups of 32:
    ``blocks`` uint8 ``(..., rows, K/32, 16)``, ``scales`` uint8 ``(..., rows, K/32)``."""
    *lead, k = weight.shape
    groups = weight.float().reshape(*lead, k // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    exponent = exponent.clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    code = (scaled.abs().unsqueeze(-1) - E2M1_MAGNITUDES).abs().argmin(-1)  # nearest magnitude
    code = (code | ((scaled < 0).long() << 3)).to(torch.uint8).reshape(*lead, k // 32, 16, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def build_plain(*, seed: int = 0) -> torch.nn.Module:
    """The unquantized bf16 model with seeded weights; the experts' vary in size by row, so
    that the groups' scales differ."""
    model = model_class()._from_config(config(), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = torch.randn(p.shape, generator=gen) * 0.2
            if name.rpartition(".")[2] in EXPERTS:
                value *= torch.logspace(-3, 1, p.shape[-1])  # the stored rows: the module's last dim
            p.copy_(value)
    return model.eval()


def hub_state(plain: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict the hub stores for ``plain``: each expert tensor as ``*_blocks`` and
    ``*_scales`` of its transpose, the rest bf16."""
    out = {}
    for name, t in plain.state_dict().items():
        if name.rpartition(".")[2] in EXPERTS:
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t.transpose(-1, -2))
        else:
            out[name] = t.contiguous()
    return out


def save_mxfp4(folder: str | Path, *, seed: int = 0, max_shard_size: str = SHARD_SIZE) -> Path:
    """The MXFP4 checkpoint of ``build_plain()``, written by transformers' ``save_pretrained``."""
    plain = build_plain(seed=seed)
    plain.config.quantization_config = dict(QUANTIZATION_CONFIG)
    plain.save_pretrained(folder, state_dict=hub_state(plain), max_shard_size=max_shard_size)
    return Path(folder)


def dequantized_state(folder: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state dict dequantized in one process, by transformers' own
    ``convert_moe_packed_tensors`` (which transposes to the module's layout); the rest cast."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = stored_tensors(folder)
    out = {}
    for name, t in stored.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            out[base] = convert_moe_packed_tensors(t, stored[base + "_scales"], dtype=dtype)
        else:
            out[name] = t.to(dtype)
    return out


def transformers_dequantized(folder: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' own dequantized load (``Mxfp4Config(dequantize=True)``, CPU)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True),
                                                dtype=dtype).eval()


def reference_model(folder: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """A one-process plain model holding :func:`dequantized_state`."""
    model = model_class()._from_config(config(), dtype=dtype)
    model.load_state_dict(dequantized_state(folder, dtype), strict=True)
    return model.eval()


__all__ = [
    "EXPERTS", "QUANTIZATION_CONFIG", "SHARD_SIZE", "build_plain", "config", "dequantized_state", "hub_state",
    "inputs", "logits", "model_class", "quantize_mxfp4", "reference_model", "save_mxfp4", "stored_tensors",
    "transformers_dequantized",
]
