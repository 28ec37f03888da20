"""sw.save refuses options that do not apply to the kind of save asked for, rather than
ignoring them (a distributed save has no file size limit, prefix, hub layout or parallel
writer). ``format`` is the registry's vocabulary (``shardwise.io.formats``), with sw.save's
documented spellings (``"distcp"``; ``"safetensors"`` with ``distributed=True``). Checked before
any collective or write, so a plain model in one process shows it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import shardwise as sw
from shardwise.io.save import DistributedSave, SafetensorsSave, save_options


@pytest.mark.parametrize("option", [{"max_shard_size": "1GB"}, {"filename_prefix": "shard"},
                                    {"layout": "module"}, {"parallel_write": True}])
def test_distributed_save_refuses_gather_save_options(tmp_path, option):
    name = next(iter(option))
    with pytest.raises(sw.UsageError, match=f"{name}=.*: not for a distributed save"):
        sw.save(nn.Linear(4, 4), tmp_path / "out", distributed=True, **option)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["dcp", "distcp", "sharded"])
def test_a_distributed_format_without_distributed_is_refused(tmp_path, fmt):
    match = f"format='{fmt}' writes a distributed checkpoint.*distributed=True"
    with pytest.raises(sw.UsageError, match=match):
        sw.save(nn.Linear(4, 4), tmp_path / "out", format=fmt)
    assert not (tmp_path / "out").exists()


def test_the_registry_names_what_save_writes():
    assert save_options(distributed=False, format="safetensors") == SafetensorsSave()
    assert save_options(distributed=True, format="dcp") == save_options(distributed=True, format="distcp") \
        == save_options(distributed=True) == DistributedSave(format="dcp")
    assert save_options(distributed=True, format="sharded") == DistributedSave(format="sharded")


# --- every inapplicable combination is refused, naming the argument --------------------------

GATHER_ONLY = [{"max_shard_size": "1GB"}, {"max_shard_size": 10**9}, {"filename_prefix": "shard"},
               {"layout": "module"}, {"parallel_write": True}, {"parallel_write": False}]


@pytest.mark.parametrize("fmt", ["distcp", "dcp", "safetensors", "sharded"])
@pytest.mark.parametrize("option", GATHER_ONLY)
def test_every_gather_option_is_refused_by_every_distributed_format(tmp_path, fmt, option):
    name = next(iter(option))
    with pytest.raises(sw.UsageError, match=f"{name}=.*: not for a distributed save"):
        sw.save(nn.Linear(4, 4), tmp_path / "out", distributed=True, format=fmt, **option)
    assert not (tmp_path / "out").exists()


def test_several_inapplicable_options_are_named_together(tmp_path):
    with pytest.raises(sw.UsageError, match="max_shard_size='1GB', layout='module': not for a distributed"):
        sw.save(nn.Linear(4, 4), tmp_path / "out", distributed=True, max_shard_size="1GB", layout="module")


@pytest.mark.parametrize("kwargs, match", [
    ({"async_save": True}, "async_save=True writes a distributed checkpoint; pass distributed=True"),
    ({"format": "distcp", "async_save": True}, "async_save=True writes a distributed checkpoint"),
    ({"format": "dcp", "max_shard_size": "1GB"}, "format='dcp' writes a distributed checkpoint"),
    ({"distributed": True, "format": "safetensors", "async_save": True},
     "async_save=True is not supported with format='safetensors'"),
])
def test_distributed_options_are_refused_by_the_gather_save(tmp_path, kwargs, match):
    with pytest.raises(sw.UsageError, match=match):
        sw.save(nn.Linear(4, 4), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_shard_size": "5 gigs"}, sw.CheckpointError, "size '5 gigs' is not understood"),
    ({"max_shard_size": 0}, sw.CheckpointError, "at least 1 byte"),
    ({"filename_prefix": "a/b"}, sw.CheckpointError, "filename_prefix 'a/b' must be a plain file name"),
    ({"layout": "hf"}, sw.CheckpointError, "layout must be 'hub' or 'module', got 'hf'"),
    ({"parallel_write": "yes"}, sw.UsageError, "parallel_write must be True, False or None, got 'yes'"),
    ({"distributed": True, "format": "npz"}, sw.UsageError,
     "no checkpoint format named 'npz'; known formats: dcp, sharded, safetensors"),
    ({"format": "npz"}, sw.UsageError, "no checkpoint format named 'npz'"),
    ({"distributed": True, "async_save": 1}, sw.UsageError, "async_save must be True or False, got 1"),
    ({"distributed": "yes"}, sw.UsageError, "distributed must be True or False, got 'yes'"),
])
def test_each_bad_value_names_its_field(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        sw.save(nn.Linear(4, 4), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


# --- the decoded values ------------------------------------------------------------------------

def test_arguments_decode_into_one_frozen_value_per_kind():
    gather = save_options(distributed=False, max_shard_size="2GB", filename_prefix="m", layout="module",
                          parallel_write=False, format="safetensors", async_save=False)
    assert gather == SafetensorsSave(max_shard_size="2GB", filename_prefix="m", layout="module",
                                     parallel_write=False)
    dist = save_options(distributed=True, format="safetensors", max_shard_size="5GB", layout="hub")
    assert dist == DistributedSave(format="sharded", async_save=False)
    assert save_options(distributed=True, async_save=True) == DistributedSave(async_save=True)
    for value, field in ((gather, "layout"), (dist, "format")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, "module")
    with pytest.raises(TypeError):  # keyword-only
        SafetensorsSave("5GB")


# --- every applicable combination still saves (one process; spawned ranks: tests/dist) -----------

def _state(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))


@pytest.mark.parametrize("kwargs, files", [
    ({}, ["model.safetensors"]),
    ({"format": "safetensors"}, ["model.safetensors"]),
    ({"max_shard_size": 600}, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                               "model.safetensors.index.json"]),
    ({"filename_prefix": "shard"}, ["shard.safetensors"]),
    ({"filename_prefix": ""}, ["model.safetensors"]),
    ({"layout": "module"}, ["model.safetensors"]),
    ({"parallel_write": False}, ["model.safetensors"]),
    ({"parallel_write": None, "max_shard_size": "5GB", "layout": "hub"}, ["model.safetensors"]),
])
def test_every_gather_option_applies(tmp_path, kwargs, files):
    model = _state()
    sw.save(model, tmp_path / "out", **kwargs)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(files + ["shardwise.json"])
    got = {}
    for f in files:
        if f.endswith(".safetensors"):
            got.update(load_file(tmp_path / "out" / f))
    want = model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kwargs, marker", [
    ({"distributed": True}, ".metadata"),
    ({"distributed": True, "format": "distcp"}, ".metadata"),
    ({"distributed": True, "format": "dcp"}, ".metadata"),
    ({"distributed": True, "format": "sharded"}, "shard-00001-model-00001-of-00001.safetensors"),
    ({"distributed": True, "format": "safetensors"}, "shard-00001-model-00001-of-00001.safetensors"),
])
def test_every_distributed_format_applies(tmp_path, kwargs, marker):
    model = _state()
    assert sw.save(model, tmp_path / "out", **kwargs) is None
    assert (tmp_path / "out" / marker).is_file()
    sw.consolidate(tmp_path / "out", tmp_path / "merged", layout="module")
    got, want = load_file(tmp_path / "merged" / "model.safetensors"), model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
