"""A tensor-parallel rank's slices read from an object store through the same safetensors
writer and region reader as a local load (``sw.load``'s path below its entry point), each
rank's bytes counted at the proxy: colwise slices cost the share, rowwise slices a range per
row, coalesced where the gaps allow, never more than 1.05x the share. Through ``sw.load`` on
spawned ranks, the job reads each byte once: rowwise slices as slabs of whole rows, exchanged."""

from __future__ import annotations

import math

import pytest
import torch
from located import at
from proxy import RankProxies

import shardwise as sw
import shardwise.io.read.exchange as exchange
from models import make_model, tiny_plan
from shardwise.core.spec import ShardSpec, split
from shardwise.io.formats.safetensors.files import StreamingWriter, read_header
from shardwise.io.read.reader import RegionReader, plan_reads
from shardwise.parallel import get_shard_state, local_of
from shardwise.testing import spawn

TENSORS = {"rows": torch.randn(512, 256), "cols": torch.randn(256, 512), "bias": torch.randn(512)}


def _write(path) -> None:
    specs = [(n, "F32", tuple(t.shape)) for n, t in TENSORS.items()]
    with StreamingWriter(path, specs) as writer:
        for name, t in TENSORS.items():
            writer.write(name, t)


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_each_rank_fetches_only_its_slice(remote, degree, dim):
    storage = remote.storage()
    path = at(storage, remote.loc("ckpt/model.safetensors"))
    _write(path)
    header = read_header(path)
    plan = {"rows": ShardSpec(dim=dim), "cols": ShardSpec(dim=dim), "bias": ShardSpec(dim=0)}
    share = sum(t.numel() * 4 for t in TENSORS.values()) // degree
    requests = []
    for rank in range(degree):
        remote.proxy.clear()
        items = plan_reads({n: (path, header.entries[n]) for n in TENSORS}, plan, degree, rank)
        with RegionReader({path: header}, num_threads=4) as reader:
            got = reader.read(items, finalize=lambda item, raw: raw)
        for name, t in TENSORS.items():
            assert torch.equal(got[name], split(t, plan[name], degree, rank)), (name, rank)
        fetched = remote.proxy.sent("GET")
        assert fetched <= 1.05 * share, (rank, fetched, share)
        requests.append(remote.proxy.count("GET"))
    if dim == 0:  # a rank's rows are one contiguous range per tensor
        assert max(requests) <= len(TENSORS), requests
    print(f"{remote.scheme} dim={dim} degree={degree}: GETs per rank {requests}, share {share} bytes")


def _load_shards(url: str, options: list[dict], axes: dict, window: int | None):
    if window is not None:  # small rounds: the exchange runs several
        exchange.ROUND_BYTES = window
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(**axes)
    with torch.device("meta"):
        model = make_model()
    sw.load(model, f"{url}/src", plan=tiny_plan(), mesh=mesh, storage_options=options[backend.rank])
    canonical, state = make_model().state_dict(), get_shard_state(model)
    tp_rank = mesh["tp"].get_local_rank()
    for name, t in model.state_dict().items():  # bit-identical to the split of the stored tensor
        want = split(canonical[name], state.specs[name], axes["tp"], tp_rank)
        got = local_of(t)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    return True


@pytest.mark.parametrize("axes,window", [({"tp": 2}, None), ({"tp": 4}, None), ({"tp": 4}, 4096),
                                         ({"dp_replicate": 2, "tp": 2}, None)])
def test_a_job_reads_each_byte_once_and_exchanges_the_slices(s3, tmp_path, axes, window):
    """sw.load at tp=2, tp=4 and dp_replicate=2 x tp=2 from S3: rowwise and packed rowwise slices
    come as slabs of whole rows and an exchange; every rank's shards equal the split of the stored
    tensors; each rank (its own proxy) fetches about its share, in a number of GETs bounded by the
    tensors, not by their rows."""
    url = s3.url().rstrip("/")
    model = make_model()
    sw.save(model, f"{url}/src", storage_options=s3.options, max_shard_size=40_000)
    tensors = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    world = math.prod(axes.values())
    sw.save(model, tmp_path / "src", max_shard_size=40_000)  # the same files, to find their data
    starts = {f.name: 8 + int.from_bytes(f.read_bytes()[:8], "little")
              for f in (tmp_path / "src").glob("*.safetensors")}
    with RankProxies(s3.server.endpoint, world) as proxies:
        options = proxies.options(s3.options)
        assert spawn(_load_shards, world, args=(url, options, axes, window), timeout=240) == [True] * world
        fetched, data, gets = proxies.figures(starts)
    print(f"{axes}: {total} tensor bytes in {len(starts)} files; per rank: fetched {fetched}, of which "
          f"tensor data {data}, GETs {gets}")
    assert sum(data) <= 1.05 * total  # the job read each tensor byte once
    assert all(d <= 1.05 * total / world for d in data), (data, total / world)  # each rank its share
    assert all(f - d <= 32_000 for f, d in zip(fetched, data, strict=True))  # index, headers, listings
    rows = sum(t.shape[0] for t in tensors.values() if t.dim() == 2)
    assert max(gets) <= 2 * len(tensors) + 3 * len(starts) < rows, (gets, rows)


def _load_failing(url: str, options: list[dict]) -> str:
    backend = sw.init_backend("gloo")
    with torch.device("meta"):
        model = make_model()
    try:
        sw.load(model, f"{url}/one", plan=tiny_plan(), mesh=backend.mesh(tp=2),
                storage_options=options[backend.rank])
    except sw.errors.ShardwiseError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_read_that_fails_on_one_rank_raises_on_every_rank(s3, tmp_path):
    """Rank 1's every GET of the file's data is throttled until its retries run out: rank 1 raises
    its error, rank 0 one naming rank 1's; neither waits in the exchange."""
    url = s3.url().rstrip("/")
    sw.save(make_model(), f"{url}/one", storage_options=s3.options)  # one file: both ranks read it
    sw.save(make_model(), tmp_path / "one")
    local = tmp_path / "one" / "model.safetensors"
    start = 8 + int.from_bytes(local.read_bytes()[:8], "little")
    with RankProxies(s3.server.endpoint, 2) as proxies:
        proxies.proxies[1].fault("503", method="GET", path="model.safetensors", times=10_000, start=start)
        messages = spawn(_load_failing, 2, args=(url, proxies.options(s3.options)), timeout=240)
    assert "model.safetensors" in messages[1] and "503" in messages[1], messages
    assert messages[0].startswith("CheckpointError") and "rank(s) [1]" in messages[0], messages
