"""Errors that name the likely cause: a collective save entered by one rank, a mesh larger
than the world of a process started without a launcher."""

from __future__ import annotations

import time

import pytest
import torch

import shardwise as sw
from harness import run_ranks
from shardwise.errors import CollectiveError, MeshError


def _only_rank0_saves(out: str, peer: str) -> str:
    backend = sw.init_backend("gloo", timeout=5)
    model = torch.nn.Linear(4, 4)
    if backend.rank != 0:
        if peer == "busy":  # alive, but elsewhere until rank 0 has given up
            time.sleep(8)
        return "left"  # the launcher then tears the group down, as a script that ends does
    try:
        sw.save(model, out)
    except CollectiveError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("peer", ["leaves", "busy"])
def test_save_entered_by_one_rank_says_it_is_collective(tmp_path, peer):
    message, other = run_ranks(_only_rank0_saves, 2, str(tmp_path / "out"), peer, timeout=60)
    assert other == "left"
    assert message.startswith("sw.save is collective: call it on every rank"), message
    assert "waited up to 5 s" in message
    assert not (tmp_path / "out").exists()


def _mesh_error(tp: int) -> str:
    backend = sw.init_backend("gloo")
    try:
        backend.mesh(tp=tp)
    except MeshError as e:
        return str(e)
    return "no error"


def test_mesh_larger_than_a_one_process_world_names_torchrun():
    message, = run_ranks(_mesh_error, 1, 4)
    assert "world size is 1" in message and "launch with torchrun --nproc-per-node 4" in message
