"""Tiny diffusers pipelines for the tests, built offline and saved with ``save_pretrained``.

Three families: Flux2 (Flux2 transformer, a Mistral3 text encoder, the Flux2 VAE), QwenImage
(QwenImage transformer, a Qwen2.5-VL text encoder, the QwenImage VAE) and Wan (Wan transformer,
no TP plan; a UMT5 encoder, shardwise's plan; the Wan VAE), each with a byte-level
tokenizer built here from the ``tokenizers`` library (no download). Every sharded dimension
(heads, kv heads, MLP width, vocabulary) divides by 1, 2 and 4.

    folder = save_pipeline("flux2", tmp_path / "pipe")
    pipe = build_pipeline("flux2")             # the same weights, one process
    image = generate(pipe, "flux2")            # a fixed-seed image, a plain tensor
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

import torch

TEXT_HIDDEN = 32
VOCAB = 264  # 256 bytes and the specials, padded to a multiple of 8
# A chat template over diffusers' Flux2 messages (content: a list of {"type": "text", ...})
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
                 "{{ c['text'] }}{% endfor %}<|im_end|>\n{% endfor %}")


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (one token per byte) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    built = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", chat_template=CHAT_TEMPLATE,
                                    model_max_length=4096)
    # as a hub folder holds it: written by a tokenizer that was itself loaded (transformers adds
    # is_local / local_files_only to tokenizer_config.json on the first load)
    with tempfile.TemporaryDirectory() as tmp:
        built.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def _mistral3():
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": VOCAB, "hidden_size": TEXT_HIDDEN,
                     "intermediate_size": 64, "max_position_embeddings": 4096, "num_attention_heads": 4,
                     "num_hidden_layers": 2, "num_key_value_heads": 4, "head_dim": 8, "sliding_window": None,
                     "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 4, "intermediate_size": 32, "image_size": 30, "patch_size": 6},
        image_token_index=3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return Mistral3ForConditionalGeneration._from_config(config, dtype=torch.float32)  # as the hub's


def _qwen25vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": TEXT_HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": VOCAB,
                     "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": TEXT_HIDDEN},
        vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, vision_start_token_id=3, vision_end_token_id=4,
        vision_token_id=5, image_token_id=6, video_token_id=7)
    return Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.float32)


def _flux2_components() -> dict:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    return {
        "transformer": Flux2Transformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=2 * TEXT_HIDDEN, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4)),
        "text_encoder": _mistral3(),
        "vae": AutoencoderKLFlux2(
            sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
            latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False),
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "tokenizer": byte_tokenizer(),
    }


def _qwenimage_components() -> dict:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    return {
        "transformer": QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=TEXT_HIDDEN, guidance_embeds=False,
            axes_dims_rope=(8, 4, 4)),
        "text_encoder": _qwen25vl(),
        "vae": AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                      temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                      latents_std=[1.0] * 4),
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "tokenizer": byte_tokenizer(),
    }


def _umt5():
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=VOCAB, d_model=TEXT_HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=16,
                        feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0)
    return UMT5EncoderModel(config)


def _wan_components() -> dict:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    return {
        "transformer": WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=TEXT_HIDDEN, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        "text_encoder": _umt5(),
        "vae": AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                latents_std=[1.0] * 4),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
        "tokenizer": byte_tokenizer(),
    }


# family -> (pipeline class name, components factory, call options)
FAMILIES = {
    "flux2": ("Flux2Pipeline", _flux2_components,
              {"height": 16, "width": 16, "guidance_scale": 4.0, "max_sequence_length": 48,
               "text_encoder_out_layers": (1, 2)}),
    "qwenimage": ("QwenImagePipeline", _qwenimage_components,
                  {"height": 32, "width": 32, "true_cfg_scale": 1.0, "max_sequence_length": 16}),
    "wan": ("WanPipeline", _wan_components,
            {"height": 16, "width": 16, "num_frames": 5, "guidance_scale": 5.0, "max_sequence_length": 16}),
}
SHARDED = ("transformer", "text_encoder")  # the components with a TP plan in Flux2 and QwenImage
# the components with a TP plan in each family: Wan's transformer ships none
SHARDED_IN = {"flux2": SHARDED, "qwenimage": SHARDED, "wan": ("text_encoder",)}


def pipeline_class(family: str):
    return getattr(importlib.import_module("diffusers"), FAMILIES[family][0])


def build_pipeline(family: str, *, seed: int = 0):
    """The tiny pipeline with seeded random weights (norms and biases too), float32, eval mode."""
    components = FAMILIES[family][1]()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("transformer", "text_encoder", "vae"):
            for p in components[name].parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            components[name].eval()
    return pipeline_class(family)(**components)


def save_pipeline(family: str, folder: str | Path, *, seed: int = 0, max_shard_size: str = "60KB") -> Path:
    """``build_pipeline(family)`` written by diffusers' ``save_pretrained``, each model in several files."""
    build_pipeline(family, seed=seed).save_pretrained(folder, max_shard_size=max_shard_size)
    return Path(folder)


def generate(pipe, family: str, *, steps: int = 2) -> torch.Tensor:
    """The image ``pipe`` makes for a fixed prompt and seed, as a plain CPU tensor."""
    options = FAMILIES[family][2]
    with torch.no_grad():
        out = pipe(prompt="a tiny red fox", num_inference_steps=steps, output_type="pt",
                   generator=torch.Generator().manual_seed(7), **options)
    frames = out.frames if hasattr(out, "frames") else out.images  # a video pipeline's output
    return frames.detach().float().cpu()


__all__ = ["FAMILIES", "SHARDED", "SHARDED_IN", "build_pipeline", "byte_tokenizer", "generate",
           "pipeline_class", "save_pipeline"]
