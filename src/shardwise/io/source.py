"""The seam between the tools and a checkpoint format: :class:`Source` (what ``sw.load`` asks)
and :class:`Stored` (what the offline tools ask), which each format plugin's ``open_source``
returns as one object."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan
from shardwise.core.quant_layout import QuantTie
from shardwise.core.spec import Region, ShardSpec
from shardwise.io.storage import Location

if TYPE_CHECKING:
    from shardwise.backends import Backend
    from shardwise.mesh import MeshDims

# (request key, raw local tensor) -> what the load keeps (None: the placement kept it itself)
Finalize = Callable[[str, torch.Tensor], Any]


@dataclass(frozen=True)
class Want:
    """One local tensor a load needs: part ``rank`` of ``degree`` of model tensor ``name`` split
    by ``spec``; with a ``tie``, the scales of that block-quantized weight, split along with it
    (a source that cannot read them refuses the tie)."""

    name: str
    spec: ShardSpec
    degree: int
    rank: int
    tie: QuantTie | None = None


class ReadMode(Enum):
    """Who reads a region of a load: each rank its own (``OWN``), one dp replica for all
    (``REPLICAS``), or the job each byte once, exchanged (``JOB``: a storage fetched once).
    The load pipeline decides it once (``io.read.modes.read_mode``)."""

    OWN = "own"
    REPLICAS = "replicas"
    JOB = "job"


@dataclass(frozen=True)
class ReadOptions:
    """How a source reads: floating tensors cast to ``dtype``; ``device`` where finalized tensors
    go (None: the host); ``mode``: who reads each region (``io.read.modes.read_items`` runs it);
    ``backend``: the one collectives wait in; ``window``: bytes per collective batch (DCP),
    None for one batch; ``mesh``: the decoded mesh the shared modes read over."""

    dtype: torch.dtype | None
    device: torch.device | None
    num_threads: int
    mode: ReadMode = ReadMode.OWN
    window: int | None = None
    backend: Backend | None = None
    mesh: MeshDims | None = None


@dataclass(frozen=True)
class Reads:
    """A source's plan of this rank's reads: ``nbytes`` (the progress total) and the format's
    own ``detail``, read only by the source that made it."""

    wants: Mapping[str, Want]
    nbytes: int
    detail: Any = None


@dataclass(frozen=True)
class Description:
    """How a checkpoint is stored (``inspect``, ``verify``): ``kind`` (one line), ``files``
    (relative to the root), header ``metadata``, the recorded ``layout`` (``shardwise.json``, or
    None), ``values`` (non-tensor entries), ``chunks`` (``{tensor: stored chunks}``, None for
    whole tensors), ``problems`` (faults that do not stop reading, such as a stale index)."""

    kind: str
    files: tuple[str, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)
    layout: Mapping[str, Any] | None = None
    values: tuple[str, ...] = ()
    chunks: Mapping[str, int] | None = None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Blob:
    """The ``nbytes`` stored bytes of one tensor (``key`` None) or one chunk of it (``key``: its
    ``info.chunk_key``). ``digest(algorithm)`` reads them (``CheckpointError`` when it cannot)
    and returns ``(digest, the format's own checksum of them or None)``; ``own``: the format
    may store such a checksum (DCP's zip CRC-32), so the blob is worth reading anyway."""

    tensor: str
    key: str | None
    nbytes: int
    digest: Callable[[str], tuple[str, str | None]]
    own: bool = False


class Stored(Protocol):
    """What the offline tools (one process, no collective) ask of a checkpoint: ``tensors``,
    ``describe``, ``blobs``, ``read_box`` in any order, then ``close``. ``root``: the folder
    (with its side files); ``name``: the format's registry name."""

    name: str
    root: Location

    def tensors(self) -> Mapping[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every stored tensor: name -> (dtype, global shape), in consolidation order."""

    def read_box(self, name: str, box: Region) -> torch.Tensor:
        """The ``box`` of stored tensor ``name``, on the CPU in its stored dtype, read from only
        the bytes that hold it."""

    def describe(self) -> Description:
        """How the checkpoint is stored (reads headers and metadata only)."""

    def blobs(self) -> Iterator[Blob]:
        """Every stored tensor's bytes, as stored (whole tensors or chunks), in file order."""

    def use_module_names(self, wanted: set[str]) -> None:
        """From now on, show the tensors of ``wanted`` (module names) that the checkpoint stores
        in a hub layout in place of the stored tensors they are built from (else: nothing)."""

    def close(self) -> None:
        """Release the files ``read_box`` and ``blobs`` opened."""


class Source(Protocol):
    """What ``sw.load`` asks of a checkpoint: every rank calls ``match``, ``plan``, ``read``, once
    each, in order (``read`` may run collectives). ``bytes_read``: tensor bytes this rank read."""

    name: str
    root: Location
    bytes_read: int

    def match(self, model: nn.Module, specs: ResolvedPlan, *, strict: bool) -> tuple[list[str], list[str]]:
        """``(missing, unexpected)`` keys; raises ``CheckpointError`` for a shape or dtype that
        disagrees with the model and, when ``strict``, for missing keys."""

    def plan(self, wants: Mapping[str, Want]) -> Reads:
        """The reads giving each wanted local tensor (names among the matched ones). Pure."""

    def read(self, reads: Reads, *, finalize: Finalize, options: ReadOptions,
             on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
        """``{key: finalize(key, local tensor)}`` for every key of ``reads.wants``."""


class OpenedSource(Source, Stored, Protocol):
    """What a format plugin's ``open_source`` returns: a :class:`Source` and a :class:`Stored`."""


__all__ = ["Blob", "Description", "Finalize", "OpenedSource", "ReadMode", "ReadOptions", "Reads", "Source",
           "Stored", "Want"]
