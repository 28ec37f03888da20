"""Expert LoRA (PEFT's ``target_parameters`` on Qwen3-MoE's 3-D expert tensors, its nested
``ParamWrapper``) under expert parallelism on spawned gloo ranks: each rank reads only its experts'
rows of ``lora_A`` and columns of ``lora_B``; logits equal the one-process PeftModel's (one adapter,
the other, both weighted, merged), unmerge restores every base tensor bit for bit, and
``save_adapter`` writes PEFT's file byte for byte; at ep=2 (local and DTensor holding) and
ep=2 x tp=2 (attention LoRA over tp as well); and at tp=2 alone, where the experts stay whole."""

from __future__ import annotations

import functools
import json

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

import torch  # noqa: E402
from lora_models import lora_layers, switched  # noqa: E402
from safetensors import safe_open  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from hf import hf_models  # noqa: E402
from shardwise.adapters.layout import expert_lora_specs  # noqa: E402
from shardwise.core.spec import ShardSpec  # noqa: E402
from shardwise.errors import PlanError  # noqa: E402
from shardwise.holding import local_of  # noqa: E402

KIND = "qwen3_moe"  # 4 experts in layer 1 (layer 0 is dense: mlp_only_layers)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOLERANCE = 1e-5


def _logits(model) -> torch.Tensor:
    return hf_models.forward(model, KIND)


def _make(folder) -> dict:
    """Base checkpoint, adapters ``a`` (r 4) and ``b`` (r 2) on q_proj and both expert tensors, and
    the one-process PeftModel's logits."""
    from peft import LoraConfig, PeftModel, get_peft_model

    hf_models.save_tiny(KIND, folder / "ckpt")
    for name, r, seed in (("a", 4, 1), ("b", 2, 2)):
        torch.manual_seed(seed)
        config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj"], target_parameters=EXPERTS,
                            init_lora_weights=False)
        get_peft_model(hf_models.build_tiny(KIND), config).save_pretrained(folder / name)
    model = PeftModel.from_pretrained(hf_models.build_tiny(KIND), folder / "a", adapter_name="a")
    model.load_adapter(folder / "b", adapter_name="b")
    return {"base": _logits(hf_models.build_tiny(KIND)), "a": _logits(model),
            **switched(model, _logits, model.set_adapter)}


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _attach(folder: str, axes: dict, holdings: list) -> list[dict]:
    from peft.functional import set_adapter

    backend = sw.init_backend("gloo")
    rows = []
    for holding in holdings:  # one launch for both holdings: transformers imports are slow
        model = sw.from_pretrained(hf_models.model_class(KIND), f"{folder}/ckpt", mesh=backend.mesh(**axes),
                                   holding=holding).eval()
        base = [(n, p, local_of(p).detach().clone()) for n, p in model.named_parameters()]
        sw.load_adapter(model, f"{folder}/a", adapter_name="a")
        before = _rchar()
        result = sw.load_adapter(model, f"{folder}/b", adapter_name="b")
        row = {"read": _rchar() - before, "bytes_read": result.bytes_read, "a": _logits(model).tolist(),
               **switched(model, lambda m: _logits(m).tolist(), functools.partial(set_adapter, model))}
        row["merge_changed"] = sorted(n for n, p, kept in base if not torch.equal(local_of(p), kept))
        for layer in lora_layers(model):
            layer.unmerge()
        row["unmerge_differs"] = [n for n, p, kept in base if not torch.equal(local_of(p), kept)]
        sw.save_adapter(model, f"{folder}/saved_{holding}", adapter_name="a")
        rows.append(row)
    return rows


def _expected_slices(path: str, axes: dict) -> int:
    """Bytes of the adapter at ``path`` a rank holds: its experts' share of each expert LoRA tensor,
    its tp slice of q_proj's lora_B (colwise), q_proj's lora_A whole."""
    total = 0
    with safe_open(path, "pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            shape = f.get_slice(key).get_shape()
            nbytes = shape[0] * shape[1] * 4
            split = axes.get("ep", 1) if ".experts." in key else axes.get("tp", 1) if "lora_B" in key else 1
            total += nbytes // split
    return total


@pytest.mark.parametrize("axes,holdings", [({"ep": 2}, ["local", "dtensor"]),
                                           ({"ep": 2, "tp": 2}, ["dtensor"]),
                                           ({"tp": 2}, ["local"])])  # experts whole on every rank
def test_expert_lora_under_ep_equals_one_process_peft(tmp_path, axes, holdings):
    reference = _make(tmp_path)
    world = axes.get("ep", 1) * axes.get("tp", 1)
    results = run_ranks(_attach, world, str(tmp_path), axes, holdings, timeout=300)
    slices = _expected_slices(str(tmp_path / "b" / "adapter_model.safetensors"), axes)
    weights = tmp_path / "b" / "adapter_model.safetensors"
    metadata = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    metadata += (tmp_path / "b" / "adapter_config.json").stat().st_size
    for rank, rows in enumerate(results):
        for holding, row in zip(holdings, rows, strict=True):
            for what in ("a", "b", "ab", "merged"):
                diff = (torch.tensor(row[what]) - reference[what]).abs().max().item()
                assert diff <= TOLERANCE, (axes, holding, rank, what, diff)
            assert (reference["a"] - reference["base"]).abs().max() > 100 * TOLERANCE  # the adapter shows
            assert any(n.endswith("experts.gate_up_proj") for n in row["merge_changed"])
            assert any(n.endswith("experts.down_proj") for n in row["merge_changed"])
            assert row["unmerge_differs"] == []
            assert row["bytes_read"] == slices, (holding, rank, row["bytes_read"], slices)
            assert row["read"] <= 1.05 * slices + metadata, (holding, rank, row["read"], slices)
    name = "adapter_model.safetensors"
    for holding in holdings:
        saved = tmp_path / f"saved_{holding}"
        assert (saved / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), holding
        configs = [json.loads((f / "adapter_config.json").read_text()) for f in (tmp_path / "a", saved)]
        for config in configs:  # sets, written by PEFT in the process's hash order
            config["target_modules"] = sorted(config["target_modules"])
            config["target_parameters"] = sorted(config["target_parameters"])
        assert configs[0] == configs[1]


def test_expert_lora_layout_follows_whole_experts_and_refuses_a_split_inside_them():
    specs = expert_lora_specs(ShardSpec(dim=0, axis="ep"), r=3)
    assert specs == {"A": ShardSpec(dim=0, axis="ep"), "B": ShardSpec(dim=1, blocks=(1, 1, 1), axis="ep")}
    assert expert_lora_specs(ShardSpec(), r=3) == {"A": ShardSpec(), "B": ShardSpec()}
    with pytest.raises(PlanError, match=r"experts.gate_up_proj.*split on dim 1.*ep plan"):
        expert_lora_specs(ShardSpec(dim=1, blocks=(1, 1)), r=3, where="experts.gate_up_proj")
