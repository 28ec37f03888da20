"""sw.load_adapter of a hub repo id (``"org/style-lora"``, pinned to one commit) against the local
stand-in for the hub (tests/remote/hub_server.py) on 2 gloo ranks: the logits and bytes read of the
same adapter from its folder, each rank fetching only its slices by ranged GETs; revision= and
token= without a repo id are refused."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("fsspec", reason="hub ids need fsspec (tox -e remote installs it)")

import torch  # noqa: E402
from hub_server import HubServer  # noqa: E402

import shardwise as sw  # noqa: E402
from hf.lora_models import logits, make, model_class  # noqa: E402  (torch only at import)
from shardwise.testing import spawn  # noqa: E402

REPO = "org/style-lora"


@pytest.fixture
def hub(tmp_path):
    # found, not imported: huggingface_hub reads HF_ENDPOINT once, at its import, in each rank
    for needed in ("transformers", "peft"):
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"hub adapters need {needed} (tox -e remote installs it)")
    reference = make("llama", tmp_path)
    server = HubServer({REPO: tmp_path / "a"}).start()
    yield server, reference
    server.stop()


def _from_hub(folder: str) -> dict:
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=2)
    remote = sw.from_pretrained(model_class("llama"), f"{folder}/ckpt", mesh=mesh)
    local = sw.from_pretrained(model_class("llama"), f"{folder}/ckpt", mesh=mesh)
    got = sw.load_adapter(remote, REPO, adapter_name="a", revision="main")
    want = sw.load_adapter(local, f"{folder}/a", adapter_name="a")
    try:
        sw.load_adapter(local, f"{folder}/b", adapter_name="b", revision="main")
        refused = ""
    except sw.UsageError as e:
        refused = str(e)
    return {"equal": torch.equal(logits(remote), logits(local)), "remote": got.bytes_read,
            "local": want.bytes_read, "logits": logits(remote).tolist(), "refused": refused}


def test_an_adapter_from_a_hub_repo_id_equals_the_folder_one(hub, tmp_path):
    server, reference = hub
    env = {"HF_ENDPOINT": server.endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf_home"),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    rows = spawn(_from_hub, 2, args=(str(tmp_path),), env=env, timeout=300)
    for row in rows:
        assert row["equal"] and row["remote"] == row["local"] > 0
        assert (torch.tensor(row["logits"]) - reference["a"]).abs().max().item() <= 1e-5
        assert "revision= and token= go with a hub repo id" in row["refused"]
    gets = [(p, r) for m, p, r in server.requests if m == "GET" and "/resolve/" in p]
    assert gets and all(r is not None and r.startswith("bytes=") for _, r in gets)  # ranged, in place
    assert not any("/resolve/main/" in p for p, _ in gets)  # one pinned commit
    sent = server.sent[f"{REPO}/adapter_model.safetensors"]
    assert 0 < sent < 2 * (tmp_path / "a" / "adapter_model.safetensors").stat().st_size
