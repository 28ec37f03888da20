"""Tiny Hugging Face models for the tests, saved with their library's own ``save_pretrained``.

Each kind builds a real transformers or diffusers model small enough for a test (a few
hundred kB), with seeded weights, and saves it into several files (``max_shard_size``) so
that the index is exercised. Shapes divide by 1, 2 and 4 (heads, kv heads, experts).

    folder = save_tiny("qwen3_tied", tmp_path / "ckpt")
    model = build_tiny("qwen3_tied")           # the same weights, one process
    out = forward(model, "qwen3_tied")         # logits / sample, a plain tensor

``KINDS`` maps a kind to ``(library, model class name, config factory)``; ``model_class``
returns the class a test passes to ``sw.from_pretrained``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

SHARD_SIZE = "60KB"  # several files for every kind


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def _qwen3_tied():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=64, tie_word_embeddings=True)


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                          decoder_sparse_step=1, mlp_only_layers=[0])


def _gpt_neox():
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False)


def _deepseek_v2():
    from transformers import DeepseekV2Config

    return DeepseekV2Config(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                            topk_group=1, max_position_embeddings=64)


def _deepseek_v3():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                            topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32,
                            qk_rope_head_dim=8, qk_nope_head_dim=16, qk_head_dim=24, v_head_dim=16,
                            max_position_embeddings=64)


def _qwen3_next():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                           linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                           shared_expert_intermediate_size=32, decoder_sparse_step=1,
                           max_position_embeddings=64)


def _muse_spark_text():  # an nn.Embedding subclass that normalises after the lookup, and MoE
    from transformers import MuseSparkTextConfig

    return MuseSparkTextConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=64, sliding_window=8, moe_intermediate_size=32,
                               num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=32,
                               bos_token_id=94, eos_token_id=95)


def _hrm_text():  # the checkpoint fuses gate|q|k|v into gqkv_proj and gate|up into gate_up_proj
    from transformers import HrmTextConfig

    return HrmTextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, head_dim=16, max_position_embeddings=64, H_cycles=1,
                         L_cycles=1, num_layers_per_stack=1)


def _minicpm5_moe():  # transformers 5.25: k_proj / v_proj are "unit_colwise" (whole heads a rank)
    from transformers import MiniCPM5MoeConfig

    return MiniCPM5MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                             topk_group=1, mlp_layer_types=["dense", "sparse"], max_position_embeddings=64)


def _flux2():
    return dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
                num_attention_heads=4, joint_attention_dim=32, timestep_guidance_channels=32,
                mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)


KINDS = {
    "llama": ("transformers", "LlamaForCausalLM", _llama),
    "qwen3_tied": ("transformers", "Qwen3ForCausalLM", _qwen3_tied),
    "mixtral": ("transformers", "MixtralForCausalLM", _mixtral),
    "qwen3_moe": ("transformers", "Qwen3MoeForCausalLM", _qwen3_moe),
    "gpt_neox": ("transformers", "GPTNeoXForCausalLM", _gpt_neox),
    "deepseek_v2": ("transformers", "DeepseekV2ForCausalLM", _deepseek_v2),
    "qwen3_next": ("transformers", "Qwen3NextForCausalLM", _qwen3_next),
    "deepseek_v3": ("transformers", "DeepseekV3ForCausalLM", _deepseek_v3),
    "muse_spark_text": ("transformers", "MuseSparkTextModel", _muse_spark_text),
    "hrm_text": ("transformers", "HrmTextForCausalLM", _hrm_text),
    "minicpm5_moe": ("transformers", "MiniCPM5MoeForCausalLM", _minicpm5_moe),
    "flux2": ("diffusers", "Flux2Transformer2DModel", _flux2),
}


def model_class(kind: str):
    library, name, _ = KINDS[kind]
    return getattr(importlib.import_module(library), name)


def build_tiny(kind: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny model with seeded random weights (every parameter, norms included), eval mode."""
    library, _, config = KINDS[kind]
    cls = model_class(kind)
    model = cls._from_config(config()) if library == "transformers" else cls.from_config(config())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            # Random norms and biases too, so a tensor loaded into the wrong place shows.
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def save_tiny(kind: str, folder: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
              max_shard_size: str = SHARD_SIZE) -> Path:
    """``build_tiny(kind)`` written by its library's ``save_pretrained`` into several files."""
    model = build_tiny(kind, seed=seed, dtype=dtype)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return Path(folder)


def inputs(kind: str) -> dict:
    """Fixed forward inputs for ``kind``."""
    gen = torch.Generator().manual_seed(1)
    if KINDS[kind][0] == "transformers":
        return {"input_ids": torch.randint(0, 96, (2, 7), generator=gen)}
    img, txt = 6, 5
    ids = lambda n: torch.stack([torch.zeros(n), torch.zeros(n), torch.arange(n), torch.zeros(n)], -1)
    return {
        "hidden_states": torch.randn(1, img, 8, generator=gen),
        "encoder_hidden_states": torch.randn(1, txt, 32, generator=gen),
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([3.5]),
        "img_ids": ids(img)[None],
        "txt_ids": ids(txt)[None],
    }


def forward(model: torch.nn.Module, kind: str) -> torch.Tensor:
    """The model's output on ``inputs(kind)`` as a plain (full, local) CPU tensor."""
    with torch.no_grad():
        out = model(**inputs(kind))
    out = out.logits if hasattr(out, "logits") else out.sample if hasattr(out, "sample") else out[0]
    if type(out).__name__ == "DTensor":
        out = out.full_tensor()
    return out.detach().float().cpu()


__all__ = ["KINDS", "SHARD_SIZE", "build_tiny", "forward", "inputs", "model_class", "save_tiny"]
