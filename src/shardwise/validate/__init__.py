"""The hardware validation suite: the same scenarios, with the same assertions, on every backend.

Launched by the backend's own launcher, it first checks that the world is what the launcher
says, then runs at every layout the world allows (tp; dp_shard x tp; dp_replicate x tp; ep x tp)
on a model built in code (16 heads, 8 KV heads, 16 experts): a byte-exact load with the bytes
each rank read, forward and backward against the one-process CPU run, ``clip_grad_norm_``, a
gather save byte-equal to the source, a distributed save resharded, consolidated and verified,
replicas reading the checkpoint once, an optimizer step saved and resumed at another layout;
then, once for the job, checkpoints cross-loaded with a CPU/gloo process and a collective
timeout that fires. Each scenario is PASS, FAIL (with the error's first line) or UNSUPPORTED
(with the reason); rank 0 prints a table and writes JSON (and markdown).

>>> report = sw.validate("gloo", json="gloo.json")   # doctest: +SKIP

Command line: ``shardwise validate --backend NAME [--json OUT]`` or ``python -m
shardwise.validate ...`` under the launcher (``torchrun --nproc-per-node 8 -m shardwise.validate
--backend nccl --json nccl.json``); ``--nproc N`` starts N local ranks itself. docs/validate.md
has the command of every backend.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.validate.runner import validate as validate


def __getattr__(name: str):
    if name == "validate":
        # deferred: at the top, runner -> crossload makes `python -m shardwise.validate.crossload` warn
        from shardwise.validate.runner import validate

        return validate
    raise AttributeError(f"module 'shardwise.validate' has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """``sw.validate(...)`` is the suite: once any ``shardwise.validate.*`` module is imported,
    Python binds the name ``validate`` on the ``shardwise`` package to this package, so the
    package itself must be the function's twin."""

    def __call__(self, *args, **kwargs):
        return __getattr__("validate")(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["validate"]
