"""The checkpoints ``peers.py`` loads, written by the libraries' own ``save_pretrained``, and the
fixed inputs of their first forward.

- ``llama``: a ``LlamaForCausalLM`` of about ``--llama-size`` bytes of bfloat16 (8 layers, GQA,
  untied head), written with transformers' ``save_pretrained`` (its default 5 GB files).
- ``flux2``: a diffusers ``Flux2Transformer2DModel`` of a few hundred MB of float32 (hidden
  1024 in 8 heads, 2 double-stream and 4 single-stream blocks), written with ``save_pretrained``.

A folder that already holds the same configuration (``peers_config.json``) is reused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_STAMP = "peers_config.json"


@dataclass
class PeerModel:
    kind: str            # "llama" | "flux2"
    folder: Path
    files: list[Path]    # the safetensors files
    total_bytes: int     # tensor bytes in the files
    library: str         # "transformers" | "diffusers"
    description: str


def llama_config(total_bytes: int, *, kv_heads: int = 4, ffn: float = 2.75, step: int = 512) -> dict:
    """The largest Llama of at most ``total_bytes`` of bfloat16 with 8 or more layers: hidden h
    a multiple of ``step``, heads of 128 (tp 1, 2 and 4 split whole heads), intermediate
    ~``ffn`` x h, ``kv_heads`` kv heads of 128, vocab 32000, untied head; then as many layers
    as still fit. The defaults are the peers benchmark's model; gpu_load.py asks a wider one."""
    vocab, kv = 32000, kv_heads * 128

    def inter(h):
        return (int(ffn * h) + 255) // 256 * 256

    def nbytes(h, layers):
        return 2 * (2 * vocab * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter(h)))

    h = max([step] + [h for h in range(step, 16384, step) if nbytes(h, 8) <= total_bytes])
    layers = 8
    while nbytes(h, layers + 1) <= total_bytes:
        layers += 1
    return dict(hidden_size=h, intermediate_size=inter(h), num_hidden_layers=layers,
                num_attention_heads=h // 128, num_key_value_heads=kv_heads, head_dim=128, vocab_size=vocab,
                max_position_embeddings=2048, tie_word_embeddings=False)


_FLUX2 = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
              num_attention_heads=8, joint_attention_dim=1024, timestep_guidance_channels=256, mlp_ratio=3.0,
              axes_dims_rope=(32, 32, 32, 32), guidance_embeds=False)


def _stamped(folder: Path, config: dict) -> bool:
    stamp = folder / _STAMP
    return stamp.is_file() and json.loads(stamp.read_text()) == config


def _stored_bytes(path: Path) -> int:
    """Bytes of the tensors a safetensors file holds, from its header (the format's own spec:
    an 8-byte little-endian header length, then JSON with each tensor's data offsets)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")


def _finish(kind: str, folder: Path, library: str, description: str) -> PeerModel:
    files = sorted(folder.glob("*.safetensors"))
    total = sum(_stored_bytes(f) for f in files)
    return PeerModel(kind, folder, files, total, library, description)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Small normal weights, norms at one: a forward that neither overflows nor is constant."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02)


def llama_checkpoint(folder: Path, total_bytes: int) -> PeerModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = llama_config(total_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    if not _stamped(folder, cfg):
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**cfg, dtype=torch.bfloat16))
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        _randomise(model, 0)
        model.save_pretrained(folder)
        (folder / _STAMP).write_text(json.dumps(cfg))
        del model
    desc = (f"LlamaForCausalLM, hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}, "
            f"{cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads / 4 kv heads, vocab "
            f"{cfg['vocab_size']}, untied head; bfloat16, written by transformers' save_pretrained")
    return _finish("llama", folder, "transformers", desc)


def flux2_checkpoint(folder: Path) -> PeerModel:
    from diffusers import Flux2Transformer2DModel

    folder.mkdir(parents=True, exist_ok=True)
    stamp = {k: list(v) if isinstance(v, tuple) else v for k, v in _FLUX2.items()}
    if not _stamped(folder, stamp):
        model = Flux2Transformer2DModel(**_FLUX2)
        _randomise(model, 1)
        model.save_pretrained(folder)
        (folder / _STAMP).write_text(json.dumps(stamp))
        del model
    c = _FLUX2
    desc = (f"Flux2Transformer2DModel, hidden {c['num_attention_heads'] * c['attention_head_dim']} in "
            f"{c['num_attention_heads']} heads, {c['num_layers']} double-stream + {c['num_single_layers']} "
            "single-stream blocks; float32, written by diffusers' save_pretrained")
    return _finish("flux2", folder, "diffusers", desc)


def model_class(kind: str):
    if kind == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel


def inputs(kind: str, tokens: int = 16) -> dict:
    """The fixed input of the first forward (the same on every rank and for every method):
    ``tokens`` token ids for the Llama, an 8 x 8 latent and 16 text tokens for Flux2."""
    g = torch.Generator().manual_seed(1234)
    if kind == "llama":
        return {"input_ids": torch.randint(0, 32000, (1, tokens), generator=g)}
    h = w = 8
    txt = 16
    img = [[0, i, j, 0] for i in range(h) for j in range(w)]
    return dict(hidden_states=torch.randn(1, h * w, _FLUX2["in_channels"], generator=g),
                encoder_hidden_states=torch.randn(1, txt, _FLUX2["joint_attention_dim"], generator=g),
                timestep=torch.tensor([0.5]), img_ids=torch.tensor([img], dtype=torch.float32),
                txt_ids=torch.tensor([[[0, 0, 0, t] for t in range(txt)]], dtype=torch.float32))


def output_of(kind: str, out) -> torch.Tensor:
    """The forward's output as a plain float CPU tensor (a DTensor output gathered)."""
    t = out.logits if kind == "llama" else out.sample
    if type(t).__name__ == "DTensor":
        t = t.full_tensor()
    return t.detach().float().cpu()


def local_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's tensors (the local part of each DTensor), counted once per tie."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        t = t.to_local() if type(t).__name__ == "DTensor" else t
        if t.is_meta or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


__all__ = ["PeerModel", "flux2_checkpoint", "inputs", "llama_checkpoint", "local_bytes", "model_class",
           "output_of"]
