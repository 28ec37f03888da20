"""Reading an object store's objects: :class:`ObjectFile` (one object opened at the length and
ETag its HEAD gave; ranged GETs, coalesced by :func:`coalesce`, ``concurrency`` in flight, each
body landed as it arrives). The client, its retries and its configuration are
``objects.ObjectStorage``'s; writing is ``objects_write``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from shardwise.errors import CheckpointError

if TYPE_CHECKING:
    from shardwise.io.storage.objects import ObjectStorage

WASTE = 1 / 20          # a coalesced request reads at most this much more than asked
CHUNK = 1 << 20         # a body is landed in chunks of at least this many bytes as it arrives


class ShortBody(Exception):
    """A body shorter or longer than the range asked for: retried, never used."""


class ObjectFile:
    """One object opened for reading at the length and ETag its HEAD gave."""

    def __init__(self, storage: ObjectStorage, bucket: str, key: str, size: int, etag: str | None):
        self.storage, self.bucket, self.key = storage, bucket, key
        self.name = storage.url(bucket, key)
        self._size, self._etag = int(size), etag

    def size(self) -> int:
        return self._size  # an object does not change length in place; a GET sees a replacement

    def fetch(self, start: int, end: int, land) -> None:
        """Hand the bytes ``[start, end)`` of the object, of the opened version, to ``land(offset
        in the range, chunk)`` as they arrive: no whole body is held (16 in flight x 8 MiB would
        be 128 MiB). A failed attempt is retried from the start, landing every byte again."""
        import obstore

        def request():
            result = obstore.get(self.storage.store(self.bucket), self.key, options={"range": (start, end)})
            etag = result.meta.get("e_tag")
            if self._etag and etag and etag.strip('"') != self._etag.strip('"'):
                raise CheckpointError(f"{self.name}: the object was replaced while being read (ETag "
                                      f"{self._etag} when opened, {etag} now); load it again")
            got = 0
            for chunk in result.stream(min_chunk_size=CHUNK):
                land(got, memoryview(chunk))
                got += len(chunk)
            if got != end - start:
                raise ShortBody(f"{got} bytes in the body of a {end - start}-byte range")

        self.storage.call(request, f"GET {self.name} bytes [{start}, {end})")

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

    def run_requests(self, runs: Sequence[tuple[int, memoryview]], done) -> list:
        """The requests that fill each ``(offset in the object, destination)`` run, as
        callables to run on any thread: neighbouring runs (of several tensors) merged into
        requests of at most ``part_size`` that read nothing between them, a longer run split.
        Each request, once its body is landed, calls ``done(index of the run, bytes)`` for
        every part of a run it filled. Runs must not overlap."""
        order = sorted((off, i) for i, (off, view) in enumerate(runs) if len(view))
        out, j = [], 0
        sizes = [(off, len(runs[i][1])) for off, i in order]
        for start, end, parts in coalesce(sizes, self.storage.part_size, waste=0.0):
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

        self.fetch(start, end, land)
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


__all__ = ["CHUNK", "ObjectFile", "ShortBody", "coalesce"]
