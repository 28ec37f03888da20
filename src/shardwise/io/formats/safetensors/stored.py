"""What the offline tools (``consolidate``, ``verify``, ``diff``, ``inspect``) ask of a
safetensors checkpoint: its tensors, boxes of them, its description and its bytes to
checksum. :class:`SafetensorsSource` inherits it; every read is exactly the box's bytes,
through validated headers and the storage's read handles.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from shardwise.core.adapter import adapter_for, folder_model
from shardwise.core.pieces import Composite, piece_reads
from shardwise.core.spec import Region
from shardwise.io.formats.safetensors.checkpoint import Checkpoint
from shardwise.io.formats.safetensors.files import INDEX_SUFFIX, read_region
from shardwise.io.info import digest_range
from shardwise.io.source import Blob, Description
from shardwise.io.storage import Handles, storage_for


class SafetensorsStored:
    """The offline half of the safetensors Source: ``ckpt`` is the resolved
    :class:`~shardwise.io.formats.safetensors.checkpoint.Checkpoint` of ``path``."""

    name = "safetensors"

    def __init__(self, path: str | os.PathLike, ckpt: Checkpoint):
        self.path, self.ckpt = Path(path), ckpt
        self._handles = Handles(storage_for(self.path))
        self._shown: dict[str, Composite] = {}  # module name -> hub composite (use_module_names)
        self._hidden: set[str] = set()  # stored keys the composites are built from

    @property
    def root(self) -> Path:
        return self.ckpt.root

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
            return self._composite_box(comp, box)
        file, entry = self.ckpt.entry(name)
        out = torch.empty(box.sizes, dtype=entry.torch_dtype)
        read_region(self._handles.get(file), self.ckpt.headers[file], entry, box.offsets, box.sizes, out)
        return out

    def _composite_box(self, comp: Composite, box: Region) -> torch.Tensor:
        out = torch.empty(box.sizes, dtype=comp.entry.torch_dtype)
        for piece, src, off in piece_reads([(box, (0,) * len(box.sizes))], comp.pieces):
            file, entry = comp.stored[piece.key]
            part = torch.empty(src.sizes, dtype=entry.torch_dtype)
            read_region(self._handles.get(file), self.ckpt.headers[file], entry, src.offsets, src.sizes, part)
            it = iter(src.sizes)
            sizes = [1 if d in piece.stacked else next(it) for d in range(len(off))]
            out[tuple(slice(o, o + n) for o, n in zip(off, sizes, strict=True))] = part.view(sizes)
        return out

    def describe(self) -> Description:
        ckpt = self.ckpt
        sharded = (len(ckpt.files) > 1 or self.path.name.endswith(".json")
                   or any(ckpt.root.glob("*" + INDEX_SUFFIX)))
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
        by_file: dict[Path, list[str]] = {}
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


__all__ = ["SafetensorsStored"]
