"""The call trace of one tensor-parallel load: how many of shardwise's modules and functions a
``sw.load`` runs through on rank 0, how many calls, and how often a call crosses a layer.

    python3 benchmarks/trace_load.py [--degree 2] [--json benchmarks/results/trace-load.json]

A small model (embedding, four transformer-like blocks with colwise and rowwise linears, a
head) is written as an ordinary two-file safetensors checkpoint with an index, then loaded on
``--degree`` spawned gloo ranks into a meta model. Rank 0 traces the ``sw.load`` call alone
with ``sys.setprofile``: every call of a function whose code lives in ``src/shardwise`` counts
(a generator once, however often it resumes; comprehensions are not functions). A "layer
switch" is such a call whose nearest shardwise caller sits in another layer (core, storage,
formats, pipelines, runtime, hf, top). The figures describe the shape of the code, not its
speed; only the public API is called, so the same script traces any commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import shardwise as sw

try:
    from shardwise.testing import spawn
except ModuleNotFoundError:  # a --base commit older than shardwise.testing (the 040407b)
    from shardwise.launch import spawn  # type: ignore[no-redef]

PLAN = {"blocks.*.q": "colwise", "blocks.*.o": "rowwise", "blocks.*.up": "colwise",
        "blocks.*.down": "rowwise", "head": "colwise"}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.q, self.o = nn.Linear(d, d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)


class Model(nn.Module):
    def __init__(self, d: int = 64, layers: int = 4, vocab: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2:
        return "top"
    if parts[1] == "io":
        if len(parts) > 2 and parts[2] in ("storage", "formats"):
            return parts[2]
        return "pipelines"
    if parts[1] in ("core", "hf", "transfer", "validate", "testing"):
        return parts[1]
    if parts[1] in ("backends", "comm", "mesh", "holding", "parallel", "local_tp", "clip"):
        return "runtime"
    return "top"


def write_checkpoint(folder: Path) -> None:
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in Model().state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half],
             "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in files.items():
        save_file({k: state[k] for k in keys}, str(folder / fname))
        weight_map.update(dict.fromkeys(keys, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def rank_trace(ckpt: str, degree: int) -> dict | None:
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=degree)
    with torch.device("meta"):
        model = Model()
    src_root = os.path.dirname(os.path.abspath(sw.__file__))
    calls: Counter = Counter()
    modules: set[str] = set()
    switches = 0
    stack: list[str | None] = []
    resumed: set[int] = set()  # generator frames already counted: a resume is not a new call
    inline = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}  # expressions, not functions

    def profile(frame, event, _arg):
        nonlocal switches
        if event == "call":
            code = frame.f_code
            mod = frame.f_globals.get("__name__", "")
            fresh = id(frame) not in resumed
            if code.co_flags & 0x20:  # CO_GENERATOR
                resumed.add(id(frame))
            if (fresh and code.co_name not in inline and code.co_filename.startswith(src_root)
                    and mod.startswith("shardwise")):
                caller = next((m for m in reversed(stack) if m is not None), None)
                calls[(mod, code.co_qualname, code.co_firstlineno)] += 1
                modules.add(mod)
                if caller is not None and layer_of(caller) != layer_of(mod):
                    switches += 1
                stack.append(mod)
            else:
                stack.append(None)
        elif event == "return" and stack:
            stack.pop()

    rank = torch.distributed.get_rank()
    if rank == 0:
        sys.setprofile(profile)
    try:
        sw.load(model, ckpt, plan=PLAN, mesh=mesh)
    finally:
        sys.setprofile(None)
    torch.distributed.barrier()
    if rank != 0:
        return None
    by_layer = Counter(layer_of(m) for (m, _, _), n in calls.items() for _ in range(n))
    return {"modules": len(modules), "functions": len(calls), "calls": sum(calls.values()),
            "layer_switches": switches, "calls_by_layer": dict(by_layer)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degree", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp))
        result = spawn(rank_trace, args.degree, args=(tmp, args.degree))[0]
    print(f"sw.load at tp={args.degree}, rank 0: {result['modules']} modules, {result['functions']} "
          f"functions, {result['calls']} calls, {result['layer_switches']} layer switches")
    print("calls by layer:", ", ".join(f"{k} {v}" for k, v in sorted(result["calls_by_layer"].items())))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"degree": args.degree, **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
