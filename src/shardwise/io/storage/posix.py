"""The POSIX calls the local storage and its save transaction share: ``pread`` into buffers,
a safe open of an untrusted file (an OS error is a ``CheckpointError`` naming the file), the
symlink containment of a checkpoint folder, libc calls ``os`` does not wrap, writeback and a
folder's fsync. No module of the package is imported here but the errors."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from shardwise.errors import CheckpointError

PARTIAL = ".partial"  # a local file written aside, renamed at its commit: .{name}.{pid}.partial

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


def path_error(path: str | os.PathLike, e: OSError, *, doing: str = "read") -> CheckpointError:
    """The ``CheckpointError`` for an OS error naming ``path`` (a symlink loop, a name too
    long, no permission): the file and the reason, never a raw ``OSError``."""
    fix = "; replace the symlink loop by the file it should lead to" if e.errno == errno.ELOOP else ""
    return CheckpointError(f"{os.fspath(path)}: cannot {doing} ({e.strerror}){fix}")


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path`` (the caller closes it)."""
    # O_NONBLOCK so that a FIFO planted in a checkpoint cannot hang open(); it has
    # no effect on regular files, and anything else is refused right after.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise path_error(path, e, doing="open") from e
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


__all__ = ["PARTIAL", "WRITEBACK_BYTES", "Writeback", "check_inside", "fsync_dir", "libc_function",
           "open_regular", "path_error", "pread_into", "pread_runs"]
