"""What every remote client shares, whatever talks to the store (obstore for ``s3://`` and
``gs://`` in ``objects``, fsspec for the other URLs in ``fsspec``): requests retried with bounded
backoff (:func:`retried`), and reads of one object (:class:`RemoteFile`: opened at the length
and version its HEAD gave; ranged requests coalesced by :func:`coalesce`, ``concurrency`` in
flight, each body landed as it arrives). A client serves the one request a read needs,
``get_range``; the save transaction's journal is ``publish``'s. This module imports no client.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage.faults import in_words

PART_SIZE = 8 << 20     # bytes per ranged GET (and per multipart part)
CONCURRENCY = 16        # requests in flight per storage
RETRIES = 6             # attempts of one request beyond the client's own retries
WASTE = 1 / 20          # a coalesced request reads at most this much more than asked
CHUNK = 1 << 20         # a body is landed in chunks of at least this many bytes as it arrives


class ShortBody(Exception):
    """A body shorter or longer than the range asked for: retried, never used."""


def retried(request, what: str, *, retries: int, scrub, is_final, fatal: tuple = (),
            name_final: bool = False):
    """``request()``, retried with jittered backoff (``retries`` more times) on every fault but
    ``fatal`` and shardwise's errors (raised as they are) and those ``is_final`` (one
    ``CheckpointError`` naming ``what``, and the fault's type where ``name_final``); then one
    ``CheckpointError`` naming ``what`` and the last fault, ``scrub``bed."""
    last: object = None
    for attempt in range(retries + 1):
        try:
            return request()
        except fatal:
            raise
        except (CheckpointError, UsageError):
            raise
        except ShortBody as e:
            last = e
        except Exception as e:  # a reset, a timeout, a 5xx, ... or an answer that waiting does not change
            if is_final(e):
                raise in_words(e, what + (f": {type(e).__name__}" if name_final else ""), scrub) from None
            last = e
        if attempt < retries:
            time.sleep(min(2.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))
    raise in_words(last, f"{what}: failed {retries + 1} times, the last", scrub) from None


class Client(Protocol):
    """What :class:`RemoteFile` asks of its client: ``part_size``, a ``pool`` of ``concurrency``
    threads, ``url`` and ``get_range``."""

    part_size: int
    pool: Any

    def url(self, bucket: str, key: str) -> str: ...

    def get_range(self, file: RemoteFile, start: int, end: int,
                  land: Callable[[int, memoryview], None]) -> None:
        """Hand bytes ``[start, end)`` of the opened ``file`` (of its version, ``file.etag``,
        where the store has versions) to ``land(offset in the range, chunk)`` as they arrive;
        retried whole (every byte landed again); a replaced object or a body of the wrong
        length is an error."""


class RemoteFile:
    """One object opened for reading at the length and version (ETag) its HEAD gave, through
    its ``storage`` (a :class:`Client`)."""

    def __init__(self, storage: Client, bucket: str, key: str, size: int, etag: str | None):
        self.storage, self.bucket, self.key = storage, bucket, key
        self.name = storage.url(bucket, key)
        self._size, self.etag = int(size), etag

    def size(self) -> int:
        return self._size  # an object does not change length in place; a GET sees a replacement

    def _check(self, start: int, end: int) -> None:
        if start < 0 or end > self._size:
            raise CheckpointError(f"{self.name}: the object ends at byte {self._size}, short of "
                                  f"[{start}, {end}); it is truncated")

    def readinto(self, buf: memoryview, pos: int) -> None:
        self._check(pos, pos + len(buf))
        step = self.storage.part_size
        self._run([(pos + a, pos + min(a + step, len(buf)), [(0, a, 0, min(step, len(buf) - a))])
                   for a in range(0, len(buf), step)], buf)

    def read_runs(self, buf: memoryview, base: int, runs: Sequence[tuple[int, int]]) -> int:
        requests, dest = [], 0
        for start, end, parts in coalesce([(base + o, n) for o, n in runs], self.storage.part_size):
            self._check(start, end)
            placed = []
            for offset, n in parts:
                placed.append((0, dest, offset - start, n))
                dest += n
            requests.append((start, end, placed))
        assert dest == len(buf), (dest, len(buf))
        self._run(requests, buf)
        return dest

    def _run(self, requests, buf: memoryview) -> None:
        """Fetch each ``(start, end, [(0, buf offset, offset in the body, length)])``, many at once."""
        whole = [(0, buf)]
        if len(requests) == 1:
            self._land(requests[0], whole, _ignore)
            return
        for future in [self.storage.pool.submit(self._land, r, whole, _ignore) for r in requests]:
            future.result()

    def run_requests(self, runs: Sequence[tuple[int, memoryview]], done,
                     part_size: int | None = None) -> list:
        """The requests that fill each ``(offset in the object, destination)`` run, as
        callables to run on any thread: neighbouring runs (of several tensors) merged into
        requests of at most the storage's ``part_size`` (or a smaller ``part_size``: bytes
        wanted soon, spread over more requests in flight) that read nothing between them, a
        longer run split. Each request, once its body is landed, calls ``done(index of the run,
        bytes)`` for every part of a run it filled. Runs must not overlap."""
        order = sorted((off, i) for i, (off, view) in enumerate(runs) if len(view))
        out, j = [], 0
        sizes = [(off, len(runs[i][1])) for off, i in order]
        step = min(self.storage.part_size, part_size or self.storage.part_size)
        for start, end, parts in coalesce(sizes, step, waste=0.0):
            self._check(start, end)
            placed = []
            for offset, n in parts:
                while order[j][0] + len(runs[order[j][1]][1]) <= offset:
                    j += 1
                placed.append((order[j][1], offset - order[j][0], offset - start, n))
            out.append(lambda r=(start, end, placed): self._land(r, runs, done))
        return out

    def _land(self, request, runs, done) -> None:
        start, end, placed = request

        def land(offset: int, chunk: memoryview) -> None:  # the runs' parts the chunk covers
            for i, at, inner, n in placed:
                lo, hi = max(inner, offset), min(inner + n, offset + len(chunk))
                if lo < hi:
                    runs[i][1][at + lo - inner:at + hi - inner] = chunk[lo - offset:hi - offset]

        self.storage.get_range(self, start, end, land)
        for i, _, _, n in placed:
            done(i, n)

    def map_whole(self):
        return None

    def map_range(self, start: int, length: int):
        return None

    def close(self) -> None:
        pass


def _ignore(*_) -> None:
    pass


def coalesce(runs: Sequence[tuple[int, int]], part_size: int, *,
             waste: float = WASTE) -> Iterator[tuple[int, int, list]]:
    """``(start, end, [(offset, length)])`` requests covering the absolute ``runs`` in order:
    neighbours merged while the request stays within ``part_size`` and reads at most ``waste``
    more than its runs (a rowwise slice's every-other runs stay apart); a run that does not fit
    fills the request to ``part_size`` and goes on in the next (requests are whole parts)."""
    start = end = useful = 0
    parts: list[tuple[int, int]] = []
    for offset, length in runs:
        while length > 0:
            room = part_size - (offset - start)
            n = min(length, room)
            if parts and offset >= end and room > 0 and offset - start - useful <= waste * (useful + n):
                parts.append((offset, n))
                useful += n
            else:
                if parts:
                    yield start, end, parts
                n = min(length, part_size)
                start, useful, parts = offset, n, [(offset, n)]
            end = offset + n
            offset, length = offset + n, length - n
    if parts:
        yield start, end, parts


__all__ = ["CHUNK", "CONCURRENCY", "PART_SIZE", "RETRIES", "Client", "RemoteFile", "ShortBody", "coalesce",
           "retried"]
