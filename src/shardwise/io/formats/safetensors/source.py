"""The :class:`~shardwise.io.source.Source` of ordinary safetensors checkpoints: one file, or
an index and its files, tensors in the model's names or in a hub layout (transformers'
conversion mapping: one model tensor assembled from several stored tensors), FP8 weights
with block scales kept quantized (the scales split along with their weights) or dequantized
per rank (``io.formats.safetensors.quantized``).

Every rank reads only the bytes of its own regions of each tensor (the whole tensor when it
is replicated) through :class:`~shardwise.io.formats.safetensors.reader.RegionReader`; no collective runs,
except that dp replicas (``io.replicas``) read each region once and send it to the others, and
that over an object store the job reads each byte once and the ranks exchange (``io.exchange``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch
from torch import nn

from shardwise.core.pieces import Composite, piece_reads
from shardwise.core.plan import ResolvedPlan
from shardwise.core.quant_layout import scale_layout, scale_local_shape
from shardwise.core.spec import local_layout, local_shape
from shardwise.io.exchange import exchanges, read_exchanged
from shardwise.io.formats.safetensors.checkpoint import resolve_checkpoint
from shardwise.io.formats.safetensors.keys import match_keys
from shardwise.io.formats.safetensors.quantized import Dequantized, Dequantizer
from shardwise.io.formats.safetensors.reader import ReadItem, RegionReader, cpu_views, plan_reads
from shardwise.io.formats.safetensors.stored import SafetensorsStored
from shardwise.io.replicas import read_once
from shardwise.io.source import Finalize, ReadOptions, Reads, Want
from shardwise.io.storage import Location


class SafetensorsSource(SafetensorsStored):
    """A safetensors checkpoint (a file, a folder, an index) read region by region."""

    def __init__(self, path: Location, *, dequantize: bool = False):
        super().__init__(path, resolve_checkpoint(path))
        self.dequantize = dequantize  # FP8 tensors with block scales into plain model tensors
        self.bytes_read = 0
        self._sources: dict = {}  # model name -> (file, entry), Composite or Dequantized, from match

    def match(self, model: nn.Module, specs: ResolvedPlan, *, strict: bool) -> tuple[list[str], list[str]]:
        self._sources, missing, unexpected = match_keys(model, specs, self.ckpt, strict=strict,
                                                        dequantize=self.dequantize)
        return missing, unexpected

    def plan(self, wants: Mapping[str, Want]) -> Reads:
        plain = {k: w for k, w in wants.items() if isinstance(self._sources[w.name], tuple)}
        items = [_scale_read(key, self._sources[w.name], w) for key, w in plain.items() if w.tie is not None]
        items += [item for key, w in plain.items() if w.tie is None for item in plan_reads(
            {key: self._sources[w.name]}, {key: w.spec}, w.degree, w.rank)]
        assembler = Assembler({k: (self._sources[w.name], w) for k, w in wants.items()
                               if isinstance(self._sources[w.name], Composite)})
        dequantizer = Dequantizer({k: (self._sources[w.name], w) for k, w in wants.items()
                                   if isinstance(self._sources[w.name], Dequantized)})
        items += assembler.items + dequantizer.items
        whole = {k for k, w in plain.items() if w.spec.replicated}
        return Reads(wants, sum(i.nbytes for i in items), (items, assembler, dequantizer, whole))

    def read(self, reads: Reads, *, finalize: Finalize, options: ReadOptions,
             on_bytes: Callable[[int], None] | None = None) -> dict:
        items, assembler, dequantizer, whole = reads.detail
        dequantizer.dtype = options.dtype
        viewable = cpu_views(options.device, options.dtype) if options.device is not None else None
        # a storage that reads once per job: the ranks fetch slabs and exchange (io.exchange)
        job = options.mesh if exchanges(self.root.storage, options.mesh) else None
        with RegionReader(self.ckpt.headers, num_threads=options.num_threads, viewable=viewable,
                          on_bytes=on_bytes if job is None else None) as reader:
            def take(item, raw):
                if item.name in dequantizer.parts:
                    return dequantizer.take(item, raw, finalize)
                return assembler.take(item, raw, finalize)

            try:
                if job is not None:
                    tensors = read_exchanged(reader, items, finalize=take, dims=job, on_bytes=on_bytes)
                elif options.replicas is None:
                    tensors = reader.read(items, finalize=take)
                else:  # dp replicas: each region is read by one of them and sent to the others
                    tensors = read_once(reader, items, finalize=take, dims=options.replicas,
                                        whole=whole, on_bytes=on_bytes)
            finally:
                self.bytes_read += reader.bytes_read
        out = {k: t for k, t in tensors.items() if k not in assembler.parts and k not in dequantizer.parts}
        out |= {k: finalize(k, t) for k, t in assembler.empty.items()}
        return out | assembler.done | dequantizer.done


def _scale_read(key: str, source, want: Want) -> ReadItem:
    """The read of a block-quantized weight's scales, split along with their weight."""
    path, entry = source
    tie = want.tie
    assert tie is not None  # plan() reads the scales of the wants with a tie only
    return ReadItem(key, path, entry, scale_layout(tie, want.spec, want.degree, want.rank),
                    scale_local_shape(tie, want.spec, want.degree, want.rank))


class Assembler:
    """Reads of tensors made of several stored tensors (hub layouts), and their assembly.

    ``items`` are one :class:`ReadItem` per overlap of a wanted local tensor's regions with a
    stored tensor (:func:`shardwise.core.pieces.piece_reads`); :meth:`take` copies each read
    box into its place in the local tensor and finalizes it when its last box arrives.
    """

    def __init__(self, composites: Mapping[str, tuple[Composite, Want]]):
        self.items: list[ReadItem] = []
        self.done: dict = {}
        self.empty: dict[str, torch.Tensor] = {}  # keys of empty tensors: nothing to read
        self.parts: set[str] = set()  # names of the items that are boxes of a composite
        self._place: dict[str, tuple[str, tuple[slice, ...]]] = {}
        self._pending: dict[str, list] = {}  # key -> [buffer or None, reads left, shape, dtype]
        self._lock = threading.Lock()
        for key, (comp, want) in composites.items():
            shape = local_shape(comp.shape, want.spec, want.degree)
            reads = piece_reads(local_layout(comp.shape, want.spec, want.degree, want.rank), comp.pieces)
            self._pending[key] = [None, len(reads), shape, comp.entry.torch_dtype]
            if not reads:
                self.empty[key] = torch.empty(shape, dtype=comp.entry.torch_dtype)
            for i, (piece, src, off) in enumerate(reads):
                path, entry = comp.stored[piece.key]
                it = iter(src.sizes)
                box = [1 if d in piece.stacked else next(it) for d in range(len(off))]
                item = ReadItem(f"{key}#{i}", path, entry, [(src, (0,) * len(src.sizes))], src.sizes)
                self.items.append(item)
                self.parts.add(item.name)
                self._place[item.name] = (key, tuple(slice(o, o + n) for o, n in zip(off, box, strict=True)))

    def take(self, item: ReadItem, raw: torch.Tensor, finalize: Finalize):
        if item.name not in self._place:
            return finalize(item.name, raw)
        key, where = self._place.pop(item.name)
        with self._lock:
            state = self._pending[key]
            if state[0] is None:
                state[0] = torch.empty(state[2], dtype=state[3])
            buf = state[0]
        buf[where].copy_(raw.view(buf[where].shape))
        with self._lock:
            state[1] -= 1
            last = state[1] == 0
        if last:
            self.done[key] = finalize(key, self._pending.pop(key)[0])
        return None


__all__ = ["Assembler", "SafetensorsSource"]
