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


def _recipe(folder) -> str:
    with pytest.raises(CheckpointError, match="never unpickles") as info:
        resolve_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message and len(message) < 3 * len(str(folder)) + 340, message  # one line
    return re.search(r"(sd = torch\.load\(.*?model\.safetensors'\))", message).group(1)


def test_the_recipe_converts_a_tied_checkpoint(tmp_path, monkeypatch):
    model = TiedLM()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    # save_file of the state dict as it is refuses the tied weights: the reason for the recipe
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.torch.save_file(dict(model.state_dict()), str(tmp_path / "plain.safetensors"))
    recipe = _recipe(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # issue #44: the recipe keeps the folder it was given
    exec(recipe, {"torch": torch, "safetensors": safetensors})
    got = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert got.keys() == model.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("head, says", [
    (None, "a torch.save archive (holding a pickle), not safetensors"),
    (b"\x80\x04}q\x00.", "a pickle, not safetensors"),
    (b"GGUF\x03\x00", "not safetensors, the only format shardwise reads; convert it to .safetensors "
                       "with the tool that wrote it"),
])
def test_a_bin_file_is_named_for_what_its_bytes_say(tmp_path, head, says):
    """Issue #32: one line, only what is known: a .bin is not always a pickle."""
    path = tmp_path / "pytorch_model.bin"
    if head is None:
        torch.save({"a": torch.ones(2)}, path)
    else:
        path.write_bytes(head)
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{path}: {says}") and "\n" not in message, message
    assert ("torch.load" in message) == (head is None or head.startswith(b"\x80")), message
