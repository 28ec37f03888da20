"""A distributed checkpoint's metadata, unpickled with an allow-list of DCP's classes and
checked for completeness (``.metadata`` is written last: its absence, or a listed data file
missing or short, means "incomplete checkpoint") before any read."""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from shardwise.core.spec import Region, is_int, overlapping
from shardwise.errors import CheckpointError
from shardwise.io.formats.dcp import METADATA_FILE
from shardwise.io.formats.safetensors.keys import listing
from shardwise.io.storage import Location, locate, read_small
from shardwise.io.storage.transaction import TMP_MARK

_METADATA_CAP = 1 << 32  # bytes: far above any model's metadata, below what would exhaust memory
_META_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    # DCP writes .metadata with pickle; only the classes such a file holds may be built,
    # so a planted file cannot name os.system or similar.
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _META_MODULE:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise CheckpointError(
            f"the DCP .metadata names {module}.{name}, which a DCP metadata file never needs; "
            "refusing to unpickle it (the file was not written by torch.distributed.checkpoint, "
            "or was tampered with)")


def read_metadata(path: Location | str | os.PathLike) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint folder ``path``. Raises ``CheckpointError`` when it is
    incomplete, a file is a symlink out of the folder, or the chunks do not tile a tensor."""
    path = locate(path)  # a str or path: the tools' and tests' door
    if not path.is_folder():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    meta = path / METADATA_FILE
    if meta.stat() is None:
        partial = [n for n in path.parent.list() if n.startswith(f".{path.name}{TMP_MARK}")]
        hint = f" ({partial[0]} beside it is an unfinished save)" if partial else ""
        raise CheckpointError(
            f"{path}: incomplete checkpoint: no {METADATA_FILE}{hint}. A DCP save writes it last, "
            "so the save that wrote this folder never finished (or this is not a DCP checkpoint); "
            "save again or load an earlier checkpoint")
    path.storage.check_inside(path, meta, source=meta)
    try:
        raw = read_small(meta, what="the DCP metadata", cap=_METADATA_CAP)
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except CheckpointError as e:
        raise CheckpointError(f"{meta}: {e}") from e
    except Exception as e:
        raise CheckpointError(f"{meta}: incomplete checkpoint: the metadata cannot be read ({e})") from e
    # getattr: a flipped byte in the pickle can rename an attribute
    if (not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict)
            or not isinstance(getattr(metadata, "state_dict_metadata", None), dict)):
        raise CheckpointError(f"{meta}: not a DCP metadata file ({type(metadata).__name__})")
    try:
        _check_files(path, metadata)
        check_chunks(path, metadata)
    except (AttributeError, TypeError, ValueError, KeyError, IndexError, OverflowError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{meta}: the metadata is malformed ({type(e).__name__}: {e}); the "
                              "file is corrupt or was not written by torch.distributed.checkpoint") from e
    return metadata


def _check_files(path: Location, metadata: Metadata) -> None:
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        rel = str(info.relative_path)
        if not rel or "/" in rel or "\\" in rel or "\0" in rel or rel in (".", ".."):
            raise CheckpointError(f"{path}: the metadata names data file {rel!r}, outside the folder")
        if not (is_int(info.offset) and is_int(info.length) and info.offset >= 0 and info.length >= 0):
            raise CheckpointError(f"{path}: the metadata gives data file {rel!r} the byte range "
                                  f"offset={info.offset!r} length={info.length!r}; the file is corrupt")
        need[rel] = max(need.get(rel, 0), info.offset + info.length)
    bad = []
    for rel, size in sorted(need.items()):
        f = path / rel
        try:
            have = f.stat()
        except OSError as e:  # a name over the OS's length limit
            raise CheckpointError(f"{path}: the metadata names data file {rel!r:.200}, which cannot "
                                  f"be looked up ({e.strerror})") from None
        if have is None:
            bad.append(f"{rel} is missing")
            continue
        path.storage.check_inside(path, f, source=path / METADATA_FILE)
        if have < size:
            bad.append(f"{rel} has {have} bytes, fewer than the {size} listed")
    if bad:
        raise CheckpointError(f"{path}: incomplete checkpoint: {'; '.join(bad[:5])}"
                              f"{' ...' if len(bad) > 5 else ''}; save again or load an earlier checkpoint")


def check_chunks(path: Location, metadata: Metadata) -> None:
    """Raise ``CheckpointError`` (naming tensor and chunk) unless every tensor is tiled exactly once
    by its chunks, each inside its tensor and backed by a blob at least its size."""
    storage = metadata.storage_data
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise CheckpointError(f"{path}: value {fqn!r} has no stored data in the metadata")
            continue
        where = f"{path}: tensor {fqn!r}"
        dtype, size = md.properties.dtype, tuple(md.size)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{where}: dtype {dtype!r} is not a torch dtype")
        if not all(is_int(d) and d >= 0 for d in size):
            raise CheckpointError(f"{where}: shape {size!r} must be non-negative ints")
        boxes, volume = [], 0
        for c in md.chunks:
            off, sz = tuple(c.offsets), tuple(c.sizes)
            if not (len(off) == len(sz) == len(size) and all(is_int(x) and x >= 0 for x in off + sz)):
                raise CheckpointError(f"{where}: chunk offsets {off} / sizes {sz} do not fit shape {size}")
            if any(o + n > d for o, n, d in zip(off, sz, size, strict=True)):
                raise CheckpointError(f"{where}: chunk at {off} of sizes {sz} reaches outside shape {size}")
            info = storage.get(MetadataIndex(fqn, off))
            if info is None:
                raise CheckpointError(f"{where}: the chunk at {off} has no stored data in the metadata")
            nbytes = math.prod(sz) * dtype.itemsize
            if nbytes > info.length:
                raise CheckpointError(f"{where}: the chunk at {off} of sizes {sz} needs {nbytes} bytes "
                                      f"but its stored data is {info.length} bytes; the metadata is corrupt")
            volume += math.prod(sz)
            boxes.append(Region(off, sz))
        if volume != math.prod(size):
            raise CheckpointError(f"{where} of shape {size} is not covered by its chunks "
                                  f"({volume} of {math.prod(size)} elements)")
        if not size and len(boxes) > 1:
            raise CheckpointError(f"{where}: a 0-d tensor has {len(boxes)} chunks")
        pair = overlapping(boxes)
        if pair is not None:
            a, b = boxes[pair[0]], boxes[pair[1]]
            raise CheckpointError(f"{where}: chunks at {a.offsets} (sizes {a.sizes}) and {b.offsets} "
                                  f"(sizes {b.sizes}) overlap; the metadata is corrupt")


def check_tensors(path, metadata: Metadata, wanted: Mapping[str, tuple[int, ...]], *,
                  strict: bool, allowed_extra=()) -> tuple[list[str], list[str]]:
    """Compare the checkpoint's tensors with ``wanted`` ({key: canonical shape}); return the missing
    and unexpected keys. Raises ``CheckpointError`` for a shape or kind mismatch and, with
    ``strict``, for missing or unexpected keys."""
    md = metadata.state_dict_metadata
    missing = [k for k in wanted if k not in md]
    if missing and strict:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint: "
                              f"{listing([repr(k) for k in missing])}; load the checkpoint that "
                              "matches this model, or pass strict=False to keep the model's values")
    wrong = []
    for k, shape in wanted.items():
        m = md.get(k)
        if m is None:
            continue
        if not isinstance(m, TensorStorageMetadata):
            wrong.append(f"{k!r} is not a tensor in the checkpoint")
        elif tuple(m.size) != tuple(shape):
            wrong.append(f"{k!r} is {tuple(m.size)} in the checkpoint but {tuple(shape)} in the model")
    if wrong:
        raise CheckpointError(f"{path}: {len(wrong)} tensor(s) do not match the model: "
                              f"{listing(wrong)}; load a checkpoint of this model's configuration")
    allowed = set(allowed_extra)
    extra = [k for k in md if k not in wanted and k not in allowed]
    if extra and strict:
        raise CheckpointError(f"{path}: {len(extra)} checkpoint tensor(s) have no place in the model: "
                              f"{listing([repr(k) for k in extra])}; pass strict=False to ignore them")
    return missing, extra

