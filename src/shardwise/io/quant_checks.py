"""Guards of loads and saves of block-quantized (FP8, MXFP4) models, and the config step after a
dequantized load. They run before any tensor is read, written or gathered (a checkpoint's
config.json is read for its block size).

Where shardwise handles a quantized weight's scales itself: the safetensors and DCP sources
read them at their own regions (``core.quant_layout.scale_layout``), the gather save and the
DCP save write each once (``io.quant_save``, ``io.formats.dcp.quant``). The other paths (rank-local
sharded safetensors, the parallel write) split every tensor evenly by its spec, which is right
for a scale only where every rank's blocks are whole (``tie_aligned``); elsewhere they refuse here.
"""

from __future__ import annotations

from torch import nn

from shardwise.core.adapter import folder_quantization
from shardwise.core.plan import ResolvedPlan
from shardwise.core.quant_layout import quant_ties, tie_aligned
from shardwise.errors import CheckpointError, UnsupportedModelError, UsageError
from shardwise.holding import Holding
from shardwise.io.formats.safetensors.quantized import checkpoint_block
from shardwise.parallel import get_shard_state


def cut_scales(specs: ResolvedPlan) -> list[str]:
    """The scale tensors of ``specs`` whose blocks some shard boundary cuts (not an even split)."""
    out = []
    for scale, tie in specs.ties.items():
        spec = specs[tie.weight]
        if not tie_aligned(tie, spec, specs.degrees[spec.axis]):
            out.append(scale)
    return out


def check_quantized_load(specs: ResolvedPlan, holding: Holding, dequantize: bool) -> None:
    """Refuse ``dequantize=True`` into a model holding quantized (FP8, MXFP4) modules, and such
    modules under ``"spmd"`` holding (one global tensor per parameter cannot hold overlapping
    scales)."""
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


def check_quantized_source(source, specs: ResolvedPlan, mesh) -> None:
    """Refuse a checkpoint whose ``weight_block_size`` is not the FP8 modules' ``block_size``,
    and FP8 scales cut by shard boundaries from a source that splits tensors evenly (rank-local
    sharded safetensors): the safetensors and DCP sources read scale regions."""
    if not specs.ties:
        return
    if source.name == "dcp":
        return  # canonical scales, read at their regions; another block size is another shape
    if source.name == "safetensors":  # the checkpoint's block size is the FP8 modules'
        found = folder_quantization(source.root)
        config = found[1] if found is not None else source.root
        fp8 = {s: t for s, t in specs.ties.items() if t.scheme == "fp8_block"}
        block = checkpoint_block(source.root) if fp8 and found is not None and found[0] is not None else None
        # the checkpoint's block is on the last two dims (experts have a 1 before it)
        wrong = [(s, t.block) for s, t in fp8.items() if block is not None and t.block[-2:] != block]
        if wrong and block is not None:  # (wrong is empty without a block)
            raise CheckpointError(f"{config}: weight_block_size {list(block)}, but the model's FP8 module of "
                                  f"{wrong[0][0]!r} has block_size {list(wrong[0][1][-2:])}; build the model "
                                  "from this checkpoint's config")
        return
    cut = cut_scales(specs)
    if cut:
        raise CheckpointError(
            f"{type(source).__name__}: {cut[0]!r} (and {len(cut) - 1} more) are FP8 scales whose blocks "
            "shard boundaries cut at this degree; this format splits every tensor evenly, so it cannot give "
            "each rank the scales of the blocks it touches. Load at a degree where every shard holds whole "
            "128-row blocks, or consolidate to safetensors first (sw.consolidate); a distributed save "
            "with format='distcp' (the default) reloads at any degree")


def check_quantized_save(model: nn.Module, how: str) -> None:
    """Refuse a save path that splits tensors evenly (``how``: a rank-local sharded
    safetensors save, a parallel write) for a model holding FP8 modules."""
    state = get_shard_state(model)
    ties = state.specs.ties if state is not None else quant_ties(model)
    if not ties:
        return
    raise UnsupportedModelError(
        f"cannot save this model {how}: it holds FP8 weights with block scales ({next(iter(ties))!r}, ...), "
        "which this path does not write yet; use sw.save(model, path) (the gather save writes them back "
        "byte for byte) or sw.save(model, path, distributed=True) (a DCP checkpoint), or load with "
        "dequantize=True to save an unquantized checkpoint")


def drop_quantization_config(model: nn.Module) -> None:
    """After a dequantized load the model holds no quantized weights: remove its
    ``config.quantization_config`` (as transformers' ``remove_quantization_config`` does), so that
    a save of it writes a config.json that says so."""
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


__all__ = ["check_quantized_load", "check_quantized_save", "check_quantized_source", "cut_scales",
           "drop_quantization_config"]
