"""Crash trials (tests/stress/stress.py kills | deaths).

``kills``: a save (gather, distributed, each fresh or over a previous checkpoint) on two
gloo ranks, or a consolidation, is SIGKILLed from outside at a random moment (rank 0, rank 1
or both, in turn). Afterwards the target must be absent, the previous checkpoint byte for
byte, or the new one whole (``sw.verify`` ok and ``sw.diff`` identical to a reference); a
surviving rank 0 must have removed its temporary folder; a killed one's is removed by the
next save, which must then succeed.

``deaths``: a rank ends on purpose (os._exit, SIGKILL, SIGSTOP) at a chosen point of a load
or a save; the survivor must raise a ShardwiseError (or finish, where no collective is left)
within twice the collectives' timeout.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import time
from pathlib import Path

import torch
from _common import bench_model, bench_plan, real_plan
from dying_ranks import Ranks, die, run_with_deaths

# gather: the rank-0 stream; parallel: every rank writes its own regions (sw.save parallel_write)
KILL_KINDS = ("gather", "gather-overwrite", "parallel", "parallel-overwrite", "dcp", "dcp-overwrite",
              "consolidate")
VICTIMS = ("rank 0", "rank 1", "both")
TIMEOUT = 10.0  # seconds: the collectives' timeout in every trial


def trial_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return bench_model(4, 384, 4096)  # ~50 MB of float32: a save takes long enough to be hit


def _files(folder: Path) -> dict[str, str] | None:
    if not folder.exists():
        return None
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".shardwise-" in p.name)


# --- what the ranks run (module level: spawned by name) -----------------------------------------

def save_rank(root: str, kind: str, seed: int, ready: str | None) -> str:
    import shardwise as sw

    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    model = trial_model(seed)
    sw.parallelize(model, real_plan(bench_plan()), backend.mesh(tp=2))
    backend.barrier()
    if ready and backend.rank == 0:
        Path(ready).touch()
    target = f"{root}/target"
    _save(model, target, kind, overwrite=kind.endswith("overwrite"))
    return "saved"


def _save(model, target, kind: str, **kwargs) -> None:
    """``sw.save`` as ``kind`` (dcp..., parallel..., else the rank-0 stream) does it."""
    import shardwise as sw

    if kind.startswith("dcp"):
        sw.save(model, target, distributed=True, **kwargs)
    else:
        sw.save(model, target, parallel_write=kind.startswith("parallel"), **kwargs)


def consolidate_proc(src: str, dst: str, ready: str | None) -> str:
    import shardwise as sw

    if ready:
        Path(ready).touch()
    sw.consolidate(src, dst, overwrite=True)
    return "saved"


def _launch(root: Path, kind: str, seed: int, ready: Path | None) -> Ranks:
    if kind == "consolidate":
        return Ranks(consolidate_proc, 1, (str(root / "source"), str(root / "target"),
                                           str(ready) if ready else None))
    return Ranks(save_rank, 2, (str(root), kind, seed, str(ready) if ready else None))


# --- kill trials ---------------------------------------------------------------------------------

def _prepare(root: Path, kind: str) -> float:
    """Reference checkpoints, the previous checkpoint where the kind needs one, and the
    duration of one undisturbed run (what the kill moments are drawn from)."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    import shardwise as sw

    sw.save(trial_model(0), root / "reference")
    if kind == "consolidate":
        outcomes = _launch(root, "dcp", 0, None).wait(300)
        assert all(o.kind == "ok" for o in outcomes.values()), outcomes
        (root / "target").rename(root / "source")
    ready = root / "ready"
    ranks = _launch(root, kind, 0, ready)
    while not ready.exists():
        time.sleep(0.01)
    began = time.monotonic()
    outcomes = ranks.wait(300)
    assert all(o.kind == "ok" for o in outcomes.values()), outcomes
    took = time.monotonic() - began
    shutil.rmtree(root / "target")
    if kind == "consolidate":  # consolidate replaces a previous checkpoint: another model's
        sw.save(trial_model(1), root / "previous")
    elif kind.endswith("overwrite"):  # the previous checkpoint: another model, same layout
        outcomes = _launch(root, kind.removesuffix("-overwrite"), 1, None).wait(300)
        assert all(o.kind == "ok" for o in outcomes.values()), outcomes
        (root / "target").rename(root / "previous")
    return took


def _last_line(text) -> str:
    return str(text).strip().splitlines()[-1][:200]


def _ended_cleanly(outcome) -> bool:
    """A survivor finished, or raised a ShardwiseError (its traceback's last line says which)."""
    if outcome.kind == "ok":
        return True
    last = _last_line(outcome.value) if outcome.kind == "error" else ""
    return last.startswith("shardwise.errors.") or last.startswith("shardwise.testing.RankFailure")


def _state(target: Path, before: dict | None, reference: Path) -> str:
    import shardwise as sw

    now = _files(target)
    if now is None:
        return "absent" if before is None else "LOST (previous gone)"
    if now == before:
        return "previous"
    report = sw.verify(target)
    if report.ok and sw.diff(target, reference).identical:
        return "new"
    return f"PARTIAL ({report.summary()})"


def kill_trial(root: Path, kind: str, j: int, took: float, rng: random.Random) -> dict:
    """One trial: start the run, kill at a random moment, check what is left, save again."""
    target = root / "target"
    shutil.rmtree(target, ignore_errors=True)  # fresh, or over the previous checkpoint
    if (root / "previous").exists():
        shutil.copytree(root / "previous", target)
    before = _files(target)
    victims = [0] if kind == "consolidate" else {"rank 0": [0], "rank 1": [1], "both": [0, 1]}[
        VICTIMS[j % 3]]
    ready = root / "ready"
    ready.unlink(missing_ok=True)
    ranks = _launch(root, kind, 0, ready)
    while not ready.exists() and ranks.procs[0].exitcode is None:
        time.sleep(0.005)
    delay = rng.uniform(0, 1.5 * took)  # some land after the end: the run must have finished
    time.sleep(delay)
    for v in victims:
        ranks.kill(v)
    outcomes = ranks.wait(2 * TIMEOUT + 30)
    survivors = {r: o for r, o in outcomes.items() if r not in victims}
    row = {"kind": kind, "victims": victims, "delay_s": round(delay, 3),
           "survivors": {r: (o.kind, o.value if o.kind != "error" else _last_line(o.value))
                         for r, o in survivors.items()},
           "state": _state(target, before, root / "reference"),
           "left_after_kill": _leftovers(root)}
    # The next run, undisturbed, repairs what a killed rank 0 left and must succeed.
    again_kind = kind if kind.endswith("overwrite") or kind == "consolidate" else kind + "-overwrite"
    again = _launch(root, again_kind, 0, None)
    ended = again.wait(300)
    row["next_run"] = ",".join(sorted({o.kind for o in ended.values()}))
    if row["next_run"] != "ok":
        row["next_run_detail"] = {r: _last_line(o.value) for r, o in ended.items() if o.kind != "ok"}
    row["left_after_next"] = _leftovers(root)
    row["next_state"] = _state(target, None, root / "reference")
    row["ok"] = (not row["state"].startswith(("LOST", "PARTIAL"))
                 and (0 in victims or not row["left_after_kill"])
                 and not row["left_after_next"] and row["next_run"] == "ok"
                 and row["next_state"] == "new"
                 and all(_ended_cleanly(o) for o in survivors.values()))
    return row


def run_kills(work: Path, n: int, seed: int, kinds=KILL_KINDS, progress=print) -> dict:
    rows = []
    for kind in kinds:
        root = work / kind
        took = _prepare(root, kind)
        rng = random.Random(f"{seed}-{kind}")
        for j in range(n):
            rows.append(kill_trial(root, kind, j, took, rng))
        bad = [r for r in rows if r["kind"] == kind and not r["ok"]]
        if progress:
            progress(f"  kills {kind}: {n} trials ({took:.2f} s per run), {len(bad)} failed")
        shutil.rmtree(root, ignore_errors=True)
    return {"n": n, "seed": seed, "rows": rows}


# --- rank deaths ---------------------------------------------------------------------------------

DEATH_OPS = ("gather save", "parallel save", "dcp save", "dcp load", "safetensors load")
DEATHS = ("exit", "kill", "stop")
POINTS = ("early", "middle")


def _hook(op: str, point: str) -> tuple[object, str, int]:
    """Where the victim dies: (owner, attribute, on which call)."""
    import torch.distributed.checkpoint as dcp

    from shardwise.io import gather, sink
    from shardwise.io.formats.dcp.items import HashingWriter
    from shardwise.io.formats.dcp.metadata import MetadataReader
    from shardwise.io.formats.safetensors import source as safetensors_source
    from shardwise.io.read import reader
    from shardwise.io.storage.local import LocalWriter

    return {
        ("gather save", "early"): (sink, "on_rank0", 1),
        ("gather save", "middle"): (gather, "gather_to_rank0", 3),
        ("parallel save", "early"): (sink, "on_rank0", 1),
        ("parallel save", "middle"): (LocalWriter, "pwrite", 3),
        ("dcp save", "early"): (sink, "on_rank0", 1),
        ("dcp save", "middle"): (HashingWriter, "write_data", 1),
        ("dcp load", "early"): (dcp, "load", 1),
        ("dcp load", "middle"): (MetadataReader, "read_data", 1),
        ("safetensors load", "early"): (safetensors_source, "resolve_checkpoint", 1),
        ("safetensors load", "middle"): (reader.RegionReader, "read", 1),
    }[(op, point)]


def death_rank(root: str, op: str, death: str, victim: int, point: str) -> tuple[str, float]:
    import shardwise as sw

    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    mesh = backend.mesh(tp=2)
    if backend.rank == victim:
        owner, name, nth = _hook(op, point)
        original, calls = getattr(owner, name), [0]

        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == nth:
                die(death)
            return original(*args, **kwargs)

        setattr(owner, name, dying)
    start = time.monotonic()
    try:
        if op.endswith("save"):
            model = trial_model(0)
            sw.parallelize(model, real_plan(bench_plan()), mesh)
            _save(model, f"{root}/out", op.split()[0])
        else:
            with torch.device("meta"):
                model = trial_model(0)
            src = f"{root}/{'dcp' if op.startswith('dcp') else 'gather'}"
            sw.load(model, src, plan=real_plan(bench_plan()), mesh=mesh, progress=False)
    except sw.ShardwiseError as e:
        return type(e).__name__, time.monotonic() - start
    return "completed", time.monotonic() - start


def _save_sources(root: str) -> bool:
    import shardwise as sw

    backend = sw.init_backend("gloo")
    model = trial_model(0)
    sw.parallelize(model, real_plan(bench_plan()), backend.mesh(tp=2))
    sw.save(model, f"{root}/gather")
    sw.save(model, f"{root}/dcp", distributed=True)
    return True


def run_deaths(work: Path, progress=print, ops=DEATH_OPS, deaths=DEATHS, points=POINTS,
               victims=(0, 1)) -> dict:
    from shardwise.testing import spawn

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spawn(_save_sources, 2, args=(str(work),), timeout=300)
    rows = []
    for op in ops:
        for death in deaths:
            for point in points:
                for victim in victims:
                    shutil.rmtree(work / "out", ignore_errors=True)
                    outcomes = run_with_deaths(death_rank, 2, str(work), op, death, victim, point,
                                               timeout=4 * TIMEOUT + 20, need={1 - victim})
                    (survivor,) = [o for r, o in outcomes.items() if r != victim]
                    ended, seconds = (survivor.value if survivor.kind == "ok"
                                      else (f"{survivor.kind}: {_last_line(survivor.value)}", None))
                    fine = (survivor.kind == "ok" and seconds <= 2 * TIMEOUT
                            and (ended.endswith("Error") or op.endswith("load")))
                    left = _leftovers(work)
                    fine = fine and (victim == 0 or not left) and not (work / "out").exists()
                    rows.append({"op": op, "death": death, "point": point, "victim": victim,
                                 "victim_end": outcomes[victim].kind, "survivor": ended,
                                 "seconds": None if seconds is None else round(seconds, 2),
                                 "left": left, "ok": fine})
                    for stale in left:  # what a dead rank 0 left: the next save would remove it
                        shutil.rmtree(work / stale, ignore_errors=True)
        if progress:
            progress(f"  deaths {op}: {sum(not r['ok'] for r in rows if r['op'] == op)} failed")
    return {"timeout_s": TIMEOUT, "rows": rows}


__all__ = ["DEATH_OPS", "KILL_KINDS", "run_deaths", "run_kills"]
