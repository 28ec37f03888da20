"""Plan resolution on meta models: styles, real plans from transformers/diffusers, validation."""

import pytest
import torch
from torch import nn

import shardwise as sw
from models import TinyTransformer, tiny_plan
from shardwise.core.plan import SUPPORTED_STYLES, normalize_style, resolve_plan


def meta(cls, *args, **kwargs):
    with torch.device("meta"):
        return cls(*args, **kwargs)


# --- tiny models with the module structure of real ones ---------------------------------
class LlamaAttention(nn.Module):
    def __init__(self, h, heads, kv_heads, qk_norm=False):
        super().__init__()
        d = h // heads
        self.q_proj = nn.Linear(h, heads * d, bias=False)
        self.k_proj = nn.Linear(h, kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, kv_heads * d, bias=False)
        self.o_proj = nn.Linear(heads * d, h, bias=False)
        if qk_norm:
            self.q_norm = nn.RMSNorm(d)
            self.k_norm = nn.RMSNorm(d)


class LlamaMLP(nn.Module):
    def __init__(self, h, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(h, ffn, bias=False)
        self.up_proj = nn.Linear(h, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, h, bias=False)


class LlamaLayer(nn.Module):
    def __init__(self, h, heads, kv_heads, ffn, qk_norm=False):
        super().__init__()
        self.self_attn = LlamaAttention(h, heads, kv_heads, qk_norm)
        self.mlp = LlamaMLP(h, ffn)
        self.input_layernorm = nn.RMSNorm(h)
        self.post_attention_layernorm = nn.RMSNorm(h)


class Config:
    def __init__(self, heads, kv_heads):
        self.num_attention_heads = heads
        self.num_key_value_heads = kv_heads


class LlamaModel(nn.Module):
    def __init__(self, vocab=128, h=64, heads=8, kv_heads=4, ffn=128, layers=2, qk_norm=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(LlamaLayer(h, heads, kv_heads, ffn, qk_norm) for _ in range(layers))
        self.norm = nn.RMSNorm(h)


class LlamaForCausalLM(nn.Module):
    base_model_prefix = "model"  # as transformers' PreTrainedModel subclasses declare it
    def __init__(self, tie=False, **kw):
        super().__init__()
        self.config = Config(kw.get("heads", 8), kw.get("kv_heads", 4))
        self.model = LlamaModel(**kw)
        self.lm_head = nn.Linear(64, kw.get("vocab", 128), bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight


# As transformers ships them (base_model_tp_plan on the config, _tp_plan on the LM class).
LLAMA_BASE_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
QWEN3_BASE_TP_PLAN = {
    **LLAMA_BASE_TP_PLAN,
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}
MISTRAL_BASE_TP_PLAN = dict(LLAMA_BASE_TP_PLAN)
LM_TP_PLAN = {"lm_head": "colwise_rep"}


def with_prefix(plan, prefix="model."):
    return {prefix + k: v for k, v in plan.items()}


@pytest.mark.parametrize("base", [LLAMA_BASE_TP_PLAN, QWEN3_BASE_TP_PLAN, MISTRAL_BASE_TP_PLAN])
@pytest.mark.parametrize("degree", [1, 2, 4])
def test_transformers_plans_resolve(base, degree):
    model = meta(LlamaForCausalLM, qk_norm="q_norm" in str(base))
    plan = {**with_prefix(base), **LM_TP_PLAN, "model.embed_tokens": "embedding_rowwise"}
    specs = resolve_plan(model, plan, degree)
    assert specs["model.layers.1.self_attn.q_proj.weight"] == sw.ShardSpec(dim=0)
    assert specs["model.layers.1.self_attn.o_proj.weight"] == sw.ShardSpec(dim=1)
    assert specs["model.layers.0.mlp.down_proj.weight"] == sw.ShardSpec(dim=1)
    assert specs["model.embed_tokens.weight"] == sw.ShardSpec(dim=0)
    assert specs["lm_head.weight"] == sw.ShardSpec(dim=0)
    assert specs["model.norm.weight"].replicated
    assert specs.styles["lm_head"].gather_output
    if "q_norm" in str(base):
        assert specs["model.layers.0.self_attn.q_norm.weight"].replicated
    assert set(specs) == set(dict(model.named_parameters()))


def test_tied_weights_keep_one_name():
    model = meta(LlamaForCausalLM, tie=True)
    plan = {**with_prefix(LLAMA_BASE_TP_PLAN), "model.embed_tokens": "embedding_rowwise"}
    with pytest.raises(sw.PlanError, match="'lm_head.weight'.*tied"):
        resolve_plan(model, plan, 2)  # the head shares the sharded embedding but is unplanned
    specs = resolve_plan(model, {**plan, "lm_head": "colwise_gather_output"}, 2)
    assert specs.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in specs
    assert specs["model.embed_tokens.weight"] == sw.ShardSpec(dim=0)
    with pytest.raises(sw.PlanError, match="tied"):  # dim-parallel embedding vs vocab-parallel head
        resolve_plan(model, {**plan, "model.embed_tokens": "embedding_colwise",
                                "lm_head": "colwise_gather_output"}, 2)


# --- diffusers-shaped models -----------------------------------------------------------
class PackedColwiseParallel:  # diffusers' marker classes, matched by name
    def __init__(self, blocks=None):
        self.blocks = blocks


class PackedRowwiseParallel(PackedColwiseParallel):
    pass


class FluxAttention(nn.Module):
    def __init__(self, h, heads, added=False, pre_only=False):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(h, h) for _ in range(3))
        if not pre_only:  # as diffusers: a single-stream block's attention has no output projection
            self.to_out = nn.ModuleList([nn.Linear(h, h), nn.Dropout(0.0)])
        if added:
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(h, h) for _ in range(3))
            self.to_add_out = nn.Linear(h, h)


class Flux2FeedForward(nn.Module):
    def __init__(self, h, mult=3):
        super().__init__()
        self.linear_in = nn.Linear(h, 2 * mult * h, bias=False)
        self.linear_out = nn.Linear(mult * h, h, bias=False)


class Flux2Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.attn = FluxAttention(h, heads, added=True)
        self.ff = Flux2FeedForward(h)
        self.ff_context = Flux2FeedForward(h)


class Flux2ParallelSelfAttention(nn.Module):
    def __init__(self, h, heads, mult=3):
        super().__init__()
        self.heads = heads
        self.to_qkv_mlp_proj = nn.Linear(h, (3 + 2 * mult) * h, bias=False)
        self.to_qkv_mlp_proj._tp_packed_col_blocks = [h, h, h, mult * h, mult * h]  # absolute sizes
        self.to_out = nn.Linear((1 + mult) * h, h, bias=False)
        self.to_out._tp_packed_row_blocks = [h, mult * h]


class Flux2SingleBlock(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.attn = Flux2ParallelSelfAttention(h, heads)


class Flux2Transformer(nn.Module):
    _tp_plan = {
        "transformer_blocks.*.attn.to_q": "colwise",
        "transformer_blocks.*.attn.to_k": "colwise",
        "transformer_blocks.*.attn.to_v": "colwise",
        "transformer_blocks.*.attn.to_out.0": "rowwise",
        "transformer_blocks.*.attn.add_q_proj": "colwise",
        "transformer_blocks.*.attn.add_k_proj": "colwise",
        "transformer_blocks.*.attn.add_v_proj": "colwise",
        "transformer_blocks.*.attn.to_add_out": "rowwise",
        "transformer_blocks.*.ff.linear_in": PackedColwiseParallel([1, 1]),
        "transformer_blocks.*.ff.linear_out": "rowwise",
        "transformer_blocks.*.ff_context.linear_in": PackedColwiseParallel([1, 1]),
        "transformer_blocks.*.ff_context.linear_out": "rowwise",
        "single_transformer_blocks.*.attn.to_qkv_mlp_proj": PackedColwiseParallel(),
        "single_transformer_blocks.*.attn.to_out": PackedRowwiseParallel(),
    }

    def __init__(self, h=32, heads=4, double=2, single=2):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(Flux2Block(h, heads) for _ in range(double))
        self.single_transformer_blocks = nn.ModuleList(Flux2SingleBlock(h, heads) for _ in range(single))
        self.proj_out = nn.Linear(h, 16)


class FluxSingleBlock(nn.Module):
    def __init__(self, h, heads, mult=4):
        super().__init__()
        self.attn = FluxAttention(h, heads, pre_only=True)
        self.proj_mlp = nn.Linear(h, mult * h)
        self.proj_out = nn.Linear((1 + mult) * h, h)


class FluxTransformer(nn.Module):
    _tp_plan = {
        "transformer_blocks.*.attn.to_q": "colwise",
        "transformer_blocks.*.attn.to_k": "colwise",
        "transformer_blocks.*.attn.to_v": "colwise",
        "transformer_blocks.*.attn.to_out.0": "rowwise",
        "single_transformer_blocks.*.attn.to_q": "colwise",
        "single_transformer_blocks.*.attn.to_k": "colwise",
        "single_transformer_blocks.*.attn.to_v": "colwise",
        "single_transformer_blocks.*.proj_mlp": "colwise",
        "single_transformer_blocks.*.proj_out": PackedRowwiseParallel([1, 4]),
    }

    def __init__(self, h=32, heads=4):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(nn.Module() for _ in range(2))
        for b in self.transformer_blocks:
            b.attn = FluxAttention(h, heads)
        self.single_transformer_blocks = nn.ModuleList(FluxSingleBlock(h, heads) for _ in range(2))


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_diffusers_flux2_plan_resolves(degree):
    model = meta(Flux2Transformer)
    specs = resolve_plan(model, Flux2Transformer._tp_plan, degree)
    assert specs["single_transformer_blocks.1.attn.to_qkv_mlp_proj.weight"] == sw.ShardSpec(
        dim=0, blocks=(32, 32, 32, 96, 96))
    assert specs["single_transformer_blocks.0.attn.to_out.weight"] == sw.ShardSpec(dim=1, blocks=(32, 96))
    assert specs["transformer_blocks.0.ff.linear_in.weight"] == sw.ShardSpec(dim=0, blocks=(1, 1))
    assert specs["transformer_blocks.1.attn.to_out.0.bias"].replicated
    assert specs["transformer_blocks.1.attn.to_q.bias"] == sw.ShardSpec(dim=0)
    assert specs["proj_out.weight"].replicated


def test_diffusers_flux_plan_resolves():
    specs = resolve_plan(meta(FluxTransformer), FluxTransformer._tp_plan, 4)
    assert specs["single_transformer_blocks.0.proj_out.weight"] == sw.ShardSpec(dim=1, blocks=(1, 4))
    assert specs["single_transformer_blocks.0.proj_mlp.bias"] == sw.ShardSpec(dim=0)


def test_torch_parallel_styles_are_accepted():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert normalize_style(ColwiseParallel()).kind == "colwise"
    assert normalize_style(ColwiseParallel(output_layouts=Replicate())).gather_output
    assert normalize_style(RowwiseParallel(input_layouts=Replicate())).split_input


def test_tiny_transformer_plan():
    specs = resolve_plan(meta(TinyTransformer), tiny_plan(), 4)
    assert specs["single.0.proj_in.weight"] == sw.ShardSpec(dim=0, blocks=(1, 1, 1, 3, 3))
    assert specs["single.0.proj_out.weight"] == sw.ShardSpec(dim=1, blocks=(1, 3))
    assert specs["fused.0.mlp.gate_up.weight"] == sw.ShardSpec(dim=0, blocks=(1, 1))  # "packed_colwise"
    assert specs["single.0.modulation.weight"] == sw.ShardSpec(dim=1)
    assert specs.styles["single.0.modulation"].split_input


# --- validation: every error names the key -----------------------------------------------
def test_unknown_style_lists_supported():
    model = meta(TinyTransformer)
    with pytest.raises(sw.PlanError) as e:
        resolve_plan(model, {"layers.*.attn.q": "diagonal_parallel"}, 2)
    msg = str(e.value)
    assert "'layers.*.attn.q'" in msg and "diagonal_parallel" in msg
    assert all(s in msg for s in ("colwise", "rowwise", "PackedColwise(blocks)"))
    assert "colwise" in SUPPORTED_STYLES


def test_key_matching_nothing_is_skipped_and_reported():
    # transformers' semantics: a key this configuration lacks is skipped and listed
    attention = {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
                 "layers.*.attn.o": "rowwise"}
    specs = resolve_plan(meta(TinyTransformer), {"layers.*.attn.q_proj": "colwise", "lm_head": "colwise",
                                                    **attention}, 2)
    assert specs.unused_keys == ("layers.*.attn.q_proj", "lm_head")
    assert specs["layers.0.attn.q.weight"] == sw.ShardSpec(dim=0)


def test_strict_plan_names_the_key_that_matches_nothing():
    with pytest.raises(sw.PlanError) as e:
        resolve_plan(meta(TinyTransformer), {"layers.*.attn.q_proj": "colwise"}, 2, strict=True)
    assert "'layers.*.attn.q_proj'" in str(e.value) and "matches no module" in str(e.value)
    with pytest.raises(sw.PlanError, match="'lm_head'.*did you mean 'head"):
        resolve_plan(meta(TinyTransformer), {"lm_head": "colwise"}, 2, strict=True)


def test_star_stands_for_an_index_and_may_repeat():
    # '*' matches numeric path components only, as many as the key has
    with pytest.raises(sw.PlanError, match=r"'embed\.\*'"):
        resolve_plan(meta(TinyTransformer), {"embed.*": "colwise"}, 2, strict=True)
    inner = [nn.ModuleList([nn.Linear(4, 8)]) for _ in range(2)]
    model = meta(nn.ModuleDict, {"outer": nn.ModuleList(inner)})
    specs = resolve_plan(model, {"outer.*.*": "colwise"}, 2)
    assert specs["outer.1.0.weight"] == sw.ShardSpec(dim=0) and specs["outer.0.0.bias"] == sw.ShardSpec(dim=0)


def test_two_keys_claiming_one_module():
    plan = {"layers.*.attn.q": "colwise", "layers.0.attn.q": "rowwise"}
    with pytest.raises(sw.PlanError) as e:
        resolve_plan(meta(TinyTransformer), plan, 2)
    assert "'layers.*.attn.q'" in str(e.value) and "'layers.0.attn.q'" in str(e.value)


def test_indivisible_dim_names_key_tensor_and_sizes():
    model = meta(TinyTransformer, hidden=36, heads=3, ffn=60)
    with pytest.raises(sw.errors.ShardingError) as e:
        resolve_plan(model, {"layers.*.mlp.down": "rowwise", "layers.*.mlp.gate_up": "packed_colwise"}, 8)
    msg = str(e.value)
    assert "'layers.*.mlp.down'" in msg and "layers.0.mlp.down.weight" in msg and "60" in msg and "8" in msg


def test_each_packed_block_must_divide():
    # blocks [1, 3] of 32 rows are 8 and 24: degree 16 divides 32 but not 8 / 24
    model = meta(nn.ModuleDict, {"fc": nn.Linear(4, 32)})
    with pytest.raises(sw.errors.ShardingError) as e:
        resolve_plan(model, {"fc": sw.PackedColwise([1, 3])}, 16)
    assert "'fc'" in str(e.value) and "16" in str(e.value)


def test_head_count_must_divide():
    # hidden 48 divides by 4, but 3 heads do not
    model = meta(TinyTransformer, hidden=48, heads=3, ffn=64)
    with pytest.raises(sw.errors.ShardingError) as e:
        resolve_plan(model, {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
                                "layers.*.attn.v": "colwise", "layers.*.attn.o": "rowwise"}, 4)
    assert "num_heads = 3" in str(e.value) and "'layers.*.attn.q'" in str(e.value)


def test_config_head_count_must_divide():
    model = meta(LlamaForCausalLM)  # 8 heads, 4 kv heads
    with pytest.raises(sw.errors.ShardingError, match="num_key_value_heads = 4"):
        resolve_plan(model, with_prefix(LLAMA_BASE_TP_PLAN), 8)


def test_sharded_style_on_unsupported_module():
    model = meta(TinyTransformer)
    with pytest.raises(sw.PlanError, match="'norm_out'.*LayerNorm"):
        resolve_plan(model, {"norm_out": "colwise"}, 2)


def test_packed_without_blocks_names_the_attribute():
    with pytest.raises(sw.PlanError, match="_tp_packed_col_blocks"):
        resolve_plan(meta(TinyTransformer), {"head": sw.PackedColwise()}, 2)


def test_bad_degree_and_plan_types():
    with pytest.raises(sw.PlanError):
        resolve_plan(meta(TinyTransformer), tiny_plan(), 0)
    with pytest.raises(sw.PlanError):
        resolve_plan(meta(TinyTransformer), [("head", "colwise")], 2)
    with pytest.raises(sw.PlanError):
        sw.PackedColwise([1, 0])


def test_head_count_error_names_the_attention_module():
    # the plan lists lm_head first; the error must point at an attention projection
    model = meta(LlamaForCausalLM)  # 8 heads, 4 kv heads
    plan = {**LM_TP_PLAN, **with_prefix(LLAMA_BASE_TP_PLAN)}
    with pytest.raises(sw.errors.ShardingError) as e:
        resolve_plan(model, plan, 8)
    assert "self_attn" in str(e.value) and "lm_head" not in str(e.value)


def test_indivisible_degree_lists_the_degrees_that_pass_every_check():
    # 36 and 60 rows split at 1, 2, 3, 4, 6, 12, but the 3 heads only at 1 and 3
    model = meta(TinyTransformer, hidden=36, heads=3, ffn=60)
    with pytest.raises(sw.errors.ShardingError, match=r"plan: 1, 3$"):
        resolve_plan(model, {"layers.*.mlp.down": "rowwise", "layers.*.mlp.gate_up": "packed_colwise",
                                "layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
                                "layers.*.attn.v": "colwise", "layers.*.attn.o": "rowwise"}, 8)


def test_parameter_keys_and_expert_styles():
    from hf_shaped import HFShapedLM

    model = meta(HFShapedLM, num_experts=4)
    specs = resolve_plan(model, "auto", 2)
    assert specs["model.layers.0.mlp.experts.gate_up_proj"] == sw.ShardSpec(dim=1, blocks=(1, 1))
    assert specs["model.layers.0.mlp.experts.down_proj"] == sw.ShardSpec(dim=2)
    assert specs.styles["model.layers.0.mlp.experts"].forward == "moe_experts"
    assert specs.local_owners[0] == "model.layers.0.mlp.experts"
    ep = resolve_plan(model, "auto", 1, ep_degree=2)  # ep rules replace the tp rules of the experts
    assert ep["model.layers.1.mlp.experts.down_proj"] == sw.ShardSpec(dim=0, axis="ep")
    assert ep.styles["model.layers.1.mlp.experts"].num_experts == 4
    with pytest.raises(sw.errors.ShardingError, match="gate_up_proj"):
        resolve_plan(model, "auto", 1, ep_degree=3)


def test_statistics_over_sharded_features_are_refused():
    # Gemma-3n's activation sparsity: a top-k over gate_proj's features, which colwise would split
    class SparseMlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.activation_sparsity = 0.95
            self.gate_proj, self.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)

    model = meta(nn.ModuleDict, {"mlp": SparseMlp()})
    with pytest.raises(sw.PlanError, match="activation-sparsity"):
        resolve_plan(model, {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise"}, 2)
    assert resolve_plan(model, {"mlp.up_proj": "colwise"}, 2)  # gate kept whole: fine


class _FusedExperts(nn.Module):
    """Inkling-style experts: a fused [experts, 2 x intermediate, hidden] gate_up_proj that the
    forward cuts into gate and up halves."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 16, 8))
        self.down_proj = nn.Parameter(torch.zeros(2, 8, 8))

    def forward(self, x, expert):
        gate, up = nn.functional.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[expert])


def test_a_plain_split_of_fused_gate_up_halves_is_refused():
    model = meta(nn.ModuleDict, {"experts": _FusedExperts()})
    with pytest.raises(sw.PlanError, match="packed_colwise"):
        resolve_plan(model, {"experts.gate_up_proj": "colwise", "experts.down_proj": "rowwise"}, 2)
    packed = {"experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise"}
    specs = resolve_plan(model, packed, 2)
    assert specs["experts.gate_up_proj"] == sw.ShardSpec(dim=1, blocks=(1, 1))
    assert resolve_plan(model, {"experts.gate_up_proj": "colwise"}, 1)  # degree 1 splits nothing


def test_base_model_plan_applies_to_a_causal_lm_under_its_prefix():
    # config.base_model_tp_plan's keys name the base model's modules ("layers.*..."): on a
    # *ForCausalLM they match under base_model_prefix ("model.layers.*...")
    model = meta(LlamaForCausalLM)
    specs = resolve_plan(model, LLAMA_BASE_TP_PLAN, 2)
    assert specs["model.layers.1.self_attn.q_proj.weight"] == sw.ShardSpec(dim=0)
    assert specs["model.layers.0.mlp.down_proj.weight"] == sw.ShardSpec(dim=1)
    assert specs.unused_keys == ()


def test_core_runs_the_model_checks_registered_above_it_without_reading_source():
    # core/plan.py stays pure: the source-reading and model-family checks are registered
    # from shardwise.hf.adapter (registered by `import shardwise`) and called through the hook
    import inspect as _inspect

    import shardwise.core.plan as core_plan
    from shardwise.hf.adapter import check_fused_halves, check_statistics_over_shards

    assert core_plan._MODEL_CHECKS[:2] == [check_statistics_over_shards, check_fused_halves]
    source = _inspect.getsource(core_plan)
    assert "getsource" not in source and "activation_sparsity" not in source
