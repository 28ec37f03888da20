"""LoRA on every packed style, on a plain nn.Module shardwise loaded: ``tests/models.py``'s
TinyTransformer (fused qkv packed [1, 1, 1], gate|up [1, 1], a single-stream projection packed
colwise [1, 1, 1, 3, 3] and rowwise [1, 3], rowwise_split_input, a vocab-parallel embedding, a
gathered head), every projection adapted: logits equal to the one-process PeftModel's, merge and
unmerge bit for bit, the adapter saved back byte for byte, in both holdings."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from models import TinyTransformer, make_model, tiny_plan, tokens  # noqa: E402
from shardwise.holding import local_of  # noqa: E402

TOLERANCE = 1e-5
TARGETS = ["embed", "q", "k", "v", "o", "qkv", "gate_up", "down", "modulation", "proj_in", "proj_out", "head"]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens()).detach().float()


def _layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _attach(folder: str, holding: str) -> dict:
    backend = sw.init_backend("gloo")
    with torch.device("meta"):
        model = TinyTransformer()
    sw.load(model, f"{folder}/ckpt.safetensors", plan=tiny_plan(), mesh=backend.mesh(tp=backend.world_size),
            holding=holding)
    base = [(p, local_of(p).detach().clone()) for p in model.parameters()]
    result = sw.load_adapter(model, f"{folder}/lora")
    out = {"logits": _logits(model).tolist(), "tensors": result.tensors}
    for layer in _layers(model):
        layer.merge()
    out["merged"] = _logits(model).tolist()
    out["changed"] = sum(not torch.equal(local_of(p), kept) for p, kept in base)
    for layer in _layers(model):
        layer.unmerge()
    out["restored"] = all(torch.equal(local_of(p), kept) for p, kept in base)
    sw.save_adapter(model, f"{folder}/saved")
    return out


@pytest.mark.parametrize("tp,holding", [(2, "dtensor"), (4, "dtensor"), (4, "local")])
def test_lora_on_every_packed_style_equals_one_process_peft(tmp_path, tp, holding):
    from peft import LoraConfig, get_peft_model

    save_file(make_model().state_dict(), tmp_path / "ckpt.safetensors")
    torch.manual_seed(3)
    peft = get_peft_model(make_model(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                   init_lora_weights=False))
    peft.save_pretrained(tmp_path / "lora", save_embedding_layers=False)
    reference = _logits(peft.eval())
    assert (reference - _logits(make_model())).abs().max() > 0.1  # the adapter changes the output
    rows = run_ranks(_attach, tp, str(tmp_path), holding, timeout=240)
    for rank, row in enumerate(rows):
        assert row["tensors"] == 2 * 15  # 14 projections and the embedding, each a pair
        for what in ("logits", "merged"):
            diff = (torch.tensor(row[what]) - reference).abs().max().item()
            assert diff <= TOLERANCE, (tp, holding, rank, what, diff)
        assert row["changed"] > 0 and row["restored"], (rank, row["changed"])
    name = "adapter_model.safetensors"
    assert (tmp_path / "saved" / name).read_bytes() == (tmp_path / "lora" / name).read_bytes()
