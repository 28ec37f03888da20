"""FP8 block-scaled models in distributed checkpoints: ``sw.save(distributed=True)`` of a kept
quantized model writes the canonical weights and the canonical scales (each block's scale once,
also where shard boundaries cut blocks), and ``sw.load`` of it at another degree rebuilds every
(weight, scale) pair quantized, byte-equal to the checkpoint transformers wrote; ``sw.consolidate``
of it gives that checkpoint's tensors byte for byte.

Four ranks: saved at tp=2 (x2 dp replicas; whole blocks, DTensor scales) and at tp=4 (the
qwen3 q/k/v and llama576's 576-wide MLP: blocks cut, local scales), each loaded at the other
degree and whole (tp=1 x4 replicas), in both holdings.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from hf import fp8_models as F  # noqa: E402
from shardwise.errors import CheckpointError, UnsupportedModelError  # noqa: E402
from shardwise.io.check import inspect_checkpoint  # noqa: E402

SAVES = [("tp2", "dtensor"), ("tp4", "local")]


@pytest.fixture(scope="module", params=list(F.KINDS))
def ckpt(request, tmp_path_factory):
    return request.param, F.save_fp8(request.param, tmp_path_factory.mktemp("fp8dcp") / request.param)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _check_held(model, stored: dict, what: str) -> None:
    """Every local tensor is this rank's part of the stored tensor: the FP8 weights and their
    scales bytes and dtype as stored, whatever the load's dtype (float32), the rest cast to it."""
    from shardwise.parallel import get_shard_state, local_of
    from shardwise.quant import local_part

    state = get_shard_state(model)
    held = model.state_dict()
    assert len(state.specs.ties) == 7, what
    for name, spec in state.specs.items():
        want = local_part(stored[name], name, spec, state.specs, state.coords(spec))
        want = want if name in state.specs.quantized else want.to(torch.float32)
        assert same_bits(local_of(held[name]), want), (what, name)


def _ranks(kind: str, folder: str, out: str):
    backend = sw.init_backend("gloo")
    meshes = {"tp2": backend.mesh(dp_replicate=2, tp=2), "tp4": backend.mesh(tp=4),
              "tp1": backend.mesh(dp_replicate=4)}
    cls, stored = F.model_class(kind), F.stored_tensors(folder)
    for save_at, holding in SAVES:
        kept = sw.from_pretrained(cls, folder, mesh=meshes[save_at], holding=holding)
        dcp = f"{out}/{save_at}"
        sw.save(kept, dcp, distributed=True)
        with pytest.raises(UnsupportedModelError, match="FP8.*distributed=True"):
            sw.save(kept, f"{out}/rank-local", distributed=True, format="safetensors")
        for load_at in meshes:
            for into in ("dtensor", "local"):
                model = F.meta_fp8_model(kind)
                sw.load(model, dcp, plan="auto", mesh=meshes[load_at], holding=into, dtype=torch.float32)
                _check_held(model, stored, f"saved at {save_at}, loaded at {load_at} {into}")
    # a plain model cannot take FP8 weights from a DCP: the cast would ignore the scales
    with sw.empty_model():
        plain = cls._from_config(F.KINDS[kind][1]())
    with pytest.raises(CheckpointError, match=r"float8_e4m3fn with block scales.*consolidate"):
        sw.load(plain, f"{out}/tp2", plan="auto", mesh=meshes["tp4"])
    return True


def test_fp8_dcp_reshards_quantized_and_consolidates_byte_for_byte(ckpt, tmp_path):
    kind, folder = ckpt
    assert all(run_ranks(_ranks, 4, kind, str(folder), str(tmp_path), timeout=900))
    stored = F.stored_tensors(folder)
    source_qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    for save_at, _ in SAVES:
        dcp = tmp_path / save_at
        assert sw.verify(dcp).ok
        assert sw.diff(dcp, folder).identical  # canonical: each scale once, at its offsets
        assert set(inspect_checkpoint(dcp).quant) == {k for k in stored if k.endswith("_scale_inv")} | {
            k for k in stored if k + "_scale_inv" in stored}
        merged = tmp_path / f"merged-{save_at}"
        sw.consolidate(dcp, merged)
        got = F.stored_tensors(merged)
        assert set(got) == set(stored)
        assert all(same_bits(got[k], stored[k]) for k in stored), save_at
        assert json.loads((merged / "config.json").read_text())["quantization_config"] == source_qc
        assert sw.verify(merged).ok
