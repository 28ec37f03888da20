"""Block-quantized safetensors read per rank, dequantized: :func:`pair_quantized` and
:func:`pair_mxfp4` (called by every key matching) turn a stored weight and its scales into one
:class:`Dequantized` source, or raise without ``dequantize``; :class:`Dequantizer` reads the
rank's value and scale boxes and dequantizes only its shard."""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from shardwise.core.header import TensorEntry
from shardwise.core.pieces import Composite
from shardwise.core.quant import (
    FLOAT8,
    MXFP4_GROUP,
    QuantScheme,
    pair_of,
    read_quantization,
    scale_key,
    scale_shape,
)
from shardwise.core.quant_layout import dequant_reads, dequantize_shard, scale_pieces
from shardwise.errors import CheckpointError, PlanError
from shardwise.io.read.reader import Assembly, ReadItem, piece_items
from shardwise.io.source import Finalize, Want
from shardwise.io.storage import Location
from shardwise.io.storage.posix import libc_function


@dataclass(frozen=True)
class Dequantized:
    """A model tensor of ``shape`` loaded dequantized from the stored ``weight`` (FP8 values or
    MXFP4 blocks) and ``scale``, each a ``(file, entry)`` or a :class:`Composite`; ``transposed``:
    the model tensor is the stored weight transposed (gpt-oss's experts)."""

    weight: tuple[Location, TensorEntry] | Composite
    scale: tuple[Location, TensorEntry] | Composite
    scheme: QuantScheme
    declared: torch.dtype
    shape: tuple[int, ...]
    transposed: bool = False


def pair_quantized(sources: dict, found: Mapping[str, str], declared: Mapping[str, torch.dtype], ckpt, *,
                   dequantize: bool, quantized: frozenset[str] = frozenset(), model_config=None) -> set[str]:
    """Turn every model tensor (stored as ``found[name]``) stored FP8 next to its scales into a
    :class:`Dequantized` source, or raise ``CheckpointError`` without ``dequantize``; the model's
    ``quantized`` tensors must be stored in their declared dtype. Returns the scale keys used."""
    stored = set(ckpt.names)
    used: set[str] = set()
    fp8_block = functools.cache(lambda: read_quantization(ckpt.root, model_config).fp8_block())
    for name, source in sources.items():
        if isinstance(source, Composite):
            if source.entry.torch_dtype in FLOAT8:
                used |= _pair_composite(sources, name, source, declared[name], ckpt, fp8_block(), dequantize)
            continue
        file, entry = source
        declared_fp8 = declared[name] in FLOAT8
        if (declared_fp8 or name in quantized) and entry.torch_dtype != declared[name]:
            raise CheckpointError(f"{file}: {name!r} is stored as {entry.torch_dtype} but the model holds it "
                                  f"as {declared[name]} (FP8 weights and their scales are kept as stored); "
                                  "shardwise does not quantize or convert them on load: load the FP8 "
                                  "checkpoint of this model, or build the model unquantized and pass "
                                  "dequantize=True")
        paired = pair_of(found[name], entry.torch_dtype, stored)
        if paired is None or paired[1] != "fp8_block" or declared_fp8:
            continue
        key = paired[0]
        what = (f"{found[name]!r} is stored as {entry.torch_dtype} with block scales {key!r} "
                "(an FP8 checkpoint)")
        sources[name] = _dequantized(file, name, what, source, ckpt.entry(key), declared[name], fp8_block,
                                     dequantize)
        used.add(key)
    return used


def _pair_composite(sources: dict, name: str, comp: Composite, declared: torch.dtype, ckpt,
                    block: tuple[int, int], dequantize: bool) -> set[str]:
    """An FP8 model tensor assembled from per-expert tensors: kept quantized, nothing to pair
    (its fused scales are a model tensor); into a plain model, a :class:`Dequantized` of the
    composite and the fused ``<name>_scale_inv`` or the per-expert scales. Returns the keys used."""
    stored = set(ckpt.names)
    fused, per_piece = scale_key(name), [scale_key(p.key) for p in comp.pieces]
    if declared in FLOAT8:
        if fused not in stored and all(k in stored for k in per_piece):
            raise CheckpointError(
                f"{ckpt.root}: {name!r} is stored per expert with per-expert FP8 scales ({per_piece[0]!r}, "
                f"...), but the model keeps {fused!r} quantized; shardwise reads FP8 experts kept quantized "
                "with their scales fused (as transformers' save_pretrained writes them): pass "
                "dequantize=True to load this checkpoint dequantized")
        return set()
    if fused in stored:
        scale: tuple[Location, TensorEntry] | Composite = ckpt.entry(fused)
        keys = {fused}
    elif all(k in stored for k in per_piece):
        kept = (1,) * (len(comp.shape) - 2) + block
        try:
            pieces = scale_pieces(comp.pieces, kept, scale_key)
        except PlanError as e:
            raise CheckpointError(f"{ckpt.root}: {name!r}: {e}") from e
        scale = Composite(scale_shape(comp.shape, kept), pieces, {p.key: ckpt.entry(p.key) for p in pieces})
        keys = set(per_piece)
    else:
        return set()  # FP8 values without scales: cast like any stored tensor
    what = f"{name!r} is assembled from FP8 tensors ({comp.pieces[0].key!r}, ...) with block scales"
    sources[name] = _dequantized(ckpt.root, name, what, comp, scale, declared, lambda: block, dequantize)
    return keys


def _dequantized(where, name: str, what: str, weight, scale, declared: torch.dtype,
                 fp8_block: Callable[[], tuple[int, int]], dequantize: bool) -> Dequantized:
    """The :class:`Dequantized` source of the FP8 ``weight`` (``what``, a stored tensor or a
    :class:`Composite`) and its ``scale``; ``CheckpointError`` without ``dequantize``, or for
    scales whose shape does not fit the block of the checkpoint's config."""
    if not dequantize:
        raise CheckpointError(
            f"{where}: {what} but the model declares {declared}; pass dequantize=True to load it dequantized "
            "into the model's dtype, or build the model with its FP8 modules (sw.from_pretrained does, "
            "unless dequantize=True)")
    shape = tuple(weight.shape if isinstance(weight, Composite) else weight[1].shape)
    held = tuple(scale.shape if isinstance(scale, Composite) else scale[1].shape)
    block = fp8_block()
    scheme = QuantScheme.fp8_block(block, ndim=len(shape))
    want = scheme.stored_shapes(shape)[1]
    if held != want:
        raise CheckpointError(f"{where}: the scales of {name!r} have shape {held}, but a weight of shape "
                              f"{shape} in blocks {block} needs {want}; is weight_block_size in "
                              "config.json right for this checkpoint?")
    return Dequantized(weight, scale, scheme, declared, shape)


def pair_mxfp4(absent: set[str], shapes: Mapping[str, tuple[int, ...]], declared: Mapping[str, torch.dtype],
               ckpt, *, dequantize: bool) -> tuple[dict[str, Dequantized], set[str]]:
    """``({model tensor: Dequantized}, stored keys used)`` for the model tensors ``absent`` from
    the checkpoint that it stores as MXFP4 ``x_blocks`` + ``x_scales`` (gpt-oss's experts, the
    transpose, as transformers' ``convert_moe_packed_tensors``); ``CheckpointError`` without
    ``dequantize``."""
    stored = set(ckpt.names)
    out: dict[str, Dequantized] = {}
    used: set[str] = set()
    config = functools.cache(lambda: read_quantization(ckpt.root))
    for name in sorted(absent):
        keys = QuantScheme.mxfp4().stored_keys(name)
        if not all(k in stored for k in keys):
            continue
        (bfile, blocks), scales = ckpt.entry(keys[0]), ckpt.entry(keys[1])
        if not dequantize or not declared[name].is_floating_point:
            raise CheckpointError(
                f"{bfile}: {name!r} is stored as MXFP4 ({keys[0]!r} and {keys[1]!r}) but the model holds it "
                f"as {declared[name]} {shapes[name]}; pass dequantize=True to load it dequantized into the "
                "model's dtype, or build the model with MXFP4 expert modules holding the blocks and scales "
                "as they are stored (sw.from_pretrained does, unless dequantize=True)")
        if config().config is not None and config().method != "mxfp4":
            raise CheckpointError(f"{ckpt.root}: the model config's quant_method {config().method!r}, but "
                                  f"{name!r} is stored as MXFP4 blocks and scales; shardwise reads such a "
                                  "pair as MXFP4 only")
        _check_mxfp4(bfile, name, blocks, scales[1], shapes[name])
        scheme = QuantScheme.mxfp4(ndim=len(shapes[name]))
        out[name] = Dequantized((bfile, blocks), scales, scheme, declared[name], shapes[name],
                                transposed=True)
        used.update(keys)
    return out, used


def _check_mxfp4(file, name: str, blocks: TensorEntry, scales: TensorEntry, shape: tuple[int, ...]) -> None:
    """Refuse an MXFP4 pair that is not uint8 ``(..., rows, G, 16)`` / ``(..., rows, G)`` of the
    transpose of the model's ``shape`` (``QuantScheme.stored_shapes``)."""
    try:
        want = QuantScheme.mxfp4(ndim=len(shape)).stored_shapes(tuple(shape[:-2]) + (shape[-1], shape[-2]))
    except PlanError:  # fewer than 2 dims, or rows not a multiple of MXFP4_GROUP
        want = None
    if (want != (tuple(blocks.shape), tuple(scales.shape)) or blocks.torch_dtype != torch.uint8
            or scales.torch_dtype != torch.uint8):
        raise CheckpointError(
            f"{file}: MXFP4 {name!r} is stored as {blocks.torch_dtype} {tuple(blocks.shape)} with scales "
            f"{scales.torch_dtype} {tuple(scales.shape)}, which does not fit the model's {tuple(shape)} "
            f"(uint8 blocks of its transpose, {MXFP4_GROUP} values a scale); load a checkpoint of this "
            "model's configuration")


# glibc's malloc_trim (hands the heap's free pages back); None off glibc
_MALLOC_TRIM = libc_function("malloc_trim", ctypes.c_size_t)


class Dequantizer:
    """``assembly`` reads each wanted tensor's values and scales at ``dequant_reads``; once both
    are in, :meth:`take` dequantizes the shard into ``dtype`` (else the declared dtype), drops
    the raw parts and finalizes it."""

    def __init__(self, tensors: Mapping[str, tuple[Dequantized, Want]]):
        self.assembly = Assembly()  # keys (model key, 0 for the values or 1 for the scales)
        self.done: dict = {}
        self.dtype: torch.dtype | None = None  # set by the source before reading: sw.load's dtype
        self._what: dict[str, tuple[Dequantized, Want]] = {}
        self._ready: dict[str, list] = {}  # key -> [values, scales], each None until read
        self._lock = threading.Lock()
        for key, (d, want) in tensors.items():
            reads = dequant_reads(d.scheme, d.shape, want.spec, want.degree, want.rank,
                                  transposed=d.transposed)
            for part, (layout, shape) in enumerate(reads):
                source, name = (d.weight, d.scale)[part], f"{key}#{('values', 'scales')[part]}"
                if isinstance(source, Composite):
                    self.assembly.add((key, part), shape, source.entry.torch_dtype,
                                      piece_items(name, source, layout))
                else:
                    self.assembly.add((key, part), shape, source[1].torch_dtype,
                                      [(ReadItem(name, source[0], source[1], layout, shape), None)])
            if all((key, part) in self.assembly.empty for part in (0, 1)):
                raise CheckpointError(f"{key}: this rank's shard of a quantized tensor is empty; load at a "
                                      "lower degree")
            self._what[key] = (d, want)
            self._ready[key] = [self.assembly.empty.pop((key, part), None) for part in (0, 1)]

    def take(self, item: ReadItem, raw: torch.Tensor, finalize: Finalize):
        got = self.assembly.take(item, raw)
        if got is None:
            return None
        (key, part), buf = got
        with self._lock:
            pair = self._ready[key]
            pair[part] = buf
            if pair[1 - part] is None:
                return None
            del self._ready[key]
        d, want = self._what[key]
        values, scales = pair
        pair.clear()
        out = dequantize_shard(values, scales, d.scheme, d.shape, want.spec, want.degree, want.rank,
                               self.dtype or d.declared, transposed=d.transposed)
        del values, scales
        if _MALLOC_TRIM is not None:
            # The raw shards just freed sit between kept outputs in glibc's heap, which keeps
            # such holes (about 400 MiB a rank over a 1 GB FP8 load): hand their pages back.
            _MALLOC_TRIM(0)
        self.done[key] = finalize(key, out)
        return None


__all__ = ["Dequantized", "Dequantizer", "pair_mxfp4", "pair_quantized"]
