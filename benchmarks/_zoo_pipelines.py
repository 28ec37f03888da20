"""The zoo's pipeline rows (``benchmarks/zoo.py --pipelines``): for each tiny diffusers pipeline
(Flux2, QwenImage, Wan: built by tests/hf/pipeline_models.py, offline), what
``sw.from_pretrained(Pipeline, folder, mesh=)`` does with each component at each degree: sharded
by a plan (whose: diffusers' ``_tp_plan``, transformers', or shardwise's for T5/UMT5 encoders),
whole on every rank (a model without a plan), plain (scheduler, tokenizer), or refused before any
read, with the error's reason (a refused degree tries each model alone, ``shard=[name]``); and the
image's largest difference from the one-process pipeline's. Loaded on gloo ranks at tp 2, 4, 3."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _common import REPO

DEGREES = (2, 4, 3)
SECTION = "## Pipelines"


def _library_plan(model) -> bool:
    """Whether the model's library ships it a TP plan (diffusers' ``_tp_plan``, transformers'
    ``tp_plan`` or its config's ``base_model_tp_plan``)."""
    config = getattr(model, "config", None)
    return any(bool(getattr(obj, attr, None)) for obj, attr in
               ((model, "_tp_plan"), (model, "tp_plan"), (config, "base_model_tp_plan")))


def _rank(family: str, folder: str) -> dict:
    """On each rank of a ``tp = world size`` mesh: each component's treatment, plan source and
    (when the pipeline loads) its image; a refused degree tries each model alone (shard=[name])."""
    import torch
    from pipeline_models import generate, pipeline_class

    import shardwise as sw
    from shardwise.testing import shard_state

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    cls = pipeline_class(family)
    try:
        pipe = sw.from_pretrained(cls, folder, mesh=mesh)
    except sw.ShardwiseError:
        pipe = None
    out: dict = {"image": None if pipe is None else generate(pipe, family).tolist(), "components": {}}
    index = json.loads((Path(folder) / "model_index.json").read_text())
    for name in sorted(k for k, v in index.items() if isinstance(v, list) and v[0] is not None):
        if pipe is not None:
            component = getattr(pipe, name)
            if not isinstance(component, torch.nn.Module):
                how, plan = "plain", "-"
            else:
                sharded = any(not s.replicated for s in shard_state(component).specs.values())
                how = "shard" if sharded else "whole"
                plan = index[name][0] if _library_plan(component) else "shardwise" if sharded else "none"
            out["components"][name] = (how, plan, index[name][1])
            continue
        try:
            sw.from_pretrained(cls, folder, mesh=mesh, shard=[name])
            how = "shard"
        except sw.UsageError as e:  # a model without a plan (whole), or not a model (plain)
            how = "whole" if "has no TP plan" in str(e) else "plain" if "not a model" in str(e) \
                else f"refused: {str(e).splitlines()[0][:160]}"
        except sw.ShardwiseError as e:
            how = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:200].replace('|', '/')}"
        out["components"][name] = (how, "", index[name][1])
    return out


def pipeline_rows(work: Path) -> list[dict]:
    """One row per component of each family's pipeline, loaded by ``sw.from_pretrained`` on
    gloo ranks at each degree: its class, plan source and ``shard`` / ``whole`` / ``plain`` or
    ``refused: <reason>`` (a refused degree checks each model alone), and per degree the image's
    largest difference from the one-process pipeline's."""
    sys.path.insert(0, str(REPO / "tests" / "hf"))  # the ranks inherit the path
    import torch
    from pipeline_models import FAMILIES, build_pipeline, generate, pipeline_class, save_pipeline

    from shardwise.testing import spawn

    rows = []
    for family in FAMILIES:
        folder = save_pipeline(family, work / f"pipeline-{family}")
        reference = generate(build_pipeline(family), family)
        runs = {d: spawn(_rank, d, args=(family, str(folder)), timeout=900)[0] for d in DEGREES}
        names = runs[DEGREES[0]]["components"]
        for name in names:
            how, plan, class_name = names[name]
            row = {"pipeline": pipeline_class(family).__name__, "component": name, "class": class_name,
                   "plan": {"shardwise": "shardwise (hf/encoder_plans.py)"}.get(plan, plan)}
            for degree, run in runs.items():
                row[f"tp{degree}"] = run["components"][name][0]
            rows.append(row)
        for degree, run in runs.items():
            image = run["image"]
            diff = None if image is None else (torch.tensor(image) - reference).abs().max().item()
            cell = "-" if diff is None else f"max diff {diff:.1e}"
            rows.append({"pipeline": pipeline_class(family).__name__, "component": "(image)", "class": "",
                         "plan": "", f"tp{degree}": cell})
    return _merge_images(rows)


def _merge_images(rows: list[dict]) -> list[dict]:
    """The per-degree image rows of a pipeline as one row."""
    out: list[dict] = []
    for r in rows:
        if r["component"] == "(image)" and out and out[-1]["component"] == "(image)" \
                and out[-1]["pipeline"] == r["pipeline"]:
            out[-1].update({k: v for k, v in r.items() if k.startswith("tp")})
        else:
            out.append(dict(r))
    return out


def _markdown(rows: list[dict], meta: dict) -> list[str]:
    lines = [SECTION, "",
             f"Generated by `python benchmarks/zoo.py --pipelines-only` (commit `{meta['commit']}`, "
             f"{meta['date']}; diffusers {meta['diffusers']}, transformers {meta['transformers']}). Each "
             "tiny pipeline of tests/hf/pipeline_models.py, saved by `save_pretrained`, loaded by "
             "`sw.from_pretrained(Pipeline, folder, mesh=)` on gloo ranks at each degree: *shard* "
             "(streamed sharded by the plan named: its library's, or shardwise's), *whole* (a model "
             "without a plan, read whole by every rank onto its device), *plain* (scheduler, tokenizer: "
             "the library's `from_pretrained` on every rank), or *refused* before any weight is read "
             "(every rank raises the error quoted; at a refused degree each model is tried alone, "
             "`shard=[name]`). The image row: the largest difference of rank 0's image (2 steps, fixed "
             "seed, float32) from the one-process pipeline's. Their text encoders are families of the "
             "table above (`t5_encoder` and `umt5_encoder` under shardwise's plans, which transformers "
             "lacks: its own tp load refuses them; `mistral3`, `qwen2_5_vl`).", "",
             "| pipeline | component | class | plan | tp=2 | tp=4 | tp=3 |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = " | ".join(r.get(f"tp{d}", "") for d in (2, 4, 3))
        lines.append(f"| {r['pipeline']} | {r['component']} | {r['class']} | {r['plan']} | {cells} |")
    return lines + [""]


def write_pipelines(rows: list[dict], meta: dict, out: Path) -> None:
    """Put the pipeline section at the end of ``out`` (replacing one there) and its rows under
    ``"pipelines"`` in the JSON beside it."""
    path = out.with_suffix(".json")
    report = json.loads(path.read_text()) if path.is_file() else {}
    report["pipelines"] = {"meta": meta, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    text = out.read_text() if out.is_file() else ""
    if SECTION in text:
        text = text[: text.index(SECTION)]
    out.write_text(text.rstrip("\n") + "\n\n" + "\n".join(_markdown(rows, meta)))


def read_pipelines(out: Path) -> dict | None:
    """The pipeline section the JSON beside ``out`` holds (a families run rewrites that JSON:
    the section is written back after it)."""
    path = out.with_suffix(".json")
    return json.loads(path.read_text()).get("pipelines") if path.is_file() else None


__all__ = ["pipeline_rows", "read_pipelines", "write_pipelines"]
