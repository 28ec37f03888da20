"""Run a function on N local ranks (processes), for the demo, benchmarks and tests.

``spawn(fn, world_size)`` starts one process per rank with the torchrun environment
set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), calls ``fn(*args)`` in
each, and returns every rank's result in rank order. If any rank raises, the others
are stopped and ``RankFailure`` carries each failing rank's traceback; if the ranks do
not all finish within ``timeout`` seconds (a hung collective), every rank is killed and
``RankFailure`` says which ones were still running.

torchrun does the same for scripts; this exists so a Python function (a test body, a
benchmark case) can run on several ranks without a script per case.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from shardwise.backends import shutdown_backend
from shardwise.errors import ShardwiseError, UsageError

# Ranks fork from a server that already imported torch: a rank starts in well under a
# second instead of paying torch's import on each spawn (2 cores here).
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
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 0.5))
            except Exception:  # queue.Empty: check for ranks that died without a report
                for rank, p in enumerate(procs):
                    if (p.exitcode not in (None, 0) and rank not in results
                            and rank not in failures):
                        failures[rank] = f"process died with exit code {p.exitcode} (killed or crashed)"
                if failures:
                    # Give the others a moment to report their own error, then stop them.
                    _drain(queue, results, failures, grace=2.0, expected=world_size)
                    break
                continue
            (results if ok else failures)[rank] = payload
            if failures:
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
