"""``move_non_persistent`` walks the model once: it moves non-persistent buffers and names every
tensor a load would leave on the meta device, parameters and buffers, nested or at the root."""

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from shardwise.errors import CheckpointError
from shardwise.io.load import move_non_persistent


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("table", torch.arange(3.0), persistent=False)


def test_non_persistent_buffers_move_and_nothing_is_left():
    model = nn.Sequential(Inner(), Inner())
    move_non_persistent(model, torch.device("cpu"))
    assert model[1].table.device.type == "cpu" and torch.equal(model[1].table, torch.arange(3.0))


def test_every_meta_tensor_is_named():
    model = nn.Sequential(Inner(), Inner())
    model[1].lin.weight = nn.Parameter(torch.empty(2, 2, device="meta"))
    model[0].register_buffer("stat", torch.empty(1, device="meta"))
    model.register_parameter("top", nn.Parameter(torch.empty(1, device="meta")))
    with pytest.raises(CheckpointError, match="still on the meta device") as info:
        move_non_persistent(model, torch.device("cpu"))
    for name in ("1.lin.weight", "0.stat", "top"):
        assert name in str(info.value)
    assert "0.lin.weight" not in str(info.value)


def _gc_during_load(fail: bool) -> tuple[list[bool], bool]:
    import gc

    import safetensors.torch as st

    import shardwise as sw
    import shardwise.io.load as load_module
    from shardwise.errors import ShardwiseError

    backend = sw.init_backend("gloo")
    seen: list[bool] = []
    resolve = load_module.resolve_for_mesh

    def spying(*args, **kwargs):
        seen.append(gc.isenabled())
        if fail:
            raise CheckpointError("a failure inside the load")
        return resolve(*args, **kwargs)

    load_module.resolve_for_mesh = spying
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        st.save_file({"weight": torch.ones(4, 2), "bias": torch.zeros(4)}, str(Path(tmp) / "m.safetensors"))
        with torch.device("meta"):
            model = nn.Linear(2, 4)
        try:
            sw.load(model, tmp, plan={"": "colwise"}, mesh=backend.mesh(tp=1))
        except ShardwiseError:
            pass
    return seen, gc.isenabled()


@pytest.mark.parametrize("fail", [False, True])
def test_the_collector_pauses_during_a_load_and_comes_back(fail):
    from harness import run_ranks

    assert run_ranks(_gc_during_load, 1, fail) == [([False], True)]


# -- one walk per load (core.walk) ---------------------------------------------------------------
def _shared_model() -> nn.Module:
    shared = Inner()
    return nn.Sequential(Inner(), shared, nn.Sequential(shared, Inner()))


def test_the_walk_tables_are_torchs():
    from shardwise.core.walk import module_table, named_modules, named_parameters, one_walk, state_tensors

    model = _shared_model()
    for inside in (False, True):
        with one_walk(model) if inside else nullcontext():
            assert list(module_table(model).items()) == list(model.named_modules(remove_duplicate=False))
            assert named_modules(model) == list(model.named_modules())
            params = list(model.named_parameters(remove_duplicate=False))
            assert list(named_parameters(model).items()) == params
            assert list(state_tensors(model)) == list(model.state_dict(keep_vars=True))


def test_one_walk_walks_once_and_forgets_replaced_tensors():
    from shardwise.core.walk import module_table, named_modules, one_walk, state_tensors, tensors_changed

    model, other = _shared_model(), _shared_model()
    with one_walk(model):
        assert module_table(model) is module_table(model) and named_modules(model) is named_modules(model)
        assert module_table(other) is not module_table(other)  # another model: walked as torch does
        before = state_tensors(model)
        assert state_tensors(model) is before
        model[0].lin.weight = nn.Parameter(torch.zeros(2, 2))
        tensors_changed(model)
        assert state_tensors(model)["0.lin.weight"] is model[0].lin.weight
    assert module_table(model) is not module_table(model)  # the block is over


def _walks_of_a_load() -> tuple[int, int, list[bool]]:
    import tempfile

    import safetensors.torch as st

    import shardwise as sw

    backend = sw.init_backend("gloo")
    torch.manual_seed(0)

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4),
                             nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)))

    full = build()
    plan = {"0": "colwise", "1": "rowwise", "2.0": "colwise", "2.1": "rowwise"}
    with sw.empty_model():
        model = build()
    counts = {"named_modules": 0, "state_dict": 0}
    originals = {name: getattr(nn.Module, name) for name in counts}

    def counting(name):
        def call(self, *args, **kwargs):
            if self is model:  # the root's call: one walk (torch recurses through the children)
                counts[name] += 1
            return originals[name](self, *args, **kwargs)
        return call

    with tempfile.TemporaryDirectory() as tmp:
        st.save_file({k: v.contiguous() for k, v in full.state_dict().items()}, f"{tmp}/m.safetensors")
        for name in counts:
            setattr(nn.Module, name, counting(name))
        try:
            sw.load(model, tmp, plan=plan, mesh=backend.mesh(tp=2))
        finally:
            for name, fn in originals.items():
                setattr(nn.Module, name, fn)
    from shardwise.holding import local_of

    exact = []
    for name, t in full.state_dict().items():
        path, _, leaf = name.rpartition(".")
        if plan[path] == "colwise":
            want = t.chunk(2, dim=0)[backend.rank]
        else:  # rowwise: the weight's input features split, the bias whole
            want = t.chunk(2, dim=1)[backend.rank] if leaf == "weight" else t
        exact.append(torch.equal(local_of(model.get_parameter(name)), want))
    return counts["named_modules"], counts["state_dict"], exact


def test_a_load_walks_the_model_once():
    """Before core.walk a 2-rank load of this model walked its modules 15 times and took its
    state dict 5 times (the guards, the adapter's refusals, plan matching, head counts, the
    quantization ties, the key match, install, wire, the checks after)."""
    from harness import run_ranks

    for walks, state_dicts, exact in run_ranks(_walks_of_a_load, 2):
        assert walks == 1 and state_dicts == 2  # modules once; tensors before install and after
        assert all(exact) and len(exact) == 8


class _Forwarding(nn.Module):  # as PEFT's models: a miss is asked of the wrapped model
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class _WithClassAttrs(Inner):
    kind = "class attribute"

    @property
    def doubled(self):
        return 2 * self.lin.in_features


def test_attribute_answers_as_getattr():
    from shardwise.core.walk import attribute, has_attribute

    model = _WithClassAttrs()
    model._hf_hook = "a hook"  # an instance attribute, as accelerate attaches one
    wrapped = _Forwarding(model)
    for module in (model, wrapped, model.lin):
        for name in ("_hf_hook", "kind", "doubled", "lin", "table", "weight", "training", "absent", "lora_A"):
            assert attribute(module, name) is getattr(module, name, None) or (
                attribute(module, name) == getattr(module, name, None))
            assert has_attribute(module, name) == hasattr(module, name)
    assert attribute(wrapped, "_hf_hook") == "a hook"  # through the wrapper's own __getattr__
