"""Reading sharded safetensors checkpoints: :class:`ShardedSource` for ``sw.load`` at any degree
and for the offline tools. :func:`plan_chunk_reads` (pure) names, for each overlap of a wanted
region with a chunk, the box of the chunk's entry to read and where it lands; the loader's
``RegionReader`` reads exactly those byte runs."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from shardwise.core.spec import Layout, Region, intersect, local_layout
from shardwise.io.formats.safetensors.files import read_region
from shardwise.io.formats.safetensors.keys import match_keys
from shardwise.io.formats.safetensors.reader import ReadItem, RegionReader
from shardwise.io.formats.sharded.checkpoint import (
    SHARDING_INFO_KEY,
    ShardedCheckpoint,
    ShardedTensor,
    read_sharded,
)
from shardwise.io.info import chunk_key, digest_range
from shardwise.io.source import Blob, Description, Finalize, ReadOptions, Reads, Want
from shardwise.io.storage import Handles, Location

Request = tuple[ShardedTensor, Layout]


def local_extent(layout: Layout) -> tuple[int, ...]:
    """The local tensor's shape: the layout's regions tile it exactly."""
    ndim = len(layout[0][0].sizes)
    return tuple(max(off[d] + r.sizes[d] for r, off in layout) for d in range(ndim))


def plan_chunk_reads(tensor: ShardedTensor, layout: Layout, *,
                     tag: str = "") -> list[tuple[ReadItem, Region]]:
    """The reads giving the local tensor of ``layout`` (regions of ``tensor`` with their
    offsets in the local tensor): for each overlap of a region with a chunk, a
    :class:`ReadItem` of that box of the chunk's entry, and the box's place in the local
    tensor. Only chunks that overlap a region are read. Pure.

    >>> [(i.path.name, dest) for i, dest in plan_chunk_reads(t, layout)]      # doctest: +SKIP
    [('shard-00001-model-00001-of-00001.safetensors', Region(offsets=(0, 0), sizes=(16, 32)))]
    """
    reads: list[tuple[ReadItem, Region]] = []
    for region, off in layout:
        for chunk in tensor.chunks:
            box = intersect(region, chunk.region)
            if box is None or box.numel == 0:
                continue
            start = zip(box.offsets, chunk.region.offsets, strict=True)
            in_chunk = Region(tuple(b - c for b, c in start), box.sizes)
            place = zip(off, box.offsets, region.offsets, strict=True)
            dest = Region(tuple(o + b - r for o, b, r in place), box.sizes)
            item = ReadItem(f"{tag or tensor.name}#{len(reads)}", chunk.path, chunk.entry,
                            [(in_chunk, (0,) * len(box.sizes))], box.sizes)
            reads.append((item, dest))
    return reads


class _Assembly:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, remaining: int):
        self.shape, self.dtype, self.remaining = shape, dtype, remaining
        self.out: torch.Tensor | None = None
        self.lock = threading.Lock()


class ShardedReader:
    """Local tensors of a :class:`ShardedCheckpoint`, read box by box; a context manager
    owning the reader's file descriptors.

    >>> with ShardedReader(read_sharded("out/hf_dcp"), num_threads=4) as reader:   # doctest: +SKIP
    ...     local = reader.read({"w": (ckpt.tensors["w"], layout)}, finalize=lambda k, t: t)["w"]
    """

    def __init__(self, ckpt: ShardedCheckpoint, *, num_threads: int,
                 on_bytes: Callable[[int], None] | None = None):
        self.ckpt = ckpt
        self._reader = RegionReader(ckpt.headers, num_threads=num_threads, on_bytes=on_bytes)

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._reader.close()

    @property
    def bytes_read(self) -> int:
        return self._reader.bytes_read

    def read(self, requests: Mapping[str, Request], *, finalize: Finalize) -> dict[str, torch.Tensor]:
        """``{key: finalize(key, local tensor)}`` for ``requests`` (``{key: (tensor, layout)}``).
        ``finalize`` runs on the reader's threads, once per key, as each tensor completes."""
        results: dict[str, torch.Tensor] = {}
        owner: dict[str, tuple[str, Region, _Assembly | None]] = {}
        items: list[ReadItem] = []
        for key, (tensor, layout) in requests.items():
            shape = local_extent(layout) if layout else ()
            reads = plan_chunk_reads(tensor, layout, tag=key)
            if not reads:  # an empty tensor: nothing to read
                results[key] = finalize(key, torch.empty(shape, dtype=tensor.torch_dtype))
                continue
            direct = len(reads) == 1 and reads[0][0].local_shape == shape
            assembly = None if direct else _Assembly(shape, tensor.torch_dtype, len(reads))
            for item, dest in reads:
                owner[item.name] = (key, dest, assembly)
                items.append(item)

        def done(item: ReadItem, raw: torch.Tensor) -> None:
            key, dest, assembly = owner[item.name]
            if assembly is None:
                results[key] = finalize(key, raw)
                return
            with assembly.lock:
                if assembly.out is None:
                    assembly.out = torch.empty(assembly.shape, dtype=assembly.dtype)
                out = assembly.out
            out[dest.slices()].copy_(raw)  # boxes are disjoint: no lock needed
            with assembly.lock:
                assembly.remaining -= 1
                last = assembly.remaining == 0
            if last:
                assembly.out = None
                results[key] = finalize(key, out)

        self._reader.read(items, finalize=done)
        return results

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` on the CPU, in its stored dtype."""
        t = self.ckpt.tensors[name]
        zeros = (0,) * len(t.shape)
        return self.read({name: (t, [(Region(zeros, t.shape), zeros)])}, finalize=lambda k, x: x)[name]


class ShardedSource:
    """The ``Source`` of a sharded safetensors checkpoint: chunk map validated on opening, keys and
    shapes matched before any read, each rank reading only the chunk bytes overlapping its
    regions; no collective. ``close`` releases the read handles."""

    name = "sharded"

    def __init__(self, path: Location):
        self.ckpt = read_sharded(path)
        self.root = self.ckpt.root
        self.bytes_read = 0
        self._sources: dict = {}
        self._handles = Handles()

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {t.name: (t.torch_dtype, t.shape) for t in ordered_tensors(self.ckpt)}

    def match(self, model: nn.Module, specs, *, strict: bool) -> tuple[list[str], list[str]]:
        self._sources, missing, unexpected = match_keys(model, specs, self.ckpt, strict=strict)
        return missing, unexpected

    def plan(self, wants: Mapping[str, Want]) -> Reads:
        requests = {}
        for key, w in wants.items():
            t = self._sources[w.name][1]
            requests[key] = (t, local_layout(t.shape, w.spec, w.degree, w.rank))
        total = sum(sum(r.numel for r, _ in layout) * t.itemsize for t, layout in requests.values())
        return Reads(wants, total, requests)

    def read(self, reads: Reads, *, finalize: Finalize, options: ReadOptions,
             on_bytes: Callable[[int], None] | None = None) -> dict:
        with ShardedReader(self.ckpt, num_threads=options.num_threads, on_bytes=on_bytes) as reader:
            try:
                return reader.read(reads.detail, finalize=finalize)
            finally:
                self.bytes_read += reader.bytes_read

    # --- the offline tools: consolidate, verify, diff, inspect ---

    def read_box(self, name: str, box: Region) -> torch.Tensor:
        tensor = self.ckpt.tensors[name]
        out = torch.empty(box.sizes, dtype=tensor.torch_dtype)
        for item, dest in plan_chunk_reads(tensor, [(box, (0,) * len(box.sizes))]):
            part = out[dest.slices()]
            buf = part if part.is_contiguous() else torch.empty(dest.sizes, dtype=tensor.torch_dtype)
            (src, _), = item.layout
            read_region(self._handles.get(item.path), self.ckpt.headers[item.path], item.entry, src.offsets,
                        src.sizes, buf)
            if buf is not part:
                part.copy_(buf)
        return out

    def describe(self) -> Description:
        ckpt = self.ckpt
        meta = {k: v for k, v in ckpt.headers[ckpt.files[0]].metadata.items() if k != SHARDING_INFO_KEY}
        return Description("torch distributed checkpoint in safetensors (DCP_SHARDING_INFO, no pickle)",
                           tuple(f.name for f in ckpt.files), meta, layout=ckpt.info,
                           chunks={n: len(t.chunks) for n, t in ckpt.tensors.items()})

    def blobs(self) -> Iterator[Blob]:
        for name, tensor in self.ckpt.tensors.items():
            for chunk in tensor.chunks:
                def digest(algorithm: str, chunk=chunk) -> tuple[str, None]:
                    start = self.ckpt.headers[chunk.path].data_start + chunk.entry.start
                    handle = self._handles.get(chunk.path)
                    return digest_range(handle, start, chunk.entry.nbytes, algorithm), None

                yield Blob(name, chunk_key(chunk.region.offsets), chunk.entry.nbytes, digest)

    def use_module_names(self, wanted: set[str]) -> None:
        pass  # torch's and transformers' distributed writers store module names

    def close(self) -> None:
        self._handles.close()


def ordered_tensors(ckpt: ShardedCheckpoint) -> list[ShardedTensor]:
    """The model's order when shardwise recorded it (so consolidation splits files like
    ``sw.save``), else by name: the format itself keeps no order."""
    recorded = (ckpt.info or {}).get("tensors")
    if isinstance(recorded, dict) and set(recorded) == set(ckpt.tensors):
        return [ckpt.tensors[n] for n in recorded]
    return [ckpt.tensors[n] for n in sorted(ckpt.tensors)]


__all__ = ["ShardedReader", "ShardedSource", "local_extent", "ordered_tensors", "plan_chunk_reads"]
