"""A diffusers pipeline from object storage: ``sw.from_pretrained(Flux2Pipeline, "s3://...")``
against SeaweedFS on 2 gloo ranks makes the one-process pipeline's image (within 1e-4), each
sharded component reading at most its own slices (the job reads each byte once); the scheduler and tokenizer
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
from shardwise.io.storage.lookups import DONE_MARK  # noqa: E402
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
        # an object store is read once per job (each rank fetches its part of the union of the
        # ranks' slices, then they exchange): never more per rank than its own slices locally
        assert all(0 < remote <= local for remote, local in row["read"]), row["read"]


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


def _save_to_s3(local: str, url: str, out: str, options: dict) -> str:
    backend = sw.init_backend("gloo")
    pipe = sw.from_pretrained(pipeline_class("flux2"), local, mesh=backend.mesh(tp=backend.world_size))
    sw.save(pipe, out)  # the local save, to compare with
    sw.save(pipe, url, storage_options=options)
    try:
        sw.save(pipe, url, storage_options=options)
    except sw.CheckpointError as e:  # an existing pipeline: refused without overwrite
        refused = str(e)
    except Exception as e:  # noqa: BLE001 - named in the assertion below
        refused = f"{type(e).__name__}: {e}"
    else:
        refused = "saved twice"
    sw.save(pipe, url, storage_options=options, overwrite=True)  # replaced once complete
    return refused


def test_pipeline_saved_to_s3_equals_the_local_save_and_is_replaced_whole(s3, tmp_path):
    import obstore

    folder = save_pipeline("flux2", tmp_path / "pipe")
    out = tmp_path / "out"
    for refused in spawn(_save_to_s3, 2, args=(str(folder), s3.url("saved"), str(out), s3.options),
                         timeout=600):
        assert "pass overwrite=True" in refused, refused
    store = s3.storage().store(s3.bucket)
    listed = [o["path"] for batch in obstore.list(store, prefix=f"{s3.prefix}/") for o in batch]
    # every file, and beside each model the record of its committed save (shardwise's: it tells
    # a late copy of that save's journal from a save in progress)
    ours = {p[len(f"{s3.prefix}/saved/"):]: bytes(obstore.get(store, p).bytes())
            for p in listed if p.startswith(f"{s3.prefix}/saved/") and not p.endswith(DONE_MARK)}
    records = sorted(p.rpartition("/")[2] for p in listed
                     if p.startswith(f"{s3.prefix}/saved/") and p.endswith(DONE_MARK))
    assert records == sorted(f".{n}{DONE_MARK}" for n in (*SHARDED, "vae")), records
    local = {f.relative_to(out).as_posix(): f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()}
    assert ours == local, sorted(ours.keys() ^ local.keys())  # every file, byte for byte
    assert not [p for p in listed if "tmp" in p or "publish.json" in p], listed  # nothing aside
    reference = generate(build_pipeline("flux2"), "flux2")
    for row in spawn(_images, 2, args=(s3.url("saved"), str(out), s3.options), timeout=600):
        assert (torch.tensor(row["remote"]) - reference).abs().max().item() <= TOLERANCE
