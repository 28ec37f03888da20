"""Tiny configurations and fixed inputs for the diffusers classes with a ``_tp_plan``.

Each entry maps a class name to ``(config(tp) -> kwargs, inputs(config) -> kwargs)``:
4 heads of 16, 2 double-stream and 2 single-stream blocks, small latent and text widths,
rotary axes that sum to the head dim. A class diffusers adds later without an entry here is
listed by the sweep as "not set up" instead of being guessed.
"""

from __future__ import annotations

import torch

_HEADS, _HEAD_DIM, _TXT, _H, _W, _BATCH = 4, 16, 6, 4, 4, 2


def _gen():
    return torch.Generator().manual_seed(4321)


def _ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _flux_config(tp: int) -> dict:
    return dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                attention_head_dim=_HEAD_DIM, num_attention_heads=_HEADS, joint_attention_dim=32,
                pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))


def _flux_inputs(config) -> dict:
    g = _gen()
    img = [[0, i, j] for i in range(_H) for j in range(_W)]
    return dict(hidden_states=torch.randn(_BATCH, _H * _W, config.in_channels, generator=g),
                encoder_hidden_states=torch.randn(_BATCH, _TXT, config.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(_BATCH, config.pooled_projection_dim, generator=g),
                timestep=torch.tensor([0.3, 0.7]), img_ids=_ids(img), txt_ids=torch.zeros(_TXT, 3))


def _flux2_config(tp: int) -> dict:
    return dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                attention_head_dim=_HEAD_DIM, num_attention_heads=_HEADS, joint_attention_dim=32,
                timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4),
                guidance_embeds=False)


def _flux2_inputs(config) -> dict:
    g = _gen()
    img = [[0, i, j, 0] for i in range(_H) for j in range(_W)]
    txt = [[0, 0, 0, t] for t in range(_TXT)]
    return dict(hidden_states=torch.randn(_BATCH, _H * _W, config.in_channels, generator=g),
                encoder_hidden_states=torch.randn(_BATCH, _TXT, config.joint_attention_dim, generator=g),
                timestep=torch.tensor([0.3, 0.7]),
                img_ids=_ids([img] * _BATCH), txt_ids=_ids([txt] * _BATCH))


def _qwen_config(tp: int) -> dict:
    return dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                attention_head_dim=_HEAD_DIM, num_attention_heads=_HEADS, joint_attention_dim=32,
                axes_dims_rope=(4, 6, 6))


def _qwen_inputs(config) -> dict:
    g = _gen()
    return dict(hidden_states=torch.randn(_BATCH, _H * _W, config.in_channels, generator=g),
                encoder_hidden_states=torch.randn(_BATCH, _TXT, config.joint_attention_dim, generator=g),
                encoder_hidden_states_mask=torch.ones(_BATCH, _TXT),
                timestep=torch.tensor([0.3, 0.7]), img_shapes=[[(1, _H, _W)]] * _BATCH)


def _qwen21_config(tp: int) -> dict:
    return dict(patch_size=1, in_channels=16, out_channels=16, num_layers=2,
                attention_head_dim=_HEAD_DIM, num_attention_heads=_HEADS, context_in_dim=32,
                mlp_ratio=2, axes_dims_rope=(4, 6, 6))


def _qwen21_inputs(config) -> dict:
    g = _gen()
    slots = _H * _W // 4  # one vision-language slot per 2x2 latent tokens
    mask = torch.tensor([[False] * _TXT + [True] * slots] * _BATCH)
    return dict(hidden_states=torch.randn(_BATCH, _H * _W, config.in_channels, generator=g),
                encoder_hidden_states=torch.randn(_BATCH, _TXT, config.context_in_dim, generator=g),
                timestep=torch.tensor([0.3, 0.7]), img_shapes=[[(1, _H, _W)]] * _BATCH,
                img_mask=mask)


DIFFUSERS_CASES = {
    "FluxTransformer2DModel": (_flux_config, _flux_inputs),
    "Flux2Transformer2DModel": (_flux2_config, _flux2_inputs),
    "QwenImageTransformer2DModel": (_qwen_config, _qwen_inputs),
    "QwenImage21Transformer2DModel": (_qwen21_config, _qwen21_inputs),
}
