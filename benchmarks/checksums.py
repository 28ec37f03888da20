"""What the per-tensor checksums cost a save.

    python3 benchmarks/checksums.py --rounds 7

The same ~500 MB model is saved by one process and by 2 gloo ranks at tp=2, as a gather save
and as a distributed save, with checksums and with them switched off (the recorded algorithm's
digest replaced by one that does nothing), the two alternating in the same processes. Compared: the
median of the slowest rank's seconds, and the best save of each (on a shared machine the
median moves with other load; the best is the least disturbed run). Every save ends with
fsync, as sw.save always does; dirty pages are flushed (``os.sync``) before each one, so
that one save's writeback does not land in the next. The table replaces its section of
docs/reliability.md (from a clean tree).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import bench_model, bench_plan, markdown_table, publish_reliability, real_plan


def cost_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return bench_model(8, 1024, 16384)  # 0.67 GB of float32


def save_rank(root: str, kind: str, rounds: int) -> dict[bool, list[float]]:
    """``{checksums on: [seconds per save]}``, the two alternating, ``rounds`` of each."""
    import shardwise as sw
    from shardwise import testing

    backend = sw.init_backend("gloo")
    model = cost_model()
    sw.parallelize(model, real_plan(bench_plan()), backend.mesh(tp=backend.world_size))
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for checksums in (False, True) if r % 2 == 0 else (True, False):
            target = Path(root) / f"{kind}-{r}-{checksums}"
            if backend.rank == 0:
                os.sync()
            backend.barrier()
            start = time.perf_counter()
            with contextlib.nullcontext() if checksums else testing.without_checksums():
                sw.save(model, target, distributed=kind == "dcp")
            backend.barrier()
            times[checksums].append(time.perf_counter() - start)
            if backend.rank == 0:
                shutil.rmtree(target)
    return times


def run_checksum_cost(work: Path, rounds: int = 3, ranks=(1, 2), progress=print) -> dict:
    from shardwise.testing import spawn

    work.mkdir(parents=True, exist_ok=True)
    nbytes = sum(t.numel() * t.element_size() for t in cost_model().state_dict().values())
    rows = []
    for n in ranks:
        for kind in ("gather", "dcp"):
            got = spawn(save_rank, n, args=(str(work), kind, rounds), timeout=1200)
            # the slowest rank of each save (the barrier after it makes them nearly equal)
            off = [max(t[False][i] for t in got) for i in range(rounds)]
            on = [max(t[True][i] for t in got) for i in range(rounds)]
            rows.append({"save": f"{kind}, {n} rank{'s' if n > 1 else ''}", "gb": nbytes / 1e9,
                         "without_s": statistics.median(off), "with_s": statistics.median(on),
                         "cost_pct": 100 * (statistics.median(on) / statistics.median(off) - 1),
                         "best_without_s": min(off), "best_with_s": min(on),
                         "best_cost_pct": 100 * (min(on) / min(off) - 1),
                         "all_without": off, "all_with": on})
            if progress:
                progress(f"  checksum cost: {rows[-1]['save']} done")
    return {"rounds": rounds, "bytes": nbytes, "rows": rows}


def main(argv=None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds with and without")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shardwise-checksums-", dir=args.work) as tmp:
        result = run_checksum_cost(Path(tmp), rounds=args.rounds)
    cols = [("save", "save"), ("gb", "GB", ".2f"), ("without_s", "median s without", ".2f"),
            ("with_s", "median s with", ".2f"), ("cost_pct", "median cost %", ".1f"),
            ("best_without_s", "best s without", ".2f"), ("best_with_s", "best s with", ".2f"),
            ("best_cost_pct", "best cost %", ".1f")]
    notes = (f"The cost of recording a checksum (XXH3-64) per tensor (per chunk for DCP) as the bytes are "
             f"written: the same {result['bytes'] / 1e9:.2f} GB model saved by one process and by 2 "
             "gloo ranks at tp=2, with checksums and with them switched off, median of the slowest "
             f"rank over {result['rounds']} interleaved rounds (fsync included, dirty pages flushed before "
             f"each save). Command: `python3 benchmarks/checksums.py --rounds {result['rounds']}`.")
    publish_reliability("checksums", "Checksum cost", notes, markdown_table(result["rows"], cols), result)
    return 0


__all__ = ["run_checksum_cost"]


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
