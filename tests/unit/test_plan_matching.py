"""Plan matching walks each module path once through a trie of the keys (STYLE.md rule 22); these
tests hold it, and the head counts found by path parents, to the per-key regex scan and the
per-module prefix scan they replaced, on many models, plans and random names."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from models import TinyTransformer, tiny_plan
from plan_reference import reference_head_counts, reference_match_plan, regex_hits
from shardwise.core.plan import resolve_plan
from shardwise.core.plan_rules import head_counts
from shardwise.core.styles import match_plan, matches
from shardwise.errors import PlanError


# --- models ---------------------------------------------------------------------------------
class Experts(nn.Module):  # an MXFP4 `x` held as `x_blocks` + `x_scales`, numbered experts below
    def __init__(self, n):
        super().__init__()
        self.gate_up_proj_blocks = nn.Parameter(torch.empty(n, 8, 4))
        self.gate_up_proj_scales = nn.Parameter(torch.empty(n, 8))
        self.each = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads = 4
        self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)


class Layer(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.self_attn = Attention()
        self.mlp = Experts(experts)


class Base(nn.Module):
    def __init__(self, layers, experts):
        super().__init__()
        self.layers = nn.ModuleList(Layer(experts) for _ in range(layers))
        self.layers.add_module("x*", nn.Linear(2, 2))  # a component that is a '*' itself


class Prefixed(nn.Module):
    base_model_prefix = "model"

    def __init__(self, layers=3, experts=12):
        super().__init__()
        self.model = Base(layers, experts)
        self.lm_head = nn.Linear(8, 8)


PLANS = [
    {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"},
    {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
     "lm_head": "colwise_rep"},
    {"layers.*.mlp.gate_up_proj": "grouped_gemm", "layers.1.mlp.each.*": "colwise", "missing": "colwise"},
    {"layers.*.mlp.each.1*": "colwise", "layers.x*": "colwise", "model.layers.*.mlp.each.11": "rowwise",
     "*": "colwise", "*.*": "colwise", "model.*.*.self_attn": "replicated"},
    {"layers.*.self_attn.q_proj.weight": "colwise", "layers.*.self_attn.q_proj.bias": "colwise"},
]


def test_match_plan_claims_what_the_regex_scan_claimed():
    for model in (Prefixed(), Prefixed(layers=11, experts=3), Base(2, 2)):
        for plan in PLANS:
            expected = reference_match_plan(model, plan)
            if len(expected[2]) == len(plan):  # nothing matches: an error, as before
                with pytest.raises(PlanError, match="none of the plan's"):
                    match_plan(model, plan)
            else:
                assert match_plan(model, plan) == expected, plan


def test_tiny_transformer_plans_resolve_as_before():
    model = TinyTransformer(num_layers=3, num_fused=2, num_single=2)
    for embedding in ("embedding_rowwise", "embedding_colwise"):
        plan = tiny_plan(embedding)
        assert match_plan(model, plan) == reference_match_plan(model, plan)
        for degree in (1, 2, 4):
            specs = resolve_plan(model, plan, degree)
            sharded = [p for p, s in specs.styles.items() if s.sharded]
            assert head_counts(model, sharded) == reference_head_counts(model, sharded)


def test_head_counts_as_the_prefix_scan_found_them():
    model = Prefixed(layers=4)
    several = ["lm_head", "model.layers.2.self_attn.o_proj.weight", "model.layers.2.self_attn.q_proj"]
    for sharded in ([], ["model.layers.0.self_attn.q_proj"], several):
        assert head_counts(model, sharded) == reference_head_counts(model, sharded)


class _ClassHeads(nn.Module):
    num_key_value_heads = 2  # on the class

    @property
    def n_heads(self):  # a property on the class
        return 4


class _Forwarding(nn.Module):
    """A module answering head counts through a ``__getattr__`` of its own (as PEFT's wrappers)."""

    def __getattr__(self, name):
        if name == "num_heads":
            return 8
        return super().__getattr__(name)


def test_head_counts_found_on_the_instance_the_class_or_a_getattr_of_its_own():
    model = nn.Module()
    model.a, model.b, model.c = nn.Module(), _ClassHeads(), _Forwarding()
    model.a.num_attention_heads, model.a.heads = 6, 3  # in the instance dict, in HEAD_ATTRS' order
    for owner in (model.a, model.b, model.c):
        owner.q_proj = nn.Linear(4, 4)
    sharded = ["a.q_proj", "b.q_proj", "c.q_proj"]
    got = head_counts(model, sharded)
    assert got == reference_head_counts(model, sharded)
    assert [(o, a, v) for o, a, v, _ in got] == [
        ("model.a", "heads", 3), ("model.a", "num_attention_heads", 6),
        ("model.b", "num_key_value_heads", 2), ("model.b", "n_heads", 4), ("model.c", "num_heads", 8)]


PARTS = st.sampled_from(["layers", "0", "7", "12", "*", "x*", "mlp", "q", "q_proj", "", "\u0663", "a.b"])


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.lists(PARTS, min_size=1, max_size=4).map(".".join), min_size=1, max_size=6),
       names=st.lists(st.lists(PARTS, min_size=1, max_size=4).map(".".join), max_size=12))
def test_trie_matches_each_key_as_its_regex(keys, names):
    assert matches(keys, names) == [regex_hits(k, names) for k in keys]
