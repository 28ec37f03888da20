"""The save side's plans: one pure recipe (plan_checkpoint) for every ordinary safetensors
checkpoint, the sharded sink's per-rank plan, and the frozen values they travel in."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.core.spec import Region, ShardSpec, local_layout
from shardwise.errors import CheckpointError
from shardwise.io.formats.safetensors.files import (
    SafetensorsSink,
    plan_checkpoint,
    plan_files,
    save_file_order,
)
from shardwise.io.formats.sharded.write import plan_rank_files
from shardwise.io.sink import PlannedFile, StoredTensor, WritePlan

SPECS = [("z.weight", "BF16", (10, 10)), ("a.weight", "F32", (10, 10)), ("m.bias", "F32", (10,)),
         ("b.weight", "BF16", (30, 10))]  # 200, 400, 40, 600 bytes


def test_one_file_sorted_as_save_file_without_index():
    plan = plan_checkpoint(SPECS, max_shard_size="1GB", prefix="model", metadata={"k": "v"})
    assert [f.name for f in plan.files] == ["model.safetensors"]
    assert [s[0] for s in plan.files[0].tensors] == ["a.weight", "m.bias", "b.weight", "z.weight"]
    assert plan.index is None and dict(plan.header) == {"format": "pt", "k": "v"}
    assert plan.tensors == plan.files[0].tensors and plan.files_of(0) == plan.files


def test_several_files_split_as_plan_files_with_one_index():
    plan = plan_checkpoint(SPECS, max_shard_size=700, prefix="diffusion_pytorch_model",
                           metadata={"k": "v"}, index_metadata={"total_parameters": 7, "k": "w"})
    groups = plan_files(SPECS, 700, "diffusion_pytorch_model")
    assert [(f.name, f.tensors) for f in plan.files] == [
        (fname, tuple(sorted(group, key=save_file_order))) for fname, group in groups]
    assert len(plan.files) == 2
    name, content = plan.index
    assert name == "diffusion_pytorch_model.safetensors.index.json"
    assert content["metadata"] == {"total_size": 1240, "k": "w", "total_parameters": 7}
    assert content["weight_map"] == {s[0]: f.name for f in plan.files for s in f.tensors}
    assert set(content["weight_map"]) == {s[0] for s in SPECS}


def test_storages_and_parts_travel_with_the_plan():
    specs = [("e.0", "F32", (4,)), ("x", "F32", (100,)), ("e.1", "F32", (4,))]
    storages = {"e.0": ("s", 32), "e.1": ("s", 32)}
    plan = plan_checkpoint(specs, max_shard_size=100, prefix="m", storages=storages, parts={"e.0": "part0"})
    where = {s[0]: f.name for f in plan.files for s in f.tensors}
    assert where["e.0"] == where["e.1"] != where["x"]  # experts of one storage share a file
    assert plan.parts == {"e.0": "part0"}


def test_the_sink_plans_stored_tensors_as_the_recipe_plans_their_specs():
    sink = SafetensorsSink(max_shard_size=700, prefix="m", metadata=None)
    stored = [StoredTensor(n, d, s) for n, d, s in SPECS]
    assert sink.plan(stored) == plan_checkpoint(SPECS, max_shard_size=700, prefix="m")
    assert [s.spec for s in stored] == SPECS and stored[0].part is None
    with pytest.raises(TypeError):  # a value with fields, not a tuple to unpack
        name, dtype, shape, part = stored[0]
    with_part = sink.plan([StoredTensor(n, d, s, part=f"part of {n}") for n, d, s in SPECS])
    assert with_part.parts == {n: f"part of {n}" for n, _, _ in SPECS}


@pytest.mark.parametrize("kwargs, match", [
    ({"max_shard_size": "5 gigs"}, "not understood"),
    ({"prefix": "a/b"}, "plain non-empty file name"),
    ({"metadata": {"format": "np"}}, "metadata\\['format'\\]"),
    ({"metadata": {"n": 1}}, "strings to strings"),
])
def test_bad_inputs_raise_before_anything_is_planned(kwargs, match):
    with pytest.raises(CheckpointError, match=match):
        plan_checkpoint(SPECS, **{"max_shard_size": "1GB", "prefix": "m", **kwargs})
    with pytest.raises(CheckpointError, match="appears twice"):
        plan_checkpoint(SPECS + SPECS[:1], max_shard_size="1GB", prefix="m")


def test_plans_are_frozen_values():
    plan = plan_checkpoint(SPECS, max_shard_size=700, prefix="m")
    stored = StoredTensor("a", "F32", (1,))
    for value, field in ((plan, "files"), (plan.files[0], "tensors"), (stored, "name")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, ())
    assert repr(plan) == "WritePlan(2 files, 4 tensors, index='m.safetensors.index.json')"
    with pytest.raises(AssertionError):
        PlannedFile("f", (("a", "F32", (1,)),), offsets=((0,), (1,)))


def _held(name, shape, regions, dtype="F32"):
    return [(name, dtype, shape, r) for r in regions]


def test_sharded_plan_names_every_ranks_files_with_offsets():
    spec = ShardSpec(dim=0, blocks=(1, 1))  # a packed weight: two regions per rank
    held = [_held("w", (8, 4), [r for r, _ in local_layout((8, 4), spec, 2, rank)])
            + _held("norm", (4,), [Region((0,), (4,))], "BF16") for rank in range(2)]
    plan = plan_rank_files(held)
    assert isinstance(plan, WritePlan) and plan.index is None
    assert [(f.name, f.rank) for f in plan.files] == [
        (f"shard-{r + 1:05d}-model-{k:05d}-of-00002.safetensors", r) for r in range(2) for k in (1, 2)]
    chunks = {(s[0], off, s[2]) for f in plan.files for s, off in zip(f.tensors, f.offsets, strict=True)}
    w = {("w", (row, 0), (2, 4)) for row in (0, 2, 4, 6)}
    assert chunks == w | {("norm", (0,), (4,))}  # the replicated norm once
    assert [f.name for f in plan.files_of(1)] == [f.name for f in plan.files[2:]]
    for f in plan.files:  # each file in save_file's order (F32 before BF16)
        assert list(f.tensors) == sorted(f.tensors, key=save_file_order)
