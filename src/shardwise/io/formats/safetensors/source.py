"""The :class:`~shardwise.io.source.Source` of ordinary safetensors checkpoints: one file, or an
index and its files; tensors in the model's names or in a hub layout (a ``Composite`` of stored
tensors); FP8 weights with block scales kept quantized or dequantized per rank (``quantized``).
Every rank reads only the bytes of its own regions (the whole tensor when replicated), with no
collective, except in the load's shared read modes (``io.read.modes``: dp replicas read each
region once, an object store's bytes are read once per job and exchanged).
The offline tools (consolidate, verify, diff, inspect) read boxes, descriptions and checksums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from shardwise.core.adapter import adapter_for, folder_model
from shardwise.core.pieces import Composite
from shardwise.core.plan import ResolvedPlan
from shardwise.core.spec import Region, local_layout, local_shape
from shardwise.io.formats.safetensors.checkpoint import resolve_checkpoint
from shardwise.io.formats.safetensors.files import INDEX_SUFFIX
from shardwise.io.formats.safetensors.keys import match_keys
from shardwise.io.formats.safetensors.quantized import Dequantized, Dequantizer
from shardwise.io.info import digest_range
from shardwise.io.read.mapped import read_region
from shardwise.io.read.modes import read_items
from shardwise.io.read.reader import (
    Assembly,
    ReadItem,
    cpu_views,
    piece_items,
    read_composite_box,
    want_layout,
)
from shardwise.io.source import Blob, Description, Finalize, ReadOptions, Reads, Want
from shardwise.io.storage import Handles, Location


class SafetensorsSource:
    """A safetensors checkpoint (a file, a folder, an index) read region by region;
    ``dequantize``: FP8 tensors with block scales into plain model tensors."""

    name = "safetensors"

    def __init__(self, path: Location, *, dequantize: bool = False):
        self.path, self.ckpt = path, resolve_checkpoint(path)
        self.dequantize = dequantize
        self.bytes_read = 0
        self._sources: dict = {}  # model name -> (file, entry), Composite or Dequantized, from match
        self._handles = Handles()
        self._shown: dict[str, Composite] = {}  # module name -> hub composite (use_module_names)
        self._hidden: set[str] = set()  # stored keys the composites are built from

    @property
    def root(self) -> Location:
        return self.ckpt.root

    def match(self, model: nn.Module, specs: ResolvedPlan, *, strict: bool) -> tuple[list[str], list[str]]:
        self._sources, missing, unexpected = match_keys(model, specs, self.ckpt, strict=strict,
                                                        dequantize=self.dequantize)
        return missing, unexpected

    def plan(self, wants: Mapping[str, Want]) -> Reads:
        scales: list[ReadItem] = []
        plain: list[ReadItem] = []
        assembly, dequantized = Assembly(), {}
        for key, w in wants.items():
            source = self._sources[w.name]
            if isinstance(source, Dequantized):
                dequantized[key] = (source, w)
            elif isinstance(source, Composite):
                assembly.add(key, local_shape(source.shape, w.spec, w.degree), source.entry.torch_dtype,
                             piece_items(key, source, local_layout(source.shape, w.spec, w.degree, w.rank)))
            else:  # a block-quantized weight's scales are split along with their weight
                path, entry = source
                shape, layout = want_layout(entry.shape, w)
                (plain if w.tie is None else scales).append(ReadItem(key, path, entry, layout, shape))
        dequantizer = Dequantizer(dequantized)
        items = scales + plain + assembly.items + dequantizer.assembly.items
        whole = {k for k, w in wants.items()
                 if isinstance(self._sources[w.name], tuple) and w.spec.replicated}
        return Reads(wants, sum(i.nbytes for i in items), (items, assembly, dequantizer, whole))

    def read(self, reads: Reads, *, finalize: Finalize, options: ReadOptions,
             on_bytes: Callable[[int], None] | None = None) -> dict:
        items, assembly, dequantizer, whole = reads.detail
        dequantizer.dtype = options.dtype
        viewable = cpu_views(options.device, options.dtype) if options.device is not None else None
        assembled: dict = {}

        def take(item, raw):
            if item.name in dequantizer.assembly.parts:
                return dequantizer.take(item, raw, finalize)
            if item.name not in assembly.parts:
                return finalize(item.name, raw)
            got = assembly.take(item, raw)
            if got is not None:
                assembled[got[0]] = finalize(*got)
            return None

        # read in the load's mode (io.read.modes): own regions, shared by replicas, or once per job
        tensors, nbytes = read_items(self.ckpt.headers, items, finalize=take, options=options, whole=whole,
                                     on_bytes=on_bytes, viewable=viewable)
        self.bytes_read += nbytes
        parts = assembly.parts.keys() | dequantizer.assembly.parts.keys()
        out = {k: t for k, t in tensors.items() if k not in parts}
        out |= {k: finalize(k, t) for k, t in assembly.empty.items()}
        return out | assembled | dequantizer.done

    # --- the offline tools: consolidate, verify, diff, inspect ---

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        entries = {n: self.ckpt.entry(n)[1] for n in self.ckpt.names if n not in self._hidden}
        shown = {n: (e.torch_dtype, e.shape) for n, e in entries.items()}
        return shown | {n: (c.entry.torch_dtype, c.shape) for n, c in self._shown.items()}

    def use_module_names(self, wanted: set[str]) -> None:
        model = folder_model(self.ckpt.root) if wanted else None
        if model is None:  # no transformers model named by config.json, or no transformers
            return
        stored = {k: self.ckpt.entry(k) for k in self.ckpt.names}
        composites, used = adapter_for(model).stored_tensors(model, stored, wanted)
        self._shown.update(composites)
        self._hidden.update(used)

    def read_box(self, name: str, box: Region) -> torch.Tensor:
        comp = self._shown.get(name)
        if comp is not None:
            return read_composite_box(self._handles, self.ckpt.headers, comp, box)
        file, entry = self.ckpt.entry(name)
        out = torch.empty(box.sizes, dtype=entry.torch_dtype)
        read_region(self._handles.get(file), self.ckpt.headers[file], entry, box.offsets, box.sizes, out)
        return out

    def describe(self) -> Description:
        ckpt = self.ckpt
        sharded = (len(ckpt.files) > 1 or self.path.name.endswith(".json")
                   or bool(ckpt.root.glob("*" + INDEX_SUFFIX)))
        listed = set(ckpt.weight_map)
        problems = []
        for file, header in ckpt.headers.items():
            unlisted = [n for n in header.entries if n not in listed]
            if unlisted:
                problems.append(f"{file}: holds {len(unlisted)} tensor(s) the index does not list "
                                f"({', '.join(map(repr, unlisted[:5]))}); the index is stale")
        metadata = dict(ckpt.headers[ckpt.files[0]].metadata) if ckpt.files else {}
        return Description("safetensors, sharded" if sharded else "safetensors, one file",
                           tuple(f.name for f in ckpt.files), metadata, problems=tuple(problems))

    def blobs(self) -> Iterator[Blob]:
        by_file: dict[Location, list[str]] = {}
        for name, file in self.ckpt.weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            header = self.ckpt.headers[file]
            for name in sorted(names, key=lambda n: header.entries[n].start):  # in file order
                entry = header.entries[name]

                def digest(algorithm: str, file=file, start=header.data_start + entry.start,
                           nbytes=entry.nbytes) -> tuple[str, None]:
                    return digest_range(self._handles.get(file), start, nbytes, algorithm), None

                yield Blob(name, None, entry.nbytes, digest)

    def close(self) -> None:
        self._handles.close()


__all__ = ["SafetensorsSource"]
