"""The .bin conversion recipe that the pickle refusal prints works, tied weights included."""

import re

import pytest
import safetensors.torch
import torch
from torch import nn

from shardwise.errors import CheckpointError
from shardwise.io.formats.safetensors.checkpoint import resolve_checkpoint


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def _recipes(folder) -> tuple[str, str]:
    with pytest.raises(CheckpointError, match="never unpickles") as info:
        resolve_checkpoint(folder)
    message = str(info.value)
    state_dict_recipe = re.search(r"(sd = torch\.load\(.*?'model\.safetensors'\))", message).group(1)
    model_recipe = re.search(r"with the model built: (.*?'model\.safetensors'\))", message).group(1)
    return state_dict_recipe, model_recipe


def test_both_recipes_convert_a_tied_checkpoint(tmp_path, monkeypatch):
    model = TiedLM()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    # save_file of the state dict as it is refuses the tied weights: the reason for the recipe
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.torch.save_file(dict(model.state_dict()), str(tmp_path / "plain.safetensors"))
    state_dict_recipe, model_recipe = _recipes(tmp_path)
    monkeypatch.chdir(tmp_path)
    exec(state_dict_recipe, {"torch": torch, "safetensors": safetensors})
    got = safetensors.torch.load_file("model.safetensors")
    assert got.keys() == model.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())

    (tmp_path / "model.safetensors").unlink()
    built = TiedLM()
    with torch.no_grad():
        for p in built.parameters():
            p.zero_()
    exec(state_dict_recipe.partition(";")[0] + "; " + model_recipe,
         {"torch": torch, "safetensors": safetensors, "model": built})
    ckpt = resolve_checkpoint(tmp_path / "model.safetensors")
    assert set(ckpt.names) < set(model.state_dict())  # the tied weight once
    assert torch.equal(safetensors.torch.load_file("model.safetensors")["proj.weight"], model.proj.weight)
