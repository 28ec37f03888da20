"""Distributed checkpoint benchmark: shardwise's canonical DCP against plain
torch.distributed.checkpoint, measured in the same run on the same model.

    python3 benchmarks/dcp.py --size 1GB --degrees 1 2 4

Rows:

- save / load at degree N: ``sw.save(model, path, distributed=True)`` and ``sw.load`` of a
  meta-device model, against ``dcp.save(model.state_dict())`` and ``dcp.load`` into freshly
  allocated tensors of the same layout (plain DCP's own planners). Seconds are those of the
  slowest rank (barrier to barrier), the median of ``--repeats`` runs; the two methods
  alternate. Target: shardwise within 10% of plain DCP.
- reshard 2 -> 4: ``sw.load`` at tp=4 of the checkpoint saved at tp=2; peak RSS of each rank
  above its level before the load. Target: at most 1.2 x checkpoint / 4.
- consolidate: ``sw.consolidate`` (one process) of the tp=4 checkpoint against torch's
  ``consolidate_safetensors_files`` of the same state dict saved at tp=4 by DCP's
  ``HuggingFaceStorageWriter`` (float tensors: torch's crashes on integer ones). GB/s =
  checkpoint bytes / seconds, best of ``--repeats``; page cache warm for both.
  Target: shardwise at least as fast.

The model is ``_common.bench_model`` (the toy of ``shardwise.testing.model``; bfloat16, packed
gate|up), built from a generated safetensors checkpoint with ``sw.load``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import GB, PeakRSS, bench_plan, checkpoint_model, make_checkpoint, real_plan, write_results

import shardwise as sw
from shardwise.testing import parse_size, spawn

# --- what each rank runs ----------------------------------------------------------------------

def _timed(fn) -> tuple[float, PeakRSS]:
    """Seconds from a barrier before ``fn`` to a barrier after it (the slowest rank sets it)."""
    import torch.distributed as dist

    dist.barrier()
    with PeakRSS() as peak:
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - start
    return seconds, peak


def _build(ckpt: str, plan, mesh):
    with torch.device("meta"):
        model = checkpoint_model(ckpt, dtype=torch.bfloat16)
    sw.load(model, ckpt, plan=plan, mesh=mesh)
    return model


def _empty_like(state_dict: dict) -> dict:
    """Freshly allocated tensors laid out like ``state_dict`` (DTensors stay DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state_dict.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.empty_like(v.to_local()), v.device_mesh, v.placements,
                                        shape=v.shape, stride=v.stride(), run_check=False)
        else:
            out[k] = torch.empty_like(v)
    return out


def degree_rank(ckpt: str, work: str, degree: int, repeats: int, hf: bool) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=degree)
    plan = real_plan(bench_plan())
    model = _build(ckpt, plan, mesh)
    rows = {"save_sw": [], "save_dcp": [], "load_sw": [], "load_dcp": [],
            "peak_save_sw": 0, "peak_save_dcp": 0, "peak_load_sw": 0, "peak_load_dcp": 0}
    for i in range(repeats):
        sw_dir, dcp_dir = f"{work}/sw-{degree}-{i}", f"{work}/dcp-{degree}-{i}"
        for method in (("sw", "dcp") if i % 2 == 0 else ("dcp", "sw")):
            if method == "sw":
                s, p = _timed(lambda d=sw_dir: sw.save(model, d, distributed=True))
            else:
                s, p = _timed(lambda d=dcp_dir: dcp.save(model.state_dict(), checkpoint_id=d))
            rows[f"save_{method}"].append(s)
            rows[f"peak_save_{method}"] = max(rows[f"peak_save_{method}"], p.bytes)
        for method in (("dcp", "sw") if i % 2 == 0 else ("sw", "dcp")):
            if method == "sw":
                with torch.device("meta"):
                    fresh = checkpoint_model(ckpt, dtype=torch.bfloat16)
                s, p = _timed(lambda f=fresh, d=sw_dir: sw.load(f, d, plan=plan, mesh=mesh))
                del fresh
            else:
                s, p = _timed(lambda d=dcp_dir: dcp.load(_empty_like(model.state_dict()), checkpoint_id=d))
            rows[f"load_{method}"].append(s)
            rows[f"peak_load_{method}"] = max(rows[f"peak_load_{method}"], p.bytes)
        dist.barrier()
        if backend.rank == 0 and i < repeats - 1:  # keep the last pair for reshard/consolidate
            shutil.rmtree(sw_dir)
            shutil.rmtree(dcp_dir)
        dist.barrier()
    if hf:  # the same state dict for torch's consolidation
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(
            path=f"{work}/hf-{degree}", save_distributed=True))
    return rows


def reshard_rank(ckpt: str, src: str, shard_embedding: bool) -> dict:
    from shardwise import testing

    testing.preload()  # before the baseline: modules are not the load's memory

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=4)
    with torch.device("meta"):
        model = checkpoint_model(ckpt, dtype=torch.bfloat16)
    plan = real_plan(bench_plan())
    if shard_embedding:  # the canonical checkpoint loads under another plan as well
        plan["model.embed_tokens"] = "embedding_rowwise"
    seconds, peak = _timed(lambda: sw.load(model, src, plan=plan, mesh=mesh))
    local = sum(getattr(p, "_local_tensor", p).nbytes for p in model.parameters())
    return {"seconds": seconds, "peak": peak.bytes, "local": local, "rss_method": peak.method}


# --- the driver -------------------------------------------------------------------------------

def consolidation(src: str, hf: str, out: str, total: int, repeats: int) -> dict:
    from safetensors import safe_open
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    from shardwise import testing

    testing.preload()  # both imported before timing

    names = set()
    for f in Path(hf).glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            names |= set(h.keys())
    best = {"sw": float("inf"), "torch": float("inf")}
    peaks = {"sw": 0, "torch": 0}
    for i in range(repeats):
        for method in (("sw", "torch") if i % 2 == 0 else ("torch", "sw")):
            dst = Path(out) / f"{method}-{i}"
            with PeakRSS() as peak:
                start = time.perf_counter()
                if method == "sw":
                    sw.consolidate(src, dst, max_shard_size=10 * total)
                else:
                    dst.mkdir(parents=True)  # torch's hangs or fails on a missing folder
                    consolidate_safetensors_files(hf, str(dst), {n: 1 for n in names})
                seconds = time.perf_counter() - start
            best[method] = min(best[method], seconds)
            peaks[method] = max(peaks[method], peak.bytes)
            shutil.rmtree(dst)
    return {"seconds": best, "peak": peaks}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1GB", help="checkpoint size (bfloat16), e.g. 1GB")
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="shardwise-dcp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        ckpt = make_checkpoint(work / "source", parse_size(args.size), parse_size("256MB"))
        total = ckpt.total_bytes
        print(f"checkpoint: {total / GB:.2f} GB bfloat16, hidden {ckpt.config['hidden']}", flush=True)
        rows, per_degree = [], {}
        for degree in args.degrees:
            r = spawn(degree_rank, degree, args=(str(ckpt.path), str(work), degree, args.repeats,
                                                 degree == 4), timeout=args.timeout)
            per_degree[degree] = r
            for op in ("save", "load"):
                ours = statistics.median(max(x[f"{op}_sw"][i] for x in r) for i in range(args.repeats))
                theirs = statistics.median(max(x[f"{op}_dcp"][i] for x in r) for i in range(args.repeats))
                rows.append({"case": f"{op} tp={degree}", "sw_s": ours, "dcp_s": theirs,
                             "ratio": ours / theirs, "sw_gbs": total / ours / GB,
                             "sw_peak": max(x[f"peak_{op}_sw"] for x in r) / 2**20,
                             "dcp_peak": max(x[f"peak_{op}_dcp"] for x in r) / 2**20})
                print(rows[-1], flush=True)
        last = args.repeats - 1
        if 2 in args.degrees:
            for shard_embedding in (False, True):
                r = spawn(reshard_rank, 4, args=(str(ckpt.path), str(work / f"sw-2-{last}"), shard_embedding),
                          timeout=args.timeout)
                worst, shards = max(x["peak"] for x in r), max(x["local"] for x in r)
                what = "embedding vocab-parallel" if shard_embedding else "embedding replicated"
                rows.append({"case": f"reshard tp=2 -> tp=4 ({what})", "sw_s": max(x["seconds"] for x in r),
                             "sw_peak": worst / 2**20, "target": 1.2 * total / 4 / 2**20,
                             "ratio": worst / (total / 4),
                             "note": f"ratio = peak / (checkpoint/4); the shards alone are "
                                     f"{shards / 2**20:.0f} MiB ({shards / (total / 4):.2f})"})
                print(rows[-1], flush=True)
        if 4 in args.degrees:
            c = consolidation(str(work / f"sw-4-{last}"), str(work / "hf-4"), str(work / "merged"),
                              total, args.repeats)
            ours, theirs = c["seconds"]["sw"], c["seconds"]["torch"]
            rows.append({"case": "consolidate (tp=4 source)", "sw_s": ours, "dcp_s": theirs,
                         "ratio": ours / theirs, "sw_gbs": total / ours / GB, "dcp_gbs": total / theirs / GB,
                         "sw_peak": c["peak"]["sw"] / 2**20, "dcp_peak": c["peak"]["torch"] / 2**20})
            print(rows[-1], flush=True)
        columns = [("case", "case"), ("sw_s", "shardwise s", ".2f"), ("dcp_s", "plain DCP / torch s", ".2f"),
                   ("ratio", "ratio", ".2f"), ("sw_gbs", "shardwise GB/s", ".2f"),
                   ("dcp_gbs", "torch GB/s", ".2f"), ("sw_peak", "shardwise peak MiB", ".0f"),
                   ("dcp_peak", "plain/torch peak MiB", ".0f"), ("target", "target MiB", ".0f"),
                   ("note", "note")]
        degrees = " ".join(map(str, args.degrees))
        command = f"python3 benchmarks/dcp.py --size {args.size} --degrees {degrees} --repeats {args.repeats}"
        notes = (f"`{command}`: "
                 f"a {total / GB:.2f} GB bfloat16 bench-model toy (packed gate|up), "
                 "gloo ranks on this machine's cores, page cache warm, files fsynced by both writers. "
                 "save/load: slowest rank, median of the repeats, ratio = shardwise / plain DCP (target "
                 "<= 1.10); load includes allocating the shards (both) and installing them (shardwise). "
                 "Peaks are per-rank RSS above the level before the call (max over ranks). reshard: "
                 "ratio = peak / (checkpoint/4), target <= 1.2. consolidate: one process, best of the "
                 "repeats, ratio = shardwise / torch seconds (target <= 1). The machine is shared: load "
                 f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end of the run, so "
                 "seconds vary by tens of percent between runs; the peaks do not.")
        print(write_results("dcp", rows, columns, notes, extra={"per_degree": per_degree}))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
