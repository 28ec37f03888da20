"""Plans as transformers ships them, on HF-shaped models: tied heads, parameter keys, MoE
experts, gradient all-reduce, ``plan="auto"``, and the after-install invariant."""

from __future__ import annotations

import pytest
import safetensors.torch as st
import torch

import shardwise as sw
from harness import run_ranks
from hf_shaped import make_lm
from shardwise.core.plan import resolve_plan
from shardwise.core.spec import split
from shardwise.errors import CheckpointError, ShardingError
from shardwise.mesh import decode_mesh
from shardwise.parallel import get_shard_state, install, local_of

SHAPES = {"dense": {}, "moe": {"num_experts": 4}}


def _ids(vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(3))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)).sum()


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    if type(g).__name__ == "DTensor":  # bring it to the parameter's own placement first
        g = g.redistribute(p.device_mesh, p.placements).to_local()
    return g


def _check_grads(model, reference, state) -> None:
    ref = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        spec = state.specs[name]
        want = ref[name] if spec.replicated else split(ref[name], spec, *state.coords(spec))
        torch.testing.assert_close(_local_grad(p), want, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _parallelize(degree: int, holding: str, shape: str, tie: bool):
    backend = sw.init_backend("gloo")
    reference = make_lm(tie=tie, **SHAPES[shape])
    want = reference(_ids())
    _loss(want).backward()
    model = make_lm(tie=tie, **SHAPES[shape])
    sw.parallelize(model, "auto", backend.mesh(tp=degree), holding=holding)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie  # one storage kept
    got = model(_ids())
    assert got.shape == want.shape
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    _loss(got).backward()
    _check_grads(model, reference, get_shard_state(model))
    return True


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("holding", ["dtensor", "local"])
@pytest.mark.parametrize("shape", ["dense", "moe"])
def test_transformers_plans_forward_and_gradients(degree, holding, shape):
    assert run_ranks(_parallelize, degree, degree, holding, shape, True) == [True] * degree


def _expert_parallel(axes: dict, holding: str):
    backend = sw.init_backend("gloo")
    reference = make_lm(num_experts=4)
    want = reference(_ids())
    _loss(want).backward()
    model = make_lm(num_experts=4)
    sw.parallelize(model, "auto", backend.mesh(**axes), holding=holding)
    state = get_shard_state(model)
    assert state.specs["model.layers.0.mlp.experts.gate_up_proj"] == sw.ShardSpec(dim=0, axis="ep")
    assert local_of(model.model.layers[0].mlp.experts.down_proj).shape[0] == 4 // axes["ep"]
    got = model(_ids())
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    _loss(got).backward()
    _check_grads(model, reference, state)
    return True


@pytest.mark.parametrize("holding", ["dtensor", "local"])
@pytest.mark.parametrize("axes", [{"ep": 2}, {"ep": 2, "tp": 2}], ids=["ep2", "ep2xtp2"])
def test_expert_parallel_forward_and_gradients(axes, holding):
    world = axes["ep"] * axes.get("tp", 1)
    assert run_ranks(_expert_parallel, world, axes, holding) == [True] * world


def test_untied_head():
    assert run_ranks(_parallelize, 2, 2, "dtensor", "dense", False) == [True] * 2


def _load(path, degree: int, holding: str, shape: str):
    backend = sw.init_backend("gloo")
    want = make_lm(**SHAPES[shape])(_ids())
    with sw.empty_model():
        model = make_lm(**SHAPES[shape])
    plan = {"bogus.*.key": "colwise", **model.tp_plan}
    with pytest.warns(UserWarning, match="bogus") if backend.rank == 0 else _no_warning():
        result = sw.load(model, path, plan=plan, mesh=backend.mesh(tp=degree), holding=holding)
    # the dense model has no experts; the MoE one has no dense MLP
    absent = (".mlp.experts",) if shape == "dense" else (".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj")
    unused = tuple(k for k in model.tp_plan if any(a in k for a in absent))
    assert result.unused_plan_keys == ("bogus.*.key", *unused)
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert head is embed and local_of(head).shape[0] == 64 // degree
    torch.testing.assert_close(model(_ids()), want, rtol=1e-5, atol=1e-5)
    return True


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("holding", ["dtensor", "local"])
@pytest.mark.parametrize("shape", ["dense", "moe"])
def test_load_tied_model_with_its_own_plan(tmp_path, holding, shape):
    st.save_model(make_lm(**SHAPES[shape]), str(tmp_path / "model.safetensors"))
    assert run_ranks(_load, 2, str(tmp_path), 2, holding, shape) == [True] * 2


def _broken_install(holding: str):
    backend = sw.init_backend("gloo")
    model = make_lm()
    specs = resolve_plan(model, "auto", 2)
    full = model.state_dict()

    def local_tensor(name, spec):  # a wrong shard for one tensor, as a buggy loader would give
        t = full[name] if spec.replicated else split(full[name], spec, 2, backend.rank)
        return t[:-1] if name == "model.layers.0.self_attn.q_proj.weight" else t

    with pytest.raises(ShardingError, match="'model.layers.0.self_attn.q_proj.weight'"):
        install(model, specs, decode_mesh(backend.mesh(tp=2), holding), local_tensor=local_tensor)
    return True


@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_install_refuses_a_wrong_shard(holding):
    assert run_ranks(_broken_install, 2, holding) == [True] * 2


def _int_for_float(path):
    backend = sw.init_backend("gloo")
    with sw.empty_model():
        model = make_lm()
    with pytest.raises(CheckpointError, match="'model.norm.weight' is stored as torch.int32.*torch.float32"):
        sw.load(model, path, plan="auto", mesh=backend.mesh(tp=1))
    return True


def test_stored_dtype_that_cannot_become_the_parameter(tmp_path):
    tensors = {k: v.clone() for k, v in make_lm(tie=False).state_dict().items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    tensors.pop("lm_head.weight")
    tensors["model.norm.weight"] = torch.ones(32, dtype=torch.int32)
    st.save_file(tensors, str(tmp_path / "model.safetensors"))
    assert run_ranks(_int_for_float, 1, str(tmp_path)) == [True]


def _save_expert_parallel(folder: str, holding: str):
    backend = sw.init_backend("gloo")
    model = make_lm(num_experts=4)
    sw.parallelize(model, "auto", backend.mesh(ep=2), holding=holding)
    sw.save(model, f"{folder}/full")
    sw.save(model, f"{folder}/dcp", distributed=True)
    return True


def _reload_at_tp2(folder: str):
    backend = sw.init_backend("gloo")
    want = make_lm(num_experts=4)(_ids())
    for axes in ({"tp": 2}, {"ep": 2}):  # written at ep=2: read at tp=2, and at ep=2 again
        with sw.empty_model():
            model = make_lm(num_experts=4)
        sw.load(model, f"{folder}/dcp", plan="auto", mesh=backend.mesh(**axes))
        torch.testing.assert_close(model(_ids()), want, rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_expert_parallel_save_and_reshard(tmp_path, holding):
    assert run_ranks(_save_expert_parallel, 2, str(tmp_path), holding) == [True] * 2
    want = make_lm(num_experts=4).state_dict()
    got = st.load_file(str(tmp_path / "full" / "model.safetensors"))
    assert set(got) | {"lm_head.weight"} == set(want)  # the tied head is stored once
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    assert run_ranks(_reload_at_tp2, 2, str(tmp_path)) == [True] * 2
