"""Tiny configurations for the zoo sweep (``benchmarks/zoo.py``).

``tiny_config(config_class, tp)`` starts from the class's defaults and shrinks every
size-like field by name (hidden 64, 3 layers, 4 heads of 16, vocab 256, 4 experts with 2
active, small intermediate sizes), so that one rule covers most families; a rule never
grows a field, except kv heads: 4 (= heads) where the family is multi-head or MLA, else
``max(2, tp)``. Fields a default leaves None although the model needs them are filled
(``_FILL_NONE``); ``OVERRIDES`` holds the few per-family fields no rule can guess. Per-layer
lists are rebuilt for the new layer count so that every layer kind the family has
(sliding/full attention, linear attention, dense/MoE MLP) still appears at least once.
"""

from __future__ import annotations

import dataclasses
import re

HIDDEN = 64
LAYERS = 3
HEADS = 4
HEAD_DIM = 16
VOCAB = 256
EXPERTS = 4
INTER = 64        # dense MLP width
EXPERT_INTER = 32  # per-expert MLP width

# Exact field names -> value (a callable gets the tp degree).
_EXACT = {
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "embedding_dim": HIDDEN,
    "dim": HIDDEN, "moe_hidden_size": EXPERT_INTER,
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "num_layers": LAYERS, "depth": LAYERS,
    "num_attention_heads": HEADS, "n_head": HEADS, "num_heads": HEADS,
    "swa_num_attention_heads": HEADS, "num_sliding_attention_heads": HEADS,
    "swa_num_key_value_heads": lambda tp: max(2, tp),
    "head_dim": HEAD_DIM, "swa_head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM,
    "d_rel": 8, "rotary_dim": 8, "index_head_dim": HEAD_DIM, "index_n_heads": HEADS,
    "index_topk": 8, "index_topk_blocks": 2, "index_block_size": 4, "index_kpool": 2,
    "vocab_size": VOCAB, "unpadded_vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
    "vision_vocab_size": 64, "ngram_vocab_size_base": 512, "make_ngram_vocab_size_divisible_by": 8,
    "split_ngram_parts": 4, "codebook_size": 64,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "model_max_length": 128,
    "original_max_position_embeddings": 64, "rel_extent": 64, "log_scaling_n_floor": 64,
    "floor_scale": 64, "attention_chunk_size": 8, "keep_window_size": 8,
    "sliding_window": 8, "sliding_window_size": 8, "block_size": 8, "chunk_size": 16,
    "mamba_chunk_size": 16,
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS, "zero_expert_num": 1,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_topk": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 2, "num_expert_group": 2, "topk_group": 1,
    "kv_lora_rank": 32, "q_lora_rank": 32, "o_lora_rank": 32, "o_groups": 2,
    "qk_nope_head_dim": HEAD_DIM, "qk_rope_head_dim": 8, "v_head_dim": HEAD_DIM,
    "qk_head_dim": HEAD_DIM + 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": HEADS, "linear_num_heads": HEADS,
    "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM, "linear_head_dim": HEAD_DIM,
    "mamba_d_state": 16, "ssm_state_size": 16, "mamba_n_heads": 8, "mamba_num_heads": 8,
    "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_d_ssm": 128, "mamba_dt_rank": 8,
    "n_groups": 2, "laurel_rank": 8, "hidden_size_per_layer_input": 8, "altup_num_inputs": 2,
    "gated_norm_rank": 8, "loop_gate_rank": 8, "hc_lowrank": 8, "ple_embed_dim": 16,
    "embedding_rank": 16, "dim_model_base": HIDDEN, "block_multiple_of": 16,
    # every-n / offset patterns: with 3 layers both kinds of layer appear
    "full_attention_interval": 2, "sliding_window_pattern": 2, "_sliding_window_pattern": 2,
    "global_attn_every_n_layers": 2, "no_rope_layer_interval": 2, "attn_layer_period": 2,
    "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
    "first_k_dense_replace": 1, "num_dense_layers": 1, "layer_group_size": 2,
    "n_layers_per_attn_res_block": 2, "moe_layer_start_index": 1, "moe_layer_end_index": LAYERS - 1,
    "num_kv_shared_layers": 1, "max_window_layers": 1, "loop_layer_index_start": 1,
    "loop_layer_index_end": 2, "n_input_layers": 1, "n_output_layers": 1, "n_recurrent_layers": 1,
    "num_layers_per_stack": 1, "H_cycles": 1, "L_cycles": 1,
}
# Substring rules for widths not named above (first match wins).
_WIDTHS = [
    (re.compile(r"(moe|expert).*(intermediate|hidden|dim)|(intermediate|ffn).*(moe|expert)"), EXPERT_INTER),
    (re.compile(r"intermediate_size|ffn_hidden_size|projector_hidden|out_hidden_size|adapter_.*dim|"
                r"projector_.*dim|vision_output_dim|prediction_head_size"), INTER),
]
# Fields whose default is None but which the model needs (a default that does not run).
_FILL_NONE = {"num_experts_per_tok": 2, "top_k_experts": 2, "num_local_experts": EXPERTS,
              "num_experts": EXPERTS, "n_routed_experts": EXPERTS, "sliding_window": 8,
              "moe_intermediate_size": EXPERT_INTER, "shared_expert_intermediate_size": EXPERT_INTER,
              "v_head_dim": HEAD_DIM}
# Per-family fields on top of the rules (model_type -> {field: value}).
# Hybrids whose defaults have no attention layer at all (their one-process forward fails).
OVERRIDES: dict[str, dict] = {
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention", "linear_attention"]},
    "lfm2": {"full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"]},
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse", "sparse"]},
    # Flux.2's text encoder: AutoConfig sub-configs, which the rules cannot shrink
    "mistral3": {"text_config": {"model_type": "mistral", "vocab_size": VOCAB, "hidden_size": HIDDEN,
                                 "intermediate_size": INTER, "num_hidden_layers": LAYERS,
                                 "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
                                 "head_dim": HEAD_DIM, "max_position_embeddings": 128,
                                 "sliding_window": None},
                 "vision_config": {"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1,
                                   "num_attention_heads": 4, "intermediate_size": 32, "image_size": 30,
                                   "patch_size": 6}, "image_token_index": 3},
    "inkling2_loop_text": {"n_layers_per_attn_res_block": 1},
}
_SKIP = {"id2label", "label2id", "architectures", "transformers_version", "dtype", "head_dim",
         "rope_parameters"}
_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
_TOKEN_FIELDS = re.compile(r"(^|_)(bos|eos|pad|sep|eod|mask|unk|document|cls)_token(_id|_index)?$")


def _field_defaults(config_class) -> dict:
    """Declared dataclass defaults (None where a list is derived in ``__post_init__``)."""
    out = {}
    if dataclasses.is_dataclass(config_class):
        for f in dataclasses.fields(config_class):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
    return out


def _resample(values: list, n: int) -> list:
    """A per-layer list for ``n`` layers that keeps each distinct kind the original has."""
    kinds = list(dict.fromkeys(map(repr, values)))
    by_repr = {repr(v): v for v in values}
    if len(kinds) >= n:  # keep the first and the rarest kinds
        return [by_repr[k] for k in kinds[:n]]
    return [by_repr[kinds[i % len(kinds)]] for i in range(n)]


# Fields set to the rule's value whatever the default; every other rule only ever shrinks.
_FORCED = {"num_key_value_heads", "swa_num_key_value_heads"}


def _shrink_value(name: str, value, tp: int, old_layers: int | None):
    if isinstance(value, bool) or value is None:
        return value
    if name in _EXACT and isinstance(value, int):
        new = _EXACT[name]
        new = new(tp) if callable(new) else new
        return new if name in _FORCED else min(value, new)
    if isinstance(value, int) and _TOKEN_FIELDS.search(name):
        return value if value < VOCAB - 8 else VOCAB - 1 - sum(map(ord, name)) % 4
    if isinstance(value, int) and value > 8:
        for pattern, new in _WIDTHS:
            if pattern.search(name):
                return new
    if isinstance(value, list) and old_layers and len(value) == old_layers and old_layers > LAYERS:
        if name == "num_attention_heads_per_layer":
            return [HEADS] * LAYERS
        return _resample(value, LAYERS)
    if isinstance(value, list) and name.endswith(("_layers", "_idxs", "_layer_ids")) and \
            all(isinstance(v, int) for v in value):
        return [v for v in value if v < LAYERS] or value[:0]
    return value


def _rope(current: dict, head_dim: int, uses_mrope: bool):
    """rope_parameters with multimodal rotary sections that fit the tiny head dim."""
    rope = current.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_type" not in rope:
        return rope  # absent, or one dict per layer type: leave it to the config
    rope = dict(rope)
    factor = rope.get("partial_rotary_factor", current.get("partial_rotary_factor")) or 1.0
    half = int(head_dim * factor) // 2
    old = rope.get("mrope_section") or ([8, 12, 12] if uses_mrope else None)
    if not old:
        return current.get("rope_parameters")
    # The sections split the rotary frequencies: they must sum to half the rotary dim.
    new = [max(1, s * half // sum(old)) for s in old]
    new[-1] += half - sum(new)
    rope["mrope_section"] = new
    return rope


def _modeling_source(config_class) -> str:
    import importlib
    import inspect

    try:
        module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
        return inspect.getsource(module)
    except Exception:  # no modeling module: nothing to learn from it
        return ""


def tiny_kwargs(config_class, tp: int, model_type: str = "") -> dict:
    """Keyword arguments that turn ``config_class``'s defaults into a tiny model."""
    current = config_class().to_dict()
    defaults = _field_defaults(config_class)
    old_layers = next((current[k] for k in _LAYER_COUNT_FIELDS if isinstance(current.get(k), int)), None)
    subs = getattr(config_class, "sub_configs", {}) or {}
    kwargs = {}
    for name, value in current.items():
        if name in _SKIP or name in subs:
            continue
        if isinstance(value, list) and name in defaults and defaults[name] is None:
            continue  # derived from the (new) layer count in __post_init__
        new = _shrink_value(name, value, tp, old_layers)
        if new is not value and new != value:
            kwargs[name] = new
    if "num_key_value_heads" in current:
        kv, heads = current["num_key_value_heads"], current.get("num_attention_heads")
        # Multi-head (and MLA) families keep kv == heads; grouped and multi-query ones get >= tp.
        kwargs["num_key_value_heads"] = HEADS if kv in (None, heads) else max(2, tp)
    for name, value in _FILL_NONE.items():  # defaults left unset that the model needs
        if name in current and current[name] is None:
            kwargs[name] = value
    if "qk_rope_head_dim" not in current and ("head_dim" in current or "head_dim" in defaults):
        kwargs["head_dim"] = HEAD_DIM  # MLA configs derive head_dim from their rope/nope parts
    rotary = kwargs.get("qk_rope_head_dim") or kwargs.get("head_dim", HIDDEN // HEADS)
    rope = _rope(current, rotary,
                 "mrope_section" in _modeling_source(config_class))
    if rope is not None and rope != current.get("rope_parameters"):
        kwargs["rope_parameters"] = rope
    for sub, sub_class in subs.items():
        if isinstance(sub_class, type) and hasattr(sub_class, "to_dict"):
            try:
                kwargs[sub] = {**tiny_kwargs(sub_class, tp), "model_type": sub_class.model_type}
            except Exception:  # an auto sub-config or one without defaults: keep the parent's
                pass
    kwargs.update(OVERRIDES.get(model_type, {}))
    return kwargs


def tiny_config(config_class, tp: int, model_type: str = ""):
    """An instance of ``config_class`` shrunk for the sweep, in float32.

    Per-layer kind lists (``layer_types``, ``mlp_layer_types``, ...) that the config derives
    from the layer count can lose a kind at 3 layers (Qwen3-Next's one full-attention layer
    in 4); those are then passed explicitly, resampled from the defaults."""
    import torch

    kwargs = tiny_kwargs(config_class, tp, model_type)
    config = config_class(**kwargs)
    base = config_class()
    old_layers = next((getattr(base, k) for k in _LAYER_COUNT_FIELDS
                       if isinstance(getattr(base, k, None), int)), None)
    fixed = {}
    for name, value in base.to_dict().items():
        if name in kwargs or not isinstance(value, list) or len(value) != old_layers:
            continue
        kinds = set(map(repr, value))
        got = getattr(config, name, None)
        if len(kinds) > 1 and isinstance(got, list) and set(map(repr, got)) < kinds:
            fixed[name] = _resample(value, len(got))
    if fixed:
        config = config_class(**kwargs, **fixed)
    config.dtype = torch.float32
    return config


__all__ = ["OVERRIDES", "tiny_config", "tiny_kwargs"]
