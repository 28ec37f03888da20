"""Attaching a LoRA adapter to a tensor-parallel model, and switching adapters.

    python3 benchmarks/lora.py --tp 4 --repeat 3

A LlamaForCausalLM (bfloat16, transformers' save_pretrained) and two PEFT adapters of rank
``--rank`` on every projection (q, k, v, o, gate, up, down), made with PEFT on one process. Every
method loads the base model first; the clock covers only attaching the adapter and a first forward
(one sequence of 16 tokens). Ranks are local gloo processes on this machine's cores, methods
interleaved round by round, page cache warm; the slowest rank counts, median of ``--repeat`` rounds:

- shardwise: ``sw.from_pretrained(cls, folder, mesh=backend.mesh(tp=N))`` then
  ``sw.load_adapter(model, adapter)``: each rank reads its slices of each LoRA tensor.
- peft-tp: transformers' own TP load (``DistributedConfig(tp_plan="auto", tp_size=N)``), then
  ``PeftModel.from_pretrained(model, adapter)``: PEFT's TP path reads the whole adapter on every
  rank and slices it afterwards.
The process's first call of transformers' weight-conversion mapping (PEFT's injection makes it;
transformers' own load already has) is made before the clock for every method.

- one-process: ``from_pretrained`` whole on every rank then ``PeftModel.from_pretrained``: the
  attach a load-then-shard user pays before sharding (shardwise refuses to shard a model with
  adapters that it did not attach).

Per rank: attach + first forward seconds, peak RSS above the level before the attach, adapter
bytes read (``/proc/self/io`` rchar). ``max |Δ|``: rank 0's logits against one process's. Then,
shardwise only: switching to the second adapter (``peft.functional.set_adapter`` + a forward)
against loading the model and that adapter again.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import PeakRSS, io_delta, proc_io, warm_file_cache, write_results

from shardwise.testing import spawn

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
METHODS = ("shardwise", "peft-tp", "one-process")
MB = 2**20


def _config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=args.hidden,
                       intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                       num_attention_heads=16, num_key_value_heads=8,
                       tie_word_embeddings=False)


def make(folder: Path, args) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(_config(args)).to(torch.bfloat16).save_pretrained(folder / "ckpt")
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        base = LlamaForCausalLM(_config(args)).to(torch.bfloat16)
        config = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS,
                            init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(folder / name)


def _ids() -> torch.Tensor:
    return torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(1))


def _base(method: str, folder: str, tp: int, backend):
    from transformers import DistributedConfig, LlamaForCausalLM

    import shardwise as sw

    if method == "shardwise":
        return sw.from_pretrained(LlamaForCausalLM, f"{folder}/ckpt", mesh=backend.mesh(tp=tp))
    if method == "peft-tp":
        return LlamaForCausalLM.from_pretrained(f"{folder}/ckpt", distributed_config=DistributedConfig(
            tp_plan="auto", tp_size=tp)).eval()
    return LlamaForCausalLM.from_pretrained(f"{folder}/ckpt").eval()


def _attach(method: str, model, adapter: str):
    from peft import PeftModel

    import shardwise as sw

    if method == "shardwise":
        sw.load_adapter(model, adapter, adapter_name="a")
        return model
    return PeftModel.from_pretrained(model, adapter, adapter_name="a")


def rank_run(method: str, folder: str, tp: int) -> dict:
    import torch.distributed as dist
    from peft.functional import set_adapter

    import shardwise as sw
    from shardwise import testing

    backend = sw.init_backend("gloo")
    testing.preload()
    model = _base(method, folder, tp, backend)
    # Imports are not part of an attach (PEFT's, and shardwise's adapters); nor is the process's first
    # call of transformers' weight-conversion mapping, which PEFT's injection makes (~1,000 regexes
    # compiled, ~1.3 s here) and transformers' own load has made already: once for every method.
    import peft.tuners.lora  # noqa: F401
    from peft.utils.transformers_weight_conversion import get_model_conversion_mapping

    sw.load_adapter  # noqa: B018 - the public name's module (the base load imported the rest)
    get_model_conversion_mapping(model)
    dist.barrier()
    with PeakRSS() as peak:
        io0, t0 = proc_io(), time.perf_counter()
        model = _attach(method, model, f"{folder}/a")
        with torch.no_grad():
            logits = model(input_ids=_ids()).logits
        seconds = time.perf_counter() - t0
        read = io_delta(io0, proc_io()).get("rchar", 0)
    if type(logits).__name__ == "DTensor":
        logits = logits.full_tensor()
    out = {"seconds": seconds, "peak": peak.bytes, "read": read, "logits": logits.float().tolist()}
    if method == "shardwise":
        sw.load_adapter(model, f"{folder}/b", adapter_name="b")
        dist.barrier()
        t0 = time.perf_counter()
        set_adapter(model, "b")
        with torch.no_grad():
            model(input_ids=_ids())
        out["switch_s"] = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        again = _base(method, folder, tp, backend)
        sw.load_adapter(again, f"{folder}/b", adapter_name="b")
        with torch.no_grad():
            again(input_ids=_ids())
        out["reload_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    folder = Path(args.dir or tempfile.mkdtemp(prefix="lora-bench-"))
    if not (folder / "b").is_dir():
        make(folder, args)
    adapter_bytes = (folder / "a" / "adapter_model.safetensors").stat().st_size
    runs: dict[str, list] = {m: [] for m in METHODS}
    for _ in range(args.repeat):
        for method in METHODS:
            warm_file_cache([*folder.rglob("*.safetensors")])
            runs[method].append(spawn(rank_run, args.tp, args=(method, str(folder), args.tp), timeout=600))
    reference = torch.tensor(runs["one-process"][0][0]["logits"])
    rows = []
    for method in METHODS:
        ordered = sorted(runs[method], key=lambda ranks: max(r["seconds"] for r in ranks))
        ranks = ordered[len(ordered) // 2]
        rows.append({"method": method, "tp": args.tp, "seconds": max(r["seconds"] for r in ranks),
                     "peak_mb": max(r["peak"] for r in ranks) / MB,
                     "read_mb": max(r["read"] for r in ranks) / MB,
                     "read_share": max(r["read"] for r in ranks) / adapter_bytes,
                     "diff": float((torch.tensor(ranks[0]["logits"]) - reference).abs().max())})
    base = {r["method"]: r for r in rows}
    for row in rows:
        row["x_peft"] = base["peft-tp"]["seconds"] / row["seconds"]
        row["mem_vs_peft"] = row["peak_mb"] / max(base["peft-tp"]["peak_mb"], 1e-9)
    sw_runs = sorted(runs["shardwise"], key=lambda ranks: max(r["switch_s"] for r in ranks))
    mid = sw_runs[len(sw_runs) // 2]
    switch, reload = max(r["switch_s"] for r in mid), max(r["reload_s"] for r in mid)
    rows.append({"method": "shardwise: switch to adapter b (set_adapter + forward)", "tp": args.tp,
                 "seconds": switch, "x_reload": reload / switch})
    rows.append({"method": "shardwise: load the model and adapter b again + forward", "tp": args.tp,
                 "seconds": reload, "x_reload": 1.0})
    columns = [("method", "method"), ("tp", "tp"), ("seconds", "attach + first forward s", ".3f"),
               ("x_peft", "speed × peft-tp"), ("peak_mb", "peak RSS MB/rank", ".1f"),
               ("mem_vs_peft", "RSS ÷ peft-tp"), ("read_mb", "adapter MB read/rank", ".1f"),
               ("read_share", "read ÷ adapter"), ("diff", "max |Δ logits| vs one process", ".2g"),
               ("x_reload", "speed × reload")]
    notes = (f"LlamaForCausalLM hidden {args.hidden}, {args.layers} layers, vocab 32000, bfloat16; two "
             f"PEFT adapters of rank {args.rank} on q, k, v, o, gate, up, down ({adapter_bytes / MB:.1f} MB "
             f"each). {args.tp} local gloo ranks on this machine's {os.cpu_count()} cores, the base loaded "
             f"before the clock; median of the slowest rank over {args.repeat} interleaved round(s). "
             "peft-tp: transformers' TP load + PeftModel.from_pretrained (PEFT's TP path: the whole adapter "
             "read on every rank, then sliced); one-process: the whole model and adapter on every rank (the "
             "attach "
             "before a load-then-shard). The last two rows: shardwise switching to a second loaded adapter "
             "against loading the model and that adapter again. Adapter MB read: rchar (PEFT maps the file: "
             "its mapped pages are not counted). Command: `python3 benchmarks/lora.py "
             + " ".join(sys.argv[1:]) + "`.")
    print(write_results("lora", rows, columns, notes))


if __name__ == "__main__":
    main()
