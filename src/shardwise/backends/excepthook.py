"""One report of an error that every rank raised alike.

A guard (``sw.load``'s checks of its options, mesh and plan) runs before any collective, on the
same inputs on every rank, so a wrong degree raises the same ``ShardwiseError`` on each of them.
Left to Python, every rank prints its own chained traceback and torchrun adds a block of its
own: a screen of identical text around one line of message. ``install`` (called by
``init_backend``) sets a ``sys.excepthook`` that, for an error marked by
``shardwise.errors.on_every_rank``, prints the error once, on rank 0, in three lines (the
message, that every rank raised it, where the user's code called shardwise), and lets the other
ranks end quietly: with rank 0's exit status (1), or under torchrun stopped by it once rank 0 has
exited, so that its summary's first failure is rank 0's.

A rank other than 0 stays quiet only once it knows that rank 0 reported the same message: rank 0
puts its message in the process group's store, and the others compare it with their own within
``WAIT_SECONDS``. A different message, a store they cannot reach or a rank 0 that never reports
makes them print their own report (prefixed with the rank): never a silent failure. Under torchrun
(``TORCHELASTIC_ERROR_FILE`` set), each rank also writes the error file torchrun reads, as
``torch.distributed.elastic``'s ``@record`` does, so that its summary names the error instead of
pointing at its documentation. Every other exception goes to the previous hook unchanged.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from shardwise.errors import ShardwiseError

WAIT_SECONDS = 60.0
_KEY = "shardwise/every_rank_error"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_installed = False


def install() -> None:
    """Set the hook on top of the current ``sys.excepthook`` (once per process)."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind, error, tb):
        if not (isinstance(error, ShardwiseError) and getattr(error, "every_rank", False)
                and dist.is_initialized() and dist.get_world_size() > 1):
            previous(kind, error, tb)
            return
        try:
            report(error, tb)
        except Exception:  # noqa: BLE001 - a broken report must not hide the error itself
            previous(kind, error, tb)

    sys.excepthook = hook
    _installed = True


def _where(tb) -> str:
    """The innermost frame outside the shardwise package: the user's call."""
    frames = [f for f in traceback.extract_tb(tb) if not os.path.abspath(f.filename).startswith(_PACKAGE)]
    if not frames:
        return ""
    f = frames[-1]
    return f"  at {f.filename}, line {f.lineno}: {(f.line or '').strip()}"


def report(error: ShardwiseError, tb) -> None:
    """Print ``error`` once for the whole world (see the module's docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    message = f"{type(error).__name__}: {error}"
    lines = [message, f"  (from a check all {world} ranks run alike, before any collective: "
                      "reported once, by rank 0)", _where(tb)]
    text = "\n".join(line for line in lines if line)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        _error_file(message, text)
        store.set(_KEY, message)
        # a launcher stops the other ranks once rank 0 exits: first let each one decide (and
        # print its own report if its error differs)
        _rank0_said(store, key=_KEY + "/all read")
        return
    same = _rank0_said(store) == message
    if same:
        _error_file(message, f"the same {type(error).__name__} as rank 0 (reported there)")
    else:
        sys.stderr.write("\n".join(f"[rank{rank}]: {line}" for line in [message, _where(tb)] if line)
                         + "\n")
        sys.stderr.flush()
        _error_file(message, message)
    try:
        if store.add(_KEY + "/read", 1) == world - 1:
            store.set(_KEY + "/all read", "1")
    except Exception:  # noqa: BLE001 - rank 0 then waits its bounded time
        pass
    if same and os.environ.get("TORCHELASTIC_RUN_ID"):
        # torchrun stops this rank once rank 0 has exited: rank 0 is then the first failure
        # of its summary, with its exit status, not a rank stopped before it finished
        _rank0_said(store, key=_KEY + "/never set")


def _rank0_said(store, key: str = _KEY) -> str | None:
    try:
        store.wait([key], timedelta(seconds=WAIT_SECONDS))
        return store.get(key).decode()
    except Exception:  # noqa: BLE001 - no word from rank 0: this rank reports for itself
        return None


def _error_file(message: str, shown: str) -> None:
    # torchrun's summary shows ``py_callstack`` of each failed rank; its first failure is the
    # earliest timestamp, rank 0's (the others write theirs after reading rank 0's message)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # torchrun then shows its own line; the report above is on stderr already


__all__ = ["WAIT_SECONDS", "install", "report"]
