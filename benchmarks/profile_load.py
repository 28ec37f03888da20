"""Where a tensor-parallel ``sw.load``'s time goes on every rank: wall and CPU seconds per rank,
and rank 0's cProfile (top functions by own time), for one of benchmarks/overhead.py's models.

    python3 benchmarks/profile_load.py --model llama-64 --degree 4 [--top 25] [--rounds 3]

Each rank loads the model ``--rounds`` times after a warm-up load (imports, caches); the CPU
seconds (``time.process_time``) beside the wall seconds say how much of a rank's wall time is
its own work and how much is waiting (for a core: 4 ranks on 2 cores; or for a collective). The
last round's ``sw.load`` runs under cProfile on rank 0 (CPU time; the profiler slows Python
calls, so its seconds are larger than the unprofiled rounds'; its ranking is what it is for).
Writes ``benchmarks/out/profile-<model>-tp<degree>.txt``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

from _common import SCRATCH_DIR, warm_file_cache
from overhead import empty, write_models

from shardwise.testing import spawn


def _one_load(name: str, folder: str, backend, tp: int, profiler=None) -> tuple[float, float, int, dict]:
    from _phases import LoadPhases

    import shardwise as sw

    model, plan = empty(name)
    m0 = time.perf_counter()
    mesh = backend.mesh(tp=tp)
    mesh_s = time.perf_counter() - m0
    w0, c0 = time.perf_counter(), time.process_time()
    with LoadPhases() as phases:
        if profiler is not None:
            profiler.enable()
        sw.load(model, folder, plan=plan, mesh=mesh)
        if profiler is not None:
            profiler.disable()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return wall, cpu, sum(1 for _ in model.named_modules()), {"mesh": mesh_s, **phases.seconds}


def rank_run(name: str, folder: str, tp: int, rounds: int, top: int) -> dict:
    import cProfile
    import gc
    import pstats

    import torch.distributed as dist
    import transformers  # noqa: F401 - imported before any clock starts

    import shardwise as sw
    from shardwise import testing

    backend = sw.init_backend("gloo")
    testing.preload()
    figures = []
    for round_ in range(rounds + 1):
        gc.collect()
        dist.barrier()
        wall, cpu, modules, steps = _one_load(name, folder, backend, tp)
        if round_:
            figures.append((wall, cpu, steps))
    gc.collect()
    dist.barrier()
    text = ""
    if dist.get_rank() == 0:
        profiler = cProfile.Profile(time.process_time)  # CPU time: a rank waiting for a core is not its cost
        _one_load(name, folder, backend, tp, profiler)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
        out.write("\n--- by cumulative time ---\n")
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
        out.write("\n--- who walks the model ---\n")
        pstats.Stats(profiler, stream=out).print_callers(r"\((named_modules|state_dict|named_parameters|"
                                                         r"named_buffers|modules)\)")
        text = out.getvalue()
    else:
        _one_load(name, folder, backend, tp)
    return {"figures": figures, "modules": modules, "profile": text}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-64")
    ap.add_argument("--degree", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardwise-overhead"))
    args = ap.parse_args(argv)
    if args.model.startswith("moe"):
        folders = write_models(args.dir, [], tuple(map(int, args.model.split("-")[1].split("x"))))
    else:
        folders = write_models(args.dir, [int(args.model.split("-")[1])], None)
    folder = folders[args.model]
    warm_file_cache(sorted(folder.glob("*.safetensors")))
    per_rank = spawn(rank_run, args.degree, timeout=1800,
                     args=(args.model, str(folder), args.degree, args.rounds, args.top))
    modules = per_rank[0]["modules"]
    lines = [f"{args.model} at tp={args.degree}: {modules} modules; per rank, median of {args.rounds} rounds"]
    for r, res in enumerate(per_rank):
        wall = statistics.median(f[0] for f in res["figures"])
        cpu = statistics.median(f[1] for f in res["figures"])
        steps = {k: statistics.median(f[2][k] or 0.0 for f in res["figures"]) for k in res["figures"][0][2]}
        lines.append(f"  rank {r}: wall {wall:.3f} s ({1e6 * wall / modules:.0f} us/module), "
                     f"cpu {cpu:.3f} s ({1e6 * cpu / modules:.0f} us/module); "
                     + ", ".join(f"{k} {v:.3f}" for k, v in steps.items()))
    report = "\n".join(lines)
    print(report, file=sys.stderr)
    SCRATCH_DIR.mkdir(exist_ok=True)
    path = SCRATCH_DIR / f"profile-{args.model}-tp{args.degree}.txt"
    path.write_text(report + "\n\n" + per_rank[0]["profile"])
    print(path)


if __name__ == "__main__":
    main()
