"""sw.save's always-on invariant: before anything is written, every stored tensor has exactly
the name, shape and dtype that the model's checkpoint holds in the chosen layout.

The fault it guards against shipped once: a hub-layout save of HRM-Text wrote the fused
``gqkv_proj.weight`` with the shape of one of its four parts, and ``verify`` said OK. Here the
planned layout is corrupted on purpose (the stored tensor given one part's shape) and the
save must refuse, leaving no folder behind."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import shardwise as sw  # noqa: E402
from hf import hf_models  # noqa: E402
from shardwise.io import save as save_module  # noqa: E402


def _one_process_model(folder):
    backend = sw.init_backend("gloo")
    return sw.from_pretrained(hf_models.model_class("hrm_text"), folder, mesh=backend.mesh(tp=1),
                              dtype=torch.float32), backend


def test_save_refuses_a_stored_tensor_of_the_wrong_shape(tmp_path, monkeypatch):
    folder = hf_models.save_tiny("hrm_text", tmp_path / "ckpt")
    model, _ = _one_process_model(folder)
    try:
        sw.save(model, tmp_path / "good")  # the true layout passes the invariant
        assert sw.verify(tmp_path / "good", against=folder).ok
        real = save_module.stored_tensors

        def one_part_shape(model, items, layout):  # the shipped bug: the fused key as one part
            return [dataclasses.replace(s, shape=(64, 64)) if s.name.endswith("gqkv_proj.weight") else s
                    for s in real(model, items, layout)]

        monkeypatch.setattr(save_module, "stored_tensors", one_part_shape)
        with pytest.raises(sw.CheckpointError, match=r"gqkv_proj\.weight.*\(64, 64\).*\(256, 64\)"):
            sw.save(model, tmp_path / "bad")
        assert not (tmp_path / "bad").exists()
    finally:
        sw.shutdown_backend()
