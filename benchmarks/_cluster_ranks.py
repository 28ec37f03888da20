"""One rank of benchmarks/cluster.py, under torchrun on a simulated node:

    python _cluster_ranks.py JOB.pickle OUT

JOB.pickle names the method and its arguments; the rank runs the method's function of
``_remote_ranks`` (the single-machine object-store benchmark's ranks) or one of its own, with
every timed phase (``_remote_ranks.PeakRSS``) also counting this process's CPU time (rusage:
every thread) and its node's NIC bytes (the kernel's counters of ``eth0``, and of ``fab0`` as
``fabric_*`` where the cluster has a back-end fabric), and writes
``OUT/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import socket
import sys
import threading
import time
from pathlib import Path

import _remote_ranks as rr
import torch
from _common import PeakRSS, real_plan

NIC, FABRIC = Path("/sys/class/net/eth0/statistics"), Path("/sys/class/net/fab0/statistics")
MIB = 1 << 20


def _nic() -> dict[str, int]:
    out = {k: int((NIC / k).read_text()) for k in ("rx_bytes", "tx_bytes")} if NIC.is_dir() else {}
    if FABRIC.is_dir():
        out.update({f"fabric_{k}": int((FABRIC / k).read_text()) for k in ("rx_bytes", "tx_bytes")})
    return out


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _server_cpu() -> float | None:
    """The storage server's CPU seconds so far (its /proc: the nodes share the PID namespace),
    None where cluster.py did not name it (``SHARDWISE_BENCH_SERVER_PID``)."""
    pid = os.environ.get("SHARDWISE_BENCH_SERVER_PID")
    if not pid:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Trace:
    """Where a timed phase's seconds go, seen from outside the library: the node's received bytes
    sampled every ``STEP`` s (when the NIC starts and stops receiving), each ``obstore.get``'s
    start and size (the first request, the first data request of 1 MiB or more, the most issued
    per ``STEP``) and each ``all_to_all_single`` of shardwise's exchange (its seconds)."""

    STEP = 0.01

    def __enter__(self) -> Trace:
        import obstore

        from shardwise.testing import exchange_probe

        self.t0, self.rx, self.gets = time.perf_counter(), [], []
        self._stop, lock = threading.Event(), threading.Lock()
        self._real_get = obstore.get
        self._probe = exchange_probe()
        self._spans = self._probe.__enter__()

        def get(store, key, *args, options=None, **kwargs):
            span = (options or {}).get("range")
            with lock:
                self.gets.append((time.perf_counter() - self.t0, span[1] - span[0] if span else -1))
            return self._real_get(store, key, *args, options=options, **kwargs)

        def sample():
            while not self._stop.wait(self.STEP):
                self.rx.append((time.perf_counter() - self.t0, _nic().get("rx_bytes", 0)))

        obstore.get = get
        self.rx.append((0.0, _nic().get("rx_bytes", 0)))
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import obstore

        self._stop.set()
        self._thread.join()
        self.rx.append((time.perf_counter() - self.t0, _nic().get("rx_bytes", 0)))
        obstore.get = self._real_get
        self._probe.__exit__(None, None, None)
        self.a2a = [(start - self.t0, end - self.t0) for start, end in self._spans]

    def as_dict(self) -> dict:
        base, total = self.rx[0][1], self.rx[-1][1] - self.rx[0][1]

        def when(fraction: float) -> float | None:
            return next((t for t, b in self.rx if b - base >= fraction * total), None) if total else None

        data = [t for t, n in self.gets if n >= MIB]
        sizes = sorted(n for _, n in self.gets)
        issued: dict[int, int] = {}
        for t, _ in self.gets:
            issued[int(t / self.STEP)] = issued.get(int(t / self.STEP), 0) + 1
        start, end = when(0.01), when(0.99)
        return {"first_get_s": self.gets[0][0] if self.gets else None,
                "first_data_get_s": data[0] if data else None, "gets": len(self.gets),
                "get_mib": round(sum(n for n in sizes if n > 0) / MIB, 2),
                "gets_under_1mib": sum(1 for n in sizes if 0 <= n < MIB),
                "get_median_mib": round(sizes[len(sizes) // 2] / MIB, 3) if sizes else None,
                "rx_start_s": start, "rx_end_s": end, "wall_s": self.rx[-1][0],
                "rx_rate_mbit": total * 8 / 1e6 / (end - start) if start is not None and end and end > start
                else None,
                "a2a": len(self.a2a), "a2a_s": sum(e - s for s, e in self.a2a),
                "a2a_last_end_s": max((e for _, e in self.a2a), default=None),
                "a2a_spans": [(round(s, 3), round(e, 3)) for s, e in self.a2a],
                "rx_mib_per_100ms": _binned(self.rx, base)}


def _binned(rx: list[tuple[float, int]], base: int, step: float = 0.1) -> list[float]:
    """The received MiB in each ``step`` of the phase (the NIC's timeline)."""
    out: list[float] = []
    last = base
    for t, b in rx:
        while len(out) <= int(t / step):
            out.append(0.0)
        out[int(t / step)] += (b - last) / MIB
        last = b
    return [round(x, 2) for x in out]


class Counted(PeakRSS):
    """PeakRSS, plus the CPU seconds of this process, the bytes of its node's NIC in the block
    and its :class:`Trace`."""

    def __enter__(self) -> Counted:
        self._nic0, self._cpu0, self._t0 = _nic(), _cpu(), time.perf_counter()
        self._server0 = _server_cpu()
        self.trace = Trace().__enter__()
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.trace.__exit__(*exc)
        self.wall = time.perf_counter() - self._t0
        self.cpu = _cpu() - self._cpu0
        self.nic = {k: v - self._nic0.get(k, 0) for k, v in _nic().items()}
        end = _server_cpu()
        self.server_cpu = None if end is None or self._server0 is None else end - self._server0

    def as_dict(self) -> dict:
        return {**super().as_dict(), "cpu_s": self.cpu, "cpu_busy": self.cpu / max(self.wall, 1e-9),
                "nic": self.nic, "trace": self.trace.as_dict(),
                # the S3 server's CPU in this phase alone (every node's requests, not only this rank's)
                "server_busy": None if self.server_cpu is None else self.server_cpu / max(self.wall, 1e-9)}


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
    from shardwise.testing import exchange_probe

    # an exchange round or other settings than the library's (cluster.py --round-mib, --trial)
    with exchange_probe(job.get("round_bytes"), job.get("depth"), job.get("settings")):
        figures = METHODS[job["method"]](*job["args"])
    figures.update(host=socket.gethostname(), local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    Path(out, f"rank{figures['rank']}.json").write_text(json.dumps(figures, default=str))
    import shardwise as sw

    sw.shutdown_backend()


if __name__ == "__main__":
    main(*sys.argv[1:3])
