"""What every remote client shares, whatever talks to the store (obstore for ``s3://`` and
``gs://`` in ``objects``, fsspec for the other URLs in ``fsspec``): :class:`RemoteStorage`, the
clients' base (their options, pool, secrets blanked from errors, the Storage methods that are
a HEAD or a listing, one storage per configuration); requests retried with bounded backoff
(:func:`retried`), and reads of one object (:class:`RemoteFile`: opened at the length and
version its HEAD gave; ranged requests coalesced by :func:`coalesce`, ``concurrency`` in
flight, each body landed as it arrives). A client serves the one request a read needs,
``get_range``; the save transaction's journal is ``publish``'s. This module imports no client.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage.faults import in_words
from shardwise.io.storage.lookups import publishing, redirect, split_location

PART_SIZE = 8 << 20     # bytes per ranged GET (and per multipart part)
CONCURRENCY = 16        # requests in flight per storage
RETRIES = 6             # attempts of one request beyond the client's own retries
WASTE = 1 / 20          # a coalesced request reads at most this much more than asked
CHUNK = 1 << 20         # a body is landed in chunks of at least this many bytes as it arrives
SECRET_WORDS = ("secret", "token", "password", "key", "credential", "service_account")


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


class RemoteStorage:
    """The base of a remote client of one ``scheme`` and configuration: ``options`` less the
    shared ``part_size``, ``concurrency`` and ``retries``; a pool of ``concurrency`` threads;
    every secret of the options and of the environment variables starting with one of
    ``secret_variables`` blanked from its errors (:meth:`scrub`). A client serves ``url``,
    ``head``, ``names`` (a folder's), ``get_range`` and ``is_final`` (a fault that waiting does
    not change), and ``split`` where its locations are no ``bucket/key``."""

    positional_writes = False  # pwrite / create(existing=True) are refused: see create()
    read_only: str | None = None  # why a save is refused (then no journal is looked for), or None
    secret_variables: tuple[str, ...] = ()
    name_final = False  # whether a final fault's error names its type

    def __init__(self, scheme: str, options: dict):
        self.scheme = scheme
        self.part_size = int(options.pop("part_size", PART_SIZE))
        self.concurrency = int(options.pop("concurrency", CONCURRENCY))
        self.retries = int(options.pop("retries", RETRIES))
        found = [v for k, v in options.items()
                 if type(v) is str and any(w in k.lower() for w in SECRET_WORDS)]
        found += [v for k, v in os.environ.items() if k.startswith(self.secret_variables)
                  and any(s in k.lower() for s in SECRET_WORDS) and v and not v.startswith("/")]
        self._secrets = sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)
        self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"shardwise-{scheme}")

    def scrub(self, error) -> str:
        """The first line of ``error``'s text with every configured secret blanked."""
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def split(self, location) -> tuple[str, str]:
        """``(bucket, key)`` of ``location`` (bucket "" where the store has none)."""
        return split_location(location)

    def where(self, location) -> tuple[str, str]:
        """Where ``location`` is read: in the staging prefix while its folder is being published."""
        bucket, key = self.split(location)
        return (bucket, key) if self.read_only else redirect(self, bucket, key)

    def list(self, location) -> list[str]:
        bucket, key = self.split(location)
        pending = None if self.read_only else publishing(self, bucket, key)
        if pending is not None:  # a save under way or interrupted: the new checkpoint, whole, or none
            return [] if pending.get("direct") else sorted(pending["files"])
        return sorted(self.names(bucket, key))

    def open(self, location) -> RemoteFile:
        bucket, key = self.where(location)
        meta = self.head(bucket, key)
        if meta is None:
            raise CheckpointError(f"{self.url(bucket, key)}: no such object")
        return RemoteFile(self, bucket, key, meta["size"], meta.get("e_tag"))

    def stat(self, location) -> int | None:
        meta = self.head(*self.where(location))
        return None if meta is None else int(meta["size"])

    def is_folder(self, location) -> bool:
        return bool(self.list(location))  # a prefix with objects under it

    def check_inside(self, root, location, *, source) -> None:
        """Nothing: a URL names its object; a store has no links that could lead out of a folder."""

    def refuse_existing(self, location, existing: bool) -> None:
        """``create(existing=True)`` refused: a remote store writes objects front to back."""
        if existing:
            raise UsageError(f"{location}: {self.scheme}:// storage writes objects front to back, not into "
                             "an existing object (the parallel write, parallel_write=True); pass "
                             "parallel_write=None or False: rank 0 streams the file")

    def call(self, request, what: str, *, fatal: tuple = (), absent: tuple = (), default=None):
        """:func:`retried` ``request()``; final: the faults :meth:`is_final` names, and ``fatal``;
        ``default`` where the store answers that the thing asked for is absent (``absent``)."""
        try:
            return retried(request, what, retries=self.retries, scrub=self.scrub, fatal=fatal + absent,
                           is_final=self.is_final, name_final=self.name_final)
        except absent:
            return default

    # --- what each client serves -------------------------------------------------------------

    def url(self, bucket: str, key: str) -> str:
        raise NotImplementedError

    def head(self, bucket: str, key: str) -> dict | None:
        raise NotImplementedError

    def names(self, bucket: str, key: str) -> Iterable[str]:
        """The names directly under the folder ``key`` (objects and folders); none for an object."""
        raise NotImplementedError

    def get_range(self, file: RemoteFile, start: int, end: int,
                  land: Callable[[int, memoryview], None]) -> None:
        """Hand bytes ``[start, end)`` of the opened ``file`` (of its version, ``file.etag``,
        where the store has versions) to ``land(offset in the range, chunk)`` as they arrive;
        retried whole (every byte landed again); a replaced object or a body of the wrong
        length is an error."""
        raise NotImplementedError

    def is_final(self, error: Exception) -> bool:
        raise NotImplementedError


_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.Lock()


def cached(key: tuple, make: Callable[[], Any]) -> Any:
    """The storage made by ``make()`` for ``key`` (its scheme, options, environment): one per
    distinct key, its clients and their connection pools shared."""
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = make()
        return _CACHE[key]


class RemoteFile:
    """One object opened for reading at the length and version (ETag) its HEAD gave, through
    its ``storage`` (a :class:`RemoteStorage`)."""

    def __init__(self, storage: RemoteStorage, bucket: str, key: str, size: int, etag: str | None):
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


__all__ = ["CHUNK", "CONCURRENCY", "PART_SIZE", "RETRIES", "RemoteFile", "RemoteStorage", "ShortBody",
           "cached", "coalesce", "retried"]
