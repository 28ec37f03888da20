"""sw.load_adapter / sw.save_adapter over object storage: a PEFT adapter read from s3:// (SeaweedFS)
on 2 spawned gloo ranks gives the logits and byte counts of the same adapter read from a local
folder, each rank reading only its slices; save_adapter writes it to s3:// through the object
store's save transaction, PEFT's bytes."""

from __future__ import annotations

import pytest

pytest.importorskip("peft", reason="LoRA adapters need peft (tox -e remote installs it)")
pytest.importorskip("transformers")

import torch  # noqa: E402

import shardwise as sw  # noqa: E402
from hf.lora_models import logits, make, model_class  # noqa: E402
from shardwise.testing import spawn  # noqa: E402

FILES = ("adapter_model.safetensors", "adapter_config.json")


def _attach(folder: str, url: str, options: dict) -> dict:
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    remote = sw.from_pretrained(model_class("llama"), f"{folder}/ckpt", mesh=mesh)
    local = sw.from_pretrained(model_class("llama"), f"{folder}/ckpt", mesh=mesh)
    got = sw.load_adapter(remote, f"{url}/a", adapter_name="a", storage_options=options)
    want = sw.load_adapter(local, f"{folder}/a", adapter_name="a")
    assert torch.equal(logits(remote), logits(local))
    sw.save_adapter(remote, f"{url}/saved", adapter_name="a", storage_options=options)
    return {"remote": got.bytes_read, "local": want.bytes_read, "logits": logits(remote).tolist()}


def test_adapter_from_and_to_s3_equals_the_local_one(s3, tmp_path):
    import obstore

    reference = make("llama", tmp_path)
    store = s3.storage().store(s3.bucket)
    for name in FILES:
        obstore.put(store, f"{s3.prefix}/a/{name}", (tmp_path / "a" / name).read_bytes())
    rows = spawn(_attach, 2, args=(str(tmp_path), s3.url().rstrip("/"), s3.options), timeout=300)
    for row in rows:
        assert row["remote"] == row["local"] > 0
        assert (torch.tensor(row["logits"]) - reference["a"]).abs().max().item() <= 1e-5
    weights = bytes(obstore.get(store, f"{s3.prefix}/saved/{FILES[0]}").bytes())
    assert weights == (tmp_path / "a" / FILES[0]).read_bytes()
    assert b'"r": 4' in bytes(obstore.get(store, f"{s3.prefix}/saved/{FILES[1]}").bytes())
