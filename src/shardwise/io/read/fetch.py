"""The requests of a load from a storage read once per job (``io.exchange``): byte runs
landed straight into tensors (a direct item's regions, a slab's pieces), queued in order on a
pool of threads, neighbouring runs of one object merged into one request by the handle
(``RemoteFile.run_requests``; a plain ``readinto`` per run on a handle without it)."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shardwise.core.spec import Region
from shardwise.io.read.mapped import contiguous_span
from shardwise.io.read.reader import ReadItem
from shardwise.io.storage import Handles, byte_view

Key = tuple[str, str]  # a stored tensor: (file, tensor name)
SLAB_PART = 256 << 10  # the smallest request a slab is cut into


@dataclass(frozen=True)
class Piece:
    """Rows of a stored tensor that one rank fetches: ``region`` is whole rows of ``tensor``."""

    tensor: Key
    region: Region


def first_error(futures: Sequence[Future]) -> BaseException | None:
    """The first failure among ``futures``, waiting for each."""
    for future in futures:
        e = future.exception()
        if e is not None:
            return e
    return None


class Requests:
    """The load's storage requests (the module's) on ``num_threads`` threads, taken in order of
    ``first`` then submission: requests submitted with ``first=True`` (a round's slab, which the
    exchange waits for) go before any other still queued (the direct reads, queued at the start
    so that the NIC never waits for a round). ``bytes_read`` counts what landed."""

    def __init__(self, files, num_threads: int):
        self.files, self.handles, self.num_threads = files, Handles(), num_threads
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="shardwise-fetch")
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._queue: list[tuple[int, int, Callable[[], object], Future]] = []  # a heap
        self._count = itertools.count()

    def requests(self, runs: Sequence[tuple[str, int, torch.Tensor]], done: Callable[[int], None],
                 part_size: int | None = None) -> list:
        """The requests filling each ``(file, offset in it, contiguous tensor)``; ``done(index)``
        once a run's last byte has landed; ``part_size``: at most that many bytes a request
        (where the handle merges and splits runs)."""
        left = [t.numel() * t.element_size() for _, _, t in runs]
        by_file: dict[str, list[int]] = {}
        for k, (f, _, _) in enumerate(runs):
            by_file.setdefault(f, []).append(k)
        out: list = []
        for f, ks in by_file.items():
            handle = self.handles.get(self.files[f][0])
            views = [(runs[k][1], byte_view(runs[k][2])) for k in ks]

            def landed(i: int, n: int, ks=ks, views=views) -> None:
                with self._lock:
                    self.bytes_read += n
                    left[ks[i]] -= n
                    last = left[ks[i]] == 0
                if last:  # the requests hold the views: let the tensor go once it is whole
                    views[i] = (views[i][0], memoryview(b""))
                    done(ks[i])

            if hasattr(handle, "run_requests"):
                out += handle.run_requests(views, landed, part_size)
            else:
                out += [lambda h=handle, v=v, i=i, f=landed: (h.readinto(v[1], v[0]), f(i, len(v[1])))
                        for i, v in enumerate(views) if len(v[1])]
        return out

    def submit(self, requests: Sequence, first: bool = False) -> list[Future]:
        futures: list[Future] = []
        with self._lock:
            for request in requests:
                futures.append(Future())
                heapq.heappush(self._queue, (0 if first else 1, next(self._count), request, futures[-1]))
        for _ in futures:  # one turn of a thread per request: it runs the first one queued then
            self.pool.submit(self._next)
        return futures

    def _next(self) -> None:
        with self._lock:
            _, _, request, future = heapq.heappop(self._queue)
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(request())
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:  # the requests whose turn was cancelled
            for *_, future in self._queue:
                future.cancel()
            self._queue.clear()
        self.handles.close()


def dests(item: ReadItem) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]] | None:
    """The raw local tensor of a direct ``item`` (allocated here) and where each region lands
    in it, as ``(offset in the tensor's bytes, contiguous slice)``; None where one does not
    land contiguously (a packed dim-1 slot) or is empty."""
    raw = torch.empty(item.local_shape, dtype=item.entry.torch_dtype)
    out = []
    for region, off in item.layout:
        span = contiguous_span(item.entry, region)
        dest = raw[tuple(slice(o, o + n) for o, n in zip(off, region.sizes, strict=True))]
        if span is None or not dest.is_contiguous():
            return None
        out.append((span[0], dest))
    return (raw, out) if out else None


def direct_requests(requests: Requests, items: list[ReadItem], prepared: dict, take, results: dict) -> list:
    """The requests of this rank's direct items (``prepared``: :func:`dests` of each), each
    item finalized (``take``) once its last region has landed."""
    runs, owner = [], []
    for i, (_, dests) in prepared.items():
        item = items[i]
        start = requests.files[str(item.path)][1].data_start + item.entry.start
        for at, dest in dests:
            runs.append((str(item.path), start + at, dest))
            owner.append(i)
    left, lock = Counter(owner), threading.Lock()

    def done(k: int) -> None:
        i = owner[k]
        with lock:
            left[i] -= 1
            last = left[i] == 0
        if last:
            raw, _ = prepared.pop(i)
            results[items[i].name] = take(items[i], raw)

    return requests.requests(runs, done)


def slab_requests(requests: Requests, tensors, fetch: Sequence[Piece]) -> tuple[list[torch.Tensor], list]:
    """This rank's slab (each piece whole rows of one tensor, allocated here) and the futures
    of its requests, queued now: the slab cut into about one request per thread (at least
    ``SLAB_PART``), so that the threads fetch it together and it lands whole before the next
    round's (a slab in one request is one flow among the others on the NIC: every slab queued
    would land at once, at the end, and its exchange after the download)."""
    pieces, runs = [], []
    for p in fetch:
        entry = tensors[p.tensor]
        pieces.append(torch.empty(p.region.sizes, dtype=entry.torch_dtype))
        span = contiguous_span(entry, p.region)
        if span is not None:
            runs.append((p.tensor[0], requests.files[p.tensor[0]][1].data_start + entry.start + span[0],
                         pieces[-1]))
    size = sum(t.numel() * t.element_size() for _, _, t in runs)
    part = max(SLAB_PART, -(-size // max(1, requests.num_threads)))
    return pieces, requests.submit(requests.requests(runs, lambda k: None, part), first=True)


__all__ = ["Requests", "dests", "direct_requests", "first_error", "slab_requests"]
