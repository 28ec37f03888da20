"""Ranks that may die: launch N local ranks and report how each one ended.

``shardwise.testing.spawn`` (and the tests' ``run_ranks``) treat any rank's death as the
end of the run and stop the others two seconds later; the reliability trials need the
opposite: a rank is killed, stopped or exits on purpose, and what matters is how the
*survivors* end and how long they take. :func:`run_with_deaths` waits for every rank (up
to a deadline) and reports each one's outcome. Ranks start through launch's own forkserver
and rank entry point, so they see the same environment as under ``spawn``.
"""

from __future__ import annotations

import os
import queue as queue_mod
import signal
import time
from dataclasses import dataclass
from typing import Any

from shardwise.testing import _context, _rank_main, free_port  # tests may use launch's internals


@dataclass
class Outcome:
    """How one rank ended: ``kind`` is "ok" (``value`` is fn's result), "error" (``value``
    is the traceback text), "died" (``value`` is the exit code) or "hung" (still running at
    the deadline: killed). ``seconds``: from the start of the run to when its end was seen."""

    kind: str
    value: Any
    seconds: float


class Ranks:
    """Started ranks: their pids (to kill from outside) and :meth:`wait` for the outcomes."""

    def __init__(self, fn, world_size: int, args: tuple = (), env: dict | None = None):
        ctx = _context()
        self._queue = ctx.Queue()
        port = free_port()
        child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self.start = time.monotonic()
        self.procs = [ctx.Process(target=_rank_main, name=f"shardwise-rank{r}",
                                  args=(fn, args, {}, r, world_size, port, child_env, self._queue))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        try:
            os.kill(self.procs[rank].pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float, need=None) -> dict[int, Outcome]:
        """Every rank's outcome; ranks still running after ``timeout`` seconds are killed, and
        so are all the others once every rank in ``need`` (default: all) has ended."""
        out: dict[int, Outcome] = {}
        exited: dict[int, float] = {}
        deadline = self.start + timeout
        need = set(range(len(self.procs)) if need is None else need)
        while not need <= set(out) and time.monotonic() < deadline:
            try:
                rank, ok, payload = self._queue.get(timeout=0.1)
                out[rank] = Outcome("ok" if ok else "error", payload, time.monotonic() - self.start)
                continue
            except queue_mod.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(self.procs):
                if r in out or p.exitcode is None:
                    continue
                exited.setdefault(r, now)
                if now - exited[r] > 1.0:  # its report, if it sent one, would be here by now
                    out[r] = Outcome("died", p.exitcode, exited[r] - self.start)
        for r, p in enumerate(self.procs):
            if r not in out:
                out[r] = Outcome("hung", None, time.monotonic() - self.start)
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        self._queue.close()
        return out


def run_with_deaths(fn, world_size: int, *args, timeout: float = 60.0, env: dict | None = None,
                    need=None) -> dict[int, Outcome]:
    """Run ``fn(*args)`` on ``world_size`` ranks (fn may kill or stop its own rank) and
    return how every rank ended (see :meth:`Ranks.wait` for ``need``)."""
    return Ranks(fn, world_size, args, env).wait(timeout, need)


def die(kind: str) -> None:
    """End this rank the way ``kind`` says: "exit" (os._exit(3), no cleanup), "kill"
    (SIGKILL) or "stop" (SIGSTOP: alive but silent, like a hung host)."""
    if kind == "exit":
        os._exit(3)
    os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[kind])
    if kind == "kill":
        time.sleep(60)  # the signal is on its way


__all__ = ["Outcome", "Ranks", "die", "run_with_deaths"]
