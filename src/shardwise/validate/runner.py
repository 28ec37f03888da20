"""The suite on every rank: the world check, each layout's scenarios, then the job's (a cross-load
with a one-process CPU/gloo run, ``python -m shardwise.validate.runner --read DCP --write OUT``,
and a collective timeout); one verdict per scenario agreed by every rank. A failed scenario is a
FAIL and the suite goes on; a broken collective stops it."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise as sw
import shardwise.comm as comm
from shardwise.errors import UsageError
from shardwise.parallel import get_shard_state
from shardwise.testing.model import TP_PLAN, build, canonical, golden
from shardwise.validate.checks import (
    FAIL,
    PASS,
    UNSUPPORTED,
    Mismatch,
    check_world,
    compare_tensors,
    mesh_world,
)
from shardwise.validate.report import Report, Result, markdown, run_header, table
from shardwise.validate.scenarios import SCENARIOS, Job, Run, Unsupported, layout_limit, layouts_for, place

WRITE_SEED = 1
# Launcher variables the CPU process must not see: it is a world of one, not a rank of the job.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
TIMEOUT_S = 2.0      # the collective timeout the timeout scenario sets
LATE_FACTOR = 3      # the late rank joins after this many timeouts: never a hang


def _cpu_read(path: str) -> str:
    backend = sw.init_backend("gloo")
    model = build(device="meta")
    sw.load(model, path, plan=TP_PLAN, mesh=backend.mesh(tp=1), progress=False)
    compare_tensors(model.state_dict().items(), canonical(), get_shard_state(model),
                    "read on CPU/gloo:", exact=True)
    return "ok"


def _cpu_write(path: str) -> str:
    sw.init_backend("gloo")
    sw.save(build(WRITE_SEED), path, distributed=True)
    return path


def main(argv: list[str] | None = None) -> int:
    """The CPU process (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m shardwise.validate.runner")
    parser.add_argument("--read", required=True)
    parser.add_argument("--write", required=True)
    args = parser.parse_args(argv)
    out: dict = {"read": None, "written": None}
    for key, step, path in (("read", _cpu_read, args.read), ("written", _cpu_write, args.write)):
        try:
            out[key] = step(path)
        except Exception as e:  # reported to the job, which fails the scenario with it
            out[f"{key}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(json.dumps(out))
    return 0


def _cpu_process(read: str, write: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU only, whatever this host has
    proc = subprocess.run([sys.executable, "-m", "shardwise.validate.runner", "--read", read,
                           "--write", write], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"read_error": f"the CPU process exited {proc.returncode}: {tail}", "written": None}
    return json.loads(lines[-1])


def crossload(job: Job) -> dict:
    """A checkpoint written here loads on CPU/gloo in one process and equals the source; one
    written there loads here, at the first layout, and equals its model."""
    backend = job.backend
    layout = next((lay for lay in job.layouts if layout_limit(backend, lay) is None), None)
    if layout is None:
        raise Unsupported("no layout runs on this backend")
    folder = job.root / "crossload"
    model, _ = place(job, layout, job.source)
    sw.save(model, folder / "device-dcp", distributed=True)
    del model
    got = None
    if backend.rank == 0:
        try:  # whatever happens, rank 0 reaches the broadcast its peers wait in
            got = _cpu_process(str(folder / "device-dcp"), str(folder / "cpu-dcp"))
        except Exception as e:
            got = {"read_error": f"{type(e).__name__}: {e}", "written": None}
    got = comm.broadcast_object(got, group=backend.coordination_group)
    if got.get("read_error"):
        raise Mismatch(f"the checkpoint written on {backend.name} does not load on CPU/gloo: "
                       f"{got['read_error']}")
    if not got.get("written"):
        raise Mismatch(f"the CPU/gloo process could not write its checkpoint: {got.get('written_error')}")
    model, _ = place(job, layout, got["written"])
    compare_tensors(model.state_dict().items(), canonical(WRITE_SEED), get_shard_state(model),
                    f"CPU/gloo checkpoint loaded at {layout.name}:", exact=True)
    return {"layout": layout.name}


def collective_timeout(job: Job) -> dict:
    """The last rank joins an all_reduce ``LATE_FACTOR`` timeouts late; every other rank must get a
    ``CollectiveError`` after about ``TIMEOUT_S`` (a backend that ignores it is reported, not hung)."""
    backend = job.backend
    if backend.world_size < 2:
        raise Unsupported("one process: no peer can be late (run with two ranks or more)")
    group = dist.new_group(list(range(backend.world_size)))  # its failure leaves the default group whole
    late = backend.world_size - 1
    t = torch.ones(1, device=backend.device)
    backend.all_reduce(t, group=group)  # every rank: a device backend sets the group up on first use
    start = time.monotonic()
    outcome = "returned"
    if backend.rank == late:
        time.sleep(LATE_FACTOR * TIMEOUT_S)
    try:
        backend.all_reduce(t, group=group, timeout=TIMEOUT_S)
    except sw.CollectiveError as e:
        outcome = f"CollectiveError: {str(e).splitlines()[0]}"
    seconds = time.monotonic() - start
    # Everyone meets again on the default group, the late rank included (bounded).
    backend.barrier(timeout=max(60.0, 4 * LATE_FACTOR * TIMEOUT_S))
    details = {"late_rank": late, "timeout_s": TIMEOUT_S, "seconds": round(seconds, 2), "outcome": outcome}
    if backend.rank == late:
        return details
    if outcome == "returned":
        limit = getattr(backend, "timeout_limit", None)  # a backend that states it cannot
        if limit:
            raise Unsupported(f"backend {backend.name!r} does not honour collective timeouts: {limit}")
        raise Mismatch(f"the all_reduce returned after {seconds:.1f} s, when the late rank came, instead of "
                       f"a CollectiveError after {TIMEOUT_S:g} s: the timeout was not honoured")
    if seconds > (LATE_FACTOR - 0.5) * TIMEOUT_S:
        raise Mismatch(f"the CollectiveError came after {seconds:.1f} s, not about {TIMEOUT_S:g} s: the "
                       "timeout did not fire, the failure came from the late rank")
    return details


Outcome = tuple[str, str, dict, bool]  # one rank's (status, reason, details, breaks the group)

JOB_SCENARIOS = (("crossload", crossload), ("collective_timeout", collective_timeout))


class Stop(Exception):
    """The ranks can no longer meet: record and stop."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _breaks_the_group(e: BaseException) -> bool:
    return isinstance(e, sw.CollectiveError | dist.DistError)


def _fail_reason(everyone: list[tuple]) -> str:
    """The first failing rank's reason, naming the rank unless every rank failed alike."""
    failed = [(r, o[1]) for r, o in enumerate(everyone) if o[0] == FAIL]
    if len(failed) == len(everyone) and len({reason for _, reason in failed}) == 1:
        return failed[0][1]
    return f"rank {failed[0][0]}: {failed[0][1]}"


class Runner:
    def __init__(self, backend, *, json_path=None, markdown_path=None, workdir=None, keep=False,
                 print_table=True, only=None):
        self.backend = backend
        self.only = selected(only)
        self.rank0 = backend.rank == 0
        self.json_path, self.markdown_path = json_path, markdown_path
        self.keep, self.print_table = keep, print_table
        world = mesh_world(backend)
        self.report = Report({**run_header(backend, world=world, processes=backend.world_size),
                              "only": sorted(self.only) if self.only is not None else None})
        self.layouts = layouts_for(world)
        self.report.layouts = [lay.name for lay in self.layouts]
        self._workdir = workdir
        self._start = time.monotonic()
        # The suite's own exchanges (verdicts, the work folder) go over a gloo group of their
        # own: a rank that failed before a collective its peers wait in must not meet them in
        # it with a verdict (gloo aborts on a mismatched collective). Its timeout outlasts a
        # scenario collective's, so a peer stuck in one times out there first and then reports.
        limit = 2 * backend.timeout.total_seconds() + 60
        self._group = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=limit))

    # -- agreement -------------------------------------------------------------------------
    def _gather(self, mine):
        out = [None] * self.backend.world_size
        try:
            dist.all_gather_object(out, mine, group=self._group)
        except Exception as e:
            raise Stop(f"the ranks could not exchange their verdicts: {_first_line(e)}") from e
        return out

    def _record(self, name, layout, mesh, outcome, seconds, judge=None) -> Result:
        """Every rank's ``outcome`` (status, reason, details, breaks) -> one agreed result."""
        everyone = self._gather(outcome)
        statuses = [o[0] for o in everyone]
        details = {"per_rank": [o[2] for o in everyone]}
        if FAIL in statuses:
            status, reason = FAIL, _fail_reason(everyone)
        elif UNSUPPORTED in statuses:
            status, reason = UNSUPPORTED, everyone[statuses.index(UNSUPPORTED)][1]
        else:
            status, reason = PASS, ""
            verdict = judge([o[2] for o in everyone]) if judge else None
            if verdict:
                status, reason = FAIL, verdict
        result = Result(name, layout, status, reason, round(seconds, 3), mesh, details)
        self.report.results.append(result)
        self._save_progress()
        if any(o[3] for o in everyone):
            raise Stop(f"{name}{f' at {layout}' if layout else ''}: {reason}")
        return result

    def _attempt(self, fn, *args, where: str = "") -> tuple[Outcome, float]:
        """This rank's :data:`Outcome` of ``fn(*args)``, and its seconds."""
        start = time.monotonic()
        try:
            details = fn(*args) or {}
            outcome = (PASS, "", details, False)
        except Unsupported as e:
            outcome = (UNSUPPORTED, str(e), {}, False)
        except Exception as e:  # the scenario failed on this rank; the traceback goes to stderr
            print(f"shardwise validate: rank {self.backend.rank}: {fn.__name__}{where} failed:",
                  file=sys.stderr)
            traceback.print_exc()
            outcome = (FAIL, _first_line(e), {}, _breaks_the_group(e))
        return outcome, time.monotonic() - start

    def _save_progress(self) -> None:
        self.report.seconds = time.monotonic() - self._start
        if self.rank0 and self.json_path:
            self.report.write_json(self.json_path)

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> Report:
        try:
            self._run()
            self.report.complete = True
        except Stop as e:
            self.report.stopped = str(e)
        self._save_progress()
        if self.rank0:
            if self.markdown_path:
                Path(self.markdown_path).write_text(markdown([self.report.to_dict()]))
            if self.print_table:
                print(table(self.report.to_dict()), flush=True)
        return self.report

    def _run(self) -> None:
        outcome, seconds = self._attempt(check_world, self.backend)
        if outcome[0] == PASS:  # the check ran: its own (status, reason, counts it saw)
            outcome = (*outcome[2], False)
        result = self._record("world", None, None, outcome, seconds)
        if result.status != PASS:
            raise Stop(f"the world is not what the launcher says: {result.reason}")
        root = self._root()
        try:
            job = self._job(root)
            for index, layout in enumerate(self.layouts):
                self._layout(job, Run(index, layout, folder=root / layout.name))
            for name, fn in JOB_SCENARIOS:
                if self.only is not None and name not in self.only:
                    continue
                outcome, seconds = self._attempt(fn, job)
                self._record(name, None, None, outcome, seconds)
        finally:
            if self.rank0 and not self.keep and self._workdir is None:
                shutil.rmtree(root, ignore_errors=True)

    def _root(self) -> Path:
        """A folder every rank sees: under ``workdir``, else rank 0's temporary folder."""
        path = None
        if self.rank0:
            base = Path(self._workdir) if self._workdir else None
            if base is not None:
                base.mkdir(parents=True, exist_ok=True)
            path = tempfile.mkdtemp(prefix="shardwise-validate-", dir=base)
        return Path(comm.broadcast_object(path, group=self._group))

    def _job(self, root: Path) -> Job:
        import safetensors.torch as st

        truth = canonical()
        source = root / "source" / "model.safetensors"
        if self.rank0:
            source.parent.mkdir(parents=True)
            st.save_file(truth, source, metadata={"format": "pt"})  # what save_pretrained writes
        self.backend.barrier()
        total = sum(t.numel() * t.element_size() for t in truth.values())
        return Job(self.backend, golden(), truth, root, source, total, self.layouts)

    def _layout(self, job: Job, run: Run) -> None:
        limit = layout_limit(self.backend, run.layout)
        done: dict[str, str] = {}
        for sc in SCENARIOS:
            if not sc.applies(run.layout) or (self.only is not None and sc.name not in self.only):
                continue
            missing = [n for n in sc.needs if done.get(n) != PASS]
            outcome: Outcome
            if limit:
                outcome, seconds = (UNSUPPORTED, limit, {}, False), 0.0
            elif missing:
                reason = f"not run: {missing[0]} did not pass at this layout"
                outcome, seconds = (FAIL, reason, {}, False), 0.0
            else:
                outcome, seconds = self._attempt(sc.fn, job, run, where=f" at {run.layout.name}")
            judge = (lambda ranks, sc=sc: sc.judge(job, run.layout, ranks)) if sc.judge else None
            result = self._record(sc.name, run.layout.name, run.layout.mesh_axes, outcome, seconds, judge)
            done[sc.name] = result.status
        run.model = None


def selected(only) -> set[str] | None:
    """The scenarios to run for ``only`` (names), with every scenario they build on; None: all."""
    if only is None:
        return None
    by_name = {sc.name: sc for sc in SCENARIOS}
    known = [*by_name, *(name for name, _ in JOB_SCENARIOS)]
    unknown = [name for name in only if name not in known]
    if unknown:
        raise UsageError(f"no scenario {unknown[0]!r}; the scenarios are {', '.join(known)}")
    out, todo = set(), list(only)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo += list(by_name[name].needs) if name in by_name else []
    return out


__all__ = ["Runner", "collective_timeout", "crossload", "main", "selected"]


if __name__ == "__main__":
    sys.exit(main())
