"""FP8 MoE checkpoints whose experts are transformers' ``FP8Experts`` (Qwen3-MoE-FP8, DeepSeek-V3)
through the TP plan and the EP plan, on spawned gloo ranks (``fp8_moe_models``).

Before FP8 experts were known, a kept load refused them ("holds float8_e4m3fn values next to
the scale tensor") and a dequantized load of the files transformers writes cast the fp8 expert
weights to bf16 without their scales: silently wrong. On every rank now:

- ``dequantize=True``: every local tensor is the same slice of the one-process dequantization,
  bit for bit; where transformers dequantizes right (the hub layout, whole blocks), that is
  also transformers' own dequantized model;
- kept quantized: each expert weight shard is the stored bytes of its region (assembled from
  the per-expert tensors) and its scale shard the scales of the blocks it touches, and the
  pair dequantizes to the exact slice; ``sw.save`` writes the files back byte for byte;
- the hub layout (scales per expert) loads dequantized; kept quantized it is refused, naming
  the fix.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from hf import fp8_moe_models as M  # noqa: E402
from shardwise.errors import CheckpointError, UnsupportedModelError  # noqa: E402

# (kind, layout, axis, degree): blocks whole at qwen3_moe tp2, cut at deepseek_v3 tp2 and qwen3_moe tp4/8
CASES = [("qwen3_moe", "transformers", "tp", 2), ("qwen3_moe", "transformers", "ep", 2),
         ("deepseek_v3", "transformers", "tp", 2), ("qwen3_moe", "hub", "tp", 4),
         ("deepseek_v3", "transformers", "ep", 4), ("qwen3_moe", "transformers", "tp", 8)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8moe")
    wanted = {(kind, layout) for kind, layout, _, _ in CASES}
    return {(k, lay): M.save_fp8_moe(k, base / f"{k}-{lay}", layout=lay) for k, lay in sorted(wanted)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_the_fixtures_hold_fp8_experts_as_transformers_and_the_hub_write_them(ckpts):
    from hf.fp8_models import stored_tensors
    from shardwise.core.quant import quantize_fp8_blocks

    folder = ckpts["qwen3_moe", "transformers"]
    stored = stored_tensors(folder)
    assert stored["model.layers.0.mlp.experts.3.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(stored["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape) == (4, 4, 2)
    hub = stored_tensors(ckpts["qwen3_moe", "hub"])
    assert tuple(hub["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"].shape) == (2, 2)
    assert not any(k.endswith("gate_up_proj_scale_inv") for k in hub)
    # the values are the plain model's, quantized per expert and block
    plain = M.build_plain("qwen3_moe").state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    q, _ = quantize_fp8_blocks(plain[3, :256])
    assert same_bits(q, stored["model.layers.0.mlp.experts.3.gate_proj.weight"])
    # transformers dequantizes the hub layout as we do, bit for bit (its own save it casts unscaled)
    theirs = M.transformers_dequantized(ckpts["qwen3_moe", "hub"], torch.bfloat16).state_dict()
    ours = M.dequantized_state(ckpts["qwen3_moe", "hub"], torch.bfloat16)
    assert set(theirs) == set(ours) and all(same_bits(theirs[k], ours[k]) for k in ours)
    assert all(same_bits(ours[k], v) for k, v in M.dequantized_state(folder, torch.bfloat16).items())


def _ranks(kind: str, layout: str, folder: str, out: str, axis: str, degree: int):
    """Every check of one checkpoint at one layout, in one launch (transformers imports are slow)."""
    backend = sw.init_backend("gloo")
    ctx = SimpleNamespace(kind=kind, folder=folder, out=out, degree=degree, rank=backend.rank,
                          mesh=backend.mesh(**{axis: degree}), cls=M.model_class(kind),
                          held=M.model_tensors(folder), full=M.dequantized_state(folder, torch.bfloat16))
    _dequantized(ctx)
    if layout == "hub":
        with pytest.raises(CheckpointError, match=r"per-expert FP8 scales.*dequantize=True"):
            sw.from_pretrained(ctx.cls, ctx.folder, mesh=ctx.mesh)
        return 0
    return _kept(ctx)


def _at(specs, spec, rank: int) -> tuple[int, int]:
    """(degree, rank) of ``spec``'s axis on a one-axis mesh (the other axis has degree 1)."""
    degree = specs.degrees[spec.axis]
    return degree, rank if degree > 1 else 0


def _dequantized(ctx) -> None:
    from shardwise.core.spec import split
    from shardwise.parallel import get_shard_state, local_of

    model = sw.from_pretrained(ctx.cls, ctx.folder, mesh=ctx.mesh, dtype=torch.bfloat16, dequantize=True)
    specs = get_shard_state(model).specs
    assert not specs.ties
    experts = 0
    for name, t in model.state_dict().items():
        local = local_of(t)
        want = ctx.full[name].to(local.dtype)  # the router's fp32 weights stay fp32 (transformers' rule)
        spec = specs.spec_of(name)
        assert same_bits(local, split(want, spec, *_at(specs, spec, ctx.rank))), name
        experts += ".experts." in name
    assert experts and model.result.bytes_read < sum(v.numel() * v.element_size() for v in ctx.held.values())
    sw.save(model, f"{ctx.out}/deq")


def _kept(ctx) -> int:
    from shardwise.core.quant import dequantize_region
    from shardwise.core.quant_layout import scale_layout, take_layout, tie_aligned
    from shardwise.core.spec import Region, local_layout, split
    from shardwise.parallel import get_shard_state, local_of

    kept = sw.from_pretrained(ctx.cls, ctx.folder, mesh=ctx.mesh, holding="local")
    specs, state = get_shard_state(kept).specs, kept.state_dict()
    expert_ties = [s for s, t in specs.ties.items() if len(t.block) == 3]
    assert len(expert_ties) == 2 * sum(1 for n in state if n.endswith("experts.down_proj"))
    cut = 0
    for scale_name, tie in specs.ties.items():
        spec = specs[tie.weight]
        n, rank = _at(specs, spec, ctx.rank)
        weight, scale = local_of(state[tie.weight]), local_of(state[scale_name])
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert same_bits(weight, split(ctx.held[tie.weight], spec, n, rank)), tie.weight
        held = scale_layout(tie, spec, n, rank)
        assert same_bits(scale, take_layout(ctx.held[scale_name], held, tuple(scale.shape))), scale_name
        cut += not tie_aligned(tie, spec, n)
        parts = []
        for (region, off), (scales, soff) in zip(local_layout(tie.weight_shape, spec, n, rank),
                                                 held, strict=True):
            q, s = weight[Region(off, region.sizes).slices()], scale[Region(soff, scales.sizes).slices()]
            parts.append((region, off, dequantize_region(q, s, region, tie.block, torch.bfloat16)))
        got = torch.empty(weight.shape, dtype=torch.bfloat16)
        for region, off, part in parts:
            got[Region(off, region.sizes).slices()] = part
        assert same_bits(got, split(ctx.full[tie.weight], spec, n, rank)), tie.weight
    for tie in specs.ties.values():  # an FP8 experts kernel on a cut shard would be wrong
        spec = specs[tie.weight]
        if len(tie.block) == 3 and not tie_aligned(tie, spec, specs.degrees[spec.axis]):
            experts = kept.get_submodule(tie.weight.rpartition(".")[0])
            hidden, index = torch.zeros(3, experts.hidden_dim), torch.zeros(3, 2, dtype=torch.long)
            with pytest.raises(UnsupportedModelError, match=r"cut 128-wide FP8 blocks.*dequantize=True"):
                experts(hidden, index, torch.ones(3, 2))
    sw.save(kept, f"{ctx.out}/kept", max_shard_size=M.SHARD_SIZE)
    return cut


@pytest.mark.parametrize("kind,layout,axis,degree", CASES,
                         ids=[f"{k}-{lay}-{a}{d}" for k, lay, a, d in CASES])
def test_fp8_experts_at_degree(ckpts, tmp_path, kind, layout, axis, degree):
    from hf.fp8_models import stored_tensors

    folder = ckpts[kind, layout]
    cut = run_ranks(_ranks, degree, kind, layout, str(folder), str(tmp_path), axis, degree, timeout=900)
    full = M.dequantized_state(folder, torch.bfloat16)
    written = M.model_tensors(tmp_path / "deq")
    assert set(written) == set(full)
    assert all(same_bits(written[k], full[k].to(written[k].dtype)) for k in full)
    if layout == "hub":
        return
    if (kind, axis, degree) in {("deepseek_v3", "tp", 2), ("qwen3_moe", "tp", 8)}:
        assert max(cut) > 0  # some shard boundary cuts a block: those scales are shared by neighbours
    saved = tmp_path / "kept"
    names = sorted(p.name for p in folder.iterdir())
    assert sorted(p.name for p in saved.iterdir() if p.name != "shardwise.json") == names
    for name in names:
        assert (saved / name).read_bytes() == (folder / name).read_bytes(), name
    assert stored_tensors(saved).keys() == stored_tensors(folder).keys()
