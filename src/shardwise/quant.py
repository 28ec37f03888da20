"""Quantized (FP8, MXFP4) models at run time over ``core.quant``: guards of loads and saves, the
TP forward of FP8 modules, the gather of cut scales, and quantized checkpoints in inspect, verify
and diff. A scale is a DTensor where no rank's blocks are cut, else a plain local tensor."""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.core import quant as cq
from shardwise.core.header import dtype_to_str, str_to_dtype
from shardwise.core.plan import ResolvedPlan, Style
from shardwise.core.quant_layout import (
    QuantTie,
    fitting_degrees,
    quant_pairs,
    scale_layout,
    scale_local_shape,
    scale_owned_layout,
    take_layout,
    tie_aligned,
)
from shardwise.core.spec import Region, ShardSpec, split
from shardwise.errors import CheckpointError, UnsupportedModelError, UsageError
from shardwise.holding import Holding
from shardwise.local_tp import _CopyTo, _GatherFrom, _ReduceFrom, _SplitTo, run_on_local_params

# ---- guards of loads and saves: before any tensor is read, written or gathered


def check_quantized_load(specs: ResolvedPlan, holding: Holding, dequantize: bool) -> None:
    """Refuse ``dequantize=True`` into quantized modules, and quantized modules under ``"spmd"``
    holding (a global tensor cannot hold overlapping scales)."""
    if dequantize and specs.ties:
        tie = next(iter(specs.ties.values()))
        kind = "an FP8 module" if tie.scheme == "fp8_block" else "an MXFP4 module"
        path = tie.weight.rpartition(".")[0]
        raise UsageError(f"dequantize=True fills a model built unquantized, but {path!r} (and "
                         f"{len(specs.ties) - 1} more quantized pairs) is {kind}; build the model with "
                         "plain modules (sw.from_pretrained(..., dequantize=True) does), or drop "
                         "dequantize=True to keep the weights quantized")
    if holding is Holding.SPMD and specs.ties:
        raise UnsupportedModelError("quantized modules (FP8, MXFP4) under holding 'spmd' are not supported "
                                    "yet; load with dequantize=True, or use one process per device")


def check_quantized_source(source, specs: ResolvedPlan, mesh, can) -> None:
    """Refuse a checkpoint block size other than the FP8 modules', and cut scales from a format
    without ``scale_regions`` (``can``: the source's format's ``Capabilities``)."""
    if not specs.ties:
        return
    fp8 = {s: t for s, t in specs.ties.items() if t.scheme == "fp8_block"}
    qc = cq.read_quantization(source.root) if can.dequantizes and fp8 else None
    if qc is not None and qc.config is not None:
        block = qc.fp8_block()
        # the checkpoint's block is on the last two dims (experts have a 1 before it)
        wrong = [(s, t.block) for s, t in fp8.items() if t.block[-2:] != block]
        if wrong:
            raise CheckpointError(f"{qc.where}: weight_block_size {list(block)}, but the model's FP8 module "
                                  f"of {wrong[0][0]!r} has block_size {list(wrong[0][1][-2:])}; build the "
                                  "model from this checkpoint's config")
    cut = [] if can.scale_regions else [scale for scale in specs.ties if scale_is_local(specs, scale)]
    if cut:
        raise CheckpointError(
            f"{type(source).__name__}: {cut[0]!r} (and {len(cut) - 1} more) are FP8 scales whose blocks "
            "shard boundaries cut at this degree; this format splits every tensor evenly, so it cannot give "
            "each rank the scales of the blocks it touches. Load at a degree where every shard holds whole "
            "128-row blocks, or consolidate to safetensors first (sw.consolidate); a distributed save "
            "with format='distcp' (the default) reloads at any degree")


def check_quantized_save(model: nn.Module, how: str) -> None:
    """Refuse the save path ``how`` (it splits tensors evenly) for a model with quantized weights."""
    scales = [f"{path}.{s}".lstrip(".") for path, m in model.named_modules() for _, s, _, _ in quant_pairs(m)]
    if scales:
        raise UnsupportedModelError(
            f"cannot save this model {how}: it holds FP8 weights with block scales ({scales[0]!r}, ...), "
            "which this path does not write yet; use sw.save(model, path) (the gather save writes them back "
            "byte for byte) or sw.save(model, path, distributed=True) (a DCP checkpoint), or load with "
            "dequantize=True to save an unquantized checkpoint")


def drop_quantization_config(model: nn.Module) -> None:
    """After a dequantized load, drop the model's ``quantization_config`` (as transformers does)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "quantization_config", None) is not None:
        try:
            delattr(config, "quantization_config")
        except AttributeError:
            config.quantization_config = None
    for attr in ("hf_quantizer", "quantization_method"):
        model.__dict__.pop(attr, None)
    if getattr(model, "is_quantized", False):
        model.is_quantized = False  # type: ignore[assignment]  # stubs: Module attrs are Tensor | Module


# ---- tensor parallelism: local shards of scales, the forward of FP8 modules


def local_part(tensor: torch.Tensor, name: str, spec: ShardSpec, specs: ResolvedPlan,
               coords: tuple[int, int]) -> torch.Tensor:
    """This rank's shard of the canonical ``tensor`` ``name`` (scales: as ``scale_layout`` says)."""
    tie = specs.ties.get(name)
    if tie is None:
        return split(tensor, spec, *coords)
    return take_layout(tensor, scale_layout(tie, spec, *coords), scale_local_shape(tie, spec, *coords))


def quantized_module(specs: ResolvedPlan, path: str) -> QuantTie | None:
    """The tie of the FP8 module at ``path``, None for any other module."""
    return specs.ties.get(cq.scale_key(f"{path}.weight" if path else "weight"))


def scale_is_local(specs: ResolvedPlan, name: str) -> bool:
    """Whether a shard boundary cuts the blocks of the scales ``name`` (held as a local tensor)."""
    tie = specs.ties.get(name)
    return tie is not None and not tie_aligned(tie, specs[tie.weight], specs.degrees[specs[tie.weight].axis])


def wire_quantized(module: nn.Module, path: str, style: Style, state) -> None:
    """Run ``module``'s own (FP8 kernel) forward on its local shards with ``style``'s collectives
    (``state``: the ``ShardState``); :func:`guard_cut_blocks` then makes it raise where a shard
    boundary cuts a block."""
    inner = type(module).forward
    group = state.group

    def forward(mod, x):
        if style.kind == "colwise":
            y = inner(mod, _CopyTo.apply(x, group))
            if style.gather_output:
                y = _GatherFrom.apply(y, group, style.blocks or (1,), state.degree, state.tp_rank)
            return y
        if style.split_input:
            x = _SplitTo.apply(x, group, style.blocks or (1,), state.degree, state.tp_rank)
        bias = mod._parameters.get("bias")
        mod._parameters["bias"] = None  # added once, after the sum
        try:
            y = _ReduceFrom.apply(inner(mod, x), group)
        finally:
            mod._parameters["bias"] = bias
        return y + bias if bias is not None else y

    module.forward = types.MethodType(forward, module)
    run_on_local_params(module)  # the FP8 kernel reads plain local shards


def guard_cut_blocks(model: nn.Module, specs: ResolvedPlan) -> None:
    """Make the forward of each FP8 module (linear or experts) whose shards cut a block raise;
    called after the modules are wired."""
    for tie in specs.ties.values():
        spec = specs[tie.weight]
        degree = specs.degrees[spec.axis]
        if tie.scheme != "fp8_block" or tie_aligned(tie, spec, degree):
            continue
        path = tie.weight.rpartition(".")[0]
        error = _cut_error(path, tie, spec, degree)

        def forward(*args, _error=error, **kwargs):
            raise _error

        model.get_submodule(path).forward = forward


def _cut_error(path: str, tie: QuantTie, spec: ShardSpec, degree: int) -> UnsupportedModelError:
    assert spec.dim is not None  # a cut block needs a split (tie_aligned is True when replicated)
    whole = fitting_degrees(tie.weight_shape, spec, lambda d: tie_aligned(tie, spec, d))
    hint = (f"degrees where every shard holds whole blocks: {', '.join(map(str, whole))}" if whole
            else "no degree > 1 gives every shard whole blocks of this weight")
    return UnsupportedModelError(
        f"{path!r}: at tp={degree} its shard boundaries on dim {spec.dim} cut {tie.block[spec.dim]}-wide "
        f"FP8 blocks of {tie.weight} {tie.weight_shape}, so its FP8 kernel would scale rows with their "
        "neighbour's block scale. The shards and scales are held exactly (sw.save writes them back byte for "
        "byte); to run the forward, load with dequantize=True, or use a degree that keeps blocks whole "
        f"({hint})")


def gather_scales_to_rank0(backend, local: torch.Tensor, tie: QuantTie, spec: ShardSpec, degree: int,
                           rank: int, group, *, keep: bool = True) -> torch.Tensor | None:
    """The whole scales of ``tie`` on global rank 0 (None elsewhere, or if not ``keep``), each from
    its owner (``scale_owned_layout``) in one gather; every rank of ``group`` calls it."""
    owned = [scale_owned_layout(tie, spec, degree, r) for r in range(degree)]
    counts = [sum(region.numel for region, _ in boxes) for boxes in owned]
    itemsize = local.element_size()
    width = max(1, max(counts)) * itemsize
    send = torch.zeros(width, dtype=torch.uint8, device=local.device)
    if counts[rank]:
        data = torch.cat([local[Region(off, r.sizes).slices()].reshape(-1) for r, off in owned[rank]])
        send[: counts[rank] * itemsize] = data.contiguous().view(torch.uint8)
    receive = None
    if backend.rank == 0:
        receive = [torch.empty(width, dtype=torch.uint8, device=local.device) for _ in range(degree)]
    backend.gather_into(send, receive, dst=0, group=group)
    if receive is None or not keep:
        return None
    full = torch.empty(tie.scale_shape, dtype=local.dtype, device=local.device)
    for boxes, count, raw in zip(owned, counts, receive, strict=True):
        values, pos = raw[: count * itemsize].view(local.dtype), 0
        for region, _ in boxes:
            full[region.slices()] = values[pos : pos + region.numel].view(region.sizes)
            pos += region.numel
    return full


# ---- inspect, verify, diff: stored tensors paired by names, dtypes and shapes (no tensor read)


@dataclass(frozen=True)
class QuantPair:
    """A stored quantized weight (``block`` None: no config says it); ``fused_at``: (expert, first
    scale row) in fused ``(E, rows, cols)`` scales (transformers' ``FP8Experts``)."""

    values: str
    scales: str
    scheme: str
    block: tuple[int, ...] | None
    fused_at: tuple[int, int] | None = None

    def describe(self) -> str:
        """``fp8_block 128x128``, as ``inspect`` shows it."""
        return f"{self.scheme} {_blocks(self.block)}"


def _blocks(block: tuple[int, ...] | None) -> str:
    return "x".join(map(str, block)) if block else "block unknown"


def stored_pairs(tensors: Mapping[str, tuple], qc: cq.QuantConfig) -> tuple[dict[str, QuantPair], list[str]]:
    """``({values key: QuantPair}, problems)`` of ``tensors`` ({name: (dtype, shape)}) under
    ``qc``: values without scales, scales of a wrong shape or dtype or without values."""
    found = {n: (str_to_dtype(d) if isinstance(d, str) else d, tuple(s)) for n, (d, s) in tensors.items()}
    pairs: dict[str, QuantPair] = {}
    problems: list[str] = []
    block = qc.block
    fp8 = [n for n, (d, _) in found.items() if d in cq.FLOAT8]
    scaled = qc.method == "fp8" or any(cq.pair_of(n, found[n][0], found) for n in fp8)
    for name in fp8:
        scale, wshape = cq.scale_key(name), found[name][1]
        if scale not in found:
            fused = _fused_scale(name, found, block, problems)
            if fused is not None:
                pairs[name] = fused
            elif scaled:
                problems.append(f"FP8 weight {name!r} has no scales {scale!r}: it cannot be dequantized; "
                                "write the weight with its weight_scale_inv (or save it unquantized)")
            continue
        pairs[name] = QuantPair(name, scale, "fp8_block", block)
        sdtype, sshape = found[scale]
        if not sdtype.is_floating_point or sdtype in cq.FLOAT8:
            problems.append(f"scales {scale!r} are {dtype_to_str(sdtype)}; FP8 block scales are float32")
        if block is not None and (len(wshape) != 2 or sshape != cq.scale_shape(wshape, block)):
            want = cq.scale_shape(wshape, block) if len(wshape) == 2 else "a 2-D weight"
            problems.append(f"scales {scale!r} have shape {sshape}, but weight {name!r} {wshape} in "
                            f"{_blocks(block)} blocks needs {want}; requantize the weight or fix "
                            "weight_block_size in config.json")
    fused_used = {p.scales for p in pairs.values() if p.fused_at is not None}
    for scale in (n for n in found if n.endswith(cq.FP8_SCALE) and n not in fused_used):
        weight = scale[: -len(cq.FP8_SCALE)]
        if weight not in pairs and (weight not in found or found[weight][0] not in cq.FLOAT8):
            what = "is missing" if weight not in found else f"is {dtype_to_str(found[weight][0])}, not FP8"
            problems.append(f"scales {scale!r} have no FP8 weight: {weight!r} {what}")
    for name, (dtype, shape) in found.items():
        if (not name.endswith(cq.MXFP4_SUFFIXES[0]) or dtype not in cq.MXFP4_BLOCK_DTYPES
                or len(shape) < 3):
            continue
        scale = cq.scale_key(name, "mxfp4")
        if scale not in found:
            if qc.method == "mxfp4":
                problems.append(f"MXFP4 blocks {name!r} have no scales {scale!r}: they cannot be "
                                "dequantized; write them with their *_scales")
            continue
        pairs[name] = QuantPair(name, scale, "mxfp4", (cq.MXFP4_GROUP,))
        sdtype, sshape = found[scale]
        if shape[-1] != cq.MXFP4_GROUP_BYTES or sshape != shape[:-1] or sdtype not in cq.MXFP4_SCALE_DTYPES:
            problems.append(f"MXFP4 scales {scale!r} are {dtype_to_str(sdtype)} {sshape}, but blocks "
                            f"{name!r} {shape} need U8 or F8_E8M0 {shape[:-1]} "
                            f"(blocks of {cq.MXFP4_GROUP_BYTES} bytes, "
                            f"one e8m0 scale per {cq.MXFP4_GROUP} values); re-export the checkpoint")
    return pairs, problems


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _fused_scale(name: str, found: dict, block, problems: list[str]) -> QuantPair | None:
    """The pair of a per-expert FP8 weight with fused scales (``experts.3.up_proj.weight``,
    ``experts.gate_up_proj_scale_inv``), as transformers saves ``FP8Experts``; else None."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    fused = cq.scale_key(f"{m[1]}.{'down_proj' if m[3] == 'down_proj' else 'gate_up_proj'}")
    if fused not in found:
        return None
    expert, (_, sshape), (_, wshape) = int(m[2]), found[fused], found[name]
    own = cq.scale_shape(wshape, block) if block is not None and len(wshape) == 2 else None
    if own is not None:
        want = (own[0] * (1 if m[3] == "down_proj" else 2), own[1])
        if len(sshape) != 3 or sshape[0] <= expert or tuple(sshape[1:]) != want:
            problems.append(f"fused scales {fused!r} have shape {sshape}, not (experts, {want[0]}, "
                            f"{want[1]}) as expert {expert}'s {name!r} {wshape} in {_blocks(block)} "
                            "blocks needs; requantize the experts or fix weight_block_size in config.json")
    return QuantPair(name, fused, "fp8_block", block, (expert, own[0] if own and m[3] == "up_proj" else 0))


def describe_quantization(qc: cq.QuantConfig, pairs: Mapping[str, QuantPair]) -> str | None:
    """The line ``inspect`` prints about a checkpoint's quantization (None: not quantized)."""
    said = qc.config if isinstance(qc.config, dict) else None
    if said is None and not pairs:
        return None
    schemes = sorted({p.describe() for p in pairs.values()})
    config = "no quantization_config in config.json" if said is None else (
        f"quant_method {str(said.get('quant_method'))!r}"
        + (f", weight_block_size {said['weight_block_size']}" if "weight_block_size" in said else ""))
    shown = ", ".join(schemes) or "-"
    return f"quantization: {config}; {len(pairs)} quantized weight(s) with scales ({shown})"


class Dequantizing:
    """A ``diff`` side whose FP8 ``pairs`` read dequantized in float32."""

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
        scales = cq.scale_region(region, pair.block)
        first, stop = scales.offsets[0], scales.offsets[0] + scales.sizes[0]
        if pair.fused_at is None:
            s = self.side.rows(pair.scales, first, stop)
        else:  # this expert's rows of the fused scales
            expert, at = pair.fused_at
            s = self.side.rows(pair.scales, expert, expert + 1)[0, at + first:at + stop]
        return cq.dequantize_region(q, s, region, pair.block, torch.float32)


def fp8_pairs(side, root) -> dict[str, QuantPair]:
    """The FP8 pairs of a ``diff`` side (MXFP4 is compared as stored)."""
    pairs, _ = stored_pairs(side.tensors, cq.read_quantization(root))
    return {n: p for n, p in pairs.items() if p.scheme == "fp8_block"}


__all__ = [
    "Dequantizing", "QuantPair", "check_quantized_load", "check_quantized_save", "check_quantized_source",
    "describe_quantization", "drop_quantization_config", "fp8_pairs", "gather_scales_to_rank0",
    "guard_cut_blocks", "local_part", "quantized_module", "scale_is_local",
    "stored_pairs", "wire_quantized",
]
