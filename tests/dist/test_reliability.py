"""Failures on real gloo ranks: corrupt data files, ranks that die, and the checksums of
tensor-parallel saves. Ranks that die are launched by tests/stress/dying_ranks.py (the
harness's ``run_ranks`` stops every rank once one dies; here the survivors are what is tested).
The longer stress passes (fuzzer, kill trials, the rank-death matrix) are tests/stress/."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import shardwise as sw
from harness import run_ranks
from models import make_model, tiny_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stress"))

from dying_ranks import die, run_with_deaths  # noqa: E402

TIMEOUT = 20  # the collectives' timeout in the ranks that lose a peer


def _leftovers(root: str) -> list[str]:
    return sorted(p.name for p in Path(root).iterdir() if ".shardwise-" in p.name)


def _save_both(root: str):
    backend = sw.init_backend("gloo")
    model = make_model()
    sw.parallelize(model, tiny_plan(), backend.mesh(tp=2))
    sw.save(model, f"{root}/gather", max_shard_size="40KB")
    sw.save(model, f"{root}/dcp", distributed=True)
    return True


def _load_corrupt(root: str):
    backend = sw.init_backend("gloo")
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(sw.CheckpointError, match="cannot be read"):  # on every rank, not a BaseException
        sw.load(model, f"{root}/dcp", plan=tiny_plan(), mesh=backend.mesh(tp=2))
    return True


def _corrupt_data_files(folder: Path) -> None:
    for data in sorted(folder.glob("*.distcp")):
        raw = bytearray(data.read_bytes())
        raw[:64] = b"\xff" * 64  # the first blob's zip header: unreadable
        data.write_bytes(bytes(raw))


def test_corrupt_data_file_is_a_checkpoint_error_on_every_rank(tmp_path):
    assert run_ranks(_save_both, 2, str(tmp_path), timeout=120) == [True, True]
    _corrupt_data_files(tmp_path / "dcp")
    assert run_ranks(_load_corrupt, 2, str(tmp_path), timeout=120) == [True, True]


def test_tensor_parallel_saves_are_checksummed(tmp_path):
    assert run_ranks(_save_both, 2, str(tmp_path), timeout=120) == [True, True]
    gather, dcp = sw.verify(tmp_path / "gather"), sw.verify(tmp_path / "dcp")
    assert gather.ok and dcp.ok, (gather, dcp)
    assert gather.checksummed == gather.tensors == 36
    # sharded tensors are one chunk per rank, written (and checksummed) by both ranks
    assert dcp.checksummed > dcp.tensors == 36
    assert sw.diff(tmp_path / "gather", tmp_path / "dcp").identical
    _corrupt_data_files(tmp_path / "dcp")
    assert not sw.verify(tmp_path / "dcp").ok


def _peer_gone_before_the_dcp_save(root: str):
    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    model = make_model()
    sw.parallelize(model, tiny_plan(), backend.mesh(tp=2))
    if backend.rank == 1:
        die("exit")
    try:
        sw.save(model, f"{root}/ckpt", distributed=True)
    except sw.ShardwiseError as e:
        return type(e).__name__, _leftovers(root), sorted(p.name for p in Path(root).iterdir())
    return "saved", [], []


def test_dcp_save_whose_peer_died_early_leaves_no_temporary_folder(tmp_path):
    outcomes = run_with_deaths(_peer_gone_before_the_dcp_save, 2, str(tmp_path), timeout=4 * TIMEOUT)
    assert outcomes[1].kind == "died"
    assert outcomes[0].kind == "ok", outcomes[0].value
    error, leftovers, entries = outcomes[0].value
    assert error == "CollectiveError" and leftovers == [] and entries == []


def _peer_dies_during_the_dcp_load(root: str):
    from shardwise.io.formats.dcp import checkpoint as dcp

    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    if backend.rank == 1:  # dies while reading its chunks, between DCP's collectives
        dcp.MetadataReader.read_data = lambda self, plan, planner: die("kill")
    with torch.device("meta"):
        model = make_model()
    try:
        sw.load(model, f"{root}/dcp", plan=tiny_plan(), mesh=backend.mesh(tp=2))
    except sw.ShardwiseError as e:
        return type(e).__name__
    return "loaded"


def test_rank_death_during_a_dcp_load_is_a_shardwise_error(tmp_path):
    assert run_ranks(_save_both, 2, str(tmp_path), timeout=120) == [True, True]
    outcomes = run_with_deaths(_peer_dies_during_the_dcp_load, 2, str(tmp_path), timeout=4 * TIMEOUT)
    assert outcomes[1].kind == "died"
    assert outcomes[0].kind == "ok", outcomes[0].value
    assert outcomes[0].value == "CollectiveError"
