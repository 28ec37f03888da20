"""Boxes of stored tensors: :func:`read_region` reads one box's byte runs into a tensor, over any
storage; the rest reads boxes through memory maps of the page cache (the storage's
``ReadHandle.map_whole`` / ``map_range``; a storage without them is read instead). Two uses,
chosen per box by the region reader:

- **Views** (zero copy): a box already in the model's dtype, for a CPU model, becomes a tensor
  over a private (copy-on-write) mapping of the file, as ``safe_open`` does: a write to it copies
  just that page, the file never changes, and the mapping lives as long as a tensor views it. A
  column slice may be a strided view too (``strided=True``): its storage spans its first to last
  element, other ranks' columns included (``torch.save`` of it writes that span).
- **Strided copies**: a column slice not viewed is copied out of a short-lived mapping of the
  rows it spans with one ``copy_``, not one ``pread`` per row.

Every mapped byte lies inside the entry's validated extent, and the file is checked to be long
enough just before mapping. A file truncated *while* mapped raises SIGBUS on access: never
rewrite a checkpoint in place while a model loaded from it lives (``sw.save`` writes aside).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardwise.core.header import FileHeader, TensorEntry, region_runs
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage import ReadHandle, byte_view


def contiguous_span(entry: TensorEntry, region: Region) -> tuple[int, int] | None:
    """``(offset within the tensor's bytes, length)`` when ``region`` of ``entry`` is one
    contiguous, non-empty byte run (leading dims of size 1, then one partial dim, then
    whole dims), else ``None``. Pure.

    >>> e = TensorEntry("w", "BF16", (4, 6), 0, 48)
    >>> contiguous_span(e, Region((1, 0), (2, 6))), contiguous_span(e, Region((0, 2), (2, 3)))
    ((12, 24), None)
    """
    shape, sizes = entry.shape, region.sizes
    if 0 in sizes:
        return None
    strides = _strides(shape)
    k = next((d for d, n in enumerate(sizes) if n != 1), len(shape) - 1)
    if any(sizes[d] != shape[d] for d in range(k + 1, len(shape))):
        return None
    start = sum(o * s for o, s in zip(region.offsets, strides, strict=True))
    length = sizes[k] * strides[k] if shape else 1
    return start * entry.itemsize, length * entry.itemsize


def _extent(handle: ReadHandle, header: FileHeader, entry: TensorEntry,
            region: Region) -> tuple[int, int] | None:
    """``(lo, hi)``: the file bytes a non-empty box spans (its first to last element, row-major),
    once the file is checked to still hold the entry; None when misaligned for the dtype (then
    the box is read, not mapped)."""
    strides = _strides(entry.shape)
    first = sum(o * s for o, s in zip(region.offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(region.offsets, region.sizes, strides, strict=True))
    base = header.data_start + entry.start
    lo, hi = base + first * entry.itemsize, base + (last + 1) * entry.itemsize
    if lo % entry.itemsize:
        return None
    need, size = header.data_start + entry.end, handle.size()
    if size < need:
        raise CheckpointError(
            f"{header.source}: tensor {entry.name!r} ends at byte {need} but the file now has {size} "
            "bytes; it was truncated or replaced after its header was read. Load it again once it "
            "is complete")
    return lo, hi


def view_box(handle: ReadHandle, header: FileHeader, entry: TensorEntry, region: Region, *,
             strided: bool = False) -> torch.Tensor | None:
    """The box as a tensor over the handle's whole-file private mapping, or ``None``: empty,
    misaligned, no mappings in this storage, or not one contiguous run unless ``strided``. The
    mapping is unmapped when the last view of the file is freed."""
    if 0 in region.sizes:
        return None
    span = contiguous_span(entry, region)
    if span is None and not strided:
        return None
    extent = _extent(handle, header, entry, region)  # None: misaligned, not viewable in its dtype
    mapping = handle.map_whole() if extent is not None else None
    if extent is None or mapping is None:
        return None
    lo, hi = extent
    if len(mapping) < hi:
        raise CheckpointError(f"{header.source}: the file is shorter than its header says; truncated?")
    flat = torch.frombuffer(mapping, dtype=entry.torch_dtype, count=(hi - lo) // entry.itemsize, offset=lo)
    if span is not None:
        return flat.view(region.sizes)
    return flat.as_strided(region.sizes, _strides(entry.shape))


def _strides(sizes) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(sizes):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def copy_mapped(handle: ReadHandle, header: FileHeader, entry: TensorEntry, region: Region,
                dest: torch.Tensor) -> int:
    """Copy ``region`` of ``entry`` into ``dest`` (any strides, the entry's dtype, the region's
    shape) through a mapping of the rows it spans; returns the bytes copied, or 0 without
    copying when the data is misaligned for its dtype or the storage has no mappings."""
    if 0 in region.sizes or not entry.shape:
        return 0
    extent = _extent(handle, header, entry, region)
    mapped = handle.map_range(extent[0], extent[1] - extent[0]) if extent is not None else None
    if extent is None or mapped is None:
        return 0
    lo, hi = extent
    with mapped as (mapping, offset):
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=hi - lo, offset=offset)
        copy_same(dest, flat.view(entry.torch_dtype).as_strided(region.sizes, _strides(entry.shape)))
    return math.prod(region.sizes) * entry.itemsize


def read_region(
    handle: ReadHandle,
    file_header: FileHeader,
    entry: TensorEntry,
    region_offsets: Sequence[int],
    region_sizes: Sequence[int],
    out: torch.Tensor,
) -> int:
    """Read exactly the bytes of one box of ``entry`` into ``out``, a contiguous CPU tensor
    (a view is fine if contiguous) of the entry's dtype and shape ``region_sizes``; return the
    bytes read. Raises ``UsageError`` for another ``out``.

    >>> header = read_header("model.safetensors")                           # doctest: +SKIP
    >>> handle = locate("model.safetensors").open()                         # doctest: +SKIP
    >>> read_region(handle, header, header.entries["w"], (0, 8), (4, 8), torch.empty(4, 8))  # doctest: +SKIP
    128
    """
    if file_header.entries.get(entry.name) != entry:
        raise UsageError(f"tensor {entry.name!r} is not an entry of {file_header.source}; pass the "
                         "header of the file that holds it")
    sizes = tuple(region_sizes)
    if (out.device.type != "cpu" or out.dtype != entry.torch_dtype or tuple(out.shape) != sizes
            or not out.is_contiguous()):
        raise UsageError(
            f"out for {entry.name!r} must be a contiguous CPU {entry.torch_dtype} tensor of shape "
            f"{sizes}, got {out.dtype} {tuple(out.shape)} on {out.device} "
            f"(contiguous={out.is_contiguous()})"
        )
    runs = region_runs(entry.shape, entry.itemsize, region_offsets, sizes)
    if not runs:
        return 0
    try:
        return handle.read_runs(byte_view(out.detach()), file_header.data_start + entry.start, runs)
    except CheckpointError as e:
        raise CheckpointError(f"{file_header.source}: tensor {entry.name!r}: {e}") from e




def copy_same(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.copy_(src)`` of one dtype; one-byte dtypes as their bytes: torch 2.9 has no copy
    kernel for float4_e2m1fn_x2 (safetensors' F4), and a byte copy is the same copy."""
    if dest.element_size() == 1 and dest.dtype == src.dtype and dest.dtype != torch.uint8:
        dest, src = dest.view(torch.uint8), src.view(torch.uint8)
    dest.copy_(src)


__all__ = ["contiguous_span", "copy_mapped", "copy_same", "read_region", "view_box"]
