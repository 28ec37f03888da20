"""The two sides of ``sw.diff``: any checkpoint read as rows of canonical tensors.

One class per format (safetensors files, a DCP folder, rank-local safetensors with
DCP_SHARDING_INFO), each with ``tensors`` (``{name: (dtype, shape)}``), ``rows(name, lo,
hi)`` (rows ``[lo, hi)`` of one tensor, read from only the stored boxes that hold them),
``use_module_names``, ``close`` and ``root`` (the folder whose config.json describes it).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardwise.core.pieces import piece_reads
from shardwise.core.spec import Region, intersect
from shardwise.io.dcp.sharded import is_sharded_safetensors, read_sharded
from shardwise.io.detect import is_dcp
from shardwise.io.files import open_regular
from shardwise.io.safetensors.checkpoint import resolve_checkpoint
from shardwise.io.safetensors.format import read_region
from shardwise.io.safetensors.hub_layout import hub_tensors, model_from_folder


class _Safetensors:
    """Rows of the tensors of a safetensors checkpoint (validated headers, pread of boxes)."""

    def __init__(self, path: Path):
        self.ckpt = resolve_checkpoint(path)
        self.root = self.ckpt.root
        self.tensors = {n: (self.ckpt.entry(n)[1].torch_dtype, self.ckpt.entry(n)[1].shape)
                        for n in self.ckpt.names}
        self._fds: dict[Path, int] = {}
        self.composites: dict = {}  # module name -> hub_layout.Composite (see use_module_names)

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = open_regular(file)
        return self._fds[file]

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        if name in self.composites:
            return self._composite_rows(self.composites[name], lo, hi)
        file, entry = self.ckpt.entry(name)
        offsets, sizes = _slab(entry.shape, lo, hi)
        out = torch.empty(sizes, dtype=entry.torch_dtype)
        read_region(self._fd(file), self.ckpt.headers[file], entry, offsets, sizes, out)
        return out

    def use_module_names(self, wanted: set[str]) -> None:
        """Show the tensors of ``wanted`` (module names the other side has and this one
        lacks) that this checkpoint stores in a transformers hub layout, in place of the
        stored tensors they are built from; nothing changes when the folder's config.json
        names no transformers model (or transformers is absent)."""
        model = model_from_folder(self.ckpt.root) if wanted else None
        if model is None:
            return
        self.composites, used = hub_tensors(model, {k: self.ckpt.entry(k) for k in self.ckpt.names}, wanted)
        for key in used:
            self.tensors.pop(key, None)
        self.tensors.update({n: (c.entry.torch_dtype, c.shape) for n, c in self.composites.items()})

    def _composite_rows(self, comp, lo: int, hi: int) -> torch.Tensor:
        offsets, sizes = _slab(comp.shape, lo, hi)
        out = torch.empty(sizes, dtype=comp.entry.torch_dtype)
        layout = [(Region(offsets, sizes), (0,) * len(sizes))]
        for piece, src, off in piece_reads(layout, comp.pieces):
            file, entry = comp.stored[piece.key]
            part = torch.empty(src.sizes, dtype=entry.torch_dtype)
            read_region(self._fd(file), self.ckpt.headers[file], entry, src.offsets, src.sizes, part)
            it = iter(src.sizes)
            box = [1 if d in piece.stacked else next(it) for d in range(len(off))]
            out[tuple(slice(o, o + n) for o, n in zip(off, box, strict=True))] = part.view(box)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _Dcp:
    """Rows of the tensors of a DCP checkpoint, from only the chunks that overlap them."""

    def __init__(self, path: Path):
        # imported on use here and in rows: torch.distributed.checkpoint takes ~0.5 s to import,
        # which a diff of safetensors checkpoints should not pay
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from shardwise.io.dcp.metadata import read_metadata

        self.path, self.metadata = path, read_metadata(path)
        self.root = path
        self.tensors = {n: (md.properties.dtype, tuple(md.size))
                        for n, md in self.metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}
        self._files: dict[str, object] = {}

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        from shardwise.io.dcp.chunks import read_chunk_into

        md = self.metadata.state_dict_metadata[name]
        offsets, sizes = _slab(tuple(md.size), lo, hi)
        out = torch.empty(sizes, dtype=md.properties.dtype)
        for chunk in md.chunks:
            start = tuple(max(a, b) for a, b in zip(offsets, chunk.offsets, strict=True))
            end = tuple(min(a + n, b + m) for a, n, b, m in
                        zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True))
            if any(s >= e for s, e in zip(start, end, strict=True)):
                continue  # no overlap (read_metadata checked that the chunks tile the tensor)
            both = tuple(e - s for s, e in zip(start, end, strict=True))
            info = self.metadata.storage_data[MetadataIndex(name, chunk.offsets)]
            rel = str(info.relative_path)
            if rel not in self._files:
                self._files[rel] = open(self.path / rel, "rb")  # noqa: SIM115 - closed by close()
            dest = out[Region(tuple(s - o for s, o in zip(start, offsets, strict=True)), both).slices()]
            in_chunk = tuple(s - o for s, o in zip(start, chunk.offsets, strict=True))
            read_chunk_into(self._files[rel], info, in_chunk, both, dest,
                            dtype=md.properties.dtype, sizes=tuple(chunk.sizes))
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def use_module_names(self, wanted: set[str]) -> None:
        pass  # a distributed checkpoint stores module names


class _Sharded(_Safetensors):
    """Rows of the tensors of a distributed checkpoint in safetensors (rank-local files with
    DCP_SHARDING_INFO), read from only the chunks that overlap them."""

    def __init__(self, path: Path):
        self.ckpt = read_sharded(path)  # validated: every tensor tiled exactly by its chunks
        self.root = self.ckpt.root
        self.tensors = {n: (t.torch_dtype, t.shape) for n, t in self.ckpt.tensors.items()}
        self._fds = {}
        self.composites = {}

    def use_module_names(self, wanted: set[str]) -> None:
        pass  # torch's and transformers' distributed writers store module names

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        tensor = self.ckpt.tensors[name]
        offsets, sizes = _slab(tensor.shape, lo, hi)
        want = Region(offsets, sizes)
        out = torch.empty(sizes, dtype=tensor.torch_dtype)
        for chunk in tensor.chunks:
            both = intersect(want, chunk.region)
            if both is None:
                continue
            if chunk.path not in self._fds:
                self._fds[chunk.path] = open_regular(chunk.path)
            part = torch.empty(both.sizes, dtype=tensor.torch_dtype)
            in_chunk = tuple(b - c for b, c in zip(both.offsets, chunk.region.offsets, strict=True))
            read_region(self._fds[chunk.path], self.ckpt.headers[chunk.path], chunk.entry, in_chunk,
                        both.sizes, part)
            out[Region(tuple(b - o for b, o in zip(both.offsets, offsets, strict=True)),
                       both.sizes).slices()] = part
        return out


def _slab(shape: tuple[int, ...], lo: int, hi: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of rows ``[lo, hi)`` of a tensor of ``shape`` (the whole of a 0-d tensor)."""
    if not shape:
        return (), ()
    return (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:])


def open_side(path: Path):
    """The reader of the checkpoint at ``path``, by its format."""
    if path.is_dir() and is_sharded_safetensors(path):
        return _Sharded(path)
    return _Dcp(path) if is_dcp(path) else _Safetensors(path)


__all__ = ["open_side"]
