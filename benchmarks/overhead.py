"""Overhead per module: what a load costs that is not its bytes, as a model grows in modules.

    python3 benchmarks/overhead.py --layers 8 16 32 64 128 256 --degrees 2 4 --repeat 3

Models (bfloat16, tiny widths, so bytes are negligible and the time is bookkeeping):
- ``llama-L``: transformers' ``LlamaForCausalLM`` (hidden 64, intermediate 128, 4 heads / 4 kv
  heads, vocab 256) with L layers, written by ``save_pretrained``.
- ``moe-64x32``: 32 layers of 64 experts each with its own gate/up/down ``nn.Linear`` (6,144
  expert modules), keys as Qwen3-MoE checkpoints name them. shardwise loads it into a model with
  per-expert modules (``PerExpertMoE``) and a plan sharding every expert colwise/rowwise;
  transformers loads the same checkpoint into its ``Qwen3MoeForCausalLM``, which fuses each
  layer's experts into two 3-D parameters while loading and whose tp plan leaves them whole.

Methods, per tp degree, on spawned gloo ranks (1 thread each), page cache warm, interleaved
round by round, median of ``--repeat`` rounds by the slowest rank:
- shardwise: build on meta (``sw.empty_model()``, timed apart as "construct"), then ``sw.load``
  with the plan; its steps timed by ``_phases.LoadPhases``: "plan + wire + install" is
  ``resolve_for_mesh`` plus ``install`` (which wires), the issue's per-module figure.
- transformers: ``from_pretrained(folder, dtype=bfloat16, distributed_config=DistributedConfig(
  tp_plan="auto", tp_size=N))`` (construct included: it cannot be timed apart).
Per module: seconds over the model's module count (``named_modules``; the loaded model's own).
Both clocks: wall (the slowest rank's) and rank CPU (``time.process_time``, the rank that spent
the most). With more ranks than cores (4 ranks on this machine's 2) a rank waits for a core, so its
wall is at least twice its CPU; the CPU figure is what a machine with a core per rank would see.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import warm_file_cache, write_results
from _phases import PHASE_COLUMNS, LoadPhases
from torch import nn

from shardwise.testing import spawn

HIDDEN, INTER, HEADS, KV, VOCAB, HEAD_DIM = 64, 128, 4, 4, 256, 16  # tp 4 splits whole kv heads


def llama_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
                       num_attention_heads=HEADS, num_key_value_heads=KV, vocab_size=VOCAB,
                       max_position_embeddings=128, tie_word_embeddings=False)


def moe_config(layers: int, experts: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=HIDDEN, intermediate_size=INTER, moe_intermediate_size=32,
                          num_experts=experts, num_experts_per_tok=2, num_hidden_layers=layers,
                          num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
                          vocab_size=VOCAB, max_position_embeddings=128, decoder_sparse_step=1,
                          mlp_only_layers=[], tie_word_embeddings=False)


class _Expert(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(HEAD_DIM), nn.RMSNorm(HEAD_DIM)


class _Layer(nn.Module):
    def __init__(self, experts: int, inter: int):
        super().__init__()
        self.self_attn = _Attention()
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(HIDDEN, experts, bias=False)
        self.mlp.experts = nn.ModuleList(_Expert(HIDDEN, inter) for _ in range(experts))
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)


class PerExpertMoE(nn.Module):
    """Qwen3-MoE's checkpoint layout with one module per expert projection (as MoE models were
    written before fused experts); ``config`` carries the head counts plan checks read."""

    def __init__(self, layers: int, experts: int, inter: int = 32):
        super().__init__()
        self.config = moe_config(layers, experts)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.model.layers = nn.ModuleList(_Layer(experts, inter) for _ in range(layers))
        self.model.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)


MOE_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.experts.*.gate_proj": "colwise",
            "model.layers.*.mlp.experts.*.up_proj": "colwise",
            "model.layers.*.mlp.experts.*.down_proj": "rowwise", "lm_head": "colwise_rep"}


def _written(folder: Path, config) -> bool:
    """Whether ``folder`` already holds a checkpoint of ``config`` (one an earlier version of this
    script wrote with another shape is written again)."""
    path = folder / "config.json"
    if not path.exists():
        return False
    saved = json.loads(path.read_text())
    return all(saved.get(k) == v for k, v in json.loads(config.to_json_string(use_diff=True)).items()
               if k not in ("transformers_version", "dtype", "torch_dtype", "architectures"))


def write_models(root: Path, layers: list[int], moe: tuple[int, int] | None) -> dict[str, Path]:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    folders = {}
    for n in layers:
        folder = folders[f"llama-{n}"] = root / f"llama-{n}"
        if not _written(folder, llama_config(n)):
            torch.manual_seed(n)
            LlamaForCausalLM(llama_config(n)).to(torch.bfloat16).save_pretrained(folder)
    if moe:
        experts, n = moe
        folder = folders[f"moe-{experts}x{n}"] = root / f"moe-{experts}x{n}"
        torch.manual_seed(0)
        model = PerExpertMoE(n, experts).to(torch.bfloat16)
        if not _written(folder, model.config):
            folder.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                      str(folder / "model.safetensors"), metadata={"format": "pt"})
            model.config.save_pretrained(folder)
    return folders


def empty(name: str) -> tuple[nn.Module, object]:
    """The model ``name`` names ("llama-16", "moe-64x32") on meta, and its plan."""
    import shardwise as sw

    with sw.empty_model():
        if name.startswith("moe"):
            experts, layers = map(int, name.split("-")[1].split("x"))
            return PerExpertMoE(layers, experts), MOE_PLAN
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(llama_config(int(name.split("-")[1]))), "auto"


def _shardwise(name: str, folder: str, backend, tp: int):
    import shardwise as sw

    t0 = time.perf_counter()
    model, plan = empty(name)
    construct = time.perf_counter() - t0
    with LoadPhases() as phases:
        sw.load(model, folder, plan=plan, mesh=backend.mesh(tp=tp))
    s, cpu = phases.seconds, phases.cpu_seconds
    return model, {"construct": construct, "load": s["total"], "load_cpu": cpu["total"],
                   "overhead": _overhead(s), "overhead_cpu": _overhead(cpu), **s}


def _overhead(steps: dict) -> float:
    return (steps["plan"] or 0.0) + (steps["place"] or 0.0) + (steps["wire"] or 0.0)


def _transformers(name: str, folder: str, tp: int):
    from transformers import AutoModelForCausalLM, DistributedConfig

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp))
    return model, {"load": time.perf_counter() - t0}


def rank_run(folders: dict[str, str], tp: int, repeat: int) -> dict:
    """Every model, both methods interleaved, ``repeat`` rounds: {(model, method): [figures]}."""
    import gc

    import torch.distributed as dist
    import transformers  # noqa: F401 - imported before any clock starts

    import shardwise as sw
    from shardwise import testing

    backend = sw.init_backend("gloo")
    testing.preload()
    out: dict = {}
    for name, folder in folders.items():
        for round_ in range(repeat + 1):  # round 0 warms both (first-use imports, caches)
            for method in ("shardwise", "transformers"):
                gc.collect()
                dist.barrier()
                model, figures = (_shardwise(name, folder, backend, tp) if method == "shardwise"
                                  else _transformers(name, folder, tp))
                figures["modules"] = sum(1 for _ in model.named_modules())
                del model
                if round_:
                    out.setdefault(f"{name}|{method}", []).append(figures)
    return out


def summarise(per_rank: list[dict], tp: int) -> list[dict]:
    rows = []
    for key in per_rank[0]:
        name, method = key.split("|")
        rounds = len(per_rank[0][key])
        # each round: the slowest rank's figures; then the median round by load time
        slowest = [max((r[key][i] for r in per_rank), key=lambda f: f["load"]) for i in range(rounds)]
        f = sorted(slowest, key=lambda f: f["load"])[rounds // 2]
        row = {"model": name, "tp": tp, "method": method, "modules": f["modules"], "load_s": f["load"],
               "load_us_per_module": 1e6 * f["load"] / f["modules"]}
        if method == "shardwise":
            row.update({k: f.get(k) for k in ("construct", "imports", *PHASE_COLUMNS[1:-1])})
            row["overhead_us_per_module"] = 1e6 * f["overhead"] / f["modules"]
            # CPU: the rank that spent the most in the median round's ranks, by the round's index
            i = slowest.index(f)
            for fig in ("overhead_cpu", "load_cpu"):
                spent = max(r[key][i][fig] for r in per_rank)
                row[fig.replace("_cpu", "_cpu_us_per_module")] = 1e6 * spent / f["modules"]
        rows.append(row)
    by = {(r["model"], r["method"]): r for r in rows}
    for r in rows:
        if r["method"] == "shardwise":
            peer = by[(r["model"], "transformers")]
            r["load_x_peer"] = peer["load_s"] / r["load_s"]
            r["peer_load_us_per_module"] = peer["load_us_per_module"]
    return [r for r in rows if r["method"] == "shardwise"]


COLUMNS = [("model", "model"), ("tp", "tp"), ("modules", "modules"),
           ("overhead_us_per_module", "plan + wire + install µs/module", ".0f"),
           ("overhead_cpu_us_per_module", "plan + wire + install rank CPU µs/module", ".0f"),
           ("load_cpu_us_per_module", "sw.load rank CPU µs/module", ".0f"),
           ("load_us_per_module", "sw.load µs/module", ".0f"),
           ("peer_load_us_per_module", "transformers load µs/module", ".0f"),
           ("load_x_peer", "load speed × transformers"), ("load_s", "sw.load s", ".3f"),
           ("plan", "plan s", ".3f"), ("detect", "detect s", ".3f"), ("read", "read s", ".3f"),
           ("place", "place s", ".3f"), ("wire", "wire s", ".3f"), ("imports", "imports s", ".3f"),
           ("construct", "construct on meta s", ".3f")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--moe", type=int, nargs=2, default=[64, 32], metavar=("EXPERTS", "LAYERS"))
    ap.add_argument("--no-moe", action="store_true")
    ap.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardwise-overhead"))
    args = ap.parse_args(argv)
    folders = write_models(args.dir, args.layers, None if args.no_moe else tuple(args.moe))
    for folder in folders.values():
        warm_file_cache(sorted(folder.glob("*.safetensors")))
    rows, load_before = [], os.getloadavg()[0]
    for tp in args.degrees:
        per_rank = spawn(rank_run, tp, args=({k: str(v) for k, v in folders.items()}, tp, args.repeat),
                         timeout=3600)
        rows += summarise(per_rank, tp)
        for r in rows[-len(folders):]:
            print(f"tp={tp} {r['model']}: {r['modules']} modules, plan+wire+install "
                  f"{r['overhead_us_per_module']:.0f} µs/module wall, {r['overhead_cpu_us_per_module']:.0f} "
                  f"rank CPU, load {r['load_s']:.3f} s "
                  f"({r['load_x_peer']:.2f}x transformers)", file=sys.stderr)
    described = __doc__.split("\n\n", 2)[2].replace("\n", " ")
    notes = (f"Tiny bfloat16 models (hidden {HIDDEN}), so the load is bookkeeping, not bytes. {described}"
             f" Median of {args.repeat} rounds after a warm-up round; load average (1 min) "
             f"{load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after it (the machine is shared: "
             "the wall figures are noisy, the CPU ones steadier). Command: "
        f"`python3 benchmarks/overhead.py --layers {' '.join(map(str, args.layers))} --degrees "
        f"{' '.join(map(str, args.degrees))} --repeat {args.repeat}`.")
    print(write_results("overhead", rows, COLUMNS, notes=notes,
                        extra={"medians": statistics.median([r["overhead_us_per_module"] for r in rows])}))


if __name__ == "__main__":
    main()
