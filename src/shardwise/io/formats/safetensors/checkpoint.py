"""Checkpoint folders: which safetensors file holds each tensor, validated before use: a
``.safetensors`` file, a folder holding one, a folder with its ``*.safetensors.index.json`` (any
prefix), or the index itself. Index file names must stay inside the folder; pickled weights are
refused with how to convert them. Nothing here ever unpickles.
"""

from __future__ import annotations

import contextvars
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath

from shardwise.core.header import FileHeader, TensorEntry
from shardwise.errors import CheckpointError
from shardwise.io.formats.safetensors.files import INDEX_SUFFIX, read_header
from shardwise.io.storage import HandleFile, Location, locate, read_json

_PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})


def _pickle_error(path: Location, *, index: Location | None = None) -> CheckpointError:
    where = f"{index}: weight_map names {path.name}" if index else str(path)
    kind = _non_safetensors_kind(path)
    if kind is None:  # not a format torch.load reads: its recipe would not help
        return CheckpointError(f"{where}: not safetensors, the only format shardwise reads; convert "
                               "it to .safetensors with the tool that wrote it")
    return CheckpointError(
        f"{where}: {kind}, not safetensors (shardwise never unpickles); if you trust its source, "
        f"convert it once: sd = torch.load({str(path)!r}, weights_only=True); safetensors.torch."
        "save_file({k: v.clone(memory_format=torch.contiguous_format) for k, v in sd.items()}, "
        f"{str(path.parent / 'model.safetensors')!r})"
    )


def _non_safetensors_kind(path: Location) -> str | None:
    """What the first bytes of ``path`` say it is: torch.save's zip or a bare pickle (both what
    ``torch.load`` reads), or None (unknown, or unreadable)."""
    try:
        handle = path.open()
        try:
            head = HandleFile(handle).pread(4, 0)
        finally:
            handle.close()
    except (OSError, CheckpointError):
        return "a pickle by its name" if path.suffix in (".pkl", ".pickle") else None
    if head.startswith(b"PK\x03\x04"):
        return "a torch.save archive (holding a pickle)"
    if head[:1] == b"\x80":
        return "a pickle"
    return None


# --- folders and indexes --------------------------------------------------------------------

@dataclass
class Checkpoint:
    """A resolved safetensors checkpoint: which file holds each tensor, and every header (the
    ``KeyedCheckpoint`` that ``shardwise.io.formats.safetensors.keys.match_keys`` reads)."""

    root: Location
    files: list[Location]
    weight_map: dict[str, Location]
    headers: dict[Location, FileHeader]

    def entry(self, name: str) -> tuple[Location, TensorEntry]:
        """The file holding tensor ``name`` and its header entry."""
        try:
            path = self.weight_map[name]
        except KeyError:
            raise CheckpointError(
                f"{self.root}: the checkpoint has no tensor {name!r} ({len(self.weight_map)} tensors)"
            ) from None
        return path, self.headers[path].entries[name]

    @property
    def names(self) -> list[str]:
        return list(self.weight_map)

    @property
    def total_size(self) -> int:
        """Bytes of all tensors in the weight map."""
        return sum(self.headers[p].entries[n].nbytes for n, p in self.weight_map.items())


def _shard_path(root: Location, fname: str, *, index: Location) -> Location:
    pure = PurePosixPath(fname)
    if (not fname or "\\" in fname or "\0" in fname or pure.is_absolute()
            or PureWindowsPath(fname).anchor or ".." in pure.parts):
        raise CheckpointError(
            f"{index}: weight_map names the file {fname!r}, which is not a relative name inside "
            f"{root}; refusing to read outside the checkpoint folder"
        )
    path = root / fname
    if pure.suffix in _PICKLE_SUFFIXES:
        raise _pickle_error(path, index=index)
    if not fname.endswith(".safetensors"):
        raise CheckpointError(f"{index}: weight_map names {fname!r}, which is not a .safetensors file")
    try:
        regular = path.stat() is not None  # raises, not None, for a name over the OS's length limit
    except (OSError, CheckpointError) as e:  # the storage's error for a name over the OS's limit
        why = getattr(e.__cause__ or e, "strerror", None) or e
        raise CheckpointError(f"{index}: weight_map names the file {fname!r:.200}, which cannot be "
                              f"looked up ({why}); the index is corrupt") from None
    if not regular:
        raise CheckpointError(
            f"{index}: weight_map names {fname!r}, but {path} does not exist or is not a regular file"
        )
    root.storage.check_inside(root, path, source=index)
    return path


def _from_index(index: Location) -> Checkpoint:
    root = index.parent
    root.storage.check_inside(root, index, source=index)
    wm = read_json(index, what="the index").get("weight_map")
    if not (isinstance(wm, dict) and wm
            and all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items())):
        raise CheckpointError(
            f"{index}: 'weight_map' must be a non-empty object mapping tensor names to file names"
        )
    files = {fname: _shard_path(root, fname, index=index) for fname in dict.fromkeys(wm.values())}
    headers = _read_headers(list(files.values()))
    owner: dict[str, Location] = {}
    for path, header in headers.items():
        for name in header.entries:
            if name in owner:
                raise CheckpointError(f"{index}: tensor {name!r} is stored in both {owner[name]} and {path}")
            owner[name] = path
    for name, fname in wm.items():
        if name not in headers[files[fname]].entries:
            raise CheckpointError(
                f"{index}: weight_map puts tensor {name!r} in {fname}, which has no such tensor"
            )
    weight_map = {name: files[fname] for name, fname in wm.items()}
    return Checkpoint(root, list(files.values()), weight_map, headers)


def _read_headers(paths: list[Location]) -> dict[Location, FileHeader]:
    """Every file's header, in order. Where each read is a round trip (``fetch_once``: an object
    store) the files' two small GETs each run at once, not one file after another: sequential,
    a many-file checkpoint paid 2 x files round trips before its first data byte. The threads run
    in this thread's context, so they share a load's ``one_look`` answers."""
    if len(paths) < 2 or not getattr(paths[0].storage, "fetch_once", False):
        return {path: read_header(path) for path in paths}
    with ThreadPoolExecutor(min(len(paths), 16), thread_name_prefix="shardwise-headers") as pool:
        futures = [pool.submit(contextvars.copy_context().run, read_header, path) for path in paths]
        # in order: the first file that fails names the error
        return {path: future.result() for path, future in zip(paths, futures, strict=True)}


def _single(path: Location) -> Checkpoint:
    header = read_header(path)
    return Checkpoint(path.parent, [path], {name: path for name in header.entries}, {path: header})


def _resolve_dir(root: Location) -> Checkpoint:
    indexes = root.glob("*" + INDEX_SUFFIX)
    if len(indexes) > 1:
        raise CheckpointError(
            f"{root}: several index files ({', '.join(p.name for p in indexes)}); pass the one to load"
        )
    if indexes:
        return _from_index(indexes[0])
    files = root.glob("*.safetensors")
    if len(files) > 1:
        raise CheckpointError(
            f"{root}: {len(files)} .safetensors files ({', '.join(p.name for p in files[:4])}"
            f"{', ...' if len(files) > 4 else ''}) but no "
            f"*{INDEX_SUFFIX}; pass one file, or add an index naming which file holds each tensor"
        )
    if files:
        root.storage.check_inside(root, files[0], source=root)
        return _single(files[0])
    pickles = [p for p in root.glob("*") if p.suffix in _PICKLE_SUFFIXES]
    if pickles:
        raise _pickle_error(pickles[0])
    raise CheckpointError(f"{root}: no .safetensors file or *{INDEX_SUFFIX} in this folder")


def resolve_checkpoint(path: Location | str | os.PathLike) -> Checkpoint:
    """Find and validate the safetensors checkpoint at ``path``: a ``.safetensors`` file, an
    ``*.safetensors.index.json``, or a folder holding one of them. Every header (and the index)
    is validated before anything is read.

    >>> ckpt = resolve_checkpoint(locate("ckpt/"))             # doctest: +SKIP
    >>> ckpt.entry("blocks.0.attn.to_q.weight")                 # doctest: +SKIP
    (Location('ckpt/model-00001-of-00002.safetensors'), TensorEntry(...))
    """
    path = locate(path)  # a str or path: the tools' and tests' door
    try:
        if not path.exists():
            raise CheckpointError(f"{path}: no such checkpoint file or folder")
        if path.is_folder():
            return _resolve_dir(path)
        if path.name.endswith(INDEX_SUFFIX):
            return _from_index(path)
        if path.suffix == ".safetensors":
            return _single(path)
    except OSError as e:  # a name too long, a permission, an I/O error: name the file
        where = e.filename if e.filename is not None else path
        raise CheckpointError(f"{path}: cannot read the checkpoint: {where}: {e.strerror or e}") from e
    if path.suffix in _PICKLE_SUFFIXES:
        raise _pickle_error(path)
    raise CheckpointError(f"{path}: not a .safetensors file, a *{INDEX_SUFFIX} or a folder holding them")


__all__ = ["Checkpoint", "resolve_checkpoint"]
