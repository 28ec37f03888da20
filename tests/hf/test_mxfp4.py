"""MXFP4 checkpoints (gpt-oss layout) through tensor and expert parallelism.

A tiny gpt-oss checkpoint written as the hub's (``mxfp4_models``: experts stored as
``*_blocks`` / ``*_scales`` of their transpose, 64 and 96 wide: 2 and 3 groups of 32), loaded on
spawned gloo ranks under gpt-oss's shipped tp plan (experts whole on every rank) and its ep plan
(each rank its own experts). On every rank:

- ``dequantize=True``: every local tensor equals the same slice of transformers' own
  dequantization (``convert_moe_packed_tensors``, transposed as gpt-oss holds it) bit for bit,
  also under a plan that cuts a 32-group (the 96-wide ``down_proj`` over tp=2: 48 each); the
  bytes a rank reads are its share (under ep, only its experts');
- kept quantized (transformers' MXFP4 expert modules): each rank's ``*_blocks`` / ``*_scales``
  are the stored bytes of its experts and dequantize to the exact slice; a split that would
  cut a group is refused naming the degrees that work;
- ``sw.save`` writes the kept model back file for file, byte for byte (blocks, scales, biases,
  config.json with its quantization_config), and the dequantized one as an ordinary checkpoint
  without quantization_config.

The forward of the kept experts needs transformers' Triton kernels (a GPU): not run here.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from hf import mxfp4_models as M  # noqa: E402
from shardwise.errors import CheckpointError, ShardingError, UsageError  # noqa: E402

GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
CUT_PLAN = {"model.layers.*.mlp.experts.down_proj": "colwise"}  # (E, 96, 64) on dim 1: 48 a rank


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return M.save_mxfp4(tmp_path_factory.mktemp("mxfp4") / "gpt_oss")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_the_fixture_is_the_hub_layout_and_transformers_dequantizes_it(ckpt):
    stored = M.stored_tensors(ckpt)
    blocks, scales = stored[GATE_UP + "_blocks"], stored[GATE_UP + "_scales"]
    assert (blocks.dtype, tuple(blocks.shape)) == (torch.uint8, (4, 192, 2, 16))  # (E, 2I, H/32, 16)
    assert (scales.dtype, tuple(scales.shape)) == (torch.uint8, (4, 192, 2))
    assert tuple(stored["model.layers.0.mlp.experts.down_proj_blocks"].shape) == (4, 64, 3, 16)
    assert stored[GATE_UP + "_bias"].dtype == torch.bfloat16 and GATE_UP not in stored
    assert len(torch.unique(scales)) > 4  # the groups' scales differ
    config = json.loads((ckpt / "config.json").read_text())
    assert config["quantization_config"] == M.QUANTIZATION_CONFIG
    for dtype in (torch.bfloat16, torch.float32):
        theirs = M.transformers_dequantized(ckpt, dtype).state_dict()
        ours = M.dequantized_state(ckpt, dtype)
        assert set(theirs) == set(ours) and all(same_bits(theirs[k], ours[k]) for k in ours)
    plain = M.build_plain().state_dict()[GATE_UP].float()  # and it is a quantization of the weights
    full = M.dequantized_state(ckpt, torch.float32)[GATE_UP]
    assert ((full - plain).abs() <= plain.abs().amax() / 4).all()


def _ranks(folder: str, out: str, axis: str, degree: int):
    """Every check of one layout, in one launch (transformers imports are slow)."""
    backend = sw.init_backend("gloo")
    ctx = SimpleNamespace(folder=folder, out=out, axis=axis, degree=degree, rank=backend.rank,
                          mesh=backend.mesh(**{axis: degree}), stored=M.stored_tensors(folder),
                          full=M.dequantized_state(folder, torch.bfloat16))
    nbytes = {k: v.numel() * v.element_size() for k, v in ctx.stored.items()}
    experts = sum(n for k, n in nbytes.items() if ".experts." in k)
    # tp: experts whole on every rank (gpt-oss's plan), embeddings and lm_head split; ep: own experts
    ctx.share = sum(nbytes.values()) - (experts * (degree - 1) // degree if axis == "ep" else 0)
    _dequantized(ctx, "dtensor")
    _kept(ctx, "dtensor")
    _kept(ctx, "local")
    if axis == "tp":
        _cut_groups(ctx)
    _refusals(ctx)
    return True


def _expect(ctx, name: str, specs) -> torch.Tensor:
    from shardwise.core.spec import split

    spec = specs.spec_of(name)
    degree = specs.degrees[spec.axis]
    return split(ctx.full[name], spec, degree, ctx.rank if degree > 1 else 0)


def _dequantized(ctx, holding: str) -> None:
    """Each local tensor is the slice of transformers' dequantization, bit for bit."""
    from shardwise.parallel import get_shard_state, local_of

    model = sw.from_pretrained(M.model_class(), ctx.folder, mesh=ctx.mesh, dtype=torch.bfloat16,
                               dequantize=True, holding=holding)
    assert not hasattr(model.config, "quantization_config")
    specs = get_shard_state(model).specs
    assert not specs.ties
    for name, t in model.state_dict().items():
        spec = specs.spec_of(name)
        assert same_bits(local_of(t), _expect(ctx, name, specs)), name
        if ".experts." in name:
            assert spec.replicated == (ctx.axis == "tp"), (name, spec)
    assert model.result.bytes_read <= ctx.share, model.result
    assert not model.result.unexpected_keys
    sw.save(model, f"{ctx.out}/deq-{holding}", max_shard_size=M.SHARD_SIZE)


def _kept(ctx, holding: str) -> None:
    """Each rank holds the stored bytes of its experts' blocks and scales, which dequantize to
    the exact slice; saved back."""
    from shardwise.core.quant import mxfp4_dequantize_region, mxfp4_regions
    from shardwise.core.spec import Region, local_layout, split
    from shardwise.parallel import get_shard_state, local_of

    kept = sw.from_pretrained(M.model_class(), ctx.folder, mesh=ctx.mesh, holding=holding)
    assert type(kept.model.layers[0].mlp.experts).__name__ == "Mxfp4GptOssExperts"
    specs, state = get_shard_state(kept).specs, kept.state_dict()
    assert len(specs.ties) == 4 and {t.scheme for t in specs.ties.values()} == {"mxfp4"}
    for scale_name, tie in specs.ties.items():
        spec, n = specs[tie.weight], ctx.degree
        assert spec.replicated == (ctx.axis == "tp") and specs[scale_name] == spec
        blocks, scales = local_of(state[tie.weight]), local_of(state[scale_name])
        assert same_bits(blocks, split(ctx.stored[tie.weight], spec, n, ctx.rank)), tie.weight
        assert same_bits(scales, split(ctx.stored[scale_name], spec, n, ctx.rank)), scale_name
        assert (type(state[scale_name]).__name__ == "DTensor") == (holding == "dtensor" and ctx.axis == "ep")
        (region, _), = local_layout(tie.weight_shape[:-2] + (tie.weight_shape[-2] * 32,), spec, n, ctx.rank)
        assert tuple(x.shape for x in (blocks, scales)) == tuple(r.sizes for r in mxfp4_regions(region))
        local = Region((0,) * 3, region.sizes)
        got = mxfp4_dequantize_region(blocks, scales, local, torch.bfloat16).transpose(-1, -2)
        base = tie.weight.removesuffix("_blocks")
        assert same_bits(got, split(ctx.full[base], spec, n, ctx.rank)), base
    assert kept.result.bytes_read <= ctx.share, kept.result
    assert not kept.result.unexpected_keys and not kept.result.missing_keys
    sw.save(kept, f"{ctx.out}/kept-{holding}", max_shard_size=M.SHARD_SIZE)
    assert sw.verify(f"{ctx.out}/kept-{holding}", against=kept).ok


def _cut_groups(ctx) -> None:
    """Dequantized, a boundary inside a 32-group is exact; kept quantized, it is refused."""
    from shardwise.parallel import get_shard_state, local_of

    with sw.empty_model():
        model = M.model_class()._from_config(M.config(), dtype=torch.bfloat16)
    sw.load(model, ctx.folder, plan=CUT_PLAN, mesh=ctx.mesh, dequantize=True)
    specs = get_shard_state(model).specs
    name = "model.layers.1.mlp.experts.down_proj"
    assert specs[name].dim == 1 and local_of(model.state_dict()[name]).shape == (4, 48, 64)
    for name, t in model.state_dict().items():
        assert same_bits(local_of(t), _expect(ctx, name, specs)), name
    kept = sw.hf.mxfp4_experts(_meta_plain(ctx))
    cut = {"model.layers.*.mlp.experts.gate_up_proj_blocks": "rowwise"}  # 16 bytes of a group over 2
    with pytest.raises(ShardingError, match=r"gate_up_proj_blocks.*inside a 32-value scale group.*no degree"):
        sw.load(kept, ctx.folder, plan=cut, mesh=ctx.mesh)
    with pytest.raises(ShardingError, match=r"dim 2 of size 3 cannot be split over degree 2"):  # 3 groups
        sw.load(sw.hf.mxfp4_experts(_meta_plain(ctx)), ctx.folder, plan=CUT_PLAN, mesh=ctx.mesh)


def _meta_plain(ctx):
    """gpt-oss from the checkpoint's config (its quantization_config too), on meta, unquantized."""
    import transformers

    with sw.empty_model():
        return M.model_class()._from_config(transformers.AutoConfig.from_pretrained(ctx.folder))


def _refusals(ctx) -> None:
    with pytest.raises(CheckpointError, match=r"stored as MXFP4 \('[\w.]+_proj_blocks'.*dequantize=True"):
        sw.load(_meta_plain(ctx), ctx.folder, plan="auto", mesh=ctx.mesh)  # a plain model, no dequantize
    with pytest.raises(UsageError, match="dequantize=True fills a model built unquantized.*MXFP4"):
        kept = sw.hf.mxfp4_experts(_meta_plain(ctx))
        sw.load(kept, ctx.folder, plan="auto", mesh=ctx.mesh, dequantize=True)


@pytest.mark.parametrize("axis,degree", [("tp", 2), ("ep", 2), ("ep", 4)], ids=["tp2", "ep2", "ep4"])
def test_mxfp4_checkpoint(ckpt, tmp_path, axis, degree):
    assert all(run_ranks(_ranks, degree, str(ckpt), str(tmp_path), axis, degree, timeout=300))
    names = sorted(p.name for p in ckpt.iterdir())
    index = "model.safetensors.index.json"
    for holding in ("dtensor", "local"):  # byte for byte the files the hub layout holds
        saved = tmp_path / f"kept-{holding}"
        assert sorted(p.name for p in saved.iterdir() if p.name != "shardwise.json") == names
        for name in names:
            if name != index:
                assert (saved / name).read_bytes() == (ckpt / name).read_bytes(), (holding, name)
        # the index's total_parameters is the count of the model object that wrote it
        # (transformers: num_parameters()): here the plain bf16 model, there uint8 blocks and scales
        ours, source = (json.loads((folder / index).read_text()) for folder in (saved, ckpt))
        assert ours["weight_map"] == source["weight_map"]
        assert ours["metadata"]["total_size"] == source["metadata"]["total_size"]
    plain = tmp_path / "deq-dtensor"
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    full, written = M.dequantized_state(ckpt, torch.bfloat16), M.stored_tensors(plain)
    assert set(written) == set(full) and all(same_bits(written[k], full[k]) for k in full)
