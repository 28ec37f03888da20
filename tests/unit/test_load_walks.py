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
