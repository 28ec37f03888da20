"""sw.check_plan on real transformers and diffusers models (Llama, Flux2, Phi-3's fused qkv and
gate|up, Qwen3-MoE under ep), tiny, on spawned gloo ranks at tp 2, 4 and 8: their correct plans
raise no alarm, and each injected fault is localized to its module (or to the first module
downstream whose inputs agree, naming the injected one as the likely cause)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

import torch  # noqa: E402
from hf_models import KINDS, build_tiny, inputs, model_class  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402

QKV = "model.layers.*.self_attn.qkv_proj"
GATE_UP = "model.layers.*.mlp.gate_up_proj"
EXPERTS = "model.layers.*.mlp.experts"
K, V = "model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj"
SINGLE = "single_transformer_blocks.*.attn."
O_PROJ, GATHER = "model.layers.*.self_attn.o_proj", "colwise_gather_output"


def _phi3(heads: int = 4, kv_heads: int = 2):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                        pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return Phi3ForCausalLM._from_config(config).eval()


def _build(kind: str, degree: int = 2):
    """The tiny model of ``kind`` and its inputs; above tp=2, with 2 * degree query and degree kv
    heads (Flux2: degree heads) so that every planned split divides."""
    if degree == 2:
        return (_phi3(), inputs("llama")) if kind == "phi3" else (build_tiny(kind), inputs(kind))
    if kind == "phi3":
        return _phi3(2 * degree, degree), inputs("llama")
    library, _, factory = KINDS[kind]
    config = factory()
    if library == "diffusers":
        dim = 64 // degree
        config.update(num_attention_heads=degree, attention_head_dim=dim, axes_dims_rope=(dim // 4,) * 4)
        model = model_class(kind).from_config(config)
    else:
        config.num_attention_heads, config.num_key_value_heads = 2 * degree, degree
        if kind == "llama":
            config.head_dim = 64 // (2 * degree)
        model = model_class(kind)._from_config(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # random norms and biases too, as build_tiny's
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval(), inputs(kind)


# (kind, plan changes over the model's own plan or None for "auto", ep_plan, first divergence,
# likely cause, text of the hint or refusal); at tp=2, or ep=2 where an ep_plan is given
PHI3_SPLIT_MLP = {GATE_UP: sw.PackedColwise([1, 1]), "model.layers.*.mlp.down_proj": "rowwise"}
# the last two swap colwise and rowwise where both forms return whole outputs: still right
CORRECT = [("llama", None, None), ("flux2", None, None), ("phi3", None, None), ("phi3", PHI3_SPLIT_MLP, None),
           ("qwen3_moe", None, None), ("qwen3_moe", None, "auto"),
           ("phi3", {QKV: "rowwise_split_input", O_PROJ: GATHER}, None),
           ("flux2", {SINGLE + "to_qkv_mlp_proj": "rowwise_split_input", SINGLE + "to_out": GATHER}, None)]
SWAPPED = "colwise and rowwise swapped?"
FAULTS = {
    "llama: mlp colwise and rowwise swapped": (
        "llama", {"model.layers.*.mlp.gate_proj": "rowwise", "model.layers.*.mlp.up_proj": "rowwise",
                  "model.layers.*.mlp.down_proj": "colwise"}, None,
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.gate_proj", "colwise and rowwise swapped?"),
    # colwise/rowwise swaps. One that runs and is wrong: k and v rowwise (the form that slices a
    # whole input) beside a colwise q. At tp=2 a rank's q heads (4 / 2) are as many as all kv
    # heads (2), so sdpa's GQA pairs them one to one: q heads 0, 1 meet kv heads 0, 1, not 0, 0
    "llama: k/v rowwise beside colwise q (runs, wrong)": (
        "llama", {K: "rowwise_split_input", V: "rowwise_split_input"}, None,
        "model.layers.0.self_attn", "model.layers.0.self_attn.k_proj", SWAPPED),
    "qwen3_moe: k/v rowwise beside colwise q (runs, wrong)": (
        "qwen3_moe", {K: "rowwise_split_input", V: "rowwise_split_input"}, None,
        "model.layers.0.self_attn", "model.layers.0.self_attn.k_proj", SWAPPED),
    # the swaps that cannot run: plain rowwise takes a shard of the input features
    "qwen3_moe: k/v rowwise on their whole input": (
        "qwen3_moe", {K: "rowwise", V: "rowwise"}, None,
        "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.k_proj", SWAPPED),
    "phi3: fused qkv rowwise, o colwise": (
        "phi3", {QKV: "rowwise", "model.layers.*.self_attn.o_proj": "colwise"}, None,
        "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.qkv_proj", SWAPPED),
    "flux2: to_k rowwise": (
        "flux2", {"transformer_blocks.*.attn.to_k": "rowwise"}, None,
        "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_k", SWAPPED),
    "flux2: single-stream projections swapped": (
        "flux2", {SINGLE + "to_qkv_mlp_proj": "rowwise_split_input", SINGLE + "to_out": "colwise"}, None,
        "single_transformer_blocks.0", "single_transformer_blocks.0.attn.to_out", "returns a shard"),
    "flux2: plain colwise on the packed gate|up": (
        "flux2", {"transformer_blocks.*.ff.linear_in": "colwise"}, None,
        "transformer_blocks.0.ff.act_fn", "transformer_blocks.0.ff.linear_in", "PackedColwise([1, 1])?"),
    "flux2: wrong packed proportions": (
        "flux2", {"single_transformer_blocks.*.attn.to_qkv_mlp_proj": sw.PackedColwise([3, 3, 3])}, None,
        "single_transformer_blocks.0.attn", "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
        "PackedColwise([1, 1, 1, 3, 3])?"),
    "phi3: plain colwise on the packed gate|up": (
        "phi3", {GATE_UP: "colwise", "model.layers.*.mlp.down_proj": "rowwise"}, None,
        "model.layers.0.mlp", "model.layers.0.mlp.gate_up_proj", "PackedColwise([1, 1])?"),
    "phi3: wrong packed proportions (refused statically)": (
        "phi3", {QKV: sw.PackedColwise([1, 1, 1]), "model.layers.*.self_attn.o_proj": "rowwise"}, None,
        "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.qkv_proj", "ShardingError"),
    # Phi-3 slices q|k|v at config.num_attention_heads * head_dim: a global head count in the forward
    "phi3: the forward slices by the global head count": (
        "phi3", {QKV: sw.PackedColwise([2, 1, 1]), "model.layers.*.self_attn.o_proj": "rowwise"}, None,
        "model.layers.0.self_attn", "model.layers.0.self_attn.qkv_proj", "a head count fixed in the code"),
    "qwen3_moe: experts split under ep with no dispatch": (
        "qwen3_moe", {}, {f"{EXPERTS}.gate_up_proj": "grouped_gemm", f"{EXPERTS}.down_proj": "grouped_gemm"},
        "model.layers.1.mlp.experts", "model.layers.1.mlp.experts", "ep_dispatch_experts"),
}


def _check(kind: str, change, ep_plan, degree: int = 2):
    from shardwise.core.plan import plan_from_model

    backend = sw.init_backend("gloo")
    model, kwargs = _build(kind, degree)
    plan = "auto" if change is None else {**plan_from_model(model), **change}
    # ep: 2 ranks of experts (4 of them), each an ep rank's tp group of degree / 2
    mesh = backend.mesh(tp=degree) if ep_plan is None else backend.mesh(ep=2) if degree == 2 else \
        backend.mesh(ep=2, tp=degree // 2)
    if ep_plan is not None:
        plan = "auto"
    report = sw.check_plan(model, (), kwargs=kwargs, plan=plan, mesh=mesh,
                           ep_plan=None if ep_plan == "auto" else ep_plan)
    return report.ok, report.first_divergence, report.likely_cause, report.hint + report.refusal, str(report)


def _many(cases: list[tuple], degree: int = 2):
    return [_check(*case, degree) for case in cases]


def test_no_false_alarm_on_correct_plans():
    results = run_ranks(_many, 2, CORRECT, timeout=300)
    for case, (ok, first, _, _, printed) in zip(CORRECT, results[0], strict=True):
        assert (ok, first) == (True, None), (case, printed)
    assert results[0] == results[1]


@pytest.fixture(scope="module")
def fault_reports():
    """Every fault's report from each of 2 ranks, from one spawn (a spawn imports transformers)."""
    ranks = run_ranks(_many, 2, [case[:3] for case in FAULTS.values()], timeout=300)
    return [dict(zip(FAULTS, results, strict=True)) for results in ranks]


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_fault_is_localized(name, fault_reports):
    first, cause, text = FAULTS[name][3:]
    ok, got_first, got_cause, hint, printed = fault_reports[0][name]
    assert not ok, printed
    assert (got_first, got_cause) == (first, cause), printed
    assert text in hint, printed
    assert fault_reports[0][name] == fault_reports[1][name]


# above tp=2 a rank's q heads (2) are fewer than the kv heads (degree): sdpa raises in the
# attention, and the report names k_proj, whole among shards
AT_HIGHER = {name: ("model.layers.0.self_attn", "model.layers.0.self_attn.k_proj", "returns a whole tensor")
             for name in FAULTS if "runs, wrong" in name}


def _everything(degree: int):
    return _many(CORRECT, degree), _many([case[:3] for case in FAULTS.values()], degree)


@pytest.mark.parametrize("degree", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_at_tp_4_and_8(degree):
    """The correct plans raise no alarm and the faults are localized at tp 4 and 8 too (ep=2 x
    tp=degree/2 for the ep cases), in one spawn: 8 ranks on a small machine, hence slow."""
    ranks = run_ranks(_everything, degree, degree, timeout=600)
    correct, faults = ranks[0]
    for case, (ok, first, _, _, printed) in zip(CORRECT, correct, strict=True):
        assert (ok, first) == (True, None), (case, printed)
    for name, (ok, got_first, got_cause, hint, printed) in zip(FAULTS, faults, strict=True):
        first, cause, text = AT_HIGHER.get(name, FAULTS[name][3:])
        assert not ok, printed
        assert (got_first, got_cause) == (first, cause), printed
        assert text in hint, printed
    assert all(r == ranks[0] for r in ranks)


FLUX2_CONFIG = {"_class_name": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 8, "num_layers": 1,
                "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 4,
                "joint_attention_dim": 32, "timestep_guidance_channels": 32, "mlp_ratio": 3.0,
                "axes_dims_rope": [4, 4, 4, 4]}


WRONG_FF = {"transformer_blocks.*.ff.linear_in": "colwise", "transformer_blocks.*.ff.linear_out": "rowwise"}


@pytest.mark.parametrize(("plan", "code"), [(None, 0), (WRONG_FF, 1)])
def test_the_command_line_builds_a_diffusers_class(tmp_path, capsys, plan, code):
    import json

    from shardwise.cli import main
    from shardwise.plan_cli import build

    (tmp_path / "config.json").write_text(json.dumps(FLUX2_CONFIG))
    args = ["check-plan", "diffusers:Flux2Transformer2DModel", "--config", str(tmp_path / "config.json")]
    if plan is not None:
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        args += ["--plan", str(tmp_path / "plan.json")]
    assert main([*args, "--tp", "2"]) == code
    out = capsys.readouterr().out
    assert ("OK, every module agrees" in out) == (code == 0), out
    localized = "FAIL at 'transformer_blocks.0.ff.act_fn'" in out and "PackedColwise([1, 1])?" in out
    assert localized == (code == 1), out
    # seeded: the same weights and inputs for the same seed, others for another
    (a, _, ka), (b, _, kb), (c, _, _) = (build("diffusers:Flux2Transformer2DModel", str(tmp_path), seed)
                                         for seed in (0, 0, 1))
    assert all(x.equal(y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert all(ka[k].equal(kb[k]) for k in ka) and set(ka) >= {"img_ids", "txt_ids", "guidance"}
    assert not all(x.equal(y) for x, y in zip(a.state_dict().values(), c.state_dict().values(), strict=True))


def test_the_command_line_names_a_diffusers_class_it_has_no_inputs_for(tmp_path):
    from diffusers import UNet2DModel

    from shardwise.plan_cli import build

    UNet2DModel(sample_size=8, block_out_channels=(8, 8), norm_num_groups=4, layers_per_block=1,
                down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D")
                ).save_config(tmp_path)
    with pytest.raises(SystemExit, match="no inputs known for UNet2DModel.*module:function"):
        build("diffusers:UNet2DModel", str(tmp_path), 0)


@pytest.mark.parametrize("axes", [["--ep", "2", "--tp", "1"], ["--ep", "2", "--tp", "2"]])
def test_the_command_line_checks_a_transformers_class_on_an_ep_mesh(tmp_path, capsys, axes):
    from shardwise.cli import main

    KINDS["qwen3_moe"][2]().save_pretrained(tmp_path)  # config.json only: seeded random weights
    assert main(["check-plan", "transformers:Qwen3MoeForCausalLM", "--config", str(tmp_path), *axes]) == 0
    out = capsys.readouterr().out
    mesh = "{'ep': 2, 'tp': " + axes[-1] + "}"
    assert f"check_plan (mesh {mesh}, rtol 0.0001): OK, every module agrees" in out, out
