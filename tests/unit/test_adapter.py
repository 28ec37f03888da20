"""Model adapters (``core.adapter``): the one seam through which load, save, consolidate and
the plan resolver ask what a model library knows; the Hugging Face adapter is one of them."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from torch import nn

import shardwise as sw
from shardwise.core import adapter as core_adapter
from shardwise.core.adapter import ModelAdapter, adapter_for, register_adapter
from shardwise.core.plan import resolve_plan
from shardwise.errors import UnsupportedModelError, UsageError
from shardwise.io.storage import write_small

SRC = Path(sw.__file__).parent


class Net(nn.Module):
    parallel_plan = {"up": "colwise", "down": "rowwise"}  # where "mylib" keeps a model's plan

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)


class MyLib(ModelAdapter):
    """A toy library: plans under ``parallel_plan``, weights in ``weights*.safetensors``, a
    ``mylib.json`` beside them, and models flagged ``frozen_by_mylib`` refused."""

    name = "mylib"
    side_files = ("mylib.json",)

    def claims(self, model):
        return isinstance(model, Net)

    def shipped_plan(self, model, axis):
        return dict(model.parallel_plan) if axis == "tp" else {}

    def refuse(self, model, action):
        if getattr(model, "frozen_by_mylib", False):
            raise UnsupportedModelError(f"cannot {action} this model: mylib froze it; unfreeze it")

    def file_prefix(self, model):
        return "weights"

    def write_side_files(self, model, folder):
        write_small(folder / "mylib.json", json.dumps({"class": type(model).__name__}).encode())
        return ["mylib.json"]


@pytest.fixture
def mylib(monkeypatch):
    adapter = MyLib()
    monkeypatch.setattr(core_adapter, "_ADAPTERS", dict(core_adapter._ADAPTERS))  # undone after the test
    return register_adapter(adapter)


def test_a_plain_model_gets_the_plain_answers():
    plain = adapter_for(nn.Linear(2, 2))
    assert plain.name == "torch" and plain.base_prefix(nn.Linear(2, 2)) == ""
    assert plain.shipped_plan(nn.Linear(2, 2), "tp") == {} and plain.save_layout(nn.Linear(2, 2), {}) is None
    with pytest.raises(sw.PlanError, match="ships no tensor-parallel plan"):
        resolve_plan(nn.Linear(2, 2), "auto", 2)


def test_the_hugging_face_adapter_is_registered_and_claims_models_by_their_conventions():
    from shardwise.testing.model import build  # follows transformers' conventions, no transformers class

    model = build(device="meta")
    # the built-in ones: Hugging Face's models and diffusers' pipelines (which claims no model)
    assert {a.name for a in core_adapter.adapters()} >= {"huggingface", "diffusers-pipeline"}
    assert adapter_for(model).name == "huggingface" and adapter_for(model).base_prefix(model) == "model"
    assert dict(resolve_plan(model, "auto", 2)) == dict(resolve_plan(model, dict(model.tp_plan), 2))


def test_a_registered_adapter_answers_for_plan_auto(mylib):
    specs = resolve_plan(Net(), "auto", 2)
    assert specs["up.weight"] == sw.ShardSpec(dim=0) and specs["down.weight"] == sw.ShardSpec(dim=1)
    assert adapter_for(Net()) is mylib


def test_a_registered_adapter_names_the_files_of_a_save_and_its_side_files(mylib, tmp_path):
    model = Net()
    sw.save(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["mylib.json", "shardwise.json",
                                                                      "weights.safetensors"]
    sw.save(model, tmp_path / "dcp", distributed=True)
    assert json.loads((tmp_path / "dcp" / "mylib.json").read_text()) == {"class": "Net"}
    sw.consolidate(tmp_path / "dcp", tmp_path / "merged", filename_prefix="weights")
    merged = tmp_path / "merged"
    assert (merged / "mylib.json").read_bytes() == (tmp_path / "dcp" / "mylib.json").read_bytes()
    weights = "weights.safetensors"
    assert (merged / weights).read_bytes() == (tmp_path / "out" / weights).read_bytes()


def test_every_adapter_refuses_what_its_library_did_before_anything_is_written(mylib, tmp_path):
    model = Net()
    model.frozen_by_mylib = True
    with pytest.raises(UnsupportedModelError, match="mylib froze it"):
        sw.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    plain = nn.Sequential(nn.Linear(2, 2))
    plain.frozen_by_mylib = True  # not a model mylib claims: its guards still run
    with pytest.raises(UnsupportedModelError, match="mylib froze it"):
        sw.save(plain, tmp_path / "plain")


def test_the_registry_refuses_a_second_adapter_of_a_name_and_an_unnamed_one(mylib):
    taken = r"'mylib' is already registered; registered: (diffusers-pipeline, )?huggingface, mylib"
    with pytest.raises(UsageError, match=taken):
        register_adapter(MyLib())
    with pytest.raises(UsageError, match="a name of its own"):
        register_adapter(ModelAdapter())
    assert register_adapter(mylib) is mylib  # the same adapter again: a no-op


def test_only_the_hugging_face_adapter_imports_transformers_or_diffusers():
    # The adapter is the one home of that knowledge: any other module importing the libraries
    # has grown Hugging Face knowledge outside it.
    found = []
    for path in SRC.rglob("*.py"):
        if path.is_relative_to(SRC / "hf"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(SRC)}: {n}" for n in names
                      if n.split(".")[0] in ("transformers", "diffusers")]
    assert found == []


def test_the_sharded_save_writes_the_side_files_every_save_writes(mylib, tmp_path):
    # it had a writer of its own, which knew only transformers' config.save_pretrained
    model = Net()
    sw.save(model, tmp_path / "sharded", distributed=True, format="safetensors")
    assert json.loads((tmp_path / "sharded" / "mylib.json").read_text()) == {"class": "Net"}
    sw.consolidate(tmp_path / "sharded", tmp_path / "merged", filename_prefix="weights")
    sw.save(model, tmp_path / "out")
    for name in ("mylib.json", "weights.safetensors"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "out" / name).read_bytes()


def test_a_plain_model_index_counts_its_parameters_as_before_the_adapter(tmp_path):
    # the hub's index format is every save's: a model no library claims keeps total_parameters
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    sw.save(model, tmp_path / "out", max_shard_size=300)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_parameters"] == sum(p.numel() for p in model.parameters())
