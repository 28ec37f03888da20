"""FP8 block-scaled checkpoints read per rank: a weight and its scales as one tied read.

A checkpoint stores ``x.weight`` as ``float8_e4m3fn`` next to ``x.weight_scale_inv`` (float32,
one scale per block of ``weight_block_size`` in its ``config.json``). Two ways to read it:

- kept quantized (the model holds ``FP8Linear`` modules): the weight is an ordinary tensor
  and the scale a model tensor of its own, read at :func:`core.quant_layout.scale_layout`
  (``SafetensorsSource.plan`` does it, from the ``Want``'s tie);
- ``dequantize=True`` (the model holds plain ``nn.Linear``): the model tensor ``x.weight`` is a
  :class:`Dequantized` source, and :class:`Dequantizer` reads the rank's weight region and its
  scale region, then dequantizes only that shard into the loaded dtype.

Why a tied pair of reads finished by one callback, like the hub layout's ``Assembler``, and
not a composite of pieces: the pieces machinery copies boxes of stored tensors into place,
while here the stored tensors are combined element by element (values times their block's
scale), and the scale's region is not a box of the weight's but a function of it
(``scale_region``). The reader stays what it is (it reads boxes); the pairing and the math
live here and in ``core``.

:func:`pair_quantized` runs in the key matching of every safetensors source, so an FP8
checkpoint never fills a plain model by a bare cast: without ``dequantize=True`` it raises.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.core.header import TensorEntry
from shardwise.core.quant_layout import QuantTie, dequantize_local, scale_layout, scale_local_shape
from shardwise.core.spec import local_layout, local_shape
from shardwise.errors import CheckpointError
from shardwise.io.guards import SUPPORTED_QUANT, quant_scheme
from shardwise.io.safetensors.hub_layout import Composite
from shardwise.io.safetensors.reader import ReadItem
from shardwise.io.source import Finalize, Want

FLOAT8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                 "float8_e5m2fnuz") if hasattr(torch, n))


@dataclass(frozen=True)
class Dequantized:
    """A model tensor stored FP8 with block scales, loaded dequantized: the stored ``weight``
    and ``scale`` (``(file, entry)`` each), the ``block`` and the model's ``declared`` dtype."""

    weight: tuple[Path, TensorEntry]
    scale: tuple[Path, TensorEntry]
    block: tuple[int, int]
    declared: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight[1].shape


def scale_key(name: str) -> str:
    """The key of the scales of the stored weight ``name`` (DeepSeek-V3 and transformers)."""
    return name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else f"{name}_scale_inv"


def pair_quantized(sources: dict, found: Mapping[str, str], declared: Mapping[str, torch.dtype], ckpt, *,
                   dequantize: bool, quantized: frozenset[str] = frozenset(), model_config=None) -> set[str]:
    """Turn every model tensor stored FP8 next to its scales into a :class:`Dequantized` source
    (``dequantize=True``) or raise ``CheckpointError`` (the model declares another dtype: a
    bare cast would ignore the scales). ``found`` maps each model tensor to its stored key.
    The model's ``quantized`` tensors (FP8 weights and their scales, kept as they are) must be
    stored in their declared dtype: no quantizing or converting on load. Returns the scale
    keys the dequantized tensors use (they are not unexpected)."""
    stored = set(ckpt.names)
    used: set[str] = set()
    block = None
    for name, source in sources.items():
        if isinstance(source, Composite):
            keys = [p.key for p in source.pieces if scale_key(p.key) in stored]
            if keys and source.entry.torch_dtype in FLOAT8:
                raise CheckpointError(
                    f"{ckpt.root}: {name!r} is assembled from FP8 tensors with block scales ({keys[0]!r}, "
                    "...: per-expert FP8 weights in the hub layout); shardwise does not read those yet. Load "
                    "with transformers and sw.save the dequantized model, then load that")
            continue
        file, entry = source
        stored_fp8, declared_fp8 = entry.torch_dtype in FLOAT8, declared[name] in FLOAT8
        if (declared_fp8 or name in quantized) and entry.torch_dtype != declared[name]:
            raise CheckpointError(f"{file}: {name!r} is stored as {entry.torch_dtype} but the model holds it "
                                  f"as {declared[name]} (FP8 weights and their scales are kept as stored); "
                                  "shardwise does not quantize or convert them on load: load the FP8 "
                                  "checkpoint of this model, or build the model unquantized and pass "
                                  "dequantize=True")
        key = scale_key(found[name])
        if not stored_fp8 or declared_fp8 or key not in stored:
            continue
        if not dequantize:
            raise CheckpointError(
                f"{file}: {found[name]!r} is stored as {entry.torch_dtype} with block scales {key!r} (an FP8 "
                f"checkpoint) but the model declares {declared[name]}; pass dequantize=True to load it "
                "dequantized into the model's dtype, or build the model with its FP8 modules "
                "(sw.from_pretrained does, unless dequantize=True)")
        block = block or checkpoint_block(ckpt.root, model_config)
        scale = ckpt.entry(key)
        tie = QuantTie(name, entry.shape, block)
        if scale[1].shape != tie.scale_shape:
            raise CheckpointError(f"{scale[0]}: scales {key!r} have shape {scale[1].shape}, but a weight of "
                                  f"shape {entry.shape} in blocks {block} needs {tie.scale_shape}; is "
                                  "weight_block_size in config.json right for this checkpoint?")
        sources[name] = Dequantized(source, scale, block, declared[name])
        used.add(key)
    return used


def checkpoint_block(root: Path, model_config=None) -> tuple[int, int]:
    """The ``weight_block_size`` of the FP8 checkpoint in ``root`` (its ``config.json``; else the
    model config's ``quantization_config``), checked to be a scheme shardwise supports."""
    qc, where = None, root / "config.json"
    try:
        qc = json.loads(where.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        pass
    if qc is None and model_config is not None:
        qc, where = getattr(model_config, "quantization_config", None), "model.config"
    if qc is None:
        raise CheckpointError(f"{root}: FP8 weights with scales, but no quantization_config (config.json "
                              "next to the weights, or the model's config) says their weight_block_size; put "
                              "the checkpoint's config.json beside it")
    method, why = quant_scheme(qc)
    if why is not None:
        raise CheckpointError(f"{where}: quantization {method!r}{why}; shardwise reads {SUPPORTED_QUANT}")
    block = qc.get("weight_block_size") if isinstance(qc, dict) else qc.weight_block_size
    return int(block[0]), int(block[1])


class Dequantizer:
    """The reads of :class:`Dequantized` tensors and their dequantization.

    ``items`` are two :class:`ReadItem`\\ s per wanted local tensor: its weight regions (fp8)
    and its scale regions (``scale_layout``). :meth:`take` keeps the first to arrive; with the
    second it dequantizes the shard (``core.quant_layout.dequantize_local``: float32 in chunks,
    cast once into ``dtype``, else the model's declared dtype), drops both raw tensors and
    finalizes the result. Peak per tensor: its fp8 and scale shards plus the output shard."""

    def __init__(self, tensors: Mapping[str, tuple[Dequantized, Want]]):
        self.items: list[ReadItem] = []
        self.parts: dict[str, tuple[str, int]] = {}  # item name -> (key, 0 values / 1 scales)
        self.done: dict = {}
        self.dtype: torch.dtype | None = None  # set by the source before reading: sw.load's dtype
        self._what: dict[str, tuple[Dequantized, Want, QuantTie]] = {}
        self._raw: dict[str, list] = {}
        self._lock = threading.Lock()
        for key, (d, want) in tensors.items():
            tie = QuantTie(want.name, d.shape, d.block)
            spec, degree = want.spec, want.degree
            at = (spec, degree, want.rank)
            reads = ((d.weight, local_layout(d.shape, *at), local_shape(d.shape, spec, degree)),
                     (d.scale, scale_layout(tie, *at), scale_local_shape(tie, *at)))
            for part, ((path, entry), layout, shape) in enumerate(reads):
                item = ReadItem(f"{key}#{'values' if part == 0 else 'scales'}", path, entry, layout, shape)
                self.items.append(item)
                self.parts[item.name] = (key, part)
            self._what[key] = (d, want, tie)
            self._raw[key] = [None, None]

    def take(self, item: ReadItem, raw: torch.Tensor, finalize: Finalize):
        key, part = self.parts[item.name]
        with self._lock:
            pair = self._raw[key]
            pair[part] = raw
            ready = pair[0] is not None and pair[1] is not None
            if ready:
                del self._raw[key]
        if ready:
            d, want, tie = self._what[key]
            out = dequantize_local(pair[0], pair[1], tie, want.spec, want.degree, want.rank,
                                   self.dtype or d.declared)
            pair.clear()
            self.done[key] = finalize(key, out)
        return None


__all__ = ["Dequantized", "Dequantizer", "FLOAT8", "checkpoint_block", "pair_quantized", "scale_key"]
