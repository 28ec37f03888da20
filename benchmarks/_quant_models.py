"""The FP8 checkpoint ``quant.py`` loads: a Qwen3-shaped ``Qwen3ForCausalLM`` of about 1 GB,
block-scaled the way the hub's Qwen3-*-FP8 and DeepSeek-V3 checkpoints are (every linear but
``lm_head`` a ``float8_e4m3fn`` weight with a float32 ``weight_scale_inv`` per 128x128 block;
embeddings, norms and ``lm_head`` bf16; ``quantization_config`` in ``config.json``), written by
transformers' own ``save_pretrained`` from its FP8 quantizer's ``FP8Linear`` modules.

Each weight is generated, quantized and dropped one at a time (peak ~ one float32 weight), so
the full bf16 model never exists. The quantization is ``shardwise.testing.quantize_fp8_blocks``
(equal to transformers' ``Fp8Quantize`` bit for bit where that applies; tests/hf/test_fp8.py).
A folder already holding the same configuration is reused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn
_STAMP = "quant_config.json"


@dataclass
class QuantCheckpoint:
    folder: Path
    files: list[Path]
    stored_bytes: int       # tensor bytes in the files (fp8 weights, scales, bf16 rest)
    bf16_bytes: int         # the same model dequantized to bf16
    description: str


def qwen3_config(layers: int = 14) -> dict:
    """Qwen3-1.7B's widths (hidden 2048, 16 heads and 8 kv heads of 128, MLP 6144), a 32k vocab
    and ``layers`` layers: 14 give about 1 GB stored. Every dim is a multiple of 128 x 4, so at
    tp 2 and 4 each shard holds whole blocks (a kept FP8 shard runs its kernel as it is)."""
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
                tie_word_embeddings=False)


def fp8_checkpoint(folder: Path, *, layers: int = 14, seed: int = 0) -> QuantCheckpoint:
    """Write (or reuse) the FP8 checkpoint in ``folder``."""
    from transformers import FineGrainedFP8Config, Qwen3Config, Qwen3ForCausalLM
    from transformers.quantizers import AutoHfQuantizer

    from shardwise.testing import quantize_fp8_blocks

    folder = Path(folder)
    config = {**qwen3_config(layers), "seed": seed, "block": list(BLOCK)}
    stamp = folder / _STAMP
    if not (stamp.is_file() and json.loads(stamp.read_text()) == config):
        quantizer = AutoHfQuantizer.from_config(FineGrainedFP8Config(weight_block_size=list(BLOCK)),
                                                pre_quantized=True)
        with torch.device("meta"):
            model = Qwen3ForCausalLM(Qwen3Config(**qwen3_config(layers), dtype=torch.bfloat16))
        quantizer.preprocess_model(model)  # transformers' own FP8Linear replacement
        gen = torch.Generator().manual_seed(seed)
        state = {}
        for name, meta in model.state_dict(keep_vars=True).items():
            if name.endswith(".weight_scale_inv"):
                continue
            if meta.dim() == 1:
                state[name] = torch.ones(meta.shape, dtype=torch.bfloat16)
                continue
            value = torch.randn(meta.shape, generator=gen) * 0.02
            value *= torch.logspace(-1, 1, meta.shape[0])[:, None]  # blocks with different scales
            if meta.dtype == FP8:
                state[name], state[name + "_scale_inv"] = quantize_fp8_blocks(value, BLOCK)
            else:
                state[name] = value.to(torch.bfloat16)
            del value
        model.load_state_dict(state, assign=True, strict=True)
        del state
        quantizer.postprocess_model(model)
        model.hf_quantizer = quantizer
        model.save_pretrained(folder, max_shard_size="500MB")
        del model
        stamp.write_text(json.dumps(config))
    return _finish(folder, layers)


def _finish(folder: Path, layers: int) -> QuantCheckpoint:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    stored = bf16 = 0
    for f in files:
        with safe_open(str(f), "pt") as h:
            for key in h.keys():  # noqa: SIM118 - safe_open has no __iter__
                shape = h.get_slice(key).get_shape()
                dtype = h.get_slice(key).get_dtype()
                n = math.prod(shape)
                stored += n * {"F8_E4M3": 1, "F32": 4, "BF16": 2}[dtype]
                bf16 += 0 if key.endswith("_scale_inv") else 2 * n
    cfg = qwen3_config(layers)
    description = (f"a Qwen3-shaped FP8 checkpoint built in code ({layers} layers, hidden "
                   f"{cfg['hidden_size']}, MLP {cfg['intermediate_size']}, 16 heads / 8 kv heads of 128, "
                   f"vocab {cfg['vocab_size']}; "
                   "float8_e4m3fn weights with float32 weight_scale_inv per 128x128 block, embeddings, "
                   "norms and lm_head bf16; written by transformers' save_pretrained)")
    return QuantCheckpoint(folder, files, stored, bf16, description)


__all__ = ["QuantCheckpoint", "fp8_checkpoint", "qwen3_config"]
