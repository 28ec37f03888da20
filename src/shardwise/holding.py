"""How a parallelised model holds its shards: one strategy object per way (``holding=``, decoded
once by :meth:`Holding.parse`), and the one DTensor test (:func:`is_dtensor`, :func:`local_of`)."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard

import torch

from shardwise.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class Holding:
    """One way of holding shards: what it declares (``one_process``, ``plain_shards``) and its
    behaviour, the methods below, forwarded to its implementation in ``shardwise.io.place``
    (imported on first use). One instance per kind, compared by identity. Every rank calls each
    method with the same arguments, in pipeline order: check_wiring, shard or placement, wire; on
    save gather_coords or dcp_placed.

    - ``check_wiring(model, specs)``: raise ``PlanError``, before any read, for a planned module
      this holding cannot wire.
    - ``shard(full, name, spec, specs, dims, device)``: this rank's shard of the model's whole
      tensor ``full``, on ``device`` (None: as is).
    - ``wire(model, specs, state)``: make the planned modules' forward correct on the installed
      shards (``install``, once).
    - ``placement(model, specs, dims, dtype)``: the last step of ``sw.load``: this rank's wants,
      each read's finalize, the install.
    - ``gather_coords(state, spec)``: ``(degree, rank)`` of the shard this rank hands a gather
      save (degree 1: whole here).
    - ``dcp_placed(model, state)``: ``({name: Placed}, save planner or None)`` of a DCP save of
      ``model`` (None: the canonical planner).

    >>> Holding.parse("local")
    Holding.LOCAL
    >>> str(Holding.parse("spmd")), Holding.parse("spmd").one_process
    ('spmd', True)
    """

    DTENSOR: ClassVar[Holding]
    LOCAL: ClassVar[Holding]
    SPMD: ClassVar[Holding]
    METHODS: ClassVar[tuple[str, ...]] = ("check_wiring", "shard", "wire", "placement", "gather_coords",
                                          "dcp_placed")

    def __init__(self, name: str, implementation: str, *, one_process: bool = False,
                 plain_shards: bool = False):
        self.name = name  # the public keyword's value
        self.one_process = one_process  # one process drives every device: tensors are global
        self.plain_shards = plain_shards  # plain local shards: no tensor says it is sharded
        self._path = implementation  # "module:Class"
        self._impl: Any = None

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

    def __getattr__(self, method: str) -> Any:
        if method not in Holding.METHODS:  # attributes, and what copy/pickle probe for
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {method!r}")
        if self._impl is None:
            module, cls = self._path.split(":")
            self._impl = getattr(importlib.import_module(module), cls)()
        return getattr(self._impl, method)


Holding.DTENSOR = Holding("dtensor", "shardwise.io.place:DTensorHolding")
Holding.LOCAL = Holding("local", "shardwise.io.place:LocalHolding", plain_shards=True)
Holding.SPMD = Holding("spmd", "shardwise.io.place:SpmdHolding", one_process=True)
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
