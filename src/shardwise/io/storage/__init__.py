"""The one place that touches checkpoint bytes: a :class:`Location` decoded once at the door
(:func:`locate`), the small ``Storage`` protocol behind it, the scheme registry, the one cache
of read handles. A format says which bytes; a storage says how to get and put them (local
files: ``storage.local``; object stores by URL scheme; any other scheme through fsspec).

Call order. A read (every rank, on its own): ``open`` (or :class:`Handles`) per object,
``readinto`` / ``read_runs`` from any thread, ``close``. A save: rank 0 calls
``transaction(target)`` and ``prepare()``; the writing ranks ``create(folder / name)`` and
``commit()`` each object; then rank 0 ``commit(index)``s the transaction, or ``discard()``s it.
"""

from __future__ import annotations

import builtins
import ctypes
import fnmatch
import io
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path, PurePath, PurePosixPath
from typing import Protocol

import torch

from shardwise.core.header import MAX_HEADER_SIZE, parse_json_object
from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage.local import LOCAL


@dataclass(frozen=True)
class Location:
    """A checkpoint folder (prefix) or object: its ``storage``, the ``path`` in it (a ``Path``
    locally, a ``PurePosixPath`` key otherwise) and the URL ``scheme`` (None: local); ``str()``
    is the user's spelling. Made by :func:`locate`; its methods are the way to the storage."""

    storage: Storage
    path: PurePath
    scheme: str | None = None

    def __str__(self) -> str:
        return str(self.path) if self.scheme is None else f"{self.scheme}://{self.path.as_posix()}"

    def __repr__(self) -> str:
        return f"Location({str(self)!r})"

    def __truediv__(self, name: str) -> Location:
        return replace(self, path=self.path / name)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def suffix(self) -> str:
        return self.path.suffix

    @property
    def parent(self) -> Location:
        return replace(self, path=self.path.parent)

    def local_path(self, why: str) -> Path:
        """The local path, for the callers that need one (``why``); ``UsageError`` elsewhere."""
        if self.scheme is not None:
            raise UsageError(f"{self}: {why} needs a local path; copy the checkpoint to a local folder first")
        return Path(self.path)

    # --- the storage calls -----------------------------------------------------------
    def open(self) -> ReadHandle:
        return self.storage.open(self)

    def stat(self) -> int | None:
        return self.storage.stat(self)

    def list(self) -> list[str]:
        return self.storage.list(self)

    def is_folder(self) -> bool:
        return self.storage.is_folder(self)

    def exists(self) -> bool:
        return self.stat() is not None or self.is_folder()

    def glob(self, pattern: str) -> builtins.list[Location]:
        """The objects directly under this folder whose names match ``pattern``, sorted."""
        return [self / n for n in self.list()
                if fnmatch.fnmatchcase(n, pattern) and (self / n).stat() is not None]

    def create(self, *, existing: bool = False) -> WriteHandle:
        return self.storage.create(self, existing=existing)

    def write_bytes(self, data: bytes) -> None:
        """Write this small object whole (:func:`write_small`): what an adapter's
        ``write_side_files`` uses for a side file."""
        write_small(self, data)


def locate(where: str | os.PathLike | Location, storage_options: dict | None = None) -> Location:
    """The :class:`Location` of the user's ``where``: ``{scheme}://...`` by the storage
    registered for ``scheme`` (``factory(**storage_options)``), else fsspec's; anything else
    local; a :class:`Location` passes through. Called once per public entry point, every rank."""
    if isinstance(where, Location):
        if storage_options:
            raise UsageError(f"{where}: storage_options go with a str or path location, not a Location")
        return where
    scheme, rest = split_scheme(where)
    if scheme is None:
        if storage_options:
            raise UsageError(f"{os.fspath(where)!r} is a local path: storage_options={storage_options!r} are "
                             f"for a URL location (registered schemes: {sorted(_SCHEMES)})")
        return Location(LOCAL, Path(rest))
    factory = _SCHEMES.get(scheme)
    if factory is None:  # any other scheme: fsspec's filesystem of it
        # deferred: an optional client (fsspec), imported on the first URL that needs it
        from shardwise.io.storage.fsspec import factory as fsspec_factory

        factory = fsspec_factory(scheme, registered=tuple(_SCHEMES))
    return Location(factory(**(storage_options or {})), PurePosixPath(rest), scheme)


class ReadHandle(Protocol):
    """One stored object opened for reading; every method may be called from any thread."""

    name: str  # what errors call it

    def size(self) -> int:
        """Its current length in bytes (asked again each time: a file may have been cut)."""

    def readinto(self, buf: memoryview, pos: int) -> None:
        """Fill ``buf`` from byte ``pos``; an end first is a ``CheckpointError`` (truncated)."""

    def read_runs(self, buf: memoryview, base: int, runs: Sequence[tuple[int, int]]) -> int:
        """Fill ``buf`` with the byte runs ``(offset from base, length)`` in turn (the storage
        coalesces them); the bytes read."""

    def map_whole(self):
        """A private (copy-on-write) buffer over the whole object for tensors to view, or None."""

    def map_range(self, start: int, length: int) -> AbstractContextManager | None:
        """``(buffer, offset of start in it)`` over ``[start, start + length)`` inside the
        ``with``; None when none pays (then read)."""

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
    """One save, complete or absent, held by rank 0: ``prepare()`` before any rank writes under
    ``folder``; ``commit(index)`` once every rank has committed its objects; ``discard()``
    always (a no-op after a commit)."""

    target: Location  # where the checkpoint goes
    folder: Location | None  # where the writers put the objects, between prepare and commit

    def prepare(self) -> None: ...

    def commit(self, index: tuple[str, dict] | None) -> None:
        """Write the index ``(object name, content)``, if any, last; then publish the save
        at ``target`` (replacing a previous checkpoint there only now)."""

    def discard(self) -> None: ...


class Storage(Protocol):
    """Where checkpoints live; every method takes a :class:`Location` of this storage. Each
    rank gets its own instance from :func:`locate`, all seeing the same objects; call order as
    in the module doc. Declared as data: ``fetch_once = True`` (each request a round trip: a
    load reads each byte once per job and the ranks exchange the rest, ``io.exchange``);
    ``concurrency`` (requests in flight: a load's default reader threads); ``read_only`` (a str
    saying why it cannot hold a save)."""

    def open(self, location: Location) -> ReadHandle:
        """The object at ``location`` for reading; a ``CheckpointError`` naming it when it is
        absent or not a plain object (a FIFO, a folder)."""

    def stat(self, location: Location) -> int | None:
        """The size of the object at ``location``; None when there is none (a folder is none)."""

    def list(self, location: Location) -> list[str]:
        """The names directly under the folder ``location`` (objects and folders), sorted."""

    def is_folder(self, location: Location) -> bool:
        """Whether ``location`` is a folder (an object store: a prefix with objects under it)."""

    def check_inside(self, root: Location, location: Location, *, source: Location) -> None:
        """Raise ``CheckpointError`` (naming ``source``) when ``location`` leads outside ``root``
        (a local symlink); a storage without links does nothing."""

    def create(self, location: Location, *, existing: bool = False) -> WriteHandle:
        """A writer of a new object at ``location`` (``existing``: rank 0 created it)."""

    def transaction(self, target: Location, *, overwrite: bool,
                    replaceable: Sequence[str] = ()) -> Transaction:
        """The save transaction that puts a new checkpoint at ``target`` (rank 0 only). With
        ``overwrite`` it replaces a checkpoint whose files all match ``replaceable`` (``fnmatch``
        patterns the save is told by its formats; a pattern ending in ``/`` names folders, which
        a local storage replaces whole); anything else there is a ``CheckpointError``."""


def read_small(location: Location, *, what: str, cap: int = MAX_HEADER_SIZE) -> bytes:
    """The whole of a small object of at most ``cap`` bytes; ``what`` names it in errors."""
    handle = location.open()
    try:
        size = handle.size()
        if size > cap:
            raise CheckpointError(f"{location}: {size} bytes, over the {cap}-byte cap for {what}")
        raw = bytearray(size)
        handle.readinto(memoryview(raw), 0)
    finally:
        handle.close()
    return bytes(raw)


def read_json(location: Location, *, what: str) -> dict:
    """The JSON object in the small object ``location`` (strict, capped; see :func:`read_small`)."""
    return parse_json_object(read_small(location, what=what), source=str(location), what=what)


def write_small(location: Location, data: bytes) -> None:
    """Write the small object ``location`` whole (aside, durable, then in place)."""
    writer = location.create()
    try:
        writer.write(memoryview(data))
        writer.commit()
    finally:
        writer.abort()


class Handles:
    """The one cache of open read handles: ``get`` opens each location once, from any thread;
    ``close`` closes them all."""

    def __init__(self):
        self._open: dict[Location, ReadHandle] = {}
        self._lock = threading.Lock()

    def get(self, location: Location) -> ReadHandle:
        with self._lock:
            handle = self._open.get(location)
            if handle is None:
                handle = self._open[location] = location.open()
            return handle

    def close(self) -> None:
        with self._lock:
            handles, self._open = list(self._open.values()), {}
        for handle in handles:
            handle.close()


class HandleFile(io.RawIOBase):
    """A seekable binary file over a read handle (for ``torch.load`` of a DCP blob), with its
    own position; it does not close the handle."""

    def __init__(self, handle: ReadHandle, *, held: Sequence[tuple[int, bytes]] = ()):
        super().__init__()
        self.handle, self.name, self._pos = handle, handle.name, 0
        self._size = handle.size()  # once: a read handle's file does not change length
        self._held = held  # (offset, bytes) already read: reads inside one are served from it

    def record(self, start: int, length: int, *, edge: int = 4096) -> HandleFile:
        """A file of its own over the same handle for ``torch.load`` of the zip record at
        ``[start, start + length)`` (a DCP blob): the record's first and last ``edge`` bytes, where
        its small entries and its central directory lie, are read once (one read when they
        meet); torch.load's many small reads there are served from them, its data from the
        handle. A buffer would not do: the zip reader seeks backwards from the end."""
        end = start + length
        spans = [(start, length)] if length <= 2 * edge else [(start, edge), (end - edge, edge)]
        return HandleFile(self.handle, held=[(at, self.pread(n, at)) for at, n in spans])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        for at, data in self._held:
            if at <= self._pos and self._pos + n <= at + len(data):
                view[:n] = data[self._pos - at:self._pos - at + n]
                break
        else:
            self.handle.readinto(view[:n], self._pos)
        self._pos += n
        return n

    def pread(self, n: int, pos: int) -> bytes:
        """``n`` bytes from ``pos`` (fewer at the end), the position unchanged."""
        out = bytearray(max(0, min(n, self._size - pos)))
        self.handle.readinto(memoryview(out), pos)
        return bytes(out)


# --- the scheme registry -----------------------------------------------------------------

_SCHEMES: dict[str, Callable[..., Storage]] = {}


def register_storage(scheme: str, factory: Callable[..., Storage]) -> None:
    """Serve ``{scheme}://...`` by ``factory(**storage_options)``; a scheme twice is an error."""
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


def _object_store(scheme: str) -> Callable[..., Storage]:
    def make(**storage_options) -> Storage:
        # deferred: an optional client (obstore), imported on the first s3:// or gs:// request
        from shardwise.io.storage.objects import factory

        return factory(scheme)(**storage_options)
    return make


for _scheme in ("s3", "gs"):
    register_storage(_scheme, _object_store(_scheme))


def target_path(location: Location) -> Location:
    """The save target ``location``, a local one made absolute; ``CheckpointError`` for a root,
    ``UsageError`` for a ``read_only`` storage. Every rank calls it before anything is written."""
    why = getattr(location.storage, "read_only", None)
    if why:
        raise UsageError(f"{location}: cannot save to {location.scheme}:// ({why}); save to a local folder "
                         "or a writable storage")
    if location.scheme is None:
        location = replace(location, path=Path(os.path.abspath(location.path)))
    if location.name in ("", ".", ".."):
        raise CheckpointError(f"path {str(location)!r} must name a folder to create, not the root")
    return location


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview aliasing a contiguous CPU tensor's bytes (the caller keeps ``t``
    alive). ctypes, not ``tensor.numpy()``: numpy is no dependency of torch's CPU wheels."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise UsageError(f"byte_view needs a contiguous CPU tensor, got one on {t.device} "
                         f"(contiguous={t.is_contiguous()}); pass t.cpu().contiguous()")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


__all__ = ["HandleFile", "Handles", "Location", "ReadHandle", "Storage", "Transaction", "WriteHandle",
           "byte_view", "locate", "read_json", "read_small", "register_storage", "split_scheme",
           "target_path", "unregister_storage", "write_small"]
