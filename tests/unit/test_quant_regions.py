"""Tied regions of block-quantized tensors (shardwise.core.quant): a weight and its scales.

Every rank's dequantized shard must be the same slice of the full dequantization, bit for bit,
whatever the shape, block, degree and sharded dim, boundaries inside a block included.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.core.quant import (
    E2M1_VALUES,
    MXFP4_GROUP,
    QuantScheme,
    dequantize_region,
    expand_scale,
    is_block_aligned,
    mxfp4_dequantize_region,
    mxfp4_regions,
    scale_region,
    scale_shape,
    unpack_e2m1,
)
from shardwise.core.spec import Region, ShardSpec, assemble, local_layout, split
from shardwise.errors import PlanError, ShardingError

FAST = settings(max_examples=50, deadline=None)
DEGREES = [1, 2, 3, 4, 5, 6, 7, 8, 16]
TARGETS = [torch.bfloat16, torch.float32]
block_entry = st.one_of(st.sampled_from([1, 2, 3, 16, 32, 128]), st.integers(1, 70))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality; NaNs (random fp8 bytes hold some) only need the same positions."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.masked_fill(nan, 0).view(as_int), b.masked_fill(nan, 0).view(as_int))


def random_fp8(shape, gen):
    """Every e4m3 byte pattern, NaNs included."""
    return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)


def random_scales(shape, gen):
    exponents = torch.randint(-30, 30, tuple(shape), generator=gen)
    return torch.randn(tuple(shape), generator=gen) * 2.0**exponents


def reference_dequant(q, scale, block, dtype):
    """Straightforward full dequantization: each scale repeated over its block, cut at the edge."""
    s = scale.float()
    for d, b in enumerate(block):
        if b is None:
            s = s.unsqueeze(d)
        else:
            s = s.repeat_interleave(b, dim=d).narrow(d, 0, q.shape[d])
    return (q.float() * s).to(dtype)


def whole(shape):
    return Region((0,) * len(shape), tuple(shape))


@st.composite
def sharded_case(draw, max_size=160):
    """A shape, block, spec, degree: the sharded dim is a multiple of degree x packed blocks."""
    ndim = draw(st.sampled_from([2, 3]))
    degree = draw(st.sampled_from(DEGREES))
    dim = draw(st.integers(0, ndim - 1))
    blocks = draw(st.sampled_from([(1,), (1, 1)])) if dim >= ndim - 2 else (1,)
    caps = [3] * (ndim - 2) + [max_size, max_size]
    shape = [draw(st.integers(1, c)) for c in caps]
    unit = degree * len(blocks)
    shape[dim] = unit * draw(st.integers(1, max(1, caps[dim] // unit)))
    block = tuple(draw(st.one_of(st.none(), st.just(1))) for _ in range(ndim - 2))
    block += tuple(draw(st.one_of(st.none(), block_entry)) for _ in range(2))
    return tuple(shape), block, ShardSpec(dim=dim, blocks=blocks), degree


@st.composite
def box_in(draw, shape):
    offsets = [draw(st.integers(0, s)) for s in shape]
    sizes = [draw(st.integers(0, s - o)) for s, o in zip(shape, offsets, strict=True)]
    return Region(tuple(offsets), tuple(sizes))


# --- scale regions -------------------------------------------------------------------------


@FAST
@given(data=st.data())
def test_scale_region_covers_exactly_the_touched_blocks(data):
    ndim = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.integers(0, 300)) for _ in range(ndim))
    block = tuple(data.draw(st.one_of(st.none(), block_entry)) for _ in range(ndim))
    region = data.draw(box_in(shape))
    sr = scale_region(region, block)
    kept = [d for d, b in enumerate(block) if b is not None]
    assert len(sr.sizes) == len(kept)
    for i, d in enumerate(kept):
        a, n, b = region.offsets[d], region.sizes[d], block[d]
        touched = sorted({x // b for x in range(a, a + n)})
        assert list(range(sr.offsets[i], sr.offsets[i] + sr.sizes[i])) == touched
    full = scale_shape(shape, block)
    assert all(o + n <= f for o, n, f in zip(sr.offsets, sr.sizes, full, strict=True))


@FAST
@given(case=sharded_case())
def test_ranks_scale_regions_cover_the_scale_tensor_and_share_only_cut_blocks(case):
    shape, block, spec, degree = case
    full = scale_shape(shape, block)
    hits = torch.zeros(full, dtype=torch.int64)
    aligned = True
    for rank in range(degree):
        for region, _ in local_layout(shape, spec, degree, rank):
            hits[scale_region(region, block).slices()] += 1
            aligned &= is_block_aligned(shape, region, block)
    assert bool((hits >= 1).all())  # every block's scale is read by some rank
    if aligned:  # block-aligned shards tile the scale tensor: no block read twice
        assert bool((hits == 1).all())
    elif not spec.packed and degree > 1:
        assert bool((hits > 1).any())  # a cut block is read by both of its ranks


def test_576_rows_at_tp8_in_128_row_blocks():
    """DeepSeek-V3's kv_a_proj_with_mqa: 576 rows, 72 a rank; transformers refuses 576 rows."""
    shape, block, degree = (576, 384), (128, 128), 8
    gen = torch.Generator().manual_seed(576)
    q, s = random_fp8(shape, gen), random_scales(scale_shape(shape, block), gen)
    assert s.shape == (5, 3)
    spans = []
    for rank in range(degree):
        (region, _), = local_layout(shape, ShardSpec(dim=0), degree, rank)
        sr = scale_region(region, block)
        spans.append((sr.offsets[0], sr.offsets[0] + sr.sizes[0]))
    assert spans == [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (2, 4), (3, 4), (3, 5)]
    for dtype in TARGETS:
        expect = reference_dequant(q, s, block, dtype)
        shards = []
        for rank in range(degree):
            (region, _), = local_layout(shape, ShardSpec(dim=0), degree, rank)
            shard = dequantize_region(q[region.slices()], s[scale_region(region, block).slices()],
                                      region, block, dtype)
            assert same_bits(shard, expect[region.slices()])
            shards.append(shard)
        assert same_bits(torch.cat(shards), expect)


# --- FP8 dequantization --------------------------------------------------------------------


@FAST
@given(case=sharded_case(), dtype=st.sampled_from(TARGETS), seed=st.integers(0, 2**31 - 1))
def test_fp8_rank_shards_are_slices_of_the_full_dequantization(case, dtype, seed):
    shape, block, spec, degree = case
    gen = torch.Generator().manual_seed(seed)
    q, s = random_fp8(shape, gen), random_scales(scale_shape(shape, block), gen)
    expect = reference_dequant(q, s, block, dtype)
    assert same_bits(dequantize_region(q, s, whole(shape), block, dtype), expect)
    shards = []
    for rank in range(degree):
        pieces = [dequantize_region(q[r.slices()], s[scale_region(r, block).slices()], r, block, dtype)
                  for r, _ in local_layout(shape, spec, degree, rank)]
        shard = torch.cat(pieces, dim=spec.dim)
        assert same_bits(shard, split(expect, spec, degree, rank))
        shards.append(shard)
    assert same_bits(assemble(shards, spec, degree), expect)


@FAST
@given(data=st.data(), dtype=st.sampled_from(TARGETS + [torch.float16]))
def test_fp8_any_box_dequantizes_to_its_slice(data, dtype):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.integers(1, 90)) for _ in range(ndim))
    block = tuple(data.draw(st.one_of(st.none(), block_entry)) for _ in range(ndim))
    region = data.draw(box_in(shape))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q, s = random_fp8(shape, gen), random_scales(scale_shape(shape, block), gen)
    got = dequantize_region(q[region.slices()], s[scale_region(region, block).slices()], region, block, dtype)
    assert same_bits(got, reference_dequant(q, s, block, dtype)[region.slices()])


def test_fp8_dims_the_scale_lacks_broadcast():
    s = torch.tensor(3.0)  # per-tensor
    assert torch.equal(expand_scale(s, Region((1, 2), (2, 3)), (None, None)), torch.full((2, 3), 3.0))
    s = torch.tensor([1.0, 2.0])  # per-column-block, same for every expert
    got = expand_scale(s, Region((0, 3), (2, 2)), (None, 4))
    assert torch.equal(got, torch.tensor([[1.0, 2.0], [1.0, 2.0]]))


def test_fp8_e8m0_scales_as_uint8_and_float8_e8m0fnu():
    q = torch.full((4, 4), 1.5).to(torch.float8_e4m3fn)
    raw = torch.tensor([[126, 130], [127, 0]], dtype=torch.uint8)
    expect = reference_dequant(q, torch.exp2(raw.float() - 127), (2, 2), torch.float32)
    assert torch.equal(dequantize_region(q, raw, whole((4, 4)), (2, 2), torch.float32), expect)
    e8m0 = raw.view(torch.float8_e8m0fnu)
    assert torch.equal(dequantize_region(q, e8m0, whole((4, 4)), (2, 2), torch.float32), expect)


def test_wrong_shapes_name_the_fix():
    with pytest.raises(PlanError, match="scale_region"):
        dequantize_region(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1),
                          Region((0, 0), (4, 4)), (2, 2))
    with pytest.raises(PlanError, match="one block entry per weight dim"):
        scale_region(Region((0, 0), (4, 4)), (2,))
    with pytest.raises(PlanError, match="positive ints or None"):
        scale_region(Region((0,), (4,)), (0,))
    with pytest.raises(PlanError, match="QuantScheme.name"):
        QuantScheme("gptq", (1, 128))
    with pytest.raises(PlanError, match="mxfp4"):
        QuantScheme("mxfp4", (1, 16))


def test_scheme_stored_shapes_and_keys():
    fp8 = QuantScheme.fp8_block((128, 128))
    assert fp8.stored_shapes((576, 7168)) == ((576, 7168), (5, 56))
    assert fp8.stored_keys("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")[1].endswith(
        "kv_a_proj_with_mqa.weight_scale_inv")
    assert QuantScheme.fp8_block(ndim=3).stored_keys("experts.gate_up_proj") == (
        "experts.gate_up_proj", "experts.gate_up_proj_scale_inv")
    mx = QuantScheme.mxfp4()
    e, i, h = 4, 2880, 2880  # gpt-oss gate_up_proj, stored orientation (E, 2I, H)
    assert mx.stored_shapes((e, 2 * i, h)) == ((e, 2 * i, h // 32, 16), (e, 2 * i, h // 32))
    assert mx.stored_keys("experts.down_proj") == ("experts.down_proj_blocks", "experts.down_proj_scales")
    with pytest.raises(PlanError, match="multiple of 32"):
        mx.stored_shapes((2, 4, 40))


def test_fp8_matches_transformers_dequantization_on_whole_blocks():
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    gen = torch.Generator().manual_seed(0)
    for shape, block in [((256, 384), (128, 128)), ((2, 64, 96), (1, 32, 16)), ((48, 40), (1, 8))]:
        q, s = random_fp8(shape, gen), random_scales(scale_shape(shape, block), gen)
        for dtype in TARGETS:
            theirs = fp8.Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)
            assert same_bits(dequantize_region(q, s, whole(shape), block, dtype), theirs)


# --- MXFP4 ---------------------------------------------------------------------------------


def random_mxfp4(shape, gen):
    """Blocks and scales of a logical weight of ``shape`` (..., rows, K); every byte value."""
    blocks_shape, scales_shape = QuantScheme.mxfp4(ndim=len(shape)).stored_shapes(shape)
    blocks = torch.randint(0, 256, blocks_shape, dtype=torch.uint8, generator=gen)
    return blocks, torch.randint(0, 256, scales_shape, dtype=torch.uint8, generator=gen)


def reference_mxfp4(blocks, scales, dtype):
    """Bytes unpacked one nibble at a time (low first), times 2 ** (scale - 127) per 32 values,
    computed in float64 (exact for every e2m1 value and e8m0 byte) and rounded once."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    lo, hi = lut[(blocks % 16).long()], lut[(blocks // 16).long()]
    values = torch.stack([lo, hi], dim=-1).flatten(-3)
    scale = torch.exp2(scales.double() - 127).repeat_interleave(MXFP4_GROUP, dim=-1)
    return (values * scale).float().to(dtype)


@st.composite
def mxfp4_case(draw):
    degree = draw(st.sampled_from(DEGREES))
    dim = draw(st.integers(0, 2))  # 0: experts (EP), 1: rows, 2: K
    shape = [draw(st.integers(1, 4)), draw(st.integers(1, 24)), MXFP4_GROUP * draw(st.integers(1, 6))]
    if dim == 2:  # K a multiple of 32 and of the degree
        shape[2] = math.lcm(MXFP4_GROUP, degree) * draw(st.integers(1, 3))
    else:
        shape[dim] = degree * draw(st.integers(1, 3))
    return tuple(shape), ShardSpec(dim=dim), degree


@FAST
@given(case=mxfp4_case(), dtype=st.sampled_from(TARGETS), seed=st.integers(0, 2**31 - 1))
def test_mxfp4_rank_shards_are_slices_of_the_full_dequantization(case, dtype, seed):
    shape, spec, degree = case
    blocks, scales = random_mxfp4(shape, torch.Generator().manual_seed(seed))
    expect = reference_mxfp4(blocks, scales, dtype)
    assert same_bits(mxfp4_dequantize_region(blocks, scales, whole(shape), dtype), expect)
    shards = []
    for rank in range(degree):
        (region, _), = local_layout(shape, spec, degree, rank)
        br, sr = mxfp4_regions(region)
        shard = mxfp4_dequantize_region(blocks[br.slices()], scales[sr.slices()], region, dtype)
        assert same_bits(shard, expect[region.slices()])
        shards.append(shard)
    assert same_bits(assemble(shards, spec, degree), expect)


@FAST
@given(data=st.data(), dtype=st.sampled_from(TARGETS))
def test_mxfp4_any_box_dequantizes_to_its_slice_and_exact_regions_refuse_cut_groups(data, dtype):
    ndim = data.draw(st.integers(2, 3))
    rows = tuple(data.draw(st.integers(1, 5)) for _ in range(ndim - 1))
    shape = rows + (MXFP4_GROUP * data.draw(st.integers(1, 5)),)
    region = data.draw(box_in(shape))  # column boundaries anywhere: inside a byte or a group
    blocks, scales = random_mxfp4(shape, torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    br, sr = mxfp4_regions(region)
    got = mxfp4_dequantize_region(blocks[br.slices()], scales[sr.slices()], region, dtype)
    assert same_bits(got, reference_mxfp4(blocks, scales, dtype)[region.slices()])
    a, n = region.offsets[-1], region.sizes[-1]
    if a % MXFP4_GROUP or (a + n) % MXFP4_GROUP:
        with pytest.raises(ShardingError, match="dequantize=True"):
            mxfp4_regions(region, exact=True)
    else:  # a packed shard of its own: its bytes unpack to exactly the region's values
        assert mxfp4_regions(region, exact=True) == (br, sr)
        values = unpack_e2m1(blocks[br.slices()])
        assert torch.equal(values, unpack_e2m1(blocks)[region.slices()])


def test_mxfp4_nibble_order_and_value_table():
    byte = torch.tensor([[0x9F] + [0] * 15], dtype=torch.uint8)  # low nibble 0xF = -6, high 0x9 = -0.5
    values = unpack_e2m1(byte)
    assert values[:2].tolist() == [-6.0, -0.5] and values.shape == (32,)
    nibbles = [unpack_e2m1(torch.tensor([[v]], dtype=torch.uint8))[0].item() for v in range(16)]
    assert nibbles == list(E2M1_VALUES)


def test_mxfp4_gpt_oss_down_proj_at_tp8_cuts_groups():
    """gpt-oss down_proj, stored (E, H, I) with I = 2880: rowwise at tp=8 gives 360 columns a
    rank, a boundary inside a 32-group; dequantized shards are still exact slices."""
    shape, spec, degree = (2, 8, 2880), ShardSpec(dim=2), 8
    blocks, scales = random_mxfp4(shape, torch.Generator().manual_seed(2880))
    expect = reference_mxfp4(blocks, scales, torch.bfloat16)
    for rank in range(degree):
        (region, _), = local_layout(shape, spec, degree, rank)
        br, sr = mxfp4_regions(region)
        first, end = 360 * rank // 32, -(-360 * (rank + 1) // 32)
        assert (sr.offsets[-1], sr.sizes[-1]) == (first, end - first)
        got = mxfp4_dequantize_region(blocks[br.slices()], scales[sr.slices()], region, torch.bfloat16)
        assert same_bits(got, expect[region.slices()])
        if rank % 4:  # 360 * rank is a multiple of 32 only for rank 0 and 4
            with pytest.raises(ShardingError, match="inside a 32-value scale group"):
                mxfp4_regions(region, exact=True)


def test_mxfp4_matches_transformers_convert_moe_packed_tensors():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    assert tuple(mxfp4.FP4_VALUES) == E2M1_VALUES
    gen = torch.Generator().manual_seed(1)
    shape = (3, 10, 96)  # (E, rows, K)
    blocks, _ = random_mxfp4(shape, gen)
    scales = torch.randint(0, 256, shape[:-1] + (3,), dtype=torch.uint8, generator=gen)
    scales[0, 0, 0] = 255  # e8m0 NaN in the OCP spec; ldexp in both: 0 stays 0, 0.5 * 2 ** 128 is finite
    for dtype in TARGETS:
        theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        assert same_bits(mxfp4_dequantize_region(blocks, scales, whole(shape), dtype), theirs)
        region = Region((1, 3, 45), (2, 5, 40))  # cuts a byte and two groups
        br, sr = mxfp4_regions(region)
        got = mxfp4_dequantize_region(blocks[br.slices()], scales[sr.slices()], region, dtype)
        assert same_bits(got, theirs[region.slices()])
