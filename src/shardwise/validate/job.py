"""The scenarios that run once for the whole job: checkpoints cross-loaded between this backend
and a one-process CPU/gloo run, and a collective timeout that fires.

The CPU side runs as its own process with no launcher environment (a world of one on gloo):
``python -m shardwise.validate.job --read DCP --write OUT`` loads the job's distributed
checkpoint (byte-equal to the source or an error), writes one of the seed-1 model, and prints
one JSON line ``{"read": "ok" | None, "written": path | None, "<key>_error": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.parallel import get_shard_state
from shardwise.testing.model import TP_PLAN, build, canonical
from shardwise.validate.checks import Mismatch, compare_tensors
from shardwise.validate.scenarios import Job, Unsupported, layout_limit, place

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
    parser = argparse.ArgumentParser(prog="python -m shardwise.validate.job")
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
    proc = subprocess.run([sys.executable, "-m", "shardwise.validate.job", "--read", read,
                           "--write", write], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"read_error": f"the CPU process exited {proc.returncode}: {tail}", "written": None}
    return json.loads(lines[-1])


def crossload(job: Job) -> dict:
    """A checkpoint written on this backend loads on CPU/gloo in one process and equals the
    source; one written there loads here, at the first layout, and equals its model."""
    backend = job.backend
    layout = next((lay for lay in job.layouts if layout_limit(backend, lay) is None), None)
    if layout is None:
        raise Unsupported("no layout runs on this backend")
    mesh = backend.mesh(**layout.mesh_axes)
    folder = job.root / "crossload"
    model, _ = place(job, layout, mesh, job.source)
    sw.save(model, folder / "device-dcp", distributed=True)
    del model
    got = None
    if backend.rank == 0:
        try:  # whatever happens, rank 0 reaches the broadcast its peers wait in
            got = _cpu_process(str(folder / "device-dcp"), str(folder / "cpu-dcp"))
        except Exception as e:
            got = {"read_error": f"{type(e).__name__}: {e}", "written": None}
    box = [got]
    dist.broadcast_object_list(box, src=0, group=backend.coordination_group)
    got = box[0]
    assert got is not None  # rank 0's, which it always sets
    if got.get("read_error"):
        raise Mismatch(f"the checkpoint written on {backend.name} does not load on CPU/gloo: "
                       f"{got['read_error']}")
    if not got.get("written"):
        raise Mismatch(f"the CPU/gloo process could not write its checkpoint: {got.get('written_error')}")
    model, _ = place(job, layout, mesh, got["written"])
    compare_tensors(model.state_dict().items(), canonical(WRITE_SEED), get_shard_state(model),
                    f"CPU/gloo checkpoint loaded at {layout.name}:", exact=True)
    return {"layout": layout.name}


def collective_timeout(job: Job) -> dict:
    """The last rank joins an all_reduce only after ``LATE_FACTOR`` timeouts; every other rank
    must get a ``CollectiveError`` after about ``TIMEOUT_S`` seconds. The late rank joins in
    the end, so a backend that ignores timeouts is reported, not hung."""
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


__all__ = ["collective_timeout", "crossload", "main"]


if __name__ == "__main__":
    sys.exit(main())
