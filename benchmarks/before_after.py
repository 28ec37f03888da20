"""Before and after: one workload on two commits, interleaved, in the same run.

    python3 benchmarks/before_after.py --base 709ee9f --size 512MB --degree 2 --rounds 3

A change that restructures shardwise must not slow it down. This script checks ``--base`` out
in a temporary git worktree and, round after round, runs the same workload under the base
commit's shardwise and under this checkout's, the two alternating which goes first (on a
shared machine the load drifts; interleaving spreads the drift over both). The workload, on
``--degree`` spawned gloo ranks over a bfloat16 checkpoint of about ``--size``
(``bench_model``, several files and an index, page cache warm):

- ``first load``: the first ``sw.load`` in the ranks' fresh processes, the modules it imports
  on first use included (``import shardwise`` itself is light and comes before);
- ``load``: ``sw.load`` of the safetensors checkpoint into a meta model at tp=degree, again;
- ``gather save``: ``sw.save`` of the loaded model (an ordinary safetensors checkpoint);
- ``dcp save``: ``sw.save(distributed=True)``;
- ``dcp load``: ``sw.load`` of that distributed checkpoint into a fresh meta model;
- ``consolidate``: ``sw.consolidate`` of it, one process (the other ranks wait).

Each figure is the median over rounds of the slowest rank's seconds (barrier before each
operation); the table gives both and after / before. Only shardwise's public API is called, so
any two commits compare. The JSON goes to benchmarks/results/before-after.json and the table
to docs/benchmarks.md (from a clean tree, as every benchmark here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPS = ("first load", "load", "gather save", "dcp save", "dcp load", "consolidate")


def rank_workload(ckpt: str, work: str, degree: int) -> dict[str, float]:
    """This rank's seconds per operation (a module-level function: spawned ranks import it)."""
    import torch
    from _common import bench_plan, checkpoint_model, real_plan

    import shardwise as sw

    backend = sw.init_backend("gloo")
    mesh, plan = backend.mesh(tp=degree), real_plan(bench_plan())
    seconds: dict[str, float] = {}

    def timed(op: str, fn, *, everyone: bool = True):
        backend.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        out = fn() if everyone or backend.rank == 0 else None
        seconds[op] = time.perf_counter() - start
        seconds[f"{op} cpu"] = time.process_time() - cpu
        return out

    def fresh(path):
        with torch.device("meta"):
            model = checkpoint_model(ckpt)
        sw.load(model, path, plan=plan, mesh=mesh, progress=False)
        return model

    timed("first load", lambda: fresh(ckpt))  # the modules sw.load imports on first use included
    model = timed("load", lambda: fresh(ckpt))
    timed("gather save", lambda: sw.save(model, f"{work}/gather", progress=False))
    timed("dcp save", lambda: sw.save(model, f"{work}/dcp", distributed=True))
    model = None  # its memory back before the next load
    timed("dcp load", lambda: fresh(f"{work}/dcp"))
    timed("consolidate", lambda: sw.consolidate(f"{work}/dcp", f"{work}/consolidated"), everyone=False)
    backend.barrier()
    return seconds


def _worker(args) -> int:
    """One run of the workload under the shardwise at ``--src`` (set before _common's import)."""
    os.environ["SHARDWISE_BENCH_SRC"] = args.src
    sys.path.insert(0, args.src)
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    try:
        from shardwise.testing import spawn
    except ModuleNotFoundError:  # a --base commit from before shardwise.testing: its one launcher
        from shardwise.launch import spawn  # type: ignore[no-redef]

    ranks = spawn(rank_workload, args.degree, args=(args.ckpt, args.work, args.degree), timeout=args.timeout)
    slowest = {op: max(r[op] for r in ranks) for op in [*OPS, *(f"{op} cpu" for op in OPS)]}
    Path(args.out).write_text(json.dumps(slowest))
    return 0


def _run_once(src: Path, ckpt: Path, scratch: Path, degree: int, timeout: float) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="run-", dir=scratch))
    out = work / "seconds.json"
    # PYTHONPATH too: the ranks' processes import the commit's shardwise (its launcher's module) themselves
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDWISE_BENCH_SRC": str(src),
           "PYTHONPATH": os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, __file__, "_worker", "--src", str(src), "--ckpt", str(ckpt), "--work", str(work),
           "--degree", str(degree), "--out", str(out), "--timeout", str(timeout)]
    try:
        subprocess.run(cmd, env=env, check=True, timeout=timeout + 60)
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="run", choices=["run", "_worker"])
    p.add_argument("--base", default="HEAD~1", help="the commit to compare with (default HEAD~1)")
    p.add_argument("--size", default="512MB", help="checkpoint size (bfloat16), e.g. 512MB")
    p.add_argument("--degree", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--src"), p.add_argument("--ckpt"), p.add_argument("--work"), p.add_argument("--out")
    args = p.parse_args(argv)
    if args.what == "_worker":
        return _worker(args)

    from _common import REPO, make_checkpoint, warm_file_cache, write_results

    from shardwise.testing import parse_size

    base = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.base], check=True,
                          capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="shardwise-before-after-") as tmp:
        scratch = Path(tmp)
        tree = scratch / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), base],
                       check=True)
        try:
            ckpt = make_checkpoint(scratch / "ckpt", parse_size(args.size), parse_size(args.size) // 4)
            srcs = {"before": tree / "src", "after": REPO / "src"}
            got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for r in range(args.rounds):
                for which in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    warm_file_cache(ckpt.files)
                    got[which].append(_run_once(srcs[which], ckpt.path, scratch, args.degree, args.timeout))
                    print(f"  round {r + 1}/{args.rounds} {which}: "
                          + ", ".join(f"{op} {got[which][-1][op]:.2f} s" for op in OPS), flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    rows = []
    for op in OPS:
        before = statistics.median(g[op] for g in got["before"])
        after = statistics.median(g[op] for g in got["after"])
        low_before, low_after = min(g[op] for g in got["before"]), min(g[op] for g in got["after"])
        cpu = {w: statistics.median(g.get(f"{op} cpu", float("nan")) for g in got[w]) for w in got}
        rows.append({"op": op, "before_s": before, "after_s": after, "ratio": after / before,
                     "before_min_s": low_before, "after_min_s": low_after,
                     "min_ratio": low_after / low_before, "before_cpu_s": cpu["before"],
                     "after_cpu_s": cpu["after"], "cpu_ratio": cpu["after"] / cpu["before"]})
    cols = [("op", "operation"), ("before_s", f"before ({base}) s", ".2f"), ("after_s", "after s", ".2f"),
            ("ratio", "after / before", ".2f"), ("before_min_s", "before min s", ".2f"),
            ("after_min_s", "after min s", ".2f"), ("min_ratio", "min after / before", ".2f"),
            ("before_cpu_s", "CPU s before", ".2f"), ("after_cpu_s", "CPU s after", ".2f"),
            ("cpu_ratio", "CPU after / before", ".2f")]
    notes = (f"The same workload under commit {base} and under this commit, interleaved, {args.rounds} "
             f"rounds: {ckpt.total_bytes / 1e9:.2f} GB bfloat16 checkpoint ({len(ckpt.files)} files), "
             f"{args.degree} gloo ranks at tp, the slowest rank's seconds, median and minimum over the "
             f"rounds; CPU s: the largest rank's CPU seconds of the operation (time.process_time), "
             "median over the rounds: steadier than wall seconds on a shared machine, blind to waiting "
             f"(a disk's fsync, a collective); load average {os.getloadavg()[0]:.1f} at the end. "
             "Below 1: faster after. "
             "Command: "
             f"`python3 benchmarks/before_after.py --base {base} --size {args.size} --degree {args.degree} "
             f"--rounds {args.rounds}`.")
    print(write_results("before-after", rows, cols, notes, extra={"runs": got, "base": base}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
