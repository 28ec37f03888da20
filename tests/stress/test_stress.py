"""The stress suites at a small N (``tox -e stress``; CI runs it): the fuzzer over mutated
checkpoints, SIGKILL trials during every kind of save, and ranks that die during loads and
saves. ``SHARDWISE_STRESS_N`` sets the fuzz cases (default 40) and ``SHARDWISE_STRESS_KILLS``
the kill trials per kind (default 1); ``tests/stress/stress.py`` runs the long passes whose
figures docs/reliability.md publishes. Every case must pass: a correct load or a clean
``ShardwiseError``, a kill that leaves nothing, the previous checkpoint or a whole new one, and
a survivor that ends with ``CollectiveError``."""

from __future__ import annotations

import os

import pytest
from crash_trials import KILL_KINDS, run_deaths, run_kills
from fuzzer import run_fuzz

pytestmark = pytest.mark.stress

FUZZ_N = int(os.environ.get("SHARDWISE_STRESS_N", "40"))
KILLS = int(os.environ.get("SHARDWISE_STRESS_KILLS", "1"))


def test_fuzzed_checkpoints_load_correctly_or_fail_cleanly(tmp_path):
    fuzz = run_fuzz(tmp_path / "fuzz", FUZZ_N, seed=7, progress=None)
    assert sum(fuzz["per_case"].values()) == FUZZ_N
    assert fuzz["per_case"]["ok"] + fuzz["per_case"]["clean"] == FUZZ_N, fuzz["examples"]
    assert fuzz["per_call"]["load"]["clean"] > 0  # the mutations do reach the checks


@pytest.mark.parametrize("kind", KILL_KINDS)
def test_a_killed_save_leaves_nothing_or_a_whole_checkpoint(tmp_path, kind):
    kills = run_kills(tmp_path / "kills", KILLS, seed=7, kinds=(kind,), progress=None)
    assert [r["kind"] for r in kills["rows"]] == [kind] * KILLS
    assert all(r["ok"] for r in kills["rows"]), kills["rows"]


@pytest.mark.parametrize("death", ["exit", "kill", "stop"])
def test_survivors_of_a_dead_rank_raise(tmp_path, death):
    deaths = run_deaths(tmp_path / "deaths", progress=None, deaths=(death,), points=("middle",), victims=(1,))
    rows = deaths["rows"]
    assert rows and all(r["ok"] for r in rows), rows
    assert not any(r["left"] for r in rows), rows
