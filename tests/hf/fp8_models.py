"""Tiny FP8 block-scaled checkpoints, laid out as the hub's are (DeepSeek-V3, Qwen3-*-FP8).

Every ``nn.Linear`` but ``lm_head`` holds a ``float8_e4m3fn`` weight with a float32
``weight_scale_inv``, one scale per 128x128 block (``amax / 448``), partial last blocks
included; the other tensors are bf16; ``config.json`` carries ``quantization_config``
(``quant_method: fp8``, ``weight_block_size: [128, 128]``).

transformers writes the files itself: the model is built with its FP8 quantizer's own module
replacement (``FineGrainedFP8HfQuantizer.preprocess_model``: ``FP8Linear`` modules, lm_head
left out as transformers leaves it), the quantized tensors are assigned, and
``save_pretrained`` writes them. Only the values come from here: ``core.quant.quantize_fp8_blocks``
equals transformers' ``Fp8Quantize`` bit for bit where that applies (dims that are multiples
of the block; tested), and goes on where it stops: ``Fp8Quantize`` leaves a weight whose dims
are not multiples of 128 unquantized, and ``Fp8Dequantize`` raises on one, while hub
checkpoints hold such weights quantized with ``ceil(rows / 128)`` scale rows.

    folder = save_fp8("llama576", tmp_path / "ckpt")
    full = dequantized_state(folder, torch.bfloat16)   # the reference, one process
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from shardwise.core.quant import dequantize_region, quantize_fp8_blocks
from shardwise.core.spec import Region

SHARD_SIZE = "200KB"  # several files: the index is exercised
BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn


def _qwen3():  # 128-multiples everywhere: aligned at tp=2, blocks cut at tp=4 and 8 (q/k/v 64, 32 rows)
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                       num_attention_heads=8, num_key_value_heads=8, head_dim=32,
                       max_position_embeddings=64, tie_word_embeddings=False)


def _llama576():  # intermediate 576 = 4.5 blocks: a partial last block, cut inside a block at any tp
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=384, intermediate_size=576, num_hidden_layers=1,
                       num_attention_heads=8, num_key_value_heads=8, head_dim=48,
                       max_position_embeddings=64, tie_word_embeddings=False)


KINDS = {"qwen3": ("Qwen3ForCausalLM", _qwen3), "llama576": ("LlamaForCausalLM", _llama576)}


def model_class(kind: str):
    import transformers

    return getattr(transformers, KINDS[kind][0])


def build_plain(kind: str, *, seed: int = 0) -> torch.nn.Module:
    """The unquantized bf16 model: seeded weights whose magnitude varies by row, so that the
    blocks' scales differ."""
    model = model_class(kind)._from_config(KINDS[kind][1](), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            value = torch.randn(p.shape, generator=gen) * 0.2
            if p.dim() == 2:
                value *= torch.logspace(-2, 1, p.shape[0])[:, None]
            p.copy_(value)
    return model.eval()


def save_fp8(kind: str, folder: str | Path, *, seed: int = 0, max_shard_size: str = SHARD_SIZE) -> Path:
    """The FP8 checkpoint of ``build_plain(kind)``, written by transformers' ``save_pretrained``."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers import AutoHfQuantizer

    plain = build_plain(kind, seed=seed).state_dict()
    quantizer = AutoHfQuantizer.from_config(FineGrainedFP8Config(weight_block_size=list(BLOCK)),
                                            pre_quantized=True)
    with torch.device("meta"):
        model = model_class(kind)._from_config(KINDS[kind][1](), dtype=torch.bfloat16)
    quantizer.preprocess_model(model)  # transformers' own FP8Linear replacement
    state = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith(".weight_scale_inv"):
            continue
        if tensor.dtype == FP8:
            state[name], state[name + "_scale_inv"] = quantize_fp8_blocks(plain[name], BLOCK)
        else:
            state[name] = plain[name]
    model.load_state_dict(state, assign=True, strict=True)
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return Path(folder)


def stored_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``folder``, as stored."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[k] = h.get_tensor(k)
    return out


def block_of(folder: str | Path) -> tuple[int, int]:
    qc = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    return tuple(qc["weight_block_size"])


def dequantized_state(folder: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state dict dequantized in one process: each FP8 weight whole through
    ``core.quant.dequantize_region`` (float32, cast once to ``dtype``), the rest cast."""
    stored = stored_tensors(folder)
    block = block_of(folder)
    out = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        scale = stored.get(name + "_scale_inv")
        if scale is None:
            out[name] = t.to(dtype)
        else:
            whole = Region((0,) * t.dim(), tuple(t.shape))
            out[name] = dequantize_region(t, scale, whole, block, dtype)
    return out


def transformers_dequantized(folder: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' own dequantized load (``FineGrainedFP8Config(dequantize=True)``, CPU)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=dtype).eval()


def reference_model(kind: str, folder: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """A one-process plain model holding :func:`dequantized_state`."""
    model = model_class(kind)._from_config(KINDS[kind][1](), dtype=dtype)
    model.load_state_dict(dequantized_state(folder, dtype), strict=True)
    return model.eval()


def fp8_model(kind: str, folder: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """A one-process model with transformers' FP8Linear modules holding the stored FP8 tensors
    (the other tensors cast to ``dtype``): what a serving engine holds on one device."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers import AutoHfQuantizer

    model = model_class(kind)._from_config(KINDS[kind][1](), dtype=dtype)
    AutoHfQuantizer.from_config(FineGrainedFP8Config(weight_block_size=list(BLOCK)),
                                pre_quantized=True).preprocess_model(model)
    stored = stored_tensors(folder)
    state = {k: v if v.dtype == FP8 or k.endswith("_scale_inv") else v.to(dtype) for k, v in stored.items()}
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def meta_fp8_model(kind: str, block=BLOCK) -> torch.nn.Module:
    """The model with transformers' FP8Linear modules, parameters on meta (to load into)."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers import AutoHfQuantizer

    import shardwise as sw

    with sw.empty_model():
        model = model_class(kind)._from_config(KINDS[kind][1]())
        AutoHfQuantizer.from_config(FineGrainedFP8Config(weight_block_size=list(block)),
                                    pre_quantized=True).preprocess_model(model)
    return model


def fake_fp8_linear(input, weight, weight_scale_inv, block_size=None, bias=None, activation_scale=None,
                    allow_deepgemm=True):
    """A CPU stand-in for transformers' FP8 kernels (Triton/DeepGEMM, GPU only) that reads the
    (weight, scales) pair as they do, local row ``i`` with scale row ``i // 128``
    (transformers' own ``_dequantize_fp8_weight``), so it is wrong exactly where they are wrong:
    on a shard whose first row is not a block's first. Activations are not quantized."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    w = _dequantize_fp8_weight(weight, weight_scale_inv, block_size, input.dtype)
    return torch.nn.functional.linear(input, w, bias)


def use_fake_fp8_kernel() -> None:
    """Route transformers' ``FP8Linear`` forward to :func:`fake_fp8_linear` in this process."""
    import transformers.integrations.finegrained_fp8 as fp8

    fp8.fp8_linear = fake_fp8_linear


def inputs() -> dict:
    gen = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 96, (2, 7), generator=gen)}


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs()).logits
    if type(out).__name__ == "DTensor":
        out = out.full_tensor()
    return out.detach().float().cpu()


__all__ = [
    "BLOCK", "KINDS", "SHARD_SIZE", "block_of", "build_plain", "dequantized_state", "fake_fp8_linear",
    "fp8_model", "inputs", "logits", "meta_fp8_model", "model_class", "reference_model",
    "save_fp8", "stored_tensors", "transformers_dequantized", "use_fake_fp8_kernel",
]
