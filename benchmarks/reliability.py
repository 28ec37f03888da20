"""Reliability stress runs: a fuzzer over checkpoints, kill -9 trials, and a rank-death matrix.

    python3 benchmarks/reliability.py fuzz --n 10000 --seed 0
    nice python3 benchmarks/reliability.py kills --n 30
    python3 benchmarks/reliability.py deaths
    python3 benchmarks/reliability.py checksums              # what the checksums cost a save
    python3 benchmarks/reliability.py all --n 200 --kills 2      # a quick pass over everything

``fuzz`` (``_fuzz.py``, mutations in ``_fuzz_mutate.py``): mutated one-file, sharded and
distributed checkpoints through ``sw.load``, ``shardwise inspect``, ``sw.verify`` and
``sw.consolidate``; every call's outcome is classed as ok / clean error / other exception /
wrong values / memory / hang / crash / access outside. ``kills`` and ``deaths``
(``_trials.py``): SIGKILLs from outside during saves and consolidation, and ranks that
exit, are killed or are stopped during loads and saves.

Each run prints its table, saves ``reliability-<run>.json`` (with up to 50 examples of
anything that is not ok or a clean error, each replayable with ``--first CASE --n 1``) and
replaces its section of ``docs/reliability.md``; from a dirty tree, like every benchmark
here, the JSON goes to the ignored ``benchmarks/out/`` and the docs stay as they are.
Outside the CI time budget; ``tests/dist/test_reliability.py`` runs a small pass of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from _common import REPO, _replace_section, machine_info, markdown_table, results_dir

DOC = REPO / "docs" / "reliability.md"
_INTRO = """# Reliability

How shardwise behaves under hostile input and crashing processes, measured by
`benchmarks/reliability.py` (each run replaces its own section below; raw data in
`benchmarks/out/reliability-*.json`). What each outcome means is in the script's docstring;
the goal is that every row reads "ok" or "clean", and every trial and death passes.
"""


def _fuzz_table(result: dict) -> str:
    from _fuzz import OUTCOMES

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


def _publish(name: str, title: str, notes: str, table: str, result: dict) -> None:
    info = machine_info()
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": info, "title": title, "notes": notes, "table": table, **result}
    (out / f"reliability-{name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(table)
    if info["commit"].endswith("-dirty") or not info["commit"]:
        print(f"[reliability {name}] the work tree is dirty: {DOC.name} not updated, JSON in {out}/",
              file=sys.stderr)
        return
    write_section(payload)


def write_section(payload: dict) -> None:
    """Replace the run's section of docs/reliability.md with ``payload`` (a saved JSON)."""
    info = payload["machine"]
    machine = (f"{info['date']}; {info['cores']} cores ({info['cpu']}); torch {info['torch']}; "
               f"commit {info['commit'] or '?'}")
    title = payload["title"]
    section = f"## {title}\n\n{payload['notes'].strip()}\n\n{payload['table']}\n\n_{machine}._\n\n"
    text = DOC.read_text() if DOC.is_file() else _INTRO
    DOC.write_text(_replace_section(text, title, section).rstrip("\n") + "\n")


def _fuzz(args, work: Path) -> None:
    from _fuzz import run_fuzz

    result = run_fuzz(work / "fuzz", args.n, args.seed, first=args.first)
    notes = (f"{result['n']} cases (seed {result['seed']}, cases {result['first']}.."
             f"{result['first'] + result['n'] - 1}), {result['seconds']:.0f} s. Each case is one "
             "mutation of a one-file, sharded or distributed checkpoint; the load, inspect and "
             "verify calls run on every case, consolidate on the distributed ones. Command: "
             f"`python3 benchmarks/reliability.py fuzz --n {result['n']} --seed {result['seed']}`.")
    _publish("fuzz", "Fuzzer", notes, _fuzz_table(result), result)


def _kills(args, work: Path) -> None:
    from _trials import run_kills

    result = run_kills(work / "kills", args.kills, args.seed)
    notes = (f"{args.kills} SIGKILLs per kind at a random moment of the run (rank 0, rank 1 and "
             "both in turn; the one process of a consolidation), 2 gloo ranks at tp=2, a ~40 MB "
             "model. A trial passes when the target is absent, the previous checkpoint byte for "
             "byte, or the new one whole (verify ok, diff identical to a reference); a surviving "
             "rank 0 left nothing beside it and every survivor ended with a ShardwiseError or "
             "finished; and the next undisturbed run removed whatever a killed rank 0 left and "
             f"succeeded. Command: `nice python3 benchmarks/reliability.py kills --kills {args.kills}`.")
    _publish("kills", "Kill -9 trials", notes, _kills_table(result), result)


def _deaths(args, work: Path) -> None:
    from _trials import TIMEOUT, run_deaths

    result = run_deaths(work / "deaths")
    notes = (f"One of 2 gloo ranks ends on purpose (os._exit, SIGKILL, SIGSTOP) early in the call "
             f"or in its middle (while data moves); the collectives' timeout is {TIMEOUT:.0f} s. A "
             f"cell passes when the survivor raises a ShardwiseError (or finishes: a safetensors "
             f"load has no collective) within {2 * TIMEOUT:.0f} s and no save leaves a target; a "
             "hidden folder is left only by a dead rank 0 (the next save removes it). Command: "
             "`python3 benchmarks/reliability.py deaths`.")
    _publish("deaths", "Rank deaths", notes, _deaths_table(result), result)


def _checksums(args, work: Path) -> None:
    from _checksum_cost import run_checksum_cost

    result = run_checksum_cost(work / "checksums", rounds=args.rounds)
    cols = [("save", "save"), ("gb", "GB", ".2f"), ("without_s", "median s without", ".2f"),
            ("with_s", "median s with", ".2f"), ("cost_pct", "median cost %", ".1f"),
            ("best_without_s", "best s without", ".2f"), ("best_with_s", "best s with", ".2f"),
            ("best_cost_pct", "best cost %", ".1f")]
    notes = (f"The cost of recording a checksum (XXH3-64) per tensor (per chunk for DCP) as the bytes are "
             f"written: the same {result['bytes'] / 1e9:.2f} GB model saved by one process and by 2 "
             "gloo ranks at tp=2, with checksums and with them switched off, median of the slowest "
             "rank over "
             f"{result['rounds']} interleaved rounds (fsync included, dirty pages flushed before "
             "each save). Command: `python3 benchmarks/reliability.py checksums`.")
    _publish("checksums", "Checksum cost", notes, markdown_table(result["rows"], cols), result)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["fuzz", "kills", "deaths", "checksums", "all", "_worker"])
    parser.add_argument("--n", type=int, default=10_000, help="fuzz cases")
    parser.add_argument("--first", type=int, default=0, help="first fuzz case (replay one with --n 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kills", type=int, default=50, help="kill trials per kind")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the checksum cost")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.what == "_worker":
        from _fuzz import worker_main

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
        if args.what in ("checksums", "all"):
            _checksums(args, work)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
