"""``sw.consolidate``: one process, no process group, every dtype, byte-identical to the
gather save. (The dist tests consolidate checkpoints written under every layout.)"""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import shardwise as sw
from shardwise.errors import CheckpointError
from shardwise.io.consolidate import consolidation_plan
from shardwise.io.formats import open_source


class Mixed(nn.Module):
    """Float, bfloat16, integer, bool and 0-d tensors, and a tied weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 4)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight
        self.bf16 = nn.Parameter(torch.randn(3, 5).to(torch.bfloat16))
        self.register_buffer("ids", torch.arange(-6, 6, dtype=torch.int64).reshape(3, 4))
        self.register_buffer("counts", torch.tensor([7, -1, 3], dtype=torch.int32))
        self.register_buffer("levels", torch.tensor([0, 255, 17], dtype=torch.uint8))
        self.register_buffer("mask", torch.tensor([[True, False], [False, True]]))
        self.register_buffer("scale", torch.tensor(2.5, dtype=torch.float64))


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("fmt", ["distcp", "safetensors"])
@pytest.mark.parametrize("max_shard_size", ["5GB", 200])
def test_byte_identical_to_gather_save(tmp_path, max_shard_size, fmt):
    model = Mixed()
    meta = {"note": "consolidated"}
    sw.save(model, tmp_path / "gather", max_shard_size=max_shard_size, metadata=meta)
    sw.save(model, tmp_path / "dcp", distributed=True, format=fmt, metadata=meta)
    out = sw.consolidate(tmp_path / "dcp", tmp_path / "merged", max_shard_size=max_shard_size)
    assert out == tmp_path / "merged"
    gathered, merged = _files(tmp_path / "gather"), _files(tmp_path / "merged")
    assert list(merged) == list(gathered)  # shardwise.json with the checksums included
    assert "shardwise.json" in merged
    assert (len(merged) > 2) == (max_shard_size == 200)  # several files and an index, or one
    for name in gathered:
        assert merged[name] == gathered[name], name
    loaded = {}
    for name in merged:
        if name.endswith(".safetensors"):
            loaded.update(load_file(tmp_path / "merged" / name))
    want = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # tied: once
    assert loaded.keys() == want.keys()
    for k, v in want.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k


def test_prefix_overwrite_and_refusals(tmp_path):
    model = Mixed()
    sw.save(model, tmp_path / "dcp", distributed=True)
    sw.consolidate(tmp_path / "dcp", tmp_path / "out", filename_prefix="weights", max_shard_size=300)
    names = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name != "shardwise.json")
    assert names[-1] == "weights.safetensors.index.json" and names[0].startswith("weights-00001-of-")
    with pytest.raises(CheckpointError, match="already exists"):
        sw.consolidate(tmp_path / "dcp", tmp_path / "out")
    sw.consolidate(tmp_path / "dcp", tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "shardwise.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left aside

    (tmp_path / "dcp" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        sw.consolidate(tmp_path / "dcp", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()

    optimizer = torch.optim.AdamW(model.parameters())
    sw.save_optimizer(model, optimizer, tmp_path / "optim")
    with pytest.raises(CheckpointError, match="not tensors"):
        sw.consolidate(tmp_path / "optim", tmp_path / "out3")


def test_cli_inspect_and_consolidate(tmp_path, capsys):
    from shardwise.cli import main

    model = Mixed()
    sw.save(model, tmp_path / "dcp", distributed=True)
    assert main(["inspect", str(tmp_path / "dcp")]) == 0
    out = capsys.readouterr().out
    assert "torch distributed checkpoint (DCP)" in out and "layout: mesh none, tp degree 1" in out
    assert "ids" in out and "I64" in out and "BOOL" in out and "9 tensors" in out
    assert main(["consolidate", str(tmp_path / "dcp"), str(tmp_path / "st"), "--max-shard-size", "200",
                 "--prefix", "w"]) == 0
    assert main(["inspect", str(tmp_path / "st")]) == 0
    out = capsys.readouterr().out
    assert "safetensors, sharded" in out and "format=pt" in out
    assert main(["consolidate", str(tmp_path / "dcp"), str(tmp_path / "st")]) == 1  # exists
    assert "already exists" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing")]) == 1


def test_hub_layout_of_a_transformers_model_without_transformers_is_refused(tmp_path, monkeypatch):
    # The hub layout of a transformers model is computed by transformers: without it the keys
    # save_pretrained writes are unknown, which must not pass for "the model has none".
    import json

    sw.save(Mixed(), tmp_path / "dcp", distributed=True)
    (tmp_path / "dcp" / "config.json").write_text(json.dumps(
        {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "transformers_version": "5.24.0"}))
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # as if not installed
    with pytest.raises(CheckpointError, match="only transformers can compute.*layout='module'"):
        sw.consolidate(tmp_path / "dcp", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    sw.consolidate(tmp_path / "dcp", tmp_path / "module", layout="module")  # the module's names: fine
    assert set(load_file(tmp_path / "module" / "model.safetensors")) >= {"lin.weight", "embed.weight"}


@pytest.mark.parametrize("fmt", ["distcp", "safetensors"])
def test_a_failed_read_reaches_the_caller_and_leaves_nothing(tmp_path, monkeypatch, fmt):
    # The first tensor of the second file fails to read (a disk error, a damaged chunk):
    # consolidate raises that very error, after the first file was written, and neither the
    # target nor a temporary folder is left behind.
    sw.save(Mixed(), tmp_path / "src", distributed=True, format=fmt)
    source = open_source(tmp_path / "src")
    _, plan = consolidation_plan(source, max_shard_size=200, layout="module")
    cls = type(source)
    source.close()
    assert len(plan.files) > 2
    original, failing, raised = cls.read_box, plan.files[1].tensors[0][0], []

    def read_box(self, name, box):
        if name == failing:
            raised.append(CheckpointError(f"{name}: the disk went away"))
            raise raised[-1]
        return original(self, name, box)

    monkeypatch.setattr(cls, "read_box", read_box)
    with pytest.raises(CheckpointError, match="the disk went away") as caught:
        sw.consolidate(tmp_path / "src", tmp_path / "merged", max_shard_size=200, layout="module")
    assert caught.value is raised[0]
    assert not (tmp_path / "merged").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no temporary folder either
    monkeypatch.setattr(cls, "read_box", original)
    sw.consolidate(tmp_path / "src", tmp_path / "merged", max_shard_size=200, layout="module")
    assert len(list((tmp_path / "merged").glob("*.safetensors"))) == len(plan.files)
