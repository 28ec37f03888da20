"""Local ranks and their memory, for the demo, benchmarks and tests: :func:`spawn` and
:class:`PeakMemory`."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from shardwise.backends import shutdown_backend
from shardwise.errors import ShardwiseError, UsageError

# Ranks fork from a server that already imported torch: a rank starts in well under a
# second instead of paying torch's import on each spawn.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor.parallel",
            "shardwise"]


class RankFailure(ShardwiseError, RuntimeError):
    """One or more ranks raised, died or timed out; ``failures`` maps rank -> report."""

    def __init__(self, message: str, failures: dict[int, str]):
        self.failures = failures
        detail = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(failures.items()))
        super().__init__(f"{message}\n{detail}")


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_main(fn, args, kwargs, rank, world_size, port, env, queue):
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    try:
        threads = env.get("OMP_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        result = fn(*args, **kwargs)
        queue.put((rank, True, result))
    except BaseException:  # report everything, KeyboardInterrupt included, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            shutdown_backend()
        except Exception:  # the group may be broken already; the parent has the report
            pass


def spawn(fn: Callable[..., Any], world_size: int, *, args: tuple = (), kwargs: dict | None = None,
          timeout: float = 120.0, env: dict[str, str] | None = None,
          threads_per_rank: int | None = 1) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks; return results in rank order.

    ``fn`` must be importable by name (a module-level function) and its result picklable.

    >>> spawn(my_check, 4, args=(model_size,))   # doctest: +SKIP
    [None, None, None, None]
    """
    if world_size < 1:
        raise UsageError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    child_env = dict(env or {})
    if threads_per_rank:
        child_env.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
    procs = []
    for rank in range(world_size):
        p = ctx.Process(target=_rank_main, name=f"shardwise-rank{rank}",
                        args=(fn, args, kwargs or {}, rank, world_size, port, child_env, queue))
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size and (remaining := deadline - time.monotonic()) > 0:
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 0.5))
                (results if ok else failures)[rank] = payload
            except Exception:  # queue.Empty: check for ranks that died without a report
                for rank, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and rank not in results and rank not in failures:
                        failures[rank] = f"process died with exit code {p.exitcode} (killed or crashed)"
            if failures:
                # Give the others a moment to report their own error, then stop them.
                _drain(queue, results, failures, grace=2.0, expected=world_size)
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        queue.close()
    if failures:
        raise RankFailure(f"{len(failures)} of {world_size} rank(s) failed", failures)
    if len(results) < world_size:
        hung = {r: f"still running after {timeout:.0f} s: killed (a hung collective?)"
                for r in range(world_size) if r not in results}
        raise RankFailure(f"{len(hung)} of {world_size} rank(s) timed out", hung)
    return [results[r] for r in range(world_size)]


def _drain(queue, results, failures, *, grace: float, expected: int) -> None:
    end = time.monotonic() + grace
    while len(results) + len(failures) < expected and time.monotonic() < end:
        try:
            rank, ok, payload = queue.get(timeout=max(0.05, end - time.monotonic()))
        except Exception:  # queue.Empty
            return
        (results if ok else failures)[rank] = payload


# -- memory ---------------------------------------------------------------------------------

def memory_status() -> dict[str, int]:
    """``VmRSS`` / ``VmHWM`` of this process in bytes; empty where /proc is missing."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_high_water_mark() -> bool:
    """Reset the kernel's high-water mark ``VmHWM`` to the current RSS (writing ``5`` to
    ``/proc/self/clear_refs``, Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    st = memory_status()
    # RSS counters are batched per CPU; tolerate a little slack between the two fields.
    return "VmHWM" in st and st["VmHWM"] <= st.get("VmRSS", 0) + (1 << 20)


class PeakMemory:
    """``with PeakMemory() as peak: ...`` then ``peak.bytes``: the highest RSS reached inside
    the block minus the RSS at entry (this process, all threads). ``method``: ``"VmHWM"``
    (exact, after :func:`reset_high_water_mark`), ``"sampled"`` (``VmRSS`` every
    ``interval`` s: a lower bound) or ``"none"`` (no /proc).

    >>> with PeakMemory() as peak:
    ...     block = bytearray(50 << 20)
    >>> peak.bytes >= 50 << 20 or peak.method == "none"
    True
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.baseline = 0
        self.bytes = 0
        self.method = "none"
        self._max = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        self._max = max(self._max, memory_status().get("VmRSS", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakMemory:
        exact = reset_high_water_mark()
        self.baseline = self._max = memory_status().get("VmRSS", 0)
        if exact:
            self.method = "VmHWM"
        elif self.baseline:
            self.method = "sampled"
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="shardwise-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._sample()
        peak = memory_status().get("VmHWM", 0) if self.method == "VmHWM" else 0
        self.bytes = max(0, max(peak, self._max) - self.baseline)


__all__ = ["PeakMemory", "RankFailure", "free_port", "memory_status", "reset_high_water_mark", "spawn"]
