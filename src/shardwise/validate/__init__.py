"""The hardware validation suite: the same scenarios, with the same assertions, on every backend.

Under the backend's launcher it checks the world, then at every layout the world allows (tp;
dp_shard x tp; dp_replicate x tp; ep x tp) runs on the toy model of ``shardwise.testing.model``:
a byte-exact load, forward and backward against the one-process CPU run, ``clip_grad_norm_``, a
gather save byte-equal to the source, a distributed save resharded, consolidated and verified,
replicas reading once, an optimizer step saved and resumed at another layout; then, once for the
job, a cross-load with a CPU/gloo process and a collective timeout. Each scenario is PASS, FAIL
(the error's first line) or UNSUPPORTED (the reason); rank 0 prints a table and writes JSON.

>>> report = sw.validate("gloo", json="gloo.json")   # doctest: +SKIP

Command line: ``shardwise validate --backend NAME [--json OUT]``, or ``python -m
shardwise.validate ...`` under the launcher (``torchrun --nproc-per-node 8 -m shardwise.validate
--backend nccl --json nccl.json``); ``--nproc N`` starts N local ranks itself. docs/validate.md
has the command of every backend.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.errors import BackendError, UsageError

if TYPE_CHECKING:
    from shardwise.validate.runner import validate as validate


def __getattr__(name: str):
    if name == "validate":
        # deferred: importing the runner here would import validate.job before
        # `python -m shardwise.validate.job` runs it as __main__ (runpy warns)
        from shardwise.validate.runner import validate

        return validate
    raise AttributeError(f"module 'shardwise.validate' has no attribute {name!r}")


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
    from shardwise.validate.runner import validate

    try:
        report = validate(args.backend, json=args.json, markdown=args.markdown, workdir=args.workdir,
                          keep=args.keep, timeout=args.timeout, only=args.only)
    except (BackendError, UsageError) as e:  # nothing ran (the backend did not start): no report
        print(f"shardwise validate: {e}", file=sys.stderr)
        return 1
    return 0 if report.ok else 1


def _report(paths: list[str], into: str | None, summary: bool) -> int:
    from shardwise.validate.report import load_runs, markdown, replace_generated, runs_table

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
    from shardwise.launch import RankFailure, spawn

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


class _CallableModule(types.ModuleType):
    """``sw.validate(...)`` is the suite: once any ``shardwise.validate.*`` module is imported,
    Python binds the name ``validate`` on the ``shardwise`` package to this package, so the
    package itself must be the function's twin."""

    def __call__(self, *args, **kwargs):
        return __getattr__("validate")(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["add_arguments", "main", "run", "validate"]
