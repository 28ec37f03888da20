"""Trainer weights into an inference layout, in memory: ``plan.run()`` against two baselines.

    python3 benchmarks/transfer.py [--size 1GB] [--repeat 2] [--bucket 64MiB]

Four gloo ranks on this machine. The source is the benchmarks' Llama-like model in float32
under FSDP2 x TP (``mesh(dp_shard=2, tp=2)``, ``fully_shard`` per block), the destination
the same model in bfloat16 at ``mesh(tp=4)`` on the same ranks (a hybrid engine). Per run,
the slowest rank's seconds (median of ``--repeat``), and each rank's peak resident memory
above the level before the call:

- ``plan.run()``: ``sw.transfer_plan(src, dst)`` computed once (its seconds reported apart),
  then replayed;
- ``full_tensor + slice``: each source parameter's ``DTensor.full_tensor()`` (an all-gather
  over the 4 ranks), cast, and the destination rank's slice copied in;
- ``DCP save + sw.load``: ``sw.save(src, distributed=True)`` to /dev/shm, then
  ``sw.load`` of that checkpoint into a fresh destination model at ``mesh(tp=4)``.

Every method must leave the same destination bytes on every rank (``same bytes`` column). The
benchmark plan shards gate_up plainly colwise (not packed): ``full_tensor()`` knows nothing of
packed blocks, and the baseline must be right to be a baseline.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
import time

import torch
from _common import PeakRSS, bench_model, bench_plan, write_results

from shardwise.testing import expected_shard, local_shard, parse_size, shard_state, spawn

BENCH_PLAN = {k: ("colwise" if v == "packed_colwise" else v) for k, v in bench_plan().items()}
HIDDEN, VOCAB = 1024, 32000


def _layers(size: int) -> int:
    per_layer = 16 * HIDDEN * HIDDEN * 4  # q, k, v, o + gate_up (8h x h) + down, float32
    return max(1, (size - 2 * VOCAB * HIDDEN * 4) // per_layer)  # embedding and head


def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    return fully_shard(model, mesh=mesh["dp_shard"])


def _timed(backend, fn):
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        out = fn()
        backend.barrier()
        seconds = time.perf_counter() - t0
    return out, seconds, peak.bytes


def _snapshot(dst) -> dict[str, torch.Tensor]:
    return {n: local_shard(p).detach().clone() for n, p in dst.named_parameters()}


def _full_then_slice(src, dst):
    state = shard_state(dst)
    params = dict(dst.named_parameters())
    with torch.no_grad():
        for name, p in src.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            spec = state.specs[name]
            part = full if spec.replicated else expected_shard(full, spec, *state.coords(spec))
            local_shard(params[name]).copy_(part)


def _dcp(backend, src, num_layers, folder):
    import shardwise as sw

    sw.save(src, folder, distributed=True)
    with torch.device("meta"):
        model = bench_model(num_layers, HIDDEN, VOCAB)
    sw.load(model, folder, plan=BENCH_PLAN, mesh=backend.mesh(tp=4), dtype=torch.bfloat16, progress=False)
    return model


def worker(size: int, repeat: int, bucket: int, shm: str) -> dict:
    import shardwise as sw

    torch.set_num_threads(1)
    backend = sw.init_backend("gloo")
    num_layers = _layers(size)
    torch.manual_seed(0)
    src = _fsdp(sw.parallelize(bench_model(num_layers, HIDDEN, VOCAB), BENCH_PLAN,
                               backend.mesh(dp_shard=2, tp=2)), backend.mesh(dp_shard=2, tp=2))
    with torch.device("meta"):
        dst = bench_model(num_layers, HIDDEN, VOCAB, dtype=torch.bfloat16)
    dst = sw.parallelize(dst.to_empty(device="cpu"), BENCH_PLAN, backend.mesh(tp=4))
    with torch.no_grad():  # fault the destination's pages in: they are not the transfer's memory
        for p in dst.parameters():
            p.zero_()
    plan, plan_s, _ = _timed(backend, lambda: sw.transfer_plan(src, dst, bucket_bytes=bucket))
    rows: dict[str, list] = {"plan.run()": [], "full_tensor + slice": [], "DCP save + sw.load": []}
    same = {k: True for k in rows}
    for i in range(repeat):
        _, s, peak = _timed(backend, plan.run)
        rows["plan.run()"].append((s, peak))
        want = _snapshot(dst)
        _, s, peak = _timed(backend, lambda: _full_then_slice(src, dst))
        rows["full_tensor + slice"].append((s, peak))
        same["full_tensor + slice"] &= all(torch.equal(want[n], t) for n, t in _snapshot(dst).items())
        folder = f"{shm}/dcp{i}"
        loaded, s, peak = _timed(backend, functools.partial(_dcp, backend, src, num_layers, folder))
        rows["DCP save + sw.load"].append((s, peak))
        same["DCP save + sw.load"] &= all(torch.equal(want[n], t) for n, t in _snapshot(loaded).items())
        del loaded
        backend.barrier()
        if backend.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return {"rank": backend.rank, "rows": rows, "same": same, "plan_s": plan_s, "layers": num_layers,
            "sent": plan.plan.sent_by(backend.rank), "received": plan.plan.received_by(backend.rank),
            "summary": str(plan.plan)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1GB", help="float32 source model bytes")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--bucket", default="64MiB")
    args = ap.parse_args()
    size, bucket = parse_size(args.size), parse_size(args.bucket)
    shm = tempfile.mkdtemp(prefix="sw-transfer-", dir="/dev/shm")
    try:
        ranks = spawn(worker, 4, args=(size, args.repeat, bucket, shm), timeout=3600)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    print(ranks[0]["summary"])
    base = None
    table = []
    for method in ranks[0]["rows"]:
        seconds = statistics.median(max(r["rows"][method][i][0] for r in ranks) for i in range(args.repeat))
        peak = max(p for r in ranks for _, p in r["rows"][method])
        base = base or seconds
        table.append({"method": method, "seconds": seconds, "vs_plan": seconds / base,
                      "peak_mib": peak / 2**20, "bucket_mib": bucket / 2**20,
                      "same": "yes" if all(r["same"][method] for r in ranks) else "NO"})
    layers = ranks[0]["layers"]
    total = (2 * VOCAB * HIDDEN + layers * 16 * HIDDEN * HIDDEN) * 4 + (2 * layers + 1) * HIDDEN * 4
    plan_s = max(r["plan_s"] for r in ranks)
    notes = (f"The bench-model toy, hidden {HIDDEN}, {layers} layers, vocab {VOCAB}: {total / 1e9:.3f} GB in "
             "float32 under FSDP2 x TP (mesh(dp_shard=2, tp=2)) into bfloat16 at mesh(tp=4), colocated "
             f"on 4 gloo ranks of this machine; sw.transfer_plan took {plan_s:.2f} s "
             f"once; each rank sends {max(r['sent'] for r in ranks) / 2**20:.1f} MiB per run. Seconds: the "
             f"slowest rank, median of {args.repeat}; peak: the largest rank's resident memory above the "
             "level before the call. `x plan.run()`: seconds of the method / seconds of plan.run(). "
             f"Command: `python3 benchmarks/transfer.py --size {args.size} --repeat {args.repeat} "
             f"--bucket {args.bucket}`.")
    cols = [("method", "method"), ("seconds", "s per run", ".2f"), ("vs_plan", "x plan.run()", ".2f"),
            ("peak_mib", "peak extra MiB per rank", ".0f"), ("bucket_mib", "bucket MiB", ".0f"),
            ("same", "same destination bytes")]
    print(write_results("transfer", table, cols, notes, extra={"ranks": ranks}))


if __name__ == "__main__":
    main()
