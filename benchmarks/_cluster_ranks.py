"""One rank of benchmarks/cluster.py, under torchrun on a simulated node:

    python _cluster_ranks.py JOB.pickle OUT

JOB.pickle names the method and its arguments; the rank runs the method's function of
``_remote_ranks`` (the single-machine object-store benchmark's ranks) or one of its own, with
every timed phase (``_remote_ranks.PeakRSS``) also counting this process's CPU time (rusage:
every thread) and its node's NIC bytes (the kernel's counters of ``eth0``), and writes
``OUT/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import socket
import sys
import time
from pathlib import Path

import _remote_ranks as rr
import torch
from _common import PeakRSS, real_plan

NIC = Path("/sys/class/net/eth0/statistics")


def _nic() -> dict[str, int]:
    return {k: int((NIC / k).read_text()) for k in ("rx_bytes", "tx_bytes")} if NIC.is_dir() else {}


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


class Counted(PeakRSS):
    """PeakRSS, plus the CPU seconds of this process and the bytes of its node's NIC in the block."""

    def __enter__(self) -> Counted:
        self._nic0, self._cpu0, self._t0 = _nic(), _cpu(), time.perf_counter()
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.wall = time.perf_counter() - self._t0
        self.cpu = _cpu() - self._cpu0
        self.nic = {k: v - self._nic0.get(k, 0) for k, v in _nic().items()}

    def as_dict(self) -> dict:
        return {**super().as_dict(), "cpu_s": self.cpu, "cpu_busy": self.cpu / max(self.wall, 1e-9),
                "nic": self.nic}


rr.PeakRSS = Counted  # type: ignore[misc]  (the ranks' timed phases count CPU and NIC bytes too)


def replicas_rank(url: str, cfg: dict, plan: dict, replicas: int, tp: int) -> dict:
    """``mesh(dp_replicate=replicas, tp=tp)``: every region read from the store by one replica."""
    import shardwise as sw

    backend, _, model = rr._start(replicas * tp, cfg)  # its mesh(tp=world) goes unused
    mesh = backend.mesh(dp_replicate=replicas, tp=tp)
    backend.barrier()
    with rr._CountGets() as gets, rr.PeakRSS() as peak:
        t0 = time.perf_counter()
        result = sw.load(model, url, plan=real_plan(plan), mesh=mesh)
        seconds = time.perf_counter() - t0
    return rr._figures(backend, seconds, peak, rr._nbytes(rr._local(model)), bytes_read=result.bytes_read,
                       requests=gets.requests, request_bytes=gets.bytes)


def download_rank(files: list[tuple[str, int]], cfg: dict, plan: dict, degree: int) -> dict:
    """Download every file into this node's own /tmp (no shared filesystem: each node the
    whole checkpoint, ranged GETs as the raw ceiling; one rank per node), then sw.load it."""
    import shardwise as sw

    backend, mesh, model = rr._start(degree, cfg)
    folder = Path("/tmp/shardwise-download")
    folder.mkdir(exist_ok=True)
    backend.barrier()
    with rr.PeakRSS() as peak:
        t0 = time.perf_counter()
        fds = {key: os.open(folder / Path(key).name, os.O_WRONLY | os.O_CREAT, 0o644) for key, _ in files}
        parts = rr.parts_of([(key, 0, size) for key, size in files])
        try:
            rr._fetch(parts, sink=lambda job, body: os.pwrite(fds[job[0]], body, job[1]))
        finally:
            for fd in fds.values():
                os.close(fd)
        download = time.perf_counter() - t0
        sw.load(model, str(folder), plan=real_plan(plan), mesh=mesh)
        local = rr._local(model)
        for t in local:  # one byte of every page of the zero-copy views
            t.reshape(-1).view(torch.uint8)[::4096].sum()
        seconds = time.perf_counter() - t0
    return rr._figures(backend, seconds, peak, rr._nbytes(local), download_s=download, requests=len(parts))


METHODS = {"raw": rr.raw_rank, "shardwise": rr.shardwise_rank, "runai": rr.runai_rank,
           "replicas": replicas_rank, "download": download_rank}


def main(job_path: str, out: str) -> None:
    torch.set_num_threads(1)
    job = pickle.loads(Path(job_path).read_bytes())  # written by cluster.py, this run
    figures = METHODS[job["method"]](*job["args"])
    figures.update(host=socket.gethostname(), local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    Path(out, f"rank{figures['rank']}.json").write_text(json.dumps(figures, default=str))
    import shardwise as sw

    sw.shutdown_backend()


if __name__ == "__main__":
    main(*sys.argv[1:3])
