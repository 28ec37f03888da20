"""The local filesystem as a :class:`~shardwise.io.storage.Storage`: untrusted files opened
safely (a ``CheckpointError`` naming the file, never a hang on a FIFO), ``pread`` ranges,
private ``mmap`` views, files written aside and renamed into place after an fsync."""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import stat
import sys
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.errors import CheckpointError

if TYPE_CHECKING:
    from shardwise.io.storage import Location

if hasattr(os, "preadv"):
    def _pread_some(fd: int, buf: memoryview, pos: int) -> int:
        return os.preadv(fd, [buf], pos)
else:  # no preadv (Windows, old macOS): read through bytes in bounded pieces
    def _pread_some(fd: int, buf: memoryview, pos: int) -> int:
        data = os.pread(fd, min(len(buf), 1 << 26), pos)
        buf[: len(data)] = data
        return len(data)


def pread_into(fd: int, buf: memoryview, pos: int, *, what: str) -> None:
    """Fill ``buf`` from file offset ``pos``; end of file first means the file is truncated."""
    done = 0
    while done < len(buf):
        n = _pread_some(fd, buf[done:], pos + done)
        if n == 0:
            raise CheckpointError(
                f"{what}: the file ends at byte {pos + done}, {len(buf) - done} bytes short of "
                f"[{pos}, {pos + len(buf)}); the file is truncated"
            )
        done += n


def pread_runs(fd: int, buf: memoryview, base: int, runs: Sequence[tuple[int, int]], *, what: str) -> int:
    """Fill ``buf`` with the byte runs ``(offset from base, length)`` of the file, one after
    another; return the bytes read (``len(buf)``)."""
    pos = 0
    # A column slice is one run per row (thousands per tensor), so the loop makes one
    # syscall per run and takes the retrying path only after a short read.
    for offset, length in runs:
        part = buf[pos : pos + length]
        n = _pread_some(fd, part, base + offset)
        if n < length:
            pread_into(fd, part[n:], base + offset + n, what=what)
        pos += length
    assert pos == len(buf), (pos, len(buf))
    return pos


def path_error(path: str | os.PathLike, e: OSError) -> CheckpointError:
    """The ``CheckpointError`` for an OS error naming ``path`` (a symlink loop, a name too
    long, no permission): the file and the reason, never a raw ``OSError``."""
    fix = "; replace the symlink loop by the file it should lead to" if e.errno == errno.ELOOP else ""
    return CheckpointError(f"{os.fspath(path)}: cannot open ({e.strerror}){fix}")


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path`` (the caller closes it)."""
    # O_NONBLOCK so that a FIFO planted in a checkpoint cannot hang open(); it has
    # no effect on regular files, and anything else is refused right after.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise path_error(path, e) from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file")
    return fd


def check_inside(root: Path, path: Path, *, source: object) -> None:
    """Raise ``CheckpointError`` (naming ``source``) when ``path`` resolves outside ``root``."""
    # A symlink may not lead out of the folder, except into the blob store of a
    # huggingface_hub cache, whose snapshots are symlinks into ../../blobs.
    try:
        target, real_root = path.resolve(), root.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop: RuntimeError up to Python 3.12, ELOOP after
        raise CheckpointError(f"{source}: {path} cannot be resolved ({e}); a symlink loop?") from e
    if target.is_relative_to(real_root):
        return
    snapshots = next((p for p in real_root.parents if p.name == "snapshots"), None)
    blobs = snapshots.parent / "blobs" if snapshots is not None else None
    if blobs is not None and blobs.is_dir() and target.is_relative_to(blobs.resolve()):
        return
    raise CheckpointError(
        f"{source}: {path.name} is a symlink to {target}, outside the checkpoint folder {root}; "
        "refusing to read it (copy the file into the folder if you trust it)"
    )


# Dirty bytes a writer lets pile up before it starts the kernel writing them back.
WRITEBACK_BYTES = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of the range's dirty pages, don't wait


@functools.cache
def libc_function(name: str, *argtypes):
    """The Linux libc function ``name`` with ``argtypes`` (errno kept); None elsewhere, or
    where this libc lacks it. For the calls ``os`` does not wrap."""
    if sys.platform != "linux":
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), name, None)
    if fn is not None:
        fn.argtypes = list(argtypes)
    return fn


def _sync_file_range():
    return libc_function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


class Writeback:
    """Start the kernel writing a file's dirty pages every ``WRITEBACK_BYTES`` written, without
    waiting, so that the final fsync waits only for the last stretch (1 GB Llama: that fsync
    0.28 s -> 0.02 s). ``sync_file_range`` through libc, Linux only (elsewhere a no-op); it only
    starts I/O, errors still surface in the fsync."""

    def __init__(self, fd: int, *, sequential: bool, every: int = WRITEBACK_BYTES):
        self.fd, self.sequential = fd, sequential
        self.every: float = every  # inf once the file is found not to support it
        self.started = 0  # bytes the kernel was told to start writing (a sequential writer's
        self._written = 0  # offset: it writes from 0 onwards)

    def wrote(self, nbytes: int) -> None:
        """``nbytes`` more were written (at the end for a sequential writer, else anywhere)."""
        self._written += nbytes
        fn = _sync_file_range()
        if fn is None or self._written - self.started < self.every:
            return
        if self.sequential:
            done = fn(self.fd, self.started, self._written - self.started, _SYNC_FILE_RANGE_WRITE)
        else:
            done = fn(self.fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # 0, 0: the whole file
        if done == 0:
            self.started = self._written
        else:  # not a file it can do this for (a pipe: ESPIPE): leave it all to the fsync
            self.every = float("inf")


def fsync_dir(folder: Path) -> None:
    """Make a rename into ``folder`` durable, where the platform can fsync a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Private (copy-on-write) mappings are POSIX; elsewhere (Windows) every box is read with pread.
MAPS = hasattr(mmap, "MAP_PRIVATE")
_GRANULE = mmap.ALLOCATIONGRANULARITY


class LocalFile:
    """A regular file opened for reading: one descriptor that every thread shares (``pread``
    takes its own offset, so no lock), and at most one whole-file private mapping."""

    def __init__(self, path: Path):
        self.name, self.fd = str(path), open_regular(path)
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def readinto(self, buf: memoryview, pos: int) -> None:
        pread_into(self.fd, buf, pos, what=self.name)

    def read_runs(self, buf: memoryview, base: int, runs: Sequence[tuple[int, int]]) -> int:
        return pread_runs(self.fd, buf, base, runs, what=self.name)

    def map_whole(self) -> mmap.mmap | None:
        # The descriptor whose header was validated, whatever the path names now. Private and
        # writable: a write to a view copies its page, the file never changes. Never closed
        # here: the tensors viewing it keep it alive, and closing it under a live tensor would
        # unmap memory the tensor still points at.
        if not MAPS:
            return None
        with self._lock:
            if self._map is None:
                self._map = mmap.mmap(self.fd, 0, flags=mmap.MAP_PRIVATE,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
            return self._map

    def map_range(self, start: int, length: int):
        return _mapped(self.fd, start, length) if MAPS else None

    def close(self) -> None:
        self._map = None  # the views hold their own references
        os.close(self.fd)


@contextmanager
def _mapped(fd: int, start: int, length: int):
    """A private mapping of ``[start, start + length)`` rounded down to the page granule, as
    ``(mapping, offset of start in it)``; unmapped on leaving, so its pages leave the process."""
    lo = start - start % _GRANULE
    mapping = mmap.mmap(fd, start + length - lo, flags=mmap.MAP_PRIVATE,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=lo)
    try:
        yield mapping, start - lo
    finally:
        mapping.close()  # the tensors over it lived only inside the with


class LocalWriter:
    """A file written aside (``.{name}.{pid}.partial``) and renamed into place by ``commit``
    after an fsync; or, ``existing``, a file that rank 0 created, written in place."""

    def __init__(self, path: Path, *, existing: bool = False):
        self.path, self._existing = path, existing
        self._tmp = path if existing else path.with_name(f".{path.name}.{os.getpid()}.partial")
        # never O_CREAT for an existing one: a missing file is an error, not a new file
        flags = os.O_WRONLY if existing else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self._fd: int | None = os.open(self._tmp, flags, 0o666)
        self._writeback = Writeback(self._fd, sequential=not existing)

    def write(self, buf: memoryview) -> None:
        assert self._fd is not None, "write after commit or abort"
        done = 0
        while done < len(buf):
            done += os.write(self._fd, buf[done:])
        self._writeback.wrote(done)

    def pwrite(self, buf: memoryview, pos: int) -> None:
        assert self._fd is not None, "write after commit or abort"
        done = 0
        while done < len(buf):
            done += os.pwrite(self._fd, buf[done:], pos + done)
        self._writeback.wrote(done)

    def commit(self) -> None:
        fd, self._fd = self._fd, None
        assert fd is not None, "commit after commit or abort"
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if not self._existing:
            try:
                os.replace(self._tmp, self.path)
            except BaseException:
                self._tmp.unlink(missing_ok=True)
                raise
            fsync_dir(self.path.parent)

    def abort(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
            if not self._existing:
                self._tmp.unlink(missing_ok=True)


class LocalStorage:
    """The local filesystem; ``LOCAL`` is the one instance."""

    fetch_once = False  # pread and mapped views: each rank reads its own runs (io.exchange)

    def open(self, location: Location) -> LocalFile:
        return LocalFile(Path(location.path))

    def stat(self, location: Location) -> int | None:
        try:
            st = os.stat(location.path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:  # a symlink loop (ELOOP), a name too long, no permission
            raise path_error(location.path, e) from e
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def list(self, location: Location) -> list[str]:
        try:
            return sorted(os.listdir(location.path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise path_error(location.path, e) from e

    def is_folder(self, location: Location) -> bool:
        return os.path.isdir(location.path)

    def check_inside(self, root: Location, location: Location, *, source: Location) -> None:
        check_inside(Path(root.path), Path(location.path), source=source)

    def create(self, location: Location, *, existing: bool = False) -> LocalWriter:
        return LocalWriter(Path(location.path), existing=existing)

    def transaction(self, target: Location, *, overwrite: bool):
        from shardwise.io.storage.transaction import Destination

        return Destination(target, overwrite)


LOCAL = LocalStorage()

__all__ = ["LOCAL", "LocalFile", "LocalStorage", "LocalWriter", "MAPS", "Writeback", "check_inside",
           "fsync_dir", "libc_function", "open_regular", "pread_into", "pread_runs"]
