"""How a parallelised model holds its shards: one strategy object per way (``holding=``, decoded
once by :meth:`Holding.parse`), and the one DTensor test (:func:`is_dtensor`, :func:`local_of`)."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard

import torch

from shardwise.errors import UsageError

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.tensor import DTensor

    from shardwise.core.plan import ResolvedPlan
    from shardwise.core.spec import ShardSpec

    # defined above this module: loosely typed, so that the imports only go downward
    MeshDims = Any
    Placed = Any
    Placement = Any
    ShardState = Any


class Holding:
    """One way of holding shards: what it declares (``one_process``, ``plain_shards``) and its
    behaviour, forwarded to its implementation in ``shardwise.io.place`` (imported on first
    use). One instance per kind, compared by identity. Every rank calls each method with the
    same arguments, in pipeline order: check_wiring, shard or placement, wire; on save
    gather_coords or dcp_placed.

    >>> Holding.parse("local")
    Holding.LOCAL
    >>> str(Holding.parse("spmd")), Holding.parse("spmd").one_process
    ('spmd', True)
    """

    DTENSOR: ClassVar[Holding]
    LOCAL: ClassVar[Holding]
    SPMD: ClassVar[Holding]

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

    def _implementation(self) -> Any:
        if self._impl is None:
            module, cls = self._path.split(":")
            self._impl = getattr(importlib.import_module(module), cls)()
        return self._impl

    def check_wiring(self, model: nn.Module, specs: ResolvedPlan) -> None:
        """Raise ``PlanError``, before any read, for a planned module this holding cannot wire."""
        self._implementation().check_wiring(model, specs)

    def shard(self, full: torch.Tensor, name: str, spec: ShardSpec, specs: ResolvedPlan,
              dims: MeshDims, device: torch.device | None) -> torch.Tensor:
        """This rank's shard of the model's whole tensor ``full``, on ``device`` (None: as is)."""
        return self._implementation().shard(full, name, spec, specs, dims, device)

    def wire(self, model: nn.Module, specs: ResolvedPlan, state: ShardState) -> None:
        """Make the planned modules' forward correct on the installed shards (``install``, once)."""
        self._implementation().wire(model, specs, state)

    def placement(self, model: nn.Module, specs: ResolvedPlan, dims: MeshDims,
                  dtype: torch.dtype | None) -> Placement:
        """The last step of ``sw.load``: this rank's wants, each read's finalize, the install."""
        return self._implementation().placement(model, specs, dims, dtype)

    def gather_coords(self, state: ShardState, spec: ShardSpec) -> tuple[int, int]:
        """``(degree, rank)`` of the shard this rank hands a gather save (degree 1: whole here)."""
        return self._implementation().gather_coords(state, spec)

    def dcp_placed(self, model: nn.Module, state: ShardState) -> tuple[dict[str, Placed], Any]:
        """``({name: Placed}, save planner or None)`` of a DCP save of ``model`` (None: the
        canonical planner)."""
        return self._implementation().dcp_placed(model, state)


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
