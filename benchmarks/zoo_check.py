"""sw.check_plan over the zoo: every family of benchmarks/zoo.py, its own plan, at tp=2.

    python benchmarks/zoo_check.py                     # every family; writes docs/plan_check.md + .json
    python benchmarks/zoo_check.py --only llama,doge   # a few families

Each of ``tp`` gloo ranks builds the zoo's tiny model of a family (benchmarks/_zoo_models.py: the
same config, seed and perturbation as the sweep) and runs ``sw.check_plan(model, inputs,
plan="auto", mesh=backend.mesh(tp=tp))``. The table sets the checker's verdict next to the
sweep's (docs/models.json, shardwise column): where the sweep's output agrees the checker must
agree (no false alarm); where the sweep's shardwise load failed (error, SILENT WRONG), the checker
must name the module. Families the sweep could not test are listed with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import _common  # noqa: F401 - puts the checkout's src first on sys.path
from _common import REPO, SRC
from _zoo_models import _build, diffusers_families, first_line, transformers_families

OUT_MD = REPO / "docs" / "plan_check.md"
OUT_JSON = REPO / "docs" / "plan_check.json"
SWEEP = REPO / "docs" / "models.json"


def _check(names: list[str], tp: int) -> list[dict]:
    """On every rank: the checker's verdict for each family (rank 0's list is kept)."""
    from _zoo_ranks import quiet_libraries

    import shardwise as sw

    quiet_libraries()
    backend = sw.init_backend("gloo")
    families = {f.name: f for f in transformers_families() + diffusers_families()}
    rows = []
    for name in names:
        start = time.perf_counter()
        row = {"family": name}
        try:
            model, inputs = _build(families[name], tp)
        except Exception as e:  # noqa: BLE001 - every failure is a row
            rows.append({**row, "verdict": "build fails", "detail": first_line(e)})
            continue
        try:
            report = sw.check_plan(model, (), kwargs=inputs, plan="auto", mesh=backend.mesh(tp=tp))
        except sw.UsageError as e:  # the one-process forward raised
            rows.append({**row, "verdict": "forward fails in one process", "detail": first_line(e)})
            continue
        except Exception as e:  # noqa: BLE001
            rows.append({**row, "verdict": "checker error", "detail": first_line(e)})
            continue
        rows.append({**row, "verdict": "agrees" if report.ok else "diverges",
                     "module": report.first_divergence,
                     "likely_cause": report.likely_cause, "detail": (report.refusal or report.hint)[:300],
                     "modules": len(report.rows), "seconds": round(time.perf_counter() - start, 2)})
    return rows


def _judge(row: dict, sweep: dict | None) -> str:
    """``ok`` when the checker and the sweep agree, else why not."""
    status = (sweep or {}).get("shardwise", {}).get("status", "")
    if row["verdict"] == "agrees":
        if (sweep or {}).get("shardwise", {}).get("detail", "").startswith("CheckpointError"):
            return "ok (the sweep's load failed reading the checkpoint; the plan is right)"
        return "ok" if status in ("pass", "") else f"MISSED ({status})"
    if row["verdict"] == "diverges":
        if status == "pass":
            return "FALSE ALARM"
        return "ok" if row.get("module") else "NO MODULE"
    return "not checked"


def main(argv=None) -> int:
    # the ranks import shardwise before this module's _common can put the checkout first
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(SRC), os.environ.get("PYTHONPATH"))))
    from shardwise.testing import RankFailure, spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated family names")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=12, help="families per spawn of the ranks")
    ap.add_argument("--part", default="0/1", metavar="I/N",
                    help="every N-th family from the I-th (run the N parts side by side; rows merge)")
    args = ap.parse_args(argv)
    part, parts = (int(x) for x in args.part.split("/"))
    sweep = {f["family"]: f for f in json.loads(SWEEP.read_text())["families"]} if SWEEP.exists() else {}
    names = [f.name for f in transformers_families() + diffusers_families() if not f.skip]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    names = names[part::parts]
    start = time.perf_counter()
    rows: list[dict] = []
    for i in range(0, len(names), args.chunk):
        part = names[i:i + args.chunk]
        try:
            rows += spawn(_check, args.tp, args=(part, args.tp), timeout=120.0 * len(part))[0]
        except RankFailure:  # one family hung or killed a rank: check them one by one
            for name in part:
                try:
                    rows += spawn(_check, args.tp, args=([name], args.tp), timeout=180.0)[0]
                except RankFailure as e:
                    rows.append({"family": name, "verdict": "checker error", "detail": first_line(e)})
        print(f"{len(rows)}/{len(names)} families", flush=True)
        _save(rows, sweep, args.tp, round(time.perf_counter() - start))  # after every chunk
    print(OUT_MD.read_text())
    return 0


def _save(rows: list[dict], sweep: dict, tp: int, seconds: int) -> None:
    """Merge ``rows`` into docs/plan_check.json (a family's row replaced) and rewrite the page."""
    for row in rows:
        row["sweep"] = sweep.get(row["family"], {}).get("shardwise", {}).get("status", "")
        row["judged"] = _judge(row, sweep.get(row["family"]))
    old = json.loads(OUT_JSON.read_text()) if OUT_JSON.exists() else {"families": [], "seconds": 0}
    merged = {r["family"]: r for r in old["families"] if old.get("tp") == tp}
    merged.update({r["family"]: r for r in rows})
    families = sorted(merged.values(), key=lambda r: r["family"])
    OUT_JSON.write_text(json.dumps({"tp": tp, "seconds": seconds, "ran": len(rows), "families": families},
                                   indent=1))
    _write_md(families, tp, seconds, len(rows))


def _write_md(rows: list[dict], tp: int, seconds: int, ran: int) -> None:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["judged"]] = counts.get(r["judged"], 0) + 1
    lines = [
        "# sw.check_plan over the model zoo",
        "",
        f"Generated by `benchmarks/zoo_check.py` (do not edit by hand): every family of "
        f"`benchmarks/zoo.py`, its own plan (`plan=\"auto\"`), tp = {tp}, {len(rows)} families"
        + (f" in {seconds} s" if ran == len(rows) else f", {ran} of them in {seconds} s")
        + " (the last run; `--part` and `--only` runs merge). \"sweep\" is the shardwise column of "
        "docs/models.md (load and compare logits); "
        "\"judged\": ok when the checker agrees with it (no alarm where the logits agree, a module "
        "named where they do not), FALSE ALARM / MISSED / NO MODULE otherwise.",
        "",
        "| judged | families |",
        "|---|---:|",
        *[f"| {k} | {v} |" for k, v in sorted(counts.items())],
        "",
        "| family | sweep | checker | module | likely cause | judged | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["judged"] == "ok", r["family"])):
        detail = r.get("detail", "").replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(f"| {r['family']} | {r['sweep']} | {r['verdict']} | {r.get('module') or ''} | "
                     f"{r.get('likely_cause') or ''} | {r['judged']} | {detail} |")
    OUT_MD.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
