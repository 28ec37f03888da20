"""``sw.consolidate``: any checkpoint a format plugin reads, written offline as one ordinary
safetensors checkpoint, byte-identical to ``sw.save``'s of the same model. Streamed: each
tensor is read from its own stored bytes, written and freed."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from shardwise._progress import Progress
from shardwise.core.adapter import adapter_for, folder_model, side_file_names
from shardwise.core.header import dtype_to_str, str_to_dtype
from shardwise.core.spec import Region, ShardSpec
from shardwise.errors import CheckpointError
from shardwise.io.formats import checkpoint_files, get_format, open_source, save_format
from shardwise.io.gather import FileGatherer, SaveItem
from shardwise.io.info import gather_info, read_info
from shardwise.io.sink import FileSink, Saving, StoredTensor, WritePlan
from shardwise.io.source import Stored
from shardwise.io.storage import Location, locate, read_small, split_scheme, target_path, write_small


def consolidation_plan(source: Stored, *, max_shard_size: int | str = "5GB", filename_prefix: str = "model",
                       layout: str = "hub") -> tuple[FileSink, WritePlan]:
    """The writer of ``sw.save``'s default gathered format, configured as ``sw.save`` would
    for ``source``'s tensors, and the ``WritePlan`` ``sw.save`` makes for them: in the hub
    layout (``plan.parts``) when the folder holds a model's config.json and ``layout="hub"``,
    else in the stored names."""
    src = source.root
    values = source.describe().values
    if values:
        raise CheckpointError(f"{src}: entries {', '.join(values[:5])} are not tensors (an optimizer "
                              "checkpoint?); consolidate writes model checkpoints only")
    specs = [(n, dtype_to_str(d), tuple(s)) for n, (d, s) in source.tensors().items()]
    if not specs:
        raise CheckpointError(f"{src}: the checkpoint holds no tensors")
    if layout not in ("hub", "module"):
        raise CheckpointError(f"layout must be 'hub' or 'module', got {layout!r}")
    model = folder_model(src, need=True) if layout == "hub" else None
    stored, storages = [StoredTensor(*spec) for spec in specs], {}
    if model is not None:
        adapter = adapter_for(model)
        parts = adapter.save_layout(model, {n: (s, d) for n, d, s in specs}) or []
        sizes = {n: str_to_dtype(d).itemsize for n, d, _ in specs}
        unique = {p.key: p for p in parts}.values()
        stored = [StoredTensor(p.key, p.dtype, p.shape, p) for p in unique] or stored
        storages = adapter.shared_storages(parts, sizes)
    info = read_info(src) or {}
    writer = save_format(None, distributed=False).writer(
        max_shard_size=max_shard_size, prefix=filename_prefix, metadata=dict(info.get("metadata") or {}),
        index_metadata=dict(info.get("index_metadata") or {}), storages=storages)  # total_parameters
    return writer, writer.plan(stored)


def _copy_side_files(src: Location, dst: Location) -> list[str]:
    """Copy the side files (``config.json`` & co) that ``src`` holds, not through a link out of
    it, into ``dst``; their names."""
    copied = []
    for name in side_file_names():
        if (src / name).stat() is None:
            continue
        try:
            src.storage.check_inside(src, src / name, source=src)
        except CheckpointError:
            continue
        write_small(dst / name, read_small(src / name, what="a side file"))
        copied.append(name)
    return copied


class _WholeItems(Mapping[str, SaveItem]):
    """The stored tensors of ``source`` as the unsharded items (``SaveItem``) a ``FileGatherer`` writes,
    each read whole from its own stored bytes when it is looked up."""

    def __init__(self, source: Stored):
        self.source, self.shapes = source, {n: tuple(s) for n, (_, s) in source.tensors().items()}

    def __getitem__(self, name: str) -> SaveItem:
        shape = self.shapes[name]
        whole = self.source.read_box(name, Region((0,) * len(shape), shape))
        return SaveItem(name, dtype_to_str(whole.dtype), shape, ShardSpec(), False, whole)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def consolidate(src: str | os.PathLike, dst: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                filename_prefix: str = "model", overwrite: bool = False, layout: str = "hub",
                storage_options: dict | None = None, dst_storage_options: dict | None = None) -> Path | str:
    """Write the distributed checkpoint ``src`` (DCP or sharded safetensors) as a safetensors
    checkpoint in the folder ``dst``; one process, no process group. Returns ``dst`` (a ``Path``
    when local, else its URL). ``storage_options``: ``src``'s storage's; ``dst_storage_options``:
    ``dst``'s (default: the same). ``max_shard_size``, ``filename_prefix`` as in ``sw.save``;
    ``dst`` must not exist unless ``overwrite=True``. A transformers checkpoint is written in its
    hub layout unless ``layout="module"``. DCP's ``.metadata`` is a pickle: trust its source.

    >>> sw.consolidate("out/dcp", "out/merged", max_shard_size="2GB")   # doctest: +SKIP"""
    if storage_options and split_scheme(src)[0] is None and split_scheme(dst)[0] is None:
        locate(src, storage_options)  # the UsageError: options for two local paths
    src_at = locate(src, storage_options if split_scheme(src)[0] else None)
    dst_options = storage_options if dst_storage_options is None else dst_storage_options
    dst_at = target_path(locate(dst, dst_options if split_scheme(dst)[0] else None))  # decoded once
    threads = torch.get_num_threads()
    source = open_source(src_at)
    try:
        if get_format(source.name) is save_format(None, distributed=False):
            _refuse_plain_safetensors(src_at)
        writer, plan = consolidation_plan(source, max_shard_size=max_shard_size,
                                          filename_prefix=filename_prefix, layout=layout)
        what = f"sw.consolidate to {dst_at}"
        run = FileGatherer(None, None, _WholeItems(source), plan, open_file=writer.open_file)
        # The copies are memory-bound: one thread moves them as fast, while a pool of OpenMP
        # threads was up to 10x slower on a busy machine; a second reader thread did not pay
        # either (docs/benchmarks.md "consolidate": the disk is the limit).
        torch.set_num_threads(1)
        with Saving(dst_at, overwrite=overwrite, backend=None, what=what, collective=False,
                    replaceable=checkpoint_files()) as saving:
            checksums = run.write(saving.folder, Progress(0, progress=False, active=False, desc=""),
                                  what=what)
            saving.commit(info=gather_info(checksums, plan.tensors),
                          side_files=lambda folder: _copy_side_files(source.root, folder), index=plan.index)
        target = saving.target
        return target.local_path("the result") if target.scheme is None else str(target)
    finally:
        torch.set_num_threads(threads)
        source.close()


def _refuse_plain_safetensors(src: Location) -> None:
    """An ordinary safetensors checkpoint (no DCP ``.metadata``) has nothing to consolidate."""
    files = [src] if src.suffix == ".safetensors" and src.stat() is not None else src.glob("*.safetensors")
    if files:
        raise CheckpointError(
            f"{src} is already a safetensors checkpoint ({len(files)} .safetensors file(s), no DCP "
            ".metadata): consolidate turns a distributed checkpoint into one, so there is nothing to "
            "do; load or copy it as it is (sw.load, from_pretrained), or `shardwise inspect` it")


__all__ = ["consolidate", "consolidation_plan"]
