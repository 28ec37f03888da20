"""What the offline tools (``consolidate``, ``verify``, ``diff``, ``inspect``) ask of a torch
DCP checkpoint: its tensors, boxes of them (from only the chunks that overlap), its
description and its chunks' bytes to checksum. :class:`~shardwise.io.formats.dcp.checkpoint.DcpSource`
inherits it.

Each chunk's bytes are read straight into the tensor being assembled
(:func:`~shardwise.io.formats.dcp.chunks.read_chunk_into`, which checks the blob against the
metadata and its zip record's CRC-32 as torch.load does) rather than unpickled into a new
tensor and copied, as ``dcp.load`` does; that copy was a third of a consolidation's time. A
checkpoint written with storage transforms (DCP's experimental extensions) goes through
``dcp.load``. The ``.metadata`` is a pickle (unpickled with an allow-list): trust its source.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from shardwise.core.spec import Region, intersect
from shardwise.io.formats.dcp.chunks import MetadataReader, chunk_checksum, read_chunk_into
from shardwise.io.formats.dcp.metadata import read_metadata
from shardwise.io.info import chunk_key, read_info
from shardwise.io.source import Blob, Description
from shardwise.io.storage import HandleFile, Handles, Location


class DcpStored:
    """The offline half of the DCP Source: ``self.metadata`` is the checked metadata of the
    checkpoint folder ``root`` (an incomplete checkpoint raises on opening)."""

    name = "dcp"

    def __init__(self, path: Location):
        self.root = path
        self.metadata = read_metadata(path)
        self._handles = Handles()

    def _file(self, rel: str) -> HandleFile:
        return HandleFile(self._handles.get(self.root / rel))

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        md = self.metadata.state_dict_metadata
        return {k: (m.properties.dtype, tuple(m.size)) for k, m in md.items()
                if isinstance(m, TensorStorageMetadata)}

    def use_module_names(self, wanted: set[str]) -> None:
        pass  # a distributed checkpoint stores the module's names

    def read_box(self, name: str, box: Region) -> torch.Tensor:
        md = cast(TensorStorageMetadata, self.metadata.state_dict_metadata[name])  # one of tensors()
        dtype = md.properties.dtype
        infos = [(c, self.metadata.storage_data[MetadataIndex(name, c.offsets)]) for c in md.chunks]
        if any(getattr(info, "transform_descriptors", None) for _, info in infos):
            return self._through_dcp_load(name)[box.slices()].clone()
        out = torch.empty(box.sizes, dtype=dtype)
        for chunk, info in infos:
            stored = Region(tuple(chunk.offsets), tuple(chunk.sizes))
            both = intersect(box, stored)
            if both is None or both.numel == 0:
                continue  # read_metadata checked that the chunks tile the tensor
            dest = out[Region(tuple(b - o for b, o in zip(both.offsets, box.offsets, strict=True)),
                              both.sizes).slices()]
            in_chunk = tuple(b - c for b, c in zip(both.offsets, stored.offsets, strict=True))
            read_chunk_into(self._file(str(info.relative_path)), info, in_chunk, both.sizes, dest,
                            dtype=dtype, sizes=stored.sizes)
        return out

    def _through_dcp_load(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        md = cast(TensorStorageMetadata, self.metadata.state_dict_metadata[name])  # one of tensors()
        out = torch.empty(md.size, dtype=md.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({name: out}, storage_reader=MetadataReader(self.root, self.metadata), no_dist=True)
        return out

    def describe(self) -> Description:
        md = self.metadata.state_dict_metadata
        values = tuple(n for n, m in md.items() if not isinstance(m, TensorStorageMetadata))
        files = tuple(sorted({str(info.relative_path) for info in self.metadata.storage_data.values()}))
        return Description("torch distributed checkpoint (DCP)", files, layout=read_info(self.root),
                           values=values, chunks={n: len(m.chunks) for n, m in md.items()
                                                                   if isinstance(m, TensorStorageMetadata)})

    def blobs(self) -> Iterator[Blob]:
        for name, md in self.metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            dtype = md.properties.dtype
            for chunk in md.chunks:
                info = self.metadata.storage_data[MetadataIndex(name, chunk.offsets)]

                def digest(algorithm: str, info=info, sizes=tuple(chunk.sizes), dtype=dtype):
                    got, _, zipped = chunk_checksum(self._file(str(info.relative_path)), info, dtype=dtype,
                                                    sizes=sizes, algorithm=algorithm)
                    return got, zipped

                nbytes = math.prod(chunk.sizes) * dtype.itemsize
                yield Blob(name, chunk_key(chunk.offsets), nbytes, digest, own=True)

    def close(self) -> None:
        self._handles.close()


__all__ = ["DcpStored"]
