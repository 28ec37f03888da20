"""The one place that touches checkpoint bytes: a small ``Storage`` protocol, the scheme
registry that picks one from a location, and the one cache of open read handles.

In the spirit of torch DCP's ``FileSystemBase`` (open / rename / mkdir over any file system)
and ``StorageReader`` / ``StorageWriter``: a format says *which* bytes (headers, boxes, chunk
offsets), a storage says how to get and put them. The local filesystem
(``shardwise.io.storage.local``: pread, private mmap views, fsync, ``renameat2`` commit) is
the first implementation; an object store is one more, registered by its URL scheme.

Call order of a read: ``storage_for(location)`` once at the public entry point, then
``open`` (or a :class:`Handles` cache of them) per file, ``readinto`` / ``read_runs`` from any
thread, ``close``. Of a save: rank 0 calls ``transaction(target)`` and ``prepare()``, writers
on the ranks that write call ``create(folder/name)`` and ``commit()`` each file, then rank 0
calls the transaction's ``commit(index)``; on any failure rank 0 calls ``discard()``.
"""

from __future__ import annotations

import ctypes
import io
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch

from shardwise.core.header import MAX_HEADER_SIZE, parse_json_object
from shardwise.errors import CheckpointError, UsageError


class ReadHandle(Protocol):
    """One stored object opened for reading; every method may be called from any thread."""

    name: str  # what errors call it

    def size(self) -> int:
        """Its current length in bytes (asked again each time: a file may have been cut)."""

    def readinto(self, buf: memoryview, pos: int) -> None:
        """Fill ``buf`` from byte ``pos``; an end first is a ``CheckpointError`` (truncated)."""

    def read_runs(self, buf: memoryview, base: int, runs: Sequence[tuple[int, int]]) -> int:
        """Fill ``buf`` with the byte runs ``(offset from base, length)``, one after another
        (the batch of a box: the storage coalesces and issues them); the bytes read."""

    def map_whole(self):
        """A private (copy-on-write) buffer over the whole object that tensors may view and
        keep alive, or None where the storage has no such views (then read)."""

    def map_range(self, start: int, length: int) -> AbstractContextManager | None:
        """A short-lived buffer over ``[start, start + length)``, as ``(buffer, offset of
        start in it)`` inside the ``with``; None when none pays (then read)."""

    def close(self) -> None: ...


class WriteHandle(Protocol):
    """A new object being written; it becomes visible at its location only at ``commit``."""

    def write(self, buf: memoryview) -> None:
        """Append ``buf`` (a sequential writer)."""

    def pwrite(self, buf: memoryview, pos: int) -> None:
        """Write ``buf`` at byte ``pos`` (the parallel write: each rank its own regions)."""

    def commit(self) -> None:
        """Make the written bytes durable and the object visible at its location."""

    def abort(self) -> None:
        """Drop what was written; safe to call more than once and after ``commit``."""


class Transaction(Protocol):
    """One save: complete or absent, never over the previous checkpoint until whole.
    Rank 0 alone holds it: ``prepare()`` before any rank writes, ``commit(index)`` once every
    rank has committed its files, ``discard()`` always (a no-op after a commit)."""

    target: Path  # where the checkpoint goes
    folder: Path | None  # where the writers put the files, between prepare and commit

    def prepare(self) -> None: ...

    def commit(self, index: tuple[str, dict] | None) -> None:
        """Write the index ``(file name, content)``, if any, last; then move the save into place."""

    def discard(self) -> None: ...


class Storage(Protocol):
    """Where checkpoints live. Every rank gets the same one from :func:`storage_for`; which
    rank calls what is the caller's (a load: every rank ``open``s what it reads; a save: see
    the module doc)."""

    def open(self, location: Path) -> ReadHandle:
        """The object at ``location`` for reading; a ``CheckpointError`` naming it when it is
        absent or not a plain object (a FIFO, a folder)."""

    def stat(self, location: Path) -> int | None:
        """The size of the object at ``location``; None when there is none."""

    def list(self, location: Path) -> list[str]:
        """The names directly under the folder (prefix) ``location``, sorted; [] when none."""

    def create(self, location: Path, *, existing: bool = False) -> WriteHandle:
        """A writer of a new object at ``location`` (``existing``: one that rank 0 created,
        each rank writing its own regions into it)."""

    def transaction(self, target: Path, *, overwrite: bool) -> Transaction:
        """The save transaction that puts a new checkpoint at ``target``."""


def read_small(storage: Storage, location: Path, *, what: str, cap: int = MAX_HEADER_SIZE) -> bytes:
    """The whole of a small object (an index, a header, ``shardwise.json``) of at most
    ``cap`` bytes; ``what`` names it in the ``CheckpointError`` for any fault."""
    handle = storage.open(location)
    try:
        size = handle.size()
        if size > cap:
            raise CheckpointError(f"{location}: {size} bytes, over the {cap}-byte cap for {what}")
        raw = bytearray(size)
        handle.readinto(memoryview(raw), 0)
    finally:
        handle.close()
    return bytes(raw)


def read_json(storage: Storage, location: Path, *, what: str) -> dict:
    """The JSON object in the small object ``location`` (strict, capped; see :func:`read_small`)."""
    return parse_json_object(read_small(storage, location, what=what), source=str(location), what=what)


def write_small(storage: Storage, location: Path, data: bytes) -> None:
    """Write the small object ``location`` whole (aside, durable, then in place)."""
    writer = storage.create(location)
    try:
        writer.write(memoryview(data))
        writer.commit()
    finally:
        writer.abort()


class Handles:
    """The one cache of open read handles (a reader's, an offline tool's): ``get`` opens each
    location once, from any thread; ``close`` closes them all."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._open: dict[Path, ReadHandle] = {}
        self._lock = threading.Lock()

    def get(self, location: Path) -> ReadHandle:
        with self._lock:
            handle = self._open.get(location)
            if handle is None:
                handle = self._open[location] = self.storage.open(location)
            return handle

    def close(self) -> None:
        with self._lock:
            handles, self._open = list(self._open.values()), {}
        for handle in handles:
            handle.close()


class HandleFile(io.RawIOBase):
    """A seekable binary file over a read handle, for the readers that take a file object
    (``torch.load`` of a DCP blob through torch's ``_create_file_view``); any storage's. It
    has its own position and does not close the handle (its owner, a :class:`Handles`, does)."""

    def __init__(self, handle: ReadHandle):
        super().__init__()
        self.handle, self.name, self._pos = handle, handle.name, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.handle.size()}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self.handle.size() - self._pos))
        self.handle.readinto(view[:n], self._pos)
        self._pos += n
        return n

    def pread(self, n: int, pos: int) -> bytes:
        """``n`` bytes from ``pos`` (fewer at the end), the position unchanged."""
        out = bytearray(max(0, min(n, self.handle.size() - pos)))
        self.handle.readinto(memoryview(out), pos)
        return bytes(out)


# --- the scheme registry -----------------------------------------------------------------

_SCHEMES: dict[str, Callable[..., Storage]] = {}


def register_storage(scheme: str, factory: Callable[..., Storage]) -> None:
    """Serve locations ``{scheme}://...`` by ``factory(**storage_options)``; a scheme
    registered twice is an error."""
    if not scheme.isidentifier() or scheme in _SCHEMES:
        raise UsageError(f"storage scheme {scheme!r} is {'taken' if scheme in _SCHEMES else 'not a name'}; "
                         f"registered: {sorted(_SCHEMES)}")
    _SCHEMES[scheme] = factory


def unregister_storage(scheme: str) -> None:
    _SCHEMES.pop(scheme, None)


def split_scheme(location: str | os.PathLike) -> tuple[str | None, str]:
    """``("mem", "bucket/ckpt")`` for ``"mem://bucket/ckpt"``; ``(None, path)`` for a local path."""
    text = os.fspath(location)
    scheme, sep, rest = text.partition("://")
    return (scheme, rest) if sep and scheme.isidentifier() else (None, text)


def storage_for(location: str | os.PathLike, storage_options: dict | None = None) -> Storage:
    """The storage that serves ``location``: a registered scheme's, else the local files."""
    scheme, _ = split_scheme(location)
    if scheme is None:
        from shardwise.io.storage.local import LOCAL

        return LOCAL
    if scheme not in _SCHEMES:
        raise UsageError(f"{os.fspath(location)!r}: no storage for the scheme {scheme!r}; registered: "
                         f"{sorted(_SCHEMES)} (register_storage(scheme, factory) adds one)")
    return _SCHEMES[scheme](**(storage_options or {}))


def _object_store(scheme: str) -> Callable[..., Storage]:
    def make(**storage_options) -> Storage:  # obstore is imported on the first request, not here
        from shardwise.io.storage.objects import factory

        return factory(scheme)(**storage_options)
    return make


for _scheme in ("s3", "gs"):
    register_storage(_scheme, _object_store(_scheme))


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of the bytes of a contiguous CPU tensor, aliasing its memory.

    Built with ctypes rather than ``tensor.numpy()``: numpy is not a dependency of torch's
    CPU wheels, nor of shardwise. The caller keeps ``t`` alive while the view is in use.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise UsageError(f"byte_view needs a contiguous CPU tensor, got one on {t.device} "
                         f"(contiguous={t.is_contiguous()}); pass t.cpu().contiguous()")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


__all__ = ["HandleFile", "Handles", "ReadHandle", "Storage", "Transaction", "WriteHandle", "byte_view",
           "read_json", "read_small", "register_storage", "split_scheme", "storage_for", "unregister_storage",
           "write_small"]
