"""Plans that cannot be what the user meant, on a real transformers Llama: refused with a
PlanError that says what to write instead, before a byte is read. Before this check the first
three loaded (every rank holding the whole model, or a forward failing inside torch)."""

from __future__ import annotations

import pytest

from shardwise.core.plan import resolve_plan
from shardwise.parallel import get_shard_state

pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_models import KINDS, build_tiny, forward, model_class, save_tiny  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402

README_KEY = {"layers.*.attn.q_proj": "colwise"}  # README's example key: a made-up module layout
Q_ONLY = {"model.layers.*.self_attn.q_proj": "colwise"}


def _flux_plan() -> dict:
    diffusers = pytest.importorskip("diffusers")
    return dict(diffusers.FluxTransformer2DModel._tp_plan)


def _llama():
    with sw.empty_model():
        return model_class("llama")(KINDS["llama"][2]())  # 4 heads, 2 kv heads, hidden 64


def test_readme_key_on_llama_names_the_module_it_meant():
    with pytest.raises(sw.PlanError) as e:
        resolve_plan(_llama(), README_KEY, 2)
    msg = str(e.value)
    assert "none of the plan's 1 keys" in msg and "LlamaForCausalLM" in msg
    assert "'model.layers.*.self_attn.q_proj'" in msg


def test_flux_plan_on_llama_is_refused():
    plan = _flux_plan()
    with pytest.raises(sw.PlanError, match=f"none of the plan's {len(plan)} keys"):
        resolve_plan(_llama(), plan, 2)


def test_q_proj_alone_names_q_proj_and_o_proj():
    with pytest.raises(sw.PlanError) as e:
        resolve_plan(_llama(), Q_ONLY, 2)
    msg = str(e.value)
    assert "'model.layers.0.self_attn.q_proj'" in msg and "'model.layers.0.self_attn.o_proj'" in msg
    assert "'model.layers.*.self_attn.o_proj': 'rowwise'" in msg


def test_degree_suggestion_excludes_degrees_the_kv_heads_refuse():
    # every tensor of Llama's own plan splits at 1, 2, 4, 8, 16, 32, but 2 kv heads allow 1, 2 only
    with pytest.raises(sw.errors.ShardingError) as e:
        resolve_plan(_llama(), "auto", 3)
    assert str(e.value).endswith("Degrees that pass every check of this plan: 1, 2")
    with pytest.raises(sw.errors.ShardingError,
                       match="num_key_value_heads = 2.*every check of this plan: 1, 2$"):
        resolve_plan(_llama(), "auto", 4)


def test_own_plan_still_resolves():
    specs = resolve_plan(_llama(), "auto", 2)
    assert specs["model.layers.0.self_attn.q_proj.weight"] == sw.ShardSpec(dim=0)
    assert specs["model.layers.1.self_attn.o_proj.weight"] == sw.ShardSpec(dim=1)


def _load_each(ckpt: str, plans: dict) -> dict:
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    out = {}
    for name, plan in plans.items():
        with sw.empty_model():
            model = model_class("llama")(KINDS["llama"][2]())
        try:
            sw.load(model, ckpt, plan=plan, mesh=mesh)
            specs = get_shard_state(model).specs
            out[name] = f"loaded; sharded: {sum(not s.replicated for s in specs.values())}"
        except sw.PlanError as e:
            out[name] = f"PlanError: {e}"
    model = sw.from_pretrained(model_class("llama"), ckpt, mesh=mesh)  # the model's own plan still loads
    out["auto"] = forward(model, "llama").tolist()
    return out


def test_load_refuses_them_on_every_rank_and_the_own_plan_loads(tmp_path):
    ckpt = save_tiny("llama", tmp_path / "ckpt")
    plans = {"readme": README_KEY, "flux": _flux_plan(), "q_only": Q_ONLY}
    rows = run_ranks(_load_each, 2, str(ckpt), plans, timeout=240)
    reference = forward(build_tiny("llama"), "llama")
    for row in rows:
        assert "model.layers.*.self_attn.q_proj" in row["readme"] and row["readme"].startswith("PlanError")
        assert row["flux"].startswith("PlanError: none of the plan's")
        assert row["q_only"].startswith("PlanError") and "o_proj" in row["q_only"]
        assert (torch.tensor(row["auto"]) - reference).abs().max().item() <= 1e-4
