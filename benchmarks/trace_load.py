"""The call trace of one tensor-parallel load: how many of shardwise's modules and functions a
``sw.load`` runs through on rank 0, how many calls, and how often a call crosses a layer.

    python3 benchmarks/trace_load.py [--degree 2] [--json benchmarks/results/trace-load.json]
    PYTHONPATH=<a checkout of another commit>/src python3 benchmarks/trace_load.py   # before

A small model (embedding, four transformer-like blocks with colwise and rowwise linears, a
head) is written as an ordinary two-file safetensors checkpoint with an index, then loaded on
``--degree`` spawned gloo ranks into a meta model. Rank 0 traces the ``sw.load`` call alone
with ``sys.setprofile``: every call of a function whose code lives in ``src/shardwise`` counts
(a generator once, however often it resumes; comprehensions are not functions). A "layer
switch" is such a call whose nearest shardwise caller sits in another layer (core, storage,
formats, read floor, pipelines, runtime, hf, top). Every rank also counts the safetensors
headers it parsed and the folder listings that reached the filesystem. The figures describe the
shape of the code, not its speed; only the public API is called, so the same script traces any
commit.
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


# the read floor (docs/architecture.md) by what the code is, under its names before and after
# it got a folder of its own (io/read/), so that a trace of any commit classifies it alike
_FLOOR = ("shardwise.io.read", "shardwise.io.exchange", "shardwise.io.fetch", "shardwise.io.replicas",
          "shardwise.io.formats.safetensors.reader", "shardwise.io.formats.safetensors.mapped",
          "shardwise.io.source", "shardwise.io.sink", "shardwise.io.info", "shardwise.io.staging",
          "shardwise.io.placed", "shardwise.io.dist_save")


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2:
        return "top"
    if any(module == f or module.startswith(f + ".") for f in _FLOOR):
        return "floor"
    if parts[1] == "io":
        if len(parts) > 2 and parts[2] in ("storage", "formats"):
            return parts[2]
        return "pipelines"
    if parts[1] in ("core", "hf", "transfer", "validate", "testing"):
        return parts[1]
    if parts[1] in ("backends", "comm", "mesh", "holding", "parallel", "local_tp", "clip", "quant",
                    "plan_checks"):
        return "runtime"
    return "top"


def write_checkpoint(folder: Path, *, index: bool = True) -> None:
    """Two files and an index; ``index=False``: one file alone in the folder."""
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in Model().state_dict().items()}
    if not index:
        save_file(state, str(folder / "model.safetensors"))
        return
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
    # generator frames already counted (a resume is not a new call), held so that no new frame
    # takes a finished one's id while the trace runs
    resumed: dict[int, object] = {}
    inline = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}  # expressions, not functions

    listings = 0
    listers = (os.listdir, os.scandir)

    def profile(frame, event, arg):
        nonlocal switches, listings
        if event == "c_call" and arg in listers:  # a folder listed on the filesystem, by shardwise
            listings += frame.f_globals.get("__name__", "").startswith("shardwise")
        elif event == "call":
            code = frame.f_code
            mod = frame.f_globals.get("__name__", "")
            fresh = resumed.get(id(frame)) is not frame
            if code.co_flags & 0x20:  # CO_GENERATOR
                resumed[id(frame)] = frame
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
    sys.setprofile(profile)
    try:
        sw.load(model, ckpt, plan=PLAN, mesh=mesh)
    finally:
        sys.setprofile(None)
    torch.distributed.barrier()
    # a header parsed (core.header.parse_header: every safetensors header, however reached) and
    # a folder listed (os.listdir / os.scandir reached from the load), on this rank
    headers = sum(n for (m, q, _), n in calls.items() if q == "parse_header")
    by_layer = Counter(layer_of(m) for (m, _, _), n in calls.items() for _ in range(n))
    return {"modules": len(modules), "functions": len(calls), "calls": sum(calls.values()),
            "layer_switches": switches, "calls_by_layer": dict(by_layer), "rank": rank,
            "headers_parsed": headers, "folder_listings": listings}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degree", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp))
        ranks = spawn(rank_trace, args.degree, args=(tmp, args.degree))
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), index=False)
        alone = spawn(rank_trace, args.degree, args=(tmp, args.degree))
    result = ranks[0]
    print(f"sw.load at tp={args.degree}, rank 0: {result['modules']} modules, {result['functions']} "
          f"functions, {result['calls']} calls, {result['layer_switches']} layer switches")
    print("calls by layer:", ", ".join(f"{k} {v}" for k, v in sorted(result["calls_by_layer"].items())))
    print("per rank (2 safetensors files, 1 folder): headers parsed",
          [r["headers_parsed"] for r in ranks], "folder listings", [r["folder_listings"] for r in ranks])
    print("per rank (1 file, no index): headers parsed", [r["headers_parsed"] for r in alone],
          "folder listings", [r["folder_listings"] for r in alone])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"degree": args.degree, **result, "per_rank": [
            {k: r[k] for k in ("rank", "headers_parsed", "folder_listings", "calls")} for r in ranks],
            "per_rank_one_file": [{k: r[k] for k in ("rank", "headers_parsed", "folder_listings")}
                                  for r in alone]},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
