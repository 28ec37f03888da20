"""``sw.consolidate``: any checkpoint a format plugin reads (``shardwise.io.formats``: torch
DCP, sharded safetensors) written as one ordinary safetensors checkpoint, offline, in one
process, without a process group: read the Source, write safetensors.

The output is byte-identical to ``sw.save`` (the gather save) of the same model: the same
names in the same order, the same file split and naming, the same headers, index and
``shardwise.json`` (the checksums of the tensors as written); the side files beside the
source (``config.json`` & co) are copied. It is streamed: each tensor is read whole from only
its own stored bytes (``Stored.read_box``), written and freed, so memory stays near one
tensor. Every dtype works, integer and bool included. The files are written aside and moved
into place like ``sw.save``.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch

from shardwise.core.adapter import adapter_for, folder_model, side_file_names
from shardwise.core.header import dtype_to_str, str_to_dtype
from shardwise.core.pieces import StoredPart
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError
from shardwise.io.formats import get_format, open_source, save_format
from shardwise.io.info import gather_info, read_info, user_metadata
from shardwise.io.sink import FileSink, Saving, StoredTensor, WritePlan
from shardwise.io.source import Stored


def consolidation_plan(source: Stored, *, max_shard_size: int | str = "5GB", filename_prefix: str = "model",
                       layout: str = "hub") -> WritePlan:
    """The ``WritePlan`` for consolidating ``source``: the one ``sw.save`` makes for the same
    tensors (the gathered format's writer), in the hub layout (``plan.parts``: ``{stored name:
    StoredPart}``) when the source's folder holds a transformers model's config.json and
    ``layout="hub"``, else in the module's own names."""
    return _consolidation(source, max_shard_size=max_shard_size, filename_prefix=filename_prefix,
                          layout=layout)[1]


def _consolidation(source: Stored, *, max_shard_size: int | str, filename_prefix: str,
                   layout: str) -> tuple[FileSink, WritePlan]:
    """The writer of ``sw.save``'s default gathered format, configured as ``sw.save`` would
    for these tensors, and its plan of them."""
    src = source.root
    values = source.describe().values
    if values:
        raise CheckpointError(f"{src}: entries {', '.join(values[:5])} are not tensors (an optimizer "
                              "checkpoint?); consolidate writes model checkpoints only")
    specs = [(n, dtype_to_str(d), tuple(s)) for n, (d, s) in source.tensors().items()]
    if not specs:
        raise CheckpointError(f"{src}: the checkpoint holds no tensors")
    parts, storages = _hub_parts(src, specs, layout)
    stored = ([StoredTensor(p.key, p.dtype, p.shape, p) for p in parts.values()] if parts
              else [StoredTensor(*spec) for spec in specs])
    recorded = dict((read_info(src) or {}).get("index_metadata") or {})  # total_parameters
    writer = save_format(None, distributed=False).writer(
        max_shard_size=max_shard_size, prefix=filename_prefix, metadata=user_metadata(src),
        index_metadata=recorded, storages=storages)
    return writer, writer.plan(stored)


def _hub_parts(src: Path, specs: list, layout: str) -> tuple[dict, dict]:
    if layout not in ("hub", "module"):
        raise CheckpointError(f"layout must be 'hub' or 'module', got {layout!r}")
    model = folder_model(src, need=True) if layout == "hub" else None
    if model is None:
        return {}, {}
    adapter = adapter_for(model)
    parts = adapter.save_layout(model, {n: (s, d) for n, d, s in specs}) or []
    sizes = {n: str_to_dtype(d).itemsize for n, d, _ in specs}
    return {p.key: p for p in parts}, adapter.shared_storages(parts, sizes)


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the side files (``core.adapter.side_file_names``: a Hugging Face model's
    ``config.json`` & co) that ``src`` holds into ``dst``; their names."""
    copied = []
    for name in side_file_names():
        if (src / name).is_file() and not (src / name).is_symlink():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


class _WholeTensors:
    """Whole stored tensors of a Source, and the hub layout's tensors assembled from them;
    each stored tensor a hub tensor needs is read once and kept until its last box is written."""

    def __init__(self, source: Stored, parts: Mapping[str, StoredPart]):
        self.source, self.parts = source, parts
        self.shapes = {n: s for n, (_, s) in source.tensors().items()}
        self._held: dict[str, torch.Tensor] = {}
        self._uses = Counter(n for p in parts.values() for n, _ in p.fragments)

    def whole(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        return self.source.read_box(name, Region((0,) * len(shape), tuple(shape)))

    def __call__(self, name: str) -> torch.Tensor:
        part = self.parts.get(name)
        if part is None:
            return self.whole(name)
        whole = part.assemble(self._kept)
        assert whole is not None  # assemble gives None only when a fragment is None; _kept never is
        return whole

    def _kept(self, name: str) -> torch.Tensor:
        if name not in self._held:
            self._held[name] = self.whole(name)
        full = self._held[name]
        self._uses[name] -= 1
        if self._uses[name] == 0:
            del self._held[name]
        return full


def consolidate(src: str | os.PathLike, dst: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                filename_prefix: str = "model", overwrite: bool = False, layout: str = "hub") -> Path:
    """Write the distributed checkpoint ``src`` (torch DCP, or sharded safetensors) as a
    safetensors checkpoint in the folder ``dst``; one process, no process group. Returns ``dst``.

    ``max_shard_size`` and ``filename_prefix`` split and name the files as ``sw.save`` does
    (``{prefix}.safetensors``, or ``{prefix}-0000i-of-0000N.safetensors`` plus an index).
    ``dst`` must not exist unless ``overwrite=True``. A transformers model's checkpoint (its
    config.json beside the data) is written in its hub layout, as ``save_pretrained`` and
    ``sw.save`` write it; ``layout="module"`` keeps the module's own names. The side files
    beside ``src`` are copied. A DCP ``.metadata`` is a pickle: consolidate only checkpoints
    whose source you trust.

    >>> sw.consolidate("out/dcp", "out/merged", max_shard_size="2GB")   # doctest: +SKIP
    """
    threads = torch.get_num_threads()
    source = open_source(src)
    try:
        if get_format(source.name) is save_format(None, distributed=False):
            _refuse_plain_safetensors(Path(src))
        writer, plan = _consolidation(source, max_shard_size=max_shard_size, filename_prefix=filename_prefix,
                                      layout=layout)
        tensor = _WholeTensors(source, plan.parts)
        # The copies are memory-bound: one thread moves them as fast, while a pool of OpenMP
        # threads waiting on each other was up to 10x slower on a busy machine. Reading the next
        # tensor on a second thread while this one is written did not pay either (measured,
        # docs/benchmarks.md "consolidate"): writing the tensors alone (save_file + fsync) took
        # 0.9-1.4x a whole consolidation, the disk being the limit, and the reader thread's malloc
        # arena returned and faulted in again memory that one thread reuses (sharded safetensors:
        # 1.2-1.5x the time, 2.5x the peak).
        torch.set_num_threads(1)
        with Saving(dst, overwrite=overwrite, backend=None, what=f"sw.consolidate to {dst}",
                    collective=False) as saving:
            checksums: dict[str, str] = {}
            for planned in plan.files:
                out = writer.open_file(saving.folder / planned.name, planned.tensors, plan.header)
                try:
                    for name, _, _ in planned.tensors:
                        out.write(name, tensor(name))
                    out.close()
                finally:
                    out.abort()  # a no-op after close
                checksums.update(out.checksums)
            saving.commit(info=gather_info(checksums, plan.tensors),
                          side_files=lambda folder: _copy_side_files(source.root, folder), index=plan.index)
        return saving.target
    finally:
        torch.set_num_threads(threads)
        source.close()


def _refuse_plain_safetensors(src: Path) -> None:
    """An ordinary safetensors checkpoint (no DCP ``.metadata``) has nothing to consolidate."""
    files = [src] if src.suffix == ".safetensors" and src.is_file() else (
        sorted(src.glob("*.safetensors")) if src.is_dir() else [])
    if files:
        raise CheckpointError(
            f"{src} is already a safetensors checkpoint ({len(files)} .safetensors file(s), no DCP "
            ".metadata): consolidate turns a distributed checkpoint into one, so there is nothing to "
            "do; load or copy it as it is (sw.load, from_pretrained), or `shardwise inspect` it")


__all__ = ["consolidate", "consolidation_plan"]
