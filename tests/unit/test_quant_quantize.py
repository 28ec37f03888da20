"""FP8 block quantization (shardwise.core.quant.quantize_fp8_blocks), against its inverse, and
the scales of experts stored per expert (shardwise.core.quant_layout.scale_pieces).

What the hub stores and what :func:`dequantize_region` reads back: any shape (leading expert
dims, partial last blocks), any block. transformers' ``Fp8Quantize`` bit for bit is checked in
tests/hf/test_fp8.py (it needs transformers).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.core.pieces import Piece, check_tiling
from shardwise.core.quant import dequantize_region, quantize_fp8_blocks, scale_shape
from shardwise.core.quant_layout import scale_pieces
from shardwise.core.spec import Region
from shardwise.errors import PlanError

FAST = settings(max_examples=60, deadline=None)
FP8_MAX = 448.0
SUBNORMAL_STEP = 2.0**-9  # e4m3's smallest step, in units of the block's scale


def weights(draw, lead, rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, rows, cols, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
    zero_block = draw(st.booleans())
    if zero_block and rows and cols:
        w[..., : max(1, rows // 3), : max(1, cols // 3)] = 0
    return w


@FAST
@given(st.data())
def test_dequantizing_the_quantized_weight_is_within_e4m3_rounding(data):
    lead = tuple(data.draw(st.lists(st.integers(1, 3), max_size=1)))
    rows, cols = data.draw(st.integers(1, 90)), data.draw(st.integers(1, 90))
    block = (data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40)))
    w = weights(data.draw, lead, rows, cols, data.draw(st.integers(0, 2**16)))
    q, s = quantize_fp8_blocks(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == w.shape and q.is_contiguous()
    ndim_block = (1,) * len(lead) + block
    assert tuple(s.shape) == scale_shape(tuple(w.shape), ndim_block)
    assert q.float().abs().max() <= FP8_MAX
    whole = Region((0,) * w.dim(), tuple(w.shape))
    back = dequantize_region(q, s, whole, ndim_block, torch.float32)
    step = dequantize_region(torch.ones_like(q), s, whole, ndim_block, torch.float32) * SUBNORMAL_STEP
    # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 of the value, or half the subnormal step
    assert torch.all((back - w).abs() <= w.abs() * 2.0**-4 + step / 2 + 1e-30)
    # every block's largest value is quantized to +-448 (an all-zero block: scale 1, zeros)
    blocks = scale_shape(tuple(w.shape), ndim_block)
    for i in range(blocks[-2]):
        for j in range(blocks[-1]):
            tile = q[..., i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            amax = tile.abs().flatten(-2).amax(-1)
            zero = w[..., i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].abs()
            zero = zero.flatten(-2).amax(-1) == 0
            assert torch.all(torch.where(zero, s[..., i, j] == 1, amax == FP8_MAX))


@FAST
@given(st.data())
def test_each_block_is_quantized_on_its_own(data):
    """A block-aligned box of the weight quantizes to the same box of the whole's quantization:
    what lets any rank, or a later save, requantize its shard without its neighbours."""
    rows, cols = data.draw(st.integers(2, 80)), data.draw(st.integers(2, 80))
    block = (data.draw(st.integers(1, 30)), data.draw(st.integers(1, 30)))
    w = weights(data.draw, (), rows, cols, data.draw(st.integers(0, 2**16)))
    q, s = quantize_fp8_blocks(w, block)
    bi = data.draw(st.integers(0, (rows - 1) // block[0]))
    bj = data.draw(st.integers(0, (cols - 1) // block[1]))
    r0, c0 = bi * block[0], bj * block[1]
    part_q, part_s = quantize_fp8_blocks(w[r0:, c0:], block)
    assert torch.equal(part_q.view(torch.uint8), q[r0:, c0:].contiguous().view(torch.uint8))
    assert torch.equal(part_s, s[bi:, bj:])


def test_bf16_input_and_experts_dims():
    w = torch.randn(2, 200, 130, dtype=torch.bfloat16)
    q, s = quantize_fp8_blocks(w)
    assert s.shape == (2, 2, 2)
    one_q, one_s = quantize_fp8_blocks(w[1])
    assert torch.equal(one_q.view(torch.uint8), q[1].view(torch.uint8)) and torch.equal(one_s, s[1])


@pytest.mark.parametrize("shape,block", [((5,), (2, 2)), ((4, 4), (2,)), ((4, 4), (0, 2)),
                                         ((4, 4), (2, None))])
def test_bad_shapes_and_blocks_are_refused(shape, block):
    with pytest.raises(PlanError):
        quantize_fp8_blocks(torch.ones(shape), block)


def _experts(num: int, rows: int, cols: int) -> list[Piece]:
    """gate_up of ``num`` experts stored per expert: gate rows [0, rows), up rows [rows, 2 rows)."""
    return [Piece(f"e.{e}.{proj}", Region((0, 0), (rows, cols)), (e, half * rows, 0), (0,))
            for e in range(num) for half, proj in enumerate(("gate", "up"))]


def test_per_expert_scales_tile_the_fused_scales():
    pieces = scale_pieces(_experts(3, 256, 300), (1, 128, 128), lambda k: k + "_scale_inv")
    check_tiling(scale_shape((3, 512, 300), (1, 128, 128)), pieces, "scales")  # raises unless exact
    assert [(p.key, p.source.sizes, p.offsets) for p in pieces[:2]] == [
        ("e.0.gate_scale_inv", (2, 3), (0, 0, 0)), ("e.0.up_scale_inv", (2, 3), (0, 2, 0))]


def test_per_expert_scales_refuse_a_half_that_cuts_a_block():
    with pytest.raises(PlanError, match="'e.0.up' lands at .* cuts its 128-wide blocks on dim 1"):
        scale_pieces(_experts(1, 192, 256), (1, 128, 128), lambda k: k + "_scale_inv")
