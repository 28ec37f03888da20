"""The seam between the tools and a checkpoint format: two small protocols, :class:`Source`
(a load) and :class:`Stored` (the offline tools), which each format's source implements.

Every format is a plugin under ``shardwise.io.formats`` (``safetensors``: files, indexes, hub
layouts, FP8/MXFP4 variants; ``sharded``: rank-local sharded safetensors; ``dcp``: torch DCP,
read through torch's own planner and reader); ``shardwise.io.formats.open_source`` picks the
one that claims a path. ``sw.load`` (``shardwise.io.load``) is one pipeline over it: guards ->
plan -> ``open_source`` -> ``match`` -> ``plan`` -> ``read`` -> place (``shardwise.io.place``).
``consolidate``, ``verify``, ``diff`` and ``inspect`` use the same object as a Stored: ``tensors()`` lists
what is stored, ``read_box`` reads any box of a stored tensor, ``describe`` and ``blobs`` say
how it is stored and give its bytes to checksum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
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
    ``replicas``: the decoded mesh where dp replicas share their reads (``MeshDims.shares_reads``,
    ``io.replicas``), else None; ``backend`` the one collectives wait in (the decoded mesh's
    ``comm_backend``); ``window``: bytes per batch for a format that reads in collective
    batches (DCP), None for one batch; ``mesh`` the decoded mesh, for a source over a storage
    that reads once per job (``io.exchange.exchanges``)."""

    dtype: torch.dtype | None
    device: torch.device | None
    num_threads: int
    replicas: MeshDims | None = None
    window: int | None = None
    backend: Backend | None = None
    mesh: MeshDims | None = None


@dataclass(frozen=True)
class Reads:
    """A source's plan of this rank's reads: ``nbytes`` to read (the progress total) and the
    format's own ``detail``. Only the source that made it reads it."""

    wants: Mapping[str, Want]
    nbytes: int
    detail: Any = None


@dataclass(frozen=True)
class Description:
    """How a checkpoint is stored, for ``inspect`` and ``verify``: ``kind`` (one line),
    ``files`` (names relative to the root), header ``metadata``, the ``layout`` shardwise
    recorded (``shardwise.json``, or None), ``values`` (names of stored non-tensor entries),
    ``chunks`` (``{tensor: number of stored chunks}``, None for a format that stores whole
    tensors) and ``problems`` (structural faults that do not stop reading, such as a stale
    index)."""

    kind: str
    files: tuple[str, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)
    layout: Mapping[str, Any] | None = None
    values: tuple[str, ...] = ()
    chunks: Mapping[str, int] | None = None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Blob:
    """The stored bytes of one tensor (``key`` None) or one chunk of it (``key``: its
    ``info.chunk_key``), ``nbytes`` long. ``digest(algorithm)`` reads them and returns
    ``(digest, own)``: ``own`` is the checksum the format itself stores for them (DCP's zip
    CRC-32), or None; it raises ``CheckpointError`` for a blob that cannot be read. ``own``
    (the field): the format may store such a checksum, so the blob is worth reading even
    where shardwise recorded none."""

    tensor: str
    key: str | None
    nbytes: int
    digest: Callable[[str], tuple[str, str | None]]
    own: bool = False


class Stored(Protocol):
    """What the offline tools (``consolidate``, ``verify``, ``diff``, ``inspect``: one process,
    no collective) ask of a checkpoint: ``tensors``, ``describe``, ``blobs`` and ``read_box`` in
    any order, then ``close``. ``root`` is the folder holding the checkpoint (its
    ``config.json`` and side files); ``name`` is the registry's name of the format."""

    name: str
    root: Location

    def tensors(self) -> Mapping[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every stored tensor: name -> (dtype, global shape), in the order a consolidation
        writes them."""
        ...

    def read_box(self, name: str, box: Region) -> torch.Tensor:
        """The ``box`` of stored tensor ``name`` (a name of ``tensors()``), on the CPU in its
        stored dtype, read from only the stored bytes that hold it. One process, no collective."""
        ...

    def describe(self) -> Description:
        """How the checkpoint is stored (reads headers and metadata only)."""
        ...

    def blobs(self) -> Iterator[Blob]:
        """Every stored tensor's bytes, as stored (whole tensors or chunks), in file order."""
        ...

    def use_module_names(self, wanted: set[str]) -> None:
        """From now on, ``tensors()`` and ``read_box`` show the tensors of ``wanted`` (module
        names) that the checkpoint stores in a transformers hub layout, in place of the stored
        tensors they are built from; a format that stores module names does nothing."""
        ...

    def close(self) -> None:
        """Release the files ``read_box`` and ``blobs`` opened."""
        ...


class Source(Protocol):
    """What ``sw.load`` asks of a checkpoint: every rank calls, in order, ``match`` once, ``plan``
    once, ``read`` once (``read`` may run collectives: DCP always, safetensors with dp
    replicas or over a storage read once per job). ``bytes_read`` counts tensor bytes this rank
    read from storage."""

    name: str
    root: Location
    bytes_read: int

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


class OpenedSource(Source, Stored, Protocol):
    """What a format plugin's ``open_source`` returns: one object that serves both a load
    (:class:`Source`) and the offline tools (:class:`Stored`)."""


__all__ = ["Blob", "Description", "Finalize", "OpenedSource", "ReadOptions", "Reads", "Source", "Stored",
           "Want"]
