"""Save benchmark: sw.save (rank-0 stream, and every rank writing its own regions) against
safetensors' save_file.

    python3 benchmarks/save.py --size 3GB --degrees 1 2 4 --repeat 3 --writes stream parallel

Rows, all writing the same bytes (one file: the checkpoint stays under max_shard_size):

- save_file, one process: the whole state dict in memory (owned copies of every tensor,
  as a trained model holds them), then ``safetensors.torch.save_file`` into one file.
  save_file does not fsync; the "+ fsync" row adds the time to make the file durable,
  which sw.save always does (it fsyncs, then renames into place).
- shardwise sw.save at tp=N: N spawned gloo ranks, each holding its shard (``sw.load`` of
  the checkpoint into a meta-device bench_model), then ``sw.save`` of the model, as the
  rank-0 stream (``parallel_write=False``: one tensor at a time gathered to rank 0, which
  writes) and in parallel (``parallel_write=True``: rank 0 lays the file out, every rank
  writes its own regions at their offsets, the checksums are read back from the file).

Figures: seconds (the slowest rank), GB/s = checkpoint bytes / seconds, peak RSS above the
process's level just before the save (rank 0, and the largest of the other ranks), rank 0's
peak divided by the largest tensor (the target is at most 2), throughput against save_file
measured in the same run. Dirty pages are flushed (``os.sync``) before every phase, so that
one phase's writeback does not land in the next. Each sw.save output is compared with
save_file's, byte for byte.
"""

from __future__ import annotations

import argparse
import filecmp
import gc
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import (
    GB,
    PeakRSS,
    bench_plan,
    checkpoint_model,
    make_checkpoint,
    mem_available,
    real_plan,
    write_results,
)
from safetensors.torch import load_file, save_file

from shardwise.testing import parse_size, spawn

WRITES = {"stream": False, "parallel": True}  # --writes: sw.save's parallel_write


# --- what each process runs (module level, so spawn can pickle them) ------------------------

def save_file_rank(files: list[str], out_file: str) -> dict:
    """save_file of the whole state dict, in a fresh process; then the fsync it skips."""
    state: dict[str, torch.Tensor] = {}
    for path in files:
        views = load_file(path)
        state.update({name: view.clone() for name, view in views.items()})
        del views  # the last reference to the file's mmap
    gc.collect()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        save_file(state, out_file, metadata={"format": "pt"})
        seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    fd = os.open(out_file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"rank": 0, "seconds": seconds, "fsync_seconds": time.perf_counter() - t0, **peak.as_dict()}


def shardwise_rank(ckpt_dir: str, out_dir: str, degree: int, parallel_write: bool = False,
                   owned: bool = True) -> dict:
    """One rank of a tp=``degree`` gloo mesh: load its shard, then time ``sw.save``.

    ``owned``: copy every shard into the process's own memory first, as save_file's process
    holds its tensors (and a trained model its weights); otherwise the shards stay the
    load's views of the page cache, and the save pays the page faults of mapping them in."""
    import shardwise as sw

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=degree)
    with torch.device("meta"):
        model = checkpoint_model(ckpt_dir, dtype=torch.bfloat16)
    sw.load(model, ckpt_dir, plan=real_plan(bench_plan()), mesh=mesh)
    if owned:
        from shardwise.testing import local_shard as local_of

        with torch.no_grad():  # a copy-on-write mapping: each page becomes the process's own
            for t in model.state_dict(keep_vars=True).values():
                local_of(t).copy_(local_of(t).clone())
    gc.collect()
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        sw.save(model, out_dir, overwrite=True, progress=False, parallel_write=parallel_write)
        seconds = time.perf_counter() - t0
    return {"rank": backend.rank, "seconds": seconds, **peak.as_dict()}


# --- phases ----------------------------------------------------------------------------------

def _row(method: str, degree: int, seconds: float | None, total: int, largest: int,
         ranks: list[dict] | None, note: str = "") -> dict:
    row = {"method": method, "degree": degree, "note": note, "ranks": ranks}
    if seconds is None:
        return row
    row.update(seconds=seconds, gbps=total / seconds / GB)
    if ranks and ranks[0].get("peak_rss") is not None:
        row.update(rank0_gb=ranks[0]["peak_rss"] / GB, rank0_x_largest=ranks[0]["peak_rss"] / largest)
        others = [r["peak_rss"] for r in ranks[1:]]
        row["others_gb"] = max(others) / GB if others else None
    return row


def _median(runs: list, key):
    return sorted(runs, key=key)[len(runs) // 2]


def _add_ratios(rows: list[dict]) -> None:
    plain = next((r for r in rows if r["method"] == "save_file" and "gbps" in r), None)
    durable = next((r for r in rows if r["method"] == "save_file + fsync" and "gbps" in r), None)
    for row in rows:
        if "gbps" in row:
            row["vs_save_file"] = row["gbps"] / plain["gbps"] if plain else None
            row["vs_durable"] = row["gbps"] / durable["gbps"] if durable else None


COLUMNS = [
    ("method", "method"), ("degree", "tp"), ("seconds", "s"), ("gbps", "GB/s"),
    ("vs_save_file", "GB/s ÷ save_file"), ("vs_durable", "GB/s ÷ save_file + fsync"),
    ("rank0_gb", "rank-0 peak RSS GB"), ("rank0_x_largest", "rank-0 peak ÷ largest tensor"),
    ("others_gb", "other ranks' peak RSS GB"), ("note", "note"),
]


def _notes(ckpt, largest: int, args) -> str:
    cfg = ckpt.config
    return (
        f"Model: {ckpt.total_bytes / GB:.2f} GB of {cfg['dtype']}, a Llama-like stack of "
        f"{cfg['num_layers']} layers, hidden {cfg['hidden']}, vocab {cfg['vocab']}; largest tensor "
        f"{largest / GB:.3f} GB. sw.save stream: gathered to rank 0, which writes; sw.save parallel: "
        "every rank writes its own regions into the file rank 0 laid out, then the checksums are "
        "read back from the file. Plan: q/k/v colwise, o rowwise, packed gate_up PackedColwise([1, 1]), "
        "down rowwise; embedding and norms replicated. Every method writes one file (sw.save: "
        "default max_shard_size 5GB), and every sw.save output was byte-identical to save_file's "
        "unless a note says otherwise. save_file does not fsync; sw.save writes into a temporary "
        "folder, fsyncs and renames it into place, so compare it with the \"+ fsync\" row for "
        "equal durability. Peak RSS is above each process's level just before the save (VmHWM "
        "reset via /proc/self/clear_refs, checked by a 5 ms VmRSS sampler). Ranks are local "
        "processes with 1 torch thread each on gloo, sharing the machine's cores (tp=4 puts "
        f"4 ranks on 2 cores). Median of {args.repeat} interleaved rounds (by the slowest rank); "
        "on a shared machine single runs vary by 2x and more, so ratios in one round matter more "
        "than absolute seconds. Command: `python3 benchmarks/save.py --size "
        f"{args.size} --degrees {' '.join(map(str, args.degrees))} --repeat {args.repeat} "
        f"--writes {' '.join(args.writes)}{' --mapped' if args.mapped else ''}`. Each rank's "
        + ("shards are the load's page-cache views (the save maps them in)." if args.mapped else
           "shards are copied into its own memory before the timed save, as save_file's are.")
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="3GB", help="model size, e.g. 512MB, 3GB (default 3GB)")
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4], help="tp degrees (1 2 4)")
    p.add_argument("--dir", help="folder for the checkpoint (reused when it holds the same one)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3, help="rounds; each row is the median (default 3)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per spawned phase")
    p.add_argument("--mapped", action="store_true",
                   help="sw.save the shards as loaded (page-cache views), not owned copies")
    p.add_argument("--writes", nargs="+", choices=WRITES, default=list(WRITES),
                   help="sw.save modes to time (default: stream parallel)")
    args = p.parse_args(argv)
    if args.repeat < 1 or any(d < 1 for d in args.degrees):
        p.error("--repeat and --degrees must be positive")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix="shardwise-bench-save-"))
    folder = Path(args.dir) if args.dir else work / "ckpt"
    ckpt = make_checkpoint(folder, parse_size(args.size), 2 * parse_size(args.size), layers=args.layers)
    total = ckpt.total_bytes
    largest = max(math.prod(shape) for _, shape in ckpt.tensors) * 2  # bf16
    files = [str(f) for f in ckpt.files]
    log(f"checkpoint {folder}: {total / GB:.2f} GB, largest tensor {largest / GB:.3f} GB")
    reference = work / "save_file.safetensors"
    room = mem_available() >= 2.2 * total
    plain: list[dict] = []
    ours: dict[tuple[str, int], list[tuple[list[dict], str]]] = {
        (w, d): [] for d in args.degrees for w in args.writes}
    try:
        for run in range(args.repeat):  # rounds interleave the methods: drift hits them alike
            if room:
                log(f"[{run + 1}/{args.repeat}] save_file, one process")
                os.sync()
                plain += spawn(save_file_rank, 1, args=(files, str(reference)), timeout=args.timeout)
            for write, degree in ours:
                log(f"[{run + 1}/{args.repeat}] sw.save {write} on {degree} rank(s)")
                out = work / f"sw-{write}-{degree}"
                os.sync()
                ranks = spawn(shardwise_rank, degree,
                              args=(str(folder), str(out), degree, WRITES[write], not args.mapped),
                              timeout=args.timeout)
                same = not reference.exists() or filecmp.cmp(reference, out / "model.safetensors",
                                                             shallow=False)
                ours[write, degree].append((ranks, "" if same else "output differs from save_file's"))
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    if plain:
        r = _median(plain, lambda r: r["seconds"])
        rows.append(_row("save_file", 1, r["seconds"], total, largest, [r]))
        durable = _median([r["seconds"] + r["fsync_seconds"] for r in plain], lambda s: s)
        rows.append(_row("save_file + fsync", 1, durable, total, largest, None))
    else:
        rows.append(_row("save_file", 1, None, total, largest, None, "skipped: not enough free RAM"))
    for (write, degree), runs in sorted(ours.items(), key=lambda kv: (kv[0][1], kv[0][0] != "stream")):
        ranks, note = _median(runs, lambda run: max(r["seconds"] for r in run[0]))
        rows.append(_row(f"shardwise sw.save {write}", degree, max(r["seconds"] for r in ranks), total,
                         largest, ranks, note))
    _add_ratios(rows)
    table = write_results("save", [{k: v for k, v in r.items() if k != "ranks"} for r in rows], COLUMNS,
                          _notes(ckpt, largest, args),
                          extra={"config": ckpt.config, "total_bytes": total, "largest_tensor": largest,
                                 "per_rank": [{"method": r["method"], "degree": r["degree"],
                                               "ranks": r["ranks"]} for r in rows],
                                 "rounds": {"save_file": plain,
                                            **{f"sw.save {w} tp={d}": [ranks for ranks, _ in runs]
                                               for (w, d), runs in ours.items()}}})
    print(table)


if __name__ == "__main__":
    main()
