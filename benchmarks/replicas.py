"""Replicas read once: bytes read from storage per node, with and without a dp_replicate axis.

    python3 benchmarks/replicas.py [--llama-size 1GB] [--repeat 3]

Two torchrun "nodes" of two ranks each on this machine (``--nnodes 2 --node-rank 0|1
--rdzv-endpoint 127.0.0.1:PORT``, loopback only) load the Llama checkpoint of ``peers.py``
with ``sw.from_pretrained``:

- ``mesh(dp_replicate=2, tp=2)``: each region is read from storage by one replica and
  broadcast to the other (gloo over loopback here; the network between nodes in a real job);
- ``mesh(dp_shard=2, tp=2)``: no replica axis, every node reads its tp shards itself (what
  a ``dp_replicate`` mesh did before replicas read once).

Per node: bytes read from storage (``LoadResult.bytes_read`` summed over its ranks); per run:
the slowest rank's load seconds. Both nodes share one page cache here, so the seconds say
little about shared storage; the bytes are what the storage would serve.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _peers_models as pm
from _common import GB, warm_file_cache, write_results
from _torchrun import torchrun_nodes

from shardwise.testing import parse_size

MODES = {"replicas": "mesh(dp_replicate=2, tp=2)", "plain": "mesh(dp_shard=2, tp=2)"}


def worker(folder: str, out: str, mode: str) -> None:
    """One rank under torchrun: load, run one forward, write the figures."""
    import torch

    import shardwise as sw

    torch.set_num_threads(1)
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(dp_replicate=2, tp=2) if mode == "replicas" else backend.mesh(dp_shard=2, tp=2)
    cls = pm.model_class("llama")
    from shardwise import testing

    testing.preload()  # imports are not part of the load

    backend.barrier()
    t0 = time.perf_counter()
    model = sw.from_pretrained(cls, folder, mesh=mesh, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        logits = pm.output_of("llama", model(**pm.inputs("llama")))
    record = {"rank": backend.rank, "node": int(os.environ["GROUP_RANK"]), "seconds": seconds,
              "bytes_read": model.result.bytes_read, "logits_sum": float(logits.double().sum())}
    (Path(out) / f"rank{backend.rank}.json").write_text(json.dumps(record))
    sw.shutdown_backend()


def run_nodes(folder: Path, mode: str, timeout: float) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix=f"shardwise-replicas-{mode}-"))
    return torchrun_nodes([__file__, "--worker", str(folder), str(out), mode], out, timeout=timeout)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-size", default="1GB")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "shardwise-bench-peers"))
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    model = pm.llama_checkpoint(Path(args.dir) / "llama", parse_size(args.llama_size))
    runs: dict[str, list] = {m: [] for m in MODES}
    for _ in range(args.repeat):
        for mode in MODES:
            warm_file_cache([str(f) for f in model.files])
            runs[mode].append(run_nodes(model.folder, mode, args.timeout))
    rows = []
    for mode, results in runs.items():
        results.sort(key=lambda ranks: max(r["seconds"] for r in ranks))
        ranks = results[len(results) // 2]
        node = [sum(r["bytes_read"] for r in ranks if r["node"] == n) for n in (0, 1)]
        sums = {round(r["logits_sum"], 3) for r in ranks}
        rows.append({"mode": MODES[mode], "node0_gb": node[0] / GB, "node1_gb": node[1] / GB,
                     "job_gb": sum(node) / GB, "x_ckpt": sum(node) / model.total_bytes,
                     "seconds": max(r["seconds"] for r in ranks),
                     "same_logits": "yes" if len(sums) == 1 else f"no: {sorted(sums)}"})
    columns = [("mode", "mesh"), ("node0_gb", "node 0 read GB", ".3f"), ("node1_gb", "node 1 read GB", ".3f"),
               ("job_gb", "job read GB", ".3f"), ("x_ckpt", "job read ÷ checkpoint"),
               ("seconds", "load s (slowest rank)"), ("same_logits", "same logits on every rank")]
    notes = (f"{model.description}: {model.total_bytes / GB:.3f} GB. Two torchrun nodes of 2 gloo ranks on "
             "this machine (loopback), sw.from_pretrained on every rank; read GB is LoadResult.bytes_read "
             "summed over a node's ranks (bytes read from storage). Both nodes share one warm page cache, so "
             f"the seconds do not show shared storage. Median of {args.repeat} run(s). Command: "
             f"`python3 benchmarks/replicas.py {' '.join(sys.argv[1:])}`.")
    print(write_results("replicas", rows, columns, notes))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main()
