"""How a shard is held in a model, and how to tell a DTensor from a plain tensor.

:class:`Holding` names the three ways (``parallelize`` and ``sw.load`` accept them as the
strings ``"dtensor"``, ``"local"`` and ``"spmd"``); :func:`is_dtensor` and :func:`local_of`
are the one test for a DTensor that every module uses.
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

from shardwise.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class Holding(str, enum.Enum):
    """How a parallelised model holds its shards.

    - ``DTENSOR`` (gloo, nccl, native TorchNeuron): each parameter is a DTensor over its mesh
      axis, its local tensor this rank's shard;
    - ``LOCAL`` (xla, neuron_xla): each parameter is a plain local shard and the forward of
      each planned module does its collectives itself;
    - ``SPMD`` (xla_spmd): one process drives every device; each parameter stays one global
      tensor placed over the devices and the XLA partitioner inserts the collectives.

    A ``str`` subclass, so ``Holding.LOCAL == "local"`` stays true for callers that compare
    against the strings of the public ``holding=`` keyword.

    >>> Holding.parse("local")
    <Holding.LOCAL: 'local'>
    >>> Holding.parse("local") == "local"
    True
    """

    DTENSOR = "dtensor"
    LOCAL = "local"
    SPMD = "spmd"

    @classmethod
    def parse(cls, value: str | Holding) -> Holding:
        """``value`` as a ``Holding``; a string that names none raises ``UsageError``."""
        try:
            return cls(value)
        except ValueError:
            names = tuple(h.value for h in cls)
            raise UsageError(f"holding must be one of {names} or None (the backend's), "
                             f"got {value!r}") from None

    def __str__(self) -> str:
        return self.value

    @property
    def one_process(self) -> bool:
        """True when one process drives every device (its tensors are global, not shards)."""
        return self is Holding.SPMD

    @property
    def wires_forward(self) -> bool:
        """True when shardwise wires the forward of planned modules (not under SPMD, where the
        model's own forward is correct and the partitioner adds the collectives)."""
        return self is not Holding.SPMD


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """True when ``tensor`` is a ``torch.distributed.tensor.DTensor`` (a Parameter of one too).

    An ``isinstance`` check, without importing ``torch.distributed.tensor`` (about 0.3 s) for
    it: no DTensor can exist before that module is imported, so its absence answers False.

    >>> is_dtensor(torch.zeros(2))
    False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a plain tensor is returned as is)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


__all__ = ["Holding", "is_dtensor", "local_of"]
