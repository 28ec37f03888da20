"""The write side of every format: a :class:`FileSink` turns what is to be written into a frozen,
pure :class:`WritePlan` (files, order, writer rank, index), the same on every rank, then
writes it; :class:`Saving` is the one transaction of every save."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import shardwise.comm as comm
from shardwise.backends import coordination_group
from shardwise.comm import agree, capture
from shardwise.errors import CheckpointError
from shardwise.io.info import write_info
from shardwise.io.storage import Location

if TYPE_CHECKING:
    import torch

    from shardwise.backends import Backend
    from shardwise.core.pieces import StoredPart

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


class FileWriter(Protocol):
    """One file being written, in the order of its plan: :meth:`write` each tensor, then
    :meth:`close` (durable; reports :attr:`checksums` to an enclosing
    ``shardwise.io.info.collect_checksums()``), or :meth:`abort` on a failure (a no-op after
    ``close``)."""

    checksums: dict[str, str]  # tensor -> checksum of its bytes as written

    def write(self, name: str, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


# (location of the new file, its tensors in order, the plan's header metadata) -> its writer
OpenFile = Callable[[Location, Sequence[Spec], Mapping[str, str]], FileWriter]


class FileSink(Protocol):
    """A gathered format's writer, configured once (``plugin.writer(**options)``): :meth:`plan`
    is pure and the same on every rank; then one process opens each planned file with
    :meth:`open_file` and writes its tensors whole, in order; the plan's ``index`` is written
    last by the save's transaction."""

    def plan(self, stored: Sequence[StoredTensor]) -> WritePlan: ...

    def open_file(self, location: Location, tensors: Sequence[Spec],
                  header: Mapping[str, str]) -> FileWriter: ...


def on_rank0(fn: Callable[[], object], what: str, *, backend: Backend | None, share: bool = False,
             digest: bytes = b"\0" * 8):
    """The one "rank 0 does it, every rank learns the outcome": run ``fn`` on global rank 0;
    every rank raises if it failed (``shardwise.comm.agree`` over ``backend``, ``digest`` its
    check that every rank saves the same thing) and, with ``share``, gets its result.
    Collective: every rank calls it at the same point."""
    result = [None]

    def run():
        result[0] = fn()

    agree(backend, capture(run) if comm.rank() == 0 else None, what=what, digest=digest)
    if share:
        result[0] = comm.broadcast_object(result[0], src=0, group=coordination_group(backend), purpose=what)
    return result[0]


class Saving:
    """The one transaction of every save (``sw.save`` of every format, ``sw.consolidate``),
    over the target's storage. Call order, on every rank: construct (rank 0 opens and prepares
    the temporary folder beside ``location``; every rank gets :attr:`folder` or the failure),
    write into :attr:`folder`, then :meth:`commit` (rank 0 writes ``shardwise.json``, the side
    files and the index, and moves the folder into place; every rank learns the outcome);
    :meth:`discard` (or leaving the ``with``) on every path: rank 0 removes what is left, a
    no-op after a commit. ``digest``: every rank's fingerprint of what it saves (they must
    agree). ``collective=False`` (``sw.consolidate``: one process, whatever group it is in):
    this process does every step, with no collective. ``what`` names the save in errors;
    ``{target}`` in it stands for the target's path. ``target``: the save's target as
    ``storage.target_path`` gave it at the API's door (``sw.save``, ``sw.save_optimizer``,
    ``sw.consolidate``), computed there once. ``replaceable``: the file names (patterns) that
    ``overwrite`` may replace, as the formats declare them (``io.formats.checkpoint_files``)."""

    def __init__(self, target: Location, *, overwrite: bool, backend: Backend | None, what: str,
                 replaceable: Sequence[str] = (), digest: bytes = b"\0" * 8, collective: bool = True,
                 every_rank_writes: bool = False):
        self.backend, self.collective = backend, collective
        self.target = target
        self.what = what.replace("{target}", str(self.target))
        self.rank0 = not collective or comm.rank() == 0
        # a rank that writes its own objects may sweep the folder when the save fails, until
        # the commit begins (only then can rank 0 publish): see discard
        self.sweeping = every_rank_writes and collective
        self._dest = (self.target.storage.transaction(self.target, overwrite=overwrite,
                                                      replaceable=tuple(replaceable))
                      if self.rank0 else None)

        def prepare():  # its path: each rank rebuilds the location over its own storage
            self._dest.prepare()
            return self._dest.folder.path

        try:
            self.folder = replace(self.target, path=on_rank0(prepare, f"preparing {what}", backend=backend,
                                                             share=True, digest=digest)
                                  if collective else prepare())
            if every_rank_writes and collective:
                self._check_shared()
        except BaseException:
            self.discard()
            raise

    def _check_shared(self) -> None:
        """Every rank sees rank 0's temporary folder (a local one: object stores are seen by
        all), or every rank raises: ranks on machines that do not share the filesystem would
        otherwise fail on a missing folder, or write where rank 0 cannot commit."""
        if self.folder.scheme is not None or comm.world_size() == 1:
            return
        import socket

        seen = comm.all_gather_object((self.folder.is_folder(), socket.gethostname()),
                                      group=coordination_group(self.backend), purpose=self.what)
        blind = [r for r, (ok, _) in enumerate(seen) if not ok]
        if blind:
            hosts = sorted({seen[r][1] for r in blind})
            raise CheckpointError(
                f"{self.what}: every rank writes its own part, but rank(s) {blind} (on {', '.join(hosts)}) "
                f"cannot see the folder rank 0 (on {seen[0][1]}) made at {self.folder}: the ranks do not "
                "share this filesystem. Save to a folder every machine mounts (a shared filesystem), to "
                "object storage (s3://, gs://), or with distributed=False (rank 0 writes); nothing was saved")

    def commit(self, *, info: dict | None = None, side_files: Callable[[Location], object] | None = None,
               index: tuple[str, dict] | None = None) -> None:
        """Collective: rank 0 completes the folder (``info`` as ``shardwise.json``,
        ``side_files(folder)``, the ``index`` last) and moves it into place."""
        def commit():
            if info is not None:
                write_info(self.folder, info)
            if side_files is not None:
                side_files(self.folder)
            self._dest.commit(index)

        if self.collective:
            on_rank0(commit, f"moving {self.what} into place", backend=self.backend)
        else:
            commit()

    def discard(self) -> None:
        if self._dest is not None:
            self._dest.discard()
        elif self.sweeping and getattr(self, "folder", None) is not None:
            self.sweeping = False  # once: best effort, rank 0 removes the rest if it can
            sweep = getattr(self.target.storage.transaction(self.target, overwrite=True), "sweep", None)
            if sweep is not None:  # an object store: a survivor deletes what was written (and its own
                with contextlib.suppress(Exception):  # last objects, landed after rank 0's discard)
                    sweep(self.folder)

    def __enter__(self) -> Saving:
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


__all__ = ["FileSink", "FileWriter", "OpenFile", "PlannedFile", "Saving", "Spec", "StoredTensor", "WritePlan",
           "on_rank0"]
