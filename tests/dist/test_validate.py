"""``shardwise validate`` on spawned gloo ranks at world 1, 2 and 4: every scenario at every
layout is PASS or UNSUPPORTED with a reason (except the known shardwise bugs listed below,
which must still fail: fixing one flips this test, and its entry goes), the report has the
structure the docs and CI read, and a world that lies fails the world check and stops."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pytest

import shardwise as sw
from harness import run_ranks
from shardwise.validate import (
    FAIL,
    PASS,
    STATUSES,
    UNSUPPORTED,
    load_runs,
    markdown,
    replace_generated,
)
from shardwise.validate.scenarios import SCENARIOS, layouts_for

JOB_SCENARIOS = ("world", "crossload", "collective_timeout")
# Known shardwise bugs the suite finds, by world: {(scenario, layout): the bug}. None now; the
# last ones (forward_backward, clip_grad_norm, optimizer_reshard at dp_shard2_tp2, and
# optimizer_reshard at tp4, which reshards to it) were q_norm / k_norm losing their gradient
# all-reduce under fully_shard (tests/dist/test_fsdp_tp_grads.py).
KNOWN_FAILURES: dict[int, dict[tuple[str, str], str]] = {}


def _suite(json_path: str):
    report = sw.validate("gloo", json=json_path, timeout=60)
    return report.to_dict()


def _expected_cells(world: int) -> set[tuple[str, str | None]]:
    cells = {(name, None) for name in JOB_SCENARIOS}
    for layout in layouts_for(world):
        cells |= {(sc.name, layout.name) for sc in SCENARIOS if sc.applies(layout)}
    return cells


@pytest.mark.slow
# eight ranks on two cores is the suite's longest run: tox -e stress runs it (marker long), tox -e gloo
# leaves it out so that the contributors' suite stays short
@pytest.mark.parametrize("world", [1, 2, 4, pytest.param(8, marks=pytest.mark.long)])
def test_every_scenario_passes_or_says_why_not(tmp_path, world):
    path = tmp_path / f"gloo-{world}.json"
    reports = run_ranks(_suite, world, str(path), timeout=180 + 30 * world)  # 8 ranks share 2 cores
    run = reports[0]
    assert json.loads(path.read_text()) == json.loads(json.dumps(run, default=str))  # rank 0 wrote it
    for other in reports[1:]:  # one agreed verdict per scenario
        assert [r["status"] for r in other["results"]] == [r["status"] for r in run["results"]]

    assert run["backend"] == "gloo" and run["world_size"] == run["processes"] == world
    assert run["holding"] == "dtensor" and run["device"] == "cpu" and run["schema"] == 1
    assert run["torch"] and run["shardwise"] == sw.__version__
    assert run["commit"] is None or len(run["commit"]) == 40
    assert run["dirty"] in (None, True, False)
    assert dt.datetime.fromisoformat(run["date"]).tzinfo is not None
    assert run["complete"] and run["stopped"] is None
    assert run["layouts"] == [lay.name for lay in layouts_for(world)]
    cells = {(r["scenario"], r["layout"]) for r in run["results"]}
    assert cells == _expected_cells(world) and len(cells) == len(run["results"])
    assert run["summary"] == {s: sum(r["status"] == s for r in run["results"]) for s in STATUSES}

    failed = {}
    for r in run["results"]:
        assert r["status"] in STATUSES
        assert r["status"] == PASS or r["reason"], r
        assert len(r["details"]["per_rank"]) == world
        if r["status"] == FAIL:
            failed[(r["scenario"], r["layout"])] = r["reason"]
    known = KNOWN_FAILURES.get(world, {})
    fixed = sorted(set(known) - set(failed))
    assert not fixed, f"known failures that pass now (remove them from KNOWN_FAILURES): {fixed}"
    new = {cell: reason for cell, reason in failed.items() if cell not in known}
    assert not new, f"scenarios that fail: {new}"
    assert run["ok"] is (not failed)

    timeout = next(r for r in run["results"] if r["scenario"] == "collective_timeout")
    if world == 1:
        assert timeout["status"] == UNSUPPORTED and "one process" in timeout["reason"]
    else:  # the timeout fired on every rank but the late one
        outcomes = [d["outcome"] for d in timeout["details"]["per_rank"][:-1]]
        assert all(o.startswith("CollectiveError") for o in outcomes), outcomes
    if world > 1:
        replicas = [r for r in run["results"] if r["scenario"] == "replicas_read_once"]
        assert replicas and all(r["status"] == PASS for r in replicas)
        table = markdown([run])
        assert f"| scenario | {' | '.join(f'`{c}`' for c in [*run['layouts'], 'job'])} |" in table


def _lying_world(folder: str):
    """Each spawned rank joins a world of one of its own (what torch_xla on PJRT CPU does under
    torchrun) while the launcher says WORLD_SIZE=2."""
    import torch.distributed as dist

    from shardwise.validate import main

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    path = f"{folder}/rank{os.environ['RANK']}.json"
    code = main(["--backend", "gloo", "--json", path, "--timeout", "60"])
    return code, json.loads(open(path).read())


def test_a_world_of_one_per_process_fails_the_world_check(tmp_path):
    for code, run in run_ranks(_lying_world, 2, str(tmp_path), timeout=120):
        assert code == 1 and run["ok"] is False
        assert [(r["scenario"], r["status"]) for r in run["results"]] == [("world", FAIL)]
        reason = run["results"][0]["reason"]
        assert "WORLD_SIZE=2" in reason and "world of 1" in reason, reason
        assert run["stopped"].startswith("the world is not what the launcher says"), run["stopped"]


def _injected(folder: str):
    """Two short runs (first layout only, no job scenarios): a scenario that raises on rank 1
    only, then a rank that skips a scenario, leaving its peer in the save's collective."""
    from dataclasses import replace

    import shardwise.validate.runner as runner
    from shardwise.validate.scenarios import SCENARIOS, gather_save

    rank = int(os.environ["RANK"])

    def fails(job, run):
        gather_save(job, run)
        raise RuntimeError("injected on one rank\nsecond line")

    def skips(job, run):
        return {}

    runner.layouts_for = lambda world: layouts_for(world)[:1]
    runner.JOB_SCENARIOS = ()
    out = []
    for name, fn in (("gather_save", fails), ("dcp_reshard", skips)):
        runner.SCENARIOS = tuple(replace(sc, fn=fn) if sc.name == name and rank == 1 else sc
                                 for sc in SCENARIOS)
        out.append(sw.validate("gloo", timeout=10, print_table=False).to_dict())
    return out


def test_a_failing_scenario_is_reported_and_a_broken_collective_stops(tmp_path):
    failed, stopped = run_ranks(_injected, 2, str(tmp_path), timeout=180)[0]
    statuses = {r["scenario"]: (r["status"], r["reason"]) for r in failed["results"]}
    assert statuses["gather_save"] == (FAIL, "rank 1: RuntimeError: injected on one rank")
    assert statuses["dcp_reshard"][0] == statuses["optimizer_reshard"][0] == PASS  # it went on
    assert failed["complete"] and not failed["ok"] and failed["stopped"] is None

    # rank 0 waited in sw.save for rank 1, which had gone on: its CollectiveError stops the suite
    assert [r["scenario"] for r in stopped["results"]][-1] == "dcp_reshard"  # nothing ran after it
    assert stopped["results"][-1]["reason"].startswith("rank 0: CollectiveError: sw.save is collective")
    assert not stopped["complete"] and stopped["stopped"].startswith("dcp_reshard at tp2")


def test_report_renders_markdown_from_json(tmp_path, capsys):
    from shardwise.validate import main

    run = {"schema": 1, "backend": "gloo", "world_size": 2, "processes": 2, "device": "cpu",
           "holding": "dtensor", "torch": "2.x", "shardwise": "0", "commit": None, "date": "2026-01-01",
           "layouts": ["tp2"], "ok": False, "complete": True, "stopped": None, "seconds": 1.0,
           "summary": {PASS: 1, FAIL: 1, UNSUPPORTED: 1},
           "results": [{"scenario": "world", "layout": None, "status": PASS, "reason": ""},
                       {"scenario": "load", "layout": "tp2", "status": FAIL, "reason": "Mismatch: x"},
                       {"scenario": "collective_timeout", "layout": None, "status": UNSUPPORTED,
                        "reason": "no late peer"}]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert main(["--report", str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr().out
    assert "| scenario | `tp2` | `job` |" in out
    assert "| load | FAIL | - |" in out and "| world | - | PASS |" in out
    assert "- load @ tp2: FAIL: Mismatch: x" in out
    assert "FAILED: 1 PASS, 1 FAIL, 1 UNSUPPORTED" in out


def test_the_docs_tables_are_generated_from_the_runs():
    docs = Path(__file__).resolve().parents[2] / "docs"
    runs = sorted((docs / "validate").glob("*.json"))
    page = (docs / "validate.md").read_text()
    assert runs, "docs/validate/ holds the JSON of the runs the page shows"
    assert replace_generated(page, markdown(load_runs(runs))) == page, (
        "docs/validate.md's tables differ from its runs' JSON; regenerate them with "
        "`shardwise validate --report docs/validate/*.json --into docs/validate.md`")


def test_only_runs_the_named_scenarios_and_what_they_build_on():
    from shardwise.validate.runner import selected

    assert selected(None) is None
    assert selected(["optimizer_reshard"]) == {"load", "forward_backward", "clip_grad_norm",
                                               "optimizer_reshard"}
    assert selected(["gather_save", "crossload"]) == {"load", "gather_save", "crossload"}
    with pytest.raises(sw.UsageError, match="no scenario 'optimizer'.*optimizer_reshard"):
        selected(["optimizer"])
