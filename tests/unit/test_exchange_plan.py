"""The pure plan of a load that reads each byte once per job (``shardwise.io.read.exchange``): run on
every rank's view and executed here by hand (slabs sliced out of the canonical tensors, moves
delivered through per-pair mailboxes), each rank's local tensors equal ``split``, every pooled
byte is fetched once, slabs are balanced and the plan of a colwise tensor reads it directly."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.core.header import TensorEntry
from shardwise.core.spec import ShardSpec, local_layout, local_shape, split
from shardwise.io.read.exchange_plan import Need, plan_exchange

SHAPES = {("a.safetensors", "emb"): (24, 8), ("a.safetensors", "o"): (8, 16), ("a.safetensors", "norm"): (8,),
          ("b.safetensors", "gate_up"): (16, 8), ("b.safetensors", "down"): (8, 16),
          ("b.safetensors", "proj_out"): (8, 24), ("b.safetensors", "scale"): ()}
SPECS = {"emb": ShardSpec(dim=0), "o": ShardSpec(dim=1), "norm": ShardSpec(), "gate_up": ShardSpec(0, (1, 1)),
         "down": ShardSpec(dim=1), "proj_out": ShardSpec(1, (2, 1)), "scale": ShardSpec()}


def _entries() -> dict:
    out, start = {}, {}
    for (f, name), shape in SHAPES.items():
        at, n = start.get(f, 0), math.prod(shape) * 4
        out[(f, name)] = TensorEntry(name, "F32", shape, at, at + n)
        start[f] = at + n
    return out


def _needs(world: int, degree: int) -> list[list[Need]]:
    """Every rank's needs: rank r is tp rank ``r % degree`` (dp replicas beyond ``degree``)."""
    return [[Need(i, key, tuple(local_layout(shape, SPECS[key[1]], degree, r % degree)))
             for i, (key, shape) in enumerate(SHAPES.items())] for r in range(world)]


def _run(world: int, degree: int, window: int):
    """Execute every rank's plan by hand; the local tensors and the bytes each rank fetched."""
    entries = _entries()
    torch.manual_seed(0)
    canon = {key: torch.randn(shape) for key, shape in SHAPES.items()}
    needs = _needs(world, degree)
    plans = [plan_exchange(needs, entries, r, window=window) for r in range(world)]
    assert len({len(p.rounds) for p in plans}) == 1  # every rank runs the same number of rounds
    keys = list(SHAPES)
    local = [{i: torch.full(local_shape(SHAPES[k], SPECS[k[1]], degree), float("nan"))
              for i, k in enumerate(keys)} for _ in range(world)]
    fetched, direct = [0] * world, [0] * world
    for r, plan in enumerate(plans):  # the direct reads
        for i in plan.direct:
            for region, off in needs[r][i].layout:
                local[r][i][tuple(slice(o, o + n) for o, n in zip(off, region.sizes, strict=True))] = \
                    canon[keys[i]][region.slices()]
                direct[r] += region.numel * 4
    for number in range(len(plans[0].rounds)):
        slabs = [[canon[p.tensor][p.region.slices()] for p in plan.rounds[number].fetch] for plan in plans]
        for r in range(world):
            fetched[r] += sum(s.numel() * 4 for s in slabs[r])
        mail = {}
        for src, plan in enumerate(plans):
            rnd = plan.rounds[number]
            assert all(m.peer != src for m in rnd.sends)
            assert [m.peer for m in rnd.sends] == sorted(m.peer for m in rnd.sends)
            for m in rnd.sends:
                piece = rnd.fetch[m.piece]
                inner = tuple(slice(b - p, b - p + n) for b, p, n in
                              zip(m.box.offsets, piece.region.offsets, m.box.sizes, strict=True))
                mail.setdefault((src, m.peer), []).append((m.box, slabs[src][m.piece][inner]))
        for dst, plan in enumerate(plans):
            for m in plan.rounds[number].receives:
                if m.peer == dst:
                    piece = plan.rounds[number].fetch[m.piece]
                    data = canon[piece.tensor][m.box.slices()]
                else:
                    box, data = mail[(m.peer, dst)].pop(0)
                    assert box == m.box  # the sender's order is the receiver's
                at = tuple(slice(a, a + n) for a, n in zip(m.at, m.box.sizes, strict=True))
                local[dst][m.item][at] = data
        assert all(not v for v in mail.values())
    for r in range(world):
        for i, key in enumerate(keys):
            assert torch.equal(local[r][i], split(canon[key], SPECS[key[1]], degree, r % degree)), (r, key)
    return plans, fetched, direct


@pytest.mark.parametrize("world,degree", [(2, 2), (4, 4), (4, 2), (2, 1)])
@pytest.mark.parametrize("window", [1 << 20, 200])
def test_every_rank_gets_its_shards_and_each_byte_is_fetched_once(world, degree, window):
    if any(s.dim is not None and SHAPES[k][s.dim] % (degree * sum(s.blocks)) for k in SHAPES
           for s in [SPECS[k[1]]]):
        pytest.skip("shapes do not divide")
    plans, fetched, direct = _run(world, degree, window)
    entries = _entries()
    pooled = {p.tensor for plan in plans for rnd in plan.rounds for p in rnd.fetch}
    assert sum(fetched) == sum(entries[k].nbytes for k in pooled)  # every pooled byte, once
    if world == degree:  # no replicas: colwise tensors are read by each rank for itself, once
        assert ("a.safetensors", "emb") not in pooled and ("b.safetensors", "gate_up") not in pooled
        assert sum(direct) == sum(entries[k].nbytes for k in entries if k not in pooled)
    else:  # replicas need the same rows: pooled, so the job reads them once
        assert ("a.safetensors", "emb") in pooled
    row = max(math.prod(SHAPES[k][1:]) * 4 for k in pooled)
    share = sum(fetched) / world
    # balanced within a row a round (each slab ends at the row boundary after its share)
    assert max(fetched) <= share + len(plans[0].rounds) * row
    if window < 1 << 20:
        assert len(plans[0].rounds) > 1


def test_rowwise_needs_few_pieces_per_rank():
    """A rowwise tensor of many rows: each rank fetches one slab of rows, whatever the row count."""
    entry = TensorEntry("w", "F32", (4096, 8), 0, 4096 * 32)
    needs = [[Need(0, ("f", "w"), tuple(local_layout((4096, 8), ShardSpec(dim=1), 4, r)))] for r in range(4)]
    for r in range(4):
        plan = plan_exchange(needs, {("f", "w"): entry}, r)
        assert plan.direct == () and len(plan.rounds) == 1
        (piece,) = plan.rounds[0].fetch
        assert piece.region.sizes == (1024, 8)
        assert len(plan.rounds[0].sends) == 3 and len(plan.rounds[0].receives) == 4


def test_a_pool_under_a_round_is_still_cut_into_rounds():
    """16 MiB of rowwise rows over 2 ranks (under the 32 MiB round): MIN_ROUNDS rounds of a
    MIN_SLAB slab a rank, so that the exchange of each overlaps the fetch of the next; a tiny
    pool stays whole."""
    from shardwise.io.read.exchange_plan import MIN_ROUNDS, MIN_SLAB, ROUND_BYTES

    rows = (16 << 20) // 4096
    entry = TensorEntry("w", "F32", (rows, 1024), 0, rows * 4096)
    needs = [[Need(0, ("f", "w"), tuple(local_layout((rows, 1024), ShardSpec(dim=1), 2, r)))] for r in (0, 1)]
    assert entry.nbytes < ROUND_BYTES
    plans = [plan_exchange(needs, {("f", "w"): entry}, r, window=ROUND_BYTES // 2) for r in (0, 1)]
    assert [len(p.rounds) for p in plans] == [MIN_ROUNDS] * 2
    for plan in plans:
        for rnd in plan.rounds:
            (piece,) = rnd.fetch
            assert piece.region.sizes[0] * 4096 == MIN_SLAB
