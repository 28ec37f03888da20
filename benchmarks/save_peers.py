"""Saving a tensor-parallel model back to safetensors: shardwise against transformers' own.

    python3 benchmarks/save_peers.py --degrees 1 2 4 --repeat 3 [--llama-size 1GB]

The Llama checkpoint of ``peers.py`` (written by transformers' ``save_pretrained``) is loaded at
tp = N by each library's own TP load (``sw.from_pretrained`` and transformers'
``from_pretrained(distributed_config=DistributedConfig(tp_plan="auto"))``), then saved back to an
ordinary safetensors folder by the same library, every rank calling:

- shardwise: ``sw.save(model, out)`` (one machine: rank 0 streams, one tensor at a time);
- transformers: ``model.save_pretrained(out)`` (it gathers the full state dict, then writes);
- the baseline: ``safetensors.torch.save_file`` of the full state dict in one process (what a
  model on one device would do), measured in the same rounds.

Seconds are the slowest rank's, from a barrier before the save to a barrier after it; the
median of ``--repeat`` interleaved rounds. Both libraries' outputs are checked tensor by tensor
against the checkpoint they were loaded from (``sw.diff``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _peers_models as pm
import torch
from _common import GB, warm_file_cache, write_results

from shardwise.testing import parse_size, spawn

METHODS = ("shardwise", "transformers")


def rank_save(method: str, folder: str, out: str, tp: int) -> float:
    """One rank: load with ``method``'s TP load, then time its save (barrier to barrier)."""
    import torch.distributed as dist
    from peers import _load

    import shardwise as sw

    backend = sw.init_backend("gloo")
    model = _load(method, "llama", folder, tp, backend)
    dist.barrier()
    start = time.perf_counter()
    if method == "shardwise":
        sw.save(model, out, overwrite=True, progress=False)
    else:
        model.save_pretrained(out)
    dist.barrier()
    return time.perf_counter() - start


def baseline_save(folder: str, out: str) -> float:
    """save_file of the checkpoint's full state dict, already in memory, in one process."""
    from safetensors.torch import load_file, save_file

    state = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update({k: v.clone() for k, v in load_file(f).items()})
    Path(out).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    save_file(state, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    return time.perf_counter() - start


def _same(folder: Path, out: Path) -> bool:
    import shardwise as sw

    return sw.diff(folder, out).identical


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--llama-size", default="1GB")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "shardwise-bench-peers"))
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    model = pm.llama_checkpoint(Path(args.dir) / "llama", parse_size(args.llama_size))
    files = [str(f) for f in model.files]
    work = Path(tempfile.mkdtemp(prefix="save-peers-", dir=args.dir))
    times: dict[tuple[str, int], list[float]] = {}
    same: dict[str, bool] = {}
    for rnd in range(args.repeat):
        warm_file_cache(files)
        times.setdefault(("save_file", 1), []).append(
            spawn(baseline_save, 1, args=(str(model.folder), str(work / "base")), timeout=args.timeout)[0])
        for tp in args.degrees:
            for method in METHODS:
                warm_file_cache(files)
                out = work / f"{method}-{tp}"
                got = spawn(rank_save, tp, args=(method, str(model.folder), str(out), tp),
                            timeout=args.timeout)
                times.setdefault((method, tp), []).append(max(got))
                if f"{method}-{tp}" not in same:  # once: a diff of 1 GB takes seconds
                    same[f"{method}-{tp}"] = _same(model.folder, out)
                print(f"  round {rnd + 1} tp={tp} {method}: {max(got):.2f} s", file=sys.stderr, flush=True)
    base = statistics.median(times[("save_file", 1)])
    rows = []
    for (method, tp), ts in times.items():
        s = statistics.median(ts)
        rows.append({"method": method, "tp": tp, "s": s, "gbps": model.total_bytes / GB / s,
                     "ratio": base / s, "same": "yes" if method == "save_file" else
                     ("yes" if same[f"{method}-{tp}"] else "NO")})
    columns = [("method", "method", None), ("tp", "tp", None), ("s", "s", ".2f"), ("gbps", "GB/s", ".2f"),
               ("ratio", "speed ÷ save_file", ".2f"), ("same", "tensors equal the checkpoint", None)]
    notes = (f"{model.description}, {model.total_bytes / GB:.2f} GB. Loaded at tp=N by each library's own "
             "TP load, then saved back to safetensors by the same library with every rank calling: "
             "shardwise `sw.save(model, out)` (one machine: the rank-0 stream), transformers "
             "`model.save_pretrained(out)` (it gathers the full state dict first). Baseline: "
             "`safetensors.torch.save_file` of the full state dict, in memory, in one process. Seconds: "
             "the slowest rank, barrier to barrier; median of "
             f"{args.repeat} interleaved rounds. Command: `python3 benchmarks/save_peers.py "
             f"--degrees {' '.join(map(str, args.degrees))} --repeat {args.repeat}`.")
    print(write_results("save-peers", rows, columns, notes))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
