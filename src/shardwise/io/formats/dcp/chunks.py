"""Reading the chunks of a distributed checkpoint: only the bytes asked for, each blob checked
against the metadata (dtype, shape, zip CRC-32) before its data is read, so a bad blob is a
``CheckpointError``, never a cast or a shifted read.
"""

from __future__ import annotations

import io
import zlib

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardwise.core.header import region_runs
from shardwise.errors import CheckpointError
from shardwise.io.info import digest_range, tensor_checksum
from shardwise.io.storage import HandleFile, Handles, Location, byte_view
from shardwise.io.storage.torchfs import LocationReader


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
    meta = _load(f, info, "meta")
    if not isinstance(meta, torch.Tensor):
        raise CheckpointError(f"{where} holds a {type(meta).__name__}, not a tensor")
    if dtype is not None and meta.dtype != dtype:
        raise CheckpointError(f"{where} holds {meta.dtype} data but the metadata says {dtype}; "
                              "the checkpoint is corrupt")
    if sizes is not None and tuple(meta.shape) != tuple(sizes):
        raise CheckpointError(f"{where} holds a tensor of shape {tuple(meta.shape)} but the metadata "
                              f"says {tuple(sizes)}; the checkpoint is corrupt")
    record = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if (record or 0) + meta.untyped_storage().nbytes() > info.length:
        raise CheckpointError(f"{where} says its data runs {meta.untyped_storage().nbytes()} bytes "
                              f"from byte {record or 0}, past the {info.length} bytes stored; the checkpoint "
                              "is corrupt")
    if record is None or not meta.is_contiguous():
        return meta, None
    return meta, info.offset + record + meta.storage_offset() * meta.element_size()


def _load(f, info, map_location: str):
    """``torch.load`` (``weights_only``) of the saved chunk ``info`` in the open file ``f``."""
    from torch.distributed.checkpoint.utils import _create_file_view

    try:
        # torch types its own _create_file_view IOBase; it is a binary file view, as torch.load takes
        return torch.load(_create_file_view(f, info.offset, info.length),  # type: ignore[arg-type]
                          map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{_where(f, info)} cannot be read ({e})") from e


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


__all__ = ["MetadataReader", "chunk_checksum", "open_blob", "read_chunk_into",
           "zip_crc"]
