"""Several torchrun "nodes" on this machine (loopback rendezvous), for benchmarks that need
more than one node's worth of ranks (benchmarks/replicas.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from shardwise.testing import free_port


def torchrun_nodes(script: list[str], out: Path, *, timeout: float, nodes: int = 2,
                   per_node: int = 2) -> list[dict]:
    """Run ``script`` (a path and its arguments) as ``nodes`` torchrun "nodes" of ``per_node``
    ranks on this machine (loopback rendezvous) and return what each rank wrote to
    ``out/rank{r}.json``, in rank order. Raises ``RuntimeError`` with the end of the logs
    when a node fails or the run outlasts ``timeout``."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
         "--nproc-per-node", str(per_node), "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
         *script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(nodes)]
    deadline, logs = time.monotonic() + timeout, []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"torchrun failed ({[p.returncode for p in procs]}):\n" + "\n".join(logs)[-4000:])
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nodes * per_node)]


__all__ = ["torchrun_nodes"]
