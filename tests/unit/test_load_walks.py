"""``move_non_persistent`` walks the model once: it moves non-persistent buffers and names every
tensor a load would leave on the meta device, parameters and buffers, nested or at the root."""

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
