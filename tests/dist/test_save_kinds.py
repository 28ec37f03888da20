"""sw.save's options on real gloo ranks (tp=2): every applicable combination writes a checkpoint
that round-trips byte for byte against its source; every inapplicable one raises the same
UsageError on every rank, before any collective (no rank waits) and before anything is written."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import shardwise as sw
from harness import run_ranks
from models import TinyTransformer, make_model, tiny_plan

SMALL = "20KB"  # the tiny model is 160 KB: several files

# name -> sw.save keyword arguments that apply
APPLICABLE = {
    "default": {},
    "small": {"max_shard_size": SMALL},
    "prefix": {"filename_prefix": "diffusion_pytorch_model", "max_shard_size": SMALL},
    "module": {"layout": "module"},
    "stream": {"parallel_write": False, "max_shard_size": SMALL},
    "parallel": {"parallel_write": True, "max_shard_size": SMALL},
    "distcp": {"distributed": True},
    "distcp-async": {"distributed": True, "async_save": True},
    "sharded": {"distributed": True, "format": "safetensors"},
    "sharded-by-name": {"distributed": True, "format": "sharded"},
    "dcp-by-name": {"distributed": True, "format": "dcp"},
    "safetensors-by-name": {"format": "safetensors"},
}
INAPPLICABLE = [
    {"distributed": True, "max_shard_size": SMALL}, {"distributed": True, "filename_prefix": "m"},
    {"distributed": True, "layout": "module"}, {"distributed": True, "parallel_write": False},
    {"distributed": True, "format": "safetensors", "parallel_write": True},
    {"distributed": True, "format": "safetensors", "async_save": True},
    {"async_save": True}, {"format": "dcp"}, {"format": "sharded", "layout": "module"},
    {"distributed": True, "format": "nope"},
]


def _saves(tmp: Path) -> list[str]:
    backend = sw.init_backend("gloo")
    model = TinyTransformer()
    model.load_state_dict(load_file(tmp / "original.safetensors"))
    sw.parallelize(model, tiny_plan(), backend.mesh(tp=2))
    for name, kwargs in APPLICABLE.items():
        handle = sw.save(model, tmp / name, **kwargs)
        if handle is not None:
            handle.wait()
    refused = []
    for i, kwargs in enumerate(INAPPLICABLE):
        try:
            sw.save(model, tmp / f"refused-{i}", **kwargs)
            refused.append("saved")
        except sw.UsageError as e:
            refused.append(str(e).split(":")[0])
    backend.barrier(timeout=30)  # no rank was left inside a collective
    return refused


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_bytes(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert got[name].contiguous().view(torch.uint8).equal(t.contiguous().view(torch.uint8)), name


def test_every_applicable_save_round_trips_and_every_other_is_refused(tmp_path):
    original = tmp_path / "original.safetensors"
    save_file(make_model().state_dict(), original, metadata={"format": "pt"})
    want = load_file(original)
    results = run_ranks(_saves, 2, tmp_path)
    assert results[0] == results[1] and "saved" not in results[0]
    assert all(not (tmp_path / f"refused-{i}").exists() for i in range(len(INAPPLICABLE)))
    for name, kwargs in APPLICABLE.items():
        folder = tmp_path / name
        if kwargs.get("distributed"):
            sw.consolidate(folder, tmp_path / f"{name}-merged", layout="module")
            folder = tmp_path / f"{name}-merged"
        elif kwargs.get("max_shard_size"):
            prefix = kwargs.get("filename_prefix", "model")
            assert (folder / f"{prefix}.safetensors.index.json").is_file(), name
            assert len(list(folder.glob(f"{prefix}-*-of-*.safetensors"))) > 1, name
        else:  # one file: byte-identical to save_file's, header included
            assert (folder / "model.safetensors").read_bytes() == original.read_bytes(), name
        _same_bytes(_tensors(folder), want)
        assert sw.verify(tmp_path / name).ok, name
    assert not [p.name for p in tmp_path.iterdir() if ".shardwise-" in p.name]
