"""The local save transaction (``LocalStorage.transaction``): files go into a hidden folder
beside the target, ``.{name}.shardwise-tmp-{host}-{pid}-{token}``, moved into place with one
rename once complete (swapped atomically with a previous checkpoint where ``renameat2``
exists). A killed save leaves only that folder, which the next save to the path removes."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.errors import CheckpointError, StorageError
from shardwise.io.storage.lookups import OLD_MARK, TMP_MARK, foreign, host, owner
from shardwise.io.storage.posix import PARTIAL, fsync_dir, libc_function

if TYPE_CHECKING:
    from shardwise.io.storage import Location


class Destination:
    """The local :class:`~shardwise.io.storage.Transaction` (rank 0 only); ``replaceable``: the
    file names (patterns) ``overwrite`` may replace."""

    def __init__(self, target: Location, overwrite: bool, replaceable: tuple[str, ...] = ()):
        self.target, self.overwrite, self.replaceable = target, overwrite, replaceable
        self.folder: Location | None = None

    def prepare(self) -> None:
        target = Path(self.target.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(target)
        _check_target(target, self.overwrite, self.replaceable)
        self.folder = self.target.parent / f".{target.name}{TMP_MARK}{owner()}-{secrets.token_hex(4)}"
        os.mkdir(self.folder.path)

    def commit(self, index: tuple[str, dict] | None) -> None:
        """Write the index ``(file name, content)`` if any, last; then move the folder into place."""
        assert self.folder is not None  # prepare() made it
        if index is not None:
            text = json.dumps(index[1], indent=2, sort_keys=True) + "\n"
            (self.folder / index[0]).write_bytes(text.encode())
        tmp, target = Path(self.folder.path), Path(self.target.path)
        fsync_dir(tmp)
        if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
            target.rmdir()  # an empty folder holds nothing to keep
        if not target.exists() and not target.is_symlink():
            _rename_noreplace(tmp, target)
        elif self.overwrite:
            _check_target(target, True, self.replaceable)
            _exchange(tmp, target, tmp.name.replace(TMP_MARK, OLD_MARK))
            shutil.rmtree(tmp)  # now the previous checkpoint
        else:
            raise _appeared(target)
        self.folder = None
        fsync_dir(target.parent)

    def discard(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder.path, ignore_errors=True)
            self.folder = None


def _check_target(target: Path, overwrite: bool, replaceable: tuple[str, ...]) -> None:
    if target.is_symlink():
        raise CheckpointError(f"{target} is a symlink; pass the folder it points to "
                              f"({os.path.realpath(target)})")
    if not target.exists():
        return
    if not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a folder; sw.save writes a folder")
    entries = sorted(target.iterdir())
    if not entries:
        return
    if not overwrite:
        raise CheckpointError(f"{target} already exists ({len(entries)} entries); pass overwrite=True "
                              "to replace it once the new checkpoint is complete, or choose another path")
    # overwrite=True deletes only what the save's formats say they write (and their side files),
    # and the partial files this storage's writers leave when killed; a folder only where a
    # pattern ending in "/" names it (a pipeline's component folders)
    files = [e.name for e in entries if e.is_file()]
    folders = [e.name + "/" for e in entries if not e.is_file()]
    others = foreign(folders, replaceable) + foreign(files, (*replaceable, f".*{PARTIAL}"))
    if others:
        raise CheckpointError(
            f"overwrite=True replaces the whole folder {target}, but it also holds {others[0]!r}, "
            "which is not a checkpoint file; move that out first, or save to another folder")


def _alive(name: str) -> bool:
    """Whether the save that named a temporary folder ``{host}-{pid}-{token}`` may still run."""
    where, _, pid = name.rpartition("-")[0].rpartition("-")
    if where != host() or not pid.isdigit() or int(pid) == os.getpid():
        return False  # one writer per path at a time: another host's folder is stale
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    try:  # killed but not yet reaped by its parent: a zombie writes nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _remove_stale(target: Path) -> None:
    """Remove what an interrupted save to ``target`` left beside it (the previous checkpoint
    renamed aside is put back if nothing replaced it)."""
    prefix = "." + target.name
    for entry in sorted(target.parent.iterdir()):
        mark = next((m for m in (TMP_MARK, OLD_MARK) if entry.name.startswith(prefix + m)), None)
        if mark is None or _alive(entry.name[len(prefix + mark):]):
            continue
        if mark == OLD_MARK and not target.exists() and not target.is_symlink():
            os.rename(entry, target)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


# --- renames: atomic where the platform has renameat2 ------------------------------------
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2_fn():
    c_int, c_char_p = ctypes.c_int, ctypes.c_char_p  # glibc >= 2.28
    return libc_function("renameat2", c_int, c_char_p, c_int, c_char_p, ctypes.c_uint)


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """True when done; False when this platform or filesystem has no such rename."""
    fn = _renameat2_fn()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    if err == errno.EEXIST and flags == _RENAME_NOREPLACE:
        raise _appeared(dst)
    raise StorageError(err, f"{os.strerror(err)} (moving the finished checkpoint into place; check that "
                       "the folder is writable and the target not in use)", str(src), None, str(dst))


def _appeared(target: Path) -> CheckpointError:
    return CheckpointError(f"{target} appeared while saving; pass overwrite=True to replace it")


def _rename_noreplace(src: Path, dst: Path) -> None:
    if not _renameat2(src, dst, _RENAME_NOREPLACE):
        if dst.exists():  # os.rename would silently replace an empty folder
            raise _appeared(dst)
        os.rename(src, dst)


def _exchange(new: Path, target: Path, aside: str) -> None:
    """Afterwards ``target`` holds ``new`` and ``new`` holds the previous ``target``."""
    if _renameat2(new, target, _RENAME_EXCHANGE):
        return
    old = target.parent / aside  # no atomic swap here: a crash in between leaves `old`,
    os.rename(target, old)       # which the next save to `target` puts back
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    os.rename(old, new)


__all__ = ["Destination", "OLD_MARK", "TMP_MARK"]
