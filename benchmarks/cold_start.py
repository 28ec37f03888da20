"""Cold start: a fresh process per rank, from its first line to a loaded model: the imports, the
process group, the model built and the first load, shardwise against transformers 5.25.

    python3 benchmarks/cold_start.py --degrees 1 2 4 --repeat 3 [--llama-size 1GB]

The checkpoint is benchmarks/peers.py's Llama (``_peers_models.llama_checkpoint``, bfloat16,
written by ``save_pretrained``). Each round starts ``torchrun --nproc-per-node N`` on this script
once per method, the methods interleaved round by round, page cache warm before each launch,
bytecode cached (a warm-up round, not counted, compiles whatever was not). Every rank times, from
its own first line (interpreter start-up before it is the same for both methods, and torchrun's):

- imports: ``import torch``, then the method's modules (shardwise: ``shardwise`` and
  transformers' ``LlamaForCausalLM``, which ``sw.from_pretrained`` builds; transformers: its
  ``LlamaForCausalLM`` and ``DistributedConfig``);
- init: the gloo process group (``sw.init_backend("gloo")``; ``dist.init_process_group("gloo")``,
  which transformers adopts);
- load: shardwise ``sw.from_pretrained(LlamaForCausalLM, folder, mesh=backend.mesh(tp=N),
  dtype=bfloat16)`` (build on meta, plan "auto", every import it does on first use);
  transformers ``LlamaForCausalLM.from_pretrained(folder, dtype=bfloat16,
  distributed_config=DistributedConfig(tp_plan="auto", tp_size=N))``;
- cold: all three, the first line to a loaded model; the CPU seconds the rank's process spent by
  then (``time.process_time``, interpreter start-up included: steadier than wall time on a
  shared machine), and its peak RSS (``ru_maxrss``).

The slowest rank's cold seconds count; the median round is reported. Ratios: transformers'
seconds over shardwise's, measured in the same run.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # a rank's first line: everything below is inside its cold start

import argparse  # noqa: E402 - after the clock starts, on purpose (cheap, and the same for both)
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def rank_main(method: str, folder: str, out: str) -> None:
    """One rank of one cold start (under torchrun): its figures into ``out/rank{r}.json``."""
    import resource

    import torch

    if method == "shardwise":
        from transformers import LlamaForCausalLM

        import shardwise as sw
    else:
        import torch.distributed as dist
        from transformers import DistributedConfig, LlamaForCausalLM
    t_imports = time.perf_counter()
    tp = int(os.environ["WORLD_SIZE"])
    if method == "shardwise":
        backend = sw.init_backend("gloo")
    else:
        dist.init_process_group("gloo")
    t_init = time.perf_counter()
    if method == "shardwise":
        model = sw.from_pretrained(LlamaForCausalLM, folder, mesh=backend.mesh(tp=tp), dtype=torch.bfloat16)
    else:
        model = LlamaForCausalLM.from_pretrained(
            folder, dtype=torch.bfloat16, distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp))
    t_load = time.perf_counter()
    rank = int(os.environ["RANK"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss: KiB on Linux
    figures = {"rank": rank, "imports": t_imports - _T0, "init": t_init - t_imports, "load": t_load - t_init,
               "cold": t_load - _T0, "cpu": time.process_time(), "peak_rss_gb": peak,
               "params": sum(1 for _ in model.parameters())}
    Path(out, f"rank{rank}.json").write_text(json.dumps(figures))


def launch(method: str, folder: Path, degree: int, out: Path, timeout: float) -> list[dict]:
    """One cold start of ``degree`` fresh ranks; their figures in rank order."""
    import subprocess

    from shardwise.testing import free_port

    for old in out.glob("rank*.json"):
        old.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(degree), "--master-port",
           str(free_port()), str(Path(__file__).resolve()), "--rank-run", method, str(folder), str(out)]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, check=False)
    if done.returncode:
        raise RuntimeError(f"{method} tp={degree} failed ({done.returncode}):\n{done.stdout[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(degree)]


COLUMNS = [("tp", "tp"), ("method", "method"), ("cold", "cold start s", ".2f"),
           ("imports", "imports s", ".2f"), ("init", "process group s", ".2f"), ("load", "load s", ".2f"),
           ("cpu", "CPU s (that rank)", ".2f"), ("peak_rss_gb", "peak RSS GB (max rank)", ".2f"),
           ("cold_x_peer", "cold start speed × transformers"), ("load_x_peer", "load speed × transformers"),
           ("rounds", "cold s by round")]


def summarise(method: str, degree: int, rounds: list[list[dict]]) -> dict:
    slowest = [max(ranks, key=lambda r: r["cold"]) for ranks in rounds]
    f = sorted(slowest, key=lambda r: r["cold"])[len(slowest) // 2]
    return {"tp": degree, "method": method, **{k: f[k] for k in ("cold", "imports", "init", "load", "cpu")},
            "peak_rss_gb": max(r["peak_rss_gb"] for ranks in rounds for r in ranks),
            "rounds": ", ".join(f"{s['cold']:.2f}" for s in slowest)}


def main(argv=None) -> None:
    import _peers_models as pm
    from _common import warm_file_cache, write_results

    from shardwise.testing import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--llama-size", default="1GB")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardwise-cold"))
    args = ap.parse_args(argv)
    model = pm.llama_checkpoint(args.dir / f"llama-{args.llama_size}", parse_size(args.llama_size))
    out = args.dir / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    methods = ("shardwise", "transformers")
    rows = []
    for degree in args.degrees:
        runs: dict[str, list[list[dict]]] = {m: [] for m in methods}
        for round_ in range(args.repeat + 1):  # round 0: bytecode compiled, caches warm; not counted
            for method in methods:
                warm_file_cache(model.files)
                ranks = launch(method, model.folder, degree, out, timeout=900)
                if round_:
                    runs[method].append(ranks)
                print(f"tp={degree} {method} round {round_}: cold {max(r['cold'] for r in ranks):.2f} s "
                      f"(load {max(r['load'] for r in ranks):.2f} s; load average {os.getloadavg()[0]:.1f})",
                      file=sys.stderr)
        by = {m: summarise(m, degree, runs[m]) for m in methods}
        for m in methods:
            by[m]["cold_x_peer"] = by["transformers"]["cold"] / by[m]["cold"]
            by[m]["load_x_peer"] = by["transformers"]["load"] / by[m]["load"]
            rows.append(by[m])
    notes = (f"{model.description}; {model.total_bytes / 1e9:.2f} GB. " + " ".join(__doc__.split("\n\n")[2:])
             .replace("\n", " ") + f" Median of {args.repeat} rounds after a warm-up round; the machine is "
             f"shared (load average {os.getloadavg()[0]:.1f} at the end), so the figures are noisy. Command: "
             f"`python3 benchmarks/cold_start.py --degrees {' '.join(map(str, args.degrees))} --repeat "
             f"{args.repeat} --llama-size {args.llama_size}`.")
    print(write_results("cold-start", rows, COLUMNS, notes=notes))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--rank-run":
        rank_main(*sys.argv[2:])
    else:
        main()
