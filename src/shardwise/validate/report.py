"""What a validation run found: one :class:`Result` per scenario and layout, the run's
header (backend, world, versions, commit, date), and its renderings: the terminal table,
JSON and markdown (docs tables are generated from the JSON, never written by hand)."""

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
    """One scenario at one layout (``layout`` None: once for the whole job). ``reason`` is
    the first line of what failed, or why the backend cannot run it; never empty unless PASS."""

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


def _git(*args: str) -> subprocess.CompletedProcess | None:
    here = Path(__file__).resolve().parent
    try:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None


def commit_of_checkout() -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the shardwise source in use (an editable install's checkout), or
    ``(None, None)`` outside one. ``dirty``: files differ from that commit."""
    out = _git("rev-parse", "HEAD")
    sha = out.stdout.strip() if out is not None and out.returncode == 0 else ""
    if len(sha) != 40:
        return None, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return sha, (bool(status.stdout.strip()) if status is not None and status.returncode == 0 else None)


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


def _cell(status: str) -> str:
    return {UNSUPPORTED: "UNSUP"}.get(status, status)


def _grid(run: dict) -> tuple[list[str], list[str], dict]:
    columns = list(run["layouts"])
    if any(r["layout"] is None for r in run["results"]):
        columns.append(JOB)
    rows, cells = [], {}
    for r in run["results"]:
        if r["scenario"] not in rows:
            rows.append(r["scenario"])
        cells[(r["scenario"], r["layout"] or JOB)] = r["status"]
    return rows, columns, cells


def _notes(run: dict) -> list[str]:
    return [f"{r['scenario']} @ {r['layout'] or JOB}: {r['status']}: {r['reason']}"
            for r in run["results"] if r["status"] != PASS]


def _title(run: dict) -> str:
    commit = (run.get("commit") or "unknown")[:10] + (" (modified)" if run.get("dirty") else "")
    return (f"backend {run['backend']}, world {run['world_size']} ({run['device']}, {run['holding']} "
            f"holding), torch {run['torch']}, shardwise {run['shardwise']}, commit {commit}, {run['date']}")


def _verdict(run: dict) -> str:
    s = run["summary"]
    tail = f"; stopped: {run['stopped']}" if run.get("stopped") else ""
    tail += "" if run.get("complete") else "; incomplete"
    tail += f"; partial: only {', '.join(run['only'])}" if run.get("only") else ""
    return (f"{'OK' if run['ok'] else 'FAILED'}: {s[PASS]} PASS, {s[FAIL]} FAIL, {s[UNSUPPORTED]} "
            f"UNSUPPORTED in {run['seconds']} s{tail}")


def table(run: dict) -> str:
    """The terminal table of one run (a ``Report.to_dict()``): scenarios x layouts."""
    rows, columns, cells = _grid(run)
    width = max([len("scenario"), *map(len, rows)])
    widths = {c: max(len(c), 5) for c in columns}

    def line(first: str, values: list[str]) -> str:
        return "  ".join([f"{first:<{width}}", *(f"{v:<{widths[c]}}" for c, v in zip(columns, values,
                                                                                       strict=True))]).rstrip()

    lines = [f"shardwise validate: {_title(run)}", line("scenario", columns)]
    lines += [line(row, [_cell(cells.get((row, c), "-")) for c in columns]) for row in rows]
    notes = _notes(run)
    if notes:
        lines += ["", *notes]
    lines += ["", _verdict(run)]
    return "\n".join(lines)


def markdown(runs: list[dict]) -> str:
    """Markdown of one or more runs (``Report.to_dict()``, or their JSON files loaded): per
    run its header, the table and every FAIL / UNSUPPORTED with its reason."""
    out = []
    for run in runs:
        rows, columns, cells = _grid(run)
        out += [f"### {run['backend']}, world {run['world_size']}", "", f"{_title(run)}.", "",
                "| scenario | " + " | ".join(f"`{c}`" for c in columns) + " |",
                "|---|" + "---|" * len(columns)]
        for row in rows:
            out.append(f"| {row} | " + " | ".join(cells.get((row, c), "-") for c in columns) + " |")
        out += ["", *(f"- {n}" for n in _notes(run)), *_bytes_read(run), "", f"{_verdict(run)}.", ""]
    return "\n".join(out).rstrip() + "\n"


def runs_table(runs: list[dict]) -> str:
    """One markdown table row per run (``Report.to_dict()``, or their JSON files loaded): the
    backend, its world (devices under SPMD, ranks otherwise), the commit and date it ran at, and
    its PASS / FAIL / UNSUPPORTED counts. The docs show whole runs only: a partial one (``--only``)
    is refused."""
    partial = [f"{run['backend']}, world {run['world_size']}" for run in runs if run.get("only")]
    if partial:
        raise UsageError(f"run {partial[0]} ran only some scenarios (--only); the docs show whole runs")
    out = ["| backend | world | processes | device (holding) | torch | commit | date | PASS | FAIL "
           "| UNSUPPORTED | result |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s = run["summary"]
        commit = (run.get("commit") or "unknown")[:10] + (" (modified)" if run.get("dirty") else "")
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
    """``text`` (a markdown page) with the lines between its ``<!-- generated: ... -->`` line
    and ``<!-- end generated -->`` replaced by ``generated``."""
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


__all__ = ["FAIL", "JOB", "PASS", "Report", "Result", "STATUSES", "UNSUPPORTED", "load_runs", "markdown",
           "replace_generated", "run_header", "runs_table", "table"]
