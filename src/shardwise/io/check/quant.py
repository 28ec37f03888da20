"""What ``inspect``, ``verify`` and ``diff`` know about quantized checkpoints: which stored
tensors are a quantized weight and its scales, in which scheme and block.

From names, dtypes and shapes only (no tensor is read), with the scheme and block size from
the ``quantization_config`` of the ``config.json`` beside the checkpoint:

- FP8 block-scaled (``quant_method: fp8``; DeepSeek-V3, Qwen3-FP8): ``x.weight`` float8 next
  to ``x.weight_scale_inv`` (float) of shape ``ceil(dims / weight_block_size)``; an expert's
  weight stored per expert may have its scales fused (``experts.gate_up_proj_scale_inv``, as
  transformers' ``save_pretrained`` writes ``FP8Experts``);
- MXFP4 (``quant_method: mxfp4``; gpt-oss): ``x_blocks`` uint8 ``(..., K/32, 16)`` next to
  ``x_scales`` uint8 ``(..., K/32)``, one e8m0 scale per 32 values.

:func:`quant_pairs` pairs them and lists what is wrong (a weight without its scales, scales of
the wrong shape for the block); :class:`Dequantizing` shows a ``diff`` side's FP8 weights in
dequantized units (``core.quant.dequantize_region``: float32, the same math as a load).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardwise.core.adapter import folder_quantization
from shardwise.core.header import dtype_to_str
from shardwise.core.quant import MXFP4_GROUP, MXFP4_GROUP_BYTES, dequantize_region, scale_region, scale_shape
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError
from shardwise.io.storage import Location

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FP8_SCALE = "_scale_inv"  # x.weight -> x.weight_scale_inv (DeepSeek-V3, transformers' FP8Linear)


@dataclass(frozen=True)
class QuantPair:
    """A stored quantized weight: its ``values`` and ``scales`` keys, its ``scheme``
    (``"fp8_block"`` or ``"mxfp4"``) and ``block`` (None: no quantization_config says it)."""

    values: str
    scales: str
    scheme: str
    block: tuple[int, ...] | None
    # an expert's weight whose scales are a part of a fused tensor (transformers' save of
    # FP8Experts): (expert, first scale row) in ``scales`` (E, rows, cols)
    fused_at: tuple[int, int] | None = None

    def describe(self) -> str:
        """``fp8_block 128x128`` (the scheme and block size, as ``inspect`` shows them)."""
        block = "x".join(map(str, self.block)) if self.block else "block unknown"
        return f"{self.scheme} {block}"


def quantization_config(root: Location) -> dict | None:
    """The ``quantization_config`` of the model config beside the checkpoint in ``root`` (the
    model adapter's: ``core.adapter.folder_quantization``); None if there is none."""
    found = folder_quantization(root)
    qc = found[0] if found is not None else None
    return qc if isinstance(qc, dict) else None


def has_config(root: Location) -> bool:
    return folder_quantization(root) is not None


def _method(qc: dict | None) -> str | None:
    return None if qc is None else str(qc.get("quant_method"))


def _fp8_block(qc: dict | None) -> tuple[int, int] | None:
    block = (qc or {}).get("weight_block_size")
    if (_method(qc) == "fp8" and isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        return int(block[0]), int(block[1])
    return None


def _as_str(dtype) -> str:
    return dtype if isinstance(dtype, str) else dtype_to_str(dtype)


def quant_pairs(tensors: Mapping[str, tuple], qc: dict | None) -> tuple[dict[str, QuantPair], list[str]]:
    """``({values key: QuantPair}, problems)`` of a checkpoint's ``tensors`` (``{name: (dtype,
    shape)}``, dtypes as torch dtypes or safetensors names) under its quantization config ``qc``.

    Problems: an FP8 weight without its scales (where the config says fp8, or other FP8 weights
    have theirs), scales whose shape is not ``ceil(weight dims / block)``, scales that are not
    a float dtype, scales whose weight is missing or not FP8; MXFP4 blocks without their scales
    or with scales of another shape.

    >>> pairs, problems = quant_pairs({"w.weight": ("F8_E4M3", (576, 256)),
    ...                                "w.weight_scale_inv": ("F32", (4, 2))},
    ...                               {"quant_method": "fp8", "weight_block_size": [128, 128]})
    >>> pairs["w.weight"].describe(), problems[0][:68]
    ('fp8_block 128x128', "scales 'w.weight_scale_inv' have shape (4, 2), but weight 'w.weight'")
    """
    found = {n: (_as_str(d), tuple(s)) for n, (d, s) in tensors.items()}
    pairs: dict[str, QuantPair] = {}
    problems: list[str] = []
    block = _fp8_block(qc)
    fp8 = [n for n, (d, _) in found.items() if d in FP8_DTYPES]
    scaled = _method(qc) == "fp8" or any(n + FP8_SCALE in found for n in fp8)
    fused_used: set[str] = set()
    for name in fp8:
        scale = name + FP8_SCALE
        if scale not in found:
            fused = _fused_scale(name, found, block, problems)
            if fused is not None:
                pairs[name] = fused
                fused_used.add(fused.scales)
                continue
            if scaled:
                problems.append(f"FP8 weight {name!r} has no scales {scale!r}: it cannot be dequantized; "
                                "write the weight with its weight_scale_inv (or save it unquantized)")
            continue
        pair = pairs[name] = QuantPair(name, scale, "fp8_block", block)
        (sdtype, sshape), (_, wshape) = found[scale], found[name]
        if not sdtype.startswith(("F", "BF")) or sdtype in FP8_DTYPES:
            problems.append(f"scales {scale!r} are {sdtype}; FP8 block scales are float32")
        if block is not None and (len(wshape) != 2 or sshape != scale_shape(wshape, block)):
            want = scale_shape(wshape, block) if len(wshape) == 2 else "a 2-D weight"
            problems.append(f"scales {scale!r} have shape {sshape}, but weight {name!r} {wshape} in "
                            f"{pair.describe().split()[1]} blocks needs {want}; requantize the weight or "
                            "fix weight_block_size in config.json")
    for scale in (n for n in found if n.endswith(FP8_SCALE) and n not in fused_used):
        weight = scale[: -len(FP8_SCALE)]
        if weight not in pairs and (weight not in found or found[weight][0] not in FP8_DTYPES):
            what = "is missing" if weight not in found else f"is {found[weight][0]}, not FP8"
            problems.append(f"scales {scale!r} have no FP8 weight: {weight!r} {what}")
    _mxfp4_pairs(found, qc, pairs, problems)
    return pairs, problems


def _fused_scale(name: str, found: dict, block, problems: list[str]) -> QuantPair | None:
    """The pair of an expert's FP8 weight stored per expert whose scales are fused, as
    transformers' ``save_pretrained`` writes ``FP8Experts`` (``experts.3.up_proj.weight`` with
    ``experts.gate_up_proj_scale_inv`` ``(E, rows(gate) + rows(up), cols)``); None if it is not one."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    fused = f"{m[1]}.{'down_proj' if m[3] == 'down_proj' else 'gate_up_proj'}{FP8_SCALE}"
    if fused not in found:
        return None
    expert, (_, sshape), (_, wshape) = int(m[2]), found[fused], found[name]
    rows = scale_shape(wshape, block)[0] if block is not None and len(wshape) == 2 else 0
    pair = QuantPair(name, fused, "fp8_block", block, (expert, rows if m[3] == "up_proj" else 0))
    if block is not None and len(wshape) == 2:
        want = scale_shape(wshape, block)
        want = (want[0] * (1 if m[3] == "down_proj" else 2), want[1])
        if len(sshape) != 3 or sshape[0] <= expert or tuple(sshape[1:]) != want:
            problems.append(f"fused scales {fused!r} have shape {sshape}, not (experts, {want[0]}, "
                            f"{want[1]}) as expert {expert}'s {name!r} {wshape} in "
                            f"{pair.describe().split()[1]} blocks needs; requantize the experts or fix "
                            "weight_block_size in config.json")
    return pair


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _mxfp4_pairs(found: dict, qc: dict | None, pairs: dict, problems: list[str]) -> None:
    for name, (dtype, shape) in found.items():
        if not name.endswith("_blocks") or dtype != "U8" or len(shape) < 3:
            continue
        scale = name[: -len("_blocks")] + "_scales"
        if scale not in found:
            if _method(qc) == "mxfp4":
                problems.append(f"MXFP4 blocks {name!r} have no scales {scale!r}: they cannot be "
                                "dequantized; write them with their *_scales")
            continue
        pairs[name] = QuantPair(name, scale, "mxfp4", (MXFP4_GROUP,))
        sdtype, sshape = found[scale]
        if shape[-1] != MXFP4_GROUP_BYTES or sshape != shape[:-1] or sdtype != "U8":
            problems.append(f"MXFP4 scales {scale!r} are {sdtype} {sshape}, but blocks {name!r} {shape} need "
                            f"U8 {shape[:-1]} (blocks of {MXFP4_GROUP_BYTES} bytes, one e8m0 scale per "
                            f"{MXFP4_GROUP} values); re-export the checkpoint")


def describe_quantization(qc: dict | None, pairs: Mapping[str, QuantPair]) -> str | None:
    """The line ``inspect`` prints about a checkpoint's quantization (None: not quantized)."""
    if qc is None and not pairs:
        return None
    schemes = sorted({p.describe() for p in pairs.values()})
    config = "no quantization_config in config.json" if qc is None else (
        f"quant_method {_method(qc)!r}" + (f", weight_block_size {qc['weight_block_size']}"
                                           if "weight_block_size" in qc else ""))
    shown = ", ".join(schemes) or "-"
    return f"quantization: {config}; {len(pairs)} quantized weight(s) with scales ({shown})"


class Dequantizing:
    """A ``diff`` side (``tensors`` and ``rows(name, lo, hi)``) whose FP8 weights named in
    ``pairs`` read as their dequantized values (float32): rows ``[lo, hi)`` of the weight and
    the scale rows covering them (``scale_region``), through ``dequantize_region``. Raises
    ``CheckpointError`` for a pair whose block size no config says."""

    def __init__(self, side, pairs: Mapping[str, QuantPair], root):
        self.side, self.pairs, self.root = side, pairs, root
        self.tensors = {n: (torch.float32, shape) if n in pairs else (dtype, shape)
                        for n, (dtype, shape) in side.tensors.items()}

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        pair = self.pairs.get(name)
        if pair is None:
            return self.side.rows(name, lo, hi)
        if pair.block is None:
            raise CheckpointError(f"{self.root}: {name!r} is FP8 with scales {pair.scales!r}, but no "
                                  "quantization_config in config.json says its weight_block_size, so it "
                                  "cannot be compared in dequantized units; put the checkpoint's config.json "
                                  "beside it")
        q = self.side.rows(name, lo, hi)
        region = Region((lo, 0), tuple(q.shape))
        scales = scale_region(region, pair.block)
        first, stop = scales.offsets[0], scales.offsets[0] + scales.sizes[0]
        if pair.fused_at is None:
            s = self.side.rows(pair.scales, first, stop)
        else:  # this expert's rows of the fused scales
            expert, at = pair.fused_at
            s = self.side.rows(pair.scales, expert, expert + 1)[0, at + first:at + stop]
        return dequantize_region(q, s, region, pair.block, torch.float32)


def fp8_pairs(side, root) -> dict[str, QuantPair]:
    """The FP8 pairs of a ``diff`` side (MXFP4 is compared as stored)."""
    pairs, _ = quant_pairs(side.tensors, quantization_config(root))
    return {n: p for n, p in pairs.items() if p.scheme == "fp8_block"}


__all__ = ["Dequantizing", "QuantPair", "describe_quantization", "fp8_pairs", "has_config", "quant_pairs",
           "quantization_config"]
