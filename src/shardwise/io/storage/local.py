"""The local filesystem as a :class:`~shardwise.io.storage.Storage`: untrusted files opened
safely (a ``CheckpointError`` naming the file, never a hang on a FIFO), ``pread`` ranges,
private ``mmap`` views, files written aside and renamed into place after an fsync."""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.io.storage.lookups import remembered
from shardwise.io.storage.posix import (
    PARTIAL,
    Writeback,
    check_inside,
    fsync_dir,
    open_regular,
    path_error,
    pread_into,
    pread_runs,
)
from shardwise.io.storage.transaction import Destination

if TYPE_CHECKING:
    from shardwise.io.storage import Location

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
        self._tmp = path if existing else path.with_name(f".{path.name}.{os.getpid()}{PARTIAL}")
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
        """The names in the folder ``location``; listed once within a load (``lookups.one_look``:
        the formats' claims and the checkpoint's resolution ask the same folder)."""
        return list(remembered((self, "list", os.fspath(location.path)), lambda: _listdir(location.path)))

    def is_folder(self, location: Location) -> bool:
        return os.path.isdir(location.path)

    def check_inside(self, root: Location, location: Location, *, source: Location) -> None:
        check_inside(Path(root.path), Path(location.path), source=source)

    def create(self, location: Location, *, existing: bool = False) -> LocalWriter:
        return LocalWriter(Path(location.path), existing=existing)

    def transaction(self, target: Location, *, overwrite: bool,
                    replaceable: Sequence[str] = ()) -> Destination:
        return Destination(target, overwrite, tuple(replaceable))


def _listdir(path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise path_error(path, e) from e


LOCAL = LocalStorage()

__all__ = ["LOCAL", "LocalFile", "LocalStorage", "LocalWriter", "MAPS"]
