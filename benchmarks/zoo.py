"""Conformance sweep: every transformers family with a TP plan, every diffusers class with one.

    python benchmarks/zoo.py                          # the whole zoo at tp=2, writes docs/models.md + .json
    python benchmarks/zoo.py --only llama,qwen3_moe   # a few families (rows merged into the existing JSON)
    python benchmarks/zoo.py --failed-from docs/models.json   # rerun what did not pass for shardwise
    python benchmarks/zoo.py --no-peer --limit 10     # shardwise only, the first 10 families
    python benchmarks/zoo.py --ep-plan-only           # the families with a base_model_ep_plan
    python benchmarks/zoo.py --quantized-only         # only the quantized stage (other rows kept)
    python benchmarks/zoo.py --pipelines-only         # only the pipelines' section (other rows kept)

For each family the parent (one process) builds a tiny model (hidden 64, 3 layers, 4 heads,
vocab 256, 4 experts: benchmarks/_zoo_configs.py), perturbs its weights, saves it with
``save_pretrained`` into several files and records the output of a fixed input. Then ``tp``
gloo ranks, started once, load each checkpoint two ways and compare with that output
(rtol = atol = 1e-4, float32):

- shardwise: the model built with parameters on meta (``sw.empty_model()``), then
  ``sw.load(model, ckpt, plan=<the model's own plan>, mesh=backend.mesh(tp=tp))``;
- peer: the library's own tensor-parallel load, ``from_pretrained(ckpt,
  distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp))`` for transformers,
  ``from_pretrained(ckpt, parallel_config=TensorParallelConfig(tp_degree=tp))`` for diffusers;
- peer ep (families whose config has a ``base_model_ep_plan``): transformers' TP x EP load,
  ``DistributedConfig(tp_plan="auto", tp_size=tp, ep_size=tp)``.

A result is pass, SILENT WRONG (no error, but another output shape or other values), error
(first line of the exception), hang (a rank gave no result in time), or, for both tools, one
of: not testable (no text model class), build fails, forward fails in one process too.
Then the quantized stage (``_zoo_quant.py``): FP8 and MXFP4 variants of DeepSeek-V3, Qwen3,
Qwen3-MoE and gpt-oss at tp 2/4/8 and ep 2/4, loaded dequantized and kept quantized, saved
back; its table is the "Quantized variants" section of docs/models.md. Then the pipelines
(``_zoo_pipelines.py``): which components of the Flux2, QwenImage and Wan pipelines shard, stay
whole or are refused at tp 2, 4 and 3; the "Pipelines" section. The text encoders of those
pipelines without a config plan (T5 and UMT5 under shardwise's plans, Mistral3, Qwen2.5-VL) are
families of the sweep too.
Installs nothing: ``tox -e zoo`` has the requirements.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401 - puts the checkout's src first on sys.path
from _common import REPO
from _zoo_models import (
    build_case,
    diffusers_families,
    ep_plan_families,
    text_encoder_families,
    transformers_families,
)
from _zoo_pipelines import pipeline_rows, read_pipelines, write_pipelines
from _zoo_quant import quant_stage
from _zoo_ranks import RankPool, quiet_libraries
from _zoo_report import classify, write_report

TESTED = ("pass", "wrong", "error", "hang", "refused")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="",
                    help="comma-separated family names (model types or diffusers classes)")
    ap.add_argument("--failed-from", type=Path, help="rerun the families whose shardwise result in this JSON "
                    "was not pass (and could be tested)")
    ap.add_argument("--ep-plan-only", action="store_true",
                    help="only the families whose config has a base_model_ep_plan (the peer ep column)")
    ap.add_argument("--limit", type=int, default=0, help="at most N families (after --only/--failed-from)")
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                    help="also load with the library's own tensor parallelism (default: yes)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree = number of ranks (default 2)")
    ap.add_argument("--timeout", type=int, default=90, help="seconds per family and tool on the ranks")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "models.md")
    ap.add_argument("--merge", action=argparse.BooleanOptionalAction, default=None,
                    help="keep the other families' rows of an existing JSON (default: when a subset runs)")
    ap.add_argument("--quantized", action=argparse.BooleanOptionalAction, default=None,
                    help="run the quantized stage (default: on a run of the whole zoo)")
    ap.add_argument("--quantized-only", action="store_true",
                    help="run only the quantized stage; the families' rows of the existing JSON are kept")
    ap.add_argument("--pipelines", action=argparse.BooleanOptionalAction, default=None,
                    help="the pipelines' section (default: on a run of the whole zoo)")
    ap.add_argument("--pipelines-only", action="store_true",
                    help="only the pipelines' section; the rest of the existing report is kept")
    ap.add_argument("--work", type=Path,
                    help="folder for the checkpoints (default: a temporary one, removed)")
    return ap.parse_args(argv)


def select(args) -> list:
    families = transformers_families() + text_encoder_families() + diffusers_families()
    names = [n for n in args.only.split(",") if n]
    if args.failed_from:
        old = json.loads(args.failed_from.read_text())["families"]
        names += [r["family"] for r in old if r["shardwise"]["status"] in TESTED[1:]]
    if names:
        unknown = sorted(set(names) - {f.name for f in families})
        if unknown:
            sys.exit(f"unknown families: {', '.join(unknown)}")
        families = [f for f in families if f.name in set(names)]
    if args.ep_plan_only:
        families = [f for f in families if f.name in ep_plan_families()]
    return families[: args.limit] if args.limit else families


def git_describe() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def sweep(families, args, work: Path) -> list[dict]:
    """Build every case in this process, then run the testable ones on the ranks."""
    rows, cases = [], []
    t0 = time.perf_counter()
    for fam in families:
        case = None if fam.skip else build_case(fam, work, args.tp)
        cases.append((fam, case))
    built = sum(c is not None for _, c in cases)
    print(f"built {built} cases in {time.perf_counter() - t0:.0f} s", flush=True)
    pool = RankPool(args.tp, args.timeout, log=lambda m: print(m, flush=True))
    try:
        for i, (fam, case) in enumerate(cases, 1):
            results = {}
            if case is not None and not case.error:
                results["shardwise"] = pool.run(case, "shardwise")
                if args.peer:
                    results["peer"] = pool.run(case, "peer")
                    if case.ep_plan:
                        results["peer_ep"] = pool.run(case, "peer_ep")
            row = classify(fam, case, results, peer=args.peer)
            rows.append(row)
            sw, peer, ep = row["shardwise"], row["peer"], row["peer_ep"]
            loud = "  <-- SILENT WRONG" if "wrong" in (sw["status"], peer["status"], ep["status"]) else ""
            print(f"[{i}/{len(cases)}] {fam.name}: shardwise {sw['status']}, peer {peer['status']}, "
                  f"peer ep {ep['status']}{loud}  "
                  f"{sw.get('detail', '')[:100]}", flush=True)
    finally:
        pool.close()
    print(f"rank restarts: {pool.restarts}", flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_libraries()  # before diffusers/transformers print their import-time notices
    families = [] if args.quantized_only or args.pipelines_only else select(args)
    partial = bool(args.only or args.failed_from or args.limit or args.pipelines_only or args.ep_plan_only)
    run_pipelines = args.pipelines_only or (args.pipelines if args.pipelines is not None else not partial)
    kept_pipelines, pipelines = read_pipelines(args.out), None
    run_quant = args.quantized_only or (args.quantized if args.quantized is not None else not partial)
    work = args.work or Path(tempfile.mkdtemp(prefix="shardwise-zoo-"))
    start = time.perf_counter()
    quantized = None
    try:
        rows = sweep(families, args, work) if families else []
        if run_quant:
            quantized = quant_stage(work, log=lambda m: print(m, flush=True))
        if run_pipelines:
            pipelines = pipeline_rows(work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    meta = {"command": " ".join(["python benchmarks/zoo.py", *(sys.argv[1:] if argv is None else argv)]),
            "commit": git_describe(), "date": time.strftime("%Y-%m-%d %H:%M"), "tp": args.tp,
            "seconds": round(time.perf_counter() - start), "peer": args.peer,
            "transformers": _version("transformers"), "diffusers": _version("diffusers"),
            "torch": _version("torch")}
    merge = args.merge if args.merge is not None else partial or args.quantized_only
    if not args.pipelines_only:
        path = write_report(rows, meta, args.out, merge=merge, quantized=quantized,
                            ep_families=ep_plan_families())
        print(f"wrote {args.out} and {path} in {meta['seconds']} s", flush=True)
    if pipelines is not None:
        write_pipelines(pipelines, meta, args.out)
        print(f"wrote the pipelines' section of {args.out}", flush=True)
    elif kept_pipelines:  # the families' report was rewritten: the section goes back after it
        write_pipelines(kept_pipelines["rows"], kept_pipelines["meta"], args.out)
    return 0


def _version(name: str) -> str:
    try:
        return __import__(name).__version__
    except Exception:  # not installed: the report says so
        return "absent"


if __name__ == "__main__":
    sys.exit(main())
