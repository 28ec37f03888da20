"""docs/backends.md's "what has run where" table is generated from the runs' JSON in
docs/validate/ (``shardwise validate --report ... --summary --into docs/backends.md``): the
table in the file must equal what the generator makes, so a hand edit fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.errors import UsageError
from shardwise.validate import load_runs, replace_generated, runs_table

DOCS = Path(__file__).resolve().parents[2] / "docs"
REGENERATE = "shardwise validate --report docs/validate/*.json --summary --into docs/backends.md"


def _runs():
    paths = sorted((DOCS / "validate").glob("*.json"))
    assert paths, "docs/validate/ holds the JSON of the runs"
    return load_runs(paths)


def test_backends_table_is_generated_from_the_runs():
    page = (DOCS / "backends.md").read_text()
    assert replace_generated(page, runs_table(_runs())) == page, (
        f"docs/backends.md's table differs from the runs' JSON; regenerate it with `{REGENERATE}`")


def test_a_hand_edit_of_the_table_is_caught():
    page = (DOCS / "backends.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `xla_spmd` | 4 |"))
    edited = page.replace(row, row.replace("(spmd)", "(dtensor)"), 1)
    assert edited != page
    assert replace_generated(edited, runs_table(_runs())) != edited


def test_every_run_is_a_row_with_its_counts():
    runs = _runs()
    lines = runs_table(runs).splitlines()
    assert len(lines) == 2 + len(runs)
    for run, line in zip(runs, lines[2:], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == f"`{run['backend']}`" and cells[1] == str(run["world_size"])
        assert cells[5].startswith(f"`{(run['commit'] or 'unknown')[:10]}")
        assert cells[6] == run["date"][:10]
        assert cells[7:10] == [str(run["summary"][s]) for s in ("PASS", "FAIL", "UNSUPPORTED")]
    names = {(r["backend"], r["world_size"]) for r in runs}
    assert {("xla_spmd", 4), ("xla_spmd", 8)} <= names, "the xla_spmd runs at 4 and 8 devices are in the docs"


def test_a_partial_run_is_refused(tmp_path):
    run = dict(_runs()[0], only=["load"])
    with pytest.raises(UsageError, match="--only"):
        runs_table([run])
    (tmp_path / "partial.json").write_text(json.dumps(run))
    from shardwise.validate import main

    assert main(["--report", str(tmp_path / "partial.json"), "--summary"]) == 2
