"""The write side of every format: a :class:`Sink` turns what is to be written into a frozen
:class:`WritePlan` (which tensor goes to which file, in which order, which rank writes it, the
index), then writes it.

Plan, then execute: ``plan`` is pure and gives the same answer on every rank, so the ranks
agree on the files without exchanging them; ``write`` does the I/O and the collectives. The
implementations: ``shardwise.io.safetensors.sink`` (the plan-files / sort / index recipe of
every ordinary safetensors checkpoint, and its rank-0 stream, with the parallel write in
``shardwise.io.parallel_save``) and ``shardwise.io.dcp.sharded_write`` (rank-local sharded
safetensors files). torch's own DCP writer (``distributed=True``, ``format="distcp"``) keeps
its ``StorageWriter`` protocol and its planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from shardwise.core.pieces import StoredPart
    from shardwise.io.storage import Location

# (tensor name, safetensors dtype, shape) of one tensor of a file, as its header lists it
Spec = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True)
class StoredTensor:
    """One tensor a save writes: its name, dtype and canonical shape, and, in the hub layout,
    the boxes of model tensors it is assembled from (``part``; None: the model tensor itself).

    >>> StoredTensor("lm_head.weight", "BF16", (32, 16))
    StoredTensor(name='lm_head.weight', dtype='BF16', shape=(32, 16))
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    part: StoredPart | None = field(default=None, repr=False)

    @property
    def spec(self) -> Spec:
        """``(name, dtype, shape)``, as a file's header lists it."""
        return self.name, self.dtype, self.shape


@dataclass(frozen=True)
class PlannedFile:
    """One file of a plan: its ``tensors`` in the order they are written, and the ``rank`` that
    writes it. ``offsets`` (sharded files only, one per tensor) is where each tensor, a chunk,
    starts in its canonical tensor; empty when the file holds whole tensors."""

    name: str
    tensors: tuple[Spec, ...]
    rank: int = 0
    offsets: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        assert not self.offsets or len(self.offsets) == len(self.tensors), (self.name, self.offsets)


@dataclass(frozen=True)
class WritePlan:
    """Everything a sink writes, decided before any byte is: the ``files``; the ``header``
    metadata (``__metadata__`` of every safetensors header); the ``index`` ``(file name,
    content)`` written last, or None; ``parts``, ``{stored name: StoredPart}`` for the stored
    tensors that are boxes of model tensors (the hub layout)."""

    files: tuple[PlannedFile, ...]
    header: Mapping[str, str] = field(default_factory=dict)
    index: tuple[str, dict] | None = field(default=None, repr=False)  # the content goes to json.dumps
    parts: Mapping[str, StoredPart] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return (f"WritePlan({len(self.files)} files, {sum(len(f.tensors) for f in self.files)} tensors, "
                f"index={self.index[0] if self.index else None!r})")

    @property
    def tensors(self) -> tuple[Spec, ...]:
        """Every tensor of every file, file by file."""
        return tuple(spec for f in self.files for spec in f.tensors)

    def files_of(self, rank: int) -> tuple[PlannedFile, ...]:
        """The files ``rank`` writes."""
        return tuple(f for f in self.files if f.rank == rank)


class Sink(Protocol):
    """Where a save's tensors go, in one format.

    Call order: every rank calls :meth:`plan` with the same ``items`` (pure, so every rank
    holds the same plan without a collective), then every rank calls :meth:`write` once with
    that plan (collective: a failure on any rank raises on every rank). ``folder`` is the
    save's temporary folder where the rank writes (None on a rank that writes nothing);
    moving it into place is the caller's (``shardwise.io.storage.Transaction``).
    """

    def plan(self, items) -> WritePlan:
        """The files, their order and the index for ``items``; raises before anything is
        written when they cannot be written."""
        ...

    def write(self, plan: WritePlan, folder: Location | None, bar) -> dict:
        """Write ``plan``'s files into ``folder``; return the checksums of what was written
        (as ``shardwise.json`` records them)."""
        ...


__all__ = ["PlannedFile", "Sink", "Spec", "StoredTensor", "WritePlan"]
