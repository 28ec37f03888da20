"""Region math of shardwise.core.spec: no process group, no files."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardwise.core.pieces import Piece, check_tiling, piece_reads
from shardwise.core.spec import (
    Region,
    ShardSpec,
    assemble,
    block_sizes,
    check_shardable,
    chunk_layout,
    global_shape,
    intersect,
    local_layout,
    local_shape,
    shard_regions,
    split,
)
from shardwise.errors import PlanError, ShardingError

FAST = settings(max_examples=100, deadline=None)
DTYPES = [torch.int64, torch.float32, torch.bfloat16, torch.bool, torch.int8]


def canonical(shape, dtype=torch.int64):
    """A tensor whose elements are distinguishable within what the dtype can hold."""
    flat = torch.arange(math.prod(shape))
    if dtype == torch.bool:
        flat = flat % 3 == 0
    elif dtype in (torch.bfloat16, torch.int8):
        flat = flat % 100  # both hold 0..99 exactly
    return flat.reshape(shape).to(dtype)


def box(offsets, sizes):
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


@st.composite
def layouts(draw, divisible=True):
    """(shape, spec, degree); divisible=False makes some block indivisible by the degree."""
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    degree = draw(st.integers(1 if divisible else 2, 8))
    if divisible and draw(st.integers(0, 9)) == 0:
        return tuple(shape), ShardSpec(), degree
    dim = draw(st.integers(0, ndim - 1))
    blocks = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=5)))
    unit = draw(st.integers(1, 3))
    if divisible:
        unit *= degree
    else:
        assume(any(b * unit % degree for b in blocks))
    shape[dim] = sum(blocks) * unit
    return tuple(shape), ShardSpec(dim=dim, blocks=blocks), degree


# --- properties -------------------------------------------------------------


@FAST
@given(layouts())
def test_regions_tile_the_canonical_tensor_once(case):
    shape, spec, degree = case
    count = torch.zeros(shape, dtype=torch.int32)
    for rank in range(degree):
        regions = shard_regions(shape, spec, degree, rank)
        assert sum(r.numel for r, _ in local_layout(shape, spec, degree, rank)) == math.prod(
            local_shape(shape, spec, degree)
        )
        for region in regions:
            count[region.slices()] += 1
    # Replicated: every rank holds the whole tensor.
    assert bool((count == (degree if spec.replicated else 1)).all())


@FAST
@given(layouts(), st.sampled_from(DTYPES))
def test_split_then_assemble_is_identity(case, dtype):
    shape, spec, degree = case
    canon = canonical(shape, dtype)
    shards = [split(canon, spec, degree, rank) for rank in range(degree)]
    for shard in shards:
        assert tuple(shard.shape) == local_shape(shape, spec, degree)
        assert shard.dtype == dtype and shard.is_contiguous()
        assert shard.untyped_storage().data_ptr() != canon.untyped_storage().data_ptr()
    out = assemble(shards, spec, degree)
    assert out.dtype == dtype and torch.equal(out, canon)


@FAST
@given(layouts())
def test_local_layout_offsets_match_split(case):
    shape, spec, degree = case
    canon = canonical(shape)
    for rank in range(degree):
        local = split(canon, spec, degree, rank)
        layout = local_layout(shape, spec, degree, rank)
        assert [r for r, _ in layout] == shard_regions(shape, spec, degree, rank)
        for region, off in layout:
            assert torch.equal(local[box(off, region.sizes)], canon[region.slices()])


@FAST
@given(layouts(divisible=False))
def test_indivisible_blocks_raise_sharding_error(case):
    shape, spec, degree = case
    with pytest.raises(ShardingError) as err:
        check_shardable(shape, spec, degree)
    msg = str(err.value)
    assert f"size {shape[spec.dim]}" in msg and f"degree {degree}" in msg
    assert "choose a degree that divides" in msg
    for i, size in enumerate(block_sizes(shape, spec)):
        if spec.packed and size % degree:
            assert f"block {i} (size {size})" in msg
    for fn in (
        lambda: local_shape(shape, spec, degree),
        lambda: shard_regions(shape, spec, degree, 0),
        lambda: split(canonical(shape), spec, degree, 0),
    ):
        with pytest.raises(ShardingError):
            fn()


@FAST
@given(layouts(), st.data())
def test_chunk_layout_covers_each_chunk_of_the_local_shard(case, data):
    shape, spec, degree = case
    rank = data.draw(st.integers(0, degree - 1))
    # Half the time chunk along the shard dim itself, where regions get cut.
    same = not spec.replicated and data.draw(st.booleans())
    dim = spec.dim if same else data.draw(st.integers(0, len(shape) - 1))
    num_chunks = data.draw(st.integers(1, 4))
    canon = canonical(shape)
    local = split(canon, spec, degree, rank)
    layout = local_layout(shape, spec, degree, rank)
    chunks = local.chunk(num_chunks, dim)
    total = 0
    for index in range(num_chunks):
        pieces = chunk_layout(layout, local.shape, dim, num_chunks, index)
        expected = chunks[index] if index < len(chunks) else local.narrow(dim, 0, 0)
        rebuilt = torch.full(expected.shape, -1, dtype=canon.dtype)
        count = torch.zeros(expected.shape, dtype=torch.int32)
        for region, off in pieces:
            assert region.numel > 0
            rebuilt[box(off, region.sizes)] = canon[region.slices()]
            count[box(off, region.sizes)] += 1
        assert bool((count == 1).all())
        assert torch.equal(rebuilt, expected)
        assert sum(r.numel for r, _ in pieces) == expected.numel()
        total += sum(r.numel for r, _ in pieces)
    assert total == local.numel()


@FAST
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), min_size=1, max_size=3),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), min_size=3, max_size=3),
)
def test_intersect_matches_elementwise_overlap(a_dims, b_dims):
    b_dims = b_dims[: len(a_dims)]
    a = Region(*zip(*a_dims, strict=True))
    b = Region(*zip(*b_dims, strict=True))
    grid = (10,) * len(a_dims)
    in_a = torch.zeros(grid, dtype=torch.bool)
    in_b = torch.zeros(grid, dtype=torch.bool)
    in_a[a.slices()] = True
    in_b[b.slices()] = True
    both = in_a & in_b
    got = intersect(a, b)
    if got is None:
        assert not bool(both.any())
    else:
        in_got = torch.zeros(grid, dtype=torch.bool)
        in_got[got.slices()] = True
        assert torch.equal(in_got, both) and got.numel == int(both.sum())


# --- examples ---------------------------------------------------------------


def test_colwise_weight():
    spec = ShardSpec(dim=0)
    assert shard_regions((8, 4), spec, 2, 1) == [Region((4, 0), (4, 4))]
    assert local_shape((8, 4), spec, 2) == (4, 4)


def test_rowwise_weight():
    spec = ShardSpec(dim=1)
    assert shard_regions((4, 8), spec, 4, 2) == [Region((0, 4), (4, 2))]
    assert local_layout((4, 8), spec, 4, 2) == [(Region((0, 4), (4, 2)), (0, 0))]


def test_packed_gate_up():
    spec = ShardSpec(dim=0, blocks=(1, 1))
    assert shard_regions((8, 4), spec, 2, 0) == [Region((0, 0), (2, 4)), Region((4, 0), (2, 4))]
    assert local_layout((8, 4), spec, 2, 1) == [
        (Region((2, 0), (2, 4)), (0, 0)),
        (Region((6, 0), (2, 4)), (2, 0)),
    ]
    canon = canonical((8, 1)).flatten()
    assert split(canon, ShardSpec(dim=0, blocks=(1, 1)), 2, 1).tolist() == [2, 3, 6, 7]


def test_degree_one_merges_packed_blocks():
    spec = ShardSpec(dim=0, blocks=(1, 1, 1, 3, 3))
    assert shard_regions((36, 2), spec, 1, 0) == [Region((0, 0), (36, 2))]


def test_fused_qkv_gate_up():
    spec = ShardSpec(dim=0, blocks=(1, 1, 1, 3, 3))
    assert block_sizes((36, 2), spec) == (4, 4, 4, 12, 12)
    # Blocks of 4 rows do not split three ways: the error names each of them.
    with pytest.raises(ShardingError, match=r"block 0 \(size 4\), block 1 \(size 4\), block 2"):
        check_shardable((36, 2), spec, 3)
    # 54 rows: blocks (6, 6, 6, 18, 18), each split in thirds.
    assert shard_regions((54, 2), spec, 3, 1) == [
        Region((2, 0), (2, 2)),
        Region((8, 0), (2, 2)),
        Region((14, 0), (2, 2)),
        Region((24, 0), (6, 2)),
        Region((42, 0), (6, 2)),
    ]
    assert [r.offsets[0] for r in shard_regions((36, 2), spec, 4, 3)] == [3, 7, 11, 21, 33]


def test_replicated_is_the_whole_tensor():
    assert shard_regions((3, 5), ShardSpec(), 4, 3) == [Region((0, 0), (3, 5))]
    assert local_shape((3, 5), ShardSpec(), 4) == (3, 5)
    check_shardable((7,), ShardSpec(), 4)


def test_zero_sized_dims():
    assert shard_regions((0, 4), ShardSpec(dim=0, blocks=(1, 1)), 2, 1) == [Region((0, 0), (0, 4))]
    canon = torch.zeros(4, 0)
    shards = [split(canon, ShardSpec(dim=0), 2, r) for r in range(2)]
    assert assemble(shards, ShardSpec(dim=0), 2).shape == (4, 0)
    layout = local_layout((4, 0), ShardSpec(dim=0), 2, 0)
    assert chunk_layout(layout, (2, 0), 0, 2, 0) == []


def test_chunk_along_shard_dim_cuts_regions():
    layout = local_layout((8, 4), ShardSpec(dim=0, blocks=(1, 1)), 2, 0)
    assert chunk_layout(layout, (4, 4), 0, 2, 0) == [(Region((0, 0), (2, 4)), (0, 0))]
    assert chunk_layout(layout, (4, 4), 0, 4, 1) == [(Region((1, 0), (1, 4)), (0, 0))]
    assert chunk_layout(layout, (4, 4), 0, 1, 0) == layout
    # Local rows 1..2 straddle the two blocks: one row of each.
    layout = local_layout((12, 4), ShardSpec(dim=0, blocks=(1, 1)), 2, 1)
    assert chunk_layout(layout, (6, 4), 0, 3, 1) == [
        (Region((5, 0), (1, 4)), (0, 0)),
        (Region((9, 0), (1, 4)), (1, 0)),
    ]


def test_chunk_along_other_dim_restricts_regions():
    layout = local_layout((4, 8), ShardSpec(dim=1), 2, 0)
    assert chunk_layout(layout, (4, 4), 0, 3, 1) == [(Region((2, 0), (2, 4)), (0, 0))]
    assert chunk_layout(layout, (4, 4), 0, 3, 2) == []  # torch.chunk yields only two chunks
    layout = local_layout((4, 8), ShardSpec(dim=1, blocks=(1, 1)), 2, 1)
    assert chunk_layout(layout, (4, 4), 0, 2, 1) == [
        (Region((2, 2), (2, 2)), (0, 0)),
        (Region((2, 6), (2, 2)), (0, 2)),
    ]


def test_chunk_layout_composes():
    layout = local_layout((16, 2), ShardSpec(dim=0, blocks=(1, 1)), 2, 0)
    first = chunk_layout(layout, (8, 2), 0, 2, 1)
    assert chunk_layout(first, (4, 2), 0, 2, 1) == [(Region((10, 0), (2, 2)), (0, 0))]


def test_intersect_examples():
    a = Region((0, 0), (4, 4))
    assert intersect(a, Region((2, 3), (4, 4))) == Region((2, 3), (2, 1))
    assert intersect(a, Region((1, 1), (1, 1))) == Region((1, 1), (1, 1))
    assert intersect(a, Region((4, 0), (4, 4))) is None  # touching is not overlapping
    with pytest.raises(PlanError):
        intersect(a, Region((0,), (4,)))


# --- validation and reprs ---------------------------------------------------


def test_reprs():
    assert repr(ShardSpec(dim=0, blocks=(1, 1))) == "ShardSpec(dim=0, blocks=(1, 1))"
    assert repr(ShardSpec(dim=1)) == "ShardSpec(dim=1, blocks=(1,))"
    assert repr(ShardSpec()) == "ShardSpec(replicated)"
    assert repr(Region((4, 0), (4, 4))) == "Region(offsets=(4, 0), sizes=(4, 4))"


def test_spec_properties():
    assert ShardSpec().replicated and not ShardSpec().packed
    assert not ShardSpec(dim=0).replicated and not ShardSpec(dim=0).packed
    assert ShardSpec(dim=0, blocks=[1, 3]).packed
    assert ShardSpec(dim=0, blocks=[1, 3]) == ShardSpec(dim=0, blocks=(1, 3))
    assert hash(ShardSpec(dim=0, blocks=[1, 3])) == hash(ShardSpec(dim=0, blocks=(1, 3)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dim": -1}, "dim"),
        ({"dim": 1.0}, "dim"),
        ({"dim": True}, "dim"),
        ({"dim": 0, "blocks": ()}, "blocks"),
        ({"dim": 0, "blocks": (1, 0)}, "blocks"),
        ({"dim": 0, "blocks": (2, -1)}, "blocks"),
        ({"dim": 0, "blocks": (1.5,)}, "blocks"),
        ({"blocks": (1, 1)}, "needs a shard dim"),
    ],
)
def test_spec_validation(kwargs, match):
    with pytest.raises(PlanError, match=match):
        ShardSpec(**kwargs)


@pytest.mark.parametrize("offsets, sizes", [((0, 0), (1,)), ((-1,), (2,)), ((0,), (-2,)), ((0.0,), (1,))])
def test_region_validation(offsets, sizes):
    with pytest.raises(PlanError):
        Region(offsets, sizes)


def test_bad_arguments_are_plan_errors_not_sharding_errors():
    cases = [
        lambda: check_shardable((8,), ShardSpec(dim=1), 2),
        lambda: check_shardable((8,), ShardSpec(dim=0), 0),
        lambda: shard_regions((8,), ShardSpec(dim=0), 2, 2),
        lambda: block_sizes((8,), ShardSpec()),
        lambda: assemble([torch.zeros(4)], ShardSpec(dim=0), 2),
        lambda: assemble([torch.zeros(4), torch.zeros(3)], ShardSpec(dim=0), 2),
        lambda: chunk_layout([], (4,), 1, 2, 0),
        lambda: chunk_layout([], (4,), 0, 2, 2),
    ]
    for case in cases:
        with pytest.raises(PlanError) as err:
            case()
        assert type(err.value) is PlanError


def test_ratio_mismatch_is_a_sharding_error():
    with pytest.raises(ShardingError, match="not divisible by their sum 3"):
        block_sizes((10, 2), ShardSpec(dim=0, blocks=(1, 1, 1)))


def test_plain_indivisible_message():
    with pytest.raises(ShardingError) as err:
        check_shardable((4, 10), ShardSpec(dim=1), 4)
    assert str(err.value) == (
        "dim 1 of size 10 cannot be split over degree 4: not divisible by 4; "
        "choose a degree that divides 10 (for example 1, 2, 5, 10)"
    )


# --- pieces: one canonical tensor assembled from stored tensors (hub layouts, chunks) -----
@st.composite
def stacked_and_concatenated(draw):
    """A 3-D expert tensor [experts, blocks x rows, cols] built like a hub checkpoint's
    per-expert gate/up tensors: each expert's block stacked on dim 0, blocks concatenated on
    dim 1. Returns (canonical tensor, pieces, {key: stored tensor}, spec, degree)."""
    degree = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.integers(1, 4)) * (degree if draw(st.booleans()) else 1)
    num_blocks = draw(st.integers(1, 3))
    rows, cols = draw(st.integers(1, 3)) * degree, draw(st.integers(1, 3)) * degree
    dim = draw(st.sampled_from([0, 1, 2]))
    assume(dim != 0 or experts % degree == 0)
    blocks = (1,) * num_blocks if dim == 1 else (1,)
    canon = torch.arange(experts * num_blocks * rows * cols).reshape(experts, num_blocks * rows, cols)
    stored, pieces = {}, []
    for b in range(num_blocks):
        for e in range(experts):
            key = f"experts.{e}.w{b}"
            stored[key] = canon[e, b * rows:(b + 1) * rows].clone()
            pieces.append(Piece(key, Region((0, 0), (rows, cols)), (e, b * rows, 0), stacked=(0,)))
    return canon, pieces, stored, ShardSpec(dim=dim, blocks=blocks), degree


@FAST
@given(stacked_and_concatenated())
def test_piece_reads_give_each_rank_its_split(case):
    canon, pieces, stored, spec, degree = case
    check_tiling(canon.shape, pieces, "test")
    for rank in range(degree):
        want = split(canon, spec, degree, rank)
        got = torch.full_like(want, -1)
        for piece, src, off in piece_reads(local_layout(canon.shape, spec, degree, rank), pieces):
            box = piece.box()
            sizes = [1 if d in piece.stacked else src.sizes[d - 1] for d in range(3)]
            dest = got[tuple(slice(o, o + n) for o, n in zip(off, sizes, strict=True))]
            dest.copy_(stored[piece.key][src.slices()].reshape(dest.shape))
            assert len(box.offsets) == 3
        assert torch.equal(got, want)


def test_check_tiling_names_the_fault():
    a = Piece("a", Region((0,), (4,)), (0,))
    with pytest.raises(ShardingError, match="'a' and 'b' overlap"):
        check_tiling((6,), [a, Piece("b", Region((0,), (3,)), (3,))], "t")
    with pytest.raises(ShardingError, match="cover 4 of 6"):
        check_tiling((6,), [a], "t")
    with pytest.raises(ShardingError, match="outside"):
        check_tiling((6,), [a, Piece("b", Region((0,), (4,)), (4,))], "t")


@FAST
@given(layouts())
def test_global_shape_inverts_local_shape(case):
    shape, spec, degree = case
    assert global_shape(local_shape(shape, spec, degree), spec, degree) == shape


def test_global_shape_refuses_a_local_shape_no_canonical_tensor_has():
    with pytest.raises(ShardingError):  # blocks [1, 1] of 3 rows each: 6 rows do not halve into 2 blocks
        global_shape((3, 4), ShardSpec(dim=0, blocks=(1, 1)), 2)
    with pytest.raises(PlanError):
        global_shape((4,), ShardSpec(dim=1), 2)
