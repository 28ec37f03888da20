"""The seam between ``sw.load`` and a checkpoint format: a :class:`Source` per format.

``sw.load`` (``shardwise.io.load``) is one pipeline: guards -> plan -> open the source
(``load.open_source``, the format detected once) -> ``match`` -> ``plan`` -> ``read`` ->
place (``shardwise.io.place``). A format only says what it holds, how model tensors map onto
its stored tensors, which bytes give each wanted local tensor, and reads them.
Implementations: ``safetensors_source.SafetensorsSource`` (files and index, hub-layout
composites included), ``hf_dcp_read.ShardedSource`` (rank-local sharded safetensors) and
``dcp.DcpSource`` (torch DCP, through torch's own planner and reader).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan
from shardwise.core.quant_layout import QuantTie
from shardwise.core.spec import ShardSpec

# (request key, raw local tensor) -> what the load keeps (None: the placement kept it itself)
Finalize = Callable[[str, torch.Tensor], Any]


@dataclass(frozen=True)
class Want:
    """One local tensor a load needs: part ``rank`` of ``degree`` of model tensor ``name``
    split by ``spec`` (``core.spec.local_layout`` gives its regions of the stored tensor).
    With a ``tie`` it is the scale tensor of that block-quantized weight, split along with it:
    its regions are ``core.quant_layout.scale_layout``'s (a source that cannot read them
    refuses the tie)."""

    name: str
    spec: ShardSpec
    degree: int
    rank: int
    tie: QuantTie | None = None


@dataclass(frozen=True)
class ReadOptions:
    """How a source reads: floating tensors cast to ``dtype`` (``staging.loaded_dtype``);
    ``device`` where the finalized tensors go (None: the host, the placement moves them);
    ``mesh``: set where dp replicas may share their reads (``io.replicas``); ``window``:
    bytes per batch for a format that reads in collective batches (DCP), None for one batch."""

    dtype: torch.dtype | None
    device: torch.device | None
    num_threads: int
    mesh: Any = None
    window: int | None = None


@dataclass(frozen=True)
class Reads:
    """A source's plan of this rank's reads: ``nbytes`` to read (the progress total) and the
    format's own ``detail``. Only the source that made it reads it."""

    wants: Mapping[str, Want]
    nbytes: int
    detail: Any = None


class Source(Protocol):
    """One checkpoint format. Every rank calls, in order: ``match`` once, ``plan`` once,
    ``read`` once (``read`` may run collectives: DCP always, safetensors with dp replicas).
    ``bytes_read`` counts tensor bytes this rank read from storage."""

    bytes_read: int

    def tensors(self) -> Mapping[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every stored tensor: name -> (dtype, shape)."""
        ...

    def match(self, model: nn.Module, specs: ResolvedPlan, *, strict: bool) -> tuple[list[str], list[str]]:
        """``(missing, unexpected)`` keys; raises ``CheckpointError`` for a shape or dtype that
        disagrees with the model and, when ``strict``, for missing keys."""
        ...

    def plan(self, wants: Mapping[str, Want]) -> Reads:
        """The reads giving each wanted local tensor (names among the matched ones). Pure."""
        ...

    def read(self, reads: Reads, *, finalize: Finalize, options: ReadOptions,
             on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
        """``{key: finalize(key, local tensor)}`` for every key of ``reads.wants``."""
        ...


__all__ = ["Finalize", "ReadOptions", "Reads", "Source", "Want"]
