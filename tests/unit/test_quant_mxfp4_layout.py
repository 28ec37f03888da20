"""MXFP4 through the tie machinery (shardwise.core.quant_layout), pure.

Dequantized on load, every rank's shard of an MXFP4 weight (held transposed, as gpt-oss holds
its experts) equals the same slice of the full dequantization bit for bit, whatever the
degree and the split dim, a boundary inside a 32-group included; FP8 goes through the same
reads. Kept quantized, ``x_blocks`` / ``x_scales`` are one tie with block ``(1, ..., 1, None)``:
scales split with their blocks, and a split that cuts a group is refused.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardwise.core.plan import resolve_plan
from shardwise.core.quant import QuantScheme, mxfp4_dequantize_region
from shardwise.core.quant_layout import (
    QuantTie,
    dequant_reads,
    dequantize_shard,
    quant_pairs,
    scale_layout,
    scale_local_shape,
    scale_owned_layout,
    tie_aligned,
)
from shardwise.core.spec import Region, ShardSpec, local_layout, split
from shardwise.errors import PlanError, ShardingError

FAST = settings(max_examples=60, deadline=None)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@st.composite
def mxfp4_case(draw):
    """A model shape (E, K, rows) or (E, rows, K), a spec whose dim divides, a degree."""
    degree = draw(st.sampled_from([1, 2, 3, 4, 6]))
    transposed = draw(st.booleans())
    experts, rows, groups = draw(st.integers(1, 4)), draw(st.integers(1, 24)), draw(st.integers(1, 4))
    stored = [experts, rows, groups * 32]
    shape = [stored[0], stored[2], stored[1]] if transposed else list(stored)
    dim = draw(st.sampled_from([None, 0, 1, 2]))
    blocks = draw(st.sampled_from([(1,), (1, 1)])) if dim in (1, 2) else (1,)
    k_dim = 1 if transposed else 2
    if dim is not None:
        unit = degree * len(blocks)
        if shape[dim] % unit:  # K stays a multiple of 32
            shape[dim] = 32 * unit if dim == k_dim else unit * max(1, shape[dim] // unit)
    spec = ShardSpec() if dim is None else ShardSpec(dim=dim, blocks=blocks)
    return tuple(shape), spec, degree, transposed


def stored_pair(shape, transposed: bool, seed: int):
    """Random blocks (every nibble) and scales (every byte) of the stored (E, rows, K)."""
    e, a, b = shape
    rows, k = (b, a) if transposed else (a, b)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, rows, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 256, (e, rows, k // 32), dtype=torch.uint8, generator=gen)
    return blocks, scales


@FAST
@given(case=mxfp4_case(), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       seed=st.integers(0, 2**31 - 1), chunk=st.sampled_from([1, 7, 1 << 22]))
def test_each_rank_dequantizes_its_mxfp4_shard_to_the_slice(case, dtype, seed, chunk):
    shape, spec, degree, transposed = case
    blocks, scales = stored_pair(shape, transposed, seed)
    logical = (blocks.shape[0], blocks.shape[1], blocks.shape[2] * 32)
    full = mxfp4_dequantize_region(blocks, scales, Region((0, 0, 0), logical), dtype)
    full = full.transpose(-1, -2) if transposed else full
    scheme = QuantScheme.mxfp4(ndim=3)
    for rank in range(degree):
        (vlayout, vshape), (slayout, sshape) = dequant_reads(scheme, shape, spec, degree, rank,
                                                             transposed=transposed)
        values = torch.empty(vshape, dtype=torch.uint8)
        held = torch.empty(sshape, dtype=torch.uint8)
        for (box, off), (sbox, soff) in zip(vlayout, slayout, strict=True):
            values[Region(off, box.sizes).slices()] = blocks[box.slices()]
            held[Region(soff, sbox.sizes).slices()] = scales[sbox.slices()]
        got = dequantize_shard(values, held, scheme, shape, spec, degree, rank, dtype, transposed=transposed,
                               chunk_elements=chunk)
        assert torch.equal(bits(got), bits(split(full, spec, degree, rank)))


@FAST
@given(degree=st.sampled_from([1, 2, 4, 8]), dim=st.sampled_from([None, 0, 1]), rows=st.integers(1, 40),
       block=st.sampled_from([(128, 128), (16, 32), (3, 5)]))
def test_fp8_reads_are_the_weight_split_and_the_tied_scales(degree, dim, rows, block):
    shape = (rows * degree, 40)
    spec = ShardSpec() if dim is None else ShardSpec(dim=dim)
    if dim == 1:
        shape = (rows, 40 * degree)
    tie = QuantTie("w", shape, block)
    for rank in range(degree):
        (values, vshape), (scales, sshape) = dequant_reads(QuantScheme.fp8_block(block), shape, spec, degree,
                                                           rank)
        assert values == local_layout(shape, spec, degree, rank)
        assert scales == scale_layout(tie, spec, degree, rank)
        assert sshape == scale_local_shape(tie, spec, degree, rank)


def test_a_boundary_inside_a_group_reads_that_group_on_both_sides():
    """gpt-oss's down_proj (E, I=96, H) held transposed, split on I over 2: 48 each."""
    scheme = QuantScheme.mxfp4()
    left = dequant_reads(scheme, (4, 96, 64), ShardSpec(dim=1), 2, 0, transposed=True)
    right = dequant_reads(scheme, (4, 96, 64), ShardSpec(dim=1), 2, 1, transposed=True)
    assert left[1][0][0][0] == Region((0, 0, 0), (4, 64, 2))  # groups 0 and 1 (columns 0..47)
    assert right[1][0][0][0] == Region((0, 0, 1), (4, 64, 2))  # groups 1 and 2 (columns 48..95)


# --- kept quantized: x_blocks / x_scales as one tie -----------------------------------------

BLOCKS = QuantTie("e.w_blocks", (4, 24, 3, 16), (1, 1, 1, None), "mxfp4")


@pytest.mark.parametrize("dim,degree", [(0, 2), (0, 4), (1, 3), (2, 3)])
def test_whole_group_splits_are_ordinary_shards(dim, degree):
    spec = ShardSpec(dim=dim)
    assert tie_aligned(BLOCKS, spec, degree)
    scales = torch.arange(4 * 24 * 3).reshape(BLOCKS.scale_shape)
    for rank in range(degree):
        plain = local_layout(BLOCKS.scale_shape, spec, degree, rank)
        assert scale_layout(BLOCKS, spec, degree, rank) == plain
        assert [r for r, _ in scale_owned_layout(BLOCKS, spec, degree, rank)] == [r for r, _ in plain]
        assert scale_local_shape(BLOCKS, spec, degree, rank) == tuple(split(scales, spec, degree, rank).shape)


def test_a_split_of_the_bytes_has_no_scales_of_its_own():
    assert not tie_aligned(BLOCKS, ShardSpec(dim=3), 2)
    with pytest.raises(PlanError, match="no dim for weight dim 3"):
        scale_layout(BLOCKS, ShardSpec(dim=3), 2, 0)


class Experts(nn.Module):
    """A module holding one MXFP4 pair as transformers names them, and a bias."""

    def __init__(self):
        super().__init__()
        self.w_blocks = nn.Parameter(torch.zeros(4, 24, 3, 16, dtype=torch.uint8), requires_grad=False)
        self.w_scales = nn.Parameter(torch.zeros(4, 24, 3, dtype=torch.uint8), requires_grad=False)
        self.w_bias = nn.Parameter(torch.zeros(4, 24))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = Experts()


def test_pairs_are_found_and_plan_keys_for_x_apply_to_x_blocks():
    model = Model()
    assert quant_pairs(model.experts) == [("w_blocks", "w_scales", (1, 1, 1, None), "mxfp4")]
    specs = resolve_plan(model, {"experts.w": "colwise"}, 3)  # names the parameter as transformers does
    assert specs["experts.w_blocks"] == ShardSpec(dim=2) == specs["experts.w_scales"]
    assert specs["experts.w_bias"].replicated and not specs.unused_keys
    assert specs.ties == {"experts.w_scales": QuantTie("experts.w_blocks", (4, 24, 3, 16), (1, 1, 1, None),
                                                       "mxfp4")}


def test_a_split_that_cuts_a_group_is_refused_naming_the_degrees():
    with pytest.raises(ShardingError, match=r"'experts\.w'.*w_blocks.*dim 3 over tp=2.*inside a "
                                            r"32-value scale group.*no degree > 1 does on dim 3"):
        resolve_plan(Model(), {"experts.w": "rowwise"}, 2)


# --- a stored pair into a plain model: dequantized, or refused --------------------------------


def test_a_stored_pair_is_read_dequantized_into_its_transpose_or_refused(tmp_path):
    import json

    import safetensors.torch as st

    from shardwise.errors import CheckpointError
    from shardwise.io.formats.safetensors.checkpoint import resolve_checkpoint
    from shardwise.io.formats.safetensors.quantized import pair_mxfp4

    st.save_file({"e.w_blocks": torch.zeros(2, 8, 1, 16, dtype=torch.uint8),
                  "e.w_scales": torch.zeros(2, 8, 1, dtype=torch.uint8)}, tmp_path / "model.safetensors")
    ckpt = resolve_checkpoint(tmp_path)
    bf16 = {"e.w": torch.bfloat16}
    found, used = pair_mxfp4({"e.w"}, {"e.w": (2, 32, 8)}, bf16, ckpt, dequantize=True)
    assert used == {"e.w_blocks", "e.w_scales"}
    assert found["e.w"].transposed and found["e.w"].shape == (2, 32, 8)
    with pytest.raises(CheckpointError, match=r"'e\.w' is stored as MXFP4.*pass dequantize=True"):
        pair_mxfp4({"e.w"}, {"e.w": (2, 32, 8)}, bf16, ckpt, dequantize=False)
    with pytest.raises(CheckpointError, match=r"does not fit the model's \(2, 8, 32\)"):  # not transposed
        pair_mxfp4({"e.w"}, {"e.w": (2, 8, 32)}, bf16, ckpt, dequantize=True)
    with pytest.raises(CheckpointError, match=r"is stored as MXFP4.*holds it as torch\.uint8"):
        pair_mxfp4({"e.w"}, {"e.w": (2, 32, 8)}, {"e.w": torch.uint8}, ckpt, dequantize=True)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match=r"quant_method 'fp8', but 'e\.w' is stored as MXFP4"):
        pair_mxfp4({"e.w"}, {"e.w": (2, 32, 8)}, bf16, resolve_checkpoint(tmp_path), dequantize=True)
