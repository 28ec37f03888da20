"""shardwise.comm on real gloo ranks: every kind of collective it runs turns a peer that is
not there into a CollectiveError naming the operation, the group size, the rank and the fix;
and the collectives give the right values when every rank is there."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
import shardwise.comm as comm
from harness import run_ranks

TIMEOUT = 5  # seconds: the backend's, and the process group's


def _values(_):
    sw.init_backend("gloo")
    me = comm.rank()
    total = comm.all_reduce(torch.tensor([me + 1.0]), purpose="a test")
    top = comm.all_reduce(torch.tensor([float(me)]), "max")
    inline = comm.all_reduce_inline(torch.tensor([me + 1.0]))
    parts = comm.all_gather_inline([torch.empty(2) for _ in range(2)], torch.full((2,), float(me)))
    sent = torch.tensor([me + 10.0])
    comm.broadcast(sent, 1, async_op=True).wait()
    return (total.item(), top.item(), inline.item(), [p.tolist() for p in parts], sent.item(),
            comm.broadcast_object({"from": me}, src=1), comm.all_gather_object(me),
            comm.gather_object(me * 2, dst=0))


def test_collectives_give_every_rank_the_result():
    got = run_ranks(_values, 2, None, timeout=60)
    for me, (total, top, inline, parts, sent, obj, everyone, gathered) in enumerate(got):
        assert (total, top, inline, sent) == (3.0, 1.0, 3.0, 11.0)
        assert parts == [[0.0, 0.0], [1.0, 1.0]]
        assert obj == {"from": 1} and everyone == [0, 1]
        assert gathered == ([0, 2] if me == 0 else None)


_CALLS = {
    "all_reduce": lambda: comm.all_reduce(torch.ones(1), purpose="the test's sum"),
    "all_reduce_inline": lambda: comm.all_reduce_inline(torch.ones(1)),
    "all_gather_inline": lambda: comm.all_gather_inline([torch.empty(1), torch.empty(1)], torch.ones(1)),
    "broadcast_object": lambda: comm.broadcast_object("x", src=0, purpose="the test's object"),
}


def _alone(call: str) -> str:
    sw.init_backend("gloo", timeout=TIMEOUT)
    if comm.rank() == 1:
        return "left"  # never reaches the collective; the launcher tears its group down
    try:
        _CALLS[call]()
    except sw.CollectiveError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_a_collective_a_peer_never_reaches_is_a_collective_error(call):
    message, other = run_ranks(_alone, 2, call, timeout=60)
    assert other == "left"
    op = {"broadcast_object": "broadcast_object_list"}.get(call, call.removesuffix("_inline"))
    assert f"{op} over 2 ranks" in message, message
    assert "on rank 0" in message and "Every rank of the group must reach the same" in message
    if call in ("all_reduce", "broadcast_object"):
        assert message.startswith("the test's"), message


def test_without_a_process_group_collectives_are_those_of_one_rank():
    t = torch.tensor([2.0])
    assert comm.world_backend() is None and (comm.rank(), comm.world_size()) == (0, 1)
    assert comm.all_reduce(t) is t and t.item() == 2.0
    assert comm.broadcast_object("x") == "x" and comm.all_gather_object(1) == [1]
    assert comm.gather_object(1) == [1]
    with pytest.raises(sw.UsageError, match="unknown reduce op 'mean'"):
        comm.all_reduce(t, "mean")
