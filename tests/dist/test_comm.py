"""shardwise.comm on real gloo ranks: every kind of collective it runs turns a peer that is
not there into a CollectiveError naming the operation, the group size, the rank and the fix;
the collectives give the right values when every rank is there; and a tensor collective waits
in the backend it is given, never one it looks up."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
import shardwise.comm as comm
from harness import run_ranks
from shardwise.backends import Backend
from shardwise.backends.base import GlooBackend
from shardwise.mesh import world_backend

TIMEOUT = 5  # seconds: the backend's, and the process group's


def _values(_):
    backend = sw.init_backend("gloo")
    me = comm.rank()
    total = comm.all_reduce(torch.tensor([me + 1.0]), backend=backend, purpose="a test")
    top = comm.all_reduce(torch.tensor([float(me)]), "max", backend=backend)
    inline = comm.all_reduce_inline(torch.tensor([me + 1.0]))
    parts = comm.all_gather_inline([torch.empty(2) for _ in range(2)], torch.full((2,), float(me)))
    sent = torch.tensor([me + 10.0])
    comm.broadcast(sent, 1, backend=backend, async_op=True).wait()
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
    "all_reduce": lambda b: comm.all_reduce(torch.ones(1), backend=b, purpose="the test's sum"),
    "all_reduce_inline": lambda b: comm.all_reduce_inline(torch.ones(1)),
    "all_gather_inline": lambda b: comm.all_gather_inline([torch.empty(1), torch.empty(1)], torch.ones(1)),
    "broadcast_object": lambda b: comm.broadcast_object("x", src=0, purpose="the test's object"),
}


def _alone(call: str) -> str:
    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    if comm.rank() == 1:
        return "left"  # never reaches the collective; the launcher tears its group down
    try:
        _CALLS[call](backend)
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


class _Noting(GlooBackend):
    """A gloo backend, not the one init_backend started, that notes each collective it waits for."""

    def __init__(self):
        super().__init__(timeout=TIMEOUT)
        self.rank, self.world_size = comm.rank(), comm.world_size()
        self.waited: list[str] = []

    def wait(self, work, what: str, *, timeout=None) -> None:
        self.waited.append(what)
        super().wait(work, what, timeout=timeout)


def _in_the_given_backend(_):
    started, given = sw.init_backend("gloo"), _Noting()
    total = comm.all_reduce(torch.tensor([comm.rank() + 1.0]), backend=given, purpose="the sum")
    sent = torch.tensor([comm.rank() + 10.0])
    comm.broadcast(sent, 0, backend=given, async_op=True).wait()
    return total.item(), sent.item(), given.waited, world_backend() is started


def test_a_tensor_collective_waits_in_the_backend_it_is_given():
    for total, sent, waited, resolved in run_ranks(_in_the_given_backend, 2, None, timeout=60):
        assert (total, sent) == (3.0, 10.0)
        assert waited == ["the sum (all_reduce over 2 ranks)", "broadcast over 2 ranks"]
        assert resolved  # at the boundary: the backend init_backend started


class _OnMeta(Backend):
    name = "on_meta"

    def _device(self) -> torch.device:
        return torch.device("meta")


class _DeviceOnlyGroup:
    """A process group whose collectives take tensors on one device type only, as NCCL's (CUDA)."""

    _device_types = (torch.device("meta"),)


def test_the_device_of_a_collective_is_the_given_backends_off_a_host_group():
    assert comm.device_for(_DeviceOnlyGroup(), backend=_OnMeta()) == torch.device("meta")
    assert comm.device_for(_DeviceOnlyGroup(), backend=None) == torch.device("cpu")  # no process group


def test_without_a_process_group_collectives_are_those_of_one_rank():
    t = torch.tensor([2.0])
    assert world_backend() is None and (comm.rank(), comm.world_size()) == (0, 1)
    assert comm.all_reduce(t, backend=None) is t and t.item() == 2.0
    assert comm.broadcast(t, 0, backend=None).wait() is None and t.item() == 2.0
    assert comm.device_for(backend=None) == torch.device("cpu")
    assert comm.broadcast_object("x") == "x" and comm.all_gather_object(1) == [1]
    assert comm.gather_object(1) == [1]
    with pytest.raises(sw.UsageError, match="unknown reduce op 'mean'"):
        comm.all_reduce(t, "mean", backend=None)
