"""Overhead per module of the verbs besides ``sw.load``: what a gather save, a DCP save and load,
a consolidation and a transfer plan cost that is not their bytes, as a model grows in modules.

    python3 benchmarks/overhead_verbs.py --layers 16 64 256 --degrees 2 4 --repeat 2

The models are benchmarks/overhead.py's tiny Llamas (hidden 64, bfloat16, so bytes are
negligible and the time is bookkeeping). On spawned gloo ranks (1 thread each), page cache
warm, each round: ``sw.load`` the checkpoint (plan "auto"), then each verb on it, timed (wall,
and this rank's CPU seconds, ``time.process_time``: steadier than wall time on a shared machine):

- load: ``sw.load`` itself (the figure of overhead.py, the reference);
- gather save: ``sw.save(model, folder)`` (rank 0 writes safetensors);
  baseline ``save_pretrained`` of the same model unsharded on rank 0 (built and filled before);
- dcp save: ``sw.save(model, folder, distributed=True)``; baseline torch's
  ``dcp.save(model.state_dict())``;
- dcp load: ``sw.load`` of that folder into a fresh meta model; baseline torch's ``dcp.load``
  into the already-sharded state dict;
- consolidate: ``sw.consolidate`` of the DCP folder on rank 0 (one process, the others wait);
- transfer plan: ``sw.transfer_plan(model, second)``, two loaded copies at the same layout.

Per module: seconds over the model's module count; the slowest rank's wall (and its CPU) in the
median round. The baselines run in the same rounds, interleaved.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import warm_file_cache, write_results
from overhead import llama_config, write_models

from shardwise.testing import spawn

VERBS = ("load", "gather save", "save_pretrained (baseline)", "dcp save", "torch dcp.save (baseline)",
         "dcp load", "torch dcp.load (baseline)", "consolidate", "transfer plan")


def _timed(out: dict, verb: str, fn) -> object:
    w0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    out[verb] = (time.perf_counter() - w0, time.process_time() - c0)
    return result


def _meta_llama(layers: int):
    from transformers import LlamaForCausalLM

    import shardwise as sw

    with sw.empty_model():
        return LlamaForCausalLM(llama_config(layers))


def one_round(layers: int, folder: str, work: str, backend, tp: int, whole) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import shardwise as sw

    rank, mesh, out = dist.get_rank(), backend.mesh(tp=tp), {}
    model = _meta_llama(layers)
    dist.barrier()
    _timed(out, "load", lambda: sw.load(model, folder, plan="auto", mesh=mesh))
    dist.barrier()
    _timed(out, "gather save", lambda: sw.save(model, f"{work}/gather", overwrite=True))
    dist.barrier()
    if rank == 0:
        _timed(out, "save_pretrained (baseline)", lambda: whole.save_pretrained(f"{work}/hf"))
    dist.barrier()
    _timed(out, "dcp save", lambda: sw.save(model, f"{work}/dcp", distributed=True, overwrite=True))
    dist.barrier()
    _timed(out, "torch dcp.save (baseline)",
           lambda: dcp.save(model.state_dict(), checkpoint_id=f"{work}/tdcp"))
    dist.barrier()
    second = _meta_llama(layers)
    _timed(out, "dcp load", lambda: sw.load(second, f"{work}/dcp", plan="auto", mesh=mesh))
    dist.barrier()
    state = model.state_dict()
    _timed(out, "torch dcp.load (baseline)", lambda: dcp.load(state, checkpoint_id=f"{work}/tdcp"))
    dist.barrier()
    if rank == 0:
        _timed(out, "consolidate", lambda: sw.consolidate(f"{work}/dcp", f"{work}/merged", overwrite=True))
    dist.barrier()
    _timed(out, "transfer plan", lambda: sw.transfer_plan(model, second))
    dist.barrier()
    if rank == 0:
        for sub in ("gather", "hf", "dcp", "tdcp", "merged"):
            shutil.rmtree(f"{work}/{sub}", ignore_errors=True)
    dist.barrier()
    out["modules"] = sum(1 for _ in model.named_modules())
    return out


def rank_run(folders: dict[int, str], tp: int, repeat: int, work: str) -> dict:
    import gc

    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import shardwise as sw
    from shardwise import testing

    backend = sw.init_backend("gloo")
    testing.preload()
    out: dict = {}
    for layers, folder in folders.items():
        whole = (LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16) if dist.get_rank() == 0
                 else None)
        here = f"{work}/{layers}"
        for round_ in range(repeat + 1):  # round 0 warms (first-use imports, caches)
            gc.collect()
            figures = one_round(layers, folder, here, backend, tp, whole)
            if round_:
                out.setdefault(layers, []).append(figures)
    return out


def summarise(per_rank: list[dict], tp: int) -> list[dict]:
    rows = []
    for layers in per_rank[0]:
        rounds = per_rank[0][layers]
        modules = rounds[0]["modules"]
        for verb in VERBS:
            walls = []  # per round: the slowest rank's (wall, cpu)
            for i in range(len(rounds)):
                walls.append(max((r[layers][i][verb] for r in per_rank if verb in r[layers][i]),
                                 key=lambda f: f[0]))
            wall, cpu = sorted(walls)[len(walls) // 2]
            rows.append({"model": f"llama-{layers}", "tp": tp, "modules": modules, "verb": verb,
                         "wall_s": wall, "us_per_module": 1e6 * wall / modules,
                         "cpu_us_per_module": 1e6 * cpu / modules,
                         "rounds": ", ".join(f"{1e6 * w / modules:.0f}" for w, _ in walls)})
    return rows


COLUMNS = [("model", "model"), ("tp", "tp"), ("modules", "modules"), ("verb", "verb"),
           ("us_per_module", "µs/module (wall)", ".0f"), ("cpu_us_per_module", "µs/module (CPU)", ".0f"),
           ("wall_s", "s", ".3f"), ("rounds", "µs/module by round")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardwise-overhead-verbs"))
    args = ap.parse_args(argv)
    folders = write_models(args.dir, args.layers, None)
    for folder in folders.values():
        warm_file_cache(sorted(folder.glob("*.safetensors")))
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardwise-verbs-") as work:
        for tp in args.degrees:
            chosen = {n: str(folders[f"llama-{n}"]) for n in args.layers}
            per_rank = spawn(rank_run, tp, timeout=3600, args=(chosen, tp, args.repeat, work))
            rows += summarise(per_rank, tp)
    for r in rows:
        print(f"tp={r['tp']} {r['model']} {r['verb']}: {r['us_per_module']:.0f} µs/module wall, "
              f"{r['cpu_us_per_module']:.0f} CPU", file=sys.stderr)
    notes = (" ".join(__doc__.split("\n\n")[2:]).replace("\n", " ")
             + f" Median of {args.repeat} rounds after a warm-up round; the machine is shared, so the wall "
             "figures are noisy. Command: `python3 benchmarks/overhead_verbs.py --layers "
             f"{' '.join(map(str, args.layers))} --degrees {' '.join(map(str, args.degrees))} --repeat "
             f"{args.repeat}`.")
    print(write_results("overhead-verbs", rows, COLUMNS, notes=notes,
                        extra={"median_us_per_module": statistics.median(r["us_per_module"] for r in rows)}))


if __name__ == "__main__":
    main()
