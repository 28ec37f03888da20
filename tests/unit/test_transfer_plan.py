"""The transfer plan's math, pure: no process group, layouts from degrees (offline.py).

Each plan is replayed here in one process (every move copies a box from a source rank's
local tensor into a destination rank's), so a wrong offset, a missed box or a double copy
shows as a destination shard that differs from its slice of the canonical tensor.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from shardwise.core.pieces import Piece
from shardwise.core.spec import Region, ShardSpec
from shardwise.errors import PlanError, ShardingError
from shardwise.transfer.offline import MeshLayout, holdings, offline_plan, parts_of
from shardwise.transfer.plan import Move, by_link, make_plan, pack_buckets, split_move

TENSORS = {
    "wq": ((16, 8), ShardSpec(dim=0)),
    "gate_up": ((16, 8), ShardSpec(dim=0, blocks=(1, 1))),
    "wo": ((8, 16), ShardSpec(dim=1)),
    "experts": ((4, 8, 6), ShardSpec(dim=0, axis="ep")),
    "norm": ((6,), ShardSpec()),
}


def _locals(tensors, mesh, full):
    """{(name, rank): local tensor} of every part under ``mesh``, cut from ``full``."""
    out = {}
    for name, (shape, spec) in tensors.items():
        for rank, (local, layout) in parts_of(shape, spec, mesh).items():
            t = torch.full(local, -1.0)
            for region, off in layout:
                t[Region(off, region.sizes).slices()] = full[name][region.slices()]
            out[(name, rank)] = t
    return out


def _replay(plan, src_locals, dst_shapes):
    dst = {k: torch.full(s, float("nan")) for k, s in dst_shapes.items()}
    for m in (*plan.local, *(m for b in plan.buckets for m in b)):
        box = src_locals[(m.src, m.src_rank)][Region(m.src_offsets, m.sizes).slices()]
        target = dst[(m.dst, m.dst_rank)][Region(m.dst_offsets, m.sizes).slices()]
        assert torch.isnan(target).all(), f"{m} writes bytes another move wrote"
        target.copy_(box)
    return dst


LAYOUTS = {
    "fsdp2x_tp2_to_tp4": (MeshLayout(dp_shard=2, tp=2), MeshLayout(tp=4)),
    "tp4_to_tp2_replicas": (MeshLayout(tp=4), MeshLayout(dp_replicate=2, tp=2)),
    "tp2_to_disjoint_tp2": (MeshLayout(tp=2), MeshLayout(tp=2, first_rank=2)),
    "ep2_to_tp2": (MeshLayout(ep=2), MeshLayout(tp=2)),
    "fsdp4_to_tp1": (MeshLayout(dp_shard=4), MeshLayout(first_rank=1)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replayed_plan_fills_every_destination_shard_once(name):
    src_mesh, dst_mesh = LAYOUTS[name]
    full = {n: torch.arange(math.prod(s), dtype=torch.float32).view(s) for n, (s, _) in TENSORS.items()}
    plan = offline_plan(TENSORS, src_mesh, dst_mesh, src_dtype="F32", dst_dtype="F32", bucket_bytes=96)
    want = _locals(TENSORS, dst_mesh, full)
    got = _replay(plan, _locals(TENSORS, src_mesh, full), {k: tuple(t.shape) for k, t in want.items()})
    for key, t in want.items():
        assert torch.equal(got[key], t), key
    assert plan.local_bytes + plan.remote_bytes == plan.dst_bytes


def test_a_rank_copies_what_it_already_holds():
    plan = offline_plan({"w": ((8, 4), ShardSpec(dim=0))}, MeshLayout(tp=2), MeshLayout(tp=1),
                        src_dtype="F32", dst_dtype="BF16")
    assert (plan.local_bytes, plan.remote_bytes) == (32, 32)  # rank 0's half copied, rank 1's sent
    assert [(m.src_rank, m.dst_rank) for b in plan.buckets for m in b] == [(1, 0)]


def test_replicas_share_the_sending():
    plan = offline_plan({"w": ((64, 4), ShardSpec(dim=0))}, MeshLayout(dp_replicate=2, tp=1),
                        MeshLayout(tp=4, first_rank=2), src_dtype="F32", dst_dtype="F32")
    sent = defaultdict(int)
    for b in plan.buckets:
        for m in b:
            sent[m.src_rank] += m.nbytes
    assert sent == {0: 512, 1: 512}


def test_buckets_bound_what_each_rank_sends_plus_receives():
    plan = offline_plan(TENSORS, MeshLayout(dp_shard=2, tp=2), MeshLayout(tp=4), src_dtype="F32",
                        dst_dtype="F32", bucket_bytes=40)
    assert len(plan.buckets) > 3
    for bucket in plan.buckets:
        load = defaultdict(int)
        for m in bucket:
            load[m.src_rank] += m.nbytes
            load[m.dst_rank] += m.nbytes
        assert max(load.values()) <= 40, load


def test_split_move_cuts_along_the_first_dims():
    m = Move("d", 1, (0, 0, 0), "s", 0, (2, 0, 0), (3, 2, 5), 3 * 2 * 5 * 4)
    parts = split_move(m, 24)  # 6 elements of 4 bytes: one row of 5 is 20 bytes
    assert all(p.nbytes <= 24 for p in parts) and sum(p.nbytes for p in parts) == m.nbytes
    assert {(p.src_offsets, p.sizes) for p in parts} == {((2 + i, j, 0), (1, 1, 5)) for i in range(3)
                                                         for j in range(2)}
    assert len(pack_buckets([m], 24)) == 6  # each rank may send + receive one part at a time


def test_fused_source_into_separate_destinations():
    src = holdings({"qkv": ((12, 2), ShardSpec(dim=0, blocks=(1, 1, 1)))}, MeshLayout(tp=2), "F32")
    dst = holdings({x: ((4, 2), ShardSpec(dim=0)) for x in "qkv"}, MeshLayout(tp=2), "F32")
    pieces = {x: (Piece("qkv", Region((4 * i, 0), (4, 2)), (0, 0)),) for i, x in enumerate("qkv")}
    plan = make_plan(src, dst, world_size=2, pieces=pieces)
    assert plan.remote_bytes == 0  # packed blocks keep q|k|v apart: each rank holds its own rows
    assert {(m.dst, m.src_offsets) for m in plan.local if m.dst_rank == 1} == {
        ("q", (0, 0)), ("k", (2, 0)), ("v", (4, 0))}


def test_refusals_name_the_tensor():
    src = holdings({"w": ((8, 2), ShardSpec(dim=0))}, MeshLayout(tp=2), "F32")
    dst = holdings({"w": ((8, 2), ShardSpec(dim=0)), "b": ((2,), ShardSpec())}, MeshLayout(tp=2), "F32")
    with pytest.raises(PlanError, match="'b' needs source tensor 'b'"):
        make_plan(src, dst, world_size=2)
    half = {"w": (Piece("w", Region((0, 0), (4, 2)), (0, 0)),)}
    with pytest.raises(ShardingError, match="destination tensor 'w'"):
        make_plan(src, {"w": dst["w"]}, world_size=2, pieces=half)
    partial = holdings({"w": ((8, 2), ShardSpec(dim=0))}, MeshLayout(tp=2), "F32")
    partial = {"w": type(partial["w"])(partial["w"].shape, "F32", partial["w"].parts[:1])}
    with pytest.raises(PlanError, match="no source rank holds"):
        make_plan(partial, {"w": dst["w"]}, world_size=2)


def test_summary_names_links_pairs_and_buckets():
    plan = offline_plan(TENSORS, MeshLayout(tp=4), MeshLayout(tp=2, first_rank=4), ranks_per_node=4)
    text = str(plan)
    assert "inter-node" in text and "buckets of at most 256.00 MiB" in text
    links = by_link(plan)
    assert links["inter-node"] == plan.remote_bytes and links["intra-node"] == 0
    assert sum(plan.pairs().values()) == plan.dst_bytes


def test_backends_without_point_to_point_say_so():
    from shardwise.backends.base import GlooBackend
    from shardwise.backends.nccl import NcclBackend
    from shardwise.backends.neuron import NeuronBackend
    from shardwise.backends.xla import XlaBackend

    assert GlooBackend.supports_p2p and NcclBackend.supports_p2p
    assert not XlaBackend.supports_p2p and not NeuronBackend.supports_p2p
