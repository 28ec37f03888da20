"""``sw.save``: gather a tensor-parallel model into an ordinary safetensors checkpoint.

Every rank calls it; rank 0 writes. Names, dtypes and canonical shapes come from the shard
specs, so rank 0 plans the files and writes each header before any tensor arrives; then one
tensor at a time is gathered to rank 0, put back in its canonical layout (packed blocks in
their unsharded order), written and freed. Replicated tensors are written from rank 0's copy.

What an interrupted save leaves (see :func:`save` for the full statement): the files go into a
temporary folder beside the target, ``.{name}.shardwise-tmp-{host}-{pid}-{token}``, which
is moved into place with one rename once it is complete, so the target is always either
absent, the previous checkpoint, or the new one whole.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from shardwise._progress import Progress
from shardwise.errors import CheckpointError
from shardwise.io.gather import (
    FileGatherer,
    agree,
    capture,
    collect_items,
    fingerprint,
    world_backend,
)
from shardwise.io.safetensors_io import INDEX_SUFFIX, _fsync_dir, index_json, plan_files

if TYPE_CHECKING:
    from shardwise.io.dcp import AsyncSave

_TMP_MARK, _OLD_MARK = ".shardwise-tmp-", ".shardwise-old-"
# safetensors' serializer orders a file's tensors by dtype (its enum order, descending),
# then by name; we follow it so that a one-file save of a model is byte-identical to
# save_file(state_dict, metadata={"format": "pt"}).
_SAVE_FILE_DTYPES = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16",
                     "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")


def save(model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
         filename_prefix: str = "model", metadata: Mapping[str, str] | None = None,
         overwrite: bool = False, progress: bool | None = None, distributed: bool = False,
         async_save: bool = False) -> AsyncSave | None:
    """Write ``model`` to the folder ``path`` as an ordinary safetensors checkpoint.

    Collective: every rank calls it, rank 0 writes. The folder holds
    ``{filename_prefix}.safetensors``, or ``{prefix}-0000i-of-0000N.safetensors`` files of
    at most ``max_shard_size`` each plus ``{prefix}.safetensors.index.json``; every header
    has ``{"format": "pt"}`` and ``metadata`` (which also goes into the index). Tensors are
    canonical (unsharded, packed blocks in their own order) and tied weights are written
    once, under the name kept by the plan. A model that was not parallelised is written as
    it is by rank 0 (a world of one, or ranks holding identical copies).

    Memory: rank 0 builds one tensor at a time, in one reused buffer, from row chunks of
    every rank's shard gathered in turn (about an eighth of the tensor each), so its peak
    above its baseline stays under 2x the largest tensor (1.25-1.5x measured); other ranks
    only send their shards and never hold a full tensor.
    ``progress`` shows a bar on rank 0 (default: when stderr is a terminal; tqdm if
    installed). ``distributed=True`` writes a torch distributed checkpoint instead, every
    rank its own part (``shardwise.io.dcp.save_dcp``; ``max_shard_size`` and
    ``filename_prefix`` do not apply); with ``async_save=True`` too it returns a handle
    whose ``wait()`` every rank calls. The gather save returns None.

    Crash safety: everything is written into ``.{name}.shardwise-tmp-*`` beside ``path``
    (same filesystem) and renamed into place when complete; a folder already at ``path``
    is an error unless ``overwrite=True`` (an empty folder counts as absent), and is then
    exchanged for the new one in one atomic rename (Linux ``renameat2``; elsewhere renamed
    aside first, a window that the next save repairs) and only then deleted. ``overwrite``
    refuses a folder holding anything but checkpoint files, so that it never deletes, say,
    a ``config.json``. If a rank dies or any rank fails: ``path`` is untouched (absent, or
    the previous checkpoint byte for byte), every surviving rank raises, and rank 0 removes
    its temporary folder; one left by a killed rank 0 is removed by the next save to
    ``path``. A temporary folder never sits at a path a loader would look at, its files
    appear only once fsynced, and a several-file checkpoint gets its index last.

    >>> sw.save(model, "out/full", max_shard_size="2GB")                    # doctest: +SKIP
    >>> sw.load(model2, "out/full", plan=plan, mesh=backend.mesh(tp=2))     # doctest: +SKIP
    """
    if async_save and not distributed:
        raise ValueError("async_save=True writes a distributed checkpoint; pass distributed=True too")
    if distributed:
        return _save_dcp(model, path, overwrite=overwrite, metadata=metadata, progress=progress,
                         async_save=async_save)
    from shardwise.io.guards import check_model

    check_model(model, action="save")
    target = _target_path(path)
    header_meta = _header_metadata(metadata)
    items, state = collect_items(model)
    file_plan = [(fname, sorted(group, key=_save_file_order)) for fname, group in
                 plan_files([(i.name, i.dtype, i.shape) for i in items], max_shard_size, filename_prefix)]
    backend = world_backend()
    run = FileGatherer(backend, state, {i.name: i for i in items}, header_meta)
    what = f"sw.save to {target}"
    dest = _Destination(target, overwrite) if run.rank == 0 else None
    index = None
    if len(file_plan) > 1:
        index = (filename_prefix + INDEX_SUFFIX,
                 index_json(file_plan, sum(i.nbytes for i in items), dict(metadata or {})))
    try:
        agree(backend, capture(dest.prepare) if dest else None, what=what,
              digest=fingerprint((run.degree, file_plan, [(i.name, i.spec) for i in items])))
        with Progress(sum(i.nbytes for i in items), progress, run.rank == 0, "shardwise save") as bar:
            for fname, group in file_plan:
                bar.file(fname)
                error = run.write_file(dest.tmp / fname if dest else None, group, bar)
                agree(backend, error, what=what)
        agree(backend, capture(lambda: dest.commit(index)) if dest else None, what=what)
    finally:
        if dest is not None:
            dest.discard()


def _save_dcp(model, path, **kwargs):
    try:
        from shardwise.io.dcp import save_dcp
    except ImportError as e:
        raise ImportError(f"sw.save(..., distributed=True) needs shardwise.io.dcp, which cannot be "
                          f"imported here ({e}); save without distributed=True for a safetensors "
                          "checkpoint") from e
    return save_dcp(model, path, **kwargs)


def _target_path(path) -> Path:
    target = Path(os.path.abspath(os.fspath(path)))
    if target.name in ("", ".", ".."):
        raise CheckpointError(f"path {os.fspath(path)!r} must name a folder to create, not the root")
    return target


def _header_metadata(metadata) -> dict[str, str]:
    metadata = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"metadata must map strings to strings, got {metadata!r:.200}")
    if metadata.get("format", "pt") != "pt":
        raise CheckpointError(f"metadata['format'] is {metadata['format']!r}; a torch safetensors "
                              "checkpoint says 'pt' there, which loaders check; drop the key")
    return {"format": "pt", **metadata}


def _save_file_order(spec) -> tuple[int, str]:
    name, dtype, _ = spec
    rank = _SAVE_FILE_DTYPES.index(dtype) if dtype in _SAVE_FILE_DTYPES else len(_SAVE_FILE_DTYPES)
    return rank, name


class _Destination:
    """The target folder and the temporary folder beside it; used on rank 0 only."""

    def __init__(self, target: Path, overwrite: bool):
        self.target, self.overwrite = target, overwrite
        self.tmp: Path | None = None

    def prepare(self) -> None:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(self.target)
        _check_target(self.target, self.overwrite)
        self.tmp = self.target.parent / f".{self.target.name}{_TMP_MARK}{_owner()}-{secrets.token_hex(4)}"
        self.tmp.mkdir()

    def commit(self, index: tuple[str, dict] | None) -> None:
        """Write the index ``(file name, content)`` if any, last; then move the folder into place."""
        if index is not None:
            with open(self.tmp / index[0], "w") as f:
                f.write(json.dumps(index[1], indent=2, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        target = self.target
        if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
            target.rmdir()  # an empty folder holds nothing to keep
        if not target.exists() and not target.is_symlink():
            _rename_noreplace(self.tmp, target)
        elif self.overwrite:
            _check_target(target, True)
            _exchange(self.tmp, target, self.tmp.name.replace(_TMP_MARK, _OLD_MARK))
            shutil.rmtree(self.tmp)  # now the previous checkpoint
        else:
            raise CheckpointError(f"{target} appeared while saving; pass overwrite=True to replace it")
        self.tmp = None
        _fsync_dir(target.parent)

    def discard(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


# What shardwise writes into a checkpoint folder (safetensors, their index, DCP's files and
# shardwise.json, the writers' hidden partial files): overwrite=True deletes nothing else.
_CHECKPOINT_FILE = re.compile(r".*\.safetensors|.*\.safetensors\.index\.json|\..*\.partial"
                              r"|\.metadata|.*\.distcp|shardwise\.json")


def _check_target(target: Path, overwrite: bool) -> None:
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
    foreign = [e.name for e in entries if not (e.is_file() and _CHECKPOINT_FILE.fullmatch(e.name))]
    if foreign:
        raise CheckpointError(
            f"overwrite=True replaces the whole folder {target}, but it also holds {foreign[0]!r}, "
            "which is not a checkpoint file; move that out first, or save to another folder")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64]


def _owner() -> str:
    return f"{_host()}-{os.getpid()}"


def _alive(owner: str) -> bool:
    """Whether the save that named a temporary folder ``{host}-{pid}-{token}`` may still run."""
    host, _, pid = owner.rpartition("-")[0].rpartition("-")
    if host != _host() or not pid.isdigit() or int(pid) == os.getpid():
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
        mark = next((m for m in (_TMP_MARK, _OLD_MARK) if entry.name.startswith(prefix + m)), None)
        if mark is None or _alive(entry.name[len(prefix + mark):]):
            continue
        if mark == _OLD_MARK and not target.exists() and not target.is_symlink():
            os.rename(entry, target)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


# --- renames: atomic where the platform has renameat2 ------------------------------------
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


@functools.cache
def _renameat2_fn():
    if sys.platform != "linux":
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


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
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _rename_noreplace(src: Path, dst: Path) -> None:
    if not _renameat2(src, dst, _RENAME_NOREPLACE):
        if dst.exists():  # os.rename would silently replace an empty folder
            raise FileExistsError(errno.EEXIST, "exists", str(dst))
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


__all__ = ["save"]
