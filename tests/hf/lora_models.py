"""Tiny transformers models and PEFT adapters for the LoRA tests, made on one process with PEFT
itself: ``make(kind, folder)`` writes the base checkpoint and two adapters (``a``, ``b``) and
returns the one-process reference outputs."""

from __future__ import annotations

from pathlib import Path

import torch

TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
              "lm_head"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"],
    "qwen3": ["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
VOCAB = 96


def config(kind: str):
    from transformers import LlamaConfig, Phi3Config, Qwen3Config

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                 tie_word_embeddings=False)
    if kind == "llama":
        return LlamaConfig(**shape)
    if kind == "qwen3":  # tied: the vocab-parallel embedding is also the head
        return Qwen3Config(**{**shape, "tie_word_embeddings": True}, head_dim=16)
    return Phi3Config(**shape, pad_token_id=0)


def model_class(kind: str):
    from transformers import LlamaForCausalLM, Phi3ForCausalLM, Qwen3ForCausalLM

    return {"llama": LlamaForCausalLM, "phi3": Phi3ForCausalLM, "qwen3": Qwen3ForCausalLM}[kind]


def build(kind: str) -> torch.nn.Module:
    model = model_class(kind)._from_config(config(kind))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids()).logits.detach().float()


def lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def combine(model, names=("a", "b"), weight=0.5) -> None:
    """Both adapters active, ``b`` at ``weight`` (PEFT's per-layer API)."""
    for layer in lora_layers(model):
        layer.set_adapter(list(names))
        layer.set_scale(names[1], weight)


def make(kind: str, folder: Path) -> dict:
    """Base checkpoint ``folder/ckpt``, adapters ``folder/a`` and ``folder/b`` (rank 4 and 8, random
    A and B), and the one-process outputs: base, a, b, a + 0.5 b, a merged."""
    from peft import LoraConfig, PeftModel, get_peft_model

    build(kind).save_pretrained(folder / "ckpt", max_shard_size="60KB")
    for name, r, seed in (("a", 4, 1), ("b", 8, 2)):
        torch.manual_seed(seed)
        peft = get_peft_model(build(kind), LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS[kind],
                                                      init_lora_weights=False))
        peft.save_pretrained(folder / name, save_embedding_layers=False)
    model = PeftModel.from_pretrained(build(kind), folder / "a", adapter_name="a")
    model.load_adapter(folder / "b", adapter_name="b")
    # a tied embedding's merge changes the head too
    return {"base": logits(build(kind)), "a": logits(model), **switched(model, logits, model.set_adapter)}


def switched(model, logits, select) -> dict:
    """From adapter ``a`` active: the outputs (``logits(model)``) with ``b``, with ``a + 0.5 b``,
    and with ``a`` merged into the base; ``select(name)`` makes an adapter the active one
    (``PeftModel.set_adapter``, or ``peft.functional.set_adapter`` on a model PEFT did not wrap)."""
    select("b")
    out = {"b": logits(model)}
    combine(model)
    out["ab"] = logits(model)
    select("a")
    for layer in lora_layers(model):
        layer.merge()
    out["merged"] = logits(model)
    return out


__all__ = ["TARGETS", "build", "combine", "config", "ids", "logits", "lora_layers", "make", "model_class",
           "switched"]
