"""Multi-rank test harness: run a module-level function on N spawned gloo ranks.

Any rank's exception fails the test with that rank's traceback; ranks still running
after ``timeout`` seconds are killed and the test fails, so a hung collective can
never hang CI. Built on ``shardwise.testing.spawn`` (one way to launch ranks).
"""

from __future__ import annotations

from shardwise.testing import RankFailure, spawn

DEFAULT_TIMEOUT = 90.0


def run_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs):
    """Results of ``fn(*args, **kwargs)`` on every rank, in rank order."""
    return spawn(fn, world_size, args=args, kwargs=kwargs, timeout=timeout)


__all__ = ["RankFailure", "run_ranks"]
