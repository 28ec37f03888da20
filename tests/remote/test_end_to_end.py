"""The public verbs over a real object store (SeaweedFS for ``s3://``, fake-gcs-server for
``gs://``, each behind the tests' counting proxy): a gather save, a load at tp=2 by spawned gloo
ranks equal to the local load, a DCP save at tp=2 reloaded at tp=1, consolidation out of the
store into a local folder byte for byte the local gather save, verify and diff. The proxy counts
what the ranks fetched: no more than what the loader reports reading, plus the headers."""

from __future__ import annotations

import os

import torch

import shardwise as sw
from models import make_model, tiny_plan
from shardwise.testing import spawn

SHARD_SIZE = 40_000  # several files: the index is published last


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _meta():
    with torch.device("meta"):
        return make_model()


def _locals(model) -> dict[str, torch.Tensor]:
    return {n: sw.testing.local_shard(t).detach() for n, t in model.state_dict(keep_vars=True).items()}


def _load_at_tp2(url: str, root: str, options: dict):
    backend = sw.init_backend("gloo")
    tp2 = backend.mesh(tp=2)
    ours, theirs = _meta(), _meta()
    result = sw.load(ours, f"{url}/src", plan=tiny_plan(), mesh=tp2, storage_options=options)
    sw.load(theirs, f"{root}/src", plan=tiny_plan(), mesh=tp2)
    got, want = _locals(ours), _locals(theirs)
    assert got.keys() == want.keys() and all(_same(got[n], want[n]) for n in want)
    sw.save(ours, f"{url}/dcp", distributed=True, storage_options=options)
    sw.save(ours, f"{root}/gather", max_shard_size=SHARD_SIZE)
    return result.bytes_read


def _reload_at_tp1(url: str, options: dict) -> bool:
    backend = sw.init_backend("gloo")
    model = _meta()
    sw.load(model, f"{url}/dcp", plan=tiny_plan(), mesh=backend.mesh(tp=1), storage_options=options)
    ref = make_model().state_dict()
    return all(_same(t, ref[n]) for n, t in _locals(model).items())


def test_the_public_verbs_over_an_object_store(remote, tmp_path):
    options = remote.options
    url = remote.url().rstrip("/")
    sw.save(make_model(), tmp_path / "src")  # the source checkpoint on disk, and in the store
    sw.save(make_model(), f"{url}/src", storage_options=options)
    assert sw.diff(f"{url}/src", tmp_path / "src", storage_options=options).identical
    storage = remote.storage()  # the gather save in the store is the local one, file for file, byte for byte
    local = {p.name: p.read_bytes() for p in sorted((tmp_path / "src").iterdir())}
    assert storage.list(remote.loc("src")) == sorted(local)
    for name, data in local.items():
        handle = storage.open(remote.loc(f"src/{name}"))
        got = bytearray(handle.size())
        handle.readinto(memoryview(got), 0)
        assert bytes(got) == data, name
    file_bytes = sum(p.stat().st_size for p in (tmp_path / "src").iterdir() if p.suffix == ".safetensors")

    remote.proxy.clear()
    env = {k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST",) if k in os.environ}
    read = spawn(_load_at_tp2, 2, args=(url, str(tmp_path), options), env=env, timeout=240)
    # the ranks fetched what they read (their shares, each byte once: io.exchange), the headers
    # and the DCP save's own reads at most on top: never a whole file per rank
    fetched = remote.proxy.sent("GET")
    assert sum(read) <= fetched <= 1.05 * sum(read) + 2 * (file_bytes - sum(read) / 2) + 64_000
    assert max(read) < 0.75 * file_bytes  # each rank its share, not the whole checkpoint

    assert spawn(_reload_at_tp1, 1, args=(url, options), env=env, timeout=120) == [True]
    merged = sw.consolidate(f"{url}/dcp", tmp_path / "merged", max_shard_size=SHARD_SIZE,
                            storage_options=options)
    gathered = {p.name: p.read_bytes() for p in sorted((tmp_path / "gather").iterdir())}
    assert {p.name: p.read_bytes() for p in sorted(merged.iterdir())} == gathered
    report = sw.verify(f"{url}/dcp", storage_options=options)
    assert report.ok and report.verified, report.summary()
    assert sw.diff(f"{url}/dcp", tmp_path / "gather", storage_options=options).identical
