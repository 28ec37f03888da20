"""The zoo's quantized stage: FP8 and MXFP4 variants of a few families, tiny, at tp 2/4/8 and ep.

The checkpoints are the test fixtures' (tests/hf/fp8_models.py, fp8_moe_models.py,
mxfp4_models.py: transformers' own quantized modules, written by ``save_pretrained``): one
builder, so the sweep and the tests check the same files. For each variant and layout, the
ranks (one launch per layout, every variant in it) check:

- dequantized: ``sw.from_pretrained(..., dequantize=True)``; every local tensor is the same
  slice of the one-process dequantization (``core.quant``), bit for bit;
- kept: ``sw.from_pretrained(...)``; each quantized weight shard and its scale shard are the
  stored bytes of their regions (scales: of every block the shard touches), and an FP8 pair
  dequantizes to the exact slice;
- save: ``sw.save`` of the kept model is byte-equal to the source files (checked by the parent).

A variant whose layout the model refuses (heads that do not split, experts that do not divide)
is reported with shardwise's error, not left out.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _common import REPO

if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))  # the fixture builders; spawned ranks inherit sys.path

INDEX = "model.safetensors.index.json"
LAYOUTS = (("tp", 2), ("tp", 4), ("tp", 8), ("ep", 2), ("ep", 4))


@dataclass(frozen=True)
class Variant:
    name: str      # e.g. "deepseek_v3-fp8"
    family: str
    scheme: str    # "fp8 128x128" or "mxfp4"
    source: str    # fixtures module
    kind: str      # the module's kind, "" for gpt-oss
    experts: bool
    shape_note: str


VARIANTS = (
    Variant("deepseek_v3-fp8", "deepseek_v3", "fp8 128x128", "fp8_moe_models", "deepseek_v3", True,
            "8 FP8Experts of I=128 + shared expert; kv_a_proj 160 rows (partial block)"),
    Variant("qwen3-fp8", "qwen3", "fp8 128x128", "fp8_models", "qwen3", False,
            "q/k/v 256 rows: 64 a rank at tp=4, 32 at tp=8 (blocks cut)"),
    Variant("qwen3_moe-fp8", "qwen3_moe", "fp8 128x128", "fp8_moe_models", "qwen3_moe", True,
            "4 FP8Experts of I=256: whole blocks at tp=2, cut at tp=4/8"),
    Variant("gpt_oss-mxfp4", "gpt_oss", "mxfp4", "mxfp4_models", "", True,
            "4 experts, K=64/96 (2/3 groups of 32); experts whole under tp, split under ep"),
)


def _module(v: Variant):
    import importlib

    return importlib.import_module(f"hf.{v.source}")


def build(v: Variant, folder: Path) -> Path:
    m = _module(v)
    if v.source == "fp8_models":
        return m.save_fp8(v.kind, folder)
    if v.source == "fp8_moe_models":
        return m.save_fp8_moe(v.kind, folder)
    return m.save_mxfp4(folder)


def _references(v: Variant, folder: str):
    import torch

    from hf.fp8_models import stored_tensors

    m = _module(v)
    held = m.model_tensors(folder) if v.source == "fp8_moe_models" else stored_tensors(folder)
    return held, m.dequantized_state(folder, torch.bfloat16)


def _model_class(v: Variant):
    m = _module(v)
    return m.model_class() if v.source == "mxfp4_models" else m.model_class(v.kind)


def _check(v: Variant, folder: str, out: str, mesh, rank: int) -> dict:
    import torch

    import shardwise as sw
    from shardwise.testing import (
        dequantized_shard,
        expected_scale_shard,
        expected_shard,
        local_shard,
        shard_state,
    )

    def same(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
            a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    held, full = _references(v, folder)
    cls, result = _model_class(v), {}
    model = sw.from_pretrained(cls, folder, mesh=mesh, dtype=torch.bfloat16, dequantize=True)
    specs = shard_state(model).specs
    for name, t in model.state_dict().items():
        spec = specs.spec_of(name)
        n = specs.degrees[spec.axis]
        local = local_shard(t)
        if not same(local, expected_shard(full[name].to(local.dtype), spec, n, rank if n > 1 else 0)):
            return {"dequantized": f"wrong: {name}"}
    result["dequantized"] = "pass"
    kept = sw.from_pretrained(cls, folder, mesh=mesh, holding="local")
    specs, state = shard_state(kept).specs, kept.state_dict()
    if not specs.ties:
        return {**result, "kept": "wrong: no quantized pair held"}
    for scale_name, tie in specs.ties.items():
        spec = specs[tie.weight]
        n = specs.degrees[spec.axis]
        r = rank if n > 1 else 0
        weight, scale = local_shard(state[tie.weight]), local_shard(state[scale_name])
        if not (same(weight, expected_shard(held[tie.weight], spec, n, r))
                and same(scale, expected_scale_shard(held[scale_name], tie, spec, n, r, tuple(scale.shape)))):
            return {**result, "kept": f"wrong: {tie.weight} (stored bytes)"}
        if tie.scheme == "fp8_block" and not same(
                dequantized_shard(weight, scale, tie, spec, n, r, torch.bfloat16),
                expected_shard(full[tie.weight], spec, n, r)):
            return {**result, "kept": f"wrong: {tie.weight} (dequantized pair)"}
    result["kept"] = f"pass ({len(specs.ties)} pairs)"
    sw.save(kept, out, max_shard_size=_module(v).SHARD_SIZE)
    return result


def _ranks(variants: list[Variant], folders: dict, out: str, axis: str, degree: int) -> dict:
    from _zoo_models import first_line

    import shardwise as sw

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(**{axis: degree})
    results = {}
    for v in variants:
        t0 = time.perf_counter()
        try:
            results[v.name] = _check(v, folders[v.name], f"{out}/{v.name}", mesh, backend.rank)
        except Exception as e:  # the row says which error; the sweep goes on
            results[v.name] = {"error": first_line(e)}
        results[v.name]["seconds"] = round(time.perf_counter() - t0, 1)
    return results


def _same_files(source: Path, saved: Path) -> str:
    names = sorted(p.name for p in source.iterdir())
    got = sorted(p.name for p in saved.iterdir() if p.name != "shardwise.json") if saved.is_dir() else []
    if got != names:
        return f"differs: files {got} vs {names}"
    bad = [n for n in names if (saved / n).read_bytes() != (source / n).read_bytes()]
    if bad == [INDEX] and _index_core(saved) == _index_core(source):
        # the index's total_parameters counts the model object that wrote it: gpt-oss's fixture is
        # written from the plain model (transformers cannot quantize MXFP4 on CPU)
        return "byte-equal (index: same weight_map and total_size)"
    return f"differs: {bad[0]}" if bad else "byte-equal"


def _index_core(folder: Path) -> tuple:
    index = json.loads((folder / INDEX).read_text())
    return index["weight_map"], index["metadata"]["total_size"]


def quant_stage(work: Path, *, layouts=LAYOUTS, timeout: int = 900, log=print) -> list[dict]:
    """Build every variant, run every layout, and return one row per (variant, layout)."""
    from shardwise.testing import spawn

    folders = {v.name: str(build(v, work / "quant" / v.name)) for v in VARIANTS}
    rows = []
    for axis, degree in layouts:
        variants = [v for v in VARIANTS if axis == "tp" or v.experts]
        out = work / "quant-out" / f"{axis}{degree}"
        t0 = time.perf_counter()
        try:
            per_rank = spawn(_ranks, degree, args=(variants, folders, str(out), axis, degree),
                             timeout=timeout)
        except Exception as e:  # a hang or a crash of the launch itself
            per_rank = [{v.name: {"error": f"launch: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                         for v in variants}]
        log(f"quantized {axis}={degree}: {time.perf_counter() - t0:.0f} s")
        for v in variants:
            worst = next((r[v.name] for r in per_rank if "error" in r[v.name] or any(
                str(x).startswith("wrong") for x in r[v.name].values())), per_rank[0][v.name])
            row = {"variant": v.name, "family": v.family, "scheme": v.scheme, "layout": f"{axis}={degree}",
                   "note": v.shape_note, **worst}
            if "kept" in row and row["kept"].startswith("pass"):
                row["save"] = _same_files(Path(folders[v.name]), out / v.name)
            rows.append(row)
        shutil.rmtree(out, ignore_errors=True)
    return rows


def markdown(rows: list[dict], meta: dict) -> list[str]:
    """The "Quantized variants" section of docs/models.md."""
    lines = ["", "## Quantized variants", "",
             f"Generated by the sweep's quantized stage (`{meta['command']}`, commit `{meta['commit']}`, "
             f"{meta['date']}; {meta['seconds']} s). Tiny FP8 (128x128 blocks) and MXFP4 checkpoints written "
             "by transformers' own quantized modules and `save_pretrained` (tests/hf fixtures), loaded on "
             "gloo ranks: *dequantized*, every local tensor equals the slice of the one-process "
             "dequantization bit for bit; *kept*, every quantized weight shard and scale shard are the "
             "stored bytes of their regions and each FP8 pair dequantizes to the exact slice; *save*, "
             "`sw.save` of the kept model against the source files.", "",
             "| variant | scheme | layout | dequantized | kept | save | error | shapes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['scheme']} | {r['layout']} | {r.get('dequantized', '')} | "
                     f"{r.get('kept', '')} | {r.get('save', '')} | {r.get('error', '')[:160]} | "
                     f"{r['note']} |")
    return lines


__all__ = ["LAYOUTS", "VARIANTS", "Variant", "build", "markdown", "quant_stage"]
