"""A fourth format is one folder (tests/fourth_format/rawdir) plus one registry line, with a
reader and a writer: on two gloo ranks (tp=2) it loads exactly as the safetensors checkpoint of
the same tensors loads, ``sw.save(model, path, format="rawdir")`` writes it back byte for byte,
and the offline tools (verify, consolidate) take it with no other change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardwise as sw
from harness import run_ranks
from models import TinyTransformer, make_model, tiny_plan
from shardwise.core.header import dtype_to_str
from shardwise.io import formats
from shardwise.parallel import local_of


def _register() -> None:
    if "rawdir" not in formats.FORMATS:
        formats.register_format("rawdir", "fourth_format.rawdir")  # the one line


@pytest.fixture
def registry():
    saved = dict(formats.FORMATS)
    _register()
    yield
    formats.FORMATS.clear()
    formats.FORMATS.update(saved)


def _load_both(tmp: Path) -> dict[str, list]:
    _register()  # each rank's own registry
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=2)
    shards = {}
    for name in ("original.safetensors", "rawdir"):
        with torch.device("meta"):
            model = TinyTransformer()
        sw.load(model, tmp / name, plan=tiny_plan(), mesh=mesh)
        shards[name] = {k: local_of(t).clone() for k, t in model.state_dict().items()}
    for k, want in shards["original.safetensors"].items():
        got = shards["rawdir"][k]
        assert got.dtype == want.dtype and torch.equal(got, want), k
    sw.save(model, tmp / "saved", format="rawdir")  # the loaded model, gathered back to rank 0
    return sorted(shards["rawdir"])


def _write_rawdir(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir()
    listing = {}
    for i, (name, t) in enumerate(tensors.items()):
        (folder / f"{i}.bin").write_bytes(t.contiguous().view(torch.uint8).numpy().tobytes())
        listing[name] = {"dtype": dtype_to_str(t.dtype), "shape": list(t.shape), "file": f"{i}.bin"}
    (folder / "rawdir.json").write_text(json.dumps({"format": "rawdir", "tensors": listing}))


def test_a_fourth_format_loads_at_tp2_and_saves_byte_for_byte(tmp_path, registry):
    want = make_model().state_dict()
    save_file(want, tmp_path / "original.safetensors", metadata={"format": "pt"})
    _write_rawdir(tmp_path / "rawdir", load_file(tmp_path / "original.safetensors"))
    names = run_ranks(_load_both, 2, tmp_path, timeout=180)
    assert names[0] == names[1] == sorted(want)

    saved = tmp_path / "saved"
    listing = json.loads((saved / "rawdir.json").read_text())
    assert listing["format"] == "rawdir" and set(listing["tensors"]) == set(want)
    for name, t in want.items():
        entry = listing["tensors"][name]
        assert (entry["dtype"], entry["shape"]) == (dtype_to_str(t.dtype), list(t.shape)), name
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        assert (saved / entry["file"]).read_bytes() == raw, name
    assert formats.format_of(saved).NAME == "rawdir"
    report = sw.verify(saved)
    assert report.ok and report.kind == "rawdir", report  # the checksums the writer recorded
    merged = sw.consolidate(saved, tmp_path / "merged", layout="module")
    back = load_file(merged / "model.safetensors")
    assert set(back) == set(want) and all(torch.equal(back[n], t) for n, t in want.items())
