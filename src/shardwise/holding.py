"""How a parallelised model holds its shards (``holding=``, decoded once by
:meth:`Holding.parse`): plain data that the layers which act on it read, and the one DTensor
test (:func:`is_dtensor`, :func:`local_of`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeGuard

import torch

from shardwise.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True, eq=False)
class Holding:
    """One way of holding shards, as data: its name and what it declares. ``parallel`` wires
    a model by it, ``io.place`` picks a load's placement by it, the DCP format places a save by
    it. One instance per kind, compared by identity.

    - ``one_process``: one process drives every device; each parameter is one global tensor
      placed over the devices (SPMD), and the model's own forward is correct.
    - ``plain_shards``: plain local shards, no tensor says it is sharded; each planned forward
      does its own collectives.
    - neither: each parameter a DTensor over its mesh axis (gloo, nccl, TorchNeuron).

    >>> Holding.parse("local")
    Holding.LOCAL
    >>> str(Holding.parse("spmd")), Holding.parse("spmd").one_process
    ('spmd', True)
    """

    DTENSOR: ClassVar[Holding]
    LOCAL: ClassVar[Holding]
    SPMD: ClassVar[Holding]

    name: str  # the public keyword's value
    one_process: bool = False
    plain_shards: bool = False

    @staticmethod
    def parse(value: str | Holding) -> Holding:
        """``value`` (a keyword's string, or a ``Holding``) as a ``Holding``, else ``UsageError``."""
        if isinstance(value, Holding):
            return value
        for h in _ALL:
            if value == h.name:
                return h
        raise UsageError(f"holding must be one of {tuple(h.name for h in _ALL)} or None (the "
                         f"backend's), got {value!r}")

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Holding.{self.name.upper()}"

    def __reduce__(self) -> str:
        return f"Holding.{self.name.upper()}"  # one instance per kind, across pickling too


Holding.DTENSOR = Holding("dtensor")
Holding.LOCAL = Holding("local", plain_shards=True)
Holding.SPMD = Holding("spmd", one_process=True)
_ALL = (Holding.DTENSOR, Holding.LOCAL, Holding.SPMD)


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """True when ``tensor`` is a DTensor (a Parameter of one too), without importing
    ``torch.distributed.tensor`` (0.3 s): no DTensor exists before that module is imported.

    >>> is_dtensor(torch.zeros(2))
    False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a plain tensor is returned as is)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


__all__ = ["Holding", "is_dtensor", "local_of"]
