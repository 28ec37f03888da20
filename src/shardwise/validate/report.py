"""The validation suite's report: each scenario's :class:`Result` at each layout, the run's
header, and its JSON and markdown tables (``docs/validate/``)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from shardwise._version import __version__
from shardwise.errors import UsageError
from shardwise.testing.model import CONFIG
from shardwise.validate.checks import FAIL, PASS, UNSUPPORTED

STATUSES = (PASS, FAIL, UNSUPPORTED)
JOB = "job"  # the column of scenarios that run once for the whole job
SCHEMA = 1


@dataclass
class Result:
    """One scenario at one layout (None: once for the job); ``reason`` is empty only for PASS."""

    scenario: str
    layout: str | None
    status: str
    reason: str = ""
    seconds: float = 0.0
    mesh: dict[str, int] | None = None
    details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status
        assert self.status == PASS or self.reason, f"{self.scenario}: {self.status} needs a reason"


def commit_of_checkout() -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the shardwise checkout in use, or ``(None, None)`` outside one."""
    here = Path(__file__).resolve().parent
    # one call: "# branch.oid SHA" (or "(initial)"), then a line per modified tracked file
    cmd = ["git", "-C", str(here), "status", "--porcelain=v2", "--branch", "--untracked-files=no"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None, None
    lines = out.stdout.splitlines() if out.returncode == 0 else []
    sha = next((line.split()[2] for line in lines if line.startswith("# branch.oid ")), "")
    if len(sha) != 40:
        return None, None
    return sha, any(not line.startswith("#") for line in lines)


def run_header(backend, *, world: int, processes: int) -> dict:
    commit, dirty = commit_of_checkout()
    if os.environ.get("SHARDWISE_COMMIT"):  # an installed wheel: CI says which commit it built
        commit, dirty = os.environ["SHARDWISE_COMMIT"], None
    return {
        "schema": SCHEMA, "suite": "shardwise validate", "backend": backend.name, "world_size": world,
        "processes": processes, "device": str(backend.device), "holding": backend.holding.name,
        "torch": torch.__version__, "shardwise": __version__, "python": platform.python_version(),
        "commit": commit, "dirty": dirty,
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "host": platform.node(), "model": CONFIG.to_dict(),
    }


@dataclass
class Report:
    header: dict
    layouts: list[str] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    stopped: str | None = None
    complete: bool = False
    seconds: float = 0.0

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    @property
    def ok(self) -> bool:
        return self.complete and self.stopped is None and not self.counts[FAIL]

    def to_dict(self) -> dict:
        return {**self.header, "layouts": self.layouts, "ok": self.ok, "complete": self.complete,
                "stopped": self.stopped, "seconds": round(self.seconds, 1), "summary": self.counts,
                "results": [asdict(r) for r in self.results]}

    def write_json(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, default=str) + "\n")
        os.replace(tmp, path)  # a reader never sees half a file, a killed run keeps the last one


def _grid(run: dict) -> tuple[list[str], list[list[str]]]:
    """The columns (the layouts, then ``job``) and a row per scenario: its name, then its statuses."""
    columns = list(run["layouts"])
    if any(r["layout"] is None for r in run["results"]):
        columns.append(JOB)
    cells = {(r["scenario"], r["layout"] or JOB): r["status"] for r in run["results"]}
    rows = dict.fromkeys(r["scenario"] for r in run["results"])
    return columns, [[row, *(cells.get((row, c), "-") for c in columns)] for row in rows]


def _notes(run: dict) -> list[str]:
    return [f"{r['scenario']} @ {r['layout'] or JOB}: {r['status']}: {r['reason']}"
            for r in run["results"] if r["status"] != PASS]


def _commit(run: dict) -> str:
    return (run.get("commit") or "unknown")[:10] + (" (modified)" if run.get("dirty") else "")


def _title(run: dict) -> str:
    return (f"backend {run['backend']}, world {run['world_size']} ({run['device']}, {run['holding']} "
            f"holding), torch {run['torch']}, shardwise {run['shardwise']}, commit {_commit(run)}, "
            f"{run['date']}")


def _verdict(run: dict) -> str:
    s = run["summary"]
    tail = f"; stopped: {run['stopped']}" if run.get("stopped") else ""
    tail += "" if run.get("complete") else "; incomplete"
    tail += f"; partial: only {', '.join(run['only'])}" if run.get("only") else ""
    return (f"{'OK' if run['ok'] else 'FAILED'}: {s[PASS]} PASS, {s[FAIL]} FAIL, {s[UNSUPPORTED]} "
            f"UNSUPPORTED in {run['seconds']} s{tail}")


def table(run: dict) -> str:
    """The terminal table of one run (a ``Report.to_dict()``): scenarios x layouts."""
    columns, rows = _grid(run)
    widths = [max(len("scenario"), *(len(row[0]) for row in rows)), *(max(len(c), 5) for c in columns)]

    def line(values: list[str]) -> str:
        return "  ".join(f"{v:<{w}}" for v, w in zip(values, widths, strict=True)).rstrip()

    lines = [f"shardwise validate: {_title(run)}", line(["scenario", *columns])]
    lines += [line([{UNSUPPORTED: "UNSUP"}.get(v, v) for v in row]) for row in rows]
    notes = _notes(run)
    if notes:
        lines += ["", *notes]
    lines += ["", _verdict(run)]
    return "\n".join(lines)


def markdown(runs: list[dict]) -> str:
    """Markdown of runs (``Report.to_dict()``s): per run its header, table and non-PASS reasons."""
    out = []
    for run in runs:
        columns, rows = _grid(run)
        out += [f"### {run['backend']}, world {run['world_size']}", "", f"{_title(run)}.", "",
                "| scenario | " + " | ".join(f"`{c}`" for c in columns) + " |",
                "|---|" + "---|" * len(columns)]
        out += ["| " + " | ".join(row) + " |" for row in rows]
        out += ["", *(f"- {n}" for n in _notes(run)), *_bytes_read(run), "", f"{_verdict(run)}.", ""]
    return "\n".join(out).rstrip() + "\n"


def runs_table(runs: list[dict]) -> str:
    """One markdown table row per run: backend, world, commit, date and counts; a partial run
    (``--only``) raises ``UsageError``: the docs show whole runs only."""
    partial = [f"{run['backend']}, world {run['world_size']}" for run in runs if run.get("only")]
    if partial:
        raise UsageError(f"run {partial[0]} ran only some scenarios (--only); the docs show whole runs")
    out = ["| backend | world | processes | device (holding) | torch | commit | date | PASS | FAIL "
           "| UNSUPPORTED | result |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s, commit = run["summary"], _commit(run)
        result = "OK" if run["ok"] else "FAILED" if run.get("complete") else "incomplete"
        out.append(f"| `{run['backend']}` | {run['world_size']} | {run['processes']} | {run['device']} "
                   f"({run['holding']}) | {run['torch']} | `{commit}` | {run['date'][:10]} | {s[PASS]} "
                   f"| {s[FAIL]} | {s[UNSUPPORTED]} | {result} |")
    return "\n".join(out) + "\n"


def _bytes_read(run: dict) -> list[str]:
    per_layout = [(r["layout"], [d.get("bytes_read") for d in r.get("details", {}).get("per_rank", [])])
                  for r in run["results"] if r["scenario"] == "load" and r["status"] == PASS]
    if not per_layout:
        return []
    parts = "; ".join(f"`{lay}` {', '.join(f'{b:,}' for b in got)}" for lay, got in per_layout)
    return [f"- bytes read per rank by `load`: {parts}"]


GENERATED_START, GENERATED_END = "<!-- generated:", "<!-- end generated -->"


def replace_generated(text: str, generated: str) -> str:
    """``text`` with the lines between ``<!-- generated: ... -->`` and ``<!-- end generated -->``
    replaced by ``generated``."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(GENERATED_START))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(GENERATED_END))
    except StopIteration:
        raise UsageError(f"no '{GENERATED_START} ... -->' line followed by '{GENERATED_END}' to replace "
                         "between; add both lines where the tables go") from None
    return "".join([*lines[:start + 1], generated, *lines[end:]])


def load_runs(paths: Sequence[str | os.PathLike]) -> list[dict]:
    """The reports at ``paths``, by world size then backend (a shell glob sorts 16 before 2)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    return sorted(runs, key=lambda run: (run["backend"], run["world_size"]))


__all__ = ["JOB", "Report", "Result", "SCHEMA", "STATUSES", "commit_of_checkout", "load_runs", "markdown",
           "replace_generated", "run_header", "runs_table", "table"]
