"""FP8 block-scaled checkpoints (DeepSeek-V3 / Qwen3-FP8 layout) through tensor parallelism.

Two tiny checkpoints written by transformers (``fp8_models``): a Qwen3 whose dims are 128
multiples (whole blocks per rank at tp=2, blocks cut at tp=4) and a Llama with a 576-wide MLP
(a partial last block; at tp=8 each rank holds 72 rows, inside a 128-row block). On every
rank, in both holdings:

- ``dequantize=True``: every local tensor equals the same slice of the one-process
  dequantization bit for bit (transformers' own dequantized load, where transformers can
  dequantize: it raises on the 576-wide one), and the forward equals a one-process model;
- kept quantized: each fp8 weight shard and its scale shard are the stored bytes of their
  regions, and dequantize to the exact slice; the scales are DTensors where the blocks are
  whole on every rank and local tensors where a boundary cuts a block; the forward (through
  a CPU stand-in for the FP8 kernel that reads the pair as the kernel does) equals one
  process where every shard holds whole blocks, and raises where a boundary cuts one;
- ``sw.save`` writes the kept-quantized model back file for file, byte for byte, and the
  dequantized one as an ordinary checkpoint without ``quantization_config``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from hf import fp8_models as F  # noqa: E402
from shardwise.core.quant import quantize_fp8_blocks  # noqa: E402
from shardwise.errors import CheckpointError, UnsupportedModelError, UsageError  # noqa: E402

CASES = [("qwen3", 2), ("qwen3", 4), ("llama576", 8)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    return {kind: F.save_fp8(kind, base / kind) for kind in F.KINDS}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_the_fixture_is_what_transformers_writes_and_dequantizes(ckpts):
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    weight = F.build_plain("qwen3").state_dict()["model.layers.0.mlp.down_proj.weight"]
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config()))
    theirs = quantize._quantize_one("w.weight", weight)
    q, scale = quantize_fp8_blocks(weight, F.BLOCK)
    assert same_bits(theirs["w.weight"], q) and same_bits(theirs["w.weight_scale_inv"], scale)
    stored = F.stored_tensors(ckpts["llama576"])
    assert stored["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(stored["model.layers.0.mlp.up_proj.weight_scale_inv"].shape) == (5, 3)  # ceil(576 / 128)
    assert "lm_head.weight_scale_inv" not in stored
    for dtype in (torch.bfloat16, torch.float32):
        theirs = F.transformers_dequantized(ckpts["qwen3"], dtype).state_dict()
        ours = F.dequantized_state(ckpts["qwen3"], dtype)
        assert set(theirs) == set(ours)
        assert all(same_bits(theirs[k], ours[k]) for k in ours)
    with pytest.raises(Exception, match="conversion"):  # transformers cannot dequantize 576 rows
        F.transformers_dequantized(ckpts["llama576"], torch.bfloat16)


def _ranks(kind: str, folder: str, out: str, tp: int):
    """Every check of one checkpoint at one degree, in one launch (transformers imports are slow)."""
    backend = sw.init_backend("gloo")
    ctx = SimpleNamespace(kind=kind, folder=folder, out=out, tp=tp, rank=backend.rank,
                          mesh=backend.mesh(tp=tp), cls=F.model_class(kind), stored=F.stored_tensors(folder),
                          full=F.dequantized_state(folder, torch.bfloat16), aligned={})
    nbytes = {k: v.numel() * v.element_size() for k, v in ctx.stored.items()}
    small = sum(n for k, n in nbytes.items() if ctx.stored[k].dim() == 1 or k.endswith("_scale_inv"))
    ctx.share = sum(nbytes.values()) / tp + small  # a rank's bytes: never a whole tensor but norms and scales
    for holding in ("dtensor", "local"):
        _dequantized(ctx, holding)
        _kept(ctx, holding)
    _forwards(ctx)
    _refusals(ctx)
    return ctx.aligned


def _dequantized(ctx, holding: str) -> None:
    """Each local tensor is the slice of the one-process dequantization, bit for bit."""
    from shardwise.core.spec import split
    from shardwise.parallel import get_shard_state, local_of

    model = sw.from_pretrained(ctx.cls, ctx.folder, mesh=ctx.mesh, dtype=torch.bfloat16, dequantize=True,
                               holding=holding)
    assert not hasattr(model.config, "quantization_config")
    specs = get_shard_state(model).specs
    assert not specs.ties
    for name, t in model.state_dict().items():
        assert same_bits(local_of(t), split(ctx.full[name], specs.spec_of(name), ctx.tp, ctx.rank)), name
    assert model.result.bytes_read <= ctx.share, model.result
    sw.save(model, f"{ctx.out}/deq-{holding}", max_shard_size=F.SHARD_SIZE)


def _kept(ctx, holding: str) -> None:
    """The stored bytes of each region, the exact slice once dequantized; saved back."""
    from shardwise.core.quant import dequantize_region
    from shardwise.core.quant_layout import scale_layout, take_layout, tie_aligned
    from shardwise.core.spec import Region, local_layout, split
    from shardwise.parallel import get_shard_state, local_of

    tp, rank = ctx.tp, ctx.rank
    kept = sw.from_pretrained(ctx.cls, ctx.folder, mesh=ctx.mesh, holding=holding)
    specs, state = get_shard_state(kept).specs, kept.state_dict()
    assert len(specs.ties) == 7  # q, k, v, o, gate, up, down; lm_head stays unquantized
    for scale_name, tie in specs.ties.items():
        spec = specs[tie.weight]
        weight, scale = local_of(state[tie.weight]), local_of(state[scale_name])
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert same_bits(weight, split(ctx.stored[tie.weight], spec, tp, rank)), tie.weight
        held = scale_layout(tie, spec, tp, rank)
        assert same_bits(scale, take_layout(ctx.stored[scale_name], held, tuple(scale.shape))), scale_name
        aligned = ctx.aligned[scale_name] = tie_aligned(tie, spec, tp)
        assert (type(state[scale_name]).__name__ == "DTensor") == (holding == "dtensor" and aligned)
        parts = []
        for (region, off), (scales, soff) in zip(local_layout(tie.weight_shape, spec, tp, rank), held,
                                                 strict=True):
            q, s = weight[Region(off, region.sizes).slices()], scale[Region(soff, scales.sizes).slices()]
            parts.append(dequantize_region(q, s, region, tie.block, torch.bfloat16))
        got = parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)
        assert same_bits(got, split(ctx.full[tie.weight], spec, tp, rank)), tie.weight
    assert kept.result.bytes_read <= ctx.share, kept.result
    sw.save(kept, f"{ctx.out}/kept-{holding}", max_shard_size=F.SHARD_SIZE)
    assert sw.verify(f"{ctx.out}/kept-{holding}", against=kept).ok
    with pytest.raises(UnsupportedModelError, match="FP8"):  # DCP saves them: tests/hf/test_fp8_dcp.py
        sw.save(kept, f"{ctx.out}/dcp-{holding}", distributed=True, format="safetensors")


def _forwards(ctx) -> None:
    """Dequantized: equal to one process (float32, reduction order only). Kept quantized: each
    rank's FP8 kernel on its shards (a CPU stand-in reading the pair as the kernel does) equals
    one process where every shard holds whole blocks, and refuses where a boundary cuts one."""
    from shardwise.parallel import local_of

    model = sw.from_pretrained(ctx.cls, ctx.folder, mesh=ctx.mesh, dtype=torch.float32, dequantize=True)
    want = F.logits(F.reference_model(ctx.kind, ctx.folder, torch.float32))
    assert (F.logits(model) - want).abs().max() < 1e-4
    F.use_fake_fp8_kernel()
    one = F.fp8_model(ctx.kind, ctx.folder, torch.float32)
    want = F.logits(one) if all(ctx.aligned.values()) else None
    for holding in ("dtensor", "local"):
        kept = sw.from_pretrained(ctx.cls, ctx.folder, mesh=ctx.mesh, dtype=torch.float32, holding=holding)
        if want is not None:
            assert (F.logits(kept) - want).abs().max() < 1e-4, holding
        else:
            with pytest.raises(UnsupportedModelError, match=r"cut 128-wide FP8 blocks.*dequantize=True"):
                F.logits(kept)
    # sw.parallelize of the one-process FP8 model holds what the kept load holds
    held = {k: local_of(v) for k, v in kept.state_dict().items()}
    sw.parallelize(one, "auto", ctx.mesh, holding="local")
    assert all(same_bits(local_of(v), held[k]) for k, v in one.state_dict().items())


def _refusals(ctx) -> None:
    with sw.empty_model():  # an FP8 checkpoint into a model built unquantized, without dequantize=True
        plain = ctx.cls._from_config(F.KINDS[ctx.kind][1]())
    with pytest.raises(CheckpointError, match=r"float8_e4m3fn.*weight_scale_inv.*dequantize=True"):
        sw.load(plain, ctx.folder, plan="auto", mesh=ctx.mesh)
    with pytest.raises(UsageError, match="dequantize=True fills a model built unquantized"):
        sw.load(F.meta_fp8_model(ctx.kind), ctx.folder, plan="auto", mesh=ctx.mesh, dequantize=True)
    with pytest.raises(CheckpointError, match=r"weight_block_size \[128, 128\].*block_size \[64, 64\]"):
        sw.load(F.meta_fp8_model(ctx.kind, block=(64, 64)), ctx.folder, plan="auto", mesh=ctx.mesh)


@pytest.mark.parametrize("kind,tp", CASES, ids=[f"{k}-tp{tp}" for k, tp in CASES])
def test_fp8_checkpoint_at_tp(ckpts, tmp_path, kind, tp):
    folder = ckpts[kind]
    aligned = run_ranks(_ranks, tp, kind, str(folder), str(tmp_path), tp, timeout=600)[0]
    if kind == "llama576" or tp == 4:  # blocks cut at some boundary: some scales held locally
        assert not all(aligned.values())
    else:
        assert all(aligned.values())
    for holding in ("dtensor", "local"):  # byte for byte the files transformers wrote
        saved = tmp_path / f"kept-{holding}"
        names = sorted(p.name for p in folder.iterdir())
        assert sorted(p.name for p in saved.iterdir() if p.name != "shardwise.json") == names
        for name in names:
            assert (saved / name).read_bytes() == (folder / name).read_bytes(), (holding, name)
        plain = tmp_path / f"deq-{holding}"
        config = json.loads((plain / "config.json").read_text())
        assert "quantization_config" not in config
        full = F.dequantized_state(folder, torch.bfloat16)
        written = F.stored_tensors(plain)
        assert set(written) == set(full)
        assert all(same_bits(written[k], full[k]) for k in full)
