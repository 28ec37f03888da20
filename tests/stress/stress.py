"""Reliability stress runs: a fuzzer over checkpoints, kill -9 trials, and a rank-death matrix.

    python3 tests/stress/stress.py fuzz --n 10000 --seed 0
    nice python3 tests/stress/stress.py kills --n 30
    python3 tests/stress/stress.py deaths
    python3 tests/stress/stress.py all --n 200 --kills 2  # a quick pass over everything

``fuzz`` (``fuzzer.py``, mutations in ``fuzz_mutate.py``): mutated one-file, sharded and
distributed checkpoints through ``sw.load``, ``shardwise inspect``, ``sw.verify`` and
``sw.consolidate``; every call's outcome is classed as ok / clean error / other exception /
wrong values / memory / hang / crash / access outside. ``kills`` and ``deaths``
(``crash_trials.py``): SIGKILLs from outside during saves and consolidation, and ranks that
exit, are killed or are stopped during loads and saves.

Each run prints its table, saves ``reliability-<run>.json`` (with up to 50 examples of
anything that is not ok or a clean error, each replayable with ``--first CASE --n 1``) and
replaces its section of ``docs/reliability.md``; from a dirty tree, like every benchmark,
the JSON goes to the ignored ``benchmarks/out/`` and the docs stay as they are. The pytest
suite beside this script (``tox -e stress``, ``test_stress.py``) runs a small pass of each in
CI; ``SHARDWISE_STRESS_N`` makes its fuzz pass longer. What a checksum costs a save, a speed
figure, is ``benchmarks/checksums.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # _common: the docs writer

from _common import markdown_table, publish_reliability  # noqa: E402


def _fuzz_table(result: dict) -> str:
    from fuzzer import OUTCOMES

    rows = [{"call": op, **counts} for op, counts in result["per_call"].items() if any(counts.values())]
    rows.append({"call": "per case (worst)", **result["per_case"]})
    return markdown_table(rows, [("call", "call")] + [(o, o) for o in OUTCOMES])


def _kills_table(result: dict) -> str:
    rows = []
    for kind in dict.fromkeys(r["kind"] for r in result["rows"]):
        mine = [r for r in result["rows"] if r["kind"] == kind]
        states: dict[str, int] = {}
        for r in mine:
            states[r["state"].split(" ")[0]] = states.get(r["state"].split(" ")[0], 0) + 1
        rows.append({
            "kind": kind, "trials": len(mine), "passed": sum(r["ok"] for r in mine),
            "target after the kill": ", ".join(f"{k} {v}" for k, v in sorted(states.items())),
            "left by a killed rank 0": sum(bool(r["left_after_kill"]) for r in mine),
            "left after the next run": sum(bool(r["left_after_next"]) for r in mine),
        })
    return markdown_table(rows, [(k, k) for k in rows[0]] if rows else [("kind", "kind")])


def _deaths_table(result: dict) -> str:
    rows = [{**r, "left": len(r["left"]), "ok": "yes" if r["ok"] else "NO"} for r in result["rows"]]
    cols = [("op", "operation"), ("death", "death"), ("point", "when"), ("victim", "victim rank"),
            ("survivor", "survivor ended with"), ("seconds", "survivor seconds", ".2f"),
            ("left", "hidden folders left"), ("ok", "passed")]
    return markdown_table(rows, cols)


def _fuzz(args, work: Path) -> None:
    from fuzzer import run_fuzz

    result = run_fuzz(work / "fuzz", args.n, args.seed, first=args.first)
    notes = (f"{result['n']} cases (seed {result['seed']}, cases {result['first']}.."
             f"{result['first'] + result['n'] - 1}), {result['seconds']:.0f} s. Each case is one "
             "mutation of a one-file, sharded or distributed checkpoint; the load, inspect and "
             "verify calls run on every case, consolidate on the distributed ones. Command: "
             f"`python3 tests/stress/stress.py fuzz --n {result['n']} --seed {result['seed']}`.")
    publish_reliability("fuzz", "Fuzzer", notes, _fuzz_table(result), result)


def _kills(args, work: Path) -> None:
    from crash_trials import run_kills

    result = run_kills(work / "kills", args.kills, args.seed)
    notes = (f"{args.kills} SIGKILLs per kind at a random moment of the run (rank 0, rank 1 and "
             "both in turn; the one process of a consolidation), 2 gloo ranks at tp=2, a ~40 MB "
             "model. A trial passes when the target is absent, the previous checkpoint byte for "
             "byte, or the new one whole (verify ok, diff identical to a reference); a surviving "
             "rank 0 left nothing beside it and every survivor ended with a ShardwiseError or "
             "finished; and the next undisturbed run removed whatever a killed rank 0 left and "
             f"succeeded. Command: `nice python3 tests/stress/stress.py kills --kills {args.kills}`.")
    publish_reliability("kills", "Kill -9 trials", notes, _kills_table(result), result)


def _deaths(args, work: Path) -> None:
    from crash_trials import TIMEOUT, run_deaths

    result = run_deaths(work / "deaths")
    notes = (f"One of 2 gloo ranks ends on purpose (os._exit, SIGKILL, SIGSTOP) early in the call "
             f"or in its middle (while data moves); the collectives' timeout is {TIMEOUT:.0f} s. A "
             f"cell passes when the survivor raises a ShardwiseError (or finishes: a safetensors "
             f"load has no collective) within {2 * TIMEOUT:.0f} s and no save leaves a target; a "
             "hidden folder is left only by a dead rank 0 (the next save removes it). Command: "
             "`python3 tests/stress/stress.py deaths`.")
    publish_reliability("deaths", "Rank deaths", notes, _deaths_table(result), result)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["fuzz", "kills", "deaths", "all", "_worker"])
    parser.add_argument("--n", type=int, default=10_000, help="fuzz cases")
    parser.add_argument("--first", type=int, default=0, help="first fuzz case (replay one with --n 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kills", type=int, default=50, help="kill trials per kind")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.what == "_worker":
        from fuzzer import worker_main

        worker_main(Path(args.work), args.seed)
        return 0
    with tempfile.TemporaryDirectory(prefix="shardwise-reliability-", dir=args.work) as tmp:
        work = Path(tmp)
        if args.what in ("fuzz", "all"):
            _fuzz(args, work)
        if args.what in ("kills", "all"):
            _kills(args, work)
        if args.what in ("deaths", "all"):
            _deaths(args, work)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
