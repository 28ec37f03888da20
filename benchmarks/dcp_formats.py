"""Distributed checkpoint formats, saved and loaded at the same degree in one run:

- ``sw distcp``: ``sw.save(model, path, distributed=True)`` / ``sw.load`` (DCP ``.distcp`` files
  and a pickled ``.metadata``);
- ``sw safetensors``: ``sw.save(..., distributed=True, format="safetensors")`` / the sharded
  safetensors loader (rank-local safetensors with ``DCP_SHARDING_INFO``; no pickle);
- ``torch distcp``: ``dcp.save(model.state_dict())`` / ``dcp.load`` into fresh tensors;
- ``torch hf``: the same through torch's ``HuggingFaceStorageWriter(save_distributed=True)`` /
  ``HuggingFaceStorageReader`` (what transformers' ``save_pretrained(distributed_checkpoint=True)``
  runs).

    nice python3 benchmarks/dcp_formats.py --size 200MB --degree 2 --repeats 3

Seconds are the slowest rank's, barrier to barrier, median of the repeats; the methods rotate
their order each repeat; page cache warm (each load reads what was just written). Ratios are
to ``torch distcp``. The model is ``_common.bench_model`` (the toy of ``shardwise.testing.model``;
bfloat16, packed gate|up). Prints a markdown table and saves
``benchmarks/results/dcp_formats.json`` (``_common.results_dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from _common import (
    GB,
    bench_plan,
    checkpoint_model,
    machine_info,
    make_checkpoint,
    markdown_table,
    real_plan,
    results_dir,
)
from dcp import _build, _empty_like, _timed

import shardwise as sw
from shardwise.testing import parse_size, spawn

METHODS = ("sw distcp", "sw safetensors", "torch distcp", "torch hf")


def _save(method: str, model, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    if method == "sw distcp":
        sw.save(model, folder, distributed=True)
    elif method == "sw safetensors":
        sw.save(model, folder, distributed=True, format="safetensors")
    elif method == "torch distcp":
        dcp.save(model.state_dict(), checkpoint_id=folder)
    else:
        dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True))


def _load(method: str, model, folder: str, ckpt: str, plan, mesh) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    if method.startswith("sw"):
        with torch.device("meta"):
            fresh = checkpoint_model(ckpt, dtype=torch.bfloat16)
        # both formats go through sw.load's one pipeline (its source is detected from the files)
        return _timed(lambda: sw.load(fresh, folder, plan=plan, mesh=mesh))
    # the destination tensors are allocated inside the timing, as shardwise's loads allocate theirs
    if method == "torch distcp":
        return _timed(lambda: dcp.load(_empty_like(model.state_dict()), checkpoint_id=folder))
    return _timed(lambda: dcp.load(_empty_like(model.state_dict()),
                                   storage_reader=HuggingFaceStorageReader(folder)))


def formats_rank(ckpt: str, work: str, degree: int, repeats: int) -> dict:
    import torch.distributed as dist

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=degree)
    plan = real_plan(bench_plan())
    model = _build(ckpt, plan, mesh)
    out = {f"{op} {m}": [] for op in ("save", "load") for m in METHODS}
    for i in range(repeats):
        order = METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)]
        for method in order:
            folder = f"{work}/{method.replace(' ', '-')}-{i}"
            seconds, _ = _timed(lambda m=method, f=folder: _save(m, model, f))
            out[f"save {method}"].append(seconds)
        for method in order:
            folder = f"{work}/{method.replace(' ', '-')}-{i}"
            seconds, _ = _load(method, model, folder, ckpt, plan, mesh)
            out[f"load {method}"].append(seconds)
        dist.barrier()
        if backend.rank == 0:
            for method in METHODS:
                shutil.rmtree(f"{work}/{method.replace(' ', '-')}-{i}", ignore_errors=True)
        dist.barrier()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="200MB", help="checkpoint size (bfloat16)")
    p.add_argument("--degree", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="shardwise-formats-bench-"))
    try:
        ckpt = make_checkpoint(work / "source", parse_size(args.size), parse_size("256MB"))
        total = ckpt.total_bytes
        per_rank = spawn(formats_rank, args.degree, timeout=args.timeout,
                         args=(str(ckpt.path), str(work), args.degree, args.repeats))

        def median(key: str) -> float:  # of the slowest rank's seconds per repeat
            return statistics.median(max(r[key][i] for r in per_rank) for i in range(args.repeats))

        rows = []
        for op in ("save", "load"):
            base = median(f"{op} torch distcp")
            for method in METHODS:
                s = median(f"{op} {method}")
                rows.append({"case": f"{op} tp={args.degree}", "method": method, "seconds": s,
                             "ratio": s / base, "gbs": total / s / GB})
        columns = [("case", "case"), ("method", "method"), ("seconds", "s", ".3f"),
                   ("ratio", "x torch distcp", ".2f"), ("gbs", "GB/s", ".2f")]
        table = markdown_table(rows, columns)
        print(f"{total / GB:.2f} GB bfloat16 bench-model toy, tp={args.degree}, median of {args.repeats}; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n\n{table}")
        out_dir = results_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "dcp_formats.json").write_text(json.dumps(
            {"name": "dcp_formats", "machine": machine_info(), "bytes": total, "rows": rows,
             "per_rank": per_rank, "load_average": os.getloadavg()[0]}, indent=1, default=str) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
