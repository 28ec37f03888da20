"""A whole Flux2 pipeline on tp ranks: shardwise against diffusers' own tensor-parallel recipe.

    python3 benchmarks/pipeline.py --degrees 2 4 --repeat 2 [--text-layers 12]

One Flux2 pipeline (Flux2 transformer, Mistral3 text encoder, Flux2 VAE, a byte-level tokenizer),
random weights, bfloat16, written by ``save_pretrained`` into a temporary folder. Per degree,
both methods in the same run, interleaved round by round, page cache warm before every load:

- shardwise: ``sw.from_pretrained(Flux2Pipeline, folder, mesh=backend.mesh(tp=N))``: the
  transformer and the text encoder sharded (their own plans), the VAE whole on every rank.
- diffusers: its guide's recipe: ``Flux2Transformer2DModel.from_pretrained(folder/transformer,
  parallel_config=TensorParallelConfig(tp_degree=N))``, then ``Flux2Pipeline.from_pretrained(
  folder, transformer=transformer)``: the text encoder and the VAE whole on every rank. Patched
  to run on the CPU as benchmarks/peers.py patches it (``PATCH_NOTE`` there).

Per rank: the bytes of the tensors it holds (what a GPU would hold: every component's local
parameters and buffers), load seconds, and peak RSS / peak anonymous memory above the level
before the load. On the CPU diffusers and transformers leave bfloat16 weights as views of the
mmap'd files: those pages count in RSS, not in anon, and are shared between the ranks through
the page cache, so the CPU's RSS understates what the recipe costs on a GPU; "held" does not.
The slowest rank's time and the largest rank's memory count; the median over ``--repeat``
rounds. Expected held per rank: (transformer + text encoder) / tp plus the VAE for shardwise,
transformer / tp plus the whole text encoder and the VAE for diffusers.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import PeakRSS, warm_file_cache, write_results

from shardwise.testing import spawn

METHODS = ("shardwise", "diffusers")
MB = 2**20
FIGURES = ("load_s", "held", "peak_rss", "peak_anon")


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(["<pad>"])
    template = "{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endfor %}"
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", chat_template=template)


def make_pipeline(folder: Path, text_layers: int) -> dict[str, int]:
    """A bfloat16 Flux2 pipeline in ``folder``; the bytes of each model component."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2Pipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(0)
    text_encoder = Mistral3ForConditionalGeneration._from_config(Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": 32768, "hidden_size": 1024,
                     "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
                     "head_dim": 64, "num_hidden_layers": text_layers},
        vision_config={"model_type": "pixtral", "hidden_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 4, "intermediate_size": 128, "image_size": 64,
                       "patch_size": 16}), dtype=torch.bfloat16)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=64,
        num_attention_heads=16, joint_attention_dim=3 * 1024, timestep_guidance_channels=256,
        axes_dims_rope=(16, 16, 16, 16)).to(torch.bfloat16)
    vae = AutoencoderKLFlux2(latent_channels=4, block_out_channels=(32, 64), layers_per_block=1,
                             down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8).to(torch.bfloat16)
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                         tokenizer=_tokenizer(), transformer=transformer)
    pipe.save_pretrained(folder)
    return {n: sum(p.numel() * p.element_size() for p in getattr(pipe, n).parameters())
            for n in ("transformer", "text_encoder", "vae")}


def _patch_diffusers_for_cpu() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from peers import _patch_diffusers_for_cpu as patch  # one patch, the one peers.py documents

    patch()


def rank_run(method: str, folder: str, tp: int) -> dict:
    import torch.distributed as dist
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel, TensorParallelConfig

    import shardwise as sw
    from shardwise import testing

    backend = sw.init_backend("gloo")
    testing.preload()  # shardwise's lazily imported modules: imports are not part of a load
    if method == "diffusers":
        _patch_diffusers_for_cpu()
    mesh = backend.mesh(tp=tp)
    gc.collect()
    dist.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        if method == "shardwise":
            pipe = sw.from_pretrained(Flux2Pipeline, folder, mesh=mesh, dtype=torch.bfloat16)
        else:
            transformer = Flux2Transformer2DModel.from_pretrained(
                f"{folder}/transformer", dtype=torch.bfloat16,
                parallel_config=TensorParallelConfig(tp_degree=tp))
            pipe = Flux2Pipeline.from_pretrained(folder, transformer=transformer, dtype=torch.bfloat16)
        seconds = time.perf_counter() - t0
    return {"rank": dist.get_rank(), "load_s": seconds, "held": _held_bytes(pipe), **peak.as_dict()}


def _held_bytes(pipe) -> int:
    """Bytes of the tensors this rank holds, every model component: what sits on its device."""
    total = 0
    for name in ("transformer", "text_encoder", "vae"):
        unique = {id(t): t for t in getattr(pipe, name).state_dict(keep_vars=True).values()}
        for t in unique.values():
            local = t.to_local() if type(t).__name__ == "DTensor" else t
            total += local.numel() * local.element_size()
    return total


def _row(tp: int, runs: dict, sizes: dict[str, int]) -> dict:
    med = {m: {k: statistics.median(r[k] for r in runs[(tp, m)]) for k in FIGURES} for m in METHODS}
    sw, df = med["shardwise"], med["diffusers"]
    return {"tp": tp, "sw_held_mb": sw["held"] / MB, "df_held_mb": df["held"] / MB,
            "held_ratio": sw["held"] / df["held"],
            "sw_peak_mb": sw["peak_rss"] / MB, "df_peak_mb": df["peak_rss"] / MB,
            "peak_ratio": sw["peak_rss"] / df["peak_rss"],
            "sw_anon_mb": sw["peak_anon"] / MB, "df_anon_mb": df["peak_anon"] / MB,
            "expected_sw_mb": ((sizes["transformer"] + sizes["text_encoder"]) / tp + sizes["vae"]) / MB,
            "expected_df_mb": (sizes["transformer"] / tp + sizes["text_encoder"] + sizes["vae"]) / MB,
            "sw_load_s": sw["load_s"], "df_load_s": df["load_s"], "load_ratio": sw["load_s"] / df["load_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--text-layers", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "pipe"
        sizes = make_pipeline(folder, args.text_layers)
        print({k: f"{v / MB:.0f} MB" for k, v in sizes.items()}, flush=True)
        runs: dict[tuple[int, str], list[dict]] = {}
        for tp in args.degrees:
            for _ in range(args.repeat):
                for method in METHODS:
                    warm_file_cache(sorted(folder.rglob("*.safetensors")))
                    ranks = spawn(rank_run, tp, args=(method, str(folder), tp), timeout=900)
                    worst = {k: max(r[k] for r in ranks) for k in FIGURES}  # slowest, largest rank
                    runs.setdefault((tp, method), []).append({**worst, "ranks": ranks})
                    print(tp, method, worst, flush=True)
    rows = [_row(tp, runs, sizes) for tp in args.degrees]
    columns = [("tp", "tp", None), ("sw_held_mb", "shardwise held/rank MB", ".0f"),
               ("df_held_mb", "diffusers recipe held/rank MB", ".0f"), ("held_ratio", "held ratio", ".2f"),
               ("sw_peak_mb", "shardwise peak RSS MB", ".0f"),
               ("df_peak_mb", "diffusers peak RSS MB", ".0f"), ("peak_ratio", "RSS ratio", ".2f"),
               ("sw_anon_mb", "shardwise anon MB", ".0f"), ("df_anon_mb", "diffusers anon MB", ".0f"),
               ("expected_sw_mb", "(T+E)/tp+VAE MB", ".0f"), ("expected_df_mb", "T/tp+E+VAE MB", ".0f"),
               ("sw_load_s", "shardwise load s", ".2f"), ("df_load_s", "diffusers load s", ".2f"),
               ("load_ratio", "load time ratio", ".2f")]
    notes = (f"`python3 benchmarks/pipeline.py --degrees {' '.join(map(str, args.degrees))} --repeat "
             f"{args.repeat} --text-layers {args.text_layers}`: a bfloat16 Flux2 pipeline (transformer "
             f"{sizes['transformer'] / MB:.0f} MB, Mistral3 text encoder "
             f"{sizes['text_encoder'] / MB:.0f} MB, "
             f"VAE {sizes['vae'] / MB:.1f} MB) on gloo ranks of this machine. shardwise: "
             "`sw.from_pretrained(Flux2Pipeline, folder, mesh=mesh)`; diffusers recipe: the transformer with "
             "`parallel_config=TensorParallelConfig(tp_degree=N)` (patched for the CPU as in peers.py), the "
             "text encoder whole on every rank. Held: the bytes of the tensors a rank holds (what a GPU "
             "would hold); RSS counts the recipe's mmap'd weights as file pages shared through the page "
             "cache, anon excludes them. Peak memory above the level before the load, the largest "
             "rank; load time of the slowest rank; medians over the rounds; ratios: shardwise / diffusers.")
    print(write_results("pipeline", rows, columns, notes, extra={"sizes": sizes, "runs": {
        f"{tp}-{m}": v for (tp, m), v in runs.items()}}))


if __name__ == "__main__":
    main()
