"""Plans that cannot be what the user meant, refused before anything is read: no key matching the
model, a split projection whose consumer is not split alike, head counts a forward reads whole,
and degree suggestions that pass every check. Meta models, no process group."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from models import TinyTransformer, tiny_plan
from shardwise.core.plan import resolve_plan


def check_plan(model, specs):
    from shardwise.plan_checks import check_plan  # above core: it reads the model's forward source

    check_plan(model, specs)


def meta(cls, *args, **kwargs):
    with torch.device("meta"):
        return cls(*args, **kwargs)


ATTENTION = {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
             "layers.*.attn.o": "rowwise"}


# --- a plan none of whose keys matches ---------------------------------------------------
def test_a_plan_matching_nothing_names_the_closest_module_paths():
    with pytest.raises(sw.PlanError) as e:
        resolve_plan(meta(TinyTransformer), {"layers.*.attn.q_proj": "colwise",
                                                "layers.*.attn.o_proj": "rowwise"}, 2)
    msg = str(e.value)
    assert "none of the plan's 2 keys" in msg and "TinyTransformer" in msg
    assert "'layers.*.attn.q_proj'" in msg and "'layers.*.attn.q'" in msg  # the pattern, not layer 0
    assert "'layers.*.attn.o'" in msg


def test_one_matching_key_keeps_the_others_skipped_and_reported():
    # transformers' leniency: keys absent from this configuration are skipped, not refused
    specs = resolve_plan(meta(TinyTransformer), {**ATTENTION, "lm_head": "colwise"}, 2)
    assert specs.unused_keys == ("lm_head",)


def test_an_empty_plan_is_a_deliberate_nothing_sharded():
    specs = resolve_plan(meta(TinyTransformer), {}, 2)
    assert specs and all(s.replicated for s in specs.values())


def test_a_plan_matching_nothing_is_refused_at_degree_1_too():
    # the plan is wrong for the model whatever the mesh: a mesh without tp checks it at degree 1
    with pytest.raises(sw.PlanError, match="none of the plan's 1 keys"):
        resolve_plan(meta(TinyTransformer), {"blocks.*.attn.to_q": "colwise"}, 1)


# --- a split projection and its consumer ------------------------------------------------
@pytest.mark.parametrize("degree", [2, 4])
def test_colwise_without_rowwise_consumer_names_both_modules(degree):
    plan = {k: v for k, v in ATTENTION.items() if not k.endswith(".o")}
    with pytest.raises(sw.PlanError) as e:
        resolve_plan(meta(TinyTransformer), plan, degree)
    msg = str(e.value)
    assert "'layers.0.attn.q'" in msg and "'layers.0.attn.o'" in msg
    assert "'layers.*.attn.o': 'rowwise'" in msg  # the fix, as a plan entry


def test_rowwise_consumer_of_whole_projections_names_both_modules():
    with pytest.raises(sw.PlanError) as e:
        resolve_plan(meta(TinyTransformer), {"layers.*.mlp.down": "rowwise"}, 2)
    msg = str(e.value)
    assert "'layers.0.mlp.down'" in msg and "'layers.0.mlp.gate_up'" in msg


def test_consumer_fed_a_split_input_must_not_split_it_again():
    plan = {**ATTENTION, "layers.*.attn.o": "rowwise_split_input"}
    with pytest.raises(sw.PlanError, match="'layers.0.attn.o'"):
        resolve_plan(meta(TinyTransformer), plan, 2)


def test_consistent_plans_and_degree_1_are_accepted():
    assert resolve_plan(meta(TinyTransformer), tiny_plan(), 2)
    assert resolve_plan(meta(TinyTransformer), {"layers.*.attn.q": "colwise"}, 1)  # nothing split
    # a gathered output is whole again: its consumer takes it as it is
    assert resolve_plan(meta(TinyTransformer), {"layers.*.attn.q": "colwise_gather_output"}, 2)


class _DiffusersAttention(nn.Module):
    """diffusers' names: to_q/to_k/to_v, an output ModuleList [Linear, Dropout], and the
    context stream's add_*_proj -> to_add_out."""

    def __init__(self, h=16):
        super().__init__()
        self.heads = 2
        self.to_q, self.to_k, self.to_v = (nn.Linear(h, h) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(h, h), nn.Dropout(0.0)])
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(h, h) for _ in range(3))
        self.to_add_out = nn.Linear(h, h)


def test_diffusers_names_pair_through_the_output_module_list():
    model = meta(nn.ModuleDict, {"blocks": nn.ModuleList([_DiffusersAttention()])})
    plan = {f"blocks.*.{n}": "colwise" for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj",
                                                   "add_v_proj")}
    with pytest.raises(sw.PlanError, match=r"'blocks\.0\.to_out\.0'"):
        resolve_plan(model, plan, 2)
    with pytest.raises(sw.PlanError, match=r"'blocks\.0\.add_q_proj'.*'blocks\.0\.to_add_out'"):
        resolve_plan(model, {**plan, "blocks.*.to_out.0": "rowwise"}, 2)
    paired = {**plan, "blocks.*.to_out.0": "rowwise", "blocks.*.to_add_out": "rowwise"}
    assert resolve_plan(model, paired, 2)


# --- head counts a forward reads whole ----------------------------------------------------
class _HeadsAttention(nn.Module):
    """Reshapes with its head count: under tensor parallelism each rank holds num_heads /
    degree heads, so ``view(b, t, self.num_heads, -1)`` would give every rank all heads of a
    smaller width, silently."""

    def __init__(self, h=32, heads=4):
        super().__init__()
        self.num_heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


class _Processor:
    def __call__(self, attn, x):
        b, t, _ = x.shape
        heads = attn.heads
        q = attn.to_q(x).view(b, -1, heads, x.shape[-1] // heads)
        return attn.to_out[0](q.flatten(2))


class _ProcessorAttention(_DiffusersAttention):
    def __init__(self):
        super().__init__()
        self.processor = _Processor()

    def forward(self, x):
        return self.processor(self, x)


HEADS_PLAN = {"a.q": "colwise", "a.k": "colwise", "a.v": "colwise", "a.o": "rowwise"}


def test_a_forward_that_reshapes_with_its_head_count_is_refused():
    model = meta(nn.ModuleDict, {"a": _HeadsAttention()})
    check_plan(model, resolve_plan(model, HEADS_PLAN, 1))  # degree 1: every rank has every head
    with pytest.raises(sw.PlanError) as e:
        check_plan(model, resolve_plan(model, HEADS_PLAN, 2))
    msg = str(e.value)
    assert "'a'" in msg and "self.num_heads" in msg and "'a.q'" in msg and "_HeadsAttention.forward" in msg


def test_a_processor_that_reshapes_with_the_head_count_is_refused():
    model = meta(nn.ModuleDict, {"a": _ProcessorAttention()})
    plan = {"a.to_q": "colwise", "a.to_k": "colwise", "a.to_v": "colwise", "a.to_out.0": "rowwise",
            "a.add_q_proj": "colwise", "a.add_k_proj": "colwise", "a.add_v_proj": "colwise",
            "a.to_add_out": "rowwise"}
    # heads = attn.heads, then view(b, -1, heads, ...)
    with pytest.raises(sw.PlanError, match=r"_Processor\.__call__ .*view\(b, -1, heads, "):
        check_plan(model, resolve_plan(model, plan, 2))


def test_a_forward_that_infers_its_heads_passes():
    model = meta(TinyTransformer)  # view(b, t, -1, head_dim)
    check_plan(model, resolve_plan(model, tiny_plan(), 2))


# --- degree suggestions -------------------------------------------------------------------
class _GQA(nn.Module):
    def __init__(self, h=64, heads=8, kv_heads=2):
        super().__init__()
        self.config = type("Config", (), {"num_attention_heads": heads, "num_key_value_heads": kv_heads})()
        d = h // heads
        self.q_proj, self.o_proj = nn.Linear(h, heads * d), nn.Linear(heads * d, h)
        self.k_proj, self.v_proj = nn.Linear(h, kv_heads * d), nn.Linear(h, kv_heads * d)


GQA_PLAN = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}


def test_degree_suggestions_pass_the_head_count_checks():
    # the tensors split at 1, 2, 4, 8, 16 (16 kv rows), but 2 kv heads leave only 1 and 2
    with pytest.raises(sw.errors.ShardingError) as e:
        resolve_plan(meta(_GQA), GQA_PLAN, 3)
    assert str(e.value).endswith("Degrees that pass every check of this plan: 1, 2")
    with pytest.raises(sw.errors.ShardingError) as e:
        resolve_plan(meta(_GQA), GQA_PLAN, 4)
    assert "num_key_value_heads = 2" in str(e.value)
    assert str(e.value).endswith("Degrees that pass every check of this plan: 1, 2")


# --- a plan key that matches nothing (issue #44) -----------------------------------------
def resolve_for_mesh_at_tp1(plan):
    """What ``sw.load`` / ``sw.parallelize`` run on the plan at tp=1 (``parallel.resolve_for_mesh``)."""
    from shardwise.plan_checks import check_unused_keys

    model = meta(TinyTransformer)
    specs = resolve_plan(model, plan, 1)
    check_unused_keys(model, specs.unused_keys, ours=True)
    return specs


def test_a_key_one_typo_from_a_module_is_refused_naming_both_at_tp1_too():
    plan = {k: v for k, v in tiny_plan().items() if k != "layers.*.mlp.down"}
    plan["layers.*.mlp.donw"] = "rowwise"  # a typo: `down` stays whole, the forward is wrong at tp > 1
    with pytest.raises(sw.PlanError) as e:
        resolve_for_mesh_at_tp1(plan)
    msg = str(e.value)
    assert "plan key 'layers.*.mlp.donw' matches nothing in TinyTransformer" in msg, msg
    assert "did you mean 'layers.*.mlp.down'?" in msg and "tp=1 too" in msg, msg


def test_a_key_far_from_every_module_is_skipped_with_a_warning_naming_the_closest():
    plan = {**tiny_plan(), "layers.*.mlp.experts": "colwise"}  # a module of another variant
    said = r"1 plan key\(s\) match nothing in TinyTransformer and were skipped \(they shard nothing\): "
    with pytest.warns(UserWarning, match=said + r"'layers.\*.mlp.experts' \(closest"):
        specs = resolve_for_mesh_at_tp1(plan)
    assert specs.unused_keys == ("layers.*.mlp.experts",)
