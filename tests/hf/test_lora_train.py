"""An adapter trained under FSDP2 x TP (mesh dp_shard=2 x tp=2, ``fully_shard`` over the
tp-sharded Llama, each dp rank its half of the batch) for a few SGD steps, then saved with
sw.save_adapter: equal, tensor for tensor within fp32 tolerance, to the same training of a
one-process PeftModel on the whole batch; in DTensor and local holding."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lora_models import VOCAB, build, make, model_class  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402

STEPS, LR = 3, 0.5
RTOL, ATOL = 1e-4, 1e-6


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (4, 7), generator=gen), torch.randint(0, VOCAB, (4, 7), generator=gen)


def _loss(logits, targets) -> torch.Tensor:
    if type(logits).__name__ == "DTensor":
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _train(model, params, ids, targets) -> list[float]:
    opt = torch.optim.SGD(params, lr=LR, foreach=False)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(model(input_ids=ids).logits, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _reference(folder) -> list[float]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(build("llama"), folder / "a", is_trainable=True)
    ids, targets = _batch()
    losses = _train(model, [p for p in model.parameters() if p.requires_grad], ids, targets)
    model.save_pretrained(folder / "trained_ref", save_embedding_layers=False)
    return losses


def _fsdp_tp(folder: str, holding: str) -> list[float]:
    from torch.distributed.fsdp import fully_shard

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(dp_shard=2, tp=2)
    model = sw.from_pretrained(model_class("llama"), f"{folder}/ckpt", mesh=mesh, holding=holding)
    sw.load_adapter(model, f"{folder}/a")
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    dp = mesh["dp_shard"].get_local_rank()
    ids, targets = _batch()
    rows = slice(2 * dp, 2 * dp + 2)  # FSDP2 averages over dp: the mean loss of equal halves
    losses = _train(model, [p for p in model.parameters() if p.requires_grad], ids[rows], targets[rows])
    sw.save_adapter(model, f"{folder}/trained_{holding}")
    return losses


@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_adapter_trained_under_fsdp2_x_tp_saves_the_one_process_result(tmp_path, holding):
    make("llama", tmp_path)
    want_losses = _reference(tmp_path)
    run_ranks(_fsdp_tp, 4, str(tmp_path), holding, timeout=300)
    want = load_file(tmp_path / "trained_ref" / "adapter_model.safetensors")
    got = load_file(tmp_path / f"trained_{holding}" / "adapter_model.safetensors")
    start = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert set(got) == set(want)
    assert want_losses[-1] < want_losses[0]  # it trained
    moved = 0
    for key in want:
        diff = (got[key] - want[key]).abs().max().item()
        assert torch.allclose(got[key], want[key], rtol=RTOL, atol=ATOL), (key, diff)
        moved += not torch.allclose(want[key], start[key], rtol=RTOL, atol=ATOL)
    assert moved == len(want)  # every LoRA tensor moved, and moved alike
