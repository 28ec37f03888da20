"""Reading a distributed checkpoint: its metadata, unpickled with an allow-list of DCP's classes
and checked for completeness (``.metadata`` is written last: its absence, or a listed data file
missing or short, means "incomplete checkpoint") before any read; then only the chunk bytes asked
for, each blob checked against the metadata (dtype, shape, zip CRC-32) before its data is read, so
a bad blob is a ``CheckpointError``, never a cast or a shifted read."""

from __future__ import annotations

import io
import math
import os
import pickle
import zlib
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from shardwise.core.header import check_tiling, region_runs
from shardwise.core.spec import Region, is_int
from shardwise.errors import CheckpointError
from shardwise.io.formats.dcp import METADATA_FILE
from shardwise.io.formats.dcp.blob import read_blob
from shardwise.io.formats.safetensors.keys import listing
from shardwise.io.info import digest_range, tensor_checksum
from shardwise.io.storage import HandleFile, Handles, Location, byte_view, locate, read_small
from shardwise.io.storage.lookups import TMP_MARK
from shardwise.io.storage.torchfs import LocationReader

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
        except (OSError, CheckpointError) as e:  # the storage's error for a name over the OS's limit
            why = getattr(e.__cause__ or e, "strerror", None) or e
            raise CheckpointError(f"{path}: the metadata names data file {rel!r:.200}, which cannot "
                                  f"be looked up ({why})") from None
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
        chunks = []
        for c in md.chunks:
            off, sz = tuple(c.offsets), tuple(c.sizes)
            if not (len(off) == len(sz) == len(size) and all(is_int(x) and x >= 0 for x in off + sz)):
                raise CheckpointError(f"{where}: chunk offsets {off} / sizes {sz} do not fit shape {size}")
            info = storage.get(MetadataIndex(fqn, off))
            if info is None:
                raise CheckpointError(f"{where}: the chunk at {off} has no stored data in the metadata")
            nbytes = math.prod(sz) * dtype.itemsize
            if nbytes > info.length:
                raise CheckpointError(f"{where}: the chunk at {off} of sizes {sz} needs {nbytes} bytes "
                                      f"but its stored data is {info.length} bytes; the metadata is corrupt")
            chunks.append((f"{path}/{info.relative_path}", Region(off, sz)))
        check_tiling(fqn, size, chunks)


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


def read_chunk_into(f, info, offsets, lengths, dest: torch.Tensor, *, dtype: torch.dtype | None = None,
                    sizes=None) -> int:
    """Copy the box (``offsets``, ``lengths``) of the saved chunk ``info`` (a torch.save blob in
    the open file ``f``) into ``dest``; return the bytes read. Only the box's byte runs are read,
    not the whole chunk as DCP does (a chunk in another layout is read whole), after the blob is
    checked against the metadata's ``dtype`` and ``sizes`` (``CheckpointError``)."""
    where = _where(f, info)
    meta, base = open_blob(f, info, dtype=dtype, sizes=sizes)
    if base is None:
        whole = _load(f, info, "cpu")
        dest.copy_(whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))])
        return info.length
    if tuple(dest.shape) != tuple(lengths):
        raise CheckpointError(f"{where} gives a {tuple(lengths)} box for a {tuple(dest.shape)} destination")
    direct = dest.is_contiguous() and dest.dtype == meta.dtype and dest.device.type == "cpu"
    out = dest if direct else torch.empty(tuple(lengths), dtype=meta.dtype)
    runs = region_runs(tuple(meta.shape), meta.element_size(), tuple(offsets), tuple(lengths))
    buf = byte_view(out.detach())
    pos = f.handle.read_runs(buf, base, runs) if runs else 0
    if pos == meta.numel() * meta.element_size():  # the whole chunk: its zip record's CRC applies
        expected = zip_crc(f, info, meta, base)
        got = zlib.crc32(buf) if expected is not None else None
        if got != expected:
            raise CheckpointError(f"{where}: the data does not match the CRC-32 its zip record holds "
                                  f"({got:08x}, not {expected:08x}); the file is corrupt")
    if not direct:
        dest.copy_(out)
    return pos


def zip_crc(f, info, meta: torch.Tensor, base: int) -> int | None:
    """The CRC-32 the blob's zip record holds for the chunk's data (from the data descriptor
    torch.save writes); None when the chunk is part of a larger storage. A misplaced descriptor
    means the blob is corrupt."""
    nbytes = meta.numel() * meta.element_size()
    if meta.storage_offset() != 0 or meta.untyped_storage().nbytes() != nbytes:
        return None
    end = base + nbytes
    tail = f.pread(8, end) if end + 8 <= info.offset + info.length else b""
    if tail[:4] != b"PK\x07\x08":
        raise CheckpointError(f"{_where(f, info)}: no zip data descriptor after the data (at byte "
                              f"{end}); the file is corrupt")
    return int.from_bytes(tail[4:8], "little")


def _where(f, info) -> str:
    return f"{getattr(f, 'name', '?')}: a chunk at byte {info.offset}"


def open_blob(f, info, *, dtype: torch.dtype | None = None, sizes=None) -> tuple[torch.Tensor, int | None]:
    """The saved chunk ``info`` in the open file ``f`` as a meta tensor (no data read), checked
    against the ``dtype`` and ``sizes`` the metadata lists; and the file offset where its
    bytes lie in C order, or None when it is stored otherwise (then it is read whole)."""
    where = _where(f, info)
    read = read_blob(f, info.offset, info.length)  # a plain tensor's blob, without torch.load
    view = _view(f, info) if read is None else None
    meta = _load(f, info, "meta", view) if read is None else read[0]
    if not isinstance(meta, torch.Tensor):
        raise CheckpointError(f"{where} holds a {type(meta).__name__}, not a tensor")
    if dtype is not None and meta.dtype != dtype:
        raise CheckpointError(f"{where} holds {meta.dtype} data but the metadata says {dtype}; "
                              "the checkpoint is corrupt")
    if sizes is not None and tuple(meta.shape) != tuple(sizes):
        raise CheckpointError(f"{where} holds a tensor of shape {tuple(meta.shape)} but the metadata "
                              f"says {tuple(sizes)}; the checkpoint is corrupt")
    record = read[1] if read is not None else getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if record is None:  # torch before 2.10 sets it only under a fake tensor mode, not for "meta"
        record = _only_record_offset(view)
    if (record or 0) + meta.untyped_storage().nbytes() > info.length:
        raise CheckpointError(f"{where} says its data runs {meta.untyped_storage().nbytes()} bytes "
                              f"from byte {record or 0}, past the {info.length} bytes stored; the checkpoint "
                              "is corrupt")
    if record is None or not meta.is_contiguous():
        return meta, None
    return meta, info.offset + record + meta.storage_offset() * meta.element_size()


def _view(f, info):
    """The saved chunk ``info`` of the open file ``f`` as a file of its own, for torch's zip reader."""
    from torch.distributed.checkpoint.utils import _create_file_view

    stream = f.record(info.offset, info.length) if isinstance(f, HandleFile) else f  # or any binary file
    return _create_file_view(stream, info.offset, info.length)


def _load(f, info, map_location: str, view=None):
    """``torch.load`` (``weights_only``) of the saved chunk ``info`` in the open file ``f`` (through
    ``view``, one :func:`_view` of it, where given)."""
    try:
        # torch types its own _create_file_view IOBase; it is a binary file view, as torch.load takes
        return torch.load(view if view is not None else _view(f, info),
                          map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{_where(f, info)} cannot be read ({e})") from e


def _only_record_offset(view) -> int | None:
    """Where the data of a blob's one storage record starts in ``view``, from its zip directory
    (``torch.load`` already read it); None where the blob holds several storages (then it is read
    whole, as torch.load reads it)."""
    view.seek(0)
    reader = torch._C.PyTorchFileReader(view)
    data = [name for name in reader.get_all_records() if name.startswith("data/")]
    # get_record_offset: in the C++ binding (2.9 has it), not in torch's type stubs
    return reader.get_record_offset(data[0]) if len(data) == 1 else None  # type: ignore[attr-defined]


def chunk_checksum(f, info, *, dtype: torch.dtype, sizes, algorithm: str, piece: int = 16 << 20
                   ) -> tuple[str, int, str | None]:
    """``(checksum by algorithm, bytes read, zip CRC-32 or None)`` of the saved chunk's bytes in C
    order, read in pieces of at most ``piece`` bytes."""
    meta, base = open_blob(f, info, dtype=dtype, sizes=sizes)
    if base is None:
        whole = _load(f, info, "cpu")
        return tensor_checksum(whole, algorithm), whole.numel() * whole.element_size(), None
    nbytes = meta.numel() * meta.element_size()
    expected = zip_crc(f, info, meta, base)
    return (digest_range(f.handle, base, nbytes, algorithm, piece), nbytes,
            None if expected is None else f"{expected:08x}")


class MetadataReader(LocationReader):
    """torch's ``FileSystemReader`` over the storage, serving the metadata :func:`read_metadata`
    already checked and reading only each rank's bytes (:func:`read_chunk_into`; ``bytes_read``
    counts them). Storage transforms go through DCP's own reader."""

    def __init__(self, path: Location, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata
        self.bytes_read = 0
        self._chunks = {(fqn, tuple(c.offsets)): (md.properties.dtype, tuple(c.sizes))
                        for fqn, md in metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata) for c in md.chunks}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata

    def read_data(self, plan, planner):
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.distributed.checkpoint.utils import _create_file_view

        infos = {item.storage_index: self.storage_data[item.storage_index] for item in plan.items}
        if any(getattr(i, "transform_descriptors", None) for i in infos.values()):
            self.bytes_read += sum(i.length for i in infos.values())
            return super().read_data(plan, planner)
        handles = Handles()
        try:
            # file by file, each file's handle opened once
            for item in sorted(plan.items, key=lambda i: str(infos[i.storage_index].relative_path)):
                info = infos[item.storage_index]
                f = HandleFile(handles.get(self.path / str(info.relative_path)))
                if item.type == LoadItemType.BYTE_IO:
                    data = _create_file_view(f, info.offset, info.length).read()
                    self.bytes_read += len(data)
                    planner.load_bytes(item, io.BytesIO(data))
                    continue
                target = planner.resolve_tensor(item).detach()
                index = item.storage_index
                dtype, sizes = self._chunks.get((index.fqn, tuple(index.offset)), (None, None))
                self.bytes_read += read_chunk_into(f, info, item.storage_offsets, item.lengths, target,
                                                   dtype=dtype, sizes=sizes)
                planner.commit_tensor(item, target)
        finally:
            handles.close()
        done = torch.futures.Future()
        done.set_result(None)
        return done


__all__ = ["MetadataReader", "check_chunks", "check_tensors", "chunk_checksum", "open_blob",
           "read_chunk_into", "read_metadata", "zip_crc"]
