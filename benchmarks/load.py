"""Load benchmark: the page-cache limit, the two baselines users have today, and sw.load.

    python3 benchmarks/load.py --size 4GB --file-size 1GB --degrees 1 2 4

Rows (all from a page-cache-warm checkpoint; every file is read once before each phase):

- page cache -> buffer: ``readinto`` every file into ONE preallocated, pre-touched buffer
  of the largest file's size. The memory-bandwidth ceiling for any loader here.
- page cache -> fresh memory, per rank at tp=N: each of N spawned ranks reads 1/N of every
  file into buffers allocated just before (first touch inside the read), with sw.load's
  default thread count, and keeps them. The ceiling for a loader that returns new tensors.
- A, one process: ``safetensors.torch.load_file`` of every file, each tensor copied into
  fresh memory (``.clone()``). ``load_file`` returns lazy mmap views; "I have the tensors
  in memory" means owned, resident tensors that outlive the file mapping, so we copy.
- B, per rank at tp=N: what users do today under tensor parallelism. Each of N spawned
  ranks does A for the whole checkpoint, then keeps its shard of each planned tensor (a
  contiguous copy) and drops the full tensors.
- shardwise: ``sw.load`` of a meta-device model on N spawned gloo ranks (see the hook
  ``shardwise_load`` below); "not available" until ``sw.load`` exists.

Per rank: seconds (the slowest rank counts), peak RSS above the rank's level before the
load, bytes read (``/proc/self/io`` rchar, plus the file pages faulted in through mmap,
which rchar does not count), GB/s = bytes read / seconds, CPU seconds in user space and in
the kernel. GB/s all ranks = the ranks' bytes over the slowest rank's seconds. Ratios are
against A and B measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _common import (
    GB,
    PeakRSS,
    checkpoint_model,
    drop_file_cache,
    io_delta,
    make_checkpoint,
    mem_available,
    proc_io,
    proc_status,
    real_plan,
    shard_specs,
    warm_file_cache,
    write_results,
)
from _phases import BREAKDOWN_COLUMNS, LoadPhases, breakdown_rows
from _phases import prepare as prepare_phases
from safetensors.torch import load_file

from shardwise.testing import expected_shard, parse_size, spawn

# --- what each rank runs (module level, so spawn can pickle them) ---------------------------

def _materialise(files) -> tuple[dict[str, torch.Tensor], int]:
    """``load_file`` every file and copy each tensor into fresh memory.

    Returns the tensors and the bytes of file pages faulted in through mmap (the
    RssFile growth while a file's views are alive), which ``rchar`` does not see.
    """
    state: dict[str, torch.Tensor] = {}
    mapped = 0
    for path in files:
        before = proc_status().get("RssFile", 0)
        views = load_file(path)
        state.update({name: view.clone() for name, view in views.items()})
        mapped += max(0, proc_status().get("RssFile", 0) - before)
        del views  # the last reference to this file's mmap: unmapped here, before the next file
    return state, mapped


def _cpu_since(start: os.times_result) -> dict:
    """CPU seconds of this process (all threads) since ``start``, in user space and in the kernel."""
    now = os.times()
    return {"cpu_user": now.user - start.user, "cpu_sys": now.system - start.system}


def _rank_figures(seconds: float, peak: PeakRSS, io: dict, mapped: int, local, cpu: dict) -> dict:
    rchar = io.get("rchar", 0)
    return {"rank": int(os.environ.get("RANK", 0)), "seconds": seconds, **peak.as_dict(), **cpu,
            "rchar": rchar, "disk_read_bytes": io.get("read_bytes", 0), "mmap_bytes": mapped,
            "bytes_read": rchar + mapped, "local_bytes": sum(t.numel() * t.element_size() for t in local)}


def baseline_a_rank(files: list[str]) -> dict:
    """Baseline A on this process: the whole model, materialised."""
    with PeakRSS() as peak:
        io0, t0, cpu0 = proc_io(), time.perf_counter(), os.times()
        state, mapped = _materialise(files)
        seconds = time.perf_counter() - t0
        cpu = _cpu_since(cpu0)
        io = io_delta(io0, proc_io())
    return _rank_figures(seconds, peak, io, mapped, state.values(), cpu)


def baseline_b_rank(files: list[str], specs: dict, degree: int) -> dict:
    """Baseline B on one rank: load everything, keep this rank's shard of each planned tensor."""
    rank = int(os.environ["RANK"])
    with PeakRSS() as peak:
        io0, t0, cpu0 = proc_io(), time.perf_counter(), os.times()
        state, mapped = _materialise(files)
        for name, spec in specs.items():
            # a contiguous copy; the full tensor is freed
            state[name] = expected_shard(state[name], spec, degree, rank)
        seconds = time.perf_counter() - t0
        cpu = _cpu_since(cpu0)
        io = io_delta(io0, proc_io())
    return _rank_figures(seconds, peak, io, mapped, state.values(), cpu)


# --- shardwise hook: the streaming loader plugs in here ---------------------------------------

def shardwise_rank(ckpt_dir: str, plan: dict[str, str], degree: int) -> dict:
    """``sw.load`` on one rank of a tp=``degree`` gloo mesh, into a meta-device bench_model.

    On a CPU, sw.load keeps a region that is contiguous on disk and needs no cast as a view
    of the page cache (zero copy): its pages come in when first touched. So that the peak RSS
    compares with A and B (owned, resident tensors), every page of every local tensor is
    touched once after the load, inside the peak but outside the seconds (``touch_s``).
    """
    import shardwise as sw

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=degree)
    t_meta = time.perf_counter()
    with torch.device("meta"):
        model = checkpoint_model(ckpt_dir, dtype=torch.bfloat16)
    construct = time.perf_counter() - t_meta
    loader_import = prepare_phases()  # before the clock: the phase timer wraps what the loader refers to
    with PeakRSS() as peak:
        file_rss, io0, t0, cpu0 = proc_status().get("RssFile", 0), proc_io(), time.perf_counter(), os.times()
        with LoadPhases() as phases:  # its steps: imports, plan, detect, read, place, wire
            result = sw.load(model, ckpt_dir, plan=real_plan(plan), mesh=mesh)
        seconds = time.perf_counter() - t0
        cpu = _cpu_since(cpu0)
        io = io_delta(io0, proc_io())
        params = dict(model.named_parameters())
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params.values()]
        t1 = time.perf_counter()
        for t in local:  # one byte of every page
            t.detach().reshape(-1).view(torch.uint8)[::4096].sum()
        touch = time.perf_counter() - t1
        mapped = max(0, proc_status().get("RssFile", 0) - file_rss)  # the views' pages, once touched
    left = [n for n, p in params.items() if p.is_meta]
    if left:
        raise RuntimeError(f"sw.load left {len(left)} parameters on the meta device, e.g. {left[:3]}")
    figures = _rank_figures(seconds, peak, io, mapped, local, cpu)
    # what it read, by its own count: rchar misses the strided copies made through a mapping
    return {**figures, "bytes_read": result.bytes_read, "touch_s": touch, "phases": phases.seconds,
            "construct_s": construct, "loader_import_s": loader_import}


def shardwise_load(ckpt_dir, plan: dict[str, str], degree: int, *, timeout: float = 600) -> list[dict] | None:
    """Per-rank figures of ``sw.load`` at ``degree``; None while shardwise has no ``load``."""
    import shardwise as sw

    try:
        sw.load  # noqa: B018 - the lazy attribute imports the loader
    except AttributeError:
        return None
    except ModuleNotFoundError as e:  # announced in shardwise/__init__ but not written yet
        if not (e.name or "").startswith("shardwise"):
            raise
        return None
    return spawn(shardwise_rank, degree, args=(str(ckpt_dir), plan, degree), timeout=timeout)


# --- phases ----------------------------------------------------------------------------------

def page_cache_limit(files: list[str]) -> dict:
    """Seconds and bytes to ``readinto`` every file, in turn, into one warm buffer."""
    sizes = [os.path.getsize(f) for f in files]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)  # zeros: pre-touched, no page faults inside
    view = memoryview(buf.numpy())
    io0, t0, cpu0 = proc_io(), time.perf_counter(), os.times()
    for path, size in zip(files, sizes, strict=True):
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < size and (n := f.readinto(view[done:size])):
                done += n
    seconds = time.perf_counter() - t0
    cpu = _cpu_since(cpu0)
    rchar = io_delta(io0, proc_io()).get("rchar", sum(sizes))
    return {"rank": 0, "seconds": seconds, "rchar": rchar, "bytes_read": rchar, "mmap_bytes": 0,
            "peak_rss": None, "local_bytes": max(sizes), **cpu}


def _read_fresh(spans: list[tuple[str, int, int]], threads: int, piece: int = 32 << 20) -> list[torch.Tensor]:
    """Read each ``(file, start, end)`` into a freshly allocated buffer, in pieces over
    ``threads`` threads (as sw.load reads), and keep every buffer (as a load keeps its tensors)."""
    bufs, fds, jobs = [], [], []
    try:
        for path, lo, hi in spans:
            fds.append(os.open(path, os.O_RDONLY))
            bufs.append(torch.empty(hi - lo, dtype=torch.uint8))  # fresh: first touch in preadv
            view = memoryview(bufs[-1].numpy())
            jobs += [(fds[-1], view[a : min(a + piece, hi - lo)], lo + a) for a in range(0, hi - lo, piece)]

        def read(job):
            fd, view, pos = job
            done = 0
            while done < len(view) and (n := os.preadv(fd, [view[done:]], pos + done)):
                done += n

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, jobs))
    finally:
        for fd in fds:
            os.close(fd)
    return bufs


def fresh_memory_rank(files: list[str], degree: int) -> dict:
    """The page cache into fresh memory on one of ``degree`` ranks: this rank's 1/degree of
    every file, into buffers allocated just before, with sw.load's default thread count."""
    rank = int(os.environ.get("RANK", 0))
    if degree > 1:  # start together, as sw.load's ranks do after their rendezvous
        import torch.distributed as dist

        import shardwise as sw

        sw.init_backend("gloo")
        dist.barrier()
    threads = max(1, min(8, (os.cpu_count() or 1) // degree))
    spans = []
    for path in files:
        size = os.path.getsize(path)
        spans.append((path, size * rank // degree, size * (rank + 1) // degree))
    with PeakRSS() as peak:
        io0, t0, cpu0 = proc_io(), time.perf_counter(), os.times()
        bufs = _read_fresh(spans, threads)
        seconds = time.perf_counter() - t0
        cpu = _cpu_since(cpu0)
        io = io_delta(io0, proc_io())
    return _rank_figures(seconds, peak, io, 0, bufs, cpu)


def _prepare_cache(files: list[str], cache: str) -> None:
    if cache == "cold":
        drop_file_cache(files)
    else:
        warm_file_cache(files)


def run_phase(fn, files, args) -> list[dict] | None:
    """Run ``fn()`` ``args.repeat`` times from the stated cache state; the per-rank
    figures of the run whose slowest rank is the median."""
    runs = []
    for _ in range(args.repeat):
        _prepare_cache(files, args.cache)
        ranks = fn()
        if ranks is None:  # the method is not available
            return None
        runs.append(ranks)
    runs.sort(key=lambda ranks: max(r["seconds"] for r in ranks))
    return runs[len(runs) // 2]


def summarise(method: str, degree: int, ranks: list[dict] | None, note: str = "") -> dict:
    """One table row from per-rank figures: the slowest rank's time, the largest peak."""
    row = {"method": method, "degree": degree, "note": note, "ranks": ranks}
    if not ranks:
        return row
    seconds = max(r["seconds"] for r in ranks)
    peaks = [r["peak_rss"] for r in ranks if r.get("peak_rss") is not None]
    row.update(seconds=seconds,
               read_gb=max(r["bytes_read"] for r in ranks) / GB,
               gbps=sum(r["bytes_read"] / r["seconds"] for r in ranks) / len(ranks) / GB,
               agg_gbps=sum(r["bytes_read"] for r in ranks) / seconds / GB,
               rss_gb=max(peaks) / GB if peaks else None,
               anon_gb=max(r["peak_anon"] for r in ranks) / GB if peaks else None,
               rss_method=ranks[0].get("rss_method"))
    return row


def add_ratios(rows: list[dict]) -> None:
    """time and RSS against A, and against B at the same degree, as their own columns."""
    def ratio(row, base, key):
        if base is None or row.get(key) is None or not base.get(key):
            return None
        return row[key] / base[key]

    a = next((r for r in rows if r["method"].startswith("A") and "seconds" in r), None)
    b = {r["degree"]: r for r in rows if r["method"].startswith("B") and "seconds" in r}
    for row in rows:
        row["time_vs_a"], row["rss_vs_a"] = ratio(row, a, "seconds"), ratio(row, a, "rss_gb")
        if row["method"].startswith("shardwise"):
            base = b.get(row["degree"])
            row["time_vs_b"], row["rss_vs_b"] = ratio(row, base, "seconds"), ratio(row, base, "rss_gb")


def _room(need: float, keep_cached: int) -> str:
    """'' when ``need`` bytes fit in RAM beside the cached checkpoint, else why we skip."""
    avail = mem_available() - keep_cached
    if need <= avail:
        return ""
    return f"skipped: needs ~{need / GB:.1f} GB of free RAM, {max(avail, 0) / GB:.1f} GB available"


COLUMNS = [
    ("method", "method"), ("degree", "tp"), ("seconds", "s"), ("gbps", "GB/s per rank"),
    ("agg_gbps", "GB/s all ranks"),
    ("read_gb", "read GB/rank"), ("rss_gb", "peak RSS GB/rank"),
    ("time_vs_a", "time ×A"), ("rss_vs_a", "RSS ×A"), ("time_vs_b", "time ×B"),
    ("rss_vs_b", "RSS ×B"), ("note", "note"),
]


def _notes(ckpt, args, rows: list[dict]) -> str:
    cfg = ckpt.config
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"Checkpoint: {ckpt.total_bytes / GB:.2f} GB of {cfg['dtype']} in {len(ckpt.files)} files "
        f"(--file-size {args.file_size}), a Llama-like stack of {cfg['num_layers']} layers, hidden "
        f"{cfg['hidden']}, vocab {cfg['vocab']}; q/k/v colwise, o rowwise, packed gate_up "
        f"PackedColwise([1, 1]), down rowwise; embedding and norms replicated. Page cache "
        f"{args.cache} before every phase (every file read once just before; a warm cache is "
        f"what a second load sees, not a disk). Ranks are local processes with 1 torch thread "
        f"each, sharing the machine's cores (at tp above the core count they wait for each "
        f"other). Median of {args.repeat} run(s), by the slowest rank. Command: "
        f"`python3 benchmarks/load.py --size {args.size} --file-size {args.file_size} --degrees "
        f"{' '.join(map(str, args.degrees))} --repeat {args.repeat}`.\n\n"
        "A and B copy every tensor out of `load_file`'s mmap views (`.clone()`), so the "
        "tensors are owned and resident. Peak RSS is above each process's level before the load "
        "(VmHWM reset via /proc/self/clear_refs, checked by a 5 ms VmRSS sampler); for A and B it "
        "includes up to one file of mmap'd page-cache pages (the anonymous peak is in the JSON). "
        "Read GB counts read() bytes (rchar) plus file pages faulted in through mmap. ×A and ×B "
        "are ratios to A and to B at the same tp in this run (below 1 is better). GB/s all ranks "
        "is the bytes every rank read over the slowest rank's seconds.\n\n"
        "Limits. \"page cache → buffer\" copies the files into one buffer that is already "
        "faulted in: the memory-copy ceiling, which no loader that returns new tensors can reach, "
        "since every byte it returns lands on a page touched for the first time. \"page cache → "
        "fresh memory\" reads 1/tp of every file on each of tp processes into buffers allocated "
        "just before, with sw.load's thread count: the ceiling for a materialising load here. A "
        "first touch is a page fault that zeroes a 4 KiB page; sw.load spends most of its CPU time "
        "in the kernel (figures below), and perf puts page zeroing and faulting well above the "
        "copy itself. Transparent huge pages (THP is in madvise mode) do not help on this VM: its "
        "balloon reports free 2 MiB blocks back to the host, so a huge-page fault is 4-5x cheaper "
        "than 4 KiB faults when the host still backs the block and about 3x dearer when the block "
        "was reported, the usual state (sw.load with MADV_HUGEPAGE destinations took 2.2x as long "
        "at tp=1; measured outside this script). With more ranks than the machine's "
        f"{cores} cores the ranks share them (and the machine is shared with other jobs), so "
        "their aggregate is bounded by the cores' first-touch copying, not by the page cache. "
        "Replicated tensors (the embedding, the norms) are read and held whole by every rank, on "
        "top of checkpoint/tp. On a CPU, sw.load materialises only what it must (column slices, "
        "packed shards, casts) and keeps a region that is one run on disk as a private view of the "
        "page cache (zero copy), so it is not bounded by fresh memory; its peak RSS includes every "
        "page of its tensors, touched once after the load (the touch is outside its seconds and "
        "listed below), and its read GB is its own count of the bytes it read or mapped."
        + _limits_note(rows, ckpt.total_bytes)
    )


def _limits_note(rows: list[dict], total: int) -> str:
    """This run's shardwise figures against the limits and against its local tensors."""
    def first(method, degree=None):
        return next((r for r in rows if r["method"].startswith(method) and "seconds" in r
                     and degree in (None, r["degree"])), None)

    warm = first("page cache → buffer")
    lines = []
    for row in rows:
        if not (row["method"].startswith("shardwise") and "seconds" in row):
            continue
        tp, fresh = row["degree"], first("page cache → fresh memory", row["degree"])
        local = max(r["local_bytes"] for r in row["ranks"])
        line = f"tp={tp}: {row['agg_gbps']:.2f} GB/s all ranks"
        if warm:
            line += f" = {row['agg_gbps'] / warm['agg_gbps']:.0%} of the buffer limit"
        if fresh:
            line += f" and {row['agg_gbps'] / fresh['agg_gbps']:.0%} of fresh memory on {tp} rank(s)"
        touch = max((r.get("touch_s", 0.0) for r in row["ranks"]), default=0.0)
        if touch:
            line += f", {touch:.2f} s to touch every page afterwards"
        cpu = [(r["cpu_user"], r["cpu_sys"]) for r in row["ranks"]]
        user, kernel = sum(u for u, _ in cpu), sum(k for _, k in cpu)
        if user + kernel > 0:
            share = kernel / (user + kernel)
            line += f", {(user + kernel) / len(cpu):.2f} CPU s/rank, {share:.0%} of it in the kernel"
        if row.get("rss_gb"):
            line += (f"; peak RSS {row['rss_gb']:.3f} GB/rank = {row['rss_gb'] * GB / local:.3f} x its "
                     f"local tensors ({local / GB:.3f} GB = {local * tp / total:.3f} x checkpoint/{tp})")
        lines.append(line)
    return (" This run: " + "; ".join(lines) + ".") if lines else ""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="4GB", help="checkpoint size, e.g. 512MB, 4GB (default 4GB)")
    p.add_argument("--file-size", default="1GB", help="largest file of the checkpoint (default 1GB)")
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4], help="tp degrees (1 2 4)")
    p.add_argument("--dir", help="checkpoint folder (reused when it holds the same checkpoint)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint this run wrote")
    p.add_argument("--repeat", type=int, default=1, help="runs per phase; the median is reported")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", choices=["warm", "cold"], default="warm",
                   help="page cache before each phase; cold is best effort (posix_fadvise)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per spawned phase")
    args = p.parse_args(argv)
    if args.repeat < 1 or any(d < 1 for d in args.degrees):
        p.error("--repeat and --degrees must be positive")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="shardwise-bench-load-"))
    t0 = time.perf_counter()
    ckpt = make_checkpoint(folder, parse_size(args.size), parse_size(args.file_size),
                           layers=args.layers, seed=args.seed)
    log(f"checkpoint {folder}: {ckpt.total_bytes / GB:.2f} GB in {len(ckpt.files)} files "
        f"({'reused' if ckpt.reused else f'written in {time.perf_counter() - t0:.1f} s'})")
    files = [str(f) for f in ckpt.files]
    total, timeout = ckpt.total_bytes, args.timeout
    rows = []
    try:
        log("page cache -> buffer")
        rows.append(summarise("page cache → buffer (readinto)", 1,
                              run_phase(lambda: [page_cache_limit(files)], files, args)))
        log("A: load_file + clone, one process")
        skip = _room(1.1 * total, total)
        rows.append(summarise("A: load_file + clone", 1, None if skip else run_phase(
            lambda: spawn(baseline_a_rank, 1, args=(files,), timeout=timeout), files, args), skip))
        rows.append(_fresh_row(1, files, args))
        log("shardwise, one process")
        rows.append(_shardwise_row(ckpt, 1, files, args))
        for degree in args.degrees:
            log(f"B: load_file + clone + split on {degree} rank(s)")
            skip = _room(1.1 * degree * total, total)
            specs = shard_specs(ckpt.config, ckpt.plan, degree)
            ranks = None if skip else run_phase(
                lambda d=degree, s=specs: spawn(baseline_b_rank, d, args=(files, s, d), timeout=timeout),
                files, args)
            rows.append(summarise("B: load_file + clone + split", degree, ranks, skip))
            if degree > 1:
                rows.append(_fresh_row(degree, files, args))
                log(f"shardwise on {degree} ranks")
                rows.append(_shardwise_row(ckpt, degree, files, args))
    finally:
        if not args.keep and not ckpt.reused:
            for f in [*ckpt.files, folder / "model.safetensors.index.json"]:
                Path(f).unlink(missing_ok=True)
            if not args.dir:
                shutil.rmtree(folder, ignore_errors=True)
    add_ratios(rows)
    table = write_results("load", [{k: v for k, v in r.items() if k != "ranks"} for r in rows],
                          COLUMNS, _notes(ckpt, args, rows),
                          extra={"config": ckpt.config, "total_bytes": total,
                                 "per_rank": [{"method": r["method"], "degree": r["degree"],
                                               "ranks": r["ranks"]} for r in rows]})
    print(table)
    fresh = {r["degree"]: r["ranks"] for r in rows
             if r["method"].startswith("page cache → fresh") and r["ranks"]}
    steps = [row for r in rows if r["method"].startswith("shardwise") and r["ranks"]
             for row in breakdown_rows(r["degree"], r["ranks"], fresh.get(r["degree"]))]
    print(write_results("load-breakdown", steps, BREAKDOWN_COLUMNS, _BREAKDOWN_NOTES + f" Command: `python3 "
                        f"benchmarks/load.py --size {args.size} --file-size {args.file_size} --degrees "
                        f"{' '.join(map(str, args.degrees))} --repeat {args.repeat}`."))


_BREAKDOWN_NOTES = (
    "Per rank, the run of `load` above whose slowest rank is the median: where one rank's `sw.load` "
    "goes (benchmarks/_phases.py). Loader import: shardwise's loader (`shardwise.io.load` and the "
    "holdings' modules) imported before the clock, so the steps can be timed (the first `sw.load` "
    "of a process would import it inside the call); imports: those inside the call (also inside "
    "the step that made them), plan (resolve_for_mesh), detect (open the source: format, listing, "
    "headers; match keys; plan "
    "this rank's reads), read (bytes into the rank's tensors), place (install less wire), wire, other "
    "(guards, buffers). Construct on meta: the model built on the meta device before the call. The "
    "copy limit is measured in the same run: the bytes this rank places (its local tensors) over the "
    "page cache -> fresh memory bandwidth of one rank at this tp (the row above); copy limit ÷ load "
    "is the share of that limit the load reaches (1 = at the limit; above 1, zero-copy views of "
    "the page cache beat copying).")


def _fresh_row(degree: int, files: list[str], args) -> dict:
    print(f"page cache -> fresh memory on {degree} rank(s)", file=sys.stderr, flush=True)
    ranks = run_phase(lambda: spawn(fresh_memory_rank, degree, args=(files, degree), timeout=args.timeout),
                      files, args)
    return summarise("page cache → fresh memory", degree, ranks)


def _shardwise_row(ckpt, degree: int, files: list[str], args) -> dict:
    ranks = run_phase(lambda: shardwise_load(ckpt.path, ckpt.plan, degree, timeout=args.timeout),
                      files, args)
    note = "" if ranks else "not available: this checkout has no sw.load yet"
    return summarise("shardwise sw.load", degree, ranks, note)


if __name__ == "__main__":
    main()
