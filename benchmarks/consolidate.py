"""Consolidation before and after: ``sw.consolidate`` of a torch DCP checkpoint and of a
sharded safetensors checkpoint, under two commits, interleaved, in the same run.

    python3 benchmarks/consolidate.py --base 2bc4d24 --size 512MB --degree 2 --rounds 5

Setup, untimed: a generated bfloat16 checkpoint of about ``--size`` (``bench_model``) is loaded
on ``--degree`` spawned gloo ranks at tp=degree and saved twice, ``sw.save(distributed=True)``
(DCP, ``.distcp`` files) and ``sw.save(distributed=True, format="safetensors")`` (rank-local
safetensors with ``DCP_SHARDING_INFO``). Then, round after round, a fresh process per commit
and format consolidates it (one output file: ``max_shard_size`` above the checkpoint), the
commits alternating which goes first, page cache of the source warm before each. The same
round measures two references under this checkout:

- ``read only``: every tensor read whole through the Source (``Stored.read_box``), nothing
  written: the read half of a consolidation;
- ``save_file``: safetensors' ``save_file`` of the same tensors, already in memory, then an
  fsync of the file (consolidate fsyncs what it writes): the write half, without reading.

A consolidation done one tensor after the other costs about read + write; one that reads
ahead while it writes can approach the larger of the two. Each figure is the median over the
rounds; ratios are to the base commit's consolidation of the same checkpoint in the same run
(below 1: faster). CPU seconds (user + system, all threads) say how much of the time the
process computed rather than waited; peak RSS is above the process's level before the call.
The outputs of the two commits are compared byte for byte. The JSON goes to
benchmarks/results/consolidate.json and the table to docs/benchmarks.md (from a clean tree).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FORMATS = ("dcp", "sharded")


def save_rank(ckpt: str, work: str, degree: int) -> None:
    """Write both distributed checkpoints of the model at ``ckpt`` (spawned ranks import it)."""
    import torch
    from _common import bench_plan, checkpoint_model, real_plan

    import shardwise as sw

    backend = sw.init_backend("gloo")
    with torch.device("meta"):
        model = checkpoint_model(ckpt)
    sw.load(model, ckpt, plan=real_plan(bench_plan()), mesh=backend.mesh(tp=degree), progress=False)
    sw.save(model, f"{work}/dcp", distributed=True)
    sw.save(model, f"{work}/sharded", distributed=True, format="safetensors")
    backend.barrier()


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()


def _import_readers() -> None:
    """Import what a consolidation imports on use before the clock starts: importing
    torch.distributed.checkpoint takes seconds, paid once per process, whatever the size.
    Through the public names only, the same under every commit (a base commit may predate
    shardwise.testing): shardwise's own format plugins (milliseconds) load in the call."""
    import torch.distributed.checkpoint  # noqa: F401

    import shardwise as sw

    sw.consolidate  # noqa: B018 - the lazy attribute imports the consolidation


def _cpu_seconds() -> float:
    """User + system seconds of this process so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _consolidation(work: Path, total: int, fmt: str) -> dict:
    """``sw.consolidate`` of the ``fmt`` checkpoint: seconds, peak RSS and the output's digest.
    One per process: memory the allocator kept from an earlier call would hide this one's peak."""
    from _common import PeakRSS, warm_file_cache

    import shardwise as sw

    _import_readers()
    warm_file_cache(sorted((work / fmt).iterdir()))
    dst = work / f"{fmt}-merged-{os.getpid()}"
    with PeakRSS() as peak:
        start, cpu = time.perf_counter(), _cpu_seconds()
        sw.consolidate(work / fmt, dst, max_shard_size=2 * total)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    try:
        return {fmt: {"seconds": seconds, "cpu": cpu, "peak": peak.bytes, "digest": _digest(dst)}}
    finally:
        shutil.rmtree(dst)


def _references(work: Path) -> dict:
    """This checkout's read half (every tensor through its reader: ``testing.read_all``) and
    safetensors' ``save_file`` of the same tensors (the write half)."""
    from _common import warm_file_cache
    from safetensors.torch import save_file

    from shardwise import testing

    _import_readers()
    out, tensors = {}, {}
    for fmt in FORMATS:
        warm_file_cache(sorted((work / fmt).iterdir()))
        start, cpu = time.perf_counter(), _cpu_seconds()
        tensors = testing.read_all(work / fmt)
        out[f"read only {fmt}"] = {"seconds": time.perf_counter() - start, "cpu": _cpu_seconds() - cpu}
    path = work / f"save_file-{os.getpid()}.safetensors"
    start, cpu = time.perf_counter(), _cpu_seconds()
    save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    out["save_file"] = {"seconds": time.perf_counter() - start, "cpu": _cpu_seconds() - cpu}
    path.unlink()
    return out


def _worker(args) -> int:
    sys.path.insert(0, args.src)
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    work = Path(args.work)
    got = _references(work) if args.what == "_references" else _consolidation(work, args.total, args.format)
    Path(args.out).write_text(json.dumps(got))
    return 0


def _run(what: str, src: Path, work: Path, total: int, timeout: float, fmt: str = "") -> dict:
    out = work / f"{what}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDWISE_BENCH_SRC": str(src)}
    cmd = [sys.executable, __file__, what, "--src", str(src), "--work", str(work), "--out", str(out),
           "--total", str(total), "--format", fmt]
    subprocess.run(cmd, env=env, check=True, timeout=timeout)
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink()


def _rows(got: dict, base: str) -> list[dict]:
    def median(which: str, key: str, field: str = "seconds") -> float:
        return statistics.median(r[key][field] for r in got[which])

    rows = []
    for fmt in FORMATS:
        before = median("before", fmt)
        same = all(b[fmt]["digest"] == a[fmt]["digest"] for b in got["before"] for a in got["after"])
        labels = (("before", f"sw.consolidate at {base}"), ("after", "sw.consolidate, this commit"))
        for which, label in labels:
            s = median(which, fmt)
            rows.append({"source": fmt, "method": label, "s": s, "ratio": s / before,
                         "cpu": median(which, fmt, "cpu"), "peak": median(which, fmt, "peak") / 2**20,
                         "same": ("yes" if same else "NO") if which == "after" else None})
        s = median("reference", f"read only {fmt}")
        rows.append({"source": fmt, "method": "read only (read_box, this commit)", "s": s,
                     "ratio": s / before, "cpu": median("reference", f"read only {fmt}", "cpu")})
        s = median("reference", "save_file")
        rows.append({"source": fmt, "method": "save_file + fsync (tensors in memory)", "s": s,
                     "ratio": s / before, "cpu": median("reference", "save_file", "cpu")})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="run", choices=["run", "_consolidation", "_references"])
    p.add_argument("--base", default="HEAD~1", help="the commit to compare with (default HEAD~1)")
    p.add_argument("--size", default="512MB", help="checkpoint size (bfloat16), e.g. 512MB")
    p.add_argument("--degree", type=int, default=2, help="the ranks that save the checkpoints")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600, help="seconds per process")
    p.add_argument("--src"), p.add_argument("--work"), p.add_argument("--out")
    p.add_argument("--total", type=int), p.add_argument("--format", choices=["", *FORMATS])
    args = p.parse_args(argv)
    if args.what != "run":
        return _worker(args)

    from _common import GB, REPO, make_checkpoint, write_results

    from shardwise.testing import parse_size, spawn

    base = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.base], check=True,
                          capture_output=True, text=True).stdout.strip()
    got: dict[str, list[dict]] = {"before": [], "after": [], "reference": []}
    with tempfile.TemporaryDirectory(prefix="shardwise-consolidate-") as tmp:
        work, tree = Path(tmp), Path(tmp) / "base"
        size = parse_size(args.size)
        ckpt = make_checkpoint(work / "ckpt", size, size // 4)
        spawn(save_rank, args.degree, args=(str(ckpt.path), str(work), args.degree), timeout=args.timeout)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), base],
                       check=True)
        try:
            srcs = {"before": tree / "src", "after": REPO / "src", "reference": REPO / "src"}

            def run(which: str, what: str, fmt: str = "") -> dict:
                return _run(what, srcs[which], work, ckpt.total_bytes, args.timeout, fmt)

            for r in range(args.rounds):
                order = ("before", "after", "reference") if r % 2 == 0 else ("after", "before", "reference")
                for which in order:
                    if which == "reference":
                        got[which].append(run(which, "_references"))
                    else:
                        got[which].append({f: run(which, "_consolidation", f)[f] for f in FORMATS})
                    print(f"  round {r + 1}/{args.rounds} {which}: "
                          + ", ".join(f"{k} {v['seconds']:.2f} s" for k, v in got[which][-1].items()),
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    cols = [("source", "source"), ("method", "method"), ("s", "s", ".2f"),
            ("ratio", f"÷ base ({base})", ".2f"), ("cpu", "CPU s", ".2f"), ("peak", "peak RSS MiB", ".0f"),
            ("same", "output byte-equal to base")]
    command = (f"python3 benchmarks/consolidate.py --base {base} --size {args.size} --degree {args.degree} "
               f"--rounds {args.rounds}")
    notes = (f"`{command}`: a {ckpt.total_bytes / GB:.2f} GB bfloat16 bench_model saved by {args.degree} "
             "gloo "
             "ranks at tp as DCP (`sw.save(distributed=True)`) and as sharded safetensors "
             "(`format=\"safetensors\"`), consolidated into one file by one process, page cache of the "
             f"source warm; the base commit {base} and this one interleaved, {args.rounds} rounds, median "
             "seconds; ÷ base: over the base commit's consolidation of the same source in the same run "
             "(below 1: faster). read only: every tensor through read_box, nothing written; save_file: "
             "safetensors' save_file of the same tensors already in memory, plus an fsync. CPU s: user + "
             "system seconds of the process (all threads) during the call, median; the rest of the "
             "seconds it waited (for the disk, or for a core). Peak RSS above the process's level "
             "before the call. Machine shared with other work: load average "
             f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end of the run.")
    print(write_results("consolidate", _rows(got, base), cols, notes, extra={"runs": got, "base": base}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
