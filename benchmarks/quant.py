"""An FP8 block-scaled checkpoint through tensor parallelism: shardwise, dequantized and kept
quantized, against transformers' own tensor-parallel load of the same checkpoint dequantized.

    python3 benchmarks/quant.py --degrees 2 4 --repeat 2

A ~1 GB Qwen3-shaped FP8 checkpoint (``_quant_models``: float8_e4m3fn weights and float32
``weight_scale_inv`` per 128x128 block, written by transformers) loaded on gloo ranks of this
machine, every method in the same run, interleaved round by round, page cache warm first:

- shardwise dequantized: ``sw.from_pretrained(Qwen3ForCausalLM, folder, mesh=backend.mesh(tp=N),
  dtype=torch.bfloat16, dequantize=True)``: each rank reads its weight and scale regions and
  dequantizes only its shard;
- shardwise kept FP8: ``sw.from_pretrained(Qwen3ForCausalLM, folder, mesh=...)``: transformers'
  ``FP8Linear`` modules, each rank its fp8 shard and its scales;
- transformers dequantized: ``Qwen3ForCausalLM.from_pretrained(folder, quantization_config=
  FineGrainedFP8Config(dequantize=True), tp_plan="auto", dtype=torch.bfloat16)`` (it runs on
  CPU/gloo; the process group exists before the clock starts).

Per rank: load seconds and peak RSS above the level before the load, against the rank's share
in the dtype it holds (dequantized: the bf16 model / tp; kept: the stored fp8 + scales + bf16
bytes / tp). The goal: peak RSS <= 1.1 x share + 64 MiB on every rank. The slowest rank's
load and the largest rank's RSS count; the median round by load time is reported. The
dequantized loads' local tensors are compared byte for byte with transformers'.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import _quant_models as qm
import torch
from _common import PeakRSS, warm_file_cache, write_results

from shardwise.testing import spawn

METHODS = ("shardwise dequantized", "shardwise kept FP8", "transformers dequantized")
PEER = "transformers dequantized"
MIB = 2**20
GOAL_FACTOR, GOAL_SLACK = 1.1, 64 * MIB


def _load(method: str, folder: str, tp: int, backend):
    from transformers import FineGrainedFP8Config, Qwen3ForCausalLM

    import shardwise as sw

    if method == "shardwise dequantized":
        return sw.from_pretrained(Qwen3ForCausalLM, folder, mesh=backend.mesh(tp=tp), dtype=torch.bfloat16,
                                  dequantize=True)
    if method == "shardwise kept FP8":
        return sw.from_pretrained(Qwen3ForCausalLM, folder, mesh=backend.mesh(tp=tp))
    return Qwen3ForCausalLM.from_pretrained(folder, quantization_config=FineGrainedFP8Config(dequantize=True),
                                            tp_plan="auto", dtype=torch.bfloat16)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def rank_run(method: str, folder: str, tp: int, digests: bool) -> dict:
    """One rank of one load: seconds, peak RSS above the level before it, bytes held, and the
    digest of every local tensor (``digests``)."""
    import torch.distributed as dist
    import transformers  # noqa: F401 - imported before the clock, as a user's script would

    import shardwise as sw

    backend = sw.init_backend("gloo")
    gc.collect()
    dist.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        model = _load(method, folder, tp, backend)
        seconds = time.perf_counter() - t0
    state = model.state_dict()
    seen, held, sums = set(), 0, {}
    for name, t in state.items():
        local = _local(t)
        if local.untyped_storage().data_ptr() in seen:
            continue
        seen.add(local.untyped_storage().data_ptr())
        held += local.numel() * local.element_size()
        if digests:
            data = local.detach().contiguous().view(torch.uint8).numpy()
            sums[name] = (tuple(local.shape), str(local.dtype), hashlib.blake2b(data).hexdigest())
    dtypes = sorted({str(_local(t).dtype).removeprefix("torch.") for t in state.values()})
    return {"rank": dist.get_rank(), "load_s": seconds, **peak.as_dict(), "held": held, "dtypes": dtypes,
            "digests": sums}


def summarise(method: str, tp: int, runs: list[list[dict]], ckpt: qm.QuantCheckpoint) -> dict:
    """The median round by the slowest rank's load; RSS against the share in the held dtype."""
    if not runs:
        return {"method": method, "degree": tp}
    runs = sorted(runs, key=lambda ranks: max(r["load_s"] for r in ranks))
    ranks = runs[len(runs) // 2]
    share = (ckpt.stored_bytes if method == "shardwise kept FP8" else ckpt.bf16_bytes) / tp
    rss = max(r["peak_rss"] for r in ranks)
    return {"method": method, "degree": tp, "load_s": max(r["load_s"] for r in ranks),
            "all_load_s": [round(max(r["load_s"] for r in rs), 3) for rs in runs],
            "held_dtypes": ", ".join(sorted({d for r in ranks for d in r["dtypes"]})),
            "share_mib": share / MIB, "rss_mib": rss / MIB, "rss_share": rss / share,
            "anon_share": max(r["peak_anon"] for r in ranks) / share,
            "held_share": max(r["held"] for r in ranks) / share,
            "goal": "yes" if all(r["peak_rss"] <= GOAL_FACTOR * share + GOAL_SLACK for r in ranks) else "NO",
            "ranks": ranks}


def add_ratios(rows: list[dict]) -> None:
    """× transformers: its load seconds over this row's; RSS ÷ transformers: this row's peak
    RSS over its; the dequantized loads' local tensors compared with transformers' by digest."""
    by = {(r["method"], r["degree"]): r for r in rows if "load_s" in r}
    for row in rows:
        peer = by.get((PEER, row["degree"]))
        if "load_s" not in row or peer is None:
            continue
        row["x_peer"] = peer["load_s"] / row["load_s"]
        row["rss_vs_peer"] = row["rss_mib"] / peer["rss_mib"]
        if row["method"] == "shardwise dequantized":
            same = total = 0
            for mine, theirs in zip(row["ranks"], peer["ranks"], strict=True):
                for name, digest in mine["digests"].items():
                    total += 1
                    same += theirs["digests"].get(name) == digest
            row["equal_peer"] = f"{same} of {total}"


COLUMNS = [("method", "method"), ("degree", "tp"), ("held_dtypes", "held as"), ("load_s", "load s"),
           ("share_mib", "share MiB (held dtype)", ".0f"), ("rss_mib", "peak RSS MiB/rank", ".0f"),
           ("rss_share", "peak RSS ÷ share"), ("goal", "≤ 1.1 × share + 64 MiB"),
           ("anon_share", "peak anon ÷ share"), ("held_share", "held ÷ share"),
           ("x_peer", "load speed × transformers"), ("rss_vs_peer", "RSS ÷ transformers"),
           ("equal_peer", "local tensors byte-equal to transformers'")]


def _notes(ckpt: qm.QuantCheckpoint, args) -> str:
    cmd = " ".join(["python3 benchmarks/quant.py", *sys.argv[1:]])
    parts = [
        f"{ckpt.description[0].upper() + ckpt.description[1:]}: {ckpt.stored_bytes / MIB:.0f} MiB stored in "
        f"{len(ckpt.files)} file(s), {ckpt.bf16_bytes / MIB:.0f} MiB once dequantized to bf16.",
        "Ranks are local gloo processes with 1 torch thread each on this machine's "
        f"{os.cpu_count()} cores (shared with other work while it ran); each library is imported and the",
        "process group exists before the clock starts. Page cache warm before every load; methods",
        f"interleaved round by round; the median of {args.repeat} round(s) by the slowest rank's load.",
        "\"share\" is the model in the dtype the rank holds, over tp (dequantized: bf16; kept: fp8",
        "weights + float32 scales + bf16 rest, the stored bytes); peak RSS and peak anonymous memory",
        "are above each rank's level before the load, the largest rank; \"held\" is the bytes of the",
        "rank's own tensors (replicated ones whole). Kept FP8 shards that need no copy are views of the",
        "mapped checkpoint files (page cache): their pages count in RSS once touched, so a kept load's",
        "peak RSS can stay below its share while \"held\" shows every byte is there. The goal column:",
        "every rank's peak RSS <= 1.1 x share + 64 MiB. \"load speed x transformers\" is transformers'",
        "load seconds over this",
        "row's. The last column compares each dequantized local tensor's bytes (blake2b) with",
        f"transformers' on the same rank. Command: `{cmd}`.",
    ]
    return " ".join(parts)


def run(ckpt: qm.QuantCheckpoint, args, log) -> list[dict]:
    files = [str(f) for f in ckpt.files]
    runs: dict[tuple[str, int], list] = {}
    for rnd in range(args.repeat):
        for tp in args.degrees:
            for method in METHODS:
                if method in args.skip:
                    continue
                warm_file_cache(files)
                digests = rnd == 0 and "dequantized" in method
                t = time.perf_counter()
                ranks = spawn(rank_run, tp, args=(method, str(ckpt.folder), tp, digests),
                              timeout=args.timeout)
                if not digests and (method, tp) in runs:  # keep round 1's digests with its run
                    for r in ranks:
                        r.pop("digests")
                runs.setdefault((method, tp), []).append(ranks)
                log(f"  round {rnd + 1} tp={tp} {method}: load {max(r['load_s'] for r in ranks):.2f} s, "
                    f"peak RSS {max(r['peak_rss'] for r in ranks) / MIB:.0f} MiB "
                    f"(spawned run {time.perf_counter() - t:.1f} s)")
    rows = [summarise(m, tp, runs.get((m, tp), []), ckpt) for tp in args.degrees for m in METHODS
            if m not in args.skip]
    for row in rows:  # the digests of the run reported: round 1's if it is not the median one
        first = runs.get((row["method"], row["degree"]), [[]])[0]
        if row.get("ranks") and not row["ranks"][0].get("digests") and first and first[0].get("digests"):
            row["ranks"] = [{**r, "digests": f["digests"]} for r, f in zip(row["ranks"], first, strict=True)]
    add_ratios(rows)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--layers", type=int, default=14, help="decoder layers (14: about 1 GB stored)")
    p.add_argument("--skip", nargs="*", default=[], help="methods to leave out")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "shardwise-bench-quant"),
                   help="where the checkpoint is written (reused when it matches)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    ckpt = qm.fp8_checkpoint(Path(args.dir) / f"qwen3-fp8-{args.layers}l", layers=args.layers)
    log(f"quant-fp8: {ckpt.stored_bytes / MIB:.0f} MiB stored in {ckpt.folder}")
    rows = run(ckpt, args, log)
    public = [{k: v for k, v in r.items() if k != "ranks"} for r in rows]
    per_rank = [{"method": r["method"], "degree": r["degree"],
                 "ranks": [{k: v for k, v in x.items() if k != "digests"} for x in r.get("ranks", [])]}
                for r in rows]
    if args.no_write:
        from _common import markdown_table

        print(f"## quant-fp8\n\n{_notes(ckpt, args)}\n\n{markdown_table(public, COLUMNS)}\n")
        return
    table = write_results("quant-fp8", public, COLUMNS, _notes(ckpt, args),
                          extra={"stored_bytes": ckpt.stored_bytes, "bf16_bytes": ckpt.bf16_bytes,
                                 "per_rank": per_rank})
    print(f"## quant-fp8\n\n{table}\n")


if __name__ == "__main__":
    main()
