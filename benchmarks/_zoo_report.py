"""Rows, counts and the markdown/JSON files of the zoo sweep (``benchmarks/zoo.py``).

A row per family: what the parent learned building it (dense or MoE, whether the checkpoint's
keys differ from the module's, a build or one-process failure) and one result per tool,
combined over the ranks: hang > error > SILENT WRONG > pass, the first rank's detail kept.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path

from _zoo_quant import markdown as quant_markdown

# Results that are not any tool's fault: the family could not be tried.
NOT_TRIED = {"skip": "not testable", "build": "build fails", "forward": "forward fails in one process",
             "round trip": "save/reload differs in one process"}
LABEL = {"pass": "pass", "wrong": "**SILENT WRONG**", "error": "error", "hang": "hang", "not run": "not run",
         "refused": "save refused", "no ep plan": "-", **NOT_TRIED}
# "refused": the load was right, and sw.save refused (before writing) to write it back.
_ORDER = ("hang", "error", "wrong", "refused", "pass")


def combine(per_rank: list[dict]) -> dict:
    """One result from every rank's: the worst status, with the detail of the first rank that has it."""
    for status in _ORDER:
        for rank, r in enumerate(per_rank):
            if r["status"] == status:
                out = {k: v for k, v in r.items() if k not in ("trace", "collective_fault")}
                if status != "pass" and len(per_rank) > 1:
                    out["rank"] = rank
                out["seconds"] = max(x.get("seconds", 0) for x in per_rank)
                return out
    raise ValueError(f"no known status in {per_rank}")


def classify(fam, case, results: dict, *, peer: bool) -> dict:
    """The report row of one family."""
    row = {"family": fam.name, "library": fam.library, "model_class": fam.model_class.rpartition(":")[2],
           "moe": bool(case and case.moe), "hub_layout": bool(case and case.hub_layout),
           "key_diff": case.key_diff if case else [], "files": case.files if case else 0}
    if case is None or case.error:
        stage = "skip" if case is None else case.stage
        reason = fam.skip if case is None else case.error
        row["shardwise"] = {"status": stage, "detail": reason}
        row["peer"] = {"status": stage, "detail": reason} if peer else {"status": "not run"}
        row["peer_ep"] = dict(row["peer"]) if fam.ep_plan else {"status": "no ep plan"}
        return row
    if not case.ep_plan:
        row["peer_ep"] = {"status": "no ep plan"}
    for tool in ("shardwise", "peer", "peer_ep"):
        if tool == "peer_ep" and not case.ep_plan:
            continue
        if tool not in results:
            row[tool] = {"status": "not run"}
            continue
        row[tool] = combine(results[tool])
        if row[tool]["status"] != "pass":
            row[tool]["trace"] = results[tool][row[tool].get("rank", 0)].get("trace", "")
        for key in ("detail", "trace"):  # the temporary folder differs from run to run
            row[tool][key] = row[tool].get(key, "").replace(case.folder, "<ckpt>")
    return row


def cause(detail: str) -> str:
    """A grouping key for an error: its first three ``: ``-separated parts (a list of keys
    comes after that), with names, numbers and shapes blanked."""
    text = ": ".join(detail.split(": ")[:3])
    text = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "<name>", text)
    text = re.sub(r"\[[0-9, ]+\]|\([0-9, ]+\)|\d+(\.\d+)?(e-?\d+)?", "N", text)
    return text[:110]


def counts(rows: list[dict]) -> dict:
    """Per kind (dense, MoE, all): families, tested, and per tool pass / SILENT WRONG / error."""
    out: dict = defaultdict(Counter)
    for r in rows:
        kinds = ("MoE" if r["moe"] else "dense", "all")
        for kind in kinds:
            out[kind]["families"] += 1
            if r["shardwise"]["status"] in _ORDER:
                out[kind]["tested"] += 1
            for tool in ("shardwise", "peer", "peer_ep"):
                out[kind][f"{tool} {r.get(tool, {'status': 'not run'})['status']}"] += 1
    return {k: dict(v) for k, v in out.items()}


def _cell(text: str, limit: int = 140) -> str:
    text = (text or "").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(row: dict) -> str:
    sw, peer = row["shardwise"], row["peer"]
    if sw["status"] in NOT_TRIED:
        return _cell(sw.get("detail", ""))
    parts = []
    if sw["status"] != "pass":
        parts.append("shardwise: " + _cell(sw.get("detail", ""), 110))
    if peer["status"] not in ("pass", "not run"):
        parts.append("peer: " + _cell(peer.get("detail", ""), 110))
    ep = row.get("peer_ep", {"status": "not run"})
    if ep["status"] not in ("pass", "not run", "no ep plan"):
        parts.append("peer ep: " + _cell(ep.get("detail", ""), 110))
    return "; ".join(parts)


def _runs(meta: dict) -> str:
    runs = meta.get("runs", [])
    return f" (this run; rows come from {len(runs)} runs: {', '.join(runs)})" if len(runs) > 1 else ""


def markdown(rows: list[dict], meta: dict) -> str:
    c = counts(rows)
    lines = [
        "# Model zoo: shardwise vs the libraries' own tensor-parallel load",
        "",
        "Generated by `benchmarks/zoo.py` (do not edit by hand). Every transformers model type whose config",
        "ships a `base_model_tp_plan` and every diffusers class with a `_tp_plan`, built tiny, saved with",
        "`save_pretrained` into several files, loaded on gloo ranks and compared with one process",
        f"(rtol = atol = 1e-4, float32). tp = {meta['tp']}. \"peer ep\": for a family whose config has a",
        "`base_model_ep_plan`, transformers' TP x EP load in the same run, "
        "`DistributedConfig(tp_plan=\"auto\", "
        f"tp_size={meta['tp']}, ep_size={meta['tp']})` (\"-\": no ep plan).",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: `{meta['commit']}`, {meta['date']}; transformers {meta['transformers']}, "
        f"diffusers {meta['diffusers']}, torch {meta['torch']}",
        f"- runtime: {meta['seconds']} s" + _runs(meta),
        "",
        "| kind | families | tested | shardwise pass | peer pass | shardwise save refused "
        "| shardwise SILENT WRONG | peer SILENT WRONG | with an ep plan | peer ep pass "
        "| peer ep SILENT WRONG |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in ("dense", "MoE", "all"):
        k = c.get(kind, {})
        cells = [k.get(n, 0) for n in ("families", "tested", "shardwise pass", "peer pass",
                                        "shardwise refused", "shardwise wrong", "peer wrong")]
        cells += [k.get("families", 0) - k.get("peer_ep no ep plan", 0), k.get("peer_ep pass", 0),
                  k.get("peer_ep wrong", 0)]
        lines.append(f"| {kind} | " + " | ".join(map(str, cells)) + " |")
    lines += ["", "\"tested\": built and ran in one process. \"hub layout\": the checkpoint's keys differ "
              "from the module's state_dict keys (transformers' save reverts its weight conversions). "
              "\"save\": after a correct load, `sw.save` of the tp model must write every tensor of the "
              "source checkpoint byte for byte, and the library's `from_pretrained` of that folder must "
              "give the reference output; shardwise counts as pass only when both the load and the save "
              "pass (\"save refused\": sw.save raised before writing, naming what it cannot write back).",
              "", "| family | library | kind | hub layout | shardwise | save | peer | peer ep | reason |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["library"] != "transformers", r["family"])):
        lines.append(f"| {r['family']} | {r['library']} | {'MoE' if r['moe'] else 'dense'} | "
                     f"{'yes' if r['hub_layout'] else 'no'} | {LABEL[r['shardwise']['status']]} | "
                     f"{r['shardwise'].get('save', '')} | "
                     f"{LABEL[r['peer']['status']]}{' (earlier run)' if 'from' in r['peer'] else ''} | "
                     f"{LABEL[r.get('peer_ep', {'status': 'not run'})['status']]} | {_reason(r)} |")
    lines += ["", "## shardwise failures by cause", ""]
    groups = defaultdict(list)
    for r in rows:
        if r["shardwise"]["status"] in ("wrong", "error", "hang", "refused"):
            groups[(r["shardwise"]["status"], cause(r["shardwise"].get("detail", "")))].append(r)
    for (status, _), members in sorted(groups.items(), key=lambda g: (-len(g[1]), g[0])):
        first = members[0]
        detail = _cell(first["shardwise"].get("detail", ""), 200)
        hub = sum(m["hub_layout"] for m in members)
        peer = sum(m["peer"]["status"] == "pass" for m in members)
        lines.append(f"- {LABEL[status]} ({len(members)}; hub layout {hub}, peer passes {peer}): {detail} "
                     f"— e.g. `{first['family']}`; all: {', '.join(m['family'] for m in members)}")
    return "\n".join(lines) + "\n"


def write_report(rows: list[dict], meta: dict, out: Path, *, merge: bool, quantized: list[dict] | None = None,
                 ep_families: set[str] | None = None) -> Path:
    """Write ``out`` (markdown) and the JSON beside it; with ``merge`` keep the other rows of
    the JSON already there, and its quantized stage's rows when ``quantized`` is None (this run
    had no such stage); a kept row from before the peer ep column gets "no ep plan" where its
    family is not in ``ep_families``, else "not run". Returns the JSON path."""
    path = out.with_suffix(".json")
    runs = [meta["commit"] + " " + meta["date"]]
    quant = {"meta": meta, "rows": quantized} if quantized is not None else None
    only_quant = not rows
    if merge and path.is_file():
        old = json.loads(path.read_text())
        quant = quant or old.get("quantized")
        before = {r["family"]: r for r in old["families"]}
        for r in rows:  # a --no-peer rerun keeps the peer result it did not redo
            prev = before.get(r["family"], {}).get("peer", {"status": "not run"})
            if r["peer"]["status"] == "not run" and prev["status"] != "not run":
                earlier = old["meta"]["commit"] + " " + old["meta"]["date"]
                r["peer"] = {**prev, "from": prev.get("from") or earlier}
        ran = {r["family"] for r in rows}
        kept = [r for r in old["families"] if r["family"] not in ran]
        for r in kept:
            if "peer_ep" not in r:
                none = ep_families is not None and r["family"] not in ep_families
                r["peer_ep"] = {"status": "no ep plan" if none else "not run"}
        if kept:
            runs = sorted(set(old["meta"].get("runs", [])) | set(runs))
            rows = kept + rows
    if only_quant and merge and path.is_file():  # only the quantized stage ran: the families' meta stays
        meta = old["meta"]
    else:
        meta = {**meta, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta, "counts": counts(rows), "families": rows}
    if quant is not None:
        report["quantized"] = quant
    path.write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(rows, meta)
    if quant is not None:
        text += "\n".join(quant_markdown(quant["rows"], quant["meta"])) + "\n"
    out.write_text(text)
    return path
