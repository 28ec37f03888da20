"""transformers 5.25's plans: ``unit_colwise`` (MiniCPM5-MoE's k/v projections), and plans
written for 5.24 (experts in the TP plan: ``moe_tp_experts`` with ``packed_colwise`` /
``rowwise`` parameter keys) beside 5.25's layout (attention in ``base_model_tp_plan``, experts
in ``base_model_ep_plan``; tests/hf/test_hub_layout.py loads that at tp, ep and tp x ep).

``unit_colwise`` gives each rank whole heads. Where the degree divides the head count it is
``colwise``, which shardwise serves (logits equal one process); where it does not, transformers
replicates heads across ranks and shardwise refuses before reading, naming the degrees that work.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from hf import hf_models  # noqa: E402
from shardwise.errors import ShardingError  # noqa: E402

ATTENTION = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
             "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
PLAN_524 = {**ATTENTION, "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
            "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts"}


def _load(kind: str, folder: str, plan):
    backend = sw.init_backend("gloo")
    want = hf_models.forward(hf_models.build_tiny(kind), kind)
    with sw.empty_model():
        model = hf_models.model_class(kind)._from_config(hf_models.KINDS[kind][2]())
    result = sw.load(model, folder, plan=plan, mesh=backend.mesh(tp=2))
    got = hf_models.forward(model.eval(), kind)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-4, (got - want).abs().max()
    return sorted(result.unused_plan_keys)


def test_unit_colwise_loads_whole_heads_at_tp2(tmp_path):
    from transformers import MiniCPM5MoeConfig

    assert "unit_colwise" in MiniCPM5MoeConfig.base_model_tp_plan.values()  # the style under test
    folder = hf_models.save_tiny("minicpm5_moe", tmp_path / "ckpt")
    assert run_ranks(_load, 2, "minicpm5_moe", str(folder), "auto", timeout=240) == [[], []]


def test_unit_colwise_over_more_ranks_than_heads_is_refused_with_the_degrees():
    from shardwise.core.plan import resolve_plan

    with sw.empty_model():
        model = hf_models.model_class("minicpm5_moe")._from_config(hf_models.KINDS["minicpm5_moe"][2]())
    with pytest.raises(ShardingError, match=r"num_key_value_heads.*2") as err:
        resolve_plan(model, "auto", 4)  # 2 kv heads over 4 ranks: transformers would replicate them
    assert "2" in str(err.value)


def test_a_524_plan_with_experts_in_the_tp_plan_still_loads(tmp_path):
    folder = hf_models.save_tiny("mixtral", tmp_path / "ckpt")
    assert run_ranks(_load, 2, "mixtral", str(folder), PLAN_524, timeout=240) == [[], []]
