"""A pipeline saved to ``s3://`` under the proxy's faults, by two gloo ranks at tp=2: a fault
that persists on the transformer's uploads ends the overwrite in an error on every rank, and
the pipeline saved there before stays whole, byte for byte, with nothing staged left beside it;
a 503 and a reset mid-upload are retried, and the saved pipeline equals the local save of the
same pipeline, file for file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("diffusers") is None:
    pytest.skip("pipelines need transformers and diffusers (tox -e remote installs them)",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "hf"))  # the tiny pipelines of tests/hf

from pipeline_models import pipeline_class, save_pipeline  # noqa: E402
from test_publish import _left  # noqa: E402

import shardwise as sw  # noqa: E402
from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.testing import spawn  # noqa: E402

TIMEOUT = 30.0  # the ranks' collective timeout: far past the store's bounded retries


def _save(local: str, url: str, options: dict, out: str | None) -> tuple:
    """Load the pipeline at ``local`` at tp=2 and save it over ``url`` (and to ``out``, locally);
    ``("ok",)`` or ``("error", message)``: every rank reports how it ended."""
    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    pipe = sw.from_pretrained(pipeline_class("flux2"), local, mesh=backend.mesh(tp=backend.world_size))
    if out is not None:
        sw.save(pipe, out)
    try:
        sw.save(pipe, url, storage_options=options, overwrite=True)
    except ShardwiseError as e:
        return ("error", str(e))
    return ("ok",)


def _objects(remote) -> dict[str, bytes]:
    """Every object under the test's prefix (but the committed-save records) and its bytes."""
    import obstore

    store = remote.storage().store(remote.bucket)
    return {name: bytes(obstore.get(store, f"{remote.prefix}/{name}").bytes()) for name in _left(remote)}


def test_a_pipeline_save_to_s3_under_faults(s3, tmp_path):
    first = save_pipeline("flux2", tmp_path / "first", seed=0)
    second = save_pipeline("flux2", tmp_path / "second", seed=1)
    url = s3.url("pipe")
    assert spawn(_save, 2, args=(str(first), url, s3.options, None), timeout=600) == [("ok",)] * 2
    before = _objects(s3)
    assert any(n.startswith("pipe/transformer/") for n in before), sorted(before)

    s3.proxy.fault("503", method="PUT", path="transformer/", times=10_000)
    results = spawn(_save, 2, args=(str(second), url, s3.options, None), timeout=600)
    assert all(r[0] == "error" for r in results), results  # every rank, none left waiting
    assert any("transformer/" in r[1] for r in results), results  # the failing upload named
    assert not any("timed out" in r[1].lower() for r in results), results
    s3.proxy.clear()
    assert _objects(s3) == before  # the previous pipeline, byte for byte; nothing staged left

    s3.proxy.fault("503", method="PUT", path="text_encoder/")
    s3.proxy.fault("reset", method="PUT", path="transformer/")
    out = tmp_path / "local"
    assert spawn(_save, 2, args=(str(second), url, s3.options, str(out)), timeout=600) == [("ok",)] * 2
    assert sorted(s3.proxy.taken) == ["503", "reset"] and s3.proxy.pending() == 0
    saved = {n[len("pipe/"):]: data for n, data in _objects(s3).items()}
    local = {f.relative_to(out).as_posix(): f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()}
    assert saved == local, sorted(saved.keys() ^ local.keys())  # the new pipeline, file for file
    assert saved != {n[len("pipe/"):]: data for n, data in before.items()}  # and not the first one
