"""A diffusers pipeline from object storage: ``sw.from_pretrained(Flux2Pipeline, "s3://...")``
against SeaweedFS on 2 gloo ranks makes the one-process pipeline's image (within 1e-4), each
sharded component reading its own slices as from a local folder; the scheduler and tokenizer
come through the storage too. A hub repo id: online (fsspec's ranged reads of hf://) against
the tests' stand-in hub, and with HF_HUB_OFFLINE from the local hub cache's snapshot folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# found, not imported: the ranks unpickle this module before they set HF_ENDPOINT, and
# huggingface_hub (which both import) reads it once, at its import
if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("diffusers") is None:
    pytest.skip("pipelines need transformers and diffusers (tox -e remote installs them)",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "hf"))  # the tiny pipelines of tests/hf

import torch  # noqa: E402
from pipeline_models import SHARDED, build_pipeline, generate, pipeline_class, save_pipeline  # noqa: E402

import shardwise as sw  # noqa: E402
from shardwise.testing import spawn  # noqa: E402

TOLERANCE = 1e-4


def _images(url: str, local: str, options: dict) -> dict:
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    remote = sw.from_pretrained(pipeline_class("flux2"), url, mesh=mesh, storage_options=options)
    ours = sw.from_pretrained(pipeline_class("flux2"), local, mesh=mesh)
    return {"remote": generate(remote, "flux2").tolist(), "local": generate(ours, "flux2").tolist(),
            "read": [(remote.result[n].bytes_read, ours.result[n].bytes_read) for n in SHARDED]}


def test_pipeline_from_s3_equals_one_process(s3, tmp_path):
    import obstore

    folder = save_pipeline("flux2", tmp_path / "pipe")
    store = s3.storage().store(s3.bucket)
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):  # the files save_pretrained wrote
        obstore.put(store, f"{s3.prefix}/pipe/{f.relative_to(folder).as_posix()}", f.read_bytes())
    reference = generate(build_pipeline("flux2"), "flux2")
    for row in spawn(_images, 2, args=(s3.url("pipe"), str(folder), s3.options), timeout=600):
        assert (torch.tensor(row["remote"]) - reference).abs().max().item() <= TOLERANCE
        assert (torch.tensor(row["remote"]) - torch.tensor(row["local"])).abs().max().item() <= TOLERANCE
        assert all(remote == local for remote, local in row["read"]), row["read"]


def _from_hub(repo: str) -> list:
    backend = sw.init_backend("gloo")
    pipe = sw.from_pretrained(pipeline_class("flux2"), repo, mesh=backend.mesh(tp=backend.world_size))
    return generate(pipe, "flux2").tolist()


def _download(repo: str) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo)


def test_pipeline_from_a_hub_id_online_and_from_the_offline_cache(tmp_path):
    from hub_server import HubServer

    folder = save_pipeline("flux2", tmp_path / "pipe")
    reference = generate(build_pipeline("flux2"), "flux2")
    hub = HubServer({"org/pipe": folder}).start()
    try:
        # huggingface_hub reads these at import: the ranks get them before they import it
        env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf_home"),
               "HF_HUB_DISABLE_TELEMETRY": "1"}
        for image in spawn(_from_hub, 2, args=("org/pipe",), env=env, timeout=600):  # hf:// ranged reads
            assert (torch.tensor(image) - reference).abs().max().item() <= TOLERANCE
        snapshot = Path(spawn(_download, 1, args=("org/pipe",), env=env, timeout=300)[0])
        assert (snapshot / "transformer").is_dir() and snapshot.parent.name == "snapshots"
        hub.clear()
        offline = {**env, "HF_HUB_OFFLINE": "1"}
        for image in spawn(_from_hub, 2, args=("org/pipe",), env=offline, timeout=600):
            assert (torch.tensor(image) - reference).abs().max().item() <= TOLERANCE
        assert hub.requests == [], "offline: the hub cache only"
    finally:
        hub.stop()
