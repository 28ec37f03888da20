"""Loading under torch_xla SPMD (holding ``"spmd"``: one process drives every device).

Load: each tensor is built on the devices from the chunks the devices hold, read off disk
(:meth:`SpmdMesh.from_chunks`): with the tp axis of degree ``d``, the device at tp position
``p`` holds the canonical chunk ``p`` of the tensor's shard dim (``ShardSpec(dim)`` at degree
``d``, whatever the packing: SPMD keeps tensors global, see ``backends/xla_spmd.py``), so a
chunk is read once however many devices replicate it, and no full tensor is assembled on the
host, only the chunks on their way to the devices. Safetensors checkpoints go through the
same :class:`~shardwise.io.reader.RegionReader` as every other load, one read item per chunk;
DCP checkpoints through the same canonical planner, a batch of tensors at a time.

Saving is ``shardwise.io.spmd_save``.
"""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan
from shardwise.core.spec import ShardSpec, local_layout, local_shape
from shardwise.io.checkpoint import resolve_checkpoint
from shardwise.io.dcp import read_checkpoint, stored_name
from shardwise.io.dcp_items import Placed
from shardwise.io.dcp_metadata import check_tensors, read_metadata
from shardwise.io.detect import is_dcp
from shardwise.io.pipeline import (
    LoadResult,
    check_nothing_left_on_meta,
    device_of,
    match_keys,
    move_non_persistent,
)
from shardwise.io.reader import WINDOW_BYTES, ReadItem, RegionReader
from shardwise.io.staging import cast, loaded_dtype
from shardwise.parallel import install, tp_axis


def chunk_reads(sources, specs, degree: int, positions: list[int]) -> tuple[list[ReadItem], dict]:
    """One read item per (tensor, chunk this process needs): ``(items, {item name: (tensor
    name, position)})``. A replicated tensor is one whole-tensor chunk at position 0. Pure."""
    items, keys = [], {}
    for name, (path, entry) in sources.items():
        spec = specs[name]
        for p in [0] if spec.replicated else positions:
            chunk = ShardSpec() if spec.replicated else ShardSpec(dim=spec.dim)
            key = f"{name}@{p}"
            keys[key] = (name, p)
            items.append(ReadItem(key, path, entry, local_layout(entry.shape, chunk, degree, p),
                                  local_shape(entry.shape, chunk, degree)))
    return items, keys


class _Builder:
    """The reader's finalize: collects a tensor's chunks, then builds it on the devices."""

    def __init__(self, tp_mesh, specs: ResolvedPlan, keys: dict, needed: dict, dtype):
        self.tp_mesh, self.specs, self.keys, self.needed, self.dtype = tp_mesh, specs, keys, needed, dtype
        self.built: dict[str, torch.Tensor] = {}
        self._pending: dict[str, dict[int, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def __call__(self, item: ReadItem, raw: torch.Tensor) -> None:
        name, position = self.keys[item.name]
        raw = cast(raw, self.dtype)
        with self._lock:  # one transfer at a time; the reads go on meanwhile
            parts = self._pending.setdefault(name, {})
            parts[position] = raw
            if len(parts) < self.needed[name]:
                return None
            del self._pending[name]
            self.built[name] = self.tp_mesh.from_chunks(parts, item.entry.shape, self.specs[name].dim,
                                                        raw.dtype, name=name)
        return None


def load_spmd(model: nn.Module, path, *, specs: ResolvedPlan, mesh, dtype, strict: bool,
              num_threads: int, start: float):
    """``sw.load`` for holding ``"spmd"`` (it dispatches here after its guards and the plan)."""
    tp_mesh = tp_axis(mesh)
    if is_dcp(path):
        built, missing, unexpected, nbytes = _read_dcp(model, path, specs, tp_mesh, dtype, strict)
    else:
        ckpt = resolve_checkpoint(path)
        sources, missing, unexpected = match_keys(model, specs, ckpt, strict=strict)
        check_nothing_left_on_meta(model, specs, missing)
        positions = tp_mesh.positions()
        items, keys = chunk_reads(sources, specs, tp_mesh.size(), positions)
        needed = {n: 1 if specs[n].replicated else len(positions) for n in sources}
        builder = _Builder(tp_mesh, specs, keys, needed, dtype)
        with RegionReader(ckpt.headers, num_threads=num_threads) as reader:
            reader.read(items, finalize=builder)
        built, nbytes = builder.built, reader.bytes_read
    own = model.state_dict(keep_vars=True) if missing else {}

    def local_tensor(name, spec):
        if name in built:
            return built.pop(name)
        return tp_mesh.distribute(cast(own[name].detach().cpu(), dtype), spec.dim)  # strict=False

    install(model, specs, mesh, holding="spmd", local_tensor=local_tensor)
    move_non_persistent(model, device_of(tp_mesh))
    return LoadResult(tuple(missing), tuple(unexpected), nbytes, time.perf_counter() - start,
                      len(specs) - len(missing))


def _read_dcp(model, path, specs: ResolvedPlan, tp_mesh, dtype, strict: bool):
    """Read the chunks of a DCP checkpoint a batch of tensors at a time (each batch about
    WINDOW_BYTES on the host), building each tensor on the devices as its batch completes."""
    metadata = read_metadata(path)
    own = model.state_dict(keep_vars=True)
    stored = metadata.state_dict_metadata
    key = {n: stored_name(n, specs, stored) for n in specs}
    missing, unexpected = check_tensors(path, metadata, {key[n]: tuple(own[n].shape) for n in specs},
                                        strict=strict, allowed_extra=specs.aliases)
    missing_names = [n for n in specs if key[n] in missing]
    check_nothing_left_on_meta(model, specs, missing_names)
    degree, positions = tp_mesh.size(), tp_mesh.positions()
    built, nbytes, batch, batch_bytes = {}, 0, {}, 0
    names = [n for n in specs if n not in missing_names]
    for i, n in enumerate(names):
        want = loaded_dtype(stored[key[n]].properties.dtype, dtype)
        batch[n] = _host_chunks(tuple(own[n].shape), specs[n], degree, positions, want)
        batch_bytes += batch[n].local.numel() * batch[n].local.element_size()
        if batch_bytes < WINDOW_BYTES and i + 1 < len(names):
            continue
        nbytes += read_checkpoint(path, metadata, {key[m]: p.local for m, p in batch.items()},
                                  {key[m]: p for m, p in batch.items()})
        for m, p in batch.items():
            chunks = {pos: p.piece(off, region.sizes) for pos, (region, off) in zip(
                [0] if specs[m].replicated else positions, p.layout, strict=True)}
            built[m] = tp_mesh.from_chunks(chunks, p.shape, specs[m].dim, p.local.dtype, name=m)
        batch, batch_bytes = {}, 0
    return built, missing_names, unexpected, nbytes


def _host_chunks(shape, spec: ShardSpec, degree: int, positions: list[int], dtype) -> Placed:
    """A host buffer holding the chunks at ``positions`` side by side along the shard dim."""
    if spec.replicated:
        return Placed(torch.empty(shape, dtype=dtype), shape, local_layout(shape, spec, 1, 0))
    chunk = ShardSpec(dim=spec.dim)
    layout, size = [], list(local_shape(shape, chunk, degree))
    for i, p in enumerate(positions):
        [(region, _)] = local_layout(shape, chunk, degree, p)
        layout.append((region, tuple(i * size[spec.dim] if d == spec.dim else 0 for d in range(len(shape)))))
    size[spec.dim] *= len(positions)
    return Placed(torch.empty(size, dtype=dtype), shape, layout)


__all__ = ["chunk_reads", "load_spmd"]
