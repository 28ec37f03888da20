"""Saving under torch_xla SPMD (holding ``"spmd"``: one process drives every device).

The gather save needs nothing here (a tensor is global: ``.cpu()`` is the canonical
tensor). A DCP save (``shardwise.io.formats.dcp.checkpoint.save_dcp``) writes each of this process's distinct
shards as one chunk at its canonical offsets (:func:`spmd_placed`, :class:`SpmdSavePlanner`);
an optimizer save (``shardwise.io.formats.dcp.optim``) places its state tensors the same way
(:func:`global_placed`).
Loading is ``shardwise.io.spmd``.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from shardwise.core.spec import Region
from shardwise.io.formats.dcp.items import CanonicalSavePlanner, Placed
from shardwise.parallel import get_shard_state


def spmd_placed(model: nn.Module) -> dict[str, Placed]:
    """``{name: Placed}`` for a DCP save of an SPMD model: ``local`` is the global tensor
    (so local offsets are canonical offsets) and the layout lists this process's distinct
    shards (``Backend.local_regions`` of the backend the model was loaded on). DCP drops the
    copies other processes also write."""
    state = get_shard_state(model)
    assert state is not None and state.backend is not None  # an SPMD model, its mesh made by xla_spmd
    tensors = model.state_dict(keep_vars=True)
    state.backend.settle([tensors[name].detach() for name in state.specs])  # after a step: one program
    return {name: global_placed(tensors[name], state.backend, whole=spec.replicated)
            for name, spec in state.specs.items()}


def global_placed(tensor: torch.Tensor, backend, *, whole: bool = False) -> Placed:
    """A global SPMD tensor as a :class:`Placed`: ``local`` is the tensor itself (local offsets
    are canonical offsets) and the layout lists this process's distinct shards as the tensor
    is actually sharded (``backend.local_regions``; ``whole``: one region, the whole tensor). A
    host tensor is whole."""
    t = tensor.detach()
    if whole or t.ndim == 0 or t.device.type != "xla":
        boxes = [((0,) * t.ndim, tuple(t.shape))]
    else:
        boxes = backend.local_regions(t)
    return Placed(t, tuple(t.shape), [(Region(o, s), tuple(o)) for o, s in boxes])


class SpmdSavePlanner(CanonicalSavePlanner):
    """The canonical save planner, resolving each shard of an SPMD tensor from the tensor's
    local shards on the host (fetched once per tensor, dropped as they are written) rather
    than by slicing the global tensor, which would compile one XLA program per slice.
    ``backend``: the one holding the tensors (``ShardState.backend``)."""

    def __init__(self, placed, backend):
        super().__init__(placed)
        self._backend = backend
        self._shards: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
        self._lock = threading.Lock()

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        p = self._placed.get(fqn)
        if p is None or p.local.device.type != "xla":
            return super().resolve_data(write_item)
        if len(p.layout) == 1 and p.layout[0][0].sizes == p.shape:  # whole (replicated): one copy
            return self.state_dict[fqn].cpu()
        with self._lock:
            if fqn not in self._shards:
                self._shards[fqn] = self._backend.local_shards(self.state_dict[fqn])
            shards = self._shards[fqn]
            data = shards.pop(tuple(write_item.index.offset))
            if not shards:
                del self._shards[fqn]
        return data


__all__ = ["SpmdSavePlanner", "global_placed", "spmd_placed"]
