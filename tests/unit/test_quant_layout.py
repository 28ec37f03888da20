"""Where an FP8 weight's scales live on each rank (shardwise.core.quant_layout), pure.

For any 2-D weight, block, degree and style (colwise, rowwise, packed): each rank's scales
are the scales of every block its weight shard touches; the boxes the ranks contribute to a
gather tile the scale tensor exactly once; a rank's dequantized shard is the same slice of
the full dequantization bit for bit; and where a tie is "aligned" the pair is an ordinary
shard that a kernel reading local row i with scale row i // block dequantizes right.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quant_regions import random_fp8, random_scales, reference_dequant, same_bits
from torch import nn

from shardwise.core.plan import resolve_plan
from shardwise.core.quant_layout import (
    QuantTie,
    quant_ties,
    scale_layout,
    scale_local_shape,
    scale_owned_layout,
    take_layout,
    tie_aligned,
)
from shardwise.core.spec import Region, ShardSpec, local_layout, split
from shardwise.errors import PlanError
from shardwise.testing import dequantized_shard

FAST = settings(max_examples=60, deadline=None)


@st.composite
def tie_case(draw):
    """A weight shape (its sharded dim a multiple of degree x packed blocks), block, spec, degree."""
    degree = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    dim = draw(st.sampled_from([0, 1, None]))
    blocks = draw(st.sampled_from([(1,), (1, 1), (1, 3)])) if dim is not None else (1,)
    shape = [draw(st.integers(1, 200)), draw(st.integers(1, 200))]
    if dim is not None:
        unit = degree * sum(blocks)
        shape[dim] = unit * draw(st.integers(1, max(1, 300 // unit)))
    block = (draw(st.sampled_from([1, 2, 3, 16, 32, 64, 128])), draw(st.sampled_from([1, 5, 32, 128])))
    spec = ShardSpec() if dim is None else ShardSpec(dim=dim, blocks=blocks)
    return QuantTie("w", tuple(shape), block), spec, degree


@FAST
@given(case=tie_case())
def test_owned_boxes_tile_the_scale_tensor_once_and_sit_in_the_held_scales(case):
    tie, spec, degree = case
    hits = torch.zeros(tie.scale_shape, dtype=torch.int64)
    scales = torch.arange(hits.numel(), dtype=torch.float32).reshape(tie.scale_shape)
    for rank in range(degree):
        held = scale_layout(tie, spec, degree, rank)
        local = take_layout(scales, held, scale_local_shape(tie, spec, degree, rank))
        for region, off in scale_owned_layout(tie, spec, degree, rank):
            hits[region.slices()] += 1
            # the owned box, read from the rank's local scales, is that box of the scale tensor
            assert torch.equal(local[Region(off, region.sizes).slices()], scales[region.slices()])
    assert bool((hits == 1).all())


@FAST
@given(case=tie_case(), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       seed=st.integers(0, 2**31 - 1), chunk=st.sampled_from([1, 7, 1 << 22]))
def test_each_rank_dequantizes_its_pair_to_the_slice(case, dtype, seed, chunk):
    tie, spec, degree = case
    gen = torch.Generator().manual_seed(seed)
    q, s = random_fp8(tie.weight_shape, gen), random_scales(tie.scale_shape, gen)
    expect = reference_dequant(q, s, tie.block, dtype)
    for rank in range(degree):
        pair = split(q, spec, degree, rank), held_scales(s, tie, spec, degree, rank)
        got = dequantized_shard(*pair, tie, spec, degree, rank, dtype, chunk_elements=chunk)
        assert same_bits(got, split(expect, spec, degree, rank))


def held_scales(s: torch.Tensor, tie: QuantTie, spec: ShardSpec, degree: int, rank: int) -> torch.Tensor:
    return take_layout(s, scale_layout(tie, spec, degree, rank), scale_local_shape(tie, spec, degree, rank))


def kernel_view(q: torch.Tensor, s: torch.Tensor, block, dtype) -> torch.Tensor:
    """What an FP8 kernel computes from a local pair: local row i, col j take s[i // bh, j // bw]."""
    return reference_dequant(q, s, block, dtype)


@FAST
@given(case=tie_case(), seed=st.integers(0, 2**31 - 1))
def test_aligned_pairs_are_ordinary_shards_that_kernels_read_right(case, seed):
    tie, spec, degree = case
    gen = torch.Generator().manual_seed(seed)
    q, s = random_fp8(tie.weight_shape, gen), random_scales(tie.scale_shape, gen)
    expect = reference_dequant(q, s, tie.block, torch.float32)
    aligned = tie_aligned(tie, spec, degree)
    if degree == 1 or spec.replicated:
        assert aligned
    for rank in range(degree):
        held = held_scales(s, tie, spec, degree, rank)
        if aligned:
            assert torch.equal(held, s if degree == 1 else split(s, spec, degree, rank))
            got = kernel_view(split(q, spec, degree, rank), held, tie.block, torch.float32)
            assert same_bits(got, split(expect, spec, degree, rank))


def test_576_rows_at_tp8():
    tie, spec = QuantTie("w", (576, 384), (128, 128)), ShardSpec(dim=0)
    assert not tie_aligned(tie, spec, 8) and not tie_aligned(tie, spec, 2)
    held = [scale_layout(tie, spec, 8, r)[0][0] for r in range(8)]
    assert [(r.offsets[0], r.offsets[0] + r.sizes[0]) for r in held] == [
        (0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (2, 4), (3, 4), (3, 5)]
    owned = [[r.offsets[0] for r, _ in scale_owned_layout(tie, spec, 8, rank)] for rank in range(8)]
    assert owned == [[0], [1], [], [2], [], [3], [], [4]]  # block k from the rank holding row 128 k
    assert tie_aligned(QuantTie("w", (512, 384), (128, 128)), spec, 4)
    assert not tie_aligned(QuantTie("w", (512, 384), (128, 128)), ShardSpec(dim=1), 4)  # 96 columns


class FP8Linear(nn.Linear):
    """What core reads of transformers' FP8Linear: an fp8 weight, a block_size, its scales."""

    def __init__(self, n_in: int, n_out: int, block=(128, 128)):
        super().__init__(n_in, n_out, bias=False, device="meta")
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=torch.float8_e4m3fn, device="meta"),
                                   requires_grad=False)
        self.block_size = block
        self.weight_scale_inv = nn.Parameter(torch.empty(-(-n_out // block[0]), -(-n_in // block[1]),
                                                         device="meta"))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = FP8Linear(256, 576)
        self.down = FP8Linear(576, 256)
        self.head = nn.Linear(256, 8, device="meta")


def test_scales_follow_their_weights_spec():
    model = MLP()
    assert set(quant_ties(model)) == {"up.weight_scale_inv", "down.weight_scale_inv"}
    plan = {"up": "colwise", "down": "rowwise", "up.weight_scale_inv": "rowwise"}  # the scale key is ignored
    specs = resolve_plan(model, plan, 2)
    assert specs["up.weight_scale_inv"] == specs["up.weight"] == ShardSpec(dim=0)
    assert specs["down.weight_scale_inv"] == specs["down.weight"] == ShardSpec(dim=1)
    assert specs.quantized == {"up.weight", "up.weight_scale_inv", "down.weight", "down.weight_scale_inv"}
    assert specs.ties["up.weight_scale_inv"].scale_shape == (5, 2)
    with pytest.raises(PlanError, match=r"FP8 weight 'up\.weight' by a parameter key.*plan its module"):
        resolve_plan(model, {"up.weight": "colwise", "down": "rowwise"}, 2)


def test_a_scale_that_does_not_fit_its_weight_is_refused():
    model = MLP()
    model.up.weight_scale_inv = nn.Parameter(torch.empty(4, 2, device="meta"))
    with pytest.raises(PlanError, match=r"up\.weight_scale_inv has shape \(4, 2\).*needs \(5, 2\)"):
        quant_ties(model)


def test_local_layout_of_a_rowwise_cut():
    tie, spec = QuantTie("w", (256, 576), (128, 128)), ShardSpec(dim=1)
    assert [scale_local_shape(tie, spec, 2, r) for r in range(2)] == [(2, 3), (2, 3)]
    assert scale_layout(tie, spec, 2, 1) == [(Region((0, 2), (2, 3)), (0, 0))]
    assert local_layout(tie.weight_shape, spec, 2, 1)[0][0] == Region((0, 288), (256, 288))
