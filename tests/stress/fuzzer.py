"""The fuzzer (tests/stress/stress.py fuzz): mutated checkpoints through every entry point.

One worker process runs the cases one after another: for each it builds the mutated folder
(``fuzz_mutate``), then calls ``sw.load`` (a world of one, tp=1), ``shardwise inspect``,
``sw.verify`` and, for DCP folders, ``sw.consolidate``. The parent feeds it case numbers
and watches it: a case that gives no answer within the deadline is a hang (the worker is
killed and restarted), a worker that dies is a crash.

Outcome of each call, worst first:
- ``outside``: a file under ``secret/`` was opened, or a file outside the case was opened
  for writing (an audit hook on every ``open``);
- ``crash`` / ``hang``: the worker died, or did not answer within the deadline;
- ``memory``: MemoryError or an allocation failure (the worker's address space is capped);
- ``wrong``: the call succeeded but a loaded or consolidated tensor equals neither the
  original nor what the reference reader (safetensors, or torch's own DCP reader) reads
  from the same files; or ``sw.verify`` passed a checkpoint whose loaded values changed;
- ``other``: any exception that is not a ShardwiseError;
- ``clean``: a ShardwiseError (for verify: a report that is not ok);
- ``ok``: the call succeeded with correct values.
"""

from __future__ import annotations

import io
import json
import os
import random
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import bench_model, bench_plan, real_plan

OUTCOMES = ("ok", "clean", "other", "wrong", "memory", "hang", "crash", "outside")
_ADDRESS_SPACE = 4 << 30


def seed_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return bench_model(2, 32, 64)


def _save_dcp_rank(folder: str) -> bool:
    import shardwise as sw

    backend = sw.init_backend("gloo")
    model = seed_model()
    sw.parallelize(model, real_plan(bench_plan()), backend.mesh(tp=2))
    sw.save(model, folder, distributed=True)
    return True


def make_seeds(work: Path) -> None:
    """The three seeds, the original tensors, and ``secret/`` (what escapes would reach)."""
    from safetensors.torch import save_file

    import shardwise as sw
    from shardwise.testing import spawn

    seeds, secret = work / "seeds", work / "secret"
    shutil.rmtree(work, ignore_errors=True)
    seeds.mkdir(parents=True)
    model = seed_model()
    sw.save(model, seeds / "one")
    sw.save(model, seeds / "sharded", max_shard_size=40_000)
    spawn(_save_dcp_rank, 2, args=(str(seeds / "dcp"),), timeout=300)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, work / "original.safetensors")
    secret.mkdir()
    save_file({"secret": torch.full((4,), 7.0)}, secret / "secret.safetensors")
    shutil.copytree(seeds / "sharded", secret / "st")
    shutil.copytree(seeds / "dcp", secret / "dcp")


# --- the worker --------------------------------------------------------------------------------

class _Audit:
    """Records opens of files under ``secret`` and writes outside the current case."""

    def __init__(self, secret: Path):
        self.secret = os.path.realpath(secret) + os.sep
        self.case = ""
        self.hits: list[str] = []

    def __call__(self, event, args):
        if event != "open" or not self.case or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        mode, flags = args[1], args[2] if len(args) > 2 else 0
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if path.startswith(self.secret) or (writing and not path.startswith(self.case)
                                            and path != os.devnull):
            self.hits.append(path)


def _classify(e: BaseException) -> str:
    from shardwise.errors import ShardwiseError

    if isinstance(e, ShardwiseError):
        return "clean"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and (
            "alloc" in str(e).lower() or "out of memory" in str(e).lower())):
        return "memory"
    return "other"


def _same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return (b is not None and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def _reference(folder: Path, kind: str, original: dict) -> dict:
    """What the reference reader gets from the same files ({} when it refuses them)."""
    try:
        if kind == "dcp":
            import torch.distributed.checkpoint as dcp

            got = {k: torch.empty_like(v) for k, v in original.items()}
            dcp.load(got, checkpoint_id=folder, no_dist=True)
            return got
        from safetensors.torch import load_file

        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out
    except BaseException:  # noqa: BLE001 - the reference refusing is information, not a failure
        return {}


def _check_values(got: dict, ref: dict, original: dict) -> str | None:
    bad = [n for n, t in got.items() if not (_same(t, original.get(n)) or _same(t, ref.get(n)))]
    return f"wrong values in {bad[:3]}" if bad else None


def _ops(folder: Path, kind: str, case: Path, state: dict):
    import shardwise as sw
    from shardwise.cli import main
    from shardwise.parallel import local_of

    def load():
        with torch.device("meta"):
            model = bench_model(2, 32, 64)
        sw.load(model, folder, plan=real_plan(bench_plan()), mesh=state["mesh"], progress=False)
        got = {n: local_of(t).detach() for n, t in model.state_dict().items()}
        state["changed"] = any(not _same(t, state["original"].get(n)) for n, t in got.items())
        return _check_values(got, _reference(folder, kind, state["original"]), state["original"])

    def inspect():
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        saved, sys.stdout = sys.stdout, out
        try:
            code = main(["inspect", str(folder)])
        finally:
            sys.stdout = saved
        if code:
            raise sw.CheckpointError("inspect refused it (exit 1)")

    def verify():
        report = sw.verify(folder)
        if not report.ok:
            raise sw.CheckpointError("verify found faults")
        if state.get("changed"):
            return "verify passed a checkpoint whose loaded values changed"
        return None

    def consolidate():
        from safetensors.torch import load_file

        out = sw.consolidate(folder, case / "merged")
        got = {}
        for f in sorted(out.glob("*.safetensors")):
            got.update(load_file(f))
        return _check_values(got, _reference(folder, kind, state["original"]), state["original"])

    ops = [("load", load), ("inspect", inspect), ("verify", verify)]
    return ops + [("consolidate", consolidate)] if kind == "dcp" else ops


def run_case(i: int, seed: int, work: Path, state: dict, audit: _Audit, say) -> dict:
    from fuzz_mutate import new_case

    rng = random.Random(f"{seed}-{i}")
    case = work / "cases" / str(i)
    case.mkdir(parents=True)
    try:
        kind, folder, desc = new_case(work / "seeds", work / "secret", case, rng)
        results = {}
        state["changed"] = False
        for name, fn in _ops(folder, kind, case, state):
            say({"op": name})
            audit.case, audit.hits = os.path.realpath(case) + os.sep, []
            try:
                wrong = fn()
                outcome, detail = ("wrong", wrong) if wrong else ("ok", "")
            except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
                if isinstance(e, KeyboardInterrupt):
                    raise
                outcome, detail = _classify(e), f"{type(e).__name__}: {e}"[:300]
            finally:
                audit.case = ""
            if audit.hits:
                outcome, detail = "outside", f"opened {audit.hits[:2]}"
            results[name] = (outcome, detail)
        return {"case": i, "seed": kind, "mutation": desc[:200], "results": results}
    finally:
        shutil.rmtree(case, ignore_errors=True)


def worker_main(work: Path, seed: int) -> None:
    """Read case numbers from stdin, answer one JSON line per event on the original stdout."""
    from safetensors.torch import load_file

    import shardwise as sw

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, hard))
    torch.set_num_threads(1)
    backend = sw.init_backend("gloo")
    state = {"mesh": backend.mesh(tp=1), "original": load_file(work / "original.safetensors")}
    audit = _Audit(work / "secret")
    # Warm up first: lazy imports (torch's dynamo probes the temp dir with a file on first
    # use) must not count as a case's writes.
    tempfile.gettempdir()
    for seed_kind in ("one", "dcp"):
        for _, fn in _ops(work / "seeds" / seed_kind, seed_kind, work / "warmup", state):
            fn()
    shutil.rmtree(work / "warmup", ignore_errors=True)
    sys.addaudithook(audit)

    def say(obj):
        proto.write(json.dumps(obj) + "\n")

    for line in sys.stdin:
        say(run_case(int(line), seed, work, state, audit, say))


# --- the parent --------------------------------------------------------------------------------

class _Worker:
    def __init__(self, work: Path, seed: int, log):
        script = Path(__file__).with_name("stress.py")
        self.proc = subprocess.Popen(
            ["nice", "-n", "10", sys.executable, str(script), "_worker", "--work", str(work),
             "--seed", str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            bufsize=0)
        self._pending = b""  # bytes read past the last line: select() cannot see them

    def _line(self, end: float) -> bytes | None:
        """The next line of the worker's answer; None at the deadline, b"" at its end."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            data = os.read(fd, 1 << 16)
            if not data:
                return b""
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def ask(self, i: int, deadline: float) -> tuple[dict | None, str, str | None]:
        """``(result, last op started, failure)``; failure is "hang" or "crash"."""
        self.proc.stdin.write(f"{i}\n".encode())
        op = "setup"
        end = time.monotonic() + deadline
        while True:
            line = self._line(end)
            if line is None:
                return None, op, "hang"
            if not line:
                return None, op, "crash"
            msg = json.loads(line)
            if "op" in msg:
                op = msg["op"]
                continue
            return msg, op, None

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        return self.proc.returncode


def run_fuzz(work: Path, n: int, seed: int, *, deadline: float = 60.0, first: int = 0,
             progress=print) -> dict:
    """Run cases ``first .. first + n - 1``; return counts per call and outcome, and examples."""
    make_seeds(work)
    counts = {op: dict.fromkeys(OUTCOMES, 0) for op in ("setup", "load", "inspect", "verify", "consolidate")}
    per_case = dict.fromkeys(OUTCOMES, 0)
    examples: list[dict] = []
    log = open(work / "worker.log", "w")  # noqa: SIM115 - closed below
    worker = _Worker(work, seed, log)
    start = time.monotonic()
    try:
        for i in range(first, first + n):
            result, op, failure = worker.ask(i, deadline)
            if failure is not None:
                code = worker.stop()
                failure = "memory" if failure == "crash" and code == -9 else failure
                result = {"case": i, "results": {op: (failure, f"worker exit code {code}")}}
                shutil.rmtree(work / "cases", ignore_errors=True)
                worker = _Worker(work, seed, log)
            worst = "ok"
            for name, (outcome, detail) in result["results"].items():
                counts[name][outcome] += 1
                worst = max(worst, outcome, key=OUTCOMES.index)
                if outcome not in ("ok", "clean") and len(examples) < 50:
                    examples.append({"case": i, "op": name, "outcome": outcome, "detail": detail,
                                     "mutation": result.get("mutation")})
            per_case[worst] += 1
            if progress and (i - first + 1) % 500 == 0:
                progress(f"  {i - first + 1}/{n} cases, {time.monotonic() - start:.0f} s: {per_case}")
    finally:
        worker.stop()
        log.close()
    return {"n": n, "seed": seed, "first": first, "seconds": time.monotonic() - start,
            "per_call": counts, "per_case": per_case, "examples": examples}


__all__ = ["OUTCOMES", "make_seeds", "run_fuzz", "worker_main"]
