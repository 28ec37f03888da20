"""sw.check_plan on spawned gloo ranks: no false alarm on correct plans (tp 2, 4, 8, both holdings),
and each injected fault localized to the module it was injected in (or the first module
downstream whose inputs agree, with the injected one named as the likely cause)."""

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from harness import run_ranks
from shardwise.plan_probe import RTOL
from models import Attention, make_model, tiny_plan, tokens


class FixedHeads(Attention):
    """An attention whose forward shapes heads with a number written in the code (4): right in
    one process, wrong under tensor parallelism, and no static check can see it."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (z.view(b, t, 4, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class GlobalHeads(Attention):
    """Shapes heads with ``self.num_heads``: the static wiring check refuses it."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.num_heads, -1).transpose(1, 2)
                   for z in (self.q(x), self.k(x), self.v(x)))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


def _with_attention(cls):
    model = make_model()
    old = model.layers[0].attn
    new = cls(32, 4, fused=False)
    new.load_state_dict(old.state_dict())
    model.layers[0].attn = new
    return model


FAULTS = {  # name -> (model maker, plan change, first divergence, likely cause, hint text)
    "plain colwise on packed gate|up": (
        make_model, {"layers.*.mlp.gate_up": "colwise"},
        "layers.0.mlp", "layers.0.mlp.gate_up", "PackedColwise([1, 1])?"),
    "wrong packed proportions": (
        make_model, {"fused.*.attn.qkv": sw.PackedColwise([2, 1, 1])},
        "fused.0.attn", "fused.0.attn.qkv", "PackedColwise([1, 1, 1])?"),
    "head count fixed in the forward": (
        lambda: _with_attention(FixedHeads), {},
        "layers.0.attn", "layers.0.attn.v", "head count fixed in the code"),
    "head count read off the module (static refusal)": (
        lambda: _with_attention(GlobalHeads), {},
        "layers.0.attn.q", "layers.0.attn.q", ""),
    "colwise and rowwise swapped (mlp)": (
        make_model, {"layers.*.mlp.gate_up": "rowwise", "layers.*.mlp.down": "colwise"},
        "layers.0.mlp.gate_up", "layers.0.mlp.gate_up", "colwise and rowwise swapped?"),
    "colwise where rowwise_split_input fits": (
        make_model, {"single.*.modulation": "colwise"},
        "single.0", "single.0.modulation", "returns a shard"),
    "rowwise_split_input among colwise siblings": (
        make_model, {"layers.*.attn.q": "rowwise_split_input"},
        "layers.0.attn", "layers.0.attn.q", "returns a whole tensor"),
    "head left colwise (the model returns a shard)": (
        make_model, {"head": "colwise"}, "head", "head", "colwise_gather_output"),
}


def _faults(degree: int, names: list[str], dtype=torch.float32):
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=degree)
    out = {}
    for name in names:
        build, change, *_ = FAULTS[name]
        report = sw.check_plan(build().to(dtype), (tokens(),), plan={**tiny_plan(), **change}, mesh=mesh)
        out[name] = (report.ok, report.first_divergence, report.likely_cause, report.hint + report.refusal,
                     str(report))
    return out


# at tp=4 with 4 heads, a whole q (4 heads) beside k and v shards (1 head) broadcasts in sdpa and
# o_proj fails on the result: the parent is blamed and q named
AT_TP4 = {"rowwise_split_input among colwise siblings": ("layers.0.attn", "layers.0.attn.q", "returns a whole")}


@pytest.mark.parametrize(("degree", "dtype"), [(2, torch.float32), (4, torch.bfloat16)])
def test_each_fault_is_localized_to_its_module(degree, dtype):
    results = run_ranks(_faults, degree, degree, list(FAULTS), dtype, timeout=180)
    assert all(r == results[0] for r in results)  # every rank gets the same report
    for name, (_, _, first, cause, text) in FAULTS.items():
        first, cause, text = AT_TP4.get(name, (first, cause, text)) if degree == 4 else (first, cause, text)
        ok, got_first, got_cause, hint, printed = results[0][name]
        assert not ok, name
        assert (got_first, got_cause) == (first, cause), (name, hint)
        assert text in hint, (name, hint)
        assert repr(first) in printed, name


def _correct(degree: int, holding: str, heads: int, dtype):
    backend = sw.init_backend("gloo")
    report = sw.check_plan(make_model(heads=heads).to(dtype), (tokens(),), plan=tiny_plan(),
                           mesh=backend.mesh(tp=degree), holding=holding)
    return report.ok, report.first_divergence, len(report.rows), report.rtol, str(report)


@pytest.mark.parametrize(("degree", "holding", "heads", "dtype"),
                         [(2, "dtensor", 4, torch.float32), (2, "local", 4, torch.bfloat16),
                          (4, "dtensor", 4, torch.float16), (4, "local", 4, torch.bfloat16),
                          (8, "local", 8, torch.float32)])
def test_no_false_alarm_on_the_correct_plan(degree, holding, heads, dtype):
    # a row per module call: every module but the three ModuleLists, which are never called;
    # the tolerance follows the dtype (the rowwise sums round differently at each degree)
    for ok, first, rows, rtol, printed in run_ranks(_correct, degree, degree, holding, heads, dtype,
                                                    timeout=180):
        assert (ok, first) == (True, None), printed
        assert rows == 29 and "OK, every module agrees" in printed
        assert rtol == RTOL[dtype] and f"rtol {rtol:g}" in printed


def _model_unchanged():
    backend = sw.init_backend("gloo")
    model = make_model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    report = sw.check_plan(model, (tokens(),), plan=tiny_plan(), mesh=backend.mesh(tp=2), rtol=0.0)
    after = model.state_dict()
    same = all(type(after[n]) is type(t) and after[n].equal(t) for n, t in before.items())
    return same, model.training, report.ok  # rtol 0: the rowwise sums' rounding counts


def test_the_model_is_left_as_it_was_and_rtol_is_honoured():
    for same, training, ok in run_ranks(_model_unchanged, 2):
        assert same and training and not ok


MLP_MODULE = '''
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(32, 128, bias=False)
        self.down = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def build():
    return MLP(), (torch.randn(2, 8, 32),)
'''


@pytest.mark.parametrize(("gate_up", "code"), [("colwise", 1), ("packed_colwise", 0)])
def test_the_command_line_checks_a_model_by_import_path(tmp_path, monkeypatch, capsys, gate_up, code):
    from shardwise.cli import main

    (tmp_path / "mymlp.py").write_text(MLP_MODULE)
    (tmp_path / "plan.json").write_text(f'{{"gate_up": "{gate_up}", "down": "rowwise"}}')
    monkeypatch.chdir(tmp_path)
    assert main(["check-plan", "mymlp:build", "--plan", "plan.json", "--tp", "2"]) == code
    out = capsys.readouterr().out
    assert ("PackedColwise([1, 1])?" in out) == (code == 1), out
    assert ("OK, every module" in out) == (code == 0), out
