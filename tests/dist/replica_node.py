"""One rank of the two-"node" replica test, started by torchrun (see test_replicas.py).

    python -m torch.distributed.run --nnodes 2 --node-rank N ... replica_node.py CKPT OUT MODE

MODE "replicas": ``mesh(dp_replicate=2, tp=2)``, each region read by one replica; "plain":
``mesh(dp_shard=2, tp=2)``, no replica axis, every node reads its tp shards itself. Writes
``OUT/rank<R>.json`` with the node, the bytes this rank read from storage and the logits.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared models

import shardwise as sw  # noqa: E402
from models import TinyTransformer, tiny_plan, tokens  # noqa: E402


def main(ckpt: str, out: str, mode: str) -> None:
    torch.set_num_threads(1)
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(dp_replicate=2, tp=2) if mode == "replicas" else backend.mesh(dp_shard=2, tp=2)
    with torch.device("meta"):
        model = TinyTransformer()
    result = sw.load(model, ckpt, plan=tiny_plan(), mesh=mesh, progress=False)
    with torch.no_grad():
        logits = model(tokens())
    record = {"rank": backend.rank, "node": int(os.environ["GROUP_RANK"]), "bytes_read": result.bytes_read,
              "logits": logits.tolist()}
    (Path(out) / f"rank{backend.rank}.json").write_text(json.dumps(record))
    sw.shutdown_backend()


if __name__ == "__main__":
    main(*sys.argv[1:4])
