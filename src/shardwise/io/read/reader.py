"""The threaded region reader: each rank's local shards, read straight from safetensors files.

:func:`plan_reads` (pure) names each tensor's file entry, the rank's regions and where each
lands in the local shard; :class:`RegionReader` reads those boxes on a thread pool through one
shared read handle per file, cut into dim-0 pieces of at most ``piece_bytes``, with at most
``window_bytes`` of raw bytes not yet finalized. A one-region box may instead become a view of
the page cache, and a column slice is copied out of a mapping (``mapped``). A tensor made of
boxes of several stored tensors (:class:`~shardwise.core.pieces.Composite`: a hub layout, a
sharded checkpoint's chunks) is read as :func:`piece_items` and put together by :class:`Assembly`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from shardwise.core.header import FileHeader, TensorEntry
from shardwise.core.pieces import Composite, Piece, piece_reads
from shardwise.core.quant_layout import scale_layout, scale_local_shape
from shardwise.core.spec import Layout, Region, ShardSpec, local_layout, local_shape
from shardwise.errors import UsageError
from shardwise.io.read.mapped import contiguous_span, copy_mapped, copy_same, read_region, view_box
from shardwise.io.source import Want
from shardwise.io.staging import loaded_dtype
from shardwise.io.storage import Handles, Location

PIECE_BYTES = 32 << 20
WINDOW_BYTES = 256 << 20


@dataclass(frozen=True)
class ReadItem:
    """One tensor to read: the file and entry it comes from, and this rank's layout in it."""

    name: str
    path: Location
    entry: TensorEntry
    layout: Layout
    local_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the local tensor in the file's dtype (= bytes of its regions)."""
        return math.prod(self.local_shape) * self.entry.itemsize


def plan_reads(sources: Mapping[str, tuple[Location, TensorEntry]], specs: Mapping[str, ShardSpec],
               degree: int, rank: int) -> list[ReadItem]:
    """The reads that give rank ``rank`` of ``degree`` its local shard of every tensor in
    ``sources`` (``{name: (file, entry)}``), sharded as ``specs[name]``. Pure."""
    items = []
    for name, (path, entry) in sources.items():
        spec = specs[name]
        items.append(ReadItem(name, path, entry, local_layout(entry.shape, spec, degree, rank),
                              local_shape(entry.shape, spec, degree)))
    return items


def want_layout(shape: tuple[int, ...], want: Want) -> tuple[tuple[int, ...], Layout]:
    """The local shape and layout of the wanted tensor of canonical ``shape``: split by its
    spec, or for a scale tensor, the scales of every block its weight shard touches."""
    at = (want.spec, want.degree, want.rank)
    if want.tie is None:
        return local_shape(shape, want.spec, want.degree), local_layout(shape, *at)
    return scale_local_shape(want.tie, *at), scale_layout(want.tie, *at)


def piece_items(name: str, comp: Composite, layout: Layout) -> list[tuple[ReadItem, tuple[slice, ...]]]:
    """The reads giving the local tensor of ``layout`` of the tensor ``comp`` assembles: one
    :class:`ReadItem` (``name#i``) per overlap of a region with a piece, and where its box lands
    in the local tensor. Only the pieces a region overlaps are read. Pure."""
    out = []
    for i, (piece, src, off) in enumerate(piece_reads(layout, comp.pieces)):
        path, entry = comp.stored[piece.key]
        item = ReadItem(f"{name}#{i}", path, entry, [(src, (0,) * len(src.sizes))], src.sizes)
        out.append((item, Piece(piece.key, src, off, piece.stacked).box().slices()))
    return out


class Assembly:
    """Local tensors put together from several reads, thread-safe. :meth:`add` names the reads
    of one tensor and where each box lands in it (``None``: the read is the whole tensor);
    :meth:`take` copies a read box into place and returns ``(key, tensor)`` once its last box
    is in, else None. A tensor with no reads is in :attr:`empty` at once."""

    def __init__(self) -> None:
        self.items: list[ReadItem] = []
        self.parts: dict[str, tuple[Any, tuple[slice, ...] | None]] = {}  # item name -> (key, where)
        self.empty: dict[Any, torch.Tensor] = {}
        self._pending: dict[Any, list] = {}  # key -> [buffer or None, reads left, shape, dtype]
        self._lock = threading.Lock()

    def add(self, key, shape: tuple[int, ...], dtype: torch.dtype,
            reads: Sequence[tuple[ReadItem, tuple[slice, ...] | None]]) -> None:
        if not reads:
            self.empty[key] = torch.empty(shape, dtype=dtype)
            return
        self._pending[key] = [None, len(reads), shape, dtype]
        for item, where in reads:
            self.items.append(item)
            self.parts[item.name] = (key, where)

    def take(self, item: ReadItem, raw: torch.Tensor) -> tuple[Any, torch.Tensor] | None:
        key, where = self.parts[item.name]
        with self._lock:
            state = self._pending[key]
            if where is None:
                state[0] = raw
            elif state[0] is None:
                state[0] = torch.empty(state[2], dtype=state[3])
            buf = state[0]
        if where is not None:
            buf[where].copy_(raw.view(buf[where].shape))  # boxes are disjoint: no lock needed
        with self._lock:
            state[1] -= 1
            if state[1]:
                return None
            del self._pending[key]
        return key, buf


def read_composite_box(handles: Handles, headers: Mapping[Location, FileHeader], comp: Composite,
                       box: Region) -> torch.Tensor:
    """The ``box`` of the tensor ``comp`` assembles, read from the pieces it overlaps (straight
    into place where that is contiguous and of the piece's dtype)."""
    out = torch.empty(box.sizes, dtype=comp.entry.torch_dtype)
    for item, where in piece_items("box", comp, [(box, (0,) * len(box.sizes))]):
        dest = out[where]
        dtype = item.entry.torch_dtype
        direct = dest.is_contiguous() and dest.dtype == dtype
        buf = dest.view(item.local_shape) if direct else torch.empty(item.local_shape, dtype=dtype)
        (src, _), = item.layout
        read_region(handles.get(item.path), headers[item.path], item.entry, src.offsets, src.sizes, buf)
        if not direct:
            copy_same(dest, buf.view(dest.shape))
    return out


def _pieces(item: ReadItem, piece_bytes: int) -> Iterator[tuple[Region, tuple[int, ...]]]:
    """Each region of ``item`` cut along dim 0 into boxes whose rows span at most ``piece_bytes``
    of the file (at least one row), with the box's offset in the local tensor. A row counts
    whole even where the box takes part of it: a column slice is copied out of a mapping of
    the rows it spans."""
    for region, off in item.layout:
        if region.numel == 0:
            continue
        if not region.sizes:
            yield region, off
            continue
        row = math.prod(item.entry.shape[1:]) * item.entry.itemsize
        step = max(1, piece_bytes // max(row, 1))
        for start in range(0, region.sizes[0], step):
            n = min(step, region.sizes[0] - start)
            yield (Region((region.offsets[0] + start,) + region.offsets[1:], (n,) + region.sizes[1:]),
                   (off[0] + start,) + tuple(off[1:]))


class _Window:
    """A byte budget for raw buffers between allocation and finalize."""

    def __init__(self, limit: int):
        self.limit, self.used, self.failed = limit, 0, False
        self._cond = threading.Condition()

    def acquire(self, n: int, held: int = 0) -> None:
        """Take ``n`` bytes for the next piece of an item that holds ``held`` bytes already;
        waits only while earlier items (all queued, so their bytes come back) hold bytes. An
        item alone may go over the budget."""
        with self._cond:
            while self.used > held and self.used + n > self.limit and not self.failed:
                self._cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self.failed = True
            self._cond.notify_all()


class _Job:
    def __init__(self, item: ReadItem, remaining: int):
        self.item = item
        self.raw: torch.Tensor | None = torch.empty(item.local_shape, dtype=item.entry.torch_dtype)
        self.remaining = remaining
        self.lock = threading.Lock()


T = TypeVar("T")
# what a read gives for each item, from the item and its raw local shard
Finalize = Callable[[ReadItem, torch.Tensor], T]


def cpu_views(device: torch.device, dtype: torch.dtype | None) -> Callable[[ReadItem], bool] | None:
    """The ``viewable`` predicate of a load onto ``device`` casting floating tensors to
    ``dtype``: on the CPU, an item the load will not cast may stay a view of the page cache."""
    if device.type != "cpu":
        return None

    def viewable(item: ReadItem) -> bool:
        stored = item.entry.torch_dtype
        return loaded_dtype(stored, dtype) == stored

    return viewable


class RegionReader:
    """Reads :class:`ReadItem`s with a pool of threads; a context manager owning the read
    handles (of the headers' locations, through their storages).

    >>> with RegionReader(ckpt.headers, num_threads=4) as reader:          # doctest: +SKIP
    ...     tensors = reader.read(items, finalize=lambda item, raw: raw)
    >>> reader.bytes_read                                                   # doctest: +SKIP
    """

    def __init__(self, headers: Mapping[Location, FileHeader], *, num_threads: int,
                 piece_bytes: int = PIECE_BYTES, window_bytes: int = WINDOW_BYTES,
                 on_bytes: Callable[[int], None] | None = None,
                 viewable: Callable[[ReadItem], bool] | None = None, strided_views: bool = False):
        if not (isinstance(num_threads, int) and not isinstance(num_threads, bool) and num_threads >= 1):
            raise UsageError(f"num_threads must be a positive int (the reader threads), got {num_threads!r}; "
                             "pass num_threads=None to sw.load for its default")
        self.headers = headers
        self.num_threads = num_threads
        self.piece_bytes = piece_bytes
        self.window_bytes = window_bytes
        self.on_bytes = on_bytes
        self.viewable = viewable
        # A column slice viewed in place costs no copy and no memory of the process's own,
        # but it is a non-contiguous parameter (FSDP's fully_shard refuses it, .view() fails,
        # torch.save writes the span, other ranks' columns included), so sw.load copies:
        # the strided copy out of a mapping runs at ~3.5 GB/s here, a few % of a load.
        self.strided_views = strided_views
        self.bytes_read = 0
        self._handles = Handles()
        self._lock = threading.Lock()

    def __enter__(self) -> RegionReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._handles.close()

    def read(self, items: list[ReadItem], *, finalize: Finalize[T]) -> dict[str, T]:
        """``{name: finalize(item, raw local shard)}`` for every item."""
        results: dict[str, T] = {}
        window = _Window(self.window_bytes)
        pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="shardwise-read")
        futures = []
        try:
            for item in items:
                view = self._view(item)
                if view is not None:
                    results[item.name] = finalize(item, view)
                    continue
                pieces = list(_pieces(item, self.piece_bytes))
                if not pieces:  # an empty tensor: nothing to read
                    self._finish(_Job(item, 0), results, finalize, window)
                job, held = None, 0
                for region, off in pieces:
                    n = region.numel * item.entry.itemsize
                    window.acquire(n, held)
                    if window.failed:
                        break
                    held += n
                    if job is None:
                        job = _Job(item, len(pieces))
                    futures.append(pool.submit(self._piece, job, region, off, results, finalize, window))
                if window.failed:
                    break
            for f in futures:
                f.result()  # the first worker error, if any, raises here
        finally:  # on an error, pieces not yet started are dropped
            pool.shutdown(wait=True, cancel_futures=True)
        return results

    def _view(self, item: ReadItem) -> torch.Tensor | None:
        """The item as a view of the page cache, when allowed and it has one region
        (contiguous, or any box with ``strided_views``)."""
        if self.viewable is None or len(item.layout) != 1 or not self.viewable(item):
            return None
        region = item.layout[0][0]
        if region.numel == 0:
            return None
        view = view_box(self._handles.get(item.path), self.headers[item.path], item.entry, region,
                        strided=self.strided_views)
        if view is not None:
            self._count(item.nbytes)
        return view

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
        if self.on_bytes is not None:
            self.on_bytes(n)

    def _piece(self, job: _Job, region: Region, off: tuple[int, ...], results, finalize, window) -> None:
        try:
            item = job.item
            raw = job.raw
            assert raw is not None  # freed only by _finish, after the job's last piece
            dest = raw[tuple(slice(o, o + s) for o, s in zip(off, region.sizes, strict=True))]
            handle, header = self._handles.get(item.path), self.headers[item.path]
            n = 0
            if region.sizes and contiguous_span(item.entry, region) is None:
                # Many short runs (a column slice): one strided copy out of a mapping of the
                # rows, not one pread per row. 0 = misaligned data, read below instead.
                n = copy_mapped(handle, header, item.entry, region, dest)
            if n == 0:
                # pread needs contiguous memory; a packed dim-1 slot is strided, so read aside.
                out = dest if dest.is_contiguous() else torch.empty(region.sizes, dtype=dest.dtype)
                n = read_region(handle, header, item.entry, region.offsets, region.sizes, out)
                if out is not dest:
                    copy_same(dest, out)
            self._count(n)
            with job.lock:
                job.remaining -= 1
                last = job.remaining == 0
            if last:
                self._finish(job, results, finalize, window)
        except BaseException:
            window.fail()
            raise

    @staticmethod
    def _finish(job: _Job, results, finalize: Finalize[Any], window: _Window) -> None:
        raw, job.raw = job.raw, None
        assert raw is not None  # a job finishes once, at its last piece
        results[job.item.name] = finalize(job.item, raw)
        window.release(job.item.nbytes)


__all__ = ["Assembly", "PIECE_BYTES", "ReadItem", "RegionReader", "WINDOW_BYTES", "cpu_views", "piece_items",
           "plan_reads", "read_composite_box", "want_layout"]
