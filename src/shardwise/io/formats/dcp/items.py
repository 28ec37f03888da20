"""Canonical chunks for torch DCP: a rank's part of a tensor (:class:`Placed`) becomes one
chunk per region at its canonical offsets (DCP's planners, subclassed, would trust a DTensor's
placements, wrong for packed shards and FSDP x TP). Block-quantized weights: each scale is
written once, by the rank owning its block, and read back in its stored dtype.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping
from typing import cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)

from shardwise.core.quant import FLOAT8, pair_of
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError
from shardwise.io.info import chunk_key, tensor_checksum
from shardwise.io.placed import Placed
from shardwise.io.read.reader import want_layout
from shardwise.io.source import Want
from shardwise.io.staging import loaded_dtype
from shardwise.io.storage.torchfs import LocationWriter


class _Canonical:
    """What both canonical planners hold: the :class:`Placed` tensors by state-dict key, and each
    piece's local offset and sizes by ``(key, canonical offsets)``."""

    def __init__(self, placed: Mapping[str, Placed]):
        super().__init__()
        self._placed = placed
        self._pieces = {(fqn, tuple(r.offsets)): (off, r.sizes)
                        for fqn, p in placed.items() for r, off in p.layout}

class CanonicalSavePlanner(_Canonical, DefaultSavePlanner):
    """DCP's default save planner, but each :class:`Placed` tensor (by state-dict key) becomes one
    write item per region at its canonical offsets; the metadata keeps the state dict's order."""

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            p = self._placed.get(fqn)
            if p is None:
                items += _create_write_items(fqn, obj)
                continue
            props = TensorProperties.create_from_tensor(p.local)
            for region, _ in p.layout:
                whole = region.sizes == p.shape
                offsets = torch.Size(region.offsets)
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, torch.Size(region.sizes)),
                                                props, torch.Size(p.shape))))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        md = metadata.state_dict_metadata
        order = [k for k in self.state_dict if k in md]
        metadata.state_dict_metadata = {k: md[k] for k in order + [k for k in md if k not in order]}
        return plans, metadata

    def resolve_data(self, write_item: WriteItem):
        fqn = write_item.index.fqn
        if fqn in self._placed:
            assert write_item.index.offset is not None  # create_local_plan gave each piece its offset
            off, sizes = self._pieces[(fqn, tuple(write_item.index.offset))]
            return _exact(self.state_dict[fqn][Region(off, sizes).slices()])
        return super().resolve_data(write_item)


def _exact(view: torch.Tensor) -> torch.Tensor:
    """``view`` over a storage of exactly its own bytes, sharing memory when it is contiguous
    (DCP's writer would clone a view of a larger storage and keep the copy until the file is done)."""
    if not view.is_contiguous() or view.untyped_storage().nbytes() == view.nbytes:
        return view
    start = view.storage_offset() * view.element_size()
    storage = view.untyped_storage()[start:start + view.nbytes]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(storage, 0, view.shape, view.stride())


class CanonicalLoadPlanner(_Canonical, DefaultLoadPlanner):
    """DCP's default load planner, but each :class:`Placed` tensor asks for its own regions (DCP's
    overlap math reads them from whatever chunks the checkpoint holds). Non-tensor values are
    unpickled with ``weights_only=True``, which refuses code."""

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # DCP calls set_up_planner with it first
        md = self.metadata.state_dict_metadata
        requests = []
        for fqn, obj in self.state_dict.items():
            p = self._placed.get(fqn)
            if p is None:
                requests += _create_read_items(fqn, md[fqn], obj)
                continue
            chunks = [ChunkStorageMetadata(torch.Size(r.offsets), torch.Size(r.sizes)) for r, _ in p.layout]
            # a Placed value is a tensor: its entry is TensorStorageMetadata
            requests += create_read_items_for_chunk_list(fqn, cast(TensorStorageMetadata, md[fqn]), chunks)
        return LoadPlan(requests)

    def resolve_tensor(self, read_item):
        fqn = read_item.dest_index.fqn
        if fqn not in self._placed:
            return super().resolve_tensor(read_item)
        view = self._placed[fqn].piece(*self._pieces[(fqn, tuple(read_item.dest_index.offset))])
        return narrow_tensor_by_index(view, read_item.dest_offsets, read_item.lengths)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"checkpoint value {fqn!r} is not a plain value "
                                  f"(weights_only load failed: {e})") from e
        set_element(self.original_state_dict, self.mappings[fqn], obj)


class _HashingPlanner:
    """A save planner whose ``resolve_data`` also hashes each tensor it hands to the writer."""

    def __init__(self, planner, writer: HashingWriter):
        self._planner, self._writer = planner, writer

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def resolve_data(self, write_item):
        data = self._planner.resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            if data.device.type != "cpu":  # one copy to the host, hashed and written from there
                data = data.detach().cpu()
            self._writer.hash(write_item.index, data)
        return data


class HashingWriter(LocationWriter):
    """DCP's file writer over the storage that records each chunk's checksum as it is written:
    :attr:`checksums` (``{name: {chunk_key(offsets): checksum}}``) is complete once
    ``write_data`` returns."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.checksums: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def hash(self, index, data: torch.Tensor) -> None:
        # Inline: XXH3 runs at memory speed, and the bytes are about to be written anyway.
        checksum = tensor_checksum(data)
        with self._lock:  # torch's writer may resolve chunks on several threads
            self.checksums.setdefault(index.fqn, {})[chunk_key(index.offset)] = checksum

    def write_data(self, plan, planner):
        return super().write_data(plan, _HashingPlanner(planner, self))


def side_by_side(shape, group: list, dtype: torch.dtype, device):
    """``(Placed, parts)``: one buffer holding the wanted local tensors of one checkpoint
    tensor along dim 0 (one want: the local tensor itself); ``parts(buffer)`` yields each
    key with its view."""
    sizes, layouts = zip(*(want_layout(shape, w) for _, w in group), strict=True)
    if len(group) == 1:
        buf = torch.empty(sizes[0], dtype=dtype, device=device)
        return Placed(buf, shape, layouts[0]), lambda local: [(group[0][0], local)]
    assert shape and all(w.tie is None for _, w in group), "several wants: chunks of a split tensor (spmd)"
    starts = [sum(s[0] for s in sizes[:i]) for i in range(len(sizes))]
    extent = (starts[-1] + sizes[-1][0],) + tuple(max(s[d] for s in sizes) for d in range(1, len(shape)))
    layout = [(region, (off[0] + start,) + tuple(off[1:]))
              for start, lay in zip(starts, layouts, strict=True) for region, off in lay]
    buf = torch.empty(extent, dtype=dtype, device=device)

    def parts(local):
        return [(key, local[(slice(start, start + s[0]),) + tuple(slice(0, n) for n in s[1:])])
                for (key, _), start, s in zip(group, starts, sizes, strict=True)]

    return Placed(buf, shape, layout), parts


def read_dtype(stored: torch.dtype, want: Want, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a wanted tensor is read in: FP8 weights and scales as stored, else ``loaded_dtype``."""
    if want.tie is not None or stored in FLOAT8:
        return stored
    return loaded_dtype(stored, dtype)


def check_fp8_match(root, stored: Mapping, keys: Mapping[str, str],
                    declared: Mapping[str, torch.dtype]) -> None:
    """Refuse a model tensor stored FP8 next to its block scales (``core.quant.pair_of``) that the
    model declares in another dtype: a cast would ignore the scales (DCP loads are not dequantized)."""
    for name, key in keys.items():
        dtype = getattr(getattr(stored.get(key), "properties", None), "dtype", None)
        paired = pair_of(key, dtype, stored) if dtype is not None and dtype in FLOAT8 else None
        if paired is not None and declared[name] not in FLOAT8:
            raise CheckpointError(
                f"{root}: {key!r} is stored as {dtype} with block scales {paired[0]!r}, but the model "
                f"declares {declared[name]}; a distributed checkpoint loads into the quantized model it was "
                "saved from (its FP8 modules: sw.from_pretrained builds them). To get it dequantized, "
                "sw.consolidate it to safetensors and load that with dequantize=True")


__all__ = ["check_fp8_match", "read_dtype"]
