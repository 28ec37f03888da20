"""shardwise against what users pick instead: the libraries' own tensor-parallel loads.

    python3 benchmarks/peers.py --degrees 1 2 4 --repeat 3 [--llama-size 1GB] [--large]

One table per model, tp 1, 2, 4 (gloo ranks on this machine's cores), every method in the
same run and interleaved round by round, page cache warm before every load:

- shardwise: ``sw.from_pretrained(cls, folder, mesh=backend.mesh(tp=N))`` (the model's own
  plan, ``plan="auto"``), or build on meta + ``sw.load(plan="auto")`` where this checkout has
  no ``from_pretrained``.
- transformers (Llama): ``from_pretrained(folder, distributed_config=DistributedConfig(
  tp_plan="auto", tp_size=N))``, the same as the deprecated ``tp_plan="auto"``. The process
  group exists before the clock starts (transformers adopts it, as it would create it from
  torchrun's variables); at tp=1 it is the ordinary load.
- diffusers (Flux2): ``from_pretrained(folder, parallel_config=TensorParallelConfig(
  tp_degree=N))``, patched to run on the CPU (see ``_patch_diffusers_for_cpu``).
- load-then-shard: the library's ordinary ``from_pretrained`` on every rank, then
  ``sw.parallelize(model, "auto", mesh)``.

Per rank: load seconds, load + first forward seconds (a fixed input), peak RSS and peak
anonymous memory above the level before the load, as ratios of checkpoint/tp, bytes read
(``/proc/self/io`` rchar plus the peak of file pages mapped in through mmap, which rchar does
not see). The slowest rank counts; the median of ``--repeat`` rounds is reported. Every
method's first output is compared with load-then-shard's.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import _peers_models as pm
import torch
from _common import GB, PeakRSS, io_delta, mem_available, proc_io, proc_status, warm_file_cache, write_results

from shardwise.testing import parse_size, spawn

METHODS = {"llama": ("shardwise", "transformers", "load-then-shard"),
           "flux2": ("shardwise", "diffusers", "load-then-shard")}
PEER = {"llama": "transformers", "flux2": "diffusers"}


class _Peaks(PeakRSS):
    """PeakRSS that also keeps the peak of file pages mapped (RssFile): bytes read through mmap."""

    def _sample(self) -> None:
        super()._sample()
        self.max_file = max(getattr(self, "max_file", 0), proc_status().get("RssFile", 0))


PATCH_NOTE = ("`torch.accelerator.device_count` returns 1 instead of 0 (diffusers' "
              "`_resolve_parallel_config` computes its device as `rank % device_count()`), and "
              "\"cpu\" is appended to "
              "`diffusers.hooks.tensor_parallel._SUPPORTED_TP_DEVICES`; nothing else")


def _patch_diffusers_for_cpu() -> None:
    """Let diffusers' TP load run on a CPU/gloo mesh (what is patched: ``PATCH_NOTE``)."""
    import diffusers.hooks.tensor_parallel as tp_hooks

    # 1. _resolve_parallel_config builds its device as rank % torch.accelerator.device_count(),
    #    which is 0 without an accelerator (ZeroDivisionError); count the CPU as one device.
    torch.accelerator.device_count = lambda: 1
    # 2. apply_tensor_parallel refuses mesh device types outside ("cuda", "neuron", "tpu", "xpu").
    tp_hooks._SUPPORTED_TP_DEVICES = (*tp_hooks._SUPPORTED_TP_DEVICES, "cpu")


def _load(method: str, kind: str, folder: str, tp: int, backend):
    import shardwise as sw

    cls = pm.model_class(kind)
    dtype = torch.bfloat16 if kind == "llama" else torch.float32
    if method == "shardwise":
        mesh = backend.mesh(tp=tp)
        if hasattr(sw, "from_pretrained"):
            return sw.from_pretrained(cls, folder, mesh=mesh, dtype=dtype)
        with sw.empty_model():
            model = (cls.from_config(cls.load_config(folder)) if kind == "flux2"
                     else cls(__import__("transformers").AutoConfig.from_pretrained(folder)))
        sw.load(model, folder, plan="auto", mesh=mesh, dtype=dtype)
        return model.eval()
    if method == "transformers":
        from transformers import DistributedConfig

        return cls.from_pretrained(folder, dtype=dtype,
                                   distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp)).eval()
    if method == "diffusers":
        from diffusers import TensorParallelConfig

        return cls.from_pretrained(folder, torch_dtype=dtype,
                                   parallel_config=TensorParallelConfig(tp_degree=tp)).eval()
    kwargs = {"dtype": dtype} if kind == "llama" else {"torch_dtype": dtype}
    model = cls.from_pretrained(folder, **kwargs).eval()
    return sw.parallelize(model, "auto", backend.mesh(tp=tp))


def rank_run(method: str, kind: str, folder: str, tp: int, tokens: int = 16) -> dict:
    """One rank of one load: figures, and on rank 0 the output of the first forward."""
    import torch.distributed as dist

    import shardwise as sw

    backend = sw.init_backend("gloo")
    # Imports are not part of a load: the library's, and shardwise's modules that a load imports
    # on first use (this environment may not cache bytecode, so each would compile here).
    pm.model_class(kind)
    from shardwise import testing

    testing.preload()
    if method == "diffusers":
        _patch_diffusers_for_cpu()
    x = pm.inputs(kind, tokens)
    gc.collect()
    dist.barrier()
    with _Peaks() as peak:
        file0, io0, t0, cpu0 = proc_status().get("RssFile", 0), proc_io(), time.perf_counter(), os.times()
        model = _load(method, kind, folder, tp, backend)
        t_load = time.perf_counter() - t0
        with torch.no_grad():
            out = model(**x)
        t_total = time.perf_counter() - t0
        cpu1 = os.times()
        io = io_delta(io0, proc_io())
    result = getattr(model, "result", None)
    output = pm.output_of(kind, out)  # every rank: gathering a DTensor output is a collective
    return {"rank": dist.get_rank(), "load_s": t_load, "total_s": t_total, **peak.as_dict(),
            "cpu_user": cpu1.user - cpu0.user, "cpu_sys": cpu1.system - cpu0.system,
            "rchar": io.get("rchar", 0), "mapped": max(0, peak.max_file - file0),
            "bytes_read": io.get("rchar", 0) + max(0, peak.max_file - file0),
            "sw_bytes_read": getattr(result, "bytes_read", None), "local_bytes": pm.local_bytes(model),
            "output": _to_bytes(output) if dist.get_rank() == 0 else None}


def _to_bytes(t: torch.Tensor) -> bytes:
    # A tensor put on a multiprocessing queue travels as a shared-memory handle that the parent
    # fetches from this process, which may have exited by then: send plain bytes instead.
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(data), weights_only=True)


def summarise(method: str, tp: int, runs: list[list[dict]], total: int) -> dict:
    """The run whose slowest rank's load + forward is the median; peaks as ratios of total/tp."""
    if not runs:
        return {"method": method, "degree": tp}
    runs = sorted(runs, key=lambda ranks: max(r["total_s"] for r in ranks))
    ranks = runs[len(runs) // 2]
    share = total / tp
    return {"method": method, "degree": tp, "load_s": max(r["load_s"] for r in ranks),
            "total_s": max(r["total_s"] for r in ranks),
            "all_total_s": [round(max(r["total_s"] for r in rs), 3) for rs in runs],
            "rss": max(r["peak_rss"] for r in ranks) / share,
            "anon": max(r["peak_anon"] for r in ranks) / share,
            "read_gb": max(r["bytes_read"] for r in ranks) / GB,
            "cpu_s": max(r["cpu_user"] + r["cpu_sys"] for r in ranks),
            "held": max(r["local_bytes"] for r in ranks) / share, "ranks": ranks}


def add_ratios(rows: list[dict], kind: str) -> None:
    """speed ×X = X's load + forward seconds / this row's (above 1: faster than X);
    RSS ÷ peer = this row's peak RSS / the peer's at the same tp."""
    by = {(r["method"], r["degree"]): r for r in rows if "total_s" in r}
    for row in rows:
        peer, base = by.get((PEER[kind], row["degree"])), by.get(("load-then-shard", row["degree"]))
        if "total_s" not in row:
            continue
        if peer:
            row["x_peer"], row["rss_vs_peer"] = peer["total_s"] / row["total_s"], row["rss"] / peer["rss"]
            row["x_peer_load"] = peer["load_s"] / row["load_s"]
        if base:
            row["x_base"] = base["total_s"] / row["total_s"]
            got, ref = _from_bytes(row["ranks"][0]["output"]), _from_bytes(base["ranks"][0]["output"])
            row["max_diff"] = float((got - ref).abs().max()) if got.shape == ref.shape else float("nan")


COLUMNS = [("method", "method"), ("degree", "tp"), ("load_s", "load s"),
           ("total_s", "load + first forward s"), ("rss", "peak RSS ÷ (ckpt/tp)"),
           ("anon", "peak anon ÷ (ckpt/tp)"), ("held", "held ÷ (ckpt/tp)"), ("read_gb", "read GB/rank"),
           ("cpu_s", "CPU s/rank"), ("x_peer", "speed × peer"), ("x_peer_load", "load speed × peer"),
           ("rss_vs_peer", "RSS ÷ peer"),
           ("x_base", "speed × load-then-shard"), ("max_diff", "max |Δ output| vs load-then-shard", ".2g")]


def _notes(model: pm.PeerModel, args, patch: str) -> str:
    cmd = " ".join(["python3 benchmarks/peers.py", *sys.argv[1:]])
    first = (f"one sequence of {args.tokens} tokens" if model.kind == "llama"
             else "an 8 x 8 latent and 16 text tokens")
    text = (f"{model.description}: {model.total_bytes / GB:.3f} GB in {len(model.files)} file(s). Ranks are "
            f"local gloo processes with 1 torch thread each on this machine's {os.cpu_count()} cores (tp=4 "
            "puts 4 ranks on them); the process group exists before the clock starts, and each library "
            "is imported before it. Page cache warm before every load; methods interleaved round by "
            f"round; median of {args.repeat} round(s) by the slowest rank's load + first forward "
            f"({first}: it runs whatever a loader defers, such as faulting in mapped pages). Peak RSS "
            "and peak anonymous memory are above each rank's level before the load, over checkpoint/tp; "
            "\"held\" is the bytes of the rank's own tensors over checkpoint/tp (replicated tensors are "
            "held whole). Read GB/rank is rchar plus the peak of file pages mapped (a lower bound for "
            "readers that map and unmap). CPU s/rank: user + system seconds of the load and forward, "
            "the largest rank. speed × X is X's seconds over this row's (load + first forward; \"load "
            "speed\": the load alone). Command: `" + cmd + "`.")
    if patch:
        text += f"\n\ndiffusers refuses a CPU mesh; patched in its ranks only: {patch}."
    return text


def run_model(model: pm.PeerModel, args, log) -> list[dict]:
    files = [str(f) for f in model.files]
    runs: dict[tuple[str, int], list] = {}
    for rnd in range(args.repeat):
        for tp in args.degrees:
            for method in METHODS[model.kind]:
                if method in args.skip:
                    continue
                need = tp * model.total_bytes * 1.3  # every rank holds the whole model for a moment
                if method == "load-then-shard" and need > mem_available() - model.total_bytes:
                    log(f"  skip load-then-shard tp={tp}: not enough free memory")
                    continue
                warm_file_cache(files)
                t = time.perf_counter()
                ranks = spawn(rank_run, tp, args=(method, model.kind, str(model.folder), tp, args.tokens),
                              timeout=args.timeout)
                runs.setdefault((method, tp), []).append(ranks)
                log(f"  round {rnd + 1} tp={tp} {method}: load+fwd {max(r['total_s'] for r in ranks):.2f} s "
                    f"(spawned run {time.perf_counter() - t:.1f} s)")
    rows = [summarise(m, tp, runs.get((m, tp), []), model.total_bytes)
            for tp in args.degrees for m in METHODS[model.kind] if m not in args.skip]
    add_ratios(rows, model.kind)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--llama-size", default="1GB", help="the Llama checkpoint's size (default 1GB)")
    p.add_argument("--large", action="store_true", help="also a Llama of ~4GB")
    p.add_argument("--models", nargs="+", default=["llama", "flux2"], choices=["llama", "flux2"])
    p.add_argument("--skip", nargs="*", default=[], help="methods to leave out")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "shardwise-bench-peers"),
                   help="where the checkpoints are written (reused when they match)")
    p.add_argument("--tokens", type=int, default=16, help="tokens in the Llama's first forward (16)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-write", action="store_true", help="print the tables only")
    args = p.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    root = Path(args.dir)
    models = []
    if "llama" in args.models:
        models.append(("peers-llama", pm.llama_checkpoint(root / "llama", parse_size(args.llama_size))))
        if args.large:
            models.append(("peers-llama-4gb", pm.llama_checkpoint(root / "llama-4gb", parse_size("4GB"))))
    if "flux2" in args.models:
        models.append(("peers-flux2", pm.flux2_checkpoint(root / "flux2")))
    for name, model in models:
        log(f"{name}: {model.total_bytes / GB:.3f} GB in {model.folder}")
        rows = run_model(model, args, log)
        patch = PATCH_NOTE if model.kind == "flux2" else ""
        public = [{k: v for k, v in r.items() if k not in ("ranks",)} for r in rows]
        per_rank = [{"method": r["method"], "degree": r["degree"],
                     "ranks": [{k: v for k, v in x.items() if k != "output"} for x in r.get("ranks", [])]}
                    for r in rows]
        if args.no_write:
            from _common import markdown_table

            print(f"## {name}\n\n{_notes(model, args, patch)}\n\n{markdown_table(public, COLUMNS)}\n")
            continue
        table = write_results(name, public, COLUMNS, _notes(model, args, patch),
                              extra={"total_bytes": model.total_bytes, "per_rank": per_rank})
        print(f"## {name}\n\n{table}\n")


if __name__ == "__main__":
    main()
