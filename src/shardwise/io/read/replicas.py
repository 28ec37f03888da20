"""Replicas read once: on a mesh with ``dp_replicate > 1`` each region is read from storage
by one replica (:func:`assign_owners`) and broadcast to the others. The group of a sharded
tensor is its ``dp_replicate`` group; of a replicated one, the whole mesh when it spans the
world. Every rank reads what it owns, one ``all_reduce`` tells every rank whether any read
failed, then the broadcasts run in the same order everywhere, on the device the group's
collectives take, and come back to the host before the finalize. ``bytes_read`` counts
storage reads only."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import shardwise.comm as comm
from shardwise.errors import CheckpointError
from shardwise.io.read.reader import Finalize, ReadItem, RegionReader
from shardwise.mesh import MeshDims


def assign_owners(groups: Sequence[str], members: dict[str, Sequence[int]],
                  sizes: Sequence[int]) -> list[int]:
    """The global rank that reads each item, balancing bytes; pure. Item ``i`` (``sizes[i]``
    bytes) goes to a member of group ``groups[i]`` (``members[name]``: its global ranks):
    groups in ``members`` order, items largest first, each to the member given the fewest
    bytes so far (ties: the lower rank). Put a group every rank shares first, so that every
    rank reaches the same owners.

    >>> assign_owners(["dp", "dp", "dp"], {"dp": [0, 2]}, [4, 3, 2])
    [0, 2, 2]
    >>> assign_owners(["dp", "all", "dp"], {"all": [0, 1, 2, 3], "dp": [0, 2]}, [4, 3, 2])
    [2, 0, 0]
    """
    given: dict[int, int] = {}
    owners = [-1] * len(sizes)
    order = {name: k for k, name in enumerate(members)}
    for i in sorted(range(len(sizes)), key=lambda i: (order[groups[i]], -sizes[i], i)):
        owner = min(members[groups[i]], key=lambda r: (given.get(r, 0), r))
        owners[i] = owner
        given[owner] = given.get(owner, 0) + sizes[i]
    return owners


def read_once(reader: RegionReader, items: list[ReadItem], *, finalize: Finalize, dims: MeshDims,
              whole: set[str], on_bytes: Callable[[int], None] | None = None) -> dict:
    """``{name: finalize(item, raw)}`` for every item, each read from storage by one replica.
    Collective over the mesh ``dims`` (``shares_reads``): every rank calls it with its items
    (the same, in the same order, on ranks that share their tp and ep coordinates). ``whole``:
    the items every rank reads in full (replicated tensors)."""
    assert dims.shares_reads and dims.dp_replicate_group is not None  # the caller's condition
    dp_group, spans_world, backend = dims.dp_replicate_group, dims.spans_world, dims.comm_backend
    groups = {}  # "all" first: see assign_owners
    if spans_world:
        groups["all"] = (dist.group.WORLD, list(range(dist.get_world_size())))
    groups["dp"] = (dp_group, dist.get_process_group_ranks(dp_group))
    kind = ["all" if spans_world and it.name in whole else "dp" for it in items]
    owners = assign_owners(kind, {k: ranks for k, (_, ranks) in groups.items()}, [it.nbytes for it in items])
    me = dist.get_rank()
    raw: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    try:
        raw = reader.read([it for it, o in zip(items, owners, strict=True) if o == me],
                          finalize=lambda item, t: t)
    except Exception as e:  # told to every rank below, then raised here
        error = e
    check = groups["all" if spans_world else "dp"][0]
    device = comm.device_for(check, backend=backend)
    failed = torch.tensor([1 if error else 0], dtype=torch.int32, device=device)
    comm.all_reduce(failed, "max", backend=backend, group=check,
                    purpose="the check that every replica read its share")
    if error is not None:
        raise error
    if failed.item():
        raise CheckpointError("another rank failed to read its share of the checkpoint (its own error "
                              "names the file); every rank stopped before the replicas exchanged tensors")
    return _exchange(items, owners, [groups[k][0] for k in kind], raw, finalize, on_bytes, backend)


def _exchange(items, owners, groups, raw, finalize, on_bytes, backend) -> dict:
    """Broadcast every item from its owner, in item order; finalize each as it arrives."""
    me = dist.get_rank()
    pending = []
    for item, owner, group in zip(items, owners, groups, strict=True):
        tensor = (raw.pop(item.name) if owner == me
                  else torch.empty(item.local_shape, dtype=item.entry.torch_dtype))
        work, staged = None, None
        if item.nbytes:  # moved as bytes: every group moves uint8, whatever the dtype
            device = comm.device_for(group, backend=backend)
            data = tensor.reshape(-1).view(torch.uint8)  # a view of a receiver's buffer
            staged = (data if device == data.device else data.to(device) if owner == me
                      else torch.empty_like(data, device=device))
            work = comm.broadcast(staged, owner, backend=backend, group=group, async_op=True,
                                  purpose=f"the broadcast of {item.name!r} from rank {owner} to its replicas")
        pending.append((item, owner, work, tensor, staged))
    results = {}
    for item, owner, work, tensor, staged in pending:
        if work is not None:
            work.wait()
        if owner != me:
            if staged is not None and staged.device != tensor.device:  # to the host, as a read gives it
                tensor.reshape(-1).view(torch.uint8).copy_(staged)
            if on_bytes is not None:
                on_bytes(item.nbytes)
        results[item.name] = finalize(item, tensor)
    return results


__all__ = ["assign_owners", "read_once"]
