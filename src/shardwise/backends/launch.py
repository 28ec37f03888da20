"""The job around a backend's process group: the launcher's environment each rank starts from,
and the meeting of every rank before the group is torn down."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from shardwise.errors import BackendError

_meetings = 0  # shutdowns of this process: every rank counts alike


def torchrun_env() -> dict[str, int] | None:
    """``{"rank", "world_size", "local_rank"}`` from the torchrun environment, or None outside a
    launcher; an incomplete or malformed one raises ``BackendError``.

    >>> torchrun_env() is None or "rank" in torchrun_env()
    True
    """
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise BackendError(
            f"incomplete launcher environment: {', '.join(missing)} not set; launch with "
            "`torchrun --nproc-per-node N script.py` or unset RANK/WORLD_SIZE for one process"
        )
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError as e:
        raise BackendError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers: {e}") from e
    if not 0 <= rank < world:
        raise BackendError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return {"rank": rank, "world_size": world, "local_rank": local_rank}


def meet(world_size: int, seconds: float) -> None:
    """Wait for every rank of the world through the default group's store, sleeping between
    polls, not with a collective. A gloo ``barrier`` holds the works its worker threads still
    hold (the all_gather of ``comm.agree`` that ends a load, save or ``plan.run()``); a worker
    could then free them, and their Python tensors, once the interpreter is finalising: it
    takes the GIL, Python ends the thread, and the process aborts after the job is done
    ("terminate called without an active exception", pytorch#190489, #179291). Each sleep lets
    such a worker take the GIL now (``store.wait`` would hold it throughout). Raises
    ``TimeoutError`` when the others are not there within ``seconds``."""
    global _meetings
    _meetings += 1
    key = f"shardwise/shutdown/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_meetings}"
    store = dist.distributed_c10d._get_default_store()
    deadline, pause = time.monotonic() + seconds, 0.002
    arrived = store.add(key, 1)
    while arrived < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{arrived} of {world_size} ranks reached shutdown")
        time.sleep(pause)  # the GIL released; the polls back off: a big job's store is not flooded
        pause = min(2 * pause, 0.05)
        arrived = store.add(key, 0)
    time.sleep(0.002)


__all__ = ["meet", "torchrun_env"]
