"""diffusers transformers with the ``_tp_plan`` they ship (Flux, Flux2, QwenImage), tiny, at
degree 2 and 4 in both holdings: outputs equal one process, and no diffusers warning about
config attributes read off the model (head counts come from ``model.config``)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("diffusers")

import torch  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402

HEADS, HEAD_DIM, TXT, H, W = 4, 16, 6, 4, 4


def _flux():
    from diffusers import FluxTransformer2DModel

    cfg = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
               num_attention_heads=HEADS, joint_attention_dim=32, pooled_projection_dim=32,
               guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    g = torch.Generator().manual_seed(3)
    img = torch.tensor([[0, i, j] for i in range(H) for j in range(W)], dtype=torch.float32)
    inputs = dict(hidden_states=torch.randn(1, H * W, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, TXT, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.3]),
                  img_ids=img, txt_ids=torch.zeros(TXT, 3))
    return FluxTransformer2DModel, cfg, inputs


def _flux2():
    from diffusers import Flux2Transformer2DModel

    cfg = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
               num_attention_heads=HEADS, joint_attention_dim=32, timestep_guidance_channels=32,
               mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    g = torch.Generator().manual_seed(3)
    img = [[0, i, j, 0] for i in range(H) for j in range(W)]
    txt = [[0, 0, 0, t] for t in range(TXT)]
    inputs = dict(hidden_states=torch.randn(1, H * W, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, TXT, 32, generator=g), timestep=torch.tensor([0.3]),
                  img_ids=torch.tensor([img], dtype=torch.float32),
                  txt_ids=torch.tensor([txt], dtype=torch.float32))
    return Flux2Transformer2DModel, cfg, inputs


def _qwen_image():
    from diffusers import QwenImageTransformer2DModel

    cfg = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=HEAD_DIM,
               num_attention_heads=HEADS, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    g = torch.Generator().manual_seed(3)
    inputs = dict(hidden_states=torch.randn(1, H * W, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, TXT, 32, generator=g),
                  encoder_hidden_states_mask=torch.ones(1, TXT), timestep=torch.tensor([0.3]),
                  img_shapes=[[(1, H, W)]])
    return QwenImageTransformer2DModel, cfg, inputs


def _build(make):
    cls, cfg, inputs = make()
    torch.manual_seed(0)
    model = cls.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial everywhere (zero-initialised output layers too)
            p.add_(torch.randn_like(p) * 0.05)
    return model, inputs


def _sample(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def _run(degree: int):
    backend = sw.init_backend("gloo")
    diffs = {}
    for make in (_flux, _flux2, _qwen_image):
        reference, inputs = _build(make)
        want = _sample(reference, inputs)
        for holding in ("dtensor", "local"):
            model, _ = _build(make)
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)  # diffusers' config-attribute warning
                sw.parallelize(model, "auto", backend.mesh(tp=degree), holding=holding)
            got = _sample(model, inputs)
            assert got.shape == want.shape
            diffs[(make.__name__, holding)] = (got - want).abs().max().item()
    return diffs


@pytest.mark.parametrize("degree", [2, 4])
def test_shipped_plans_at_degree(degree):
    for diffs in run_ranks(_run, degree, degree, timeout=240):
        bad = {k: v for k, v in diffs.items() if v > 1e-4}
        assert not bad and len(diffs) == 6, bad
