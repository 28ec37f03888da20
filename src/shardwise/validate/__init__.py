"""The hardware validation suite: the same scenarios on every backend, at every layout the world
allows, on the toy model, against the one-process CPU run; each is PASS, FAIL or UNSUPPORTED.
The report renders as a terminal table, JSON and markdown. ``shardwise validate --backend NAME``
or ``python -m shardwise.validate`` under the backend's launcher (docs/validate.md).

>>> report = sw.validate("gloo", json="gloo.json")   # doctest: +SKIP"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

import torch

from shardwise.backends import init_backend
from shardwise.errors import BackendError, UsageError
from shardwise.testing import RankFailure, spawn
from shardwise.validate.checks import FAIL, PASS, UNSUPPORTED
from shardwise.validate.report import (
    JOB,
    STATUSES,
    Report,
    Result,
    load_runs,
    markdown,
    replace_generated,
    run_header,
    runs_table,
    table,
)
from shardwise.validate.runner import Runner, selected


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="auto",
                        help="gloo, nccl, xla, xla_spmd, neuron, ... or auto (default)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the report as JSON (rank 0)")
    parser.add_argument("--markdown", default=None, metavar="OUT",
                        help="write the report as markdown (rank 0)")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="start N local ranks here instead of under a launcher (gloo on one host)")
    parser.add_argument("--workdir", default=None, metavar="DIR",
                        help="where checkpoints are written; every rank must see it (shared storage "
                             "across hosts). Default: a temporary folder, removed at the end")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="the backend's collective timeout (default 300)")
    parser.add_argument("--only", action="append", default=None, metavar="SCENARIO",
                        help="run only this scenario (repeatable) and the scenarios it builds on; "
                             "the report says it is partial")
    parser.add_argument("--report", nargs="+", default=None, metavar="JSON",
                        help="run nothing: print the markdown of these reports (for the docs)")
    parser.add_argument("--into", default=None, metavar="FILE",
                        help="with --report: write the markdown into FILE, between its "
                             "'<!-- generated: ... -->' and '<!-- end generated -->' lines")
    parser.add_argument("--summary", action="store_true",
                        help="with --report: one table, a row per run (backend, world, commit, date, "
                             "counts), as docs/backends.md shows it")


def _rank(args: argparse.Namespace) -> int:
    try:
        report = validate(args.backend, json=args.json, markdown=args.markdown, workdir=args.workdir,
                          keep=args.keep, timeout=args.timeout, only=args.only)
    except (BackendError, UsageError) as e:  # nothing ran (the backend did not start): no report
        print(f"shardwise validate: {e}", file=sys.stderr)
        return 1
    return 0 if report.ok else 1


def _report(paths: list[str], into: str | None, summary: bool) -> int:
    try:
        text = (runs_table if summary else markdown)(load_runs(paths))
    except UsageError as e:
        print(f"shardwise validate: {e}", file=sys.stderr)
        return 2
    if into is None:
        sys.stdout.write(text)
        return 0
    page = Path(into)
    try:
        page.write_text(replace_generated(page.read_text(), text))
    except (OSError, ValueError) as e:
        print(f"shardwise validate: {into}: {e}", file=sys.stderr)
        return 2
    print(f"wrote the tables of {len(paths)} run(s) into {into}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 when every scenario is PASS or UNSUPPORTED, 1 otherwise."""
    if args.report:
        return _report(args.report, args.into, args.summary)
    if args.into or args.summary:
        print("shardwise validate: --into and --summary go with --report JSON ...", file=sys.stderr)
        return 2
    if args.nproc is None:
        return _rank(args)
    if "RANK" in os.environ:
        print("shardwise validate: --nproc starts its own ranks; under a launcher leave it out",
              file=sys.stderr)
        return 2
    try:
        codes = spawn(_rank, args.nproc, args=(args,), timeout=3600)
    except RankFailure as e:
        print(f"shardwise validate: {e}", file=sys.stderr)
        return 1
    return max(codes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.validate",
                                     description="the hardware validation suite (see docs/validate.md)")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def validate(backend: str = "auto", *, json=None, markdown=None, workdir=None, keep: bool = False,
             timeout: float | None = 300.0, print_table: bool = True, only=None) -> Report:
    """Run the hardware validation suite on every rank of the job (under the backend's launcher)
    and return the report, the same on every rank; rank 0 prints the table and writes ``json`` /
    ``markdown``. ``workdir``: a folder every rank sees (default: rank 0's temporary folder,
    removed unless ``keep``). ``only``: those scenarios and the ones they build on.

    >>> report = sw.validate("gloo", json="gloo.json")   # doctest: +SKIP
    >>> report.ok                                          # doctest: +SKIP
    True
    """
    torch.manual_seed(0)
    only = selected(only)  # an unknown name fails before the backend starts
    started = init_backend(backend, timeout=timeout)
    return Runner(started, json_path=json, markdown_path=markdown, workdir=workdir, keep=keep,
                  print_table=print_table, only=only).run()


class _CallableModule(types.ModuleType):
    """Once a ``shardwise.validate.*`` module is imported, ``sw.validate`` is this package, so the
    package must be callable as the suite."""

    def __call__(self, *args, **kwargs):
        return validate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


__all__ = ["FAIL", "JOB", "PASS", "Report", "Result", "STATUSES", "UNSUPPORTED", "add_arguments",
           "load_runs", "main", "markdown", "replace_generated", "run", "run_header", "runs_table",
           "table", "validate"]
