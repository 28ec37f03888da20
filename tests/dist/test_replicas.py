"""Replicas read once: on ``mesh(dp_replicate=2, tp=2)`` each region is read from storage by
one replica and broadcast to the other, so the job reads the checkpoint once.

Checked on spawned ranks (local shards byte for byte, the forward, bytes read per rank, a
failing read on one replica raising on every rank) and on two torchrun "nodes" of two ranks
each, started from the test on the loopback interface (logits, bytes read per node, with and
without a replica axis).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import shardwise as sw
from harness import run_ranks
from models import TinyTransformer, make_model, tiny_plan, tokens
from shardwise.core.spec import split
from shardwise.errors import CheckpointError
from shardwise.parallel import get_shard_state, local_of

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _torchrun import torchrun_nodes  # noqa: E402

NODE_SCRIPT = Path(__file__).with_name("replica_node.py")


def _canonical(dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype).contiguous() for k, v in make_model().state_dict().items()}


def _total(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("replicas") / "model.safetensors"
    st.save_file(_canonical(), path)
    return path


def _load_replicas(path: str, holding: str, dtype):
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(dp_replicate=2, tp=2)
    with torch.device("meta"):
        model = TinyTransformer()
    result = sw.load(model, path, plan=tiny_plan(), mesh=mesh, holding=holding, dtype=dtype, progress=False)
    state, tensors = get_shard_state(model), model.state_dict()
    canonical = _canonical()
    tp_rank = mesh["tp"].get_local_rank()
    for name, spec in state.specs.items():  # every shard is the split of the file's tensor
        expected = split(canonical[name], spec, 2, tp_rank).to(dtype or torch.float32)
        assert torch.equal(local_of(tensors[name]), expected), name
    reference = make_model().to(dtype or torch.float32)
    with torch.no_grad():
        one = reference(tokens())
        out = model(tokens())
    torch.testing.assert_close(out, one, rtol=2e-2 if dtype else 1e-5, atol=2e-2 if dtype else 1e-5)
    return result.bytes_read


@pytest.mark.slow
@pytest.mark.parametrize("holding,dtype", [("dtensor", None), ("local", torch.bfloat16)])
def test_each_region_is_read_by_one_replica(ckpt, holding, dtype):
    got = run_ranks(_load_replicas, 4, str(ckpt), holding, dtype)
    total = _total(_canonical())
    # the mesh spans the job: every byte of the file is read once, by one of the four ranks
    assert sum(got) == total
    assert all(0 < b < total / 2 for b in got), got  # the reads are spread over the ranks


def _one_replica_fails(path: str):
    import shardwise.io.formats.safetensors.source as source_module

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(dp_replicate=2, tp=2)
    with torch.device("meta"):
        model = TinyTransformer()
    resolved = source_module.resolve_checkpoint(path)  # headers read while the file is whole
    backend.barrier()
    if backend.rank == 0:  # then the file loses its last bytes: only their reader can notice
        os.truncate(path, os.path.getsize(path) - 64)
    backend.barrier()
    source_module.resolve_checkpoint = lambda p: resolved
    with pytest.raises(CheckpointError) as e:
        sw.load(model, path, plan=tiny_plan(), mesh=mesh, progress=False)
    return str(e.value)


@pytest.mark.slow
def test_a_failed_read_raises_on_every_rank(tmp_path):
    path = tmp_path / "model.safetensors"
    st.save_file(_canonical(), path)
    messages = run_ranks(_one_replica_fails, 4, str(path))
    owners = [m for m in messages if "truncated" in m]  # the rank that owns the last bytes
    others = [m for m in messages if "another rank failed" in m]
    assert owners and len(owners) + len(others) == 4, messages


def _run_nodes(ckpt: Path, out: Path, mode: str, timeout: float = 240.0) -> list[dict]:
    out.mkdir()
    return torchrun_nodes([str(NODE_SCRIPT), str(ckpt), str(out), mode], out, timeout=timeout)


@pytest.mark.slow
@pytest.mark.long  # two simulated nodes of two ranks, twice: tox -e stress runs it, tox -e gloo does not
def test_two_nodes_read_the_checkpoint_once(ckpt, tmp_path):
    total = _total(_canonical())
    with torch.no_grad():
        reference = make_model()(tokens())
    per_node = {}
    for mode in ("replicas", "plain"):
        records = _run_nodes(ckpt, tmp_path / mode, mode)
        for rec in records:
            torch.testing.assert_close(torch.tensor(rec["logits"]), reference, rtol=1e-5, atol=1e-5)
        per_node[mode] = [sum(r["bytes_read"] for r in records if r["node"] == n) for n in (0, 1)]
    # with replicas reading once the two nodes share the file; without, each node reads all of it
    # (its two tp ranks read their halves, and the replicated tensors once each)
    assert sum(per_node["replicas"]) == total, per_node
    assert all(0 < b < total for b in per_node["replicas"]), per_node
    assert all(b >= total for b in per_node["plain"]), per_node
    print(f"bytes read per node of a {total}-byte checkpoint: {per_node}")
